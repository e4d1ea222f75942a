#!/usr/bin/env bash
# Runs the training-step benchmark in one command: the host passes (bench_step) and, right after,
# its PyTorch CPU peer (step_torch_cpu.py, the same threads) with the ratio of the training steps;
# where a GPU is, the device passes (bench_step_cuda) beside the PyTorch peer (step_torch.py,
# PyTorch 2.x with CUDA). Prints the Markdown tables for bench/results/step.md. Any benchmark
# that finds its timed work did not happen (skipped steps) fails the script.
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

# A Python with PyTorch for the peers: $TORCH_PYTHON, else the first of python3 and
# /usr/bin/python3 (Debian's) that imports torch.
torch_python="${TORCH_PYTHON:-}"
if [[ -z "$torch_python" ]]; then
  for candidate in python3 /usr/bin/python3; do
    if "$candidate" -c "import torch" >/dev/null 2>&1; then torch_python="$candidate"; break; fi
  done
fi
# The peers take the same arguments but --threads (bench_step's, given to step_torch_cpu.py once).
peer_args=()
skip_next=0
for arg in "$@"; do
  if [[ $skip_next -eq 1 ]]; then skip_next=0; continue; fi
  if [[ "$arg" == "--threads" ]]; then skip_next=1; continue; fi
  peer_args+=("$arg")
done
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT

echo "## Host ($(nproc) cores, $(date -u '+%Y-%m-%d %H:%M UTC'))"
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
"$build/bench/step/bench_step" "$@" | tee "$out/host.txt"
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
threads="$(sed -n 's/.*fused threads \([0-9]*\)).*/\1/p' "$out/host.txt")"
if [[ -n "$torch_python" ]]; then
  echo
  echo "### PyTorch on the host, same threads ($threads), right after"
  "$torch_python" "$here/step_torch_cpu.py" --threads "$threads" "${peer_args[@]}" |
    tee "$out/torch_cpu.txt"
  awk -v threads="$threads" '
    /^RESULT pass="AdamW training step, amp::FusedStep, / && $0 ~ ("FusedStep, " threads " thread") {
      split($0, a, "seconds="); split(a[2], b, " "); fused = b[1] }
    /^RESULT pass="AdamW training step, unfused/ { split($0, a, "seconds="); split(a[2], b, " "); unfused = b[1] }
    /^RESULT impl=torch-cpu pass="AdamW training step/ { split($0, a, "seconds="); split(a[2], b, " "); torch = b[1] }
    END {
      if (fused > 0 && torch > 0)
        printf("RATIO host training step: PyTorch %.1f ms / tandem FusedStep %.1f ms = %.2fx (unfused tandem %.1f ms: %.2fx)\n",
               torch * 1e3, fused * 1e3, torch / fused, unfused * 1e3, torch / unfused)
    }' "$out/host.txt" "$out/torch_cpu.txt"
else
  echo "PyTorch peer skipped: no Python here imports torch (set TORCH_PYTHON)"
fi

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
"${torch_python:-python3}" "$here/step_torch.py" "${peer_args[@]}" || status=$?
if [[ $status -ne 0 && $status -ne 77 ]]; then exit "$status"; fi
