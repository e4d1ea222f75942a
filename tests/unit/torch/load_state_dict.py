"""PyTorch loads a model-only checkpoint that tandem::torch wrote, strict.

Builds in PyTorch the model that tests/unit/torch/ddp_test.cpp builds with libtorch (TinyImpl),
loads MODEL with model.load_state_dict(safetensors.torch.load_file(MODEL), strict=True) (a key
missing or unexpected, or a shape that differs, raises), and checks that the loaded model computes
what the C++ one computed on the same input in EXPECTED (eval mode: BatchNorm uses the loaded
running statistics).
    python3 load_state_dict.py MODEL EXPECTED
"""
import sys

try:
    import torch
    from safetensors.torch import load_file
except ImportError as missing:  # the driver looked for both without importing them
    print(f"SKIPPED: {sys.executable} cannot import torch and safetensors.torch: {missing}")
    sys.exit(77)


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.ReLU())
        self.head = torch.nn.Linear(6, 3)
        self.tied = self.head.weight  # one tensor under two keys, as in the C++ model

    def forward(self, x):
        return self.head(self.body(x))


def main(model_file, expected_file):
    state = load_file(model_file)
    model = Tiny()
    model.load_state_dict(state, strict=True)
    count = state["body.1.num_batches_tracked"]
    if count.dtype != torch.int64 or count.dim() != 0 or count.item() != 3:
        sys.exit(f"FAILED: num_batches_tracked is {count} of {count.dtype}, not 3 of torch.int64 "
                 "with 0 dimensions (as PyTorch holds it)")
    if model.body[1].num_batches_tracked.shape != count.shape:
        sys.exit("FAILED: PyTorch's num_batches_tracked and the file's differ in shape")
    if not torch.equal(state["tied"], state["head.weight"]):
        sys.exit("FAILED: the tied parameter's two keys hold different values")
    expected = load_file(expected_file)
    model.eval()
    with torch.no_grad():
        y = model(expected["x"])
    difference = (y - expected["y"]).abs().max().item()
    if not torch.allclose(y, expected["y"], rtol=1e-5, atol=1e-6):
        sys.exit(f"FAILED: the loaded model's output differs from the C++ model's by {difference}")
    print(f"PASSED: torch {torch.__version__} loaded {len(state)} tensors strict; "
          f"outputs within {difference:.2e} of libtorch's")


if __name__ == "__main__":
    main(*sys.argv[1:3])
