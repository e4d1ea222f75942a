"""A job that grows (tandemrun --nnodes MIN:MAX --elastic --rdzv-endpoint HOST:PORT): two
tandemrun launchers on 127.0.0.1 act as two nodes. Node 0 starts the job with --nnodes 1:2 and
--nproc-per-node 2 (heal_worker, 2 ranks) and hosts the launchers' store; a second tandemrun,
started once node 0 says it runs, takes the free node slot and its 2 workers join the running
group with ranks 2 and 3 (TANDEM_ELASTIC_JOIN=1) at a step boundary, receiving the state from a
member; training goes on at 4 ranks. A third tandemrun, started while the job runs, finds both
slots taken and must be refused with a message naming the cause.

The members of the first world wait at step 2 (heal_worker --grow-at) until both new workers
asked to join and the third node's refusal was seen (DIR/grow.go), so that the new members join
before the run ends and the node slots' store (node 0's launcher) is still up for the third node;
a new worker admitted earlier waits in that step's collective. Nothing waits on the clock; the
bounds only end a hang.

It passes when: node 0 and node 1 exit 0; the third launcher exits non-zero saying the job
already has its 2 nodes; every rank (0-3) wrote DIR/rank<R>.result with 4 members, the same
steps and the same state (parameters, optimizer, EMA); ranks 0 and 1 admitted 2 new members
without a heal and applied every step once; ranks 2 and 3 joined (replacement=1); every sample
of the epoch went into an applied step exactly once, but for the padding of the last split (at
most 3 repeated).

  grow_driver.py --worker build/x/tests/elastic/heal_worker --tandemrun build/x/tools/tandemrun \\
                 --backend gloo
Exit status: 0 when it passed, 1 when it failed.
"""

import argparse
import importlib.util
import os
import re
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("heal_driver", os.path.join(HERE, "heal_driver.py"))
heal = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(heal)

STEPS = 16
NPROC = 2
GROW_AT = 2


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_text(path, text, procs, deadline):
    """Waits until the file at `path` holds `text`; False when a process in `procs` ended first
    or the deadline passed."""
    while time.monotonic() < deadline:
        if text in (heal.read(path) or ""):
            return True
        if any(p.poll() is not None for p in procs):
            return text in (heal.read(path) or "")
        time.sleep(0.02)
    return False


def run(args, directory):
    failures = []
    rdzv = f"127.0.0.1:{free_port()}"
    master_port = free_port()
    wargs = ["--backend", args.backend, "--dir", directory, "--ranks", str(NPROC),
             "--steps", str(STEPS), "--timeout-ms", "20000", "--window-ms", "20000",
             "--grow-at", str(GROW_AT), "--grow", str(NPROC)]
    command = [args.tandemrun, "--nnodes", "1:2", "--elastic", "--rdzv-endpoint", rdzv,
               "--master-addr", "127.0.0.1", "--master-port", str(master_port),
               "--rdzv-token", "grow-test", "--nproc-per-node", str(NPROC), args.worker] + wargs
    procs = {}

    def start(node):
        out = open(os.path.join(directory, f"out{node}"), "wb")
        err = open(os.path.join(directory, f"err{node}"), "wb")
        procs[node] = subprocess.Popen(command, stdout=out, stderr=err, start_new_session=True)

    def err_of(node):
        return heal.read(os.path.join(directory, f"err{node}")) or ""

    deadline = time.monotonic() + args.bound_s
    try:
        start(0)
        if not wait_for_text(os.path.join(directory, "err0"),
                             f"nodes started later join the running job through {rdzv}",
                             [procs[0]], deadline):
            return ["node 0 never said it runs the job: " + err_of(0)[-2000:]]
        start(1)
        if not wait_for_text(os.path.join(directory, "err1"),
                             f"joined the job at {rdzv} as node 1: ranks 2-3 join its running "
                             "group", [procs[1]], deadline):
            return ["node 1 never said it joined: " + err_of(1)[-2000:]]
        start(2)  # a third node: both slots are taken
        try:
            code = procs[2].wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            code = None
        refused = err_of(2)
        if code in (None, 0) or "already has its 2 nodes" not in refused or \
                "cannot join" not in refused:
            failures.append(f"the third node was not refused (exit {code}): {refused[-2000:]}")
        with open(os.path.join(directory, "grow.go.tmp"), "w") as f:
            f.write("1\n")
        os.rename(os.path.join(directory, "grow.go.tmp"), os.path.join(directory, "grow.go"))
        for node in (0, 1):
            try:
                code = procs[node].wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                code = None
            if code != 0:
                failures.append(f"node {node}'s tandemrun exited {code}")
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()

    world = 2 * NPROC
    found = heal.results(directory, world)
    for r in range(world):
        if r not in found:
            failures.append(f"rank {r} wrote no result")
        elif found[r] is None:
            failures.append(f"rank {r} came after the group had finished")
    done = {r: v for r, v in found.items() if v is not None}
    for key in ("hash", "steps"):
        if len({v[key] for v in done.values()}) > 1:
            failures.append(f"the ranks' {key} differ: " +
                            ", ".join(f"rank {r} {v[key]}" for r, v in done.items()))
    for r, v in done.items():
        if v["size"] != world:
            failures.append(f"rank {r} ended in a group of {v['size']} (want {world}: it grew)")
        new = r >= NPROC
        if v["replacement"] != (1 if new else 0):
            failures.append(f"rank {r}: replacement={v['replacement']} (want {int(new)})")
        if new:
            continue
        if v["steps"] != v["applied"] or v["heals"] != 0 or v["joins"] != NPROC:
            failures.append(f"rank {r}: {v['steps']} steps done, {v['applied']} applied, "
                            f"{v['heals']} heals, {v['joins']} joins (want equal, 0, {NPROC})")
    counted = {}
    for r in range(NPROC):
        text = heal.read(os.path.join(directory, f"rank{r}.samples"))
        if text:
            counted[r] = [int(c) for c in text.split()]
    if len(counted) != NPROC or len({tuple(c) for c in counted.values()}) > 1:
        failures.append(f"the first members' sample counts are missing or differ ({len(counted)})")
    for r, counts in list(counted.items())[:1]:
        unused = [i for i, c in enumerate(counts) if c == 0]
        extra = sum(counts) - len(counts)
        if len(counts) != NPROC * STEPS * 16 or unused or extra < 0 or extra > world - 1:
            failures.append(f"rank {r}: of {len(counts)} samples, {len(unused)} never used "
                            f"(first {unused[:5]}), {extra} used more than once (at most "
                            f"{world - 1} may be, the last split's padding)")
    text = "".join(err_of(node) for node in (0, 1, 2))
    sanitizer = re.search(r"(ERROR: \w+Sanitizer[^\n]*|WARNING: ThreadSanitizer[^\n]*|"
                          r"runtime error:[^\n]*)", text)
    if sanitizer:
        failures.append(f"a sanitizer reported: {sanitizer.group(1)}")
    if failures:
        for node in (0, 1):
            failures.append(f"node {node}'s stderr ends: " + err_of(node)[-2000:])
    return failures


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", required=True)
    parser.add_argument("--tandemrun", required=True)
    # Gloo: the job spans two nodes, which ShmComm refuses.
    parser.add_argument("--backend", required=True, choices=["gloo"])
    parser.add_argument("--bound-s", type=float, default=200.0)
    parser.add_argument("--keep", action="store_true", help="keep the job's directory")
    args = parser.parse_args()
    directory = tempfile.mkdtemp(prefix="tandem-grow-")
    started = time.monotonic()
    try:
        failures = run(args, directory)
    finally:
        if not args.keep:
            subprocess.run(["rm", "-rf", directory], check=False)
    print(f"[{'FAIL' if failures else 'PASS'}] {args.backend}: --nnodes 1:2 x {NPROC}, a node "
          f"joined the running job, a third was refused ({time.monotonic() - started:.2f} s)" +
          (f" [{directory}]" if args.keep else ""))
    for failure in failures:
        print(f"    - {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
