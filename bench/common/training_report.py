"""bench/common/training_report.py - what the CPU training benchmarks' reports (run_fashion_mnist.sh,
run_torch_resnet.sh) read first: each run's "EPOCH E S A" rows, checked to have trained.
    PYTHONPATH=$root/bench/common python3 - ... ; from training_report import read_runs
"""
import os
import sys


def read_runs(tmp, names, least_accuracy):
    """runs[key] = [(seconds so far, accuracy %)] from tmp/key.epochs, and seconds per epoch.
    Exits with FAILED when a run did not train: a time for training that did not happen is worse
    than none."""
    runs = {}
    for key in names:
        rows = [line.split() for line in open(os.path.join(tmp, key + ".epochs"))]
        runs[key] = [(float(r[2]), float(r[3])) for r in rows]
    for key, rows in runs.items():
        if not all(seconds > 0 for seconds, _ in rows) or rows[-1][1] < least_accuracy:
            sys.exit(f"FAILED: {names[key]} did not train (final accuracy {rows[-1][1]} %)")
    per_epoch = {k: v[-1][0] / len(v) for k, v in runs.items()}
    return runs, per_epoch
