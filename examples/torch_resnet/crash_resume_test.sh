#!/usr/bin/env bash
# The example's test: 200 steps of torch_resnet on 2 Gloo ranks under tandemrun, failing unless
# it trained (--min-accuracy); then the same run with rank 1 killed by SIGKILL at step 150 under
# `tandemrun --max-restarts 1`: the launcher reports it and restarts, the run resumes from the
# checkpoint of step 100, and its final checkpoint (step 200: parameters, BatchNorm buffers,
# momentum, EMA, schedule, sampler) equals the uninterrupted run's bit for bit (tandem-ckpt diff).
# The test itself is examples/common/crash_resume_test.sh, as for examples/fashion_mnist.
# The network is a third of the example's default width (--width 8): the same modules, hooks,
# SyncBatchNorm and checkpoint state, at a quarter of the test's time (CI has 25 minutes).
#   crash_resume_test.sh TANDEMRUN TORCH_RESNET TANDEM_CKPT
exec "$(dirname "$0")/../common/crash_resume_test.sh" "$1" "$2" "$3" 100 200 \
  --epochs 1 --max-steps 200 --checkpoint-every 100 --seed 3 --min-accuracy 65 --width 8
