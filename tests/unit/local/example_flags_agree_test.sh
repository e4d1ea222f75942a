#!/usr/bin/env bash
# example_flags_agree: train_mlp started as 2 Gloo processes whose --steps differ (each rank's
# flags from its LOCAL_RANK) stops before training, and each rank's Error names the flag, the ranks
# and their values (tandem::agree). Started alike, the job trains: example_train_mlp_gloo.
#   example_flags_agree_test.sh TANDEMRUN TRAIN_MLP
set -uo pipefail
tandemrun=$1 train_mlp=$2
export GLOO_SOCKET_IFNAME=lo
log=$(mktemp /tmp/tandem-flags-agree.XXXXXX)
trap 'rm -f "$log"' EXIT

# shellcheck disable=SC2016  # $LOCAL_RANK is the worker's, expanded by the worker's shell
timeout 120 "$tandemrun" --standalone --nproc-per-node 2 \
  bash -c 'exec "$0" --backend gloo --steps "$((20 + LOCAL_RANK))"' "$train_mlp" >"$log" 2>&1
status=$?
if [[ $status -eq 0 ]]; then
  cat "$log"; echo "FAILED: ranks with different --steps trained"; exit 1
fi
for rank in 0 1; do
  if ! grep -q "rank $rank: agree: --steps differs: rank 0 has 20; rank 1 has 21" "$log"; then
    cat "$log"; echo "FAILED: rank $rank did not name --steps and both values"; exit 1
  fi
done
if grep -q "  loss " "$log"; then
  cat "$log"; echo "FAILED: a step ran before the check"; exit 1
fi
echo "PASSED: both ranks refused to train with --steps 20 and 21, naming the flag and the values"
