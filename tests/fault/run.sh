#!/usr/bin/env bash
# tests/fault/run.sh - the fault-injection campaign: TRIALS trials (default 20) per backend, mode
# and fault, through tests/fault/fault_driver.py, and the figures in bench/results/faults.md.
#   tests/fault/run.sh [BUILD_DIR (default build/dev)] [TRIALS]
# Needs the build's fault_worker and tandemrun (TANDEM_BUILD_TOOLS=ON), Gloo and MPI built in
# (TANDEM_WITH_GLOO/MPI=ON), mpirun and python3. Runs niced; about 15 minutes on 2 cores. The
# "## Findings" section of an existing faults.md (written by hand) is kept.
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
build=$(cd "${1:-$root/build/dev}" && pwd)
trials=${2:-20}
timeout_ms=2000
worker=$build/tests/fault/fault_worker
tandemrun=$build/tools/tandemrun
out=$root/bench/results/faults.md
for tool in "$worker" "$tandemrun"; do
  [[ -x $tool ]] || { echo "run.sh: $tool is not built" >&2; exit 2; }
done
mpirun=$(command -v mpirun) || { echo "run.sh: no mpirun on PATH" >&2; exit 2; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

results=$(mktemp /tmp/tandem-faults-XXXXXX.jsonl)
log=${results%.jsonl}.log
echo "run.sh: trials in $results, their log in $log"
started=$(date -u +%s)
row() {  # backend mode fault ranks seed [timeout-ms [driver flags...]]
  echo "run.sh: $1 $2 $3, $4 ranks, timeout ${6:-$timeout_ms} ms, $trials trials" | tee -a "$log"
  nice python3 "$root/tests/fault/fault_driver.py" --worker "$worker" --tandemrun "$tandemrun" \
    --mpirun "$mpirun" --backend "$1" --mode "$2" --signal "$3" --world "$4" --seed "$5" \
    --trials "$trials" --timeout-ms "${6:-$timeout_ms}" --json "$results" "${@:7}" >> "$log" 2>&1 \
    || true
}
row local threads exit 2 101
row local threads stop 2 102
row gloo env kill 2 103
row gloo env stop 2 104
row gloo env kill 3 105
row gloo env stop 3 106
row gloo tandemrun kill 2 107
row gloo tandemrun stop 2 108
row shm env kill 2 112
row shm env stop 2 113
row hierarchical env kill 4 114 "$timeout_ms" --require-named
row hierarchical env stop 4 115 "$timeout_ms" --require-named
row mpi mpirun kill 2 109
row mpi mpirun stop 2 110
# A longer timeout: MpiComm's `_async` path takes two timeouts to end (see the findings).
row mpi mpirun stop 2 111 6000
elapsed=$(( $(date -u +%s) - started ))

findings=""
if [[ -f $out ]] && grep -q '^## Findings' "$out"; then
  findings=$(sed -n '/^## Findings/,$p' "$out")
fi
# The commit of the sources the build was made from (a clean clone, say, of this tree).
source=$(grep -m1 '^CMAKE_HOME_DIRECTORY' "$build/CMakeCache.txt" | cut -d= -f2)
commit=$(git -C "$source" rev-parse --short HEAD 2>/dev/null || echo unknown)
dirty=$(git -C "$source" status --porcelain --untracked-files=no -- include tools tests/fault \
        2>/dev/null | head -1 || true)
{
  echo "# Faults: a rank killed or stopped in the middle of DDP training"
  echo
  echo "Measured $(date -u '+%Y-%m-%d %H:%M UTC') at commit $commit${dirty:+ (with uncommitted changes in the tree)},"
  echo "build \`${build#$root/}\` ($(grep -m1 '^CMAKE_BUILD_TYPE' "$build/CMakeCache.txt" | cut -d= -f2)),"
  echo "on $(nproc) CPUs ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')), $(uname -sr),"
  echo "shared with other jobs; the whole campaign took $((elapsed / 60)) min $((elapsed % 60)) s."
  echo "Made by \`tests/fault/run.sh\` ($trials trials per row, seeds fixed per row; collective"
  echo "timeout $((timeout_ms / 1000)) s unless the table says otherwise, so the limit for every survivor is"
  echo "that timeout + 10 s after the fault)."
  echo
  echo "Each trial: \`fault_worker\` trains a 3-layer perceptron with DistributedDataParallel"
  echo "(overlapped bucket all_reduces, a broadcast of buffers each step) and an all_reduce of the loss,"
  echo "30 steps. A victim rank, a step (2-27), a collective (the gradient sync or the loss all_reduce)"
  echo "and a point (before it, inside it, after it) are drawn; \`fault_driver.py\` sends the victim"
  echo "SIGKILL or SIGSTOP from outside once it announces the point (inside: 20-300 ms after it"
  echo "entered the collective, which the survivors enter only once the signal is sent, so it is"
  echo "blocked inside it). The ranks start their rendezvous once every process has started."
  echo "LocalComm's ranks are threads: *exit* makes the victim thread leave its rank function at the"
  echo "point (its LocalComm is destroyed), *stop* makes it block there for good."
  echo
  echo "A trial passes when every survivor ended non-zero within timeout + 10 s of the fault with a"
  echo "\`tandem::Error\` naming the operation (under tandemrun or mpirun: or was ended by the launcher,"
  echo "which named the lost rank), the launcher (if any) exited non-zero within that time too, and"
  echo "no Error blamed a rank that had not failed. A hang is a survivor or launcher still alive at"
  echo "the limit. *max s* and *median s*: when the last survivor (and the launcher) had ended, after"
  echo "the fault; *ended late*: hangs that still ended within 10 s more (then the driver kills all)."
  echo "*Lost rank named*: trials where a survivor's Error or the launcher named the victim."
  echo
  python3 "$root/tests/fault/fault_driver.py" --report "$results"
  echo
  echo "## Failed trials"
  echo
  python3 - "$results" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
failed = [r for r in rows if not r["passed"]]
if not failed:
    print("None.")
for r in failed:
    why = "; ".join(r.get("failures") or r.get("notes") or ["?"])
    print(f"- {r['backend']}/{r['mode']}/{r['signal']} ({r['world']} ranks), victim rank "
          f"{r['victim']}, step {r['step']}, {r['point']} the {r['target']} collective "
          f"(landed: {r.get('actual_point')}): {why}")
EOF
  if [[ -n $findings ]]; then
    echo
    echo "$findings"
  fi
} > "$out"
echo "run.sh: wrote $out"
