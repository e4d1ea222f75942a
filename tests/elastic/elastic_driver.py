#!/usr/bin/env python3
"""Elastic training under faults: runs elastic_worker (a short DDP training under tandem::Elastic)
and loses one rank; the survivors must heal and finish.

Each trial draws, from --seed, a victim rank, a step, a collective (the step's gradient sync or
its loss all_reduce) and a point (before, inside or after it), starts the job, waits for the
victim to announce the point (DIR/rank<V>.at) and sends it SIGKILL or SIGSTOP (threads: the
victim thread leaves, --signal exit, or blocks, --signal stop). The protocol and the helpers are
tests/fault's (fault_driver.py): inside, the signal lands 20-300 ms after the victim entered the
collective, which the survivors enter only once the signal is sent. No step waits on the clock;
the bounds here only end a hang and are generous for a loaded machine.

A trial passes when every survivor exits 0 within its bound, each wrote DIR/rank<R>.result, and
they all say: each step applied exactly once (applied optimizer steps = steps, the same number on
every survivor), one heal into generation 1 of world-1 members, the same parameters (their hash)
on every survivor (with --zero: and the full optimizer state, which after the heal equals the state
before the loss bit for bit), and every sample of the epoch used exactly once in an applied step (the epoch's
rest is re-split over the survivors; at most world-2 samples repeated, the last split's padding).
Processes are started here by hand over file:// (a FileStore in the trial's directory, which
outlives any rank, so the victim may be rank 0), as fault_driver.py's env mode does; with
--env-store over env:// (rank 0 hosts a TcpStore), the victim never being rank 0.

  elastic_driver.py --worker build/x/tests/elastic/elastic_worker --backend shm --signal kill \\
                    --world 3 --trials 3 --seed 1
With --tandemrun, the process ranks are started by `tandemrun --standalone --elastic` instead, and
tandemrun must exit 0 and report the victim lost (a stopped victim: ended once the survivors
finished).
Exit status: 0 when every trial passed, 1 when one failed.
"""

import argparse
import importlib.util
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location(
    "fault_driver", os.path.join(HERE, "..", "fault", "fault_driver.py"))
fault = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fault)

STEPS = 24
SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}


def plan_trial(rng, world, spare_rank0=False):
    point = rng.choice(["before", "inside", "after"])
    return {
        "victim": rng.randrange(1, world) if spare_rank0 else rng.randrange(world),
        "step": rng.randint(1, STEPS - 3),
        "target": rng.choice(["grads", "loss"]),
        "point": point,
        "delay": rng.uniform(0.02, 0.3) if point == "inside" else 0.0,
    }


def start(args, trial, directory):
    wargs = ["--backend", args.backend, "--dir", directory, "--ranks", str(args.world),
             "--steps", str(STEPS), "--timeout-ms", str(args.timeout_ms),
             "--window-ms", str(args.window_ms), "--fault-step", str(trial["step"]),
             "--point", trial["point"], "--target", trial["target"],
             "--victim", str(trial["victim"]),
             "--fault", args.signal if args.backend == "local" else "exit"]
    port = fault.free_port()
    if args.env_store:
        wargs += ["--url", "env://"]
    if args.zero:
        wargs += ["--zero", str(args.zero)]

    def out(name):
        return open(os.path.join(directory, name), "wb")

    if args.backend == "local":
        proc = subprocess.Popen([args.worker] + wargs, stdout=out("out0"), stderr=out("err0"),
                                start_new_session=True)
        return {"launcher": proc, "ranks": {}}
    if args.tandemrun:
        proc = subprocess.Popen([args.tandemrun, "--standalone", "--elastic", "--nproc-per-node",
                                 str(args.world), args.worker] + wargs,
                                stdout=out("out"), stderr=out("err"), start_new_session=True)
        return {"launcher": proc, "ranks": {}}
    ranks = {}
    for r in range(args.world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(args.world), LOCAL_RANK=str(r),
                   LOCAL_WORLD_SIZE=str(args.world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        if args.backend == "hierarchical":
            node, nodes = r // 2, (args.world + 1) // 2
            env.update(LOCAL_RANK=str(r % 2), LOCAL_WORLD_SIZE=str(min(2, args.world - 2 * node)),
                       GROUP_RANK=str(node), GROUP_WORLD_SIZE=str(nodes))
        ranks[r] = subprocess.Popen([args.worker] + wargs, env=env, stdout=out(f"out{r}"),
                                    stderr=out(f"err{r}"), start_new_session=True)
    return {"launcher": None, "ranks": ranks}


def run_trial(args, trial, directory):
    victim = trial["victim"]
    survivors = [r for r in range(args.world) if r != victim]
    failures = []
    job = start(args, trial, directory)
    pids = []
    try:
        at = fault.wait_for(os.path.join(directory, f"rank{victim}.at"), job,
                            time.monotonic() + args.startup_s)
        if at is None:
            return ["the victim never reached its point; stderr ends: " +
                    fault.error_tail(directory)], {"setup_error": True}
        if args.backend != "local":
            for r in range(args.world):
                text = fault.read(os.path.join(directory, f"rank{r}.pid"))
                if text:
                    pids.append(int(text.split()[0]))
            victim_pid = int(fault.read(os.path.join(directory, f"rank{victim}.pid")).split()[0])
            if trial["delay"] > 0:
                time.sleep(trial["delay"])  # where the signal lands, not a synchronisation
            os.kill(victim_pid, SIGNALS[args.signal])
            fault.publish(os.path.join(directory, "signalled"), "1\n")
        fault_time = time.monotonic()
        now_at = fault.read(os.path.join(directory, f"rank{victim}.at")) or at
        landed = "after (it had returned)" if now_at.startswith("passed") else now_at.split()[0]

        # Wait for the survivors (threads: the process) to end.
        limit = fault_time + args.bound_s
        procs = [job["launcher"]] if job["launcher"] else [job["ranks"][r] for r in survivors]
        launched = job["launcher"] is not None
        while time.monotonic() < limit and any(p.poll() is None for p in procs):
            time.sleep(0.01)
        ended_after = time.monotonic() - fault_time
        for p in procs:
            if p.poll() is None:
                failures.append(f"still running {args.bound_s:g} s after the fault")
                break
        for r in ([None] if launched else survivors):
            p = job["launcher"] if r is None else job["ranks"][r]
            if p.poll() not in (None, 0):
                who = f"rank {r}" if r is not None else \
                    "tandemrun" if args.tandemrun else "the process"
                failures.append(f"{who} exited {p.poll()}")
        if args.tandemrun and not re.search(
                rf"tandemrun: rank {victim} was lost \(signal SIGKILL",
                fault.read(os.path.join(directory, "err")) or ""):
            failures.append(f"tandemrun did not report rank {victim} lost")
        results = {}
        for r in survivors:
            text = fault.read(os.path.join(directory, f"rank{r}.result"))
            if not text:
                failures.append(f"rank {r} wrote no result")
                continue
            steps, applied, generation, size, digest, heals, compared, heal_us = text.split()
            results[r] = (int(steps), int(applied), int(generation), int(size), digest, int(heals),
                          int(heal_us), int(compared))
        # --zero: the state after the heal was compared with the one before the loss (the worker
        # fails when they differ) on some survivor; one whose shadow of the step was cut short
        # by the loss has nothing to compare with.
        if args.zero and results and not any(v[7] for v in results.values()):
            failures.append("no survivor compared its state after the heal with the one before")
        for r, (steps, applied, generation, size, digest, heals, _, _) in results.items():
            if steps != applied:
                failures.append(f"rank {r}: {steps} steps done, {applied} optimizer steps applied")
            if generation != 1 or size != args.world - 1 or heals != 1:
                failures.append(f"rank {r}: generation {generation}, {size} members, {heals} "
                                f"heals (want 1, {args.world - 1}, 1)")
        if len({v[0] for v in results.values()}) > 1:
            failures.append("the survivors took different numbers of steps: " +
                            ", ".join(f"rank {r} {v[0]}" for r, v in results.items()))
        if len({v[4] for v in results.values()}) > 1:
            failures.append("the survivors' parameters differ: " +
                            ", ".join(f"rank {r} {v[4]}" for r, v in results.items()))
        # Every sample of the epoch went into an applied step exactly once, but for the padding of
        # the last split (at most members - 1 samples repeated, the sampler's rule).
        counted = {}
        for r in survivors:
            text = fault.read(os.path.join(directory, f"rank{r}.samples"))
            if text:
                counted[r] = [int(c) for c in text.split()]
        if len({tuple(c) for c in counted.values()}) > 1:
            failures.append("the survivors counted different samples")
        for r, counts in list(counted.items())[:1]:
            unused = [i for i, c in enumerate(counts) if c == 0]
            extra = sum(counts) - len(counts)
            if len(counts) != args.world * STEPS * 16 or unused or extra > args.world - 2 or \
                    extra < 0:
                failures.append(f"rank {r}: of {len(counts)} samples, {len(unused)} never used "
                                f"(first {unused[:5]}), {extra} used more than once (at most "
                                f"{args.world - 2} may be, the last split's padding)")
        text = "".join(fault.read(os.path.join(directory, n)) or ""
                       for n in sorted(os.listdir(directory)) if n.startswith("err"))
        sanitizer = re.search(r"(ERROR: \w+Sanitizer[^\n]*|WARNING: ThreadSanitizer[^\n]*|"
                              r"runtime error:[^\n]*)", text)
        if sanitizer:
            failures.append(f"a sanitizer reported: {sanitizer.group(1)}")
        if failures:
            failures.append("stderr ends: " + fault.error_tail(directory))
        heal_s = max((v[6] for v in results.values()), default=0) / 1e6
        return failures, {"landed": landed, "ended_after": ended_after, "heal_s": heal_s}
    finally:
        fault.kill_everything(job, pids)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", required=True)
    parser.add_argument("--tandemrun", help="start the ranks with tandemrun --elastic (processes)")
    parser.add_argument("--backend", required=True,
                        choices=["local", "gloo", "shm", "hierarchical"])
    parser.add_argument("--signal", required=True, choices=["kill", "stop", "exit"])
    parser.add_argument("--world", type=int, default=3)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout-ms", type=int, default=2000,
                        help="the collective timeout (how a stopped rank is found)")
    parser.add_argument("--window-ms", type=int, default=10000, help="the heal's window")
    parser.add_argument("--startup-s", type=float, default=120.0)
    parser.add_argument("--bound-s", type=float, default=90.0,
                        help="how long the survivors may take to finish after the fault")
    parser.add_argument("--keep", action="store_true", help="keep each trial's directory")
    parser.add_argument("--zero", type=int, choices=[0, 1, 2], default=0,
                        help="train under ZeRO stage 1 or 2 (ElasticZero): the survivors' "
                             "parameters and full optimizer state must match, and after the heal "
                             "equal the state before the loss bit for bit")
    parser.add_argument("--env-store", action="store_true",
                        help="meet over env:// (rank 0 hosts a TcpStore) instead of file://; the "
                             "victim is then never rank 0, whose loss takes the store with it")
    args = parser.parse_args()
    if (args.backend == "local") != (args.signal != "kill") and args.signal != "stop":
        parser.error("local takes --signal exit|stop; processes take kill|stop")

    failed = 0
    for i in range(args.trials):
        trial = plan_trial(random.Random(args.seed * 1000003 + i), args.world, args.env_store)
        retried = []
        for _ in range(3):
            directory = tempfile.mkdtemp(prefix="tandem-elastic-")
            try:
                failures, info = run_trial(args, trial, directory)
            finally:
                if not args.keep:
                    subprocess.run(["rm", "-rf", directory], check=False)
            # A job the machine stopped before its fault (a collective starved past the short
            # timeout on a loaded machine) is no trial of the fault: start again, twice at most,
            # as fault_driver.py does.
            if not (info.get("setup_error") and re.search(fault.ENVIRONMENTAL, failures[0])):
                break
            retried.append(failures[0])
        failures = failures + [f"(started again after: {why})" for why in retried] \
            if failures else failures
        if retried and not failures:
            print(f"    note: started again {len(retried)} time(s) after: {retried[0]}")
        info = None if info.get("setup_error") else info
        failed += bool(failures)
        status = "FAIL" if failures else "PASS"
        where = f"landed: {info['landed']}; longest heal {info['heal_s']:.3f} s; survivors done " \
            f"{info['ended_after']:.2f} s after the fault" if info else "no fault"
        print(f"[{status}] {args.backend}/{args.signal} trial {i}: {args.world} ranks, victim "
              f"rank {trial['victim']}, step {trial['step']}, {trial['point']} the "
              f"{trial['target']} collective ({where})" + (f" [{directory}]" if args.keep else ""))
        for failure in failures:
            print(f"    - {failure}")
        sys.stdout.flush()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
