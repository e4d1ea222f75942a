#!/usr/bin/env bash
# The training examples' crash-and-resume test: a 2-rank run of PROGRAM under tandemrun (its
# default backend under a launcher, or the one its flags name), then the same run with rank 1
# killed by SIGKILL at step 150 under `tandemrun --max-restarts 1`: the launcher reports it and
# restarts, the run resumes from the checkpoint of step RESUMED, and its final checkpoint (step
# FINAL) equals the uninterrupted run's bit for bit (tandem-ckpt diff).
# Each example's crash_resume_test.sh calls it with its own steps and flags.
#   crash_resume_test.sh TANDEMRUN PROGRAM TANDEM_CKPT RESUMED FINAL [PROGRAM'S FLAGS...]
set -euo pipefail
tandemrun=$1 program=$2 ckpt=$3 resumed=$4 final_step=$5
shift 5
work=$(mktemp -d /tmp/tandem-crash-resume.XXXXXX)
trap 'rm -rf "$work"' EXIT
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
checkpoint() { printf 'checkpoint-%012d.safetensors' "$1"; }

"$tandemrun" --standalone --nproc-per-node 2 "$program" "$@" \
  --checkpoint-dir "$work/straight" >"$work/straight.log" 2>&1 || {
  cat "$work/straight.log"; echo "FAILED: the uninterrupted run failed"; exit 1; }
grep "test accuracy .* after $final_step steps on 2 ranks" "$work/straight.log" || {
  cat "$work/straight.log"; echo "FAILED: the uninterrupted run did not report $final_step steps"
  exit 1; }
echo "the uninterrupted run finished; now the run whose rank 1 is killed at step 150"

"$tandemrun" --standalone --nproc-per-node 2 --max-restarts 1 "$program" "$@" \
  --checkpoint-dir "$work/crashed" --resume --crash-at-step 150 >"$work/crashed.log" 2>&1 || {
  cat "$work/crashed.log"; echo "FAILED: the crashed run did not finish after its restart"; exit 1; }

grep -q "SIGKILL" "$work/crashed.log" || {
  cat "$work/crashed.log"; echo "FAILED: the launcher did not report the killed rank"; exit 1; }
grep -q "resumed from .*$(checkpoint "$resumed") at step $resumed" "$work/crashed.log" || {
  cat "$work/crashed.log"; echo "FAILED: the restart did not resume from step $resumed"; exit 1; }

echo "the killed run restarted and finished; comparing the final checkpoints"
final=$(checkpoint "$final_step")
"$ckpt" diff "$work/straight/$final" "$work/crashed/$final" >"$work/diff.txt" || {
  cat "$work/diff.txt"; echo "FAILED: the resumed run's final state differs"; exit 1; }
cat "$work/diff.txt"
echo "PASSED: $final_step steps trained; killed at step 150, resumed from step $resumed," \
  "final state identical"
