#!/usr/bin/env bash
# bench/torch_resnet/run_torch_resnet.sh - the libtorch ResNet of examples/torch_resnet beside
# PyTorch DDP, in one run: the same model (the same module tree and state_dict names), the same
# initial weights (written by PyTorch's side, read by tandem's with --init), the same recipe (SGD
# momentum 0.9, weight decay on conv/linear weights only, warm-up + cosine, EMA, batch 64 per
# rank) and the same data order (DistributedSampler, seed 0). PyTorch: DDP over gloo, 2 processes
# started by hand (Debian's torchrun crashes, see MACHINE-NOTES); tandem: 2 ranks with the
# default backend (HierarchicalComm: shared memory on one node), Gloo, MPI and threads, and the
# default backend once more with --no-sync-bn (per-rank BatchNorm, as PyTorch's side has), and
# the compute floor (two one-rank processes with no communication). Writes seconds of training
# per epoch, test accuracy and the ratios to
# bench/results/torch-resnet.md (or $TORCH_RESNET_OUT), and accuracy against time to the .png
# beside it (matplotlib).
#   bench/torch_resnet/run_torch_resnet.sh [BUILD_DIR] [EPOCHS]     (default build/release, 2)
# Needs: torch_resnet and tandemrun built (Release, libtorch found), OpenMPI, Debian's
# python3-torch, python3-numpy and python3-matplotlib for /usr/bin/python3,
# dataset-fashion-mnist. Each run is about a minute per epoch on this 2-core VM.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
build=${1:-build/release}
epochs=${2:-2}
case $build in /*) ;; *) build=$root/$build ;; esac
program=$build/examples/torch_resnet/torch_resnet
tandemrun=$build/tools/tandemrun
for f in "$program" "$tandemrun"; do [[ -x $f ]] || { echo "missing $f" >&2; exit 1; }; done
python=/usr/bin/python3
out=${TORCH_RESNET_OUT:-$root/bench/results/torch-resnet.md}
plot=${out%.md}.png
tmp=$(mktemp -d /tmp/tandem-bench-resnet.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
export GLOO_SOCKET_IFNAME=lo OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
load_before=$(cut -d' ' -f1-3 /proc/loadavg)

source "$root/bench/common/training_runs.sh"

# One side writes the initial weights, the other reads them (both sides read them here).
"$python" "$here/torch_resnet.py" --write-init "$tmp/init.safetensors"
common=(--epochs "$epochs" --init "$tmp/init.safetensors")
port=$((29500 + RANDOM % 1000))
run torch_ddp bash -c "for r in 0 1; do RANK=\$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port $python $here/torch_resnet.py ${common[*]} & done; wait"
run tandem_default "$tandemrun" --standalone --nproc-per-node 2 "$program" "${common[@]}"
run tandem_default_nosyncbn "$tandemrun" --standalone --nproc-per-node 2 "$program" --no-sync-bn "${common[@]}"
run tandem_gloo "$tandemrun" --standalone --nproc-per-node 2 "$program" --backend gloo "${common[@]}"
run tandem_mpi mpirun -n 2 --oversubscribe --bind-to none "$program" --backend mpi "${common[@]}"
run tandem_local "$program" --backend local --ranks 2 "${common[@]}"
# The compute floor: what one epoch's libtorch work costs with no distribution at all. Two
# independent one-rank processes at once (the two cores busy, as in every run above), each the
# steps one rank takes per epoch (ceil(60000 / 2 / 64) = 469 batches of 64), per-rank BatchNorm.
steps_per_rank=469
run compute_floor bash -c "for i in 0 1; do $program --backend local --ranks 1 --no-sync-bn --max-steps $steps_per_rank --epochs 1 --init $tmp/init.safetensors & done; wait"
floor=$(tandem_epochs <"$tmp/compute_floor.log" | awk '{s += $3; n++} END {if (n == 2) printf "%.2f", s / n}')
[[ -n $floor && $(grep -c "after $steps_per_rank steps" "$tmp/compute_floor.log") -eq 2 ]] || {
  cat "$tmp/compute_floor.log"; echo "FAILED: compute_floor: not two processes of $steps_per_rank steps each" >&2; exit 1; }
names=(torch_ddp tandem_default tandem_default_nosyncbn tandem_gloo tandem_mpi tandem_local)
for name in "${names[@]:1}"; do tandem_epochs <"$tmp/$name.log" >"$tmp/$name.epochs"; done
grep "^EPOCH" "$tmp/torch_ddp.log" | awk '{print $1, $2, $3, $4 * 100}' >"$tmp/torch_ddp.epochs"
for name in "${names[@]}"; do
  [[ $(wc -l <"$tmp/$name.epochs") -eq $epochs ]] || {
    cat "$tmp/$name.log"; echo "FAILED: $name did not report $epochs epochs" >&2; exit 1; }
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg)

PYTHONPATH="$root/bench/common${PYTHONPATH:+:$PYTHONPATH}" "$python" - "$tmp" "$out" "$plot" "$(git -C "$root" rev-parse --short HEAD)" "$epochs" \
  "$load_before" "$load_after" "$floor" <<'PY'
import sys, datetime, os
from training_report import best_run_summary, plot_accuracy, read_runs, results_table, write_report
tmp, out, plot, commit, epochs, load_before, load_after, floor = sys.argv[1:9]
floor = float(floor)
names = {"torch_ddp": "PyTorch DDP, 2 processes (gloo)",
         "tandem_default": "tandem, 2 ranks (default: HierarchicalComm, shared memory)",
         "tandem_default_nosyncbn": "tandem, 2 ranks (default backend, --no-sync-bn: per-rank BatchNorm)",
         "tandem_gloo": "tandem, 2 ranks (Gloo)",
         "tandem_mpi": "tandem, 2 ranks (MPI)", "tandem_local": "tandem, 2 ranks (threads)"}
runs, per_epoch = read_runs(tmp, names, 70.0)
tandems = ("tandem_default", "tandem_gloo", "tandem_mpi", "tandem_local")
best = min(tandems, key=per_epoch.get)
lines = [
    "# libtorch ResNet: tandem's DDP beside PyTorch DDP, same model and recipe", "",
    f"Run {datetime.date.today()} on the 2-core development VM (Debian 12, libtorch 1.13.1 on both "
    f"sides), commit {commit}, by `bench/torch_resnet/run_torch_resnet.sh` (Release build), "
    f"{epochs} epochs per run (a short run: the CPU is shared). The ResNet of "
    "`examples/torch_resnet` (stride-2 stem, three residual blocks of widths 24/48/96, 174 k "
    "parameters), the same initial weights (written by the PyTorch side, loaded by tandem's with "
    "`--init`), SGD momentum 0.9 lr 0.1 with weight decay 5e-4 on conv/linear weights only, "
    "warm-up + cosine, an EMA updated every step, batch 64 per rank, the same DistributedSampler "
    "order (seed 0); one libtorch thread per rank. Seconds are training only (evaluation "
    "excluded). Differences: tandem's BatchNorm is synchronised across ranks (SyncBatchNorm), "
    "PyTorch's is per rank (torch 1.13's SyncBatchNorm refuses CPU tensors; DDP broadcasts rank "
    "0's buffers each forward instead); PyTorch indexes resident tensors, tandem reads through its "
    "Loader (one worker thread).", "",
    f"Load average (1, 5, 15 min) before the runs: {load_before}; after: {load_after} (a load "
    "near 2 is the runs themselves: two ranks on two cores). Absolute seconds drift on this "
    "shared VM: compare the ratios.", ""]
lines += results_table(names, runs, per_epoch, {
    "epoch time vs PyTorch DDP": lambda key: per_epoch[key] / per_epoch["torch_ddp"]})
lines += ["", best_run_summary(names, runs, per_epoch, best, 0.7), "",
          best_run_summary(names, runs, per_epoch, "tandem_default", 0.7,
                           lead="The default backend"), "",
          best_run_summary(names, runs, per_epoch, "tandem_default_nosyncbn", 0.7,
                           lead="Like for like (per-rank BatchNorm on both sides)"), "",
          f"Compute floor: two independent one-rank processes at once, each the 469 steps one "
          f"rank takes per epoch, with no communication and per-rank BatchNorm: {floor:.2f} s, "
          f"{floor / per_epoch['torch_ddp']:.2f}x PyTorch DDP's epoch. Against it: PyTorch DDP "
          f"{per_epoch['torch_ddp'] / floor:.2f}x, tandem --no-sync-bn "
          f"{per_epoch['tandem_default_nosyncbn'] / floor:.2f}x, tandem's default "
          f"{per_epoch['tandem_default'] / floor:.2f}x. A DDP can remove its own cost, not the "
          "libtorch work the floor measures, so a target below the floor's ratio needs faster "
          "kernels. The floor is a measurement too, with this VM's run-to-run noise of several "
          "percent: a run within that of 1.00x is at the floor.", "",
          f"![test accuracy against training time]({os.path.basename(plot)})"]
write_report(out, lines)
plot_accuracy(runs, names, plot, "seconds of training (2-core VM, shared)",
              f"libtorch ResNet on Fashion-MNIST, {epochs} epochs, batch 64 per rank")
PY
