#!/bin/sh
# The CUDA example on the simulated CUDA runtime and NCCL (CTest: example_fashion_mnist_cuda_sim):
#   fashion_mnist_sim_test.sh TANDEMRUN SIM_EXAMPLE CPU_EXAMPLE|"" RANKS FLOOR FLAG...
# runs SIM_EXAMPLE on RANKS processes of tandemrun over NCCL with FLAG... (and fp16, GradScaler,
# the Loader's copies: its defaults). It must have trained: its own --min-accuracy checks the
# test accuracy, the steps, the loss and the loss scale. The accuracy it must reach is FLOOR %,
# or, with CPU_EXAMPLE given, the CPU program's after the same FLAG... on RANKS threads (the same
# recipe, initial weights and sample order) less 2 points.
set -eu
tandemrun=$1 sim=$2 cpu=$3 ranks=$4 floor=$5
shift 5
accuracy() { sed -n 's/.*test accuracy \([0-9.]*\) % after.*/\1/p' | tail -1; }

if [ -n "$cpu" ]; then
  cpu_accuracy=$("$cpu" --backend local --ranks "$ranks" "$@" 2>&1 | accuracy)
  [ -n "$cpu_accuracy" ] || { echo "FAILED: the CPU example printed no test accuracy"; exit 1; }
  floor=$(awk -v a="$cpu_accuracy" 'BEGIN { print a - 2 }')
  echo "CPU example: test accuracy $cpu_accuracy % (the simulated GPU run must reach $floor %)"
fi
out=$(mktemp)
trap 'rm -f "$out"' EXIT
status=0
"$tandemrun" --standalone --nproc-per-node "$ranks" "$sim" --backend nccl "$@" \
  --min-accuracy "$floor" >"$out" 2>&1 || status=$?
cat "$out"
sim_accuracy=$(accuracy <"$out")
if [ "$status" -ne 0 ] || [ -z "$sim_accuracy" ]; then
  echo "FAILED: the simulated GPU run (exit code $status)"
  exit 1
fi
echo "PASSED: simulated GPU run on $ranks ranks over NCCL: test accuracy $sim_accuracy % (at least $floor %)"
