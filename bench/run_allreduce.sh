#!/usr/bin/env bash
# bench/run_allreduce.sh - the CPU all_reduce benchmark in one go: tandem-local vs memcpy,
# tandem-gloo (default options and check_collectives = false) vs raw gloo, tandem-mpi vs raw MPI,
# and torch.distributed (gloo), tandem-shm (ShmComm: processes in shared memory) vs memcpy and
# tandem-local, 2 ranks on 127.0.0.1; prints the tables and writes them.
#   bench/run_allreduce.sh [BUILD_DIR] [--runs N] [--iters N] [--out FILE] [--only PARTS]
#   (BUILD_DIR defaults to build/release, FILE to bench/results/allreduce-cpu.md; PARTS is a
#   comma list of local, gloo, mpi, torch, shm: the parts to run, default all)
# Needs: a build with TANDEM_BUILD_BENCH, TANDEM_BUILD_TOOLS, TANDEM_WITH_GLOO, TANDEM_WITH_MPI
# (this script builds nothing), OpenMPI's mpirun, and Debian's python3-torch for /usr/bin/python3.
# A part whose program is missing is reported as not run.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/.." && pwd)
build=build/release
runs=11
iters=21
out=$root/bench/results/allreduce-cpu.md
only=""
command_line="bench/run_allreduce.sh $*"
while (($#)); do
  case $1 in
    --runs) runs=$2; shift 2 ;;
    --iters) iters=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --only) only=$2; shift 2 ;;
    -h | --help) sed -n '2,12p' "$0"; exit 0 ;;
    -*) echo "unknown option $1" >&2; exit 2 ;;
    *) build=$1; shift ;;
  esac
done
case $build in /*) ;; *) build=$root/$build ;; esac
python=/usr/bin/python3
[[ -x $python ]] || python=python3

tmp=$(mktemp -d /tmp/tandem-bench-allreduce.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
results=$tmp/results.txt
notes=$tmp/notes.txt
: >"$results"
: >"$notes"

# Whether --only names part $1 (or no --only was given).
wanted() { [[ -z $only || ",$only," == *",$1,"* ]]; }

# Runs one part with a time limit; its RESULT/RUNS lines go to $results, its output to the console.
part() {
  local name=$1
  shift
  wanted "${name%%-*}" || return 0
  echo "== $name: $*" >&2
  loads+="$name $(cut -d' ' -f1 /proc/loadavg), "
  if timeout 1200 "$@" >"$tmp/$name.out" 2>&1; then
    grep -oE '(RESULT|RUNS) .*' "$tmp/$name.out" >>"$results" || true
  else
    local rc=$?
    echo "$name failed (exit $rc); its output:" >&2
    tail -20 "$tmp/$name.out" >&2
    echo "$name: failed (exit $rc), see the console output" >>"$notes"
    grep -oE '(RESULT|RUNS) .*' "$tmp/$name.out" >>"$results" || true
  fi
}

missing() {
  wanted "$1" || return 0
  echo "$1: not run ($2)" >>"$notes"
  echo "== $1: not run ($2)" >&2
}

load_before=$(cut -d' ' -f1-3 /proc/loadavg)
# What the programs were built from: the commit, and headers edited since (as of the newest build).
newest=$(ls -t "$build/bench/bench_allreduce" "$build/bench/bench_allreduce_rank" 2>/dev/null | head -1 || true)
tandem_state="$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)"
changed=$(git -C "$root" status --short -- include 2>/dev/null | awk '{print $2}' | paste -sd' ' || true)
[[ -n $changed ]] && tandem_state+=", uncommitted changes to: $changed"
if [[ -n $newest ]]; then
  tandem_state+="; programs built $(date -u -r "$newest" '+%H:%M UTC')"
  after=$(find "$root/include" -newer "$newest" -name '*.hpp' -printf '%P ' 2>/dev/null || true)
  [[ -n $after ]] && tandem_state+=", headers edited after that build: $after"
fi
loads=""
started=$(date -u '+%Y-%m-%d %H:%M UTC')
bench=$build/bench/bench_allreduce
rank_program=$build/bench/bench_allreduce_rank
tandemrun=$build/tools/tandemrun
export GLOO_SOCKET_IFNAME=lo

# 1. tandem-local (threads) and memcpy, interleaved in one process.
if [[ -x $bench ]]; then
  part local "$bench" --ranks 2 --runs "$runs" --iters "$iters"
else
  missing local "no $bench"
fi

# 2. tandem-gloo, tandem-gloo-nocheck, raw-gloo, interleaved in the same 2 processes.
modes=$([[ -x $rank_program ]] && "$rank_program" --modes || true)
if [[ " $modes " == *" gloo "* && -x $tandemrun ]]; then
  mkdir -p "$tmp/gloo-store"
  part gloo "$tandemrun" --standalone --nproc-per-node 2 "$rank_program" --mode gloo \
    --store-dir "$tmp/gloo-store" --runs "$runs" --iters "$iters"
else
  missing gloo "no $rank_program with Gloo, or no $tandemrun"
fi

# 3. tandem-mpi and raw-mpi, interleaved in the same 2 processes (MPI_THREAD_MULTIPLE, as
#    MpiComm asks); then raw MPI alone after a plain MPI_Init, for reference.
if [[ " $modes " == *" mpi "* ]] && command -v mpirun >/dev/null; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  part mpi mpirun -n 2 --bind-to none "$rank_program" --mode mpi --runs "$runs" --iters "$iters"
  part mpi-single mpirun -n 2 --bind-to none "$rank_program" --mode mpi --mpi-thread single \
    --runs "$runs" --iters "$iters"
else
  missing mpi "no $rank_program or no mpirun"
fi

# 4. tandem-shm: ShmComm under tandemrun, 2 processes of this host meeting in shared memory
#    (its peers, tandem-local and memcpy, are part 1).
if [[ " $modes " == *" shm "* && -x $tandemrun ]]; then
  part shm "$tandemrun" --standalone --nproc-per-node 2 "$rank_program" --mode shm \
    --runs "$runs" --iters "$iters"
else
  missing shm "no $rank_program with ShmComm, or no $tandemrun"
fi

# 5. torch.distributed, backend gloo: 2 ranks started by hand (torchrun 1.13 on Debian crashes).
if ! wanted torch; then
  :
elif [[ -x /usr/bin/python3 ]] && /usr/bin/python3 -c 'import torch.distributed' 2>/dev/null; then
  port=$(/usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  loads+="torch $(cut -d' ' -f1 /proc/loadavg), "
  echo "== torch: 2 x /usr/bin/python3 $here/allreduce_torch.py (MASTER_PORT=$port)" >&2
  pids=()
  for rank in 0 1; do
    RANK=$rank WORLD_SIZE=2 LOCAL_RANK=$rank MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      OMP_NUM_THREADS=1 timeout 1200 /usr/bin/python3 "$here/allreduce_torch.py" \
      --runs "$runs" --iters "$iters" >"$tmp/torch-$rank.out" 2>&1 &
    pids+=($!)
  done
  torch_ok=1
  for pid in "${pids[@]}"; do wait "$pid" || torch_ok=0; done
  grep -oE '(RESULT|RUNS) .*' "$tmp/torch-0.out" >>"$results" || true
  if ((!torch_ok)); then
    echo "torch failed; its output:" >&2
    tail -20 "$tmp/torch-0.out" "$tmp/torch-1.out" >&2
    echo "torch: failed, see the console output" >>"$notes"
  fi
else
  missing torch "no torch for /usr/bin/python3"
fi

load_after=$(cut -d' ' -f1-3 /proc/loadavg)

# Facts for the header of the results file.
compiler=$(sed -n 's/^CMAKE_CXX_COMPILER:[A-Z]*=//p' "$build/CMakeCache.txt" 2>/dev/null || true)
version_of() { dpkg-query -W -f '${Version}' "$1" 2>/dev/null || echo unknown; }
export BENCH_DATE=$started
export BENCH_COMMAND=$command_line
export BENCH_RUNS=$runs BENCH_ITERS=$iters
export BENCH_LOAD_BEFORE=$load_before BENCH_LOAD_AFTER=$load_after
export BENCH_NPROC=$(nproc)
export BENCH_CPU=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')
export BENCH_MEMORY=$(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo)
export BENCH_KERNEL=$(uname -sr)
export BENCH_OS=$(. /etc/os-release && echo "$PRETTY_NAME")
export BENCH_COMPILER=$({ [[ -n $compiler ]] && "$compiler" --version | head -1; } || echo unknown)
export BENCH_BUILD_TYPE=$(sed -n 's/^CMAKE_BUILD_TYPE:[A-Z]*=//p' "$build/CMakeCache.txt" 2>/dev/null || echo unknown)
export BENCH_TANDEM=$(sed -n 's/#define TANDEM_VERSION_\(MAJOR\|MINOR\|PATCH\) //p' "$root/include/tandem/core/config.hpp" | paste -sd.)
export BENCH_TANDEM_COMMIT=$tandem_state
export BENCH_LOADS=${loads%, }
export BENCH_GLOO="libgloo-dev $(version_of libgloo-dev)"
export BENCH_MPI=$(mpirun --version 2>/dev/null | head -1 || echo unknown)
export BENCH_TORCH=$(/usr/bin/python3 -c 'import sys, torch; print(f"torch {torch.__version__} (python3-torch, Python {sys.version.split()[0]})")' 2>/dev/null || echo unknown)
export BENCH_NOTES=$(cat "$notes")

mkdir -p "$(dirname "$out")"
$python - "$results" >"$out" <<'PY'
# Turns the RESULT/RUNS lines into the markdown report (bench/results/allreduce-cpu.md).
import os
import statistics
import sys

env = os.environ.get
results, runs = {}, {}
for line in open(sys.argv[1]):
    f = line.split()
    if f[0] == "RESULT" and len(f) == 8:
        results[(f[1], int(f[2]))] = dict(ranks=int(f[3]), us=float(f[4]), spread=float(f[5]),
                                          fastest=float(f[6]), slowest=float(f[7]))
    elif f[0] == "RUNS":
        runs[(f[1], int(f[2]))] = [float(x) for x in f[3:]]

SIZES = sorted({size for _, size in results})
ORDER = ["tandem-local", "memcpy", "tandem-shm", "tandem-gloo", "tandem-gloo-nocheck", "raw-gloo", "torch-gloo",
         "tandem-mpi", "raw-mpi", "raw-mpi-single"]
LABEL = {
    "tandem-local": "tandem-local (2 threads)",
    "memcpy": "memcpy (1 thread)",
    "tandem-shm": "tandem-shm (2 processes, shared memory)",
    "tandem-gloo": "tandem-gloo (default options)",
    "tandem-gloo-nocheck": "tandem-gloo, check_collectives = false",
    "raw-gloo": "raw gloo::allreduce",
    "torch-gloo": "torch.distributed gloo",
    "tandem-mpi": "tandem-mpi",
    "raw-mpi": "raw MPI_Allreduce",
    "raw-mpi-single": "raw MPI_Allreduce, plain MPI_Init",
}


def size_name(b):
    return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"


def time_name(us):
    if us >= 1000:
        return f"{us / 1000:.2f} ms"
    return f"{us:.1f} us" if us >= 10 else f"{us:.2f} us"


def algbw(impl, size):
    return size / results[(impl, size)]["us"] / 1e3  # GB/s


def busbw(impl, size):
    n = results[(impl, size)]["ranks"]
    return algbw(impl, size) * 2 * (n - 1) / n


def ratio(a, b, size):
    """a's time / b's time (medians), and the range of the per-run ratios (runs interleaved)."""
    if (a, size) not in results or (b, size) not in results:
        return None
    paired = [x / y for x, y in zip(runs.get((a, size), []), runs.get((b, size), []))]
    return results[(a, size)]["us"] / results[(b, size)]["us"], paired


def show_ratio(r):
    if r is None:
        return "not run"
    value, paired = r
    text = f"{value:.3f}"
    if paired:
        text += f" ({min(paired):.2f}-{max(paired):.2f})"
    return text


def shm_ratio(size):
    """tandem-shm busbw / memcpy GB/s."""
    if ("tandem-shm", size) not in results or ("memcpy", size) not in results:
        return None
    return busbw("tandem-shm", size) / algbw("memcpy", size)


def local_ratio(size):
    if ("tandem-local", size) not in results or ("memcpy", size) not in results:
        return None
    return busbw("tandem-local", size) / algbw("memcpy", size)


out = []
w = out.append
w("# all_reduce on the CPU: tandem beside the engines it wraps")
w("")
w(f"Date: {env('BENCH_DATE')}. Produced by `{env('BENCH_COMMAND').strip()}` (one run of the script;"
  " every number below comes from it).")
w("")
w(f"- Machine: {env('BENCH_NPROC')} CPUs ({env('BENCH_CPU')}), {env('BENCH_MEMORY')}, "
  f"{env('BENCH_OS')}, {env('BENCH_KERNEL')}. Shared with other work: load average "
  f"(1, 5, 15 min) {env('BENCH_LOAD_BEFORE')} before, {env('BENCH_LOAD_AFTER')} after; "
  f"1-minute load as each part started: {env('BENCH_LOADS')}.")
w(f"- Build: {env('BENCH_BUILD_TYPE')}, {env('BENCH_COMPILER')}; tandem {env('BENCH_TANDEM')} "
  f"(commit {env('BENCH_TANDEM_COMMIT')}).")
w(f"- Engines: {env('BENCH_GLOO')} (TCP transport, GLOO_SOCKET_IFNAME=lo); {env('BENCH_MPI')} "
  f"(mpirun -n 2 --bind-to none, shared-memory transport); {env('BENCH_TORCH')}.")
w("")
w("## Method")
w("")
w(f"all_reduce, sum, float32, in place, 2 ranks on 127.0.0.1. {env('BENCH_RUNS')} runs x "
  f"{env('BENCH_ITERS')} iterations per implementation and size, after a correctness check (ranks "
  "hold rank + 1; the sum must arrive everywhere) and 5 warm-up iterations. An iteration is the "
  "implementation's own barrier, then a steady clock around one all_reduce on every rank; the "
  "iteration's time is the **maximum over the ranks** (nccl-tests reports the average over ranks "
  "by default, `-a 1`; the maximum, `-a 3`, is when the collective is complete everywhere). A run's "
  "time is the median of its iterations; the table gives the **median of the run medians**, and "
  "the spread = slowest run / fastest run. The implementations that share an engine run "
  "**interleaved in the same processes** on the same buffer (order rotating per run): "
  "tandem-gloo, tandem-gloo with `check_collectives = false` and raw gloo under `tandemrun "
  "--standalone --nproc-per-node 2`; tandem-mpi and raw MPI under one mpirun (both at "
  "MPI_THREAD_MULTIPLE, which MpiComm asks for); tandem-local and memcpy in one process. Raw gloo "
  "is `gloo::allreduce` on its own context (FileStore rendezvous, the same TCP device) with the "
  "options GlooComm sets: one output buffer, a sum function (`gloo::sum<float>`), a tag, the same "
  "timeout, gloo's default algorithm. Raw MPI is `MPI_Allreduce(MPI_IN_PLACE, ...)` on a "
  "duplicate of MPI_COMM_WORLD; *raw MPI_Allreduce, plain MPI_Init* is the same in a separate "
  "mpirun whose program called `MPI_Init` (thread level single), for reference. torch.distributed "
  "runs `dist.all_reduce` between `dist.barrier()`s, timed the same way (separate processes, "
  "started by hand with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT).")
w("")
w("Bandwidths follow nccl-tests' PERFORMANCE.md: algbw = bytes / time, busbw = algbw x 2(n-1)/n "
  "(= algbw for n = 2). GB = 10^9 bytes. For memcpy the algbw column is bytes copied / time.")
w("")
w("## Results")
w("")
w("| size | implementation | median time | algbw GB/s | busbw GB/s | spread (fastest - slowest run) |")
w("|---|---|---|---|---|---|")
for size in SIZES:
    for impl in ORDER:
        r = results.get((impl, size))
        if r is None:
            continue
        bus = "-" if impl == "memcpy" else f"{busbw(impl, size):.3f}"
        w(f"| {size_name(size)} | {LABEL[impl]} | {time_name(r['us'])} | {algbw(impl, size):.3f} | "
          f"{bus} | {r['spread']:.2f}x ({time_name(r['fastest'])} - {time_name(r['slowest'])}) |")
w("")
w("Ratios (time of tandem / time of its engine: below 1.03 is within 3 %; in brackets the range "
  "of the per-run ratios, each run of the two being interleaved, which shows how much of a "
  "difference is noise):")
w("")
w("| size | tandem-gloo / raw gloo | tandem-gloo (no check) / raw gloo | torch / raw gloo | "
  "tandem-mpi / raw MPI | raw MPI / plain-MPI_Init raw MPI | tandem-local busbw / memcpy GB/s | "
  "tandem-shm busbw / memcpy GB/s | tandem-shm / tandem-local time |")
w("|---|---|---|---|---|---|---|---|---|")
for size in SIZES:
    lr = local_ratio(size)
    sr = shm_ratio(size)
    sl = ratio("tandem-shm", "tandem-local", size)
    w(f"| {size_name(size)} | {show_ratio(ratio('tandem-gloo', 'raw-gloo', size))} | "
      f"{show_ratio(ratio('tandem-gloo-nocheck', 'raw-gloo', size))} | "
      f"{show_ratio(ratio('torch-gloo', 'raw-gloo', size))} | "
      f"{show_ratio(ratio('tandem-mpi', 'raw-mpi', size))} | "
      f"{show_ratio(ratio('raw-mpi', 'raw-mpi-single', size))} | "
      f"{'not run' if lr is None else f'{lr:.2f}'} | {'not run' if sr is None else f'{sr:.2f}'} | "
      f"{'not run' if sl is None else f'{sl[0]:.3f}'} |")
w("")
w("## Targets")
w("")


def verdict(ok):
    return "**met**" if ok else "**not met**"


def target_lines(name, impl, engine, sizes):
    parts, all_ok = [], True
    for size in sizes:
        r = ratio(impl, engine, size)
        if r is None:
            parts.append(f"{size_name(size)}: not run")
            all_ok = False
            continue
        ok = r[0] <= 1.03
        all_ok &= ok
        parts.append(f"{size_name(size)}: {r[0]:.3f} ({'met' if ok else 'not met'})")
    w(f"- {name}: {verdict(all_ok)} - " + "; ".join(parts) + ".")


big = [s for s in SIZES if s >= 256 << 10]
target_lines("tandem-gloo (default options, check_collectives = true) within 3 % of raw gloo at "
             "256 KiB and above", "tandem-gloo", "raw-gloo", big)
target_lines("tandem-gloo with check_collectives = false, same target (for choosing the default)",
             "tandem-gloo-nocheck", "raw-gloo", big)
target_lines("tandem-mpi within 3 % of raw MPI (every size)", "tandem-mpi", "raw-mpi", SIZES)
def memcpy_target(name, ratio_of, floor, memcpy_rate_shown):
    """Each size from 4 MiB: the ratio of name's busbw to memcpy's, and whether all reach floor."""
    parts, all_ok = [], True
    for size in [s for s in SIZES if s >= 4 << 20]:
        ratio = ratio_of(size)
        if ratio is None:
            parts.append(f"{size_name(size)}: not run")
            all_ok = False
            continue
        all_ok &= ratio >= floor
        memcpy = f"memcpy {algbw('memcpy', size):.2f} GB/s" if memcpy_rate_shown else "memcpy"
        parts.append(f"{size_name(size)}: busbw {busbw(name, size):.2f} GB/s = {ratio:.2f} x "
                     f"{memcpy} ({'met' if ratio >= floor else 'not met'})")
    return all_ok, "; ".join(parts)


local_ok, local_parts = memcpy_target("tandem-local", local_ratio, 0.5, True)
w("- tandem-local at 4 MiB and above reaching half of single-thread memcpy bandwidth: "
  f"{verdict(local_ok)} - " + local_parts + ".")
shm_ok, shm_parts = memcpy_target("tandem-shm", shm_ratio, 0.6, False)
w("- tandem-shm at 4 MiB and above reaching 0.6 x single-thread memcpy bandwidth (issue 23): "
  f"{verdict(shm_ok)} - " + shm_parts + ".")
small = [s for s in SIZES if s <= 4 << 10]
if small and ("tandem-shm", small[0]) in results and ("tandem-local", small[0]) in results:
    gap = results[("tandem-shm", small[0])]["us"] - results[("tandem-local", small[0])]["us"]
    w(f"- tandem-shm at most 5 us over tandem-local's latency at {size_name(small[0])} (issue 23): "
      f"{verdict(gap <= 5)} - {gap:+.1f} us.")
notes = env("BENCH_NOTES", "").strip()
if notes:
    w("")
    w("Parts not run or failed:")
    for line in notes.splitlines():
        w(f"- {line}")
w("")
w("## Raw data")
w("")
w("Per implementation and size, the run medians in microseconds (max over ranks per iteration, "
  "median over the iterations of a run), in run order:")
w("")
w("```")
for size in SIZES:
    for impl in ORDER:
        if (impl, size) in runs:
            w(f"{impl} {size} " + " ".join(f"{x:.1f}" for x in runs[(impl, size)]))
w("```")
print("\n".join(out))
PY
cat "$out"
echo "written: $out" >&2
