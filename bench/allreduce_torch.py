# bench/allreduce_torch.py - one rank of torch.distributed's all_reduce (sum, float32, backend
# gloo), timed exactly as bench/allreduce_rank.cpp times tandem (see the method there).
#   RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29555 GLOO_SOCKET_IFNAME=lo \
#     /usr/bin/python3 bench/allreduce_torch.py [--runs 5] [--iters 21]   (and RANK=1 beside it)
# Needs: PyTorch with gloo (Debian's python3-torch; run with /usr/bin/python3).
#
# Rank 0 prints, per size:
#   RESULT torch-gloo <bytes> <ranks> <median_us> <spread> <fastest_run_us> <slowest_run_us>
#   RUNS torch-gloo <bytes> <run_median_us>...
import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist

SIZES = [4 << 10, 256 << 10, 4 << 20, 64 << 20]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--iters", type=int, default=21)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--sizes", type=str, default=",".join(str(s) for s in SIZES))
    args = parser.parse_args()

    dist.init_process_group(backend="gloo")  # env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, size = dist.get_rank(), dist.get_world_size()
    for nbytes in (int(s) for s in args.sizes.split(",")):
        count = nbytes // 4
        data = torch.full((count,), float(rank + 1), dtype=torch.float32)
        dist.barrier()
        dist.all_reduce(data)
        expected = float(size * (size + 1) // 2)
        if not bool(torch.all(data == expected)):
            print(f"rank {rank}: torch-gloo: wrong sum at {nbytes} bytes", file=sys.stderr)
            return 1
        data.zero_()
        for _ in range(args.warmup):
            dist.barrier()
            dist.all_reduce(data)
        run_medians = []
        samples = torch.zeros(args.iters, dtype=torch.float64)
        for _ in range(args.runs):
            for i in range(args.iters):
                dist.barrier()
                start = time.perf_counter_ns()
                dist.all_reduce(data)
                samples[i] = (time.perf_counter_ns() - start) / 1e3
            dist.all_reduce(samples, op=dist.ReduceOp.MAX)  # an iteration ends on its last rank
            run_medians.append(statistics.median(samples.tolist()))
        if rank == 0:
            fastest, slowest = min(run_medians), max(run_medians)
            print(f"RESULT torch-gloo {nbytes} {size} {statistics.median(run_medians):.3f} "
                  f"{slowest / fastest:.4f} {fastest:.3f} {slowest:.3f}")
            print(f"RUNS torch-gloo {nbytes} " + " ".join(f"{r:.3f}" for r in run_medians))
            sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
