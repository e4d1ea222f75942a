"""Golden data for tandem::lr schedules: the learning rates torch.optim.lr_scheduler sets, with
PyTorch's step conventions (construction is epoch 0 and sets the first lr; then one
optimizer.step() and one scheduler.step() per epoch).

Every schedule drives an SGD with two param groups at lr 0.1 and 0.2. A record holds the lrs
of epochs 0..E, epoch-major, two groups per epoch: `lr/<case>`.
"""
import math

import torch

BASE_LRS = (0.1, 0.2)


def warmup_cosine_lr(s, warmup, total, lr_max, lr_min):
    """tandem::lr::WarmupCosine::lr, operation for operation."""
    if s < warmup:
        return lr_max * (s + 1) / warmup
    if s > total:
        return lr_min
    progress = 1.0 if total == warmup else (s - warmup) / (total - warmup)
    return lr_min + (lr_max - lr_min) * (1 + math.cos(math.pi * progress)) / 2


def linear_scaling_factor(s, world_size, warmup):
    """tandem::lr::linear_scaling's factor."""
    k = float(world_size)
    if warmup == 0 or s >= warmup:
        return k
    return 1 + (k - 1) * s / warmup


S = torch.optim.lr_scheduler
CASES = {
    # name: (epochs, make scheduler)
    "lambda_shared": (25, lambda o: S.LambdaLR(o, lambda e: 0.95 ** e)),
    "lambda_per_group": (25, lambda o: S.LambdaLR(o, [lambda e: 1.0 / (1 + e),
                                                      lambda e: 0.5 + 0.1 * (e % 4)])),
    "step": (30, lambda o: S.StepLR(o, step_size=7, gamma=0.5)),
    "step_default_gamma": (12, lambda o: S.StepLR(o, step_size=3)),
    "multi_step": (30, lambda o: S.MultiStepLR(o, milestones=[3, 8, 8, 15], gamma=0.3)),
    "linear_warmup": (12, lambda o: S.LinearLR(o, start_factor=0.25, end_factor=1.0,
                                               total_iters=6)),
    "linear_decay": (15, lambda o: S.LinearLR(o, start_factor=1.0, end_factor=0.1,
                                              total_iters=10)),
    "linear_default": (8, lambda o: S.LinearLR(o)),
    "cosine": (35, lambda o: S.CosineAnnealingLR(o, T_max=10, eta_min=0.001)),
    "cosine_zero_min": (20, lambda o: S.CosineAnnealingLR(o, T_max=7)),
    "warmup_cosine": (25, lambda o: S.LambdaLR(
        o, lambda s: warmup_cosine_lr(s, 5, 20, 0.1, 0.01) / 0.1)),
    "linear_scaling": (9, lambda o: S.LambdaLR(o, lambda s: linear_scaling_factor(s, 4, 5))),
}


def sequence(epochs, make):
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in BASE_LRS]
    optimizer = torch.optim.SGD([dict(params=[p], lr=lr) for p, lr in zip(params, BASE_LRS)],
                                lr=BASE_LRS[0])
    scheduler = make(optimizer)
    lrs = [[g["lr"] for g in optimizer.param_groups]]
    for _ in range(epochs):
        optimizer.step()
        scheduler.step()
        lrs.append([g["lr"] for g in optimizer.param_groups])
    return lrs


def generate(writer):
    writer.comment("LR schedules over SGD with groups at lr 0.1 and 0.2; epochs 0..E, "
                   "epoch-major. See golden_lr.py.")
    for name, (epochs, make) in CASES.items():
        writer.record(f"lr/{name}", sequence(epochs, make))
    # CosineAnnealingLR's closed form, for the test that shows step() follows the recursive form.
    closed = []
    for e in range(36):
        closed.append([0.001 + (base - 0.001) * (1 + math.cos(math.pi * e / 10)) / 2
                       for base in BASE_LRS])
    writer.record("lr/cosine_closed_form", closed)
