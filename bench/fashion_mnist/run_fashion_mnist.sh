#!/usr/bin/env bash
# bench/fashion_mnist/run_fashion_mnist.sh - Fashion-MNIST, 3 epochs of the same recipe (SGD lr
# 0.1, momentum 0.9, batch 64 per rank, the same data order) in one run: PyTorch DDP over gloo
# with 2 processes, single-process PyTorch, and tandem on 2 ranks with the main job's default
# backend (no --backend flag: HierarchicalComm, shared memory on one node), Gloo, ShmComm, MPI and
# threads. Writes seconds of training per epoch, final test accuracy and the
# ratios to bench/results/fashion-mnist.md (or $FASHION_MNIST_OUT), and the accuracy-against-time
# plot beside it (matplotlib).
#   bench/fashion_mnist/run_fashion_mnist.sh [BUILD_DIR]     (default build/release)
# Needs: fashion_mnist and tandemrun built (Release), OpenMPI, Debian's python3-torch and
# python3-matplotlib for /usr/bin/python3, dataset-fashion-mnist.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
build=${1:-build/release}
case $build in /*) ;; *) build=$root/$build ;; esac
program=$build/examples/fashion_mnist/fashion_mnist
tandemrun=$build/tools/tandemrun
for f in "$program" "$tandemrun"; do [[ -x $f ]] || { echo "missing $f" >&2; exit 1; }; done
python=/usr/bin/python3
out=${FASHION_MNIST_OUT:-$root/bench/results/fashion-mnist.md}
plot=${out%.md}.png
tmp=$(mktemp -d /tmp/tandem-bench-fmnist.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
export GLOO_SOCKET_IFNAME=lo OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

source "$root/bench/common/training_runs.sh"
port=$((29500 + RANDOM % 1000))
run torch_ddp bash -c "for r in 0 1; do RANK=\$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port $python $here/fashion_mnist_torch.py & done; wait"
run torch_single "$python" "$here/fashion_mnist_torch.py"
run tandem_default "$tandemrun" --standalone --nproc-per-node 2 "$program" --plain --epochs 3
run tandem_gloo "$tandemrun" --standalone --nproc-per-node 2 "$program" --backend gloo --plain --epochs 3
run tandem_shm "$tandemrun" --standalone --nproc-per-node 2 "$program" --backend shm --plain --epochs 3
run tandem_mpi mpirun -n 2 --oversubscribe --bind-to none "$program" --backend mpi --plain --epochs 3
run tandem_local "$program" --backend local --ranks 2 --plain --epochs 3
for name in tandem_default tandem_gloo tandem_shm tandem_mpi tandem_local; do tandem_epochs <"$tmp/$name.log" >"$tmp/$name.epochs"; done
for name in torch_ddp torch_single; do grep "^EPOCH" "$tmp/$name.log" | awk '{print $1, $2, $3, $4 * 100}' >"$tmp/$name.epochs"; done
for name in tandem_default tandem_gloo tandem_shm tandem_mpi tandem_local torch_ddp torch_single; do
  [[ $(wc -l <"$tmp/$name.epochs") -eq 3 ]] || { cat "$tmp/$name.log"; echo "FAILED: $name did not report 3 epochs" >&2; exit 1; }
done

PYTHONPATH="$root/bench/common${PYTHONPATH:+:$PYTHONPATH}" "$python" - "$tmp" "$out" "$plot" "$(git -C "$root" rev-parse --short HEAD)" <<'PY'
import sys, datetime, os
from training_report import best_run_summary, plot_accuracy, read_runs, results_table, write_report
tmp, out, plot, commit = sys.argv[1:5]
names = {"torch_ddp": "PyTorch DDP, 2 processes (gloo)", "torch_single": "PyTorch, 1 process",
         "tandem_default": "tandem, 2 ranks (default: HierarchicalComm, shared memory)",
         "tandem_gloo": "tandem, 2 ranks (Gloo)",
         "tandem_shm": "tandem, 2 ranks (shared memory, ShmComm)",
         "tandem_mpi": "tandem, 2 ranks (MPI)",
         "tandem_local": "tandem, 2 ranks (threads)"}
runs, per_epoch = read_runs(tmp, names, 80.0)
best = min(("tandem_default", "tandem_gloo", "tandem_shm", "tandem_mpi", "tandem_local"),
           key=per_epoch.get)
lines = [
    "# Fashion-MNIST: tandem beside PyTorch, same recipe", "",
    f"Run {datetime.date.today()} on this 2-core VM, commit {commit}, by "
    "`bench/fashion_mnist/run_fashion_mnist.sh` (Release build). The same MLP "
    "784-256-BatchNorm-ReLU-10, nn.Linear's initialisation distribution, SGD lr 0.1 momentum 0.9, "
    "batch 64 per rank, 3 epochs, the same DistributedSampler order (seed 0); tandem with "
    "`--plain`. Seconds are training only (evaluation excluded), on one shared machine: compare "
    "the ratios, not the absolute times. PyTorch holds the data in tensors (no DataLoader), its "
    "fastest CPU variant; under DDP its BatchNorm is per rank (torch's SyncBatchNorm refuses CPU "
    "tensors), tandem's is synchronised.", ""]
lines += results_table(names, runs, per_epoch, {
    "epoch time vs PyTorch DDP": lambda key: per_epoch[key] / per_epoch["torch_ddp"],
    "vs 1-process PyTorch": lambda key: per_epoch[key] / per_epoch["torch_single"]})
single = per_epoch["torch_single"] / per_epoch[best]
lines += ["", best_run_summary(names, runs, per_epoch, best, 0.3,
                               f", {single:.2f}x as fast as single-process PyTorch (target > 1x)"),
          "", best_run_summary(names, runs, per_epoch, "tandem_default", 0.3,
                               lead="The main job's default backend"),
          "", f"![test accuracy against training time]({os.path.basename(plot)})"]
write_report(out, lines)
plot_accuracy(runs, names, plot, "seconds of training (2-core VM)",
              "Fashion-MNIST, 3 epochs, batch 64 per rank")
PY
