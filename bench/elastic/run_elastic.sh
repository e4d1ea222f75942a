#!/usr/bin/env bash
# The main job (examples/fashion_mnist, its default CPU backend: shared memory) under a kill
# schedule, three ways (issue 32; bench/results/elastic.md):
#   undisturbed  tandemrun --standalone, no kill;
#   elastic      tandemrun --standalone --elastic, the example with --elastic: one worker
#                SIGKILLed every KILL_EVERY s for KILL_FOR s; the survivors heal (tandem::Elastic)
#                and go on. With survivors only (tandemrun restarting no worker) a kill needs a
#                second live worker, so at most NPROC - 1 kills happen; where tandemrun restarts
#                the lost worker (the "heal" branch: a replacement heals from a peer), the
#                schedule runs in full. The script reports which mode it saw.
#   replace      tandemrun --standalone --elastic --max-restarts 100: the same schedule; tandemrun
#                starts a replacement for each lost worker, which joins the running group (the
#                example's on_join: the training state from a live member), so the world size
#                comes back and the schedule runs in full.
#   restarts     tandemrun --standalone --max-restarts: the same schedule, each kill restarting
#                every worker from the newest checkpoint (--checkpoint-dir, --resume; one per
#                epoch).
# Each run must finish, state its steps and test accuracy (the script fails otherwise); the table
# gives wall time, samples trained per second, kills, heals or restarts (and how many of those
# resumed from a checkpoint rather than starting over), the wall time over the undisturbed run's
# divided by the kills (what a kill cost --max-restarts; with survivors only, --elastic's world
# shrinks, which on a machine with fewer cores than ranks can make the rest faster), the heals'
# own time and the time of the step during which each heal happened (the example's "the heal
# took T ms, the step X ms": the work lost in flight, the detection, the heal and the step taken
# again; what a kill cost --elastic), and the final test accuracy.
#   bench/elastic/run_elastic.sh [BUILD_DIR]     a Release build with tandemrun and fashion_mnist
# Environment: NPROC (ranks, default 4), EPOCHS (default 30: long enough to outlast the
# schedule), KILL_EVERY (s, default 10), KILL_FOR (s, default 120), KILLS (the most kills per
# run, default no limit but the schedule's; KILLS=NPROC-1 gives --max-restarts the kills that
# survivors-only --elastic can take), MODES (default "undisturbed elastic restarts"; "replace" adds
# the replacement mode), EXTRA (more
# flags for the example).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
build="${1:-$root/build/elastic-bench}"
nproc_per_node=${NPROC:-4}
epochs=${EPOCHS:-30}
kill_every=${KILL_EVERY:-10}
kill_for=${KILL_FOR:-120}
max_kills=${KILLS:-1000000}
modes=${MODES:-undisturbed elastic restarts}
read -r -a extra <<<"${EXTRA:-}"
if [[ ! -x "$build/tools/tandemrun" || ! -x "$build/examples/fashion_mnist/fashion_mnist" ]]; then
  echo "run_elastic.sh: configuring and building $build (Release: tandemrun, fashion_mnist)" >&2
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTANDEM_BUILD_TOOLS=ON \
    -DTANDEM_BUILD_EXAMPLES=ON -DTANDEM_WITH_SHM=ON -DTANDEM_WITH_GLOO=ON -DTANDEM_WITH_DATA=ON \
    -DTANDEM_WITH_IO=ON -DTANDEM_BUILD_TESTS=OFF -DTANDEM_WITH_MPI=OFF -DTANDEM_WITH_CUDA=OFF \
    -DTANDEM_WITH_TORCH=OFF >/dev/null
  nice cmake --build "$build" --target tandemrun fashion_mnist -j 2 >/dev/null
fi
tandemrun="$build/tools/tandemrun"
program="$build/examples/fashion_mnist/fashion_mnist"
work=$(mktemp -d /tmp/tandem-bench-elastic.XXXXXX)
trap 'rm -rf "$work"' EXIT
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
flags=(--epochs "$epochs" --workers 0 "${extra[@]}")

# The worker processes tandemrun started (its children), one per line.
workers() { pgrep -P "$1" || true; }

# kill_schedule PID LOG: every kill_every s until kill_for s have passed, SIGKILL one worker of
# tandemrun PID (a random one among those alive; with survivors only, never the last one);
# appends "kill T" lines (T: seconds since the start) and a final "mode ..." line to LOG.
kill_schedule() {
  local launcher=$1 log=$2 start now alive victim most=0 fewest=999 replaced=0 done_kills=0
  start=$(date +%s.%N)
  while kill -0 "$launcher" 2>/dev/null && ((done_kills < max_kills)); do
    sleep "$kill_every"
    now=$(date +%s.%N)
    if awk -v n="$now" -v s="$start" -v f="$kill_for" 'BEGIN { exit !(n - s > f) }'; then break; fi
    mapfile -t alive < <(workers "$launcher")
    ((${#alive[@]} > most)) && most=${#alive[@]}
    ((${#alive[@]} < fewest)) && fewest=${#alive[@]}
    # A worker count back up after a kill: tandemrun restarted one (replacements).
    if ((${#alive[@]} > fewest)); then replaced=1; fi
    if ((${#alive[@]} < 2)); then continue; fi
    victim=${alive[$((RANDOM % ${#alive[@]}))]}
    if kill -KILL "$victim" 2>/dev/null; then
      echo "kill $(awk -v n="$now" -v s="$start" 'BEGIN { printf "%.1f", n - s }') pid $victim" \
        >>"$log"
      done_kills=$((done_kills + 1))
    fi
    fewest=$((${#alive[@]} - 1))
  done
  echo "mode replaced=$replaced" >>"$log"
}

# The median and the largest of numbers on stdin, one a line, as "M/L" (ms, rounded); "-" for
# none.
median_max() {
  sort -n | awk '{ v[NR] = $1 } END {
    if (NR == 0) print "-"
    else printf "%.0f/%.0f", (v[int((NR + 1) / 2)] + v[int(NR / 2) + 1]) / 2, v[NR] }'
}

# run NAME LAUNCHER-FLAGS -- PROGRAM-FLAGS: one run, timed, with the kill schedule unless
# undisturbed. Prints "NAME wall steps ranks accuracy kills heals restarts heal_ms_median".
run() {
  local name=$1
  shift
  local launcher_flags=() program_flags=()
  while [[ $1 != -- ]]; do launcher_flags+=("$1"); shift; done
  shift
  program_flags=("$@")
  local log="$work/$name.log" kills="$work/$name.kills" start end pid
  : >"$kills"
  start=$(date +%s.%N)
  "$tandemrun" --standalone --nproc-per-node "$nproc_per_node" "${launcher_flags[@]}" \
    "$program" "${flags[@]}" "${program_flags[@]}" >"$log" 2>&1 &
  pid=$!
  if [[ $name != undisturbed ]]; then kill_schedule "$pid" "$kills" & fi
  local status=0
  wait "$pid" || status=$?
  end=$(date +%s.%N)
  wait || true
  if ((status != 0)); then
    tail -30 "$log" >&2
    echo "run_elastic.sh: the $name run failed (exit $status)" >&2
    exit 1
  fi
  local final
  final=$(grep "test accuracy .* after [0-9]* steps on [0-9]* ranks" "$log" | tail -1) || {
    tail -30 "$log" >&2
    echo "run_elastic.sh: the $name run stated no final accuracy" >&2
    exit 1
  }
  local accuracy steps ranks
  accuracy=$(sed -E 's/.*test accuracy ([0-9.]+) %.*/\1/' <<<"$final")
  steps=$(sed -E 's/.* after ([0-9]+) steps.*/\1/' <<<"$final")
  ranks=$(sed -E 's/.* on ([0-9]+) ranks.*/\1/' <<<"$final")
  local kill_count heal_count restart_count resumed_count heal_ms step_ms join_count join_ms
  kill_count=$(grep -c '^kill' "$kills" || true)
  heal_count=$(grep -c 'healed during step' "$log" || true)
  restart_count=$(grep -c 'restarting the workers (restart' "$log" || true)
  resumed_count=$(grep -c 'resumed from' "$log" || true)
  heal_ms=$(grep -o 'the heal took [0-9.]* ms' "$log" | awk '{ print $4 }' | median_max)
  step_ms=$(grep -o 'ms, the step [0-9.]* ms' "$log" | awk '{ print $4 }' | median_max)
  join_count=$(grep -c 'replacement(s) joined after step' "$log" || true)
  join_ms=$(grep -o 'the join took [0-9.]* ms' "$log" | awk '{ print $4 }' | median_max)
  if ((steps == 0)); then
    echo "run_elastic.sh: the $name run trained no step" >&2
    exit 1
  fi
  if [[ $name == elastic || $name == replace ]]; then
    grep '^mode' "$kills" >>"$work/modes" || true
  fi
  echo "$name $(awk -v e="$end" -v s="$start" 'BEGIN { printf "%.1f", e - s }') $steps $ranks" \
    "$accuracy $kill_count $heal_count/$join_count $restart_count/$resumed_count $heal_ms" \
    "$step_ms $join_ms"
}

echo "## Elastic training on the main job ($(date -u '+%Y-%m-%d %H:%M UTC'))"
echo
echo "commit $(git -C "$root" rev-parse --short HEAD), $(nproc) cores, load average before:" \
  "$(cut -d' ' -f1-3 /proc/loadavg); $nproc_per_node ranks, $epochs epochs (batch 64 per rank)," \
  "one worker SIGKILLed every $kill_every s for $kill_for s${KILLS:+, at most $KILLS kills}"
echo
results=()
for mode in $modes; do
  case $mode in
    undisturbed) results+=("$(run undisturbed --)") ;;
    elastic) results+=("$(run elastic --elastic -- --elastic --elastic-store "file://$work/store")") ;;
    replace)
      results+=("$(run replace --elastic --max-restarts 100 -- --elastic \
        --elastic-store "file://$work/replace-store")") ;;
    restarts)
      results+=("$(run restarts --max-restarts 100 -- --checkpoint-dir "$work/ckpt" --resume)") ;;
    *) echo "run_elastic.sh: unknown mode $mode" >&2; exit 2 ;;
  esac
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
if grep -q 'replaced=1' "$work/modes" 2>/dev/null; then
  echo "elastic mode measured: lost workers replaced by tandemrun (they heal from a peer)"
else
  echo "elastic mode measured: survivors only (no worker replaced; at most $((nproc_per_node - 1))" \
    "kills)"
fi
echo
echo "| run | wall s | steps | ranks at end | samples/s | kills | heals/joins | restarts/resumed |" \
  "wall s over undisturbed per kill | heal ms median/max | step with the heal ms median/max |" \
  "join ms median/max | test accuracy % |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
base_wall=""
for line in "${results[@]}"; do
  read -r name wall steps ranks accuracy kills heals restarts heal_ms step_ms join_ms <<<"$line"
  [[ $name == undisturbed ]] && base_wall=$wall
  lost="-"
  if [[ -n $base_wall && $kills -gt 0 ]]; then
    lost=$(awk -v w="$wall" -v b="$base_wall" -v k="$kills" 'BEGIN { printf "%.2f", (w - b) / k }')
  fi
  samples=$(awk -v w="$wall" -v e="$epochs" 'BEGIN { printf "%.0f", e * 60000 / w }')
  echo "| $name | $wall | $steps | $ranks | $samples | $kills | $heals | $restarts | $lost |" \
    "$heal_ms | $step_ms | $join_ms | $accuracy |"
done
