"""EMA golden data: timm's ModelEmaV3 (warm-up decay, update_after_step, buffers averaged or
copied) over a small model whose weights move each step.

timm is not installed, so this module implements ModelEmaV3's two pieces with torch ops:

  get_decay(step): s = max(0, step - update_after_step - 1); 0 when s <= 0; else with warm-up
                   1 - (1 + s / warmup_gamma) ** -warmup_power clamped to [min_decay, decay],
                   without it decay
  update(step):    for every floating tensor of the state_dict (parameters and buffers; only the
                   parameters with exclude_buffers): ema.lerp_(model, weight=1. - decay); other
                   tensors (num_batches_tracked, int64) and, with exclude_buffers, every buffer
                   copied

torch._foreach_lerp_ (what timm calls) does not exist in torch 1.13; Tensor.lerp_ with a Python
float weight is the same per-element arithmetic (ATen's lerp: start + w * (end - start) for
|w| < 0.5, else end - (end - start) * (1 - w), each a fused multiply-add in the vectorised CPU
kernel).

The model: fc.weight [3, 4], fc.bias [3] (trained); buffers bn.running_mean [3],
bn.running_var [3] (float) and bn.num_batches_tracked (int64; tandem keeps it as an integral
float buffer). Each step the live weights move by 0.1 * randn and the counter grows by one; the
EMA is updated with step = the update count (timm's train loop: num_updates += 1, then
update(model, step=num_updates)).

Keys (CASE a configuration, s the update from 1):
  CASE/config        decay, min_decay, update_after_step, use_warmup, warmup_gamma,
                     warmup_power, exclude_buffers, steps
  CASE/initial/values, CASE/initial/buffers   the model at EMA construction (the first shadow)
  CASE/s<s>/values, CASE/s<s>/buffers         the live model used by update s
  CASE/s<s>/decay                             get_decay(s)
  CASE/s<s>/shadow_values, CASE/s<s>/shadow_buffers   the EMA after update s
Values are flattened in registration order: fc.weight, fc.bias; buffers running_mean,
running_var, num_batches_tracked.
"""
import torch


def get_decay(config, step):
    decay, min_decay, update_after_step, use_warmup, gamma, power = config[:6]
    step = max(0, step - update_after_step - 1)
    if step <= 0:
        return 0.0
    if use_warmup:
        value = 1 - (1 + step / gamma) ** -power
        return max(min(value, decay), min_decay)
    return decay


def make_model(generator):
    params = {"fc.weight": torch.randn(3, 4, generator=generator),
              "fc.bias": torch.randn(3, generator=generator)}
    buffers = {"bn.running_mean": torch.randn(3, generator=generator),
               "bn.running_var": torch.rand(3, generator=generator) + 0.5,
               "bn.num_batches_tracked": torch.tensor(0, dtype=torch.int64)}
    return params, buffers


def flat(tensors):
    return torch.cat([t.reshape(-1).double() for t in tensors.values()])


def run_case(writer, case, config, steps, seed):
    decay, min_decay, update_after_step, use_warmup, gamma, power, exclude_buffers = config
    writer.record(f"{case}/config", [decay, min_decay, update_after_step, float(use_warmup),
                                     gamma, power, float(exclude_buffers), steps])
    generator = torch.Generator().manual_seed(seed)
    params, buffers = make_model(generator)
    ema_params = {k: v.clone() for k, v in params.items()}
    ema_buffers = {k: v.clone() for k, v in buffers.items()}
    writer.record(f"{case}/initial/values", flat(params))
    writer.record(f"{case}/initial/buffers", flat(buffers))
    for step in range(1, steps + 1):
        with torch.no_grad():
            for value in params.values():
                value.add_(torch.randn(value.shape, generator=generator), alpha=0.1)
            buffers["bn.running_mean"].add_(torch.randn(3, generator=generator), alpha=0.1)
            buffers["bn.running_var"].mul_(1.0 + 0.1 * torch.rand(3, generator=generator))
            buffers["bn.num_batches_tracked"] += 1
        d = get_decay(config, step)
        weight = 1.0 - d
        for name, ema_v in ema_params.items():
            ema_v.lerp_(params[name], weight)
        for name, ema_v in ema_buffers.items():
            if ema_v.is_floating_point() and not exclude_buffers:
                ema_v.lerp_(buffers[name], weight)
            else:
                ema_v.copy_(buffers[name])
        writer.record(f"{case}/s{step}/values", flat(params))
        writer.record(f"{case}/s{step}/buffers", flat(buffers))
        writer.record(f"{case}/s{step}/decay", d)
        writer.record(f"{case}/s{step}/shadow_values", flat(ema_params))
        writer.record(f"{case}/s{step}/shadow_buffers", flat(ema_buffers))


def generate(writer):
    writer.comment("timm ModelEmaV3 replayed with torch ops (timm is not installed); "
                   "see golden_ema.py")
    # (decay, min_decay, update_after_step, use_warmup, warmup_gamma, warmup_power,
    #  exclude_buffers)
    run_case(writer, "plain", (0.9, 0.0, 0, False, 1.0, 2.0 / 3.0, False), 12, seed=0)
    run_case(writer, "warmup", (0.9999, 0.0, 0, True, 1.0, 2.0 / 3.0, False), 25, seed=1)
    # Warm-up after a delay, clamped below by min_decay (weights < 0.5 and >= 0.5 both occur).
    run_case(writer, "delayed_warmup", (0.95, 0.3, 3, True, 2.0, 0.75, False), 20, seed=2)
    run_case(writer, "exclude_buffers", (0.8, 0.0, 0, False, 1.0, 2.0 / 3.0, True), 8, seed=3)
