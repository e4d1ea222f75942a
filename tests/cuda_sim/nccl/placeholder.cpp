// Replaced by the simulated NCCL.
