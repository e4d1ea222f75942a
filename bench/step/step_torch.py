#!/usr/bin/env python3
"""PyTorch peer of bench_step_cuda: the same non-model part of an AdamW training step on one GPU,
the way PyTorch users write it fast - torch.optim.AdamW(fused=True) driven by
torch.amp.GradScaler (the fused kernel unscales and checks for inf itself), the EMA as
torch._foreach_lerp_ (timm's ModelEmaV3), and the fp32 -> half cast of the weights - timed with
CUDA events, median of --repeats. Exits 77 without a GPU.

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
    grad_chunks = list(grads.split(sizes))
    optimizer = torch.optim.AdamW(params, lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cuda")
    ema = [p.detach().clone() for p in params]
    halves = [torch.empty_like(p, dtype=torch.half) for p in params]
    loss = torch.ones((), device=device)

    def step():
        for p, g in zip(params, grad_chunks):
            p.grad = g  # the same gradients every step, as in bench_step_cuda
        scaler.scale(loss)
        scaler.step(optimizer)
        scaler.update()
        torch._foreach_lerp_(ema, [p.detach() for p in params], 1.0 - 0.999)
        torch._foreach_copy_(halves, [p.detach() for p in params])

    def copy():
        grads_copy.copy_(grads)

    grads_copy = torch.empty_like(grads)
    results = {}
    for name, body in (("device-to-device copy (reference)", copy),
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
    copy_bw = 8 * n / results["device-to-device copy (reference)"] / 1e9
    for name, seconds in results.items():
        bytes_per = 8 if name.startswith("device") else 54
        bw = bytes_per * n / seconds / 1e9
        print(f"| torch {torch.__version__}: {name} | {bytes_per} | {seconds * 1e3:.3f} | "
              f"{bw:.1f} | {100 * bw / copy_bw:.0f} % |")
    for name, seconds in results.items():
        print(f'RESULT impl=torch pass="{name}" params={n} tensors={args.tensors} '
              f"seconds={seconds:.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
