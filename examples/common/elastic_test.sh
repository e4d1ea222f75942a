#!/usr/bin/env bash
# The training examples' elastic test (issue 32): PROGRAM on RANKS ranks under
# `tandemrun --standalone --elastic`, with --elastic; rank 1 kills itself with SIGKILL at step
# CRASH (--crash-at-step). The launcher must report the lost rank and let the others go on; the
# survivors heal, the epoch's rest is re-split over them, and the run must end at step FINAL on
# RANKS - 1 ranks (a lost or repeated batch of samples, or a restarted epoch, ends elsewhere),
# having healed once and reached MIN_ACCURACY percent. CRASH "setup": rank 1 kills itself in the
# set-up instead (--crash-in-setup: between DDP's constructor and the resume, the others in the
# set-up's next collective); the survivors must heal there and train from step 0.
#   elastic_test.sh TANDEMRUN PROGRAM RANKS CRASH FINAL MIN_ACCURACY [PROGRAM'S FLAGS...]
set -euo pipefail
tandemrun=$1 program=$2 ranks=$3 crash=$4 final_step=$5 min_accuracy=$6
shift 6
# shellcheck source=elastic_test_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/elastic_test_lib.sh" elastic-example

crash_flags=(--crash-at-step "$crash") where="at step $crash"
[[ $crash == setup ]] && crash_flags=(--crash-in-setup) where="in the set-up"
"$tandemrun" --standalone --elastic --nproc-per-node "$ranks" "$program" "$@" --elastic \
  --elastic-store "file://$work/store" "${crash_flags[@]}" >"$log" 2>&1 ||
  fail "the run did not finish after losing rank 1"
if [[ $crash == setup ]]; then
  grep -q "healed during the set-up: $((ranks - 1)) ranks go on" "$log" ||
    fail "the survivors did not heal in the set-up"
fi
check_healed "$ranks" "$final_step" "$min_accuracy"
echo "PASSED: rank 1 killed $where; $((ranks - 1)) survivors healed and trained" \
  "to step $final_step, test accuracy $accuracy %"
