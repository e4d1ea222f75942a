#!/usr/bin/env python3
"""PyTorch's side of bench/loader: Fashion-MNIST through torch.utils.data.DataLoader with a
DistributedSampler (1 replica), batch 64, 2 workers, pin_memory, samples normalised per sample
as torchvision's ToTensor + Normalize(0.2860406, 0.3530242) does (with torch ops, not PIL, which
only makes PyTorch faster). Checks every epoch like bench_loader and prints RESULT lines.

    /usr/bin/python3 bench/loader/loader_torch.py [--epochs N] [--workers N] [--data DIR]
"""
import argparse
import gzip
import os
import sys
import time

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

MEAN, STD = 0.2860406, 0.3530242


class FashionMNIST(Dataset):
    def __init__(self, directory):
        with gzip.open(os.path.join(directory, "train-images-idx3-ubyte.gz")) as f:
            self.images = np.frombuffer(f.read()[16:], dtype=np.uint8).reshape(-1, 1, 28, 28)
        with gzip.open(os.path.join(directory, "train-labels-idx1-ubyte.gz")) as f:
            self.labels = np.frombuffer(f.read()[8:], dtype=np.uint8).astype(np.int64)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        image = torch.from_numpy(self.images[i]).float().div(255).sub(MEAN).div(STD)
        return image, int(self.labels[i])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--data", default=os.environ.get("FASHION_MNIST_DIR",
                                                         "/usr/share/datasets/fashion-mnist"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = FashionMNIST(args.data)
    expected = int((np.arange(len(data), dtype=np.int64) * data.labels).sum())
    sampler = DistributedSampler(data, num_replicas=1, rank=0, seed=0)
    loader = DataLoader(data, batch_size=64, sampler=sampler, num_workers=args.workers,
                        pin_memory=True)
    samples = 0
    start = time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        indices = torch.tensor(list(iter(sampler)))
        seen = 0
        weighted = 0
        for images, labels in loader:
            batch_indices = indices[seen:seen + len(labels)]
            weighted += int((batch_indices * labels).sum())
            seen += len(labels)
        if seen != len(data) or weighted != expected:
            print("loader_torch: FAILED: epoch incomplete or labels out of place", file=sys.stderr)
            return 1
        samples += seen
    elapsed = time.perf_counter() - start
    print(f"RESULT torch_samples_per_s {samples / elapsed:.0f}")
    print(f"RESULT torch_epoch_s {elapsed / args.epochs:.4f}")
    print(f"RESULT torch_version {torch.__version__}")
    print(f"RESULT torch_pin_memory {int(torch.cuda.is_available())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
