#!/usr/bin/env bash
# A checkpoint saved at 2 ranks resumes at 3 and at 1 (issue 32): for each --zero stage given
# (0: plain DDP), 50 steps of batch 256 per rank on 2 ranks under tandemrun (the default
# backend), saved mid-epoch; then two copies of the directory resumed with --resume at 3 ranks and
# at 1. The epoch's 34400 samples left are split anew over the new ranks with the per-rank batch
# kept at 256, so the epoch ends at step 50 + ceil(ceil(34400 / 3) / 256) = 95 on 3 ranks and
# 50 + ceil(34400 / 256) = 185 on 1: a run that lost or repeated a batch of samples, or restarted
# the epoch, ends elsewhere. Each final checkpoint is checked whole with tandem-ckpt verify.
#   resize_resume_test.sh TANDEMRUN FASHION_MNIST TANDEM_CKPT STAGE...
set -euo pipefail
tandemrun=$1 program=$2 ckpt=$3
shift 3
work=$(mktemp -d /tmp/tandem-resize-resume.XXXXXX)
trap 'rm -rf "$work"' EXIT
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
flags=(--epochs 1 --batch-size 256 --seed 5 --workers 0)

for zero in "$@"; do
  saved="$work/zero$zero"
  "$tandemrun" --standalone --nproc-per-node 2 "$program" "${flags[@]}" --zero "$zero" \
    --max-steps 50 --checkpoint-dir "$saved" >"$saved.log" 2>&1 || {
    cat "$saved.log"; echo "FAILED: --zero $zero: the run at 2 ranks failed"; exit 1; }
  for ranks_and_steps in "3 95" "1 185"; do
    read -r ranks steps <<<"$ranks_and_steps"
    dir="$work/zero$zero-at$ranks"
    cp -r "$saved" "$dir"
    "$tandemrun" --standalone --nproc-per-node "$ranks" "$program" "${flags[@]}" --zero "$zero" \
      --checkpoint-dir "$dir" --resume >"$dir.log" 2>&1 || {
      cat "$dir.log"; echo "FAILED: --zero $zero: the resume at $ranks ranks failed"; exit 1; }
    grep -q "resumed from .*checkpoint-000000000050.safetensors at step 50" "$dir.log" || {
      cat "$dir.log"; echo "FAILED: --zero $zero: no resume from step 50 at $ranks ranks"; exit 1; }
    grep "test accuracy .* after $steps steps on $ranks ranks" "$dir.log" || {
      cat "$dir.log"; echo "FAILED: --zero $zero: at $ranks ranks the epoch did not end at" \
        "step $steps"; exit 1; }
    "$ckpt" verify "$dir/$(printf 'checkpoint-%012d.safetensors' "$steps")" || {
      echo "FAILED: --zero $zero: the final checkpoint at $ranks ranks is not whole"; exit 1; }
  done
done
echo "PASSED: saved at 2 ranks, resumed at 3 and 1 (--zero $*), every epoch's sample once"
