#!/usr/bin/env python3
"""PyTorch's side of bench/fashion_mnist: the same MLP (784-256-BatchNorm-ReLU-10, nn.Linear's
default initialisation), recipe (SGD lr 0.1, momentum 0.9, batch 64 per rank, 3 epochs) and data
order (DistributedSampler, seed 0, set_epoch) as `fashion_mnist --plain`, with the data resident
in tensors (PyTorch's fastest variant on a CPU: no DataLoader workers). Prints one line per epoch:
    EPOCH <epoch> <seconds of training so far> <test accuracy>
Single process:  fashion_mnist_torch.py
DDP over gloo:   RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p fashion_mnist_torch.py
(plain BatchNorm1d under DDP: torch's SyncBatchNorm refuses CPU tensors.)"""
import gzip
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DistributedSampler

MEAN, STD = 0.2860406, 0.3530242


def load(directory, split):
    with gzip.open(os.path.join(directory, f"{split}-images-idx3-ubyte.gz")) as f:
        images = np.frombuffer(f.read()[16:], dtype=np.uint8).reshape(-1, 784)
    with gzip.open(os.path.join(directory, f"{split}-labels-idx1-ubyte.gz")) as f:
        labels = np.frombuffer(f.read()[8:], dtype=np.uint8).astype(np.int64)
    x = torch.from_numpy(images.astype(np.float32)).div_(255).sub_(MEAN).div_(STD)
    return x, torch.from_numpy(labels)


def main():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    directory = os.environ.get("FASHION_MNIST_DIR", "/usr/share/datasets/fashion-mnist")
    epochs = int(os.environ.get("EPOCHS", "3"))
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    train_x, train_y = load(directory, "train")
    test_x, test_y = load(directory, "t10k")
    model = nn.Sequential(nn.Linear(784, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 10))
    net = nn.parallel.DistributedDataParallel(model) if distributed else model
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    class Sized:
        def __len__(self):
            return len(train_y)

    sampler = DistributedSampler(Sized(), num_replicas=world, rank=rank, shuffle=True, seed=0)
    trained = 0.0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        indices = torch.tensor(list(iter(sampler)))
        net.train()
        start = time.perf_counter()
        steps = 0
        for first in range(0, len(indices), 64):
            batch = indices[first:first + 64]
            optimizer.zero_grad()
            loss = loss_fn(net(train_x[batch]), train_y[batch])
            loss.backward()
            optimizer.step()
            steps += 1
        if distributed:
            dist.barrier()
        trained += time.perf_counter() - start
        net.eval()
        with torch.no_grad():
            correct = (model(test_x).argmax(1) == test_y).sum().item()
        if rank == 0:
            print(f"EPOCH {epoch} {trained:.4f} {correct / len(test_y):.4f} steps {steps}", flush=True)
    if distributed:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
