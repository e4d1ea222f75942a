#!/usr/bin/env python3
"""PyTorch CPU peer of bench_step's training-step rows: the non-model part of an AdamW step on
the host, the fastest way the installed PyTorch offers - torch.optim.AdamW(foreach=True), a
GradScaler's unscale and inf check, the EMA as a lerp, the fp32 -> half copy - from restored
gradients each step (the restore copy is timed alone and subtracted, as in bench_step), median of
--repeats. Fails (exit 1, no results) when a step was skipped or the parameters did not change.

    /usr/bin/python3 bench/step/step_torch_cpu.py [--params N] [--repeats R] [--threads T]

GradScaler: PyTorch 2.3 and newer run torch.amp.GradScaler("cpu") (one fused unscale + check
kernel, _amp_foreach_non_finite_check_and_unscale_). Older PyTorch (Debian's 1.13) has no CPU
GradScaler - it disables itself without CUDA - so the same two steps are written out: the
gradients multiplied by 1/scale (one read + write pass, as the kernel) and the check as
isfinite(sum) (one read pass; a sum overflowing would count as inf). EMA: torch._foreach_lerp_
where it exists, else Tensor.lerp_ per tensor (the same kernel). --threads sets
torch.set_num_threads (default: PyTorch's own, all cores).
"""
import argparse
import sys
import time


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", type=float, default=124e6)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tensors", type=int, default=1)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    import torch

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    n = int(args.params)
    sizes = [n // args.tensors] * args.tensors
    sizes[-1] += n - sum(sizes)
    index = torch.arange(n)
    values = ((index % 2001) - 1000).float() * 1e-3
    grads = ((index % 997) - 498).float() * 1e-3
    del index
    params = [torch.nn.Parameter(chunk.clone()) for chunk in values.split(sizes)]
    originals = list(grads.split(sizes))
    grad_chunks = [g.clone() for g in originals]
    for p, g in zip(params, grad_chunks):
        p.grad = g
    optimizer = torch.optim.AdamW(params, lr=1e-3, foreach=True)
    ema = [p.detach().clone() for p in params]
    halves = [torch.empty_like(p, dtype=torch.half) for p in params]
    loss = torch.ones(())

    native_scaler = None
    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if version >= (2, 3):
        native_scaler = torch.amp.GradScaler("cpu")
    scale = 65536.0
    found_any = {"inf": 0}

    def restore():
        for g, o in zip(grad_chunks, originals):
            g.copy_(o)

    calls = {"n": 0}

    def step():
        restore()
        if native_scaler is not None:
            native_scaler.scale(loss)
            native_scaler.step(optimizer)
            native_scaler.update()
        else:
            torch._foreach_mul_(grad_chunks, 1.0 / scale)
            finite = all(bool(torch.isfinite(g.sum())) for g in grad_chunks)
            if finite:
                optimizer.step()
            else:
                found_any["inf"] += 1
        live = [p.detach() for p in params]
        if hasattr(torch, "_foreach_lerp_"):
            torch._foreach_lerp_(ema, live, 1.0 - 0.999)
        else:
            for e, p in zip(ema, live):
                e.lerp_(p, 1.0 - 0.999)
        for h, p in zip(halves, live):
            h.copy_(p)
        calls["n"] += 1

    def copy():
        grads_copy.copy_(grads)

    grads_copy = torch.empty_like(grads)
    before = torch.cat([p.detach().flatten() for p in params])
    bodies = (("memcpy (reference)", copy),
              ("gradient restore (copy, timed alone)", restore),
              ("AdamW training step (GradScaler, AdamW foreach, EMA lerp, cast)", step))
    times = {name: [] for name, _ in bodies}
    # Rounds, every body once per round, as bench_step does; round 0 warms up.
    for round_ in range(args.repeats + 1):
        for name, body in bodies:
            start = time.perf_counter()
            body()
            seconds = time.perf_counter() - start
            if round_ > 0:
                times[name].append(seconds)
    results = {name: sorted(t)[len(t) // 2] for name, t in times.items()}

    after = torch.cat([p.detach().flatten() for p in params])
    steps = int(optimizer.state[params[0]]["step"])
    changed = int((after != before).sum())
    current_scale = native_scaler.get_scale() if native_scaler is not None else scale
    print(f"CHECK torch training step: {calls['n']} calls, AdamW steps {steps}, scale "
          f"{current_scale:g}, {changed} of {n} parameters changed, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, GradScaler "
          f"{'torch.amp (cpu)' if native_scaler is not None else 'written out (no CPU GradScaler)'}")
    failures = []
    if steps != calls["n"] or found_any["inf"]:
        failures.append(f"AdamW took {steps} steps for {calls['n']} calls (skipped steps)")
    if current_scale != 65536.0:
        failures.append(f"the scale moved from 65536 to {current_scale}")
    if changed < n // 2:
        failures.append(f"only {changed} of {n} parameters changed")
    if failures:
        for failure in failures:
            print(f"step_torch_cpu.py: {failure}", file=sys.stderr)
        print("step_torch_cpu.py: the timed work did not happen; no results", file=sys.stderr)
        return 1
    step_name = bodies[2][0]
    results[step_name] -= results["gradient restore (copy, timed alone)"]
    copy_bw = 8 * n / results["memcpy (reference)"] / 1e9
    for name, seconds in results.items():
        bytes_per = 54 if name == step_name else 8
        bw = bytes_per * n / seconds / 1e9
        print(f"| torch {torch.__version__} CPU: {name} | {bytes_per} | {seconds * 1e3:.1f} | "
              f"{bw:.2f} | {100 * bw / copy_bw:.0f} % |")
    for name, seconds in results.items():
        print(f'RESULT impl=torch-cpu pass="{name}" params={n} tensors={args.tensors} '
              f"threads={torch.get_num_threads()} seconds={seconds:.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
