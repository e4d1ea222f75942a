#!/usr/bin/env bash
# Runs the training-step benchmark in one command: the host passes (bench_step), and where a GPU
# is, the device passes (bench_step_cuda) beside the PyTorch peer (step_torch.py, PyTorch 2.x with
# CUDA). Prints the Markdown tables for bench/results/step.md.
#   bench/step/run_step.sh BUILD_DIR [CUDA_BUILD_DIR] [-- extra bench args, e.g. --params 1e6]
# BUILD_DIR: a Release build with -DTANDEM_BUILD_BENCH=ON; CUDA_BUILD_DIR: the same with CUDA.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
build="${1:?usage: run_step.sh BUILD_DIR [CUDA_BUILD_DIR] [-- bench args]}"
shift
cuda_build=""
if [[ $# -gt 0 && "$1" != "--" ]]; then
  cuda_build="$1"
  shift
fi
[[ $# -gt 0 && "$1" == "--" ]] && shift

echo "## Host ($(nproc) cores, $(date -u '+%Y-%m-%d %H:%M UTC'))"
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
"$build/bench/step/bench_step" "$@"
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"

if [[ -z "$cuda_build" ]]; then
  echo "GPU part: no CUDA build directory given"
  exit 0
fi
echo
echo "## GPU"
status=0
"$cuda_build/bench/step/bench_step_cuda" "$@" || status=$?
if [[ $status -eq 77 ]]; then
  echo "GPU part skipped: no CUDA device"
  exit 0
fi
[[ $status -eq 0 ]] || exit "$status"
python3 "$here/step_torch.py" "$@" || status=$?
if [[ $status -ne 0 && $status -ne 77 ]]; then exit "$status"; fi
