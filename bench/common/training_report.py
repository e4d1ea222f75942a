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


def plot_accuracy(runs, names, plot, xlabel, title):
    """Test accuracy against seconds of training, one line a run, saved to plot; a note on stderr
    and no plot where matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: no plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for key, label in names.items():
        ax.plot([r[0] for r in runs[key]], [r[1] for r in runs[key]], marker="o", label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(plot, dpi=110)
