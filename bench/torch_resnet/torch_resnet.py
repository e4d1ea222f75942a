#!/usr/bin/env python3
"""PyTorch's side of bench/torch_resnet: the ResNet of examples/torch_resnet (same module tree,
so the same state_dict names), the same recipe (SGD momentum 0.9 in two param groups - weight
decay on conv and linear weights, none on BatchNorm and biases -, warm-up + cosine as a LambdaLR,
an EMA of the weights updated every step) and the same data order (DistributedSampler, seed 0,
set_epoch; tandem's sampler equals it bit for bit), trained with DistributedDataParallel over
gloo. The data sit in tensors (no DataLoader workers: PyTorch's fastest CPU variant).
Prints one line per epoch:
    EPOCH <epoch> <seconds of training so far> <test accuracy> steps <steps this epoch>
Initial weights: --init FILE loads a safetensors file strictly (the names of state_dict());
--write-init FILE writes the module as built under torch.manual_seed(--seed) and exits.
Python's safetensors package is not needed (Debian's python3 lacks it): the format is read and
written here (8-byte header length, JSON header, raw little-endian data).
  DDP over gloo, 2 processes (torchrun's variables set by hand, see MACHINE-NOTES):
    for r in 0 1; do RANK=$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 \\
      GLOO_SOCKET_IFNAME=lo /usr/bin/python3 torch_resnet.py --epochs 1 --init init.safetensors & done
  Single process: /usr/bin/python3 torch_resnet.py
Under DDP its BatchNorm is per rank: torch's SyncBatchNorm refuses CPU tensors."""
import argparse
import gzip
import json
import math
import os
import struct
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

MEAN, STD = 0.2860406, 0.3530242  # torchvision's Normalize for Fashion-MNIST, as tandem's


class Block(nn.Module):
    """A residual block: body = conv3x3-BN-ReLU-conv3x3-BN, shortcut = conv1x1-BN when the shape
    changes (else identity, an empty Sequential), out = relu(body(x) + shortcut(x))."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x):
        return F.relu(self.body(x) + self.shortcut(x))


class ResNet(nn.Module):
    """stem (conv3x3 stride 2, 28 -> 14) and three stages of one block (widths w, 2w, 4w; 14, 7,
    4 pixels), global average pooling, a linear head: examples/torch_resnet's Net."""

    def __init__(self, width=24):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, width, 3, 2, 1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        self.layer1 = nn.Sequential(Block(width, width, 1))
        self.layer2 = nn.Sequential(Block(width, 2 * width, 2))
        self.layer3 = nn.Sequential(Block(2 * width, 4 * width, 2))
        self.fc = nn.Linear(4 * width, 10)

    def forward(self, x):
        x = self.layer3(self.layer2(self.layer1(self.stem(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def load(directory, split):
    with gzip.open(os.path.join(directory, f"{split}-images-idx3-ubyte.gz")) as f:
        images = np.frombuffer(f.read()[16:], dtype=np.uint8).reshape(-1, 1, 28, 28)
    with gzip.open(os.path.join(directory, f"{split}-labels-idx1-ubyte.gz")) as f:
        labels = np.frombuffer(f.read()[8:], dtype=np.uint8).astype(np.int64)
    x = torch.from_numpy(images.astype(np.float32)).div_(255).sub_(MEAN).div_(STD)
    return x, torch.from_numpy(labels)


DTYPES = {torch.float32: ("F32", np.float32), torch.int64: ("I64", np.int64)}


def write_safetensors(path, tensors):
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, t in tensors.items():
        code, _ = DTYPES[t.dtype]
        data = t.detach().contiguous().numpy().tobytes()
        header[name] = {"dtype": code, "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path + ".tmp", "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))
    os.replace(path + ".tmp", path)


def read_safetensors(path):
    with open(path, "rb") as f:
        raw = f.read()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    header.pop("__metadata__", None)
    base, out = 8 + length, {}
    by_code = {code: numpy for code, numpy in DTYPES.values()}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        array = np.frombuffer(raw[base + begin:base + end], dtype=by_code[entry["dtype"]])
        out[name] = torch.from_numpy(array.copy()).reshape(entry["shape"])
    return out


def warmup_cosine(warmup, total, lr_min):
    """tandem::lr::warmup_cosine's factor (lr_max 1): linear warm-up, cosine down to lr_min."""
    def factor(s):
        if s < warmup:
            return (s + 1) / warmup
        if s > total:
            return lr_min
        progress = 1.0 if total == warmup else (s - warmup) / (total - warmup)
        return lr_min + (1 - lr_min) * (1 + math.cos(math.pi * progress)) / 2
    return factor


class EMA:
    """timm's ModelEmaV3 with warm-up (tandem::EMA's defaults in the example: decay 0.999,
    power 2/3): floating tensors lerp toward the live ones, integral buffers are copied."""

    def __init__(self, model, decay=0.999):
        self.decay, self.updates = decay, 0
        self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items()}

    @torch.no_grad()
    def update(self, model):
        self.updates += 1
        s = self.updates - 1
        decay = 0.0 if s == 0 else min(self.decay, 1 - (1 + s) ** (-2 / 3))
        for k, v in model.state_dict().items():
            if v.is_floating_point():
                self.shadow[k].lerp_(v, 1 - decay)
            else:
                self.shadow[k].copy_(v)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--weight-decay", type=float, default=5e-4)
    parser.add_argument("--width", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-steps", type=int, default=-1, help="stop each epoch early (smoke)")
    parser.add_argument("--data", default=os.environ.get("FASHION_MNIST_DIR",
                                                         "/usr/share/datasets/fashion-mnist"))
    parser.add_argument("--init", help="initial weights (safetensors, state_dict names)")
    parser.add_argument("--write-init", help="write the initial weights here and exit")
    args = parser.parse_args()

    torch.set_num_threads(1)  # one core per rank: the ranks are the parallelism
    torch.manual_seed(args.seed)
    model = ResNet(args.width)
    if args.write_init:
        write_safetensors(args.write_init, model.state_dict())
        return 0
    if args.init:
        model.load_state_dict(read_safetensors(args.init), strict=True)

    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    train_x, train_y = load(args.data, "train")
    test_x, test_y = load(args.data, "t10k")
    net = nn.parallel.DistributedDataParallel(model) if distributed else model

    # Two param groups, as tandem's example: decay for conv/linear weights, none for BN and biases.
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if p.dim() <= 1]
    optimizer = torch.optim.SGD([{"params": decay, "weight_decay": args.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}],
                                lr=args.lr, momentum=0.9)
    steps_per_epoch = math.ceil(math.ceil(len(train_y) / world) / args.batch_size)
    total = steps_per_epoch * args.epochs
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(min(100, total // 10), total, 0.01))
    ema = EMA(model)

    class Sized:
        def __len__(self):
            return len(train_y)

    sampler = torch.utils.data.DistributedSampler(Sized(), num_replicas=world, rank=rank,
                                                  shuffle=True, seed=args.seed)
    trained = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        indices = torch.tensor(list(iter(sampler)))
        net.train()
        start = time.perf_counter()
        steps = 0
        for first in range(0, len(indices), args.batch_size):
            batch = indices[first:first + args.batch_size]
            optimizer.zero_grad()
            loss = F.cross_entropy(net(train_x[batch]), train_y[batch])
            loss.backward()
            optimizer.step()
            schedule.step()
            ema.update(model)
            steps += 1
            if steps == args.max_steps:
                break
        if distributed:
            dist.barrier()
        trained += time.perf_counter() - start
        # Distributed evaluation: each rank its share of the test set, the counts summed.
        model.eval()
        with torch.no_grad():
            mine = torch.arange(rank, len(test_y), world)
            counts = torch.tensor([(model(test_x[mine]).argmax(1) == test_y[mine]).sum().item(),
                                   len(mine)], dtype=torch.int64)
        if distributed:
            dist.all_reduce(counts)
        if rank == 0:
            print(f"EPOCH {epoch} {trained:.4f} {counts[0].item() / counts[1].item():.4f} "
                  f"steps {steps}", flush=True)
    if distributed:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
