#!/usr/bin/env bash
# Crash and resume: rank 1 of a 2-rank Gloo run is killed with SIGKILL mid-epoch under
# `tandemrun --max-restarts 1`; the launcher reports it and restarts; the run resumes from the
# last checkpoint and its final parameters equal, bit for bit, those of an uninterrupted run
# with the same seed (tandem-ckpt diff). The test itself is examples/common/crash_resume_test.sh.
# Two short epochs (118 steps each at batch 256); the crash comes at step 150, in the second.
#   crash_resume_test.sh TANDEMRUN FASHION_MNIST TANDEM_CKPT
exec "$(dirname "$0")/../common/crash_resume_test.sh" "$1" "$2" "$3" 118 236 \
  --epochs 2 --batch-size 256 --seed 5
