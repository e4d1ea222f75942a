#!/usr/bin/env python3
"""PyTorch peer of bench_step_cuda: the same non-model part of an AdamW training step on one GPU,
the way PyTorch users write it fast - torch.optim.AdamW(fused=True) driven by
torch.amp.GradScaler (the fused kernel unscales and checks for inf itself), the EMA as
torch._foreach_lerp_ (timm's ModelEmaV3), and the fp32 -> half cast of the weights - timed with
CUDA events, median of --repeats. Exits 77 without a GPU. The gradients are restored before each
step (that copy is timed alone and subtracted), and the run fails when a step was skipped, the
scale moved or the parameters did not change.

    python3 bench/step/step_torch.py [--params N] [--repeats R] [--tensors K]

--tensors splits the parameters into K equal tensors (1 = one flat tensor like tandem's arena;
GPT-2 small has 148). Prints a Markdown row and RESULT lines like bench_step_cuda.
"""
import argparse
import sys


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", type=float, default=124e6)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--tensors", type=int, default=1)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("SKIPPED: no CUDA device (step_torch.py needs a GPU)")
        return 77
    n = int(args.params)
    sizes = [n // args.tensors] * args.tensors
    sizes[-1] += n - sum(sizes)
    device = torch.device("cuda")
    index = torch.arange(n, device=device)
    values = ((index % 2001) - 1000).float() * 1e-3
    grads = ((index % 997) - 498).float() * 1e-3
    params = [torch.nn.Parameter(chunk.clone()) for chunk in values.split(sizes)]
    originals = list(grads.split(sizes))
    grad_chunks = [g.clone() for g in originals]
    optimizer = torch.optim.AdamW(params, lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cuda")
    ema = [p.detach().clone() for p in params]
    halves = [torch.empty_like(p, dtype=torch.half) for p in params]
    loss = torch.ones((), device=device)

    def restore():
        torch._foreach_copy_(grad_chunks, originals)

    calls = {"n": 0, "stepped": 0}

    def step():
        restore()  # the same gradients every step, as in bench_step_cuda
        for p, g in zip(params, grad_chunks):
            p.grad = g
        scaler.scale(loss)
        scaler.step(optimizer)
        scaler.update()
        calls["n"] += 1
        torch._foreach_lerp_(ema, [p.detach() for p in params], 1.0 - 0.999)
        torch._foreach_copy_(halves, [p.detach() for p in params])

    def copy():
        grads_copy.copy_(grads)

    grads_copy = torch.empty_like(grads)
    before = torch.cat([p.detach().flatten() for p in params])
    results = {}
    for name, body in (("device-to-device copy (reference)", copy),
                       ("gradient restore (copy, timed alone)", restore),
                       ("AdamW training step (GradScaler step + update, EMA, cast)", step)):
        body()
        torch.cuda.synchronize()
        times = []
        for _ in range(args.repeats):
            start = torch.cuda.Event(enable_timing=True)
            stop = torch.cuda.Event(enable_timing=True)
            start.record()
            body()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) / 1e3)
        times.sort()
        results[name] = times[len(times) // 2]
    # The work must have happened (as bench_step_cuda checks): every step ran, no inf was found,
    # the scale never backed off, and the parameters changed.
    after = torch.cat([p.detach().flatten() for p in params])
    steps = int(optimizer.state[params[0]]["step"].item())
    changed = int((after != before).sum().item())
    print(f"CHECK training step: {calls['n']} calls, AdamW steps {steps}, scale "
          f"{scaler.get_scale():g}, {changed} of {n} parameters changed")
    failures = []
    if steps != calls["n"]:
        failures.append(f"AdamW took {steps} steps for {calls['n']} calls (skipped steps)")
    if scaler.get_scale() != 65536.0:
        failures.append(f"the scale moved from 65536 to {scaler.get_scale()}")
    if changed < n // 2:
        failures.append(f"only {changed} of {n} parameters changed")
    if not torch.isfinite(after).all():
        failures.append("parameters are inf/NaN")
    if failures:
        for failure in failures:
            print(f"step_torch.py: {failure}", file=sys.stderr)
        print("step_torch.py: the timed work did not happen; no results", file=sys.stderr)
        return 1
    step_name = "AdamW training step (GradScaler step + update, EMA, cast)"
    results[step_name] -= results["gradient restore (copy, timed alone)"]
    copy_bw = 8 * n / results["device-to-device copy (reference)"] / 1e9
    for name, seconds in results.items():
        bytes_per = 54 if name == step_name else 8
        bw = bytes_per * n / seconds / 1e9
        print(f"| torch {torch.__version__}: {name} | {bytes_per} | {seconds * 1e3:.3f} | "
              f"{bw:.1f} | {100 * bw / copy_bw:.0f} % |")
    for name, seconds in results.items():
        print(f'RESULT impl=torch pass="{name}" params={n} tensors={args.tensors} '
              f"seconds={seconds:.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
