#!/usr/bin/env bash
# bench/run_allreduce.sh - the CPU all_reduce benchmark in one go: tandem (tandem-shm, and
# tandem-shm-segment when the build has it; tandem-mpi, tandem-gloo, tandem-local) beside every
# peer on this host - oneCCL (from PyPI), Open MPI, DeepSpeed's shared-memory all_reduce,
# raw gloo, torch.distributed over gloo, and a single-thread memcpy - at 2 ranks and at 4 ranks
# (oversubscribed on a 2-CPU machine, marked so); writes bench/results/allreduce-peers.md.
#   bench/run_allreduce.sh [BUILD_DIR] [--runs N] [--iters N] [--out FILE] [--only PARTS]
#     [--ranks LIST] [--sizes BYTES,...] [--peers-dir DIR] [--part-timeout SECONDS]
#   (BUILD_DIR defaults to build/release; PARTS is a comma list of local, gloo, mpi, shm, torch,
#   oneccl, deepspeed, default all; LIST defaults to 2,4; --sizes defaults to 4 KiB, 256 KiB,
#   4 MiB, 64 MiB, the sizes of memcpy's measurement; DIR, where the peers are installed and
#   built, defaults to BUILD_DIR/peers). Rank counts above the CPU count run 3 runs x 7
#   iterations at most (oversubscribed peers take up to 0.5 s per all_reduce here); a part that
#   passes --part-timeout (default 300 s) is reported as failed.
# Needs: a build with TANDEM_BUILD_BENCH, TANDEM_BUILD_TOOLS, TANDEM_WITH_GLOO, TANDEM_WITH_MPI
# (the script builds no tandem target), OpenMPI's mpirun, Debian's python3-torch and libtorch-dev
# for /usr/bin/python3, g++, and a python3 with pip that reaches PyPI the first time (oneCCL:
# oneccl-cpu, oneccl-cpu-devel, intel-cmplr-lib-rt into a venv; DeepSpeed's sdist and pybind11's
# headers, both pinned, into DIR; nothing goes into a system Python). A part that cannot run
# here is reported as not run, with the reason; a part that fails (a wrong sum, a crash) is
# reported as failed, gives no number, and makes the script exit 1 after writing the report.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/.." && pwd)
build=build/release
runs=5
iters=21
out=$root/bench/results/allreduce-peers.md
only=""
rank_counts=2,4
sizes=""
peers=""
part_timeout=300
command_line="bench/run_allreduce.sh $*"
while (($#)); do
  case $1 in
    --runs) runs=$2; shift 2 ;;
    --iters) iters=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --only) only=$2; shift 2 ;;
    --ranks) rank_counts=$2; shift 2 ;;
    --sizes) sizes=$2; shift 2 ;;
    --peers-dir) peers=$2; shift 2 ;;
    --part-timeout) part_timeout=$2; shift 2 ;;
    -h | --help) sed -n '2,23p' "$0"; exit 0 ;;
    -*) echo "unknown option $1" >&2; exit 2 ;;
    *) build=$1; shift ;;
  esac
done
case $build in /*) ;; *) build=$root/$build ;; esac
[[ -n $peers ]] || peers=$build/peers
case $peers in /*) ;; *) peers=$root/$peers ;; esac
sizes_flag=()
[[ -n $sizes ]] && sizes_flag=(--sizes "$sizes")
python=/usr/bin/python3
[[ -x $python ]] || python=python3
pip_python=python3 # the python3 on PATH: the one with pip and PyPI (not Debian's)
nproc=$(nproc)

tmp=$(mktemp -d /tmp/tandem-bench-allreduce.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
notes=$tmp/notes.txt
: >"$notes"
failed=0
loads=""
durations=""

# Whether --only names part $1 (or no --only was given).
wanted() { [[ -z $only || ",$only," == *",$1,"* ]]; }

note_missing() {
  echo "$1: not run ($2)" >>"$notes"
  echo "== $1: not run ($2)" >&2
}

# Keeps a finished part's RESULT/RUNS lines (from $2) in this rank count's results; a part that
# failed, or printed no RESULT, is noted and gives no numbers.
collect() {
  local name=$1 output=$2 rc=$3
  if ((rc != 0)); then
    echo "$name failed (exit $rc); its output:" >&2
    tail -20 "$output" >&2
    echo "$name: **failed** (exit $rc): $(grep -m1 -iE 'error|expected|wrong|not ' "$output" | cut -c1-300 || true)" >>"$notes"
    failed=1
  elif ! grep -qE '(^|] )RESULT ' "$output"; then
    echo "$name: **failed**: exited 0 but printed no RESULT line" >>"$notes"
    failed=1
  else
    grep -oE '(RESULT|RUNS) .*' "$output" >>"$results"
  fi
}

# Runs one part (a launcher command) with a time limit.
part() {
  local name=$1
  shift
  echo "== $name: $*" >&2
  loads+="$name $(cut -d' ' -f1 /proc/loadavg), "
  local rc=0 start=$SECONDS
  timeout "$part_timeout" "$@" >"$tmp/$name.out" 2>&1 || rc=$?
  durations+="$name $((SECONDS - start)) s, "
  collect "$name" "$tmp/$name.out" "$rc"
}

# Runs one part whose $n ranks are started by hand (python ranks: torchrun 1.13 on Debian
# crashes), each with RANK/WORLD_SIZE/LOCAL_*/MASTER_*; rank 0's output carries the results.
by_hand() {
  local name=$1
  shift
  local port
  port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  echo "== $name: $n x $* (MASTER_PORT=$port)" >&2
  loads+="$name $(cut -d' ' -f1 /proc/loadavg), "
  local pids=() rank rc=0 status start=$SECONDS
  for ((rank = 0; rank < n; rank++)); do
    RANK=$rank WORLD_SIZE=$n LOCAL_RANK=$rank LOCAL_WORLD_SIZE=$n LOCAL_SIZE=$n \
      MASTER_ADDR=127.0.0.1 MASTER_PORT=$port OMP_NUM_THREADS=1 \
      timeout "$part_timeout" "$@" >"$tmp/$name-$rank.out" 2>&1 &
    pids+=($!)
  done
  for rank in "${!pids[@]}"; do
    status=0
    wait "${pids[$rank]}" || status=$?
    if ((status)); then
      ((rc)) || rc=$status
      cat "$tmp/$name-$rank.out" >>"$tmp/$name-errors.out"
    fi
  done
  durations+="$name $((SECONDS - start)) s, "
  if ((rc)); then
    collect "$name" "$tmp/$name-errors.out" "$rc"
  else
    collect "$name" "$tmp/$name-0.out" 0
  fi
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
started=$(date -u '+%Y-%m-%d %H:%M UTC')
bench=$build/bench/bench_allreduce
rank_program=$build/bench/bench_allreduce_rank
tandemrun=$build/tools/tandemrun
export GLOO_SOCKET_IFNAME=lo
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
modes=$([[ -x $rank_program ]] && "$rank_program" --modes || true)

# --- Preparing the peers (once; later runs reuse $peers) -------------------------------------

# oneCCL from PyPI into a venv. Its wheels (2021.17 to 2022.2 alike) ship a libccl.so.1 that names
# a libccl.so.2 it does not ship and calls Intel compiler runtime functions (_intel_fast_memcpy)
# that its dependencies do not bring: intel-cmplr-lib-rt brings them, and libccl.so.2 is pointed
# at libccl.so.1 itself (the same file: the loader maps it once), in a directory of our own.
oneccl_venv=$peers/oneccl-venv
oneccl_program=$peers/oneccl_allreduce
why="" # what a prepare_ function could not do

# Runs one step of preparing a peer, its output in $tmp/$1.out; when it fails, why says which
# step failed and the first error line of its output.
step() {
  local log=$tmp/$1.out what=$2
  shift 2
  "$@" >"$log" 2>&1 && return 0
  why="$what failed: $(grep -m1 -iE 'error' "$log" | cut -c1-300 || true)"
  return 1
}

prepare_oneccl() {
  if [[ ! -e $oneccl_venv/include/oneapi/ccl.hpp || ! -e $oneccl_venv/lib/libintlc.so.5 ]]; then
    echo "== installing oneCCL from PyPI into $oneccl_venv" >&2
    step oneccl-venv "$pip_python -m venv" "$pip_python" -m venv "$oneccl_venv" || return 1
    step oneccl-install "pip install oneccl-cpu oneccl-cpu-devel intel-cmplr-lib-rt" \
      "$oneccl_venv/bin/pip" install -q oneccl-cpu oneccl-cpu-devel intel-cmplr-lib-rt || return 1
  fi
  mkdir -p "$peers/oneccl-fix"
  ln -sf "$oneccl_venv/lib/libccl.so.1" "$peers/oneccl-fix/libccl.so.2"
  if [[ ! -x $oneccl_program || $here/peers/oneccl_allreduce.cpp -nt $oneccl_program ]]; then
    echo "== building $oneccl_program" >&2
    step oneccl-build "g++ bench/peers/oneccl_allreduce.cpp" g++ -std=c++17 -O2 -Wall -Wextra \
      -I"$oneccl_venv/include" "$here/peers/oneccl_allreduce.cpp" -o "$oneccl_program" \
      -L"$oneccl_venv/lib" -lccl -lintlc \
      -Wl,--disable-new-dtags,-rpath,"$oneccl_venv/lib:$peers/oneccl-fix" \
      -Wl,-rpath-link,"$peers/oneccl-fix" || return 1
  fi
}

# DeepSpeed's shared-memory all_reduce: its sdist (pinned) for csrc/cpu/comm, pybind11's headers
# (the version Debian's torch 1.13 was built with), built once as a torch extension.
deepspeed_version=0.19.8
deepspeed_src=$peers/deepspeed-$deepspeed_version
pybind11_dir=$peers/pybind11-2.10.3
deepspeed_build=$peers/deepspeed-shm-build
prepare_deepspeed() {
  step torch-check "import torch.utils.cpp_extension with $python" \
    "$python" -c 'import torch.utils.cpp_extension' || return 1
  if [[ ! -e $deepspeed_src/csrc/cpu/comm/shm.cpp ]]; then
    echo "== downloading DeepSpeed $deepspeed_version's sdist into $peers" >&2
    mkdir -p "$peers"
    step deepspeed-get "pip download deepspeed==$deepspeed_version" "$pip_python" -m pip download \
      -q --no-deps --no-binary :all: -d "$tmp/deepspeed" "deepspeed==$deepspeed_version" || return 1
    step deepspeed-unpack "unpacking DeepSpeed's sdist" \
      tar -xzf "$tmp/deepspeed/deepspeed-$deepspeed_version.tar.gz" -C "$peers" || return 1
  fi
  if [[ ! -e $pybind11_dir/pybind11/include/pybind11/pybind11.h ]]; then
    step pybind11-get "pip install --target pybind11==2.10.3" "$pip_python" -m pip install -q \
      --target "$pybind11_dir" pybind11==2.10.3 || return 1
  fi
  mkdir -p "$deepspeed_build"
  echo "== building (or finding built) DeepSpeed's shm_comm op in $deepspeed_build" >&2
  step deepspeed-build "building DeepSpeed's shm_comm op against Debian's torch" env MAX_JOBS=2 \
    "$python" "$here/allreduce_torch.py" --impl deepspeed-shm --build-only \
    --deepspeed-src "$deepspeed_src" --pybind11-include "$pybind11_dir/pybind11/include" \
    --build-dir "$deepspeed_build" || return 1
}

oneccl_ready=0
deepspeed_ready=0
if wanted oneccl; then
  if prepare_oneccl; then oneccl_ready=1; else note_missing oneccl "$why"; fi
fi
if wanted deepspeed; then
  if prepare_deepspeed; then deepspeed_ready=1; else note_missing deepspeed "$why"; fi
fi

# tandem-shm's implementations: today's path, and the segment's when this build has it
# (bench_allreduce_rank names its known implementations when asked for an unknown one), and
# today's path with waiters that sleep at once (no spin, no yield: the waits before ShmComm's
# yield), where this build has it.
shm_impls=tandem-shm
if [[ " $modes " == *" shm "* && -x $tandemrun ]] && wanted shm; then
  known=$("$tandemrun" --standalone --nproc-per-node 1 "$rank_program" --mode shm --impls '?' \
    --sizes 4096 --runs 1 --iters 1 2>&1 | sed -n 's/.*known://p' | head -1 || true)
  if [[ " $known " == *" tandem-shm-segment "* ]]; then
    shm_impls=tandem-shm-segment,tandem-shm
    [[ " $known " == *" tandem-shm-nospin "* ]] && shm_impls+=,tandem-shm-nospin
  else
    echo "tandem-shm-segment: not in this build (bench_allreduce_rank --mode shm knows:${known:- nothing})" >>"$notes"
  fi
fi

# --- The parts, per rank count ---------------------------------------------------------------

result_args=()
all_runs=$runs all_iters=$iters over_counts=""
for n in ${rank_counts//,/ }; do
  results=$tmp/results-$n.txt
  : >"$results"
  result_args+=("$n=$results")
  over=()
  runs=$all_runs iters=$all_iters
  if ((n > nproc)); then
    over=(--oversubscribe)
    runs=$((all_runs < 3 ? all_runs : 3)) iters=$((all_iters < 7 ? all_iters : 7))
    over_counts="$runs runs x $iters iterations"
  fi
  echo "=== $n ranks$( ((n > nproc)) && echo ", oversubscribed on $nproc CPUs")" >&2

  # tandem-local (threads) and memcpy, interleaved in one process: memcpy once, at 2 ranks.
  if wanted local && ((n == 2)); then
    if [[ -x $bench ]]; then
      part "local@$n" "$bench" --ranks "$n" --runs "$runs" --iters "$iters"
    else
      note_missing local "no $bench"
    fi
  fi

  # tandem-gloo, tandem-gloo-nocheck, raw-gloo, in the same processes (TCP: 2 ranks only).
  if wanted gloo && ((n == 2)); then
    if [[ " $modes " == *" gloo "* && -x $tandemrun ]]; then
      mkdir -p "$tmp/gloo-store"
      part "gloo@$n" "$tandemrun" --standalone --nproc-per-node "$n" "$rank_program" --mode gloo \
        --store-dir "$tmp/gloo-store" --runs "$runs" --iters "$iters" "${sizes_flag[@]}"
    else
      note_missing gloo "no $rank_program with Gloo, or no $tandemrun"
    fi
  fi

  # tandem-mpi and raw MPI_Allreduce in the same processes (MPI_THREAD_MULTIPLE, as MpiComm asks);
  # then raw MPI alone after a plain MPI_Init (a plain MPI program; often faster on a busy host).
  if wanted mpi; then
    if [[ " $modes " == *" mpi "* ]] && command -v mpirun >/dev/null; then
      part "mpi@$n" mpirun -n "$n" "${over[@]}" --bind-to none "$rank_program" --mode mpi \
        --runs "$runs" --iters "$iters" "${sizes_flag[@]}"
      part "mpi-single@$n" mpirun -n "$n" "${over[@]}" --bind-to none "$rank_program" --mode mpi \
        --mpi-thread single --runs "$runs" --iters "$iters" "${sizes_flag[@]}"
    else
      note_missing mpi "no $rank_program with MPI, or no mpirun"
    fi
  fi

  # tandem-shm (and tandem-shm-segment): ShmComm under tandemrun, interleaved in the same processes.
  if wanted shm; then
    if [[ " $modes " == *" shm "* && -x $tandemrun ]]; then
      part "shm@$n" "$tandemrun" --standalone --nproc-per-node "$n" "$rank_program" --mode shm \
        --impls "$shm_impls" --runs "$runs" --iters "$iters" "${sizes_flag[@]}"
    else
      note_missing shm "no $rank_program with ShmComm, or no $tandemrun"
    fi
  fi

  # oneCCL, two ways: its default transport (ATL/OFI, libfabric's shm provider) under tandemrun,
  # and ATL/MPI over the Intel MPI runtime it depends on (impi-rt), under that MPI's mpiexec.
  # CCL_WORKER_OFFLOAD=0 runs each collective on the calling thread: with oneCCL's default worker
  # thread, ranks x 2 busy threads share the CPUs (measured here: 58 ms at 4 KiB instead of 7 us).
  if ((oneccl_ready)) && [[ -x $tandemrun ]]; then
    mkdir -p "$tmp/oneccl-$n" "$tmp/oneccl-impi-$n"
    part "oneccl@$n" env CCL_WORKER_OFFLOAD=0 CCL_ATL_SHM=1 CCL_PROCESS_LAUNCHER=none \
      "$tandemrun" --standalone --nproc-per-node "$n" "$oneccl_program" \
      --store-dir "$tmp/oneccl-$n" --runs "$runs" --iters "$iters" "${sizes_flag[@]}"
    part "oneccl-impi@$n" env PATH="$oneccl_venv/bin:$PATH" CCL_WORKER_OFFLOAD=0 \
      CCL_ATL_TRANSPORT=mpi "$oneccl_venv/bin/mpiexec" -n "$n" "$oneccl_program" \
      --label oneccl-impi --store-dir "$tmp/oneccl-impi-$n" --runs "$runs" --iters "$iters" \
      "${sizes_flag[@]}"
  fi

  # DeepSpeed's shm all_reduce and torch.distributed over gloo: python ranks started by hand.
  if ((deepspeed_ready)); then
    by_hand "deepspeed@$n" "$python" "$here/allreduce_torch.py" --impl deepspeed-shm \
      --deepspeed-src "$deepspeed_src" --pybind11-include "$pybind11_dir/pybind11/include" \
      --build-dir "$deepspeed_build" --runs "$runs" --iters "$iters" "${sizes_flag[@]}"
  fi
  if wanted torch; then
    if "$python" -c 'import torch.distributed' 2>/dev/null; then
      by_hand "torch@$n" "$python" "$here/allreduce_torch.py" --runs "$runs" --iters "$iters" \
        "${sizes_flag[@]}"
    else
      note_missing torch "no torch for $python"
    fi
  fi
done

load_after=$(cut -d' ' -f1-3 /proc/loadavg)

# Facts for the header of the results file.
compiler=$(sed -n 's/^CMAKE_CXX_COMPILER:[A-Z]*=//p' "$build/CMakeCache.txt" 2>/dev/null || true)
version_of() { dpkg-query -W -f '${Version}' "$1" 2>/dev/null || echo unknown; }
pip_version() { sed -n 's/^Version: //p' "$1"/*"$2"-*.dist-info/METADATA 2>/dev/null | head -1; }
export BENCH_DATE=$started
export BENCH_COMMAND=$command_line
export BENCH_RUNS=$all_runs BENCH_ITERS=$all_iters BENCH_OVER_COUNTS=$over_counts
export BENCH_LOAD_BEFORE=$load_before BENCH_LOAD_AFTER=$load_after
export BENCH_NPROC=$nproc
export BENCH_CPU=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')
export BENCH_MEMORY=$(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo)
export BENCH_KERNEL=$(uname -sr)
export BENCH_OS=$(. /etc/os-release && echo "$PRETTY_NAME")
export BENCH_COMPILER=$({ [[ -n $compiler ]] && "$compiler" --version | head -1; } || echo unknown)
export BENCH_BUILD_TYPE=$(sed -n 's/^CMAKE_BUILD_TYPE:[A-Z]*=//p' "$build/CMakeCache.txt" 2>/dev/null || echo unknown)
export BENCH_TANDEM=$(sed -n 's/#define TANDEM_VERSION_\(MAJOR\|MINOR\|PATCH\) //p' "$root/include/tandem/core/config.hpp" | paste -sd.)
export BENCH_TANDEM_COMMIT=$tandem_state
export BENCH_MODES=$modes
export BENCH_LOADS=${loads%, }
export BENCH_DURATIONS="${durations%, }; in all $SECONDS s"
export BENCH_GLOO="libgloo-dev $(version_of libgloo-dev)"
export BENCH_MPI=$(mpirun --version 2>/dev/null | head -1 || echo unknown)
export BENCH_TORCH=$("$python" -c 'import sys, torch; print(f"torch {torch.__version__} (python3-torch, Python {sys.version.split()[0]})")' 2>/dev/null || echo unknown)
site=$(ls -d "$oneccl_venv"/lib/python3*/site-packages 2>/dev/null | head -1 || true)
if ((oneccl_ready)); then
  export BENCH_ONECCL="oneCCL oneccl-cpu $(pip_version "$site" oneccl_cpu) from PyPI with impi-rt $(pip_version "$site" impi_rt) (g++ -O2; CCL_WORKER_OFFLOAD=0, and CCL_ATL_SHM=1 over OFI)"
else
  export BENCH_ONECCL="oneCCL not run"
fi
if ((deepspeed_ready)); then
  export BENCH_DEEPSPEED="DeepSpeed $deepspeed_version's shm_comm op (csrc/cpu/comm, -O2 -fopenmp, its builder's flags) built as a torch extension against $(version_of libtorch-dev) libtorch-dev"
else
  export BENCH_DEEPSPEED="DeepSpeed not run"
fi
export BENCH_NOTES=$(cat "$notes")

mkdir -p "$(dirname "$out")"
"$python" "$here/peers/allreduce_report.py" "${result_args[@]}" >"$out"
cat "$out"
echo "written: $out" >&2
exit "$failed"
