#!/usr/bin/env bash
# bench/zero/run_zero.sh - the ZeRO benchmark in one run: tandem's DDP, shard<1> and shard<2>
# with AdamW on 2 and 4 ranks as LocalComm threads and as GlooComm and ShmComm processes under
# tandemrun, beside PyTorch's DDP + AdamW and DDP + ZeroRedundancyOptimizer (gloo, the same
# parameter count); writes bench/results/zero.md (ratios, targets, the commit).
#   bench/zero/run_zero.sh [BUILD_DIR] [-- --params P --steps S --warmup W --bucket-mib M]
#   (BUILD_DIR defaults to build/release; it needs bench_zero and tools/tandemrun; --params
#   defaults to 124e6, about 2.5 GB per rank for DDP: 4 ranks need about 10 GB free)
# Needs: a Release build with TANDEM_BUILD_BENCH and TANDEM_BUILD_TOOLS (this script builds
# nothing); PyTorch with gloo in $TORCH_PYTHON (default /usr/bin/python3, Debian's torch).
# Every part fails unless its work happened (steps taken, parameters moved, ranks equal); the
# script then exits 1 and the results file names the failed parts.
set -euo pipefail

if [[ ${1:-} == -h || ${1:-} == --help ]]; then sed -n '2,12p' "$0"; exit 0; fi
root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
here=$root/bench/zero
build=$root/build/release
if (($#)) && [[ $1 != -- ]]; then build=$(realpath -m "$1"); shift; fi
[[ ${1:-} == -- ]] && shift
extra=("$@")  # bench_zero's and zero_torch.py's options
program=$build/bench/zero/bench_zero
tandemrun=$build/tools/tandemrun
torch_python=${TORCH_PYTHON:-/usr/bin/python3}
out=$root/bench/results/zero.md
[[ -x $program ]] || { echo "no $program: build the target bench_zero" >&2; exit 2; }
[[ -x $tandemrun ]] || { echo "no $tandemrun: build the target tandemrun" >&2; exit 2; }

# The parameter count both sides use (zero_bench's default unless --params is given).
params=124000000
for ((i = 0; i < ${#extra[@]}; ++i)); do
  [[ ${extra[i]} == --params ]] && params=$(awk -v p="${extra[i + 1]}" 'BEGIN { printf "%d", p }')
done

tmp=$(mktemp -d /tmp/tandem-bench-zero.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
export GLOO_SOCKET_IFNAME=lo
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
: >"$tmp/results.txt"

# part NAME IMPL BACKEND RANKS STAGE command...: runs one configuration; its RESULT line, or a
# failed line when it exits non-zero or prints none.
part() {
  local name=$1 impl=$2 backend=$3 ranks=$4 stage=$5
  shift 5
  echo "== $name: $*" >&2
  if timeout 1800 "$@" >"$tmp/$name.out" 2>&1 && grep -q 'RESULT ' "$tmp/$name.out"; then
    grep -oE 'RESULT .*' "$tmp/$name.out" | tee -a "$tmp/results.txt" >&2
  else
    echo "$name failed:" >&2
    tail -20 "$tmp/$name.out" >&2
    echo "RESULT impl=$impl backend=$backend ranks=$ranks stage=$stage failed" >>"$tmp/results.txt"
  fi
}

for ranks in 2 4; do
  for stage in 0 1 2; do
    part "local-$ranks-$stage" tandem local "$ranks" "$stage" \
      "$program" local --ranks "$ranks" --stage "$stage" "${extra[@]}"
    for backend in gloo shm; do
      part "$backend-$ranks-$stage" tandem "$backend" "$ranks" "$stage" \
        "$tandemrun" --standalone --nproc-per-node "$ranks" "$program" "$backend" \
        --stage "$stage" "${extra[@]}"
    done
  done
  for zero in 0 1; do
    part "torch-$ranks-$zero" torch gloo "$ranks" "$zero" \
      "$torch_python" "$here/zero_torch.py" --ranks "$ranks" --zero "$zero" "${extra[@]}"
  done
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg)

commit=$(git -C "$root" rev-parse --short HEAD)
git -C "$root" diff --quiet HEAD -- include/tandem/{arena,comm,core,ddp,optim,tensor} bench/zero || commit="$commit (with uncommitted changes)"
{
  echo "# ZeRO: memory and step time of shard<1> and shard<2>"
  echo
  if ((params < 124000000)); then
    echo "**Small verification run** (--params $params): it checks the benchmark end to end on a shared machine; the numbers are not the issue's measurement. **The 124 M parameter run is pending** (\`bench/zero/run_zero.sh\` with no --params)."
    echo
  fi
  echo "- Date: $(date -u '+%Y-%m-%d %H:%M UTC'); commit $commit. Produced by \`bench/zero/run_zero.sh ${build#"$root"/}${extra[*]:+ -- ${extra[*]}}\`."
  echo "- Device: $(nproc) CPUs ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')), $(awk '/MemTotal/ { printf "%.0f GiB", $2 / 1048576 }' /proc/meminfo) memory, no GPU used; load average (1, 5, 15 min) $load_before before, $load_after after (a VM shared with other work: times are noisy)."
  echo "- Build: $(grep -m1 CMAKE_BUILD_TYPE: "$build/CMakeCache.txt" | cut -d= -f2), $(c++ --version | head -1). PyTorch: $("$torch_python" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo none) ($torch_python), one thread per rank."
  echo "- Model: $params float32 parameters in 12 tensors; synthetic backward g = 1e-3 w + c (one element-wise pass, no forward work) on both sides; AdamW (lr 1e-3, weight decay 0.01); DDP buckets of 25 MiB; tandem with \`overlap\`. Each part checks that its work happened (every rank took all its steps, the parameters moved, all ranks equal) or fails."
  echo "- Memory per rank: processes (gloo, shm, PyTorch) report the largest rank's VmHWM/VmRSS; threads (local) share one process, so their figure is the process's divided by the ranks. ShmComm's shared segments count in every process that maps them."
  echo
} >"$tmp/header.md"
status=0
python3 "$here/zero_report.py" "$tmp/results.txt" "$out.new" --header "$tmp/header.md" || status=$?
mv "$out.new" "$out"
echo "wrote $out" >&2
exit "$status"
