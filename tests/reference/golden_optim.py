"""Golden data for tandem::optim::SGD and AdamW: parameter trajectories over 20 steps with two
param groups, from torch.optim's single-tensor (for-loop) implementation on the CPU.

The model is four parameters registered as layer2.weight (5, 7), layer2.bias (5),
layer3.weight (3, 5), layer3.bias (3): group 0 is layer2, group 1 is layer3. The initial values
and the scripted gradients (independent of the parameters, so every configuration replays the
same ones) are recorded too, so the C++ side reads exactly what PyTorch started from.

Keys:
  model/shapes                 rank and extents of each parameter, flattened
  model/init                   initial values, all parameters concatenated (float32)
  model/grads                  20 gradients (step-major), all parameters concatenated
  <opt>/<case>/options         per group: the hyperparameters (see CASES for the order)
  <opt>/<case>/params          the parameters after each of the 20 steps (step-major)
  <opt>/<case>/state/<i>/<key> parameter i's final state, as optimizer.state_dict() has it
                               (momentum_buffer when not None; step, exp_avg, exp_avg_sq,
                               max_exp_avg_sq)
"""
import math

import torch

STEPS = 20
SHAPES = [("layer2.weight", (5, 7)), ("layer2.bias", (5,)), ("layer3.weight", (3, 5)),
          ("layer3.bias", (3,))]
GROUPS = [[0, 1], [2, 3]]

# SGD options per group: lr, momentum, dampening, weight_decay, nesterov, maximize.
SGD_CASES = {
    "plain": [dict(lr=0.1), dict(lr=0.2)],
    "momentum": [dict(lr=0.1, momentum=0.9), dict(lr=0.2, momentum=0.9)],
    "dampening": [dict(lr=0.1, momentum=0.9, dampening=0.25),
                  dict(lr=0.2, momentum=0.9, dampening=0.5)],
    "nesterov": [dict(lr=0.1, momentum=0.9, nesterov=True),
                 dict(lr=0.2, momentum=0.9, nesterov=True)],
    "weight_decay": [dict(lr=0.1, momentum=0.9, weight_decay=1e-2),
                     dict(lr=0.2, weight_decay=5e-2)],
    "maximize": [dict(lr=0.1, momentum=0.9, weight_decay=1e-3, maximize=True),
                 dict(lr=0.2, maximize=True)],
    "mixed": [dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4),
              dict(lr=0.2, momentum=0.5, dampening=0.3, weight_decay=5e-3)],
}
SGD_KEYS = ["lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize"]
SGD_DEFAULTS = dict(lr=0.1, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False,
                    maximize=False)

# AdamW options per group: lr, beta1, beta2, eps, weight_decay, amsgrad, maximize.
ADAMW_CASES = {
    "default": [dict(lr=0.01), dict(lr=0.02)],
    "amsgrad": [dict(lr=0.01, amsgrad=True), dict(lr=0.02, amsgrad=True)],
    "mixed": [dict(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
              dict(lr=0.02, amsgrad=True, maximize=True, weight_decay=0.0)],
    "torch_defaults": [dict(), dict()],
}
ADAMW_KEYS = ["lr", "beta1", "beta2", "eps", "weight_decay", "amsgrad", "maximize"]
ADAMW_DEFAULTS = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                      maximize=False)


def initial_values():
    values = []
    for k, (_, shape) in enumerate(SHAPES):
        n = math.prod(shape)
        values.append(torch.tensor([math.sin(0.37 * i + 1.1 * k) * (0.5 + 0.1 * k)
                                    for i in range(n)], dtype=torch.float32).reshape(shape))
    return values


def scripted_grads():
    """Gradients that vary in sign and size, some shrinking over time (so amsgrad's maximum
    differs from exp_avg_sq), and a few exact zeros."""
    steps = []
    for t in range(STEPS):
        grads = []
        for k, (_, shape) in enumerate(SHAPES):
            n = math.prod(shape)
            g = []
            for i in range(n):
                if (i + t) % 11 == 0:
                    g.append(0.0)
                    continue
                scale = 1.0 / (1 + t) if i % 3 == 0 else 1.0 + 0.05 * t
                g.append(math.cos(1.3 * i - 0.7 * t + k) * scale * (10.0 if i % 5 == 1 else 1.0))
            grads.append(torch.tensor(g, dtype=torch.float32).reshape(shape))
        steps.append(grads)
    return steps


def run(optimizer_class, groups_options, init, grads):
    params = [torch.nn.Parameter(v.clone()) for v in init]
    groups = [dict(params=[params[i] for i in members], **options)
              for members, options in zip(GROUPS, groups_options)]
    optimizer = optimizer_class(groups, foreach=False)
    trajectory = []
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        optimizer.step()
        trajectory.append([p.detach().clone() for p in params])
    state = {}
    for i, p in enumerate(params):  # the groups list the parameters in registration order
        for key, value in optimizer.state[p].items():
            if value is not None:
                state[f"state/{i}/{key}"] = value
    return trajectory, state, optimizer


def generate(writer):
    writer.comment("SGD and AdamW trajectories, torch.optim single-tensor (foreach=False), CPU, "
                   "float32. See golden_optim.py for the model, gradients and cases.")
    torch.set_default_dtype(torch.float32)
    init = initial_values()
    grads = scripted_grads()
    writer.record("model/shapes", [[len(s)] + list(s) for _, s in SHAPES])
    writer.record("model/init", init)
    writer.record("model/grads", grads)

    for case, options in SGD_CASES.items():
        lr = options[0]["lr"]
        trajectory, state, _ = run(lambda g, **kw: torch.optim.SGD(g, lr=lr, **kw), options, init,
                                   grads)
        writer.record(f"sgd/{case}/options",
                      [[float({**SGD_DEFAULTS, **o}[k]) for k in SGD_KEYS] for o in options])
        writer.record(f"sgd/{case}/params", trajectory)
        for key, values in state.items():
            writer.record(f"sgd/{case}/{key}", values)

    for case, options in ADAMW_CASES.items():
        trajectory, state, _ = run(torch.optim.AdamW, options, init, grads)
        rows = []
        for o in options:
            full = {**ADAMW_DEFAULTS, **o}
            full["beta1"], full["beta2"] = full["betas"]
            rows.append([float(full[k]) for k in ADAMW_KEYS])
        writer.record(f"adamw/{case}/options", rows)
        writer.record(f"adamw/{case}/params", trajectory)
        for key, values in state.items():
            writer.record(f"adamw/{case}/{key}", values)
