"""bench/common/training_report.py - what the training benchmarks' reports (run_fashion_mnist.sh,
run_fashion_mnist_gpu.sh, run_torch_resnet.sh) share: each run's epoch rows, checked to have
trained, the table of seconds per epoch, accuracy and ratios, and the accuracy plot.
    PYTHONPATH=$root/bench/common python3 - ... ; from training_report import read_runs
"""
import os
import sys


def read_runs(tmp, names, least_accuracy, epochs=None):
    """runs[key] = [(seconds so far, accuracy %)] from tmp/key.epochs, whose rows end in those
    two numbers ("EPOCH E S A" or "E S A"), and seconds per epoch. Exits with FAILED when a run
    did not train, or did not report `epochs` rows where given: a time for training that did not
    happen is worse than none."""
    runs = {}
    for key in names:
        rows = [line.split() for line in open(os.path.join(tmp, key + ".epochs")) if line.strip()]
        if epochs is not None and len(rows) != epochs:
            sys.exit(f"FAILED: {names[key]} reported {len(rows)} epochs, not {epochs}")
        runs[key] = [(float(r[-2]), float(r[-1])) for r in rows]
    for key, rows in runs.items():
        if not all(seconds > 0 for seconds, _ in rows) or rows[-1][1] < least_accuracy:
            sys.exit(f"FAILED: {names[key]} did not train (final accuracy {rows[-1][1]} %)")
    per_epoch = {k: v[-1][0] / len(v) for k, v in runs.items()}
    return runs, per_epoch


def results_table(names, runs, per_epoch, ratios, digits=2):
    """The report's Markdown table: a row a run with its seconds per epoch (`digits` decimals),
    final test accuracy, and a column for each of `ratios` (heading -> function of the run's key,
    printed as "1.23x")."""
    lines = ["| run | s / epoch | test accuracy | " + " | ".join(ratios) + " |",
             "|---|---:|---:|" + "---:|" * len(ratios)]
    for key, label in names.items():
        cells = " | ".join(f"{ratio(key):.2f}x" for ratio in ratios.values())
        lines.append(f"| {label} | {per_epoch[key]:.{digits}f} | {runs[key][-1][1]:.2f} % | {cells} |")
    return lines


def best_run_summary(names, runs, per_epoch, best, ratio_target, also="", peer="torch_ddp",
                     peer_label="PyTorch DDP", lead="Best tandem run"):
    """The sentence on the best tandem run against `peer`: seconds per epoch, the ratio of epoch
    times against its target, `also` (more of the same sentence), and the two final accuracies
    against the 0.5-point target. `lead` names the run's role (the best one, the default one)."""
    ratio = per_epoch[best] / per_epoch[peer]
    gap = runs[best][-1][1] - runs[peer][-1][1]
    met = lambda ok: "met" if ok else "not met"
    return (f"{lead}: {names[best]}, {per_epoch[best]:.2f} s per epoch: {ratio:.2f}x "
            f"{peer_label}'s epoch time (target <= {ratio_target}x: {met(ratio <= ratio_target)})"
            f"{also}; accuracy {runs[best][-1][1]:.2f} % against {peer_label}'s "
            f"{runs[peer][-1][1]:.2f} % ({gap:+.2f} points; target within 0.5: "
            f"{met(abs(gap) <= 0.5)}).")


def write_report(out, lines):
    """Writes the report (its folder made where missing) and prints it."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as report:
        report.write("\n".join(lines) + "\n")
    print("\n".join(lines))


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
