#!/usr/bin/env bash
# bench/flight_recorder/run_flight_recorder.sh - what the flight recorder costs: per operation
# (bench_flight_recorder: the ring alone, and a 4-byte all_reduce with it on and off) and on the
# main job's step (fashion_mnist, 2 ranks, one epoch of the benchmark's recipe, with the recorder
# on - the default - and off, TANDEM_FLIGHT_RECORDER_SIZE=0, interleaved run by run) on the main
# job's default backend under tandemrun and on threads. Writes bench/results/flight-recorder.md
# (or $FLIGHT_RECORDER_OUT). Fails when a run did not train its 469 steps.
#   bench/flight_recorder/run_flight_recorder.sh [BUILD_DIR (default build/release)] [RUNS (default 7)]
# Needs: fashion_mnist, tandemrun and bench_flight_recorder built (Release,
# TANDEM_BUILD_EXAMPLES=ON, TANDEM_BUILD_BENCH=ON, Gloo for the default backend), and
# dataset-fashion-mnist.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
build=${1:-build/release}
case $build in /*) ;; *) build=$root/$build ;; esac
runs=${2:-7}
program=$build/examples/fashion_mnist/fashion_mnist
tandemrun=$build/tools/tandemrun
micro=$build/bench/flight_recorder/bench_flight_recorder
for f in "$program" "$tandemrun" "$micro"; do [[ -x $f ]] || { echo "missing $f" >&2; exit 1; }; done
out=${FLIGHT_RECORDER_OUT:-$root/bench/results/flight-recorder.md}
tmp=$(mktemp -d /tmp/tandem-bench-flight.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
export GLOO_SOCKET_IFNAME=lo TANDEM_FLIGHT_RECORDER_DIR=$tmp/records
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
started=$(date -u '+%Y-%m-%d %H:%M UTC')

echo "--- bench_flight_recorder"
"$micro" 21 2000 | tee "$tmp/micro.txt"

# One epoch (469 steps of 64 per rank); "epoch 0: ... after S s of training" gives the seconds.
one_run() {  # name, recorder size, command...
  local name=$1 size=$2; shift 2
  local log=$tmp/$name.log
  TANDEM_FLIGHT_RECORDER_SIZE=$size "$@" --plain --epochs 1 >"$log" 2>&1 ||
    { cat "$log"; echo "FAILED: $name" >&2; exit 1; }
  local line
  line=$(grep -h "epoch 0: test accuracy" "$log" | tail -1)
  [[ $line == *"after "*" s of training"* ]] && grep -q "after 469 steps on 2 ranks" "$log" ||
    { cat "$log"; echo "FAILED: $name did not report one epoch of 469 steps" >&2; exit 1; }
  sed -n 's/.* after \([0-9.]*\) s of training.*/\1/p' <<<"$line" >>"$tmp/$name.seconds"
}
for ((i = 0; i < runs; ++i)); do
  echo "--- round $((i + 1)) of $runs"
  for side in on off; do  # alternate which side goes first
    [[ $((i % 2)) -eq 1 ]] && side=$([[ $side == on ]] && echo off || echo on)
    size=$([[ $side == on ]] && echo 2000 || echo 0)
    one_run "default_$side" "$size" "$tandemrun" --standalone --nproc-per-node 2 "$program"
    one_run "threads_$side" "$size" "$program" --backend local --ranks 2
  done
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg)

python3 - "$tmp" "$out" "$(git -C "$root" rev-parse --short HEAD)" "$started" "$load_before" \
  "$load_after" "$runs" <<'PY'
import os, statistics, sys
tmp, out, commit, started, load_before, load_after, runs = sys.argv[1:8]
def seconds(name):
    with open(os.path.join(tmp, name + ".seconds")) as f:
        return [float(x) for x in f.read().split()]
micro = open(os.path.join(tmp, "micro.txt")).read().strip().splitlines()
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
lines = ["# What the flight recorder costs", "",
         f"Run {started} at commit {commit} by `bench/flight_recorder/run_flight_recorder.sh` "
         f"(Release build), on {os.cpu_count()} CPUs ({cpu}), shared with other jobs: load average "
         f"{load_before} before, {load_after} after. Compare the ratios, not the absolute times.", "",
         "## Per operation", "",
         "`bench_flight_recorder 21 2000`: the ring alone (record and end on one thread), and a "
         "4-byte all_reduce on LocalComm with 2 ranks as threads - the smallest collective, where a "
         "fixed cost shows most - on a group recording (the default ring of 2000) and one not "
         "(size 0), interleaved; medians over 21 rounds of 2000 operations. Every result is checked.",
         "", "```"] + micro + ["```", "",
         "## On the main job's step", "",
         f"`fashion_mnist --plain --epochs 1` (469 steps of 64 per rank, 2 ranks): {runs} runs with "
         "the recorder on (the default) and as many with `TANDEM_FLIGHT_RECORDER_SIZE=0`, "
         "interleaved (which side goes first alternates); seconds of training of the epoch "
         "(evaluation excluded). A run that did not train its 469 steps fails the benchmark.", "",
         "| backend | recorder on: median s | off: median s | on / off (medians) | per step added | runs on (s) | runs off (s) |",
         "|---|---|---|---|---|---|---|"]
for key, label in (("default", "default (tandemrun, HierarchicalComm: shared memory)"),
                   ("threads", "threads (LocalComm)")):
    on, off = seconds(key + "_on"), seconds(key + "_off")
    mon, moff = statistics.median(on), statistics.median(off)
    lines.append(f"| {label} | {mon:.3f} | {moff:.3f} | {mon / moff:.3f} | "
                 f"{(mon - moff) / 469 * 1e6:+.1f} us | {', '.join(f'{x:.2f}' for x in on)} | "
                 f"{', '.join(f'{x:.2f}' for x in off)} |")
with open(out, "w") as f:
    f.write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
echo "wrote $out"
