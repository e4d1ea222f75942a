#!/usr/bin/env bash
# bench/loader/run_loader.sh - Fashion-MNIST samples per second through tandem's Loader beside
# PyTorch's DataLoader (batch 64, DistributedSampler, 2 workers, pin_memory), alternating the
# two twice in one run, and the gather's bandwidth beside memcpy's; writes the table.
#   bench/loader/run_loader.sh [BUILD_DIR] [--epochs N] [--out FILE]
#   (BUILD_DIR defaults to build/release, FILE to bench/results/loader.md)
# Needs: bench_loader built (TANDEM_BUILD_BENCH, zlib), Debian's python3-torch for
# /usr/bin/python3, and dataset-fashion-mnist (or FASHION_MNIST_DIR).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
build=build/release
epochs=3
out=$root/bench/results/loader.md
while (($#)); do
  case $1 in
    --epochs) epochs=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    -h | --help) sed -n '2,8p' "$0"; exit 0 ;;
    -*) echo "unknown option $1" >&2; exit 2 ;;
    *) build=$1; shift ;;
  esac
done
case $build in /*) ;; *) build=$root/$build ;; esac
program=$build/bench/loader/bench_loader
[[ -x $program ]] || { echo "run_loader.sh: $program is not built" >&2; exit 1; }
python=/usr/bin/python3
[[ -x $python ]] || python=python3

tmp=$(mktemp -d /tmp/tandem-bench-loader.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
for round in 1 2; do
  echo "--- round $round: tandem"
  "$program" --epochs "$epochs" --workers 2 | tee -a "$tmp/tandem.txt"
  echo "--- round $round: PyTorch"
  "$python" "$here/loader_torch.py" --epochs "$epochs" --workers 2 | tee -a "$tmp/torch.txt"
done

best() { awk -v key="$2" '$1 == "RESULT" && $2 == key { if ($3 > m) m = $3 } END { print m }' "$1"; }
tandem_rate=$(best "$tmp/tandem.txt" tandem_samples_per_s)
torch_rate=$(best "$tmp/torch.txt" torch_samples_per_s)
gather=$(best "$tmp/tandem.txt" gather_gbps)
copy=$(best "$tmp/tandem.txt" memcpy_gbps)
fraction=$(best "$tmp/tandem.txt" gather_of_memcpy)
torch_version=$(awk '$2 == "torch_version" { print $3; exit }' "$tmp/torch.txt")
pinned=$(awk '$2 == "torch_pin_memory" { print $3; exit }' "$tmp/torch.txt")
ratio=$(awk -v a="$tandem_rate" -v b="$torch_rate" 'BEGIN { printf "%.1f", a / b }')
percent=$(awk -v f="$fraction" 'BEGIN { printf "%.0f", 100 * f }')

mkdir -p "$(dirname "$out")"
{
  echo "# Loader: Fashion-MNIST samples per second, tandem beside PyTorch"
  echo
  echo "Run $(date -u +%Y-%m-%d) on $(nproc) cores ($(uname -m)), commit $(git -C "$root" rev-parse --short HEAD),"
  echo "by \`bench/loader/run_loader.sh\`: $epochs epochs of the 60000 training images, batch 64,"
  echo "DistributedSampler (1 replica, shuffled, set_epoch), 2 workers; tandem and PyTorch alternated"
  echo "twice, best run of each. Both check every epoch (every sample once, labels at their indices)."
  echo
  echo "| loader | samples/s | vs PyTorch |"
  echo "|---|---:|---:|"
  echo "| tandem::Loader (2 workers) | $tandem_rate | ${ratio}x |"
  echo "| torch DataLoader $torch_version (2 workers, pin_memory$([[ $pinned == 1 ]] || echo ": no CUDA here, so not pinned")) | $torch_rate | 1x |"
  echo
  echo "The gather alone (no workers, one thread): $gather GB/s on the bytes it moves (per sample"
  echo "785 bytes read, 3144 written), against memcpy's $copy GB/s (read + written) on 64 MiB:"
  echo "**${percent} %** of memcpy."
} >"$out"
cat "$out"
