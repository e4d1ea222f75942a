# shellcheck shell=bash
# Shared by elastic_test.sh, elastic_join_test.sh and elastic_zero_test.sh (sourced, not run): a
# work directory removed at exit, the run's log, fail() that shows the log, the accuracy check of
# the run's last line and the checks of a run that lost rank 1 and healed.
#   source elastic_test_lib.sh NAME     (NAME names the work directory)
work=$(mktemp -d "/tmp/tandem-$1.XXXXXX")
trap 'rm -rf "$work"' EXIT
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
log="$work/run.log"
fail() { cat "$log"; echo "FAILED: $*"; exit 1; }
# check_accuracy LINE MIN: sets accuracy to LINE's test accuracy; fails below MIN percent.
check_accuracy() {
  accuracy=$(sed -E 's/.*test accuracy ([0-9.]+) %.*/\1/' <<<"$1")
  awk -v a="$accuracy" -v m="$2" 'BEGIN { exit !(a >= m) }' ||
    fail "test accuracy $accuracy % is below $2 %"
}
# check_healed RANKS FINAL MIN [AFTER]: the run in $log lost rank 1 (the launcher said so), it
# healed once to AFTER ranks (default RANKS - 1: the survivors) and ended at step FINAL (a lost or
# repeated batch of samples, or a restarted epoch, ends elsewhere), reaching MIN percent; sets line
# (the last line) and accuracy.
check_healed() {
  local after=${4:-$(($1 - 1))}
  grep -q "rank 1 was lost (signal SIGKILL" "$log" || fail "the launcher did not report rank 1 lost"
  grep -q "healed 1 time(s): $after ranks went on" "$log" || fail "no heal to $after"
  line=$(grep "test accuracy .* after $2 steps on $after ranks" "$log") ||
    fail "the run did not end at step $2 on $after ranks"
  echo "$line"
  check_accuracy "$line" "$3"
}
