#!/usr/bin/env bash
# The training examples' replacement test (issue 32): PROGRAM on RANKS ranks under
# `tandemrun --standalone --elastic --max-restarts 1`, with --elastic; rank 1 kills itself with
# SIGKILL at step CRASH (--crash-at-step, on the launcher's first attempt only). The launcher must
# report the lost rank and start a replacement, which joins the running group (on_join: the
# training state from a live member) and trains with it: the run must end on RANKS ranks, having
# healed once and admitted one replacement, at a step between FEWEST (the replacement joined in
# the heal: the undisturbed run's steps) and MOST (it joined at the epoch's end: the survivors
# trained the rest alone), never a restarted epoch, and reach MIN_ACCURACY percent.
#   elastic_join_test.sh TANDEMRUN PROGRAM RANKS CRASH FEWEST MOST MIN_ACCURACY [FLAGS...]
set -euo pipefail
tandemrun=$1 program=$2 ranks=$3 crash=$4 fewest=$5 most=$6 min_accuracy=$7
shift 7
# shellcheck source=elastic_test_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/elastic_test_lib.sh" elastic-join

"$tandemrun" --standalone --elastic --max-restarts 1 --nproc-per-node "$ranks" "$program" "$@" \
  --elastic --elastic-store "file://$work/store" --crash-at-step "$crash" >"$log" 2>&1 ||
  fail "the run did not finish after losing rank 1"
grep -q "rank 1 was lost (signal SIGKILL" "$log" || fail "the launcher did not report rank 1 lost"
grep -q "a replacement joins them" "$log" || fail "the launcher started no replacement"
joined=$(grep "1 replacement(s) joined after step" "$log") || fail "no replacement joined"
echo "$joined"
grep -q "healed 1 time(s): $ranks ranks went on" "$log" || fail "no single heal back to $ranks"
grep -q "1 replacement(s) joined: $ranks ranks at the end" "$log" || fail "not $ranks at the end"
line=$(grep "test accuracy .* after [0-9]* steps on $ranks ranks" "$log") ||
  fail "the run did not end on $ranks ranks"
echo "$line"
steps=$(sed -E 's/.* after ([0-9]+) steps.*/\1/' <<<"$line")
((steps >= fewest && steps <= most)) || fail "$steps steps: outside $fewest .. $most"
check_accuracy "$line" "$min_accuracy"
echo "PASSED: rank 1 killed at step $crash and replaced; the run ended on $ranks ranks at step" \
  "$steps, test accuracy $accuracy %"
