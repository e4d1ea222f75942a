#!/usr/bin/env python3
"""bench/zero/zero_torch.py - zero_bench's PyTorch peer: DistributedDataParallel with AdamW, the
optimizer plain (--zero 0) or torch.distributed.optim.ZeroRedundancyOptimizer (--zero 1), gloo,
N processes of this host (torch.multiprocessing.spawn, one thread each).
  /usr/bin/python3 bench/zero/zero_torch.py --ranks N --zero 0|1 [--params P] [--steps S]
      [--warmup W] [--bucket-mib 25]
The same model and step as zero_bench: P float parameters in 12 tensors; the backward writes
g = 1e-3 * w + c (c by rank and step) through a custom autograd Function (one element-wise pass,
no forward work), DDP reduces it in 25 MiB buckets, the optimizer steps (ZeroRedundancyOptimizer:
its shard, then the broadcast of the parameters), zero_grad(set_to_none=False). A step's time is
the slowest rank's, the median over the timed steps; VmRSS and VmHWM from /proc/self/status at
the end, the largest over the processes; the optimizer state this rank holds (its tensors' bytes).
Fails (exit 1, no RESULT line) unless every rank took W + S steps, the parameters moved and all
ranks hold the same parameters. Prints one RESULT line like zero_bench's."""
import argparse
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

TENSORS = 12
MIB = 1024.0 * 1024.0


class SyntheticGrad(torch.autograd.Function):
    """Forward: nothing (a zero loss); backward: the parameter's gradient 1e-3 * w + c."""

    @staticmethod
    def forward(ctx, weight, c):
        ctx.save_for_backward(weight)
        ctx.c = c
        return weight.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        (weight,) = ctx.saved_tensors
        grad = torch.mul(weight, 1e-3)
        grad.add_(ctx.c)
        return grad, None


class Model(torch.nn.Module):
    def __init__(self, total):
        super().__init__()
        each = total // TENSORS
        sizes = [each] * (TENSORS - 1) + [total - each * (TENSORS - 1)]
        start = 0
        weights = []
        for n in sizes:
            values = (torch.arange(start, start + n, dtype=torch.float64) % 1000) * 1e-3 - 0.5
            weights.append(torch.nn.Parameter(values.float()))
            start += n
        self.weights = torch.nn.ParameterList(weights)

    def forward(self, c):
        loss = None
        for w in self.weights:
            term = SyntheticGrad.apply(w, c)
            loss = term if loss is None else loss + term
        return loss


def checksum(model):
    total = 0.0
    for w in model.weights:
        index = torch.arange(w.numel(), dtype=torch.float64)
        total += float((w.detach().double() * (1 + index % 7)).sum())
    return total


def resident():
    rss = hwm = 0.0
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                rss = float(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                hwm = float(line.split()[1]) * 1024
    return rss, hwm


def reduced(values, op):
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return t.tolist()


def worker(rank, args, port, failed):
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.ranks)
    model = Model(args.params)
    initial = checksum(model)
    ddp = DDP(model, bucket_cap_mb=args.bucket_mib)
    if args.zero:
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW,
                                      lr=1e-3, weight_decay=0.01)
    else:
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3, weight_decay=0.01)
    times = []
    for s in range(args.warmup + args.steps):
        c = 1e-4 * (1 + rank + s % 5)
        dist.barrier()
        start = time.perf_counter()
        loss = ddp(c)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        if s >= args.warmup:
            times.append(time.perf_counter() - start)
    rss, hwm = resident()  # before checksum()'s float64 temporaries
    times = sorted(reduced(times, dist.ReduceOp.MAX))
    median = times[len(times) // 2]

    inner = opt.optim if args.zero else opt
    steps = [float(st["step"]) for st in inner.state.values() if "step" in st]
    state_bytes = sum(t.numel() * t.element_size() for st in inner.state.values()
                      for t in st.values() if torch.is_tensor(t) and t.dim() > 0)
    final = checksum(model)
    mine_steps = min(steps) if steps else 0.0
    low = reduced([final, mine_steps], dist.ReduceOp.MIN)
    high = reduced([final, max(steps) if steps else 0.0], dist.ReduceOp.MAX)
    expected = args.warmup + args.steps
    moved = abs(final - initial) > 1e-6 * max(1.0, abs(initial))
    ok = moved and low[0] == high[0] and low[1] == expected and high[1] == expected
    state, rss, hwm = reduced([state_bytes, rss, hwm], dist.ReduceOp.MAX)
    if rank == 0:
        if ok:
            name = "ZeroRedundancyOptimizer" if args.zero else "DDP"
            print(f"RESULT impl=torch backend=gloo ranks={args.ranks} stage={args.zero} "
                  f"optimizer={name} params={args.params} steps={args.steps} "
                  f"step_ms={median * 1e3:.3f} state_mib_per_rank={state / MIB:.2f} "
                  f"rss_mib_per_rank={rss / MIB:.1f} hwm_mib_per_rank={hwm / MIB:.1f} "
                  f"per_rank=max-over-processes torch={torch.__version__}", flush=True)
        else:
            print(f"zero_torch: FAILED, the work did not happen: moved {moved}, equal "
                  f"{low[0] == high[0]}, steps {low[1]}..{high[1]} of {expected}",
                  file=sys.stderr, flush=True)
    if not ok:
        failed.value = 1
    dist.barrier()
    # Leave without tearing down: torch 1.13's ~ProcessGroupGloo (reached from the DDP Reducer's
    # destructor) joins a gloo thread that waits for the GIL its caller holds, and now and then
    # hangs there. Every collective is done (the barrier), so nothing is lost.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--zero", type=int, choices=[0, 1], default=1)
    parser.add_argument("--params", type=float, default=124e6)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--bucket-mib", type=int, default=25)
    args = parser.parse_args()
    args.params = int(args.params)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    failed = mp.get_context("spawn").Value("i", 0)
    mp.spawn(worker, args=(args, port, failed), nprocs=args.ranks, join=True)
    sys.exit(1 if failed.value else 0)


if __name__ == "__main__":
    main()
