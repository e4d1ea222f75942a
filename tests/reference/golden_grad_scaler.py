"""GradScaler golden data: what torch's GradScaler does to a scripted series of scaled gradients,
finite and not, for one and two optimizers.

Debian's torch 1.13 (CPU only) cannot run torch.cuda.amp.GradScaler: it disables itself without
CUDA, and torch._amp_update_scale_ and torch._amp_foreach_non_finite_check_and_unscale_ have no
CPU kernels in 1.13. So this module replays GradScaler's Python logic (torch/cuda/amp/
grad_scaler.py: unscale_, step, update; the per-optimizer READY/UNSCALED/STEPPED stages) and the
two kernels with torch ops on float32 tensors, exactly as their CUDA (1.13) and CPU (2.x)
implementations compute:

  unscale:  inv_scale = float32(1 / float64(scale));  found_inf = 1 if any grad (BEFORE the
            multiply) is inf or NaN;  grad = grad if inv_scale == 1 else float32(grad * inv_scale)
  update:   found_inf (summed over optimizers) != 0: scale = float32(float64(scale) * backoff),
            tracker = 0;  else tracker + 1 == growth_interval: grown = float32(scale * growth);
            scale = grown if finite; tracker = 0;  else tracker += 1

Keys (CASE a scenario, s the iteration from 0, o the optimizer):
  CASE/config             init_scale, growth_factor, backoff_factor, growth_interval, steps,
                          optimizers
  CASE/s<s>/o<o>/grads    the scaled gradients backward produced (inputs; may hold inf/NaN)
  CASE/s<s>/o<o>/unscaled the gradients after unscale_ (NaN stays NaN, inf stays inf)
  CASE/s<s>/o<o>/found_inf  0 or 1
  CASE/s<s>/o<o>/stepped  1 when the optimizer stepped, 0 when skipped
  CASE/s<s>/scale         the scale used in iteration s (before update)
  CASE/s<s>/scale_after, CASE/s<s>/tracker_after   after update()
  CASE/state_dict         scale, growth_factor, backoff_factor, growth_interval, _growth_tracker
"""
import torch

SIZE = 7


class ReplayedScaler:
    """torch's GradScaler, its two kernels written with CPU torch ops."""

    def __init__(self, init_scale, growth_factor, backoff_factor, growth_interval):
        assert growth_factor > 1.0 and backoff_factor < 1.0
        self.scale = torch.full((1,), init_scale, dtype=torch.float32)
        self.tracker = torch.full((1,), 0, dtype=torch.int32)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval

    def unscale(self, grads):
        inv_scale = self.scale.double().reciprocal().float()
        found_inf = (~torch.isfinite(grads)).any().float()
        if inv_scale.item() != 1.0:
            grads = grads * inv_scale  # float32 * float32 tensor: one float32 multiply
        return grads, found_inf

    def update(self, found_infs):
        found_inf = found_infs[0].clone()
        for extra in found_infs[1:]:
            found_inf += extra
        scale = float(self.scale.item())  # a float32 value, exact as a Python float
        if found_inf.item():
            self.scale.fill_(scale * self.backoff_factor)  # float64 product rounded to float32
            self.tracker.fill_(0)
        else:
            successful = int(self.tracker.item()) + 1
            if successful == self.growth_interval:
                grown = torch.tensor(scale * self.growth_factor, dtype=torch.float32)
                if torch.isfinite(grown):
                    self.scale.copy_(grown.reshape(1))
                self.tracker.fill_(0)
            else:
                self.tracker.fill_(successful)

    def state_dict(self):
        return [self.scale.item(), self.growth_factor, self.backoff_factor,
                self.growth_interval, self.tracker.item()]


def run_case(writer, case, config, bad, optimizers=1, seed=0):
    """bad maps (step, optimizer) to a list of (index, value) to poison in the scaled grads."""
    init_scale, growth_factor, backoff_factor, growth_interval, steps = config
    writer.record(f"{case}/config", [init_scale, growth_factor, backoff_factor, growth_interval,
                                     steps, optimizers])
    scaler = ReplayedScaler(init_scale, growth_factor, backoff_factor, growth_interval)
    generator = torch.Generator().manual_seed(seed)
    for step in range(steps):
        writer.record(f"{case}/s{step}/scale", scaler.scale)
        found_infs = []
        for o in range(optimizers):
            true_grads = torch.randn(SIZE, generator=generator, dtype=torch.float32)
            scaled = true_grads * scaler.scale  # what backward(scale * loss) gives
            for index, value in bad.get((step, o), []):
                scaled[index] = value
            unscaled, found_inf = scaler.unscale(scaled.clone())
            writer.record(f"{case}/s{step}/o{o}/grads", scaled)
            writer.record(f"{case}/s{step}/o{o}/unscaled", unscaled)
            writer.record(f"{case}/s{step}/o{o}/found_inf", found_inf)
            writer.record(f"{case}/s{step}/o{o}/stepped", 0.0 if found_inf.item() else 1.0)
            found_infs.append(found_inf)
        scaler.update(found_infs)
        writer.record(f"{case}/s{step}/scale_after", scaler.scale)
        writer.record(f"{case}/s{step}/tracker_after", scaler.tracker.double())
    writer.record(f"{case}/state_dict", scaler.state_dict())


def generate(writer):
    inf, nan = float("inf"), float("nan")
    writer.comment("GradScaler replayed with torch ops (torch 1.13 has no CPU GradScaler); "
                   "see golden_grad_scaler.py")
    # PyTorch's defaults: the scale only backs off in a short run.
    run_case(writer, "defaults", (65536.0, 2.0, 0.5, 2000, 6),
             {(1, 0): [(2, inf)], (3, 0): [(0, nan)], (4, 0): [(6, -inf), (1, nan)]})
    # A short growth interval: growth, then backoff resets the tracker, then growth again.
    run_case(writer, "growth", (4.0, 2.0, 0.5, 3, 12), {(4, 0): [(5, inf)]}, seed=1)
    # Growth never reaches inf: 2^127 * 2 overflows float32 and the scale stays.
    run_case(writer, "overflow", (2.0 ** 126, 2.0, 0.5, 1, 4), {}, seed=2)
    # Factors that are not powers of two: the float64 product rounded to float32, and an
    # inverse scale that is not exact.
    run_case(writer, "odd_factors", (1000.0, 3.0, 0.3, 2, 10),
             {(2, 0): [(0, inf)], (6, 0): [(3, nan)]}, seed=3)
    # Two optimizers: each skips on its own flag; update() backs off when either saw inf.
    run_case(writer, "two_optimizers", (256.0, 2.0, 0.5, 2, 6),
             {(1, 1): [(4, inf)], (3, 0): [(2, nan)]}, optimizers=2, seed=4)
