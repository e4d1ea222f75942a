# bench/allreduce_torch.py - one rank of torch.distributed's all_reduce (sum, float32, backend
# gloo), or of DeepSpeed's shared-memory CPU all_reduce, timed exactly as bench/allreduce_rank.cpp
# times tandem (see the method there).
#   RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29555 GLOO_SOCKET_IFNAME=lo \
#     /usr/bin/python3 bench/allreduce_torch.py [--runs 5] [--iters 21]   (and RANK=1 beside it)
#   ... allreduce_torch.py --impl deepspeed-shm --deepspeed-src DIR --pybind11-include DIR
#     --build-dir DIR
# Needs: PyTorch with gloo (Debian's python3-torch; run with /usr/bin/python3). For deepspeed-shm:
# DeepSpeed's source tree (its sdist from PyPI: csrc/cpu/comm/shm*.cpp), pybind11's headers and
# libtorch-dev's headers: the op (what DeepSpeed's ShareMemCommBuilder builds, with its flags) is
# built as a torch C++ extension into --build-dir (bench/run_allreduce.sh builds it once before
# the ranks start; the ranks then load the built module). `import deepspeed` itself is not used:
# DeepSpeed asks for torch >= 2.0. Its all_reduce runs only when LOCAL_SIZE = WORLD_SIZE (all
# ranks on this host); its barrier is its all_reduce of one element; the maximum over ranks (outside
# the timed part) goes through gloo.
#
# Rank 0 prints, per size (IMPL: torch-gloo or deepspeed-shm):
#   RESULT <impl> <bytes> <ranks> <median_us> <spread> <fastest_run_us> <slowest_run_us>
#   RUNS <impl> <bytes> <run_median_us>...
import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist

SIZES = [4 << 10, 256 << 10, 4 << 20, 64 << 20]


def deepspeed_shm_module(src: str, pybind11_include: str, build_dir: str):
    """DeepSpeed's shm_comm op, built (or loaded, when built already) as a torch extension."""
    from torch.utils import cpp_extension

    comm = f"{src}/csrc/cpu/comm"
    return cpp_extension.load(name="deepspeed_shm_comm",
                              sources=[f"{comm}/shm_interface.cpp", f"{comm}/shm.cpp"],
                              extra_include_paths=[f"{src}/csrc/cpu/includes", pybind11_include],
                              extra_cflags=["-O2", "-fopenmp"], build_directory=build_dir,
                              verbose=False)


def engine_of(args, rank: int, size: int):
    """(barrier, in-place all_reduce) of --impl: each implementation's own barrier."""
    if args.impl == "torch-gloo":
        return dist.barrier, dist.all_reduce
    module = deepspeed_shm_module(args.deepspeed_src, args.pybind11_include, args.build_dir)
    module.initialize(size, rank)  # all ranks local only when LOCAL_SIZE == size
    all_reduce = torch.ops.deepspeed.inference_all_reduce_
    token = torch.zeros(1, dtype=torch.float32)
    # DeepSpeed's op exports no barrier: an all_reduce of one element is one (every rank waits
    # for every other's contribution), at its own latency rather than gloo's.
    return (lambda: all_reduce(token)), all_reduce


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--iters", type=int, default=21)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--sizes", type=str, default=",".join(str(s) for s in SIZES))
    parser.add_argument("--impl", choices=["torch-gloo", "deepspeed-shm"], default="torch-gloo")
    parser.add_argument("--deepspeed-src", type=str, help="DeepSpeed's source tree")
    parser.add_argument("--pybind11-include", type=str, help="pybind11's include directory")
    parser.add_argument("--build-dir", type=str, help="where the DeepSpeed op is built")
    parser.add_argument("--build-only", action="store_true",
                        help="build the DeepSpeed op and exit (no ranks needed)")
    args = parser.parse_args()
    if args.impl == "deepspeed-shm" and not (args.deepspeed_src and args.pybind11_include
                                             and args.build_dir):
        parser.error("deepspeed-shm needs --deepspeed-src, --pybind11-include and --build-dir")
    if args.build_only:
        deepspeed_shm_module(args.deepspeed_src, args.pybind11_include, args.build_dir)
        return 0

    dist.init_process_group(backend="gloo")  # env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, size = dist.get_rank(), dist.get_world_size()
    barrier, all_reduce = engine_of(args, rank, size)
    for nbytes in (int(s) for s in args.sizes.split(",")):
        count = nbytes // 4
        data = torch.full((count,), float(rank + 1), dtype=torch.float32)
        barrier()
        all_reduce(data)
        expected = float(size * (size + 1) // 2)
        if not bool(torch.all(data == expected)):
            wrong = int((data != expected).sum())
            print(f"rank {rank}: {args.impl}: {wrong} of {count} elements are not {expected} at "
                  f"{nbytes} bytes", file=sys.stderr)
            return 1
        data.zero_()
        for _ in range(args.warmup):
            barrier()
            all_reduce(data)
        run_medians = []
        samples = torch.zeros(args.iters, dtype=torch.float64)
        for _ in range(args.runs):
            for i in range(args.iters):
                barrier()
                start = time.perf_counter_ns()
                all_reduce(data)
                samples[i] = (time.perf_counter_ns() - start) / 1e3
            dist.all_reduce(samples, op=dist.ReduceOp.MAX)  # an iteration ends on its last rank
            run_medians.append(statistics.median(samples.tolist()))
        if rank == 0:
            fastest, slowest = min(run_medians), max(run_medians)
            print(f"RESULT {args.impl} {nbytes} {size} {statistics.median(run_medians):.3f} "
                  f"{slowest / fastest:.4f} {fastest:.3f} {slowest:.3f}")
            print(f"RUNS {args.impl} {nbytes} " + " ".join(f"{r:.3f}" for r in run_medians))
            sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
