#!/usr/bin/env python3
"""safetensors between tandem and Python: tandem's file in Python's `safetensors` (numpy), a
file Python wrote in tandem, and a tandem model checkpoint in a torch module through
load_state_dict (Debian's torch under /usr/bin/python3, given only the safetensors package).
    safetensors_interop.py TOOL          (exit 77, skipped, without safetensors and numpy)"""
import os
import subprocess
import sys
import tempfile

try:
    import numpy as np
    import safetensors
    from safetensors.numpy import load_file, save_file
except ImportError as error:
    print(f"SKIPPED: safetensors or numpy is not installed ({error})")
    sys.exit(77)

tool = sys.argv[1]
with tempfile.TemporaryDirectory() as directory:
    mine = os.path.join(directory, "tandem.safetensors")
    subprocess.run([tool, "write", mine], check=True)
    t = load_file(mine)
    assert t["f64"].tolist() == [1.5, -2.25]
    assert t["f32"].shape == (2, 3) and t["f32"].dtype == np.float32
    assert t["f32"].ravel().tolist() == [0.5, 1, 2, 4, 8, 16]
    assert t["f16"].dtype == np.float16 and t["f16"].tolist() == [1.5, -3.0]
    assert t["i64"].tolist() == [-5, 1 << 40] and t["i32"].tolist() == [7]
    assert t["u8"].tolist() == [0, 200]
    print("PASSED: Python's safetensors read tandem's file")

    theirs = os.path.join(directory, "python.safetensors")
    save_file({"a": np.array([[1, 2], [3, 4.5]], dtype=np.float32),
               "b": np.array([-1, 9], dtype=np.int64)}, theirs, metadata={"who": "python"})
    subprocess.run([tool, "check", theirs], check=True)
    print("PASSED: tandem read Python's file")

    model = os.path.join(directory, "model.safetensors")
    subprocess.run([tool, "model", model], check=True)
    torch_python = "/usr/bin/python3"
    if subprocess.run([torch_python, "-c", "import torch"], capture_output=True).returncode != 0:
        print("SKIPPED (part): no torch under /usr/bin/python3 for load_state_dict")
        sys.exit(0)
    # Give Debian's Python the safetensors package only (not this Python's numpy).
    shim = os.path.join(directory, "shim")
    os.mkdir(shim)
    os.symlink(os.path.dirname(safetensors.__file__), os.path.join(shim, "safetensors"))
    script = (
        "import torch, safetensors.torch as st\n"
        "m = torch.nn.Module(); m.fc = torch.nn.Linear(3, 4)\n"
        f"m.load_state_dict(st.load_file({model!r}))\n"
        "w = [0.25 * i for i in range(12)]\n"
        "assert m.fc.weight.flatten().tolist() == w, m.fc.weight\n"
        "assert m.fc.bias.tolist() == [0.25 * i for i in range(12, 16)], m.fc.bias\n"
        f"b = st.load_file({mine + '.bf16'!r})['bf16']\n"
        "assert b.dtype == torch.bfloat16 and b.float().tolist() == [2.5, -0.75], b\n"
        "print('PASSED: torch', torch.__version__, 'load_state_dict took tandem\\'s checkpoint')\n")
    subprocess.run([torch_python, "-c", script], check=True, env=dict(os.environ, PYTHONPATH=shim))
