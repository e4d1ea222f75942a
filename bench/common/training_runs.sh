# bench/common/training_runs.sh - the two shell functions the CPU training benchmarks
# (run_fashion_mnist.sh, run_torch_resnet.sh) share: run a side with its output kept, and turn
# tandem's epoch lines into the "EPOCH E S A" rows the reports read.
#   source "$root/bench/common/training_runs.sh"
# Needs: $tmp, a scratch folder, set before `run` is called; $epochs (default 3), how many epoch
# lines `run` echoes.

# tandem prints "epoch E: test accuracy A % (...) after S s of training"; keep "EPOCH E S A".
tandem_epochs() { sed -n 's/.*epoch \([0-9]*\): test accuracy \([0-9.]*\) % .* after \([0-9.]*\) s of training.*/EPOCH \1 \3 \2/p'; }

run() {  # name, command...
  local name=$1; shift
  echo "--- $name"
  "$@" >"$tmp/$name.log" 2>&1 || { cat "$tmp/$name.log"; echo "FAILED: $name" >&2; exit 1; }
  grep -h "^EPOCH\|epoch [0-9]*: test" "$tmp/$name.log" | tail -"${epochs:-3}"
}
