#!/usr/bin/env bash
# train_mlp (tandem, Gloo) under PyTorch's own torchrun, unchanged: its agent hosts the c10d
# store the ranks meet in (TORCHELASTIC_USE_AGENT_STORE=True), its error file carries tandem's
# message, its --max-restarts restarts a failed job that resumes from its checkpoint.
#   torchrun_test.sh PYTHON TRAIN_MLP train N   N ranks train; every rank ends with the same weights
#                                               (for N=2, the same as two threads of --backend local)
#   torchrun_test.sh PYTHON TRAIN_MLP failure   a rank that throws is shown in torchrun's summary
#   torchrun_test.sh PYTHON TRAIN_MLP restart   rank 1 fails at step 25 of attempt 0; attempt 1
#                                               resumes from step 20 and ends with the weights of
#                                               an uninterrupted run
# Exits 77 (skipped) when PYTHON cannot import torch.
set -u
python=$1
train_mlp=$2
mode=$3

if ! "$python" -c "import torch" 2>/dev/null; then
  echo "skipped: $python cannot import torch (Debian: apt install python3-torch)"
  exit 77
fi
version=$("$python" -c "import torch; print(torch.__version__)")
echo "torch $version at $python"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

fail() {
  echo "FAILED: $*"
  exit 1
}

# One torchrun job; its output (every rank's and the agent's) in $work/out, its exit code in $rc.
# --redirects 9:1 --tee 9:1 dodge a crash of Debian's torchrun 1.13 on Python 3.11 (redirecting
# a local rank that does not exist leaves every real rank's output on the console).
torchrun() {
  local nproc=$1
  shift
  local port
  port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=1 timeout 240 "$python" -m torch.distributed.run \
    --nproc_per_node "$nproc" --no_python --redirects 9:1 --tee 9:1 --monitor_interval 1 \
    --master_addr 127.0.0.1 --master_port "$port" "$@" >"$work/out" 2>&1
  rc=$?
  cat "$work/out"
  echo "---- torchrun exit code: $rc"
}

# The fingerprint lines of every rank: "rank R weights fingerprint HEX".
fingerprints() { grep -E '^rank [0-9]+ weights fingerprint [0-9a-f]+$' "$work/out" | sort; }

check_identical() {
  local n=$1
  local lines
  lines=$(fingerprints)
  [ "$(echo "$lines" | grep -c .)" -eq "$n" ] || fail "expected $n fingerprint lines, got: $lines"
  [ "$(echo "$lines" | awk '{print $5}' | sort -u | wc -l)" -eq 1 ] ||
    fail "the ranks ended with different weights: $lines"
  grep -q "weights on all $n ranks identical" "$work/out" || fail "train_mlp did not confirm it"
}

case "$mode" in
  train)
    n=$4
    torchrun "$n" "$train_mlp"
    [ "$rc" -eq 0 ] || fail "torchrun with $n ranks exited $rc"
    check_identical "$n"
    grep -q "held-out loss" "$work/out" || fail "no training summary"
    if [ "$n" -eq 2 ]; then
      # Two threads of the same program (no torchrun, no Gloo) reach bitwise the same weights.
      threads=$("$train_mlp" --backend local --ranks 2 | awk '/weights fingerprint/ {print $5}' | sort -u)
      [ "$threads" = "$(fingerprints | awk '{print $5}' | sort -u)" ] ||
        fail "torchrun's weights differ from --backend local's ($threads)"
    fi
    ;;
  failure)
    torchrun 2 "$train_mlp" --fail-rank 1 --fail-step 5
    [ "$rc" -ne 0 ] || fail "torchrun succeeded although rank 1 failed"
    # torchrun's failure summary: rank 1 with its error file and tandem's message as the trace.
    grep -q "traceback : tandem: rank 1: train_mlp: injected failure at step 5" "$work/out" ||
      fail "tandem's message is not in torchrun's summary"
    ! grep -q "error_file: <N/A>" "$work/out" || fail "a failed rank left no error file"
    ;;
  restart)
    torchrun 2 --max_restarts 1 "$train_mlp" --checkpoint-dir "$work/checkpoints" \
      --checkpoint-every 10 --fail-rank 1 --fail-step 25
    [ "$rc" -eq 0 ] || fail "the restarted job exited $rc"
    grep -q "injected failure at step 25" "$work/out" || fail "attempt 0 did not fail as asked"
    # TORCHELASTIC_RESTART_COUNT=1 reached the program, which resumed from its last checkpoint.
    grep -q "attempt 1 resumed from checkpoint-000000000020.safetensors at step 20" "$work/out" ||
      fail "attempt 1 did not resume from step 20"
    check_identical 2
    threads=$("$train_mlp" --backend local --ranks 2 | awk '/weights fingerprint/ {print $5}' | sort -u)
    [ "$threads" = "$(fingerprints | awk '{print $5}' | sort -u)" ] ||
      fail "the resumed run's weights differ from an uninterrupted run's ($threads)"
    ;;
  *)
    fail "unknown mode $mode"
    ;;
esac
echo "passed: $mode (torch $version)"
