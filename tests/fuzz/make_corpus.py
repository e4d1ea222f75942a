#!/usr/bin/env python3
"""Writes the hand-made seeds of tests/fuzz/corpus/{safetensors,idx,init_env,checkpoint_state,
mnist_dataset,example_flags}/.

Valid files of every kind the readers accept and near-valid ones that each break one rule, so
the fuzzer starts from the format's corners. Deterministic: running it again rewrites the same
bytes. Files the fuzzer found interesting later are added by hand beside these (names without
the "seed-" prefix). Usage: tests/fuzz/make_corpus.py
"""
import gzip
import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def write(target, name, data, folder="corpus"):
    """folder "pending": an input that shows a reported bug not yet fixed (not replayed)."""
    folder = os.path.join(HERE, folder, target)
    os.makedirs(folder, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(folder, "seed-" + name), "wb") as f:
        f.write(data)


def crc32c(data):
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


# --- safetensors -------------------------------------------------------------------------------
SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
         "U8": 1, "BOOL": 1}


def st_file(tensors, metadata=None, pad=True, checksum=False):
    """tensors: (name, dtype, shape, data bytes) in data order."""
    header, data = {}, b""
    for name, dtype, shape, payload in tensors:
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [len(data), len(data) + len(payload)]}
        data += payload
    metadata = dict(metadata or {})
    if checksum:
        metadata["tandem.data_crc32c"] = "%08x" % crc32c(data)
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        text += b" " * ((8 - len(text) % 8) % 8)
    return struct.pack("<Q", len(text)) + text + data


def st_raw(header_text, data=b"", length=None):
    text = header_text.encode() if isinstance(header_text, str) else header_text
    return struct.pack("<Q", len(text) if length is None else length) + text + data


def safetensors():
    w = lambda n, d: write("safetensors", n, d)
    w("f32-2x2", st_file([("fc.weight", "F32", [2, 2], struct.pack("<4f", 1, 2, 3, 4))]))
    every = [(f"t.{dt.lower()}", dt, [3], bytes(range(3 * SIZES[dt]))) for dt in SIZES]
    w("every-dtype", st_file(every))
    w("metadata", st_file([("w", "I32", [2], struct.pack("<2i", -1, 7))],
                          {"format": "pt", "epoch": "3"}))
    w("checksum", st_file([("b", "F64", [1], struct.pack("<d", 0.5)),
                           ("a", "U8", [2, 1], b"\x01\x02")], checksum=True))
    w("checksum-wrong", st_file([("a", "U8", [2], b"\x01\x02")],
                                {"tandem.data_crc32c": "00000000"}))
    w("scalar", st_file([("step", "I64", [], struct.pack("<q", 42))]))
    w("zero-size", st_file([("empty", "F32", [0, 5], b""), ("x", "BF16", [1], b"\x80\x3f")]))
    w("empty-header", st_raw("{}"))
    w("unpadded", st_file([("w", "F16", [2], b"\x00\x3c\x00\x40")], pad=False))
    w("metadata-only", st_file([], {"tandem.state": '{"step":1}'}))
    w("training-state", st_file([("module.fc.weight", "F32", [1, 2], struct.pack("<2f", 1, 2)),
                                 ("optimizer.state.0.momentum_buffer", "F32", [2],
                                  struct.pack("<2f", 0, 0))],
                                {"tandem.state": json.dumps(
                                    {"grad_scaler": {"scale": 65536.0}, "step": 10})},
                                checksum=True))
    w("unicode-name", st_file([("poids.\u00e9t\u00e9", "U8", [1], b"\x05")]))
    # Near-valid: one rule broken each.
    w("truncated-length", b"\x10\x00\x00")
    w("length-past-end", st_raw("{}", length=100))
    w("length-huge", st_raw("{}", length=1 << 62))
    w("not-json", st_raw("{\"a\":"))
    w("not-object", st_raw("[1,2,3] "))
    w("bad-utf8", st_raw(b'{"\xff\xfe":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"\x00"))
    w("unknown-dtype", st_raw('{"a":{"dtype":"F8","shape":[1],"data_offsets":[0,1]}}', b"\x00"))
    w("shape-mismatch", st_raw('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}', b"\0" * 4))
    w("overlap", st_raw('{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},'
                        '"b":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}}', b"\0" * 3))
    w("hole", st_raw('{"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}', b"\0" * 2))
    w("duplicate", st_raw('{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
                          '"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"\0"))
    w("metadata-not-string", st_raw('{"__metadata__":{"epoch":3}}'))
    w("negative-shape", st_raw('{"a":{"dtype":"U8","shape":[-1],"data_offsets":[0,1]}}', b"\0"))
    w("huge-shape", st_raw('{"a":{"dtype":"F64","shape":[4611686018427387904,4],'
                           '"data_offsets":[0,8]}}', b"\0" * 8))
    w("offsets-reversed", st_raw('{"a":{"dtype":"U8","shape":[0],"data_offsets":[1,0]}}', b"\0"))
    w("offsets-float", st_raw('{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1.0]}}', b"\0"))
    w("trailing-data", st_file([("a", "U8", [1], b"\x01")]) + b"\x02")
    w("duplicate-inner-key", st_raw('{"a":{"dtype":"U8","dtype":"I8","shape":[1],'
                                    '"data_offsets":[0,1]}}', b"\0"))
    w("duplicate-metadata-key", st_raw('{"__metadata__":{"tandem.state":"{}",'
                                       '"tandem.state":"{\\"step\\":1}"}}'))
    w("bool-valid", st_file([("mask", "BOOL", [3], b"\x00\x01\x01")]))
    w("bool-byte-two", st_file([("mask", "BOOL", [2], b"\x01\x02")]))


# --- IDX ---------------------------------------------------------------------------------------
IDX_TYPES = {0x08: "B", 0x09: "b", 0x0B: ">h", 0x0C: ">i", 0x0D: ">f", 0x0E: ">d"}


def idx_file(type_code, dims, values):
    fmt = IDX_TYPES[type_code]
    body = b"".join(struct.pack(fmt if fmt.startswith(">") else ">" + fmt, v) for v in values)
    return bytes([0, 0, type_code, len(dims)]) + b"".join(struct.pack(">I", d) for d in dims) + body


def idx():
    w = lambda n, d: write("idx", n, d)
    images = idx_file(0x08, [2, 3, 3], list(range(18)))
    labels = idx_file(0x08, [4], [9, 0, 0, 3])
    w("u8-images", images)
    w("u8-labels", labels)
    w("i8", idx_file(0x09, [2, 2], [-1, 0, 1, -128]))
    w("i16", idx_file(0x0B, [3], [-2, 300, 32767]))
    w("i32", idx_file(0x0C, [2, 1], [-100000, 7]))
    w("f32", idx_file(0x0D, [2], [0.5, -3.25]))
    w("f64", idx_file(0x0E, [1, 1, 1], [1e300]))
    w("zero-extent", idx_file(0x08, [0, 28, 28], []))
    # gzip as the files ship, and 'z'/'t'/'a': compressed, cut or extended by the target itself.
    w("gzip-images", gzip.compress(images, mtime=0))
    w("gzip-f32", gzip.compress(idx_file(0x0D, [2], [0.5, -3.25]), mtime=0))
    w("z-images", b"z" + images)
    w("z-i16", b"z" + idx_file(0x0B, [3], [-2, 300, 32767]))
    w("t-labels", b"t" + labels)
    w("a-labels", b"a" + labels)
    # Near-valid.
    w("truncated-data", images[:-1])
    w("trailing-byte", labels + b"\x00")
    w("zero-dims", bytes([0, 0, 8, 0]))
    w("unknown-type", bytes([0, 0, 0x0A, 1, 0, 0, 0, 1, 5]))
    w("bad-magic", bytes([1, 0, 8, 1, 0, 0, 0, 1, 5]))
    w("lying-size", bytes([0, 0, 0x0E, 2, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF]))
    w("gzip-lying-size", gzip.compress(bytes([0, 0, 8, 1, 0x7F, 0xFF, 0xFF, 0xFF]), mtime=0))
    w("gzip-two-members", gzip.compress(labels, mtime=0) + gzip.compress(b"", mtime=0))
    corrupt = bytearray(gzip.compress(images, mtime=0))
    corrupt[12] ^= 0x55
    w("gzip-corrupt", bytes(corrupt))
    w("gzip-truncated", gzip.compress(images, mtime=0)[:-5])


# --- init URLs and the environment ---------------------------------------------------------------
def init_env():
    w = lambda n, text: write("init_env", n, text)
    w("env-torchrun", "env://\nMASTER_ADDR=127.0.0.1\nMASTER_PORT=29500\nRANK=1\nWORLD_SIZE=4\n"
      "LOCAL_RANK=1\nLOCAL_WORLD_SIZE=2\nGROUP_RANK=0\nGROUP_WORLD_SIZE=2\n")
    w("env-no-port", "env://\nMASTER_ADDR=localhost\nRANK=0\nWORLD_SIZE=1\n")
    w("tcp-query", "tcp://10.0.0.1:23456?rank=2&world_size=8\n")
    w("tcp-ipv6", "tcp://[::1]:29500/?world_size=2&rank=1\n")
    w("tcp-no-port", "tcp://host\n")
    w("tcp-bad-port", "tcp://host:65536?rank=0&world_size=1\n")
    w("file", "file:///tmp/tandem-rendezvous?rank=0&world_size=2\n")
    w("file-relative", "file://relative/path?rank=0&world_size=1\n")
    w("query-unknown", "tcp://h:1?ranks=1\n")
    w("query-disagrees", "tcp://h:1?rank=3&world_size=4\nRANK=1\nWORLD_SIZE=4\n")
    w("slurm", "env://\nMASTER_ADDR=node1\nMASTER_PORT=29500\nSLURM_PROCID=5\nSLURM_NTASKS=7\n"
      "SLURM_LOCALID=1\nSLURM_NODEID=2\nSLURM_NNODES=3\nSLURM_TASKS_PER_NODE=2(x2),3\n")
    w("slurm-bad-list", "env://\nSLURM_PROCID=0\nSLURM_NTASKS=2\nSLURM_TASKS_PER_NODE=2(x\n")
    w("slurm-per-node", "tcp://a:2\nSLURM_PROCID=3\nSLURM_NTASKS=4\nSLURM_NTASKS_PER_NODE=2\n"
      "SLURM_NODEID=1\nSLURM_NNODES=2\nSLURM_LOCALID=1\n")
    w("openmpi", "env://\nMASTER_ADDR=a\nMASTER_PORT=1\nOMPI_COMM_WORLD_RANK=3\n"
      "OMPI_COMM_WORLD_SIZE=4\nOMPI_COMM_WORLD_LOCAL_RANK=1\nOMPI_COMM_WORLD_LOCAL_SIZE=2\n")
    w("mpich", "tcp://b:3\nPMI_RANK=1\nPMI_SIZE=2\nMPI_LOCALRANKID=1\nMPI_LOCALNRANKS=2\n")
    w("size-without-rank", "env://\nWORLD_SIZE=2\n")
    w("rank-too-big", "env://\nMASTER_ADDR=a\nMASTER_PORT=2\nRANK=2\nWORLD_SIZE=2\n")
    w("not-integer", "env://\nMASTER_ADDR=a\nMASTER_PORT=29500\nRANK=+1\nWORLD_SIZE=0x2\n")
    w("negative", "env://\nMASTER_ADDR=a\nMASTER_PORT=-1\nRANK=-1\nWORLD_SIZE=9223372036854775808\n")
    w("unknown-scheme", "http://example.com:80\n")
    w("empty", "")

# --- the checkpoint loader's metadata (tandem.state) ----------------------------------------------
# What checkpoint_state_fuzz's training state saves after one SGD step (its own save_to).
STATE = json.loads('{"grad_scaler":{"_growth_tracker":0.0,"backoff_factor":0.5,"growth_factor":2.0,"growth_interval":2000.0,"scale":65536.0},"lr_scheduler":{"_last_lr":[0.05,0.1],"_step_count":1,"base_lrs":[0.1,0.2],"last_epoch":0},"noise":["100"],"optimizer":{"param_groups":[{"options":{"dampening":0.0,"lr":0.05,"maximize":0.0,"momentum":0.9,"nesterov":0.0,"weight_decay":0.0},"params":[0],"step":1},{"options":{"dampening":0.0,"lr":0.1,"maximize":0.0,"momentum":0.9,"nesterov":0.0,"weight_decay":0.0},"params":[1],"step":1}],"state":{"0":{"scalars":{},"tensors":["momentum_buffer"]},"1":{"scalars":{},"tensors":["momentum_buffer"]}}},"sampler":{"batches_done":0,"dataset_size":45,"drop_last":false,"epoch":0,"num_replicas":1,"seed":7,"shuffle":true},"step":0}')


def checkpoint_state():
    import copy
    w = lambda n, value: write("checkpoint_state", n,
                               value if isinstance(value, str) else json.dumps(value))
    w("saved", STATE)

    def changed(name, edit, folder="corpus"):
        state = copy.deepcopy(STATE)
        edit(state)
        write("checkpoint_state", name, json.dumps(state), folder)

    changed("no-optimizer", lambda s: s.pop("optimizer"))
    changed("state-index-not-number", lambda s: s["optimizer"]["state"].update(
        {"x": s["optimizer"]["state"]["0"]}), "pending")
    changed("state-index-huge", lambda s: s["optimizer"]["state"].update(
        {"99999999999999999999": s["optimizer"]["state"]["0"]}), "pending")
    changed("state-index-out-of-range", lambda s: s["optimizer"]["state"].update(
        {"7": s["optimizer"]["state"]["0"]}))
    changed("state-unknown-tensor", lambda s: s["optimizer"]["state"]["0"].update(
        {"tensors": ["exp_avg"]}))
    changed("group-params-out-of-range",
            lambda s: s["optimizer"]["param_groups"][0].update({"params": [5]}))
    changed("group-missing", lambda s: s["optimizer"]["param_groups"].pop())
    changed("group-step-negative", lambda s: s["optimizer"]["param_groups"][1].update({"step": -3}))
    changed("scalars", lambda s: s["optimizer"]["state"]["0"].update({"scalars": {"step": 2.0}}))
    changed("scale-zero", lambda s: s["grad_scaler"].update({"scale": 0.0}))
    changed("scale-string", lambda s: s["grad_scaler"].update({"scale": "big"}))
    changed("scheduler-short", lambda s: s["lr_scheduler"].update({"base_lrs": [0.1]}))
    changed("scheduler-epoch-huge",
            lambda s: s["lr_scheduler"].update({"last_epoch": 9223372036854775807}))
    changed("sampler-other-size", lambda s: s["sampler"].update({"dataset_size": 46}))
    changed("sampler-epoch-negative", lambda s: s["sampler"].update({"epoch": -1}))
    changed("rng-two-ranks", lambda s: s.update({"noise": ["1", "2"]}))
    changed("rng-garbage", lambda s: s.update({"noise": ["not a state"]}))
    changed("rng-not-array", lambda s: s.update({"noise": 5}))
    changed("step-float", lambda s: s.update({"step": 1.5}), "pending")
    changed("step-huge", lambda s: s.update({"step": 18446744073709551615}))
    changed("scaler-interval-huge", lambda s: s["grad_scaler"].update({"growth_interval": 1e20}))
    changed("scaler-tracker-negative",
            lambda s: s["grad_scaler"].update({"_growth_tracker": -1.0}))
    changed("scaler-backoff-one", lambda s: s["grad_scaler"].update({"backoff_factor": 1.0}))
    changed("options-lr-bool",
            lambda s: s["optimizer"]["param_groups"][0]["options"].update({"lr": True}))
    changed("scheduler-epoch-below", lambda s: s["lr_scheduler"].update({"last_epoch": -5}))
    changed("scheduler-lr-null", lambda s: s["lr_scheduler"].update({"base_lrs": [None, 0.2]}))
    changed("sampler-past-epoch", lambda s: s["sampler"].update({"batches_done": 46}))
    changed("sampler-shuffle-off", lambda s: s["sampler"].update({"shuffle": False}))
    changed("rng-trailing", lambda s: s.update({"noise": ["100 5"]}))
    w("not-json", "{\"step\":")
    w("array", "[]")


# --- an MNIST-family data set: its images and labels (mnist_dataset_fuzz) -----------------------
def mnist_dataset():
    def w(name, classes, rows, columns, images, labels):
        write("mnist_dataset", name,
              bytes([classes, rows, columns]) + struct.pack(">H", len(images)) + images + labels)

    images = idx_file(0x08, [3, 4, 5], [i % 251 for i in range(60)])
    w("fits", 10, 4, 5, images, idx_file(0x08, [3], [0, 9, 4]))
    w("any", 0, 0, 0, images, idx_file(0x08, [3], [255, 17, 0]))
    w("label-out-of-range", 10, 4, 5, images, idx_file(0x08, [3], [0, 12, 4]))
    w("rows-differ", 10, 28, 5, images, idx_file(0x08, [3], [0, 1, 2]))
    w("counts-differ", 10, 4, 5, images, idx_file(0x08, [2], [0, 1]))
    w("labels-2d", 10, 4, 5, images, idx_file(0x08, [3, 1], [0, 1, 2]))
    w("no-pixels", 0, 0, 0, idx_file(0x08, [2, 0, 5], []), idx_file(0x08, [2], [1, 1]))
    w("images-i32", 0, 0, 0, idx_file(0x0C, [1, 1, 1], [7]), idx_file(0x08, [1], [1]))


# --- the examples' command line (example_flags_fuzz): arguments separated by NUL bytes ----------
def example_flags():
    w = lambda n, args: write("example_flags", n, "\0".join(args))
    w("defaults", [])
    w("short-run", ["--backend", "local", "--ranks", "2", "--epochs", "1", "--max-steps", "200"])
    w("everything", ["--epochs", "3", "--batch-size", "64", "--lr", "0.05", "--seed", "7",
                     "--data", "/tmp", "--checkpoint-dir", "/tmp/ckpt", "--resume", "--timeout",
                     "60", "--workers", "2", "--tensorboard", "/tmp/tb", "--max-steps", "5",
                     "--wide", "--plain", "--zero", "1", "--precision", "bf16", "--resident"])
    w("lr-inf", ["--data", "/tmp", "--lr", "inf"])
    w("lr-nan", ["--data", "/tmp", "--lr", "nan"])
    w("lr-overflow", ["--data", "/tmp", "--lr", "1e999"])
    w("lr-trailing", ["--data", "/tmp", "--lr", "0.1x"])
    w("lr-negative", ["--data", "/tmp", "--lr", "-0.1"])
    w("batch-zero", ["--data", "/tmp", "--batch-size", "0"])
    w("epochs-negative", ["--data", "/tmp", "--epochs", "-1"])
    w("data-missing", ["--data", "/nonexistent/fashion-mnist"])
    w("data-file", ["--data", "/etc/hostname"])
    w("value-missing", ["--data", "/tmp", "--epochs"])
    w("unknown", ["--data", "/tmp", "--bogus", "1"])
    w("elastic", ["--data", "/tmp", "--elastic", "--elastic-store", "file:///tmp/job.store",
                  "--await-replacement", "30", "--crash-in-setup", "--async-save", "--zero", "2"])
    w("await-without-elastic", ["--data", "/tmp", "--await-replacement", "5"])
    w("await-too-long", ["--data", "/tmp", "--elastic", "--await-replacement", "3601"])
    w("await-negative", ["--data", "/tmp", "--elastic", "--await-replacement", "-1"])
    w("store-not-file", ["--data", "/tmp", "--elastic", "--elastic-store", "tcp://host:29500"])


if __name__ == "__main__":
    safetensors()
    idx()
    init_env()
    checkpoint_state()
    mnist_dataset()
    example_flags()
