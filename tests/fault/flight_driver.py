#!/usr/bin/env python3
"""The flight recorder's fault cases: runs flight_worker and checks what the ranks and the
launcher say (see flight_worker.cpp for what each case does).

  notice    a rank arrives late: every backend's waiting ranks say so, naming it; the job ends 0
  stall     a rank is stopped (SIGSTOP) under tandemrun: tandemrun says so, the ranks' notices and
            the merged diagnosis name it, and the failure summary puts it first
  mismatch  ranks disagree under tandemrun: every rank writes its record; the summary quotes them
  blame     only rank 0 fails, last, under tandemrun: the summary names rank 0 and its cause
            first, and the others say whose failure they followed

Nothing is timed: the driver waits for what it expects with limits far beyond any load.

  flight_driver.py --worker W [--tandemrun T] [--mpirun M] --case notice --backend gloo \\
                   --mode tandemrun [--world 3]
Exit status: 0 passed, 1 failed, 77 when the case cannot run here.
"""

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

LIMIT_S = 120.0
NOTICE = re.compile(r"tandem: rank (\d+) has waited [^\n]* in all_reduce #2 \(4 KiB float32\)"
                    r"(?: for ranks? ([\d, ]+))?(?: \(ranks? ([\d, ]+) ha(?:s|ve) arrived\))?")


def read(path):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def ranks_of(text):
    return {int(r) for r in re.findall(r"\d+", text or "")}


class Job:
    """The job's processes and where their stderr goes."""

    def __init__(self, args, case, directory, extra_env, world, timeout_ms):
        self.args = args
        self.directory = directory
        self.procs = []
        self.err_files = []
        env = dict(os.environ, TANDEM_WAIT_NOTICE_S="1", **extra_env)
        if args.mode == "tandemrun":
            env.pop("TANDEM_FLIGHT_RECORDER_DIR", None)  # tandemrun makes its own
        wargs = ["--backend", args.backend, "--case", case, "--dir", directory,
                 "--victim", str(args.victim if args.victim >= 0 else world - 1),
                 "--timeout-ms", str(timeout_ms), "--ranks", str(world)]
        if args.mode == "env":
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            for r in range(world):
                renv = dict(env, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                            LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(port))
                if args.backend == "hierarchical":
                    node = r // 2
                    renv.update(LOCAL_RANK=str(r % 2), LOCAL_WORLD_SIZE=str(min(2, world - 2 * node)),
                                GROUP_RANK=str(node), GROUP_WORLD_SIZE=str((world + 1) // 2))
                self.start([args.worker] + wargs, renv, f"err{r}")
            return
        if args.mode == "threads":
            cmd = [args.worker] + wargs
        elif args.mode == "tandemrun":
            cmd = [args.tandemrun, "--standalone", "--nproc-per-node", str(world),
                   args.worker] + wargs
        else:
            cmd = [args.mpirun, "-n", str(world), "--oversubscribe", "--bind-to", "none",
                   "--timeout", "150", args.worker] + wargs
            env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
            env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        self.start(cmd, env, "err")

    def start(self, cmd, env, name):
        path = os.path.join(self.directory, name)
        self.err_files.append(path)
        self.procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                           stderr=open(path, "wb"), start_new_session=True))

    def text(self):
        return "".join(read(p) for p in self.err_files)

    def ended(self):
        return all(p.poll() is not None for p in self.procs)

    def wait(self, limit):
        while time.monotonic() < limit and not self.ended():
            time.sleep(0.02)
        return self.ended()

    def codes(self):
        return [p.poll() for p in self.procs]

    def kill(self):
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except OSError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


def wait_until(job, predicate, limit):
    while time.monotonic() < limit:
        if predicate():
            return True
        if job.ended():
            return predicate()
        time.sleep(0.02)
    return False


def kept_flight_dir(text):
    found = re.search(r"Flight recorder \(`tandemrun --trace ([^`]+)`\)", text)
    return found.group(1) if found else None


def case_notice(args, job, failures):
    victim = args.victim if args.victim >= 0 else args.world - 1

    def named():
        for m in NOTICE.finditer(job.text()):
            if victim in ranks_of(m.group(2)) and victim not in ranks_of(m.group(3)):
                return True
        return False

    if not wait_until(job, named, time.monotonic() + LIMIT_S):
        failures.append(f"no waiting notice named rank {victim}")
    with open(os.path.join(job.directory, "go"), "w") as f:
        f.write("go\n")
    if not job.wait(time.monotonic() + LIMIT_S):
        failures.append("the job did not end after the late rank went on")
    elif any(code != 0 for code in job.codes()):
        failures.append(f"the job ended with {job.codes()} (expected 0)")


def case_stall(args, job, failures):
    victim = args.victim if args.victim >= 0 else args.world - 1
    at = os.path.join(job.directory, f"rank{victim}.at")
    if not wait_until(job, lambda: os.path.exists(at), time.monotonic() + LIMIT_S):
        failures.append("the victim never announced itself")
        return None
    pid = int(read(os.path.join(job.directory, f"rank{victim}.pid")).split()[0])
    os.kill(pid, signal.SIGSTOP)
    limit = time.monotonic() + LIMIT_S
    if not job.wait(limit):
        failures.append("tandemrun did not end after the ranks' timeout")
        return None
    text = job.text()
    if job.codes() != [1]:
        failures.append(f"tandemrun exited {job.codes()}, not 1")
    if not re.search(rf"tandemrun: rank {victim} \(pid {pid}\) is stopped", text):
        failures.append("tandemrun did not say the victim was stopped")
    if not any(victim in ranks_of(m.group(1)) for m in re.finditer(
            r"tandem: rank \d+ has waited [^\n]* in all_reduce #\d+ [^\n]*?for ranks? ([\d, ]+)",
            text)):
        failures.append("no waiting notice named the victim")
    if not re.search(rf"tandemrun:   rank {victim} [^\n]*; ranks? [\d, ]+ waits? in ", text):
        failures.append("tandemrun's stall report did not name the victim first")
    root = re.search(r"Root Cause.*?rank\s*:\s*(\d+).*?error\s*:\s*([^\n]*)", text, re.S)
    if not root or int(root.group(1)) != victim or "stopped" not in root.group(2):
        failures.append(f"the summary's root cause is not the stopped rank {victim}")
    return kept_flight_dir(text)


def case_mismatch(args, job, failures):
    if not job.wait(time.monotonic() + LIMIT_S):
        failures.append("the job did not end")
        return None
    text = job.text()
    flight = kept_flight_dir(text)
    if job.codes() != [1]:
        failures.append(f"tandemrun exited {job.codes()}, not 1")
    if not flight:
        failures.append("the summary has no flight recorder section")
        return None
    for r in range(args.world):
        if not re.search(rf"  rank {r} \(pid \d+, mismatch\): [^\n]*disagree", text):
            failures.append(f"the summary does not quote rank {r}'s mismatch record")
        if not any(n.startswith(f"flight-rank{r}-") for n in os.listdir(flight)):
            failures.append(f"rank {r} wrote no record in {flight}")
    return flight


def case_blame(args, job, failures):
    if not job.wait(time.monotonic() + LIMIT_S):
        failures.append("the job did not end")
        return None
    text = job.text()
    if job.codes() != [1]:
        failures.append(f"tandemrun exited {job.codes()}, not 1")
    root = re.search(r"Root Cause.*?rank\s*:\s*(\d+).*?error\s*:\s*([^\n]*)", text, re.S)
    if not root or root.group(1) != "0" or "No space left on device" not in root.group(2):
        failures.append("the summary's root cause is not rank 0 with its cause")
    others = text[text.find("Other Failures:"):] if "Other Failures:" in text else ""
    if "follows   : rank 0 failed: " not in others:
        failures.append("rank 1 does not say it followed rank 0")
    if args.world > 2 and "follows   : another rank's failure" not in others:
        failures.append("rank 2 does not say it followed another rank's failure")
    return kept_flight_dir(text)


CASES = {"notice": case_notice, "stall": case_stall, "mismatch": case_mismatch,
         "blame": case_blame}


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", required=True)
    parser.add_argument("--tandemrun")
    parser.add_argument("--mpirun")
    parser.add_argument("--case", choices=sorted(CASES), required=True)
    parser.add_argument("--backend", choices=["local", "gloo", "shm", "hierarchical", "mpi"],
                        required=True)
    parser.add_argument("--mode", choices=["threads", "env", "tandemrun", "mpirun"], required=True)
    parser.add_argument("--world", type=int, default=3)
    parser.add_argument("--victim", type=int, default=-1, help="default: the last rank")
    parser.add_argument("--timeout-ms", type=int, default=0,
                        help="the collectives' timeout (default: 60 s; stall: 8 s)")
    args = parser.parse_args()
    if args.mode == "tandemrun" and not args.tandemrun:
        print("flight_driver: skipped: no tandemrun given (build with TANDEM_BUILD_TOOLS=ON)")
        return 77
    if args.mode == "mpirun" and not args.mpirun:
        print("flight_driver: skipped: no mpirun")
        return 77
    timeout_ms = args.timeout_ms or (8000 if args.case == "stall" else 60000)
    directory = tempfile.mkdtemp(prefix="tandem-flight-case-")
    extra_env = {}
    if args.mode != "tandemrun":  # tandemrun makes the directory itself
        extra_env["TANDEM_FLIGHT_RECORDER_DIR"] = os.path.join(directory, "flight")
    failures = []
    kept = None
    job = Job(args, args.case, directory, extra_env, args.world, timeout_ms)
    try:
        kept = CASES[args.case](args, job, failures)
        text = job.text()
        sanitizer = re.search(r"(WARNING: ThreadSanitizer[^\n]*|ERROR: \w+Sanitizer[^\n]*|"
                              r"runtime error:[^\n]*)", text)
        if sanitizer:
            failures.append(f"a sanitizer reported: {sanitizer.group(1)}")
        if kept and args.tandemrun:
            trace = subprocess.run([args.tandemrun, "--trace", kept], capture_output=True,
                                   text=True, timeout=60, check=False)
            if trace.returncode != 0 or "flight-rank" not in trace.stdout:
                failures.append(f"tandemrun --trace {kept} read no record: {trace.stdout}")
    finally:
        job.kill()
    status = "PASS" if not failures else "FAIL"
    print(f"[{status}] flight {args.case} on {args.backend}/{args.mode}, {args.world} ranks")
    for failure in failures:
        print(f"    - {failure}")
    if failures:
        print("---- what the job said ----")
        print(job.text()[-12000:])
    if kept and os.path.isdir(kept) and "tandemrun_flight_" in kept:
        shutil.rmtree(os.path.dirname(os.path.dirname(kept)), ignore_errors=True)
    shutil.rmtree(directory, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
