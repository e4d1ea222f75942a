#!/usr/bin/env bash
# The training examples' --elastic --zero test (issue 32): PROGRAM on 3 ranks under `tandemrun
# --standalone --elastic`, rank 1 killing itself with SIGKILL at step CRASH (--crash-at-step),
# three ways: plain DDP (the reference), --zero 1, and --zero 2 resumed from a checkpoint of the
# first CRASH steps (so the heal comes in the first step after the resume). Each must heal once and
# end at step FINAL on 2 ranks, reaching MIN_ACCURACY percent, and the ZeRO runs' last checkpoints
# (parameters, the optimizer state gathered from the shards, the EMA, the schedule, the sampler)
# must equal the reference's byte for byte: the survivors put the lost rank's optimizer shard
# together from its replica (tandem::ElasticZero) exactly, and the EMA averages each step once.
# Then replacements (`tandemrun --max-restarts 1`, the survivors waiting for it in the heal:
# --await-replacement): rank 1 killed at step CRASH is replaced under plain DDP, --zero 1 and
# --zero 2 (under ZeRO the replacement receives the parameters and its optimizer shard through
# tandem::ElasticZero::attach, its on_join state leaving them out); each must heal once, admit the
# replacement, end at step JOINED on 3 ranks that hold the same parameters, and the ZeRO runs'
# last checkpoints must equal plain DDP's byte for byte. And --zero 2 resumed from that checkpoint
# with rank 1 lost in the set-up (--crash-in-setup, the others in the resume): the survivors heal
# there, resume over 2 ranks and end as the others, with plain DDP's last tensors.
#   elastic_zero_test.sh TANDEMRUN PROGRAM CRASH FINAL JOINED MIN_ACCURACY [PROGRAM'S FLAGS...]
set -euo pipefail
tandemrun=$1 program=$2 crash=$3 final_step=$4 joined_step=$5 min_accuracy=$6
shift 6
flags=("$@")
# shellcheck source=elastic_test_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/elastic_test_lib.sh" elastic-zero

# run NAME [FLAGS...]: one launch on 3 ranks, its log in $work/NAME.log (then $log), its
# checkpoints in $work/NAME unless FLAGS name another directory. With restarts=1 set, under
# --max-restarts 1.
run() {
  local name=$1
  shift
  log="$work/$name.log"
  "$tandemrun" --standalone --elastic --max-restarts "${restarts:-0}" --nproc-per-node 3 \
    "$program" "${flags[@]}" --checkpoint-dir "$work/$name" "$@" --elastic \
    --elastic-store "file://$work/$name.store" >"$log" 2>&1
}
# same_as REFERENCE NAME STEP: NAME's checkpoint of STEP is REFERENCE's, byte for byte.
same_as() {
  local last
  last=$(printf 'checkpoint-%012d.safetensors' "$3")
  cmp "$work/$1/$last" "$work/$2/$last" || fail "$2's last checkpoint differs from $1's"
}
# same_tensors_as REFERENCE NAME STEP: NAME's checkpoint of STEP holds REFERENCE's tensors (the
# parameters, the optimizer state, the EMA), byte for byte: the same CRC-32C of the data in the
# header (the rest of the header may differ: each rank's RNG stream).
data_crc() { grep -ao '"tandem.data_crc32c":"[0-9a-f]*"' "$1" | head -1; }
same_tensors_as() {
  local last reference
  last=$(printf 'checkpoint-%012d.safetensors' "$3")
  reference=$(data_crc "$work/$1/$last")
  [[ -n $reference && $reference == "$(data_crc "$work/$2/$last")" ]] ||
    fail "$2's last checkpoint holds other tensors than $1's"
}
# healed NAME: the run lost rank 1 and healed to FINAL; its last checkpoint is the reference's.
healed() {
  check_healed 3 "$final_step" "$min_accuracy"
  same_as plain "$1" "$final_step"
}
# replaced NAME [FLAGS...]: rank 1 killed at CRASH and replaced in the heal; the run ends at
# JOINED on 3 ranks holding the same parameters.
replaced() {
  local name=$1
  shift
  restarts=1 run "$name" "$@" --crash-at-step "$crash" --await-replacement 300 ||
    fail "$name did not finish after losing rank 1 and replacing it"
  grep -q "a replacement joins them" "$log" || fail "the launcher started no replacement"
  grep -q "1 replacement(s) joined: 3 ranks at the end" "$log" || fail "$name: no replacement"
  grep -q "the 3 ranks hold the same parameters" "$log" || fail "$name: the ranks' parameters"
  check_healed 3 "$joined_step" "$min_accuracy" 3
}

run plain --crash-at-step "$crash" || fail "plain DDP did not finish after losing rank 1"
check_healed 3 "$final_step" "$min_accuracy"
run zero1 --zero 1 --crash-at-step "$crash" || fail "--zero 1 did not finish after losing rank 1"
healed zero1
run zero2 --zero 2 --max-steps "$crash" || fail "--zero 2 did not take its first $crash steps"
cp -r "$work/zero2" "$work/zero2_setup"  # the checkpoint of step CRASH, for the set-up's loss
run zero2 --zero 2 --resume --crash-at-step "$crash" ||
  fail "--zero 2 resumed did not finish after losing rank 1"
grep -q "resumed from .* at step $crash" "$log" || fail "--zero 2 did not resume at step $crash"
healed zero2
# --zero 2 resumed from the same checkpoint, rank 1 lost in the set-up (--crash-in-setup: after
# DDP's constructor and ElasticZero's first attach, the others in the resume's collectives): the
# survivors heal there, load the checkpoint again over 2 ranks and end as the others.
run zero2_setup --zero 2 --resume --crash-in-setup ||
  fail "--zero 2 resumed did not finish after losing rank 1 in the set-up"
grep -q "healed during the set-up: 2 ranks go on" "$log" || fail "no heal in the set-up"
grep -q "resumed from .* at step $crash" "$log" || fail "the survivors did not resume at $crash"
grep -q "the 2 ranks hold the same parameters" "$log" || fail "the survivors' parameters"
check_healed 3 "$final_step" "$min_accuracy"
# Its survivors took the checkpoint's RNG streams of ranks 0 and 1, the healed run's kept 0 and 2.
same_tensors_as plain zero2_setup "$final_step"

replaced plain_joined
replaced zero1_joined --zero 1
same_as plain_joined zero1_joined "$joined_step"
replaced zero2_joined --zero 2
same_as plain_joined zero2_joined "$joined_step"
echo "PASSED: rank 1 killed at step $crash; under --zero 1 and --zero 2 (resumed) the 2" \
  "survivors healed to step $final_step with the checkpoint of plain DDP's run; replaced, the 3" \
  "ranks ended at step $joined_step with the same parameters and plain DDP's checkpoint, test" \
  "accuracy $accuracy %"
