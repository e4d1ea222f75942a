#!/usr/bin/env bash
# bench/fashion_mnist/run_fashion_mnist_gpu.sh - Fashion-MNIST on one GPU, 3 epochs of the same
# recipe (SGD lr 0.1, momentum 0.9, batch 64, the same data order; `--plain` for tandem) in one
# run: PyTorch with a DataLoader (2 workers, pin_memory) and with the data resident on the GPU,
# each in fp32 and with AMP (autocast fp16 + GradScaler), beside tandem's fashion_mnist_cuda (O2
# fp16 with the Loader's copies, O2 fp16 resident, fp32 resident). Writes seconds of training per
# epoch, final test accuracy and the speed-up over PyTorch's fastest variant as a Markdown table
# (default bench/results/fashion-mnist-gpu.md). A run below 80 % test accuracy fails the
# benchmark: a time for training that did not happen is worse than none.
#   bench/fashion_mnist/run_fashion_mnist_gpu.sh [BUILD_DIR] [--out FILE]   (default build/release)
# Needs: fashion_mnist_cuda built (Release, CUDA), PyTorch with CUDA for $PYTHON (default python3),
# the Fashion-MNIST files ($FASHION_MNIST_DIR). Without a GPU it says so and exits 77.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
build=build/release
out=$root/bench/results/fashion-mnist-gpu.md
while (($#)); do
  case $1 in
    --out) out=$2; shift 2 ;;
    -h | --help) sed -n '2,13p' "$0"; exit 0 ;;
    *) build=$1; shift ;;
  esac
done
case $build in /*) ;; *) build=$root/$build ;; esac

gpu=""
command -v nvidia-smi >/dev/null 2>&1 &&
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 || true)
if [[ -z "$gpu" ]]; then
  echo "run_fashion_mnist_gpu: SKIPPED: no GPU on this machine (nvidia-smi lists none); nothing was run."
  exit 77
fi
program=$build/examples/fashion_mnist/fashion_mnist_cuda
[[ -x $program ]] || { echo "missing $program (configure with -DTANDEM_BUILD_EXAMPLES=ON and CUDA)" >&2; exit 1; }
python=${PYTHON:-python3}
tmp=$(mktemp -d /tmp/tandem-bench-fmnist-gpu.XXXXXX)
trap 'rm -rf "$tmp"' EXIT

run() {  # name, command...
  local name=$1; shift
  echo "--- $name"
  "$@" >"$tmp/$name.log" 2>&1 || { tail -n 30 "$tmp/$name.log"; echo "FAILED: $name" >&2; exit 1; }
  grep -h "^EPOCH\|epoch [0-9]*: test\|^test accuracy" "$tmp/$name.log" | tail -4 || true
}
torch_variants=(loader loader_amp resident resident_amp)
for v in "${torch_variants[@]}"; do
  run "torch_$v" "$python" "$here/fashion_mnist_torch_gpu.py" --variant "$v" --epochs 3
done
run tandem_fp16_loader "$program" --plain --epochs 3
run tandem_fp16_resident "$program" --plain --epochs 3 --resident
run tandem_fp32_resident "$program" --plain --epochs 3 --resident --precision fp32

# tandem prints "epoch E: test accuracy A % (...) after S s of training"; PyTorch "EPOCH E S A".
for name in tandem_fp16_loader tandem_fp16_resident tandem_fp32_resident; do
  sed -n 's/.*epoch \([0-9]*\): test accuracy \([0-9.]*\) % .* after \([0-9.]*\) s of training.*/\1 \3 \2/p' \
    "$tmp/$name.log" >"$tmp/$name.epochs"
done
for v in "${torch_variants[@]}"; do
  grep "^EPOCH" "$tmp/torch_$v.log" | awk '{print $2, $3, $4 * 100}' >"$tmp/torch_$v.epochs"
done

PYTHONPATH="$root/bench/common${PYTHONPATH:+:$PYTHONPATH}" "$python" - "$tmp" "$out" \
  "$(git -C "$root" rev-parse --short HEAD)" "$gpu" <<'PY'
import datetime, os, sys
from training_report import read_runs, results_table, write_report
tmp, out, commit, gpu = sys.argv[1:5]
names = {"torch_loader": "PyTorch, DataLoader (2 workers, pin_memory), fp32",
         "torch_loader_amp": "PyTorch, DataLoader, AMP (fp16 autocast + GradScaler)",
         "torch_resident": "PyTorch, data resident on the GPU, fp32",
         "torch_resident_amp": "PyTorch, data resident on the GPU, AMP",
         "tandem_fp16_loader": "tandem, O2 fp16 + GradScaler, Loader (cuda_delivery)",
         "tandem_fp16_resident": "tandem, O2 fp16 + GradScaler, data resident (--resident)",
         "tandem_fp32_resident": "tandem, fp32, data resident"}
runs, per_epoch = read_runs(tmp, names, 80.0, epochs=3)
torch_keys = [k for k in names if k.startswith("torch_")]
tandem_keys = [k for k in names if k.startswith("tandem_")]
fastest_torch = min(torch_keys, key=per_epoch.get)
best = min(tandem_keys, key=per_epoch.get)
lines = [
    "# Fashion-MNIST on one GPU: tandem beside PyTorch, same recipe", "",
    f"Run {datetime.date.today()} on {gpu}, commit {commit}, by "
    "`bench/fashion_mnist/run_fashion_mnist_gpu.sh` (Release build). The same MLP "
    "784-256-BatchNorm-ReLU-10, nn.Linear's initialisation distribution, SGD lr 0.1 momentum 0.9, "
    "batch 64, 3 epochs, the same DistributedSampler order (seed 0); tandem with `--plain`. "
    "Seconds are training only (evaluation excluded; the GPU synchronised before each epoch's "
    "clock is read), the first epoch included for every run.", ""]
lines += results_table(names, runs, per_epoch, {
    "speed-up over PyTorch's fastest": lambda key: per_epoch[fastest_torch] / per_epoch[key]},
    digits=3)
lines += ["", f"PyTorch's fastest: {names[fastest_torch]}, {per_epoch[fastest_torch]:.3f} s per "
          f"epoch. tandem's fastest: {names[best]}, {per_epoch[best]:.3f} s per epoch: "
          f"{per_epoch[fastest_torch] / per_epoch[best]:.2f}x faster (target >= 5x), accuracy "
          f"{runs[best][-1][1]:.2f} % against {runs[fastest_torch][-1][1]:.2f} %."]
write_report(out, lines)
PY
