#!/usr/bin/env python3
"""PyTorch's side of bench/fashion_mnist on one GPU: the same MLP (784-256-BatchNorm-ReLU-10,
nn.Linear's default initialisation), recipe (SGD lr 0.1, momentum 0.9, batch 64, 3 epochs) and data
order (DistributedSampler with one replica, seed 0, set_epoch) as `fashion_mnist_cuda --plain`.
Variants (--variant):
    loader        DataLoader over CPU tensors, 2 workers, pin_memory, non_blocking copies; fp32
    loader_amp    the same with torch.autocast(float16) and GradScaler
    resident      the whole data set on the GPU, each batch indexed there; fp32
    resident_amp  the same with torch.autocast(float16) and GradScaler
Prints one line per epoch (training time only, the GPU synchronised before the clock is read):
    EPOCH <epoch> <seconds of training so far> <test accuracy>"""
import argparse
import os
import sys
import time

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

# The data set is read and normalised exactly as the CPU peer does (this script's folder is on
# sys.path when it runs).
from fashion_mnist_torch import load


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", default="resident",
                        choices=["loader", "loader_amp", "resident", "resident_amp"])
    parser.add_argument("--epochs", type=int, default=int(os.environ.get("EPOCHS", "3")))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("fashion_mnist_torch_gpu: SKIPPED: torch sees no CUDA device", file=sys.stderr)
        return 77
    torch.manual_seed(0)
    gpu = torch.device("cuda")
    directory = os.environ.get("FASHION_MNIST_DIR", "/usr/share/datasets/fashion-mnist")
    train_x, train_y = load(directory, "train")
    test_x, test_y = load(directory, "t10k")
    test_x, test_y = test_x.to(gpu), test_y.to(gpu)
    model = nn.Sequential(nn.Linear(784, 256), nn.BatchNorm1d(256), nn.ReLU(),
                          nn.Linear(256, 10)).to(gpu)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    amp = args.variant.endswith("_amp")
    scaler = torch.amp.GradScaler("cuda", enabled=amp)
    resident = args.variant.startswith("resident")
    sampler = DistributedSampler(TensorDataset(train_x, train_y), num_replicas=1, rank=0,
                                 shuffle=True, seed=0)
    if resident:
        train_x_gpu, train_y_gpu = train_x.to(gpu), train_y.to(gpu)
    else:
        loader = DataLoader(TensorDataset(train_x, train_y), batch_size=64, sampler=sampler,
                            num_workers=2, pin_memory=True, persistent_workers=True)

    def step(x, y):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        return 1

    trained = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        torch.cuda.synchronize()
        start = time.perf_counter()
        steps = 0
        if resident:
            indices = torch.tensor(list(iter(sampler)), device=gpu)
            for first in range(0, len(indices), 64):
                batch = indices[first:first + 64]
                steps += step(train_x_gpu[batch], train_y_gpu[batch])
        else:
            for x, y in loader:
                steps += step(x.to(gpu, non_blocking=True), y.to(gpu, non_blocking=True))
        torch.cuda.synchronize()
        trained += time.perf_counter() - start
        model.eval()
        with torch.no_grad():
            correct = (model(test_x).argmax(1) == test_y).sum().item()
        print(f"EPOCH {epoch} {trained:.4f} {correct / len(test_y):.4f} steps {steps}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
