#!/usr/bin/env bash
# The training examples refuse what does not fit, each time with a message naming the flag or the
# file and a non-zero exit, never training on (issue 30): flags out of range (exit 2, before
# anything starts), data whose labels or images do not fit the model, a checkpoint directory that
# cannot be made (exit 1, before the first step). The data here is made on the spot (two images),
# so the test needs no data set.
#   example_refusals_test.sh FASHION_MNIST TRAIN_MLP
set -uo pipefail
fashion_mnist=$1 train_mlp=$2
work=$(mktemp -d /tmp/tandem-refusals.XXXXXX)
trap 'rm -rf "$work"' EXIT
failures=0

# expect CODE TEXT COMMAND...: COMMAND exits CODE and says TEXT (stdout and stderr together).
expect() {
  local code=$1 text=$2
  shift 2
  "$@" >"$work/out" 2>&1
  local got=$?
  if [ "$got" -ne "$code" ] || ! grep -qF -- "$text" "$work/out"; then
    echo "FAILED: $* exited $got (want $code) and said:"
    cat "$work/out"
    echo "(wanted: $text)"
    failures=$((failures + 1))
  else
    echo "ok: $* -> $code: $(grep -F -- "$text" "$work/out" | head -1)"
  fi
}

# idx DIR STEM TYPE_AND_DIMS_BYTES DATA_SOURCE: an IDX file of unsigned bytes.
images() {  # DIR STEM ROWS: 2 images of ROWS x 28
  { printf '\000\000\010\003\000\000\000\002\000\000\000'; printf "\\$(printf '%03o' "$3")"
    printf '\000\000\000\034'; head -c $((2 * $3 * 28)) /dev/zero; } >"$1/$2-images-idx3-ubyte"
}
labels() {  # DIR STEM SECOND_LABEL
  { printf '\000\000\010\001\000\000\000\002\003'; printf "\\$(printf '%03o' "$3")"; } \
    >"$1/$2-labels-idx1-ubyte"
}
dataset() {  # DIR ROWS SECOND_LABEL
  mkdir -p "$1"
  for stem in train t10k; do images "$1" "$stem" "$2"; labels "$1" "$stem" "$3"; done
}
dataset "$work/fits" 28 9
dataset "$work/label12" 28 12
dataset "$work/rows27" 27 9
: >"$work/a-file"
run=(--backend local --ranks 1 --epochs 1 --max-steps 1 --workers 0)

# Flags: exit 2 and the reason.
for lr in inf -inf nan 1e999 0 -0.5 0.1x '' ' 0.1'; do
  expect 2 "--lr '$lr': not a finite number above 0" "$fashion_mnist" --data "$work/fits" --lr "$lr"
done
expect 2 "--batch-size '0': not a whole number from 1 to 60000" \
  "$fashion_mnist" --data "$work/fits" --batch-size 0
expect 2 "--epochs '-1': not a whole number from 1 to 1000" \
  "$fashion_mnist" --data "$work/fits" --epochs -1
expect 2 "--workers '1.5': not a whole number from 0 to 64" \
  "$fashion_mnist" --data "$work/fits" --workers 1.5
expect 2 "--zero '3': not a whole number from 0 to 2" "$fashion_mnist" --data "$work/fits" --zero 3
expect 2 "--data '$work/missing': no such directory" "$fashion_mnist" --data "$work/missing"
expect 2 "--data '$work/a-file': not a directory" "$fashion_mnist" --data "$work/a-file"
expect 2 "--checkpoint-dir '$work/a-file': exists and is not a directory" \
  "$fashion_mnist" --data "$work/fits" --checkpoint-dir "$work/a-file"
expect 2 "--bogus '1': unknown flag" "$fashion_mnist" --data "$work/fits" --bogus 1
expect 2 "--epochs '': unknown, or its value is missing" "$fashion_mnist" --epochs
expect 2 "train_mlp: --steps '0': must be at least 1" "$train_mlp" --steps 0
expect 2 "train_mlp: --ranks 'x': not a whole number" "$train_mlp" --ranks x

# Data that does not fit the model: exit 1, the file, the sample and the value.
expect 1 "$work/label12/train-labels-idx1-ubyte: sample 1 has the label 12, outside the 10 classes" \
  "$fashion_mnist" "${run[@]}" --data "$work/label12"
expect 1 "$work/rows27/train-images-idx3-ubyte: the images are 27 x 28 pixels" \
  "$fashion_mnist" "${run[@]}" --data "$work/rows27"

# A checkpoint directory that cannot be made: exit 1 before the first step, naming it and errno.
expect 1 "cannot create the directory $work/a-file/ckpt: Not a directory (errno 20)" \
  "$fashion_mnist" "${run[@]}" --data "$work/fits" --checkpoint-dir "$work/a-file/ckpt"
if grep -q "epoch 0" "$work/out"; then
  echo "FAILED: fashion_mnist trained before finding its checkpoint directory unusable"
  failures=$((failures + 1))
fi
expect 1 "cannot create the directory $work/a-file/mlp: Not a directory (errno 20)" \
  "$train_mlp" --backend local --ranks 2 --steps 20 --checkpoint-dir "$work/a-file/mlp"
if grep -q "^step " "$work/out"; then
  echo "FAILED: train_mlp trained before finding its checkpoint directory unusable"
  failures=$((failures + 1))
fi
# A TensorBoard directory that cannot be made: the same, on every rank.
# (run_local reports whichever rank's Error came first: rank 0's own, or one naming rank 0.)
expect 1 "TensorBoardWriter: cannot create $work/a-file/tb: Not a directory" \
  "$fashion_mnist" --backend local --ranks 2 --epochs 1 --max-steps 1 --workers 0 \
  --data "$work/fits" --tensorboard "$work/a-file/tb"
# And one that fits trains (the refusals above are not all the program ever says).
expect 0 "test accuracy" "$fashion_mnist" "${run[@]}" --data "$work/fits" \
  --checkpoint-dir "$work/ckpt"

if [ "$failures" -ne 0 ]; then
  echo "FAILED: $failures refusal(s) wrong"
  exit 1
fi
echo "PASSED: every refusal named its flag or file and exited non-zero"
