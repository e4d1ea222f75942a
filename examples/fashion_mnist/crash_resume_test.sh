#!/usr/bin/env bash
# Crash and resume: rank 1 of a 2-rank Gloo run is killed with SIGKILL mid-epoch under
# `tandemrun --max-restarts 1`; the launcher reports it and restarts; the run resumes from the
# last checkpoint and its final parameters equal, bit for bit, those of an uninterrupted run
# with the same seed (tandem-ckpt diff).
#   crash_resume_test.sh TANDEMRUN FASHION_MNIST TANDEM_CKPT
set -euo pipefail
tandemrun=$1 program=$2 ckpt=$3
work=$(mktemp -d /tmp/tandem-crash-resume.XXXXXX)
trap 'rm -rf "$work"' EXIT
# Two short epochs (118 steps each at batch 256); the crash comes at step 150, in the second.
args=(--epochs 2 --batch-size 256 --seed 5)

"$tandemrun" --standalone --nproc-per-node 2 "$program" "${args[@]}" \
  --checkpoint-dir "$work/straight" >"$work/straight.log" 2>&1 || {
  cat "$work/straight.log"; echo "FAILED: the uninterrupted run failed"; exit 1; }

"$tandemrun" --standalone --nproc-per-node 2 --max-restarts 1 "$program" "${args[@]}" \
  --checkpoint-dir "$work/crashed" --resume --crash-at-step 150 >"$work/crashed.log" 2>&1 || {
  cat "$work/crashed.log"; echo "FAILED: the crashed run did not finish after its restart"; exit 1; }

grep -q "SIGKILL" "$work/crashed.log" || {
  cat "$work/crashed.log"; echo "FAILED: the launcher did not report the killed rank"; exit 1; }
grep -q "resumed from .*checkpoint-000000000118.safetensors at step 118" "$work/crashed.log" || {
  cat "$work/crashed.log"; echo "FAILED: the restart did not resume from step 118"; exit 1; }

final=checkpoint-000000000236.safetensors
"$ckpt" diff "$work/straight/$final" "$work/crashed/$final" >"$work/diff.txt" || {
  cat "$work/diff.txt"; echo "FAILED: the resumed run's parameters differ"; exit 1; }
cat "$work/diff.txt"
echo "PASSED: killed at step 150, resumed from step 118, final parameters identical"
