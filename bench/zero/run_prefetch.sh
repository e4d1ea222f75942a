#!/usr/bin/env bash
# bench/zero/run_prefetch.sh - ZeRO's parameter prefetch (the prefetch_parameters policy) against
# the synchronous gather and plain DDP, in one run, on every engine bench_zero has: LocalComm
# threads, ShmComm and GlooComm processes under tandemrun, MpiComm processes under mpirun. Each
# engine runs DDP, shard<1>, shard<1> + prefetch_parameters, shard<2> and shard<2> +
# prefetch_parameters with --forward 1 (a forward pass that reads each tensor in registration
# order, where the prefetch has something to overlap), and the step time (barrier to barrier: a
# gather left in flight counts) is compared with the same engine's DDP in that run. Appends a
# dated section to bench/results/zero.md.
#   bench/zero/run_prefetch.sh [BUILD_DIR] [-- bench_zero options]   (default build/release;
#   RANKS="2 4" for the world sizes, default 2; ENGINES, default "local shm gloo mpi";
#   BASELINE=BUILD_DIR to run another build's bench_zero (e.g. the commit before a change) beside
#   it, part by part, its rows named ENGINE-baseline; REPEATS=N to run every part N times, each
#   row then the median run's (even N: the faster middle one); STEP=fastest to compare each
#   part's fastest timed step (bench_zero's fastest_step_ms) instead of the median one, where
#   other work shares the machine; RESULTS=FILE to write the report of an earlier run's RESULT
#   lines without running)
# Needs: bench_zero and tools/tandemrun built (Release), OpenMPI's mpirun for the MPI engine.
# Fails (exit 1) when a part fails; bench_zero itself fails unless its work happened.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=$root/build/release
if (($#)) && [[ $1 != -- ]]; then build=$(realpath -m "$1"); shift; fi
[[ ${1:-} == -- ]] && shift
extra=("$@")
program=$build/bench/zero/bench_zero
tandemrun=$build/tools/tandemrun
out=$root/bench/results/zero.md
[[ -x $program && -x $tandemrun ]] || { echo "build bench_zero and tandemrun in $build" >&2; exit 2; }
export GLOO_SOCKET_IFNAME=lo OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
tmp=$(mktemp -d /tmp/tandem-bench-prefetch.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
status=0
# RESULTS=FILE: no runs, the report of FILE's RESULT lines (a run whose report failed).
if [[ -n ${RESULTS:-} ]]; then grep -oE 'RESULT .*' "$RESULTS" >"$tmp/results.txt"; RANKS=none; fi
builds=("$build")
if [[ -n ${BASELINE:-} ]]; then
  baseline=$(realpath -m "$BASELINE")
  [[ -x $baseline/bench/zero/bench_zero && -x $baseline/tools/tandemrun ]] ||
    { echo "build bench_zero and tandemrun in $baseline" >&2; exit 2; }
  builds=("$baseline" "$build")
fi
for ranks in ${RANKS:-2}; do
  [[ $ranks == none ]] && break
  for engine in ${ENGINES:-local shm gloo mpi}; do
    for config in "0 0" "1 0" "1 1" "2 0" "2 1"; do
      read -r stage prefetch <<<"$config"
      flags=(--stage "$stage" --prefetch "$prefetch" --forward 1 "${extra[@]}")
      for ((repeat = 0; repeat < ${REPEATS:-1}; ++repeat)); do
        for dir in "${builds[@]}"; do  # the baseline first, then this build, part by part
          name=$engine
          [[ $dir != "$build" ]] && name=$engine-baseline
          bin=$dir/bench/zero/bench_zero
          case $engine in
            local) cmd=("$bin" local --ranks "$ranks" "${flags[@]}") ;;
            mpi) cmd=(mpirun -n "$ranks" --oversubscribe --bind-to none "$bin" mpi "${flags[@]}") ;;
            *) cmd=("$dir/tools/tandemrun" --standalone --nproc-per-node "$ranks" "$bin" "$engine" "${flags[@]}") ;;
          esac
          echo "== $name $ranks ranks stage $stage prefetch $prefetch" >&2
          if timeout 1800 "${cmd[@]}" >"$tmp/part.out" 2>&1 && grep -q 'RESULT ' "$tmp/part.out"; then
            grep -oE 'RESULT .*' "$tmp/part.out" | sed "s/ backend=$engine / backend=$name /" |
              tee -a "$tmp/results.txt" >&2
          else
            tail -20 "$tmp/part.out" >&2
            echo "RESULT impl=tandem backend=$name ranks=$ranks stage=$stage prefetch=$prefetch failed" >>"$tmp/results.txt"
            status=1
          fi
        done
      done
    done
  done
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg)
if [[ -n ${RESULTS:-} ]]; then  # the loads of the run that printed them, where given
  load_before=${LOAD_BEFORE:-unknown} load_after=${LOAD_AFTER:-unknown}
fi
if [[ -n ${COMMIT:-} ]]; then
  commit=$COMMIT  # a copy of the tree without its git directory (a lent machine) is told it
else
  commit=$(git -C "$root" rev-parse --short HEAD)
  git -C "$root" diff --quiet HEAD -- include/tandem bench/zero || commit="$commit (with uncommitted changes)"
fi
baseline_text=""
[[ -n ${BASELINE:-} ]] && baseline_text="BASELINE=${BASELINE_NAME:-$BASELINE}"
[[ ${REPEATS:-1} != 1 ]] && baseline_text="$baseline_text REPEATS=$REPEATS"
[[ ${STEP:-median} == fastest ]] && baseline_text="$baseline_text STEP=fastest"
python3 - "$tmp/results.txt" "$out" "$commit" "$load_before" "$load_after" "$(nproc)" "${extra[*]}" "$baseline_text" "${STEP:-median}" <<'PY'
import sys, datetime
results, out, commit, before, after, cpus, extra, how, step = sys.argv[1:10]
field = "fastest_step_ms" if step == "fastest" else "step_ms"
rows = []
for line in open(results):
    fields = dict(f.split("=", 1) for f in line.split()[1:] if "=" in f)
    fields["failed"] = line.strip().endswith(" failed")
    rows.append(fields)
key = lambda r: (r["backend"], int(r["ranks"]), int(r["stage"]), int(r.get("prefetch", 0)))
# Repeated parts: the median run's row (a failed run counts as the slowest; of an even count's two
# middle runs, the faster: the one less disturbed by other work).
runs = {}
for r in rows:
    runs.setdefault(key(r), []).append(r)
slowest = lambda r: float("inf") if r["failed"] else float(r[field])
by = {k: sorted(v, key=slowest)[(len(v) - 1) // 2] for k, v in runs.items()}
now = datetime.datetime.utcnow().strftime("%Y-%m-%d %H:%M UTC")
# The 1-minute load before the run, against the CPUs: above them, other work had the machine.
if before == "unknown":
    busy = "the load was not recorded: compare within a row's engine"
elif float(before.split()[0]) > int(cpus):
    busy = "other work was running: times are noisy, compare within a row's engine"
else:
    busy = "no more load than the CPUs before the run: the runs' own ranks load it while they run"
lines = ["", f"## Prefetch: the parameter all_gather overlapped with the next forward ({now})", "",
         f"- Commit {commit}; `{(how.strip() + ' ') if how.strip() else ''}bench/zero/run_prefetch.sh`{' -- ' + extra if extra else ''}; "
         f"{cpus} CPUs, load average (1, 5, 15 min) {before} before, {after} after ({busy}).",
         "- Every part with `--forward 1`: a forward pass reads each tensor in registration order "
         "(under `prefetch_parameters` after `ddp.wait_parameters(p)`), then the synthetic "
         "backward; step = barrier to barrier, so a gather left in flight is counted" +
         ("; each part's fastest timed step (of its slowest rank's)." if field != "step_ms"
          else "."), "",
         "| engine | ranks | DDP ms | shard<1> ms | shard<1> + prefetch ms | shard<2> ms | "
         "shard<2> + prefetch ms | shard<1> / DDP | prefetch<1> / DDP | shard<2> / DDP | "
         "prefetch<2> / DDP |", "|---|---|---|---|---|---|---|---|---|---|---|"]
targets = []
for backend, ranks in sorted({(k[0], k[1]) for k in by}, key=lambda k: (k[1], k[0])):
    ms = {}
    for cfg in ((0, 0), (1, 0), (1, 1), (2, 0), (2, 1)):
        r = by.get((backend, ranks) + cfg)
        ms[cfg] = float(r[field]) if r and not r["failed"] else None
    base = ms[(0, 0)]
    cell = lambda v: "failed" if v is None else f"{v:.1f}"
    ratio = lambda v: "-" if v is None or not base else f"{v / base:.2f}"
    lines.append(f"| {backend} | {ranks} | " + " | ".join(cell(ms[c]) for c in ms if c != (0, 0) or True)
                 + " | " + " | ".join(ratio(ms[c]) for c in ((1, 0), (1, 1), (2, 0), (2, 1))) + " |")
    for stage in (1, 2):
        v = ms[(stage, 1)]
        if v is not None and base:
            targets.append(f"- {backend}, {ranks} ranks, shard<{stage}> + prefetch: "
                           f"{v / base:.2f}x DDP's step (target <= 1.10: "
                           f"{'met' if v <= 1.10 * base else 'NOT met'})")
lines += [""] + targets + ["", "Raw lines:", "", "```"]
lines += [l.rstrip() for l in open(results)] + ["```", ""]
with open(out, "a") as f:
    f.write("\n".join(lines))
print(f"appended to {out}", file=sys.stderr)
PY
exit "$status"
