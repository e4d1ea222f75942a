#!/usr/bin/env bash
# bench/torch_resnet/run_sync_bn.sh - SyncBatchNorm's cost on the ResNet example: the seconds of
# training of the first STEPS steps with SyncBatchNorm and with per-rank BatchNorm (--no-sync-bn),
# 2 ranks on the default backend, runs interleaved ROUNDS times so that a shared machine's drift
# falls on both alike; optionally a second build of the example (BASE, e.g. an older commit's)
# interleaved too. Prints one line per run and the medians and ratios.
#   bench/torch_resnet/run_sync_bn.sh [BUILD_DIR] [BASE_PROGRAM]   (STEPS=100 ROUNDS=3)
# Needs: torch_resnet and tandemrun built (Release), dataset-fashion-mnist.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-build/release}
case $build in /*) ;; *) build=$root/$build ;; esac
program=$build/examples/torch_resnet/torch_resnet
tandemrun=$build/tools/tandemrun
base=${2:-}
steps=${STEPS:-100}
rounds=${ROUNDS:-3}
for f in "$program" "$tandemrun" ${base:+"$base"}; do [[ -x $f ]] || { echo "missing $f" >&2; exit 1; }; done
configs=(sync nosync)
[[ -n $base ]] && configs+=(base)
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg); $steps steps, $rounds rounds"
results=$(mktemp)
trap 'rm -f "$results"' EXIT
for ((round = 1; round <= rounds; ++round)); do
  for config in "${configs[@]}"; do
    prog=$program flags=()
    [[ $config == base ]] && prog=$base
    [[ $config == nosync ]] && flags=(--no-sync-bn)
    output=$("$tandemrun" --standalone --nproc-per-node 2 "$prog" --epochs 1 --max-steps "$steps" \
      "${flags[@]}" 2>&1)
    seconds=$(sed -n 's/.*after \([0-9.]*\) s of training.*/\1/p' <<<"$output")
    [[ -n $seconds ]] || { echo "FAILED: $config printed no training time" >&2; exit 1; }
    # The timed work happened: the run's last line counts the steps it took.
    took=$(sed -n 's/.*test accuracy .* after \([0-9]*\) steps on 2 ranks.*/\1/p' <<<"$output")
    [[ $took == "$steps" ]] || {
      echo "FAILED: $config took ${took:-no} steps, not $steps" >&2
      exit 1
    }
    echo "$config $round $seconds" | tee -a "$results"
  done
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
python3 - "$results" <<'PY'
import sys, statistics
runs = {}
for line in open(sys.argv[1]):
    config, _, seconds = line.split()
    runs.setdefault(config, []).append(float(seconds))
median = {c: statistics.median(v) for c, v in runs.items()}
for c, v in runs.items():
    print(f"{c}: median {median[c]:.2f} s of {len(v)} runs ({', '.join(f'{x:.2f}' for x in v)})")
print(f"SyncBatchNorm / per-rank BatchNorm: {median['sync'] / median['nosync']:.2f}x (target <= 1.05)")
if "base" in median:
    print(f"base SyncBatchNorm / per-rank BatchNorm: {median['base'] / median['nosync']:.2f}x; "
          f"SyncBatchNorm / base: {median['sync'] / median['base']:.2f}x")
PY
