#!/usr/bin/env bash
# The example's test: 200 steps of torch_resnet on 2 Gloo ranks under tandemrun, failing unless
# it trained (--min-accuracy); then the same run with rank 1 killed by SIGKILL at step 150 under
# `tandemrun --max-restarts 1`: the launcher reports it and restarts, the run resumes from the
# checkpoint of step 100, and its final checkpoint (step 200: parameters, BatchNorm buffers,
# momentum, EMA, schedule, sampler) equals the uninterrupted run's bit for bit (tandem-ckpt diff).
# The mechanism of examples/fashion_mnist/crash_resume_test.sh.
#   crash_resume_test.sh TANDEMRUN TORCH_RESNET TANDEM_CKPT
set -euo pipefail
tandemrun=$1 program=$2 ckpt=$3
work=$(mktemp -d /tmp/tandem-torch-resnet.XXXXXX)
trap 'rm -rf "$work"' EXIT
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
args=(--epochs 1 --max-steps 200 --checkpoint-every 100 --seed 3 --min-accuracy 65)

"$tandemrun" --standalone --nproc-per-node 2 "$program" "${args[@]}" \
  --checkpoint-dir "$work/straight" >"$work/straight.log" 2>&1 || {
  cat "$work/straight.log"; echo "FAILED: the uninterrupted 200-step run failed"; exit 1; }
grep "test accuracy .* after 200 steps on 2 ranks" "$work/straight.log" || {
  cat "$work/straight.log"; echo "FAILED: the uninterrupted run did not report 200 steps"; exit 1; }

"$tandemrun" --standalone --nproc-per-node 2 --max-restarts 1 "$program" "${args[@]}" \
  --checkpoint-dir "$work/crashed" --resume --crash-at-step 150 >"$work/crashed.log" 2>&1 || {
  cat "$work/crashed.log"; echo "FAILED: the crashed run did not finish after its restart"; exit 1; }

grep -q "SIGKILL" "$work/crashed.log" || {
  cat "$work/crashed.log"; echo "FAILED: the launcher did not report the killed rank"; exit 1; }
grep -q "resumed from .*checkpoint-000000000100.safetensors at step 100" "$work/crashed.log" || {
  cat "$work/crashed.log"; echo "FAILED: the restart did not resume from step 100"; exit 1; }

final=checkpoint-000000000200.safetensors
"$ckpt" diff "$work/straight/$final" "$work/crashed/$final" >"$work/diff.txt" || {
  cat "$work/diff.txt"; echo "FAILED: the resumed run's final state differs"; exit 1; }
cat "$work/diff.txt"
echo "PASSED: 200 steps trained; killed at step 150, resumed from step 100, final state identical"
