#!/usr/bin/env python3
"""Reads tandem's TensorBoard events with TensorBoard's own reader (the `tensorboard` package):
tensorboard_read.py WRITER -- runs WRITER DIR, then checks tags, steps and values. Exit 77
(skipped) when the package is not installed."""
import subprocess
import sys
import tempfile

try:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
except ImportError as error:
    print(f"SKIPPED: the tensorboard package is not installed ({error})")
    sys.exit(77)

with tempfile.TemporaryDirectory() as directory:
    subprocess.run([sys.argv[1], directory], check=True)
    events = EventAccumulator(directory)
    events.Reload()
    tags = sorted(events.Tags()["scalars"])
    assert tags == ["test/accuracy", "train/loss"], tags
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == list(range(10)), loss
    for e in loss:
        assert abs(e.value - 2.0 / (e.step + 1)) < 1e-6, e
    accuracy = events.Scalars("test/accuracy")
    assert len(accuracy) == 1 and accuracy[0].step == 9 and accuracy[0].value == 0.8125
    print(f"PASSED: TensorBoard read {len(loss) + len(accuracy)} scalars under {tags}")
