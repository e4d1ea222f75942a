# shellcheck shell=bash
# Shared by elastic_test.sh and elastic_join_test.sh (sourced, not run): a work directory removed
# at exit, the run's log, fail() that shows the log, and the accuracy check of the run's last line.
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
