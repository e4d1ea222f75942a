#!/usr/bin/env python3
"""Writes tandem's golden data with PyTorch: each golden_<topic>.py module beside this script
produces <topic>.txt in this folder. The files are checked in; run this only to regenerate them.

    /usr/bin/python3 tests/reference/make_golden.py            # Debian's python3-torch 1.13
    python3 tests/reference/make_golden.py optim lr            # some topics only

Record format (tests/support/golden.hpp reads it): one `key count v0 v1 ...` per line, values
as float.hex() so the C++ side reads exactly what PyTorch computed.
"""
import importlib
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent


class Writer:
    """Collects records for one topic and writes them in one go (a failed run leaves the old
    file in place rather than half of a new one)."""

    def __init__(self, topic):
        self.topic = topic
        self.lines = []
        self.keys = set()

    def comment(self, text):
        for line in text.splitlines():
            self.lines.append("# " + line)

    def record(self, key, values):
        if " " in key or key in self.keys:
            raise ValueError(f"{self.topic}: bad or duplicate key {key!r}")
        self.keys.add(key)
        flat = [float(v) for v in _flatten(values)]
        self.lines.append(" ".join([key, str(len(flat))] + [v.hex() for v in flat]))

    def record_ints(self, key, values):
        """Integers in decimal (indices, counts): exact, and a third of the size of hex floats."""
        if " " in key or key in self.keys:
            raise ValueError(f"{self.topic}: bad or duplicate key {key!r}")
        self.keys.add(key)
        ints = [int(v) for v in values]
        self.lines.append(" ".join([key, str(len(ints))] + [str(v) for v in ints]))

    def write(self):
        import torch

        header = f"# {self.topic}: written by make_golden.py with torch {torch.__version__}\n"
        target = HERE / f"{self.topic}.txt"
        temporary = target.with_suffix(".txt.tmp")
        temporary.write_text(header + "\n".join(self.lines) + "\n")
        temporary.replace(target)
        print(f"wrote {target.name}: {len(self.keys)} records")


def _flatten(values):
    if hasattr(values, "detach"):
        return values.detach().double().flatten().tolist()
    if isinstance(values, (list, tuple)):
        out = []
        for v in values:
            out.extend(_flatten(v))
        return out
    return [values]


def main(argv):
    topics = argv or sorted(p.stem[len("golden_"):] for p in HERE.glob("golden_*.py"))
    sys.path.insert(0, str(HERE))
    for topic in topics:
        module = importlib.import_module(f"golden_{topic}")
        writer = Writer(topic)
        module.generate(writer)
        writer.write()


if __name__ == "__main__":
    main(sys.argv[1:])
