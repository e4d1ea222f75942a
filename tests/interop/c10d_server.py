"""Hosts a real torch.distributed.TCPStore for tandem's C10dStore protocol test.

Prints "torch <version> port <port>" once the store listens, sets "py/bytes" (binary), waits for
"cpp/done", checks the binary value tandem set under "cpp/bytes" and answers under "py/verified"
("yes" or what it read). Keeps the store up until its standard input closes. Exits 77 (the
test's "skipped") when torch cannot be imported.
"""
import datetime
import sys

try:
    import torch
    import torch.distributed as dist
except Exception as error:  # no torch here: the test reports itself skipped
    print(f"skip: cannot import torch: {error}", flush=True)
    sys.exit(77)

timeout = datetime.timedelta(seconds=60)
store = dist.TCPStore("127.0.0.1", 0, None, True, timeout, wait_for_workers=False)
print(f"torch {torch.__version__} port {store.port}", flush=True)

store.set("py/bytes", b"\x00\xffpy\x00")
store.wait(["cpp/done"], timeout)
seen = store.get("cpp/bytes")
store.set("py/verified", "yes" if seen == b"\x00\x01cpp\xff\x00" else repr(seen))
sys.stdin.read()
