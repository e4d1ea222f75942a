#!/usr/bin/env bash
# The training examples' --elastic --zero test (issue 32): PROGRAM on 3 ranks under `tandemrun
# --standalone --elastic`, rank 1 killing itself with SIGKILL at step CRASH (--crash-at-step),
# three ways: plain DDP (the reference), --zero 1, and --zero 2 resumed from a checkpoint of the
# first CRASH steps (so the heal comes in the first step after the resume). Each must heal once and
# end at step FINAL on 2 ranks, reaching MIN_ACCURACY percent, and the ZeRO runs' last checkpoints
# (parameters, the optimizer state gathered from the shards, the EMA, the schedule, the sampler)
# must equal the reference's byte for byte: the survivors put the lost rank's optimizer shard
# together from its replica (tandem::ElasticZero) exactly, and the EMA averages each step once.
# Then --zero under `--max-restarts 1` must be refused, naming why (the example's replacements do
# not join a ZeRO group yet).
#   elastic_zero_test.sh TANDEMRUN PROGRAM CRASH FINAL MIN_ACCURACY [PROGRAM'S FLAGS...]
set -euo pipefail
tandemrun=$1 program=$2 crash=$3 final_step=$4 min_accuracy=$5
shift 5
flags=("$@")
# shellcheck source=elastic_test_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/elastic_test_lib.sh" elastic-zero

# run NAME [FLAGS...]: one launch on 3 ranks, its log in $work/NAME.log (then $log), its
# checkpoints in $work/NAME unless FLAGS name another directory.
run() {
  local name=$1
  shift
  log="$work/$name.log"
  "$tandemrun" --standalone --elastic --nproc-per-node 3 "$program" "${flags[@]}" \
    --checkpoint-dir "$work/$name" "$@" --elastic --elastic-store "file://$work/$name.store" \
    >"$log" 2>&1
}
# healed NAME: the run lost rank 1 and healed to FINAL; its last checkpoint is the reference's.
healed() {
  check_healed 3 "$final_step" "$min_accuracy"
  local last
  last=$(printf 'checkpoint-%012d.safetensors' "$final_step")
  cmp "$work/plain/$last" "$work/$1/$last" || fail "$1's last checkpoint differs from plain DDP's"
}

run plain --crash-at-step "$crash" || fail "plain DDP did not finish after losing rank 1"
check_healed 3 "$final_step" "$min_accuracy"
run zero1 --zero 1 --crash-at-step "$crash" || fail "--zero 1 did not finish after losing rank 1"
healed zero1
run zero2 --zero 2 --max-steps "$crash" || fail "--zero 2 did not take its first $crash steps"
run zero2 --zero 2 --resume --crash-at-step "$crash" ||
  fail "--zero 2 resumed did not finish after losing rank 1"
grep -q "resumed from .* at step $crash" "$log" || fail "--zero 2 did not resume at step $crash"
healed zero2

log="$work/refused.log"
if "$tandemrun" --standalone --elastic --max-restarts 1 --nproc-per-node 2 "$program" --zero 2 \
  --elastic --elastic-store "file://$work/refused.store" >"$log" 2>&1; then
  fail "--elastic --zero ran under --max-restarts 1"
fi
grep -q "replacements do not join a ZeRO group yet" "$log" ||
  fail "--elastic --zero under --max-restarts 1 was not refused with its reason"
echo "PASSED: rank 1 killed at step $crash; under --zero 1 and --zero 2 (resumed) the 2" \
  "survivors healed to step $final_step with the checkpoint of plain DDP's run, test accuracy" \
  "$accuracy %; --zero with replacements refused"
