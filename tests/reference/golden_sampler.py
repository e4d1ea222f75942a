"""DistributedSampler index lists from torch.utils.data.DistributedSampler itself.

Keys: `n{n}/r{replicas}/k{rank}/s{seed}/e{epoch}/sh{0|1}/dl{0|1}` -> the rank's indices in order;
`big/...` for n = 60000 (the Fashion-MNIST training set): the first 500 indices and a checksum
`sum((position + 1) * index) mod 2^31 - 1` over all of them.
"""
import torch
from torch.utils.data import DistributedSampler

SIZES = [1, 3, 7, 8, 10, 37]
SEEDS = [0, 42, 2**32 + 5, 2**40 + 123]
EPOCHS = [0, 2]
BIG_MOD = 2**31 - 1


class _Sized:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n


def _indices(n, replicas, rank, seed, epoch, shuffle, drop_last):
    sampler = DistributedSampler(_Sized(n), num_replicas=replicas, rank=rank, shuffle=shuffle,
                                 seed=seed, drop_last=drop_last)
    sampler.set_epoch(epoch)
    indices = list(iter(sampler))
    assert len(indices) == len(sampler) == sampler.num_samples
    return indices, sampler.total_size


def generate(w):
    w.comment("DistributedSampler (torch.utils.data) index lists; see golden_sampler.py")
    for n in SIZES:
        for replicas in range(1, 9):
            for drop_last in (False, True):
                for shuffle in (False, True):
                    seeds = SEEDS if shuffle else [0]
                    epochs = EPOCHS if shuffle else [0]
                    for seed in seeds:
                        for epoch in epochs:
                            for rank in range(replicas):
                                indices, total = _indices(n, replicas, rank, seed, epoch, shuffle,
                                                          drop_last)
                                key = (f"n{n}/r{replicas}/k{rank}/s{seed}/e{epoch}"
                                       f"/sh{int(shuffle)}/dl{int(drop_last)}")
                                w.record_ints(key, indices)
                                w.record_ints(key + "/total", [total])
    for replicas, seed, epoch in [(1, 0, 0), (2, 0, 0), (2, 0, 1), (3, 2**33, 4), (8, 7, 0)]:
        for rank in sorted({0, replicas - 1}):
            for drop_last in (False, True):
                indices, _ = _indices(60000, replicas, rank, seed, epoch, True, drop_last)
                key = f"big/r{replicas}/k{rank}/s{seed}/e{epoch}/dl{int(drop_last)}"
                checksum = sum((p + 1) * v for p, v in enumerate(indices)) % BIG_MOD
                w.record_ints(key + "/prefix", indices[:500])
                w.record_ints(key + "/checksum", [checksum, len(indices)])
