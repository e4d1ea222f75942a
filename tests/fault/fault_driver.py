#!/usr/bin/env python3
"""Fault injection for tandem: runs fault_worker (a short DDP training) and loses one rank.

Each trial draws, from --seed, a victim rank, a step, a collective (the step's gradient sync or
its loss all_reduce) and a point (before, inside or after it), starts the job, waits for the
victim to announce the point (DIR/rank<V>.at) and then sends it SIGKILL or SIGSTOP from here.
For "inside" the signal lands 20-300 ms after the victim entered the collective, and the
survivors enter it only once this driver has written DIR/signalled, so the victim is blocked
inside it. No step waits on the clock (the workers start their rendezvous together once every
process has started; the waits here are bounds on hangs, generous for a loaded machine).
LocalComm's ranks are threads:
the victim thread itself leaves at the point (--signal exit) or stops there for good (--signal
stop); see fault_worker.cpp.

Modes: env (gloo, shm or hierarchical ranks started here by hand over env://), tandemrun (gloo
or shm under tandemrun --standalone), mpirun (mpi), threads (local). hierarchical cuts the job
into nodes of two ranks (GROUP_RANK = rank / 2) on this host: shared memory within each, Gloo
between the nodes' first ranks, so a fault crosses both levels.

A job that fails before its fault because of the machine (its store's port taken, a rendezvous
or a collective starved past the short timeout on a loaded machine) is no trial: it starts again, twice at most,
and the trial says so. A trial passes when, within the collective timeout + 10 s of the fault, every surviving rank has
ended non-zero with a tandem::Error naming the operation (under a launcher: or was ended by the
launcher after it reported the lost rank) and the launcher, if any, has exited non-zero. A rank
or launcher still alive then is a hang; it is given 10 s more (to report how late it ends) and
then killed.

  fault_driver.py --worker build/x/tests/fault/fault_worker --backend gloo --mode env \\
                  --signal kill --trials 20 --seed 1 --json results.jsonl
  fault_driver.py --report results.jsonl       (markdown table of every row in the file)
Exit status: 0 when every trial passed, 1 when one failed, 77 when the row cannot run here.
"""

import argparse
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

OPERATIONS = ("all_reduce", "broadcast", "barrier", "all_gather", "reduce_scatter", "reduce",
              "gather", "scatter", "all_to_all", "send", "recv")
# What a job that failed before its fault says when the machine, not tandem, stopped it.
# Before the fault nothing has been stopped or killed, so a collective that timed out then was
# starved by the machine (seen under ThreadSanitizer at -j2: a rank 2 s late inside step 23).
ENVIRONMENTAL = (r"already in use|rendezvous.*(?:was not set within|timed out|did not join)|"
                 r"init_process_group: rank\(s\) [\d, ]+ did not join|"
                 r"timed out after [\d.]+ s waiting for|no progress after [\d.]+ s")
ERROR_LINE = re.compile(r"tandem: rank (\d+): ([A-Za-z_:]+): ([^\n]*)")
SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}
STEPS = 30
# A survivor (or launcher) alive this long after the collective timeout that followed the fault is
# a hang. Detection takes well under a second (a kill) or the timeout (a stop); the rest is room
# for a loaded machine.
HANG_SLACK_S = 10.0


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read(path):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def alive(pid):
    """True while pid runs or is stopped; a zombie counts as ended."""
    stat = read(f"/proc/{pid}/stat")
    if stat is None:
        return False
    state = stat[stat.rfind(")") + 2:].split(" ", 1)[0]
    return state not in ("Z", "X")


def names_lost_rank(cause, victim):
    """True when an Error's cause says what became of rank `victim`: it died, is gone, left or
    is stopped, or the survivor timed out waiting for it."""
    ranks = rf"\branks? (?:\d+, )*{victim}(?:(?:, | and )\d+)*"
    return bool(re.search(ranks + r" (?:died|has died|have died|left|is stopped|are stopped|"
                          r"has already ended|have already ended)", cause) or
                re.search(rf"waiting for rank {victim}\b", cause))


def plan_trial(rng, args, world):
    point = rng.choice(["before", "inside", "after"])
    return {
        "victim": rng.randrange(world),
        "step": rng.randint(2, STEPS - 3),
        "target": rng.choice(["grads", "loss"]),
        "point": point,
        "delay": rng.uniform(0.02, 0.3) if point == "inside" else 0.0,
    }


def worker_args(args, trial, directory):
    return ["--backend", args.backend, "--dir", directory, "--ranks", str(args.world),
            "--steps", str(STEPS), "--timeout-ms", str(args.timeout_ms),
            "--fault-step", str(trial["step"]), "--point", trial["point"],
            "--target", trial["target"], "--victim", str(trial["victim"]),
            "--fault", args.signal if args.backend == "local" else "exit"]


def start(args, trial, directory):
    """Starts the job; returns {"launcher": Popen or None, "ranks": {rank: Popen}}."""
    def out(name):
        return open(os.path.join(directory, name), "wb")

    wargs = worker_args(args, trial, directory)
    env = dict(os.environ)
    if args.mode == "env":
        port = free_port()
        ranks = {}
        for r in range(args.world):
            renv = dict(env, RANK=str(r), WORLD_SIZE=str(args.world), LOCAL_RANK=str(r),
                        LOCAL_WORLD_SIZE=str(args.world), MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(port))
            if args.backend == "hierarchical":
                node, nodes = r // 2, (args.world + 1) // 2
                renv.update(LOCAL_RANK=str(r % 2),
                            LOCAL_WORLD_SIZE=str(min(2, args.world - 2 * node)),
                            GROUP_RANK=str(node), GROUP_WORLD_SIZE=str(nodes))
            ranks[r] = subprocess.Popen([args.worker] + wargs, env=renv,
                                        stdout=out(f"out{r}"), stderr=out(f"err{r}"),
                                        start_new_session=True)
        return {"launcher": None, "ranks": ranks}
    if args.mode == "threads":
        cmd = [args.worker] + wargs
    elif args.mode == "tandemrun":
        cmd = [args.tandemrun, "--standalone", "--nproc-per-node", str(args.world),
               args.worker] + wargs
    else:
        cmd = [args.mpirun, "-n", str(args.world), "--oversubscribe", "--bind-to", "none",
               "--timeout", "120", args.worker] + wargs
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    launcher = subprocess.Popen(cmd, env=env, stdout=out("out"), stderr=out("err"),
                                start_new_session=True)
    return {"launcher": launcher, "ranks": {}}


def kill_everything(job, pids):
    procs = list(job["ranks"].values()) + ([job["launcher"]] if job["launcher"] else [])
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
    for pid in pids:
        if alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def publish(path, text):
    """Writes a file whole (through a rename), for a worker that polls for it."""
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(text)
    os.rename(path + ".tmp", path)


def error_tail(directory):
    """The last lines the job wrote on stderr, for a trial that failed before its fault."""
    lines = []
    for name in sorted(os.listdir(directory)):
        if name.startswith("err"):
            lines += [f"{name}: {line}" for line in (read(os.path.join(directory, name)) or "")
                      .splitlines()[-3:] if line.strip()]
    return " | ".join(lines[-6:]) or "(nothing)"


def wait_for(path, job, limit):
    """Polls for a file until `limit` (monotonic); None when the job ended first or time ran out."""
    while time.monotonic() < limit:
        text = read(path)
        if text:
            return text
        procs = [job["launcher"]] if job["launcher"] else list(job["ranks"].values())
        if any(p.poll() is not None for p in procs):
            text = read(path)
            return text or None
        time.sleep(0.001)
    return None


def run_trial(args, trial, directory):
    timeout_s = args.timeout_ms / 1000.0
    victim = trial["victim"]
    survivors = [r for r in range(args.world) if r != victim]
    result = dict(trial, backend=args.backend, mode=args.mode, signal=args.signal,
                  world=args.world, timeout_s=timeout_s, passed=False, hang=False, notes=[])
    job = start(args, trial, directory)
    worker_pids = {}
    try:
        at = wait_for(os.path.join(directory, f"rank{victim}.at"), job,
                      time.monotonic() + args.startup_s)
        if at is None:
            procs = [job["launcher"]] if job["launcher"] else list(job["ranks"].values())
            ended = any(p.poll() is not None for p in procs)
            result["notes"].append(
                "the victim never reached its point: " +
                ("the job ended first" if ended else f"not within {args.startup_s:g} s") +
                "; its stderr ends: " + error_tail(directory))
            result["setup_error"] = True
            return result
        for r in range(args.world):
            pid_text = read(os.path.join(directory, f"rank{r}.pid"))
            if pid_text:
                worker_pids[r] = int(pid_text.split()[0])
        if args.backend == "local":
            fault_time = int(at.split()[3]) / 1e9
            actual_point = at.split()[0]
        else:
            if victim not in worker_pids:
                result["notes"].append("no pid file from the victim")
                result["setup_error"] = True
                return result
            if trial["delay"] > 0:
                time.sleep(trial["delay"])
            os.kill(worker_pids[victim], SIGNALS[args.signal])
            fault_time = time.monotonic()
            publish(os.path.join(directory, "signalled"), "1\n")  # the survivors go on
            now_at = read(os.path.join(directory, f"rank{victim}.at")) or at
            actual_point = "after (the collective had returned)" \
                if now_at.startswith("passed") else now_at.split()[0]
        result["actual_point"] = actual_point

        # Watch the survivors (and the launcher) end.
        hang_at = fault_time + timeout_s + HANG_SLACK_S
        give_up = hang_at + 10.0
        ended = {}    # rank -> (seconds after the fault, exit code or None)
        launcher_end = None
        while time.monotonic() < give_up:
            now = time.monotonic()
            if job["launcher"] is not None and launcher_end is None:
                rc = job["launcher"].poll()
                if rc is not None:
                    launcher_end = (now - fault_time, rc)
            for r in survivors:
                if r in ended:
                    continue
                if args.mode == "env":
                    rc = job["ranks"][r].poll()
                    if rc is not None:
                        ended[r] = (now - fault_time, rc)
                elif args.mode == "threads":
                    if launcher_end is not None:
                        ended[r] = launcher_end
                elif r in worker_pids and not alive(worker_pids[r]):
                    ended[r] = (now - fault_time, None)
            done = len(ended) == len(survivors) and \
                (job["launcher"] is None or launcher_end is not None)
            if done:
                break
            time.sleep(0.002)

        # The victim and anything the launcher left behind.
        leftovers = [r for r, pid in worker_pids.items()
                     if job["launcher"] is not None and launcher_end is not None and alive(pid)
                     and args.mode != "threads"]
        if leftovers:
            result["notes"].append(f"ranks {leftovers} still alive after the launcher exited")
        kill_everything(job, list(worker_pids.values()))

        # Judge.
        errors = {}
        texts = {}
        if args.mode == "env":
            for r in survivors:
                texts[r] = read(os.path.join(directory, f"err{r}")) or ""
        else:
            combined = read(os.path.join(directory, "err")) or ""
            for r in survivors:
                texts[r] = combined
        for r in survivors:
            end_record = read(os.path.join(directory, f"rank{r}.end"))
            mine = [m for m in ERROR_LINE.finditer(texts[r]) if int(m.group(1)) == r]
            if end_record:
                first, _, rest = end_record.partition("\n")
                code_text, time_text = first.split()[:2]
                errors[r] = {"recorded_code": int(code_text),
                             "recorded_after": int(time_text) / 1e9 - fault_time,
                             "error": rest.strip()}
            else:
                errors[r] = {"recorded_code": None, "recorded_after": None, "error": ""}
            if mine:
                errors[r]["error_line"] = mine[0].group(0)
                errors[r]["operation"] = mine[0].group(2)
                cause = mine[0].group(3)
                errors[r]["names_lost_rank"] = names_lost_rank(cause, victim)
                # A survivor blamed as the lost one ("rank 0 has died" when rank 0 only gave up).
                # "rank 0 failed first (...)" (ShmComm) wraps the first failure another rank saw,
                # and says nothing against rank 0: what counts is inside.
                blamed = {int(m.group(1)) for m in re.finditer(
                    r"\brank (\d+) (?:has died|left|failed(?! first \())", cause)}
                errors[r]["blames"] = sorted(blamed - {victim})

        ends = [ended[r][0] for r in survivors if r in ended]
        if launcher_end is not None:
            ends.append(launcher_end[0])
        everyone = len(ended) == len(survivors) and \
            (job["launcher"] is None or launcher_end is not None)
        result["detection_s"] = max(ends) if ends and everyone else None
        result["watched_s"] = give_up - fault_time
        result["survivors"] = {
            str(r): dict(errors[r], ended_after=ended.get(r, (None, None))[0],
                         exit_code=ended.get(r, (None, None))[1]) for r in survivors}
        result["launcher"] = None if job["launcher"] is None else {
            "ended_after": None if launcher_end is None else launcher_end[0],
            "exit_code": None if launcher_end is None else launcher_end[1]}
        launcher_text = "" if args.mode == "env" else (read(os.path.join(directory, "err")) or "")
        root = re.search(r"Root Cause.*?rank\s*:\s*(\d+)", launcher_text, re.S)
        result["launcher_root_cause_rank"] = int(root.group(1)) if root else None
        result["launcher_names_lost_rank"] = bool(
            (root and int(root.group(1)) == victim) or
            re.search(rf"process rank {victim} with PID", launcher_text))
        result["launcher_lines"] = [line for line in launcher_text.splitlines()
                                    if "Root Cause" in line or "exitcode" in line
                                    or "noticed that process" in line or "MPI_ABORT" in line
                                    or line.startswith("tandemrun:")][:6]

        # Pass or fail, with the reasons.
        limit = timeout_s + HANG_SLACK_S
        failures = []
        for r in survivors:
            if r not in ended or ended[r][0] > limit:
                result["hang"] = True
                result["ended_late"] = r in ended and result.get("ended_late", True)
                late = f" (it ended {ended[r][0]:.1f} s after)" if r in ended else ""
                failures.append(f"rank {r} still alive {limit:.1f} s after the fault{late}")
                continue
            info = errors[r]
            has_error = "operation" in info and any(op in info["operation"] for op in OPERATIONS)
            if info.get("blames"):
                failures.append(f"rank {r}'s Error blames rank(s) {info['blames']}, which did "
                                f"not fail (the lost rank is {victim})")
            if args.require_named and "operation" in info and not info.get("names_lost_rank"):
                failures.append(f"rank {r}'s Error does not name the lost rank {victim}")
            if args.mode in ("env", "threads"):
                code = ended[r][1] if args.mode == "env" else info["recorded_code"]
                if not code:
                    failures.append(f"rank {r} ended with code {code}")
                if not has_error:
                    failures.append(f"rank {r} printed no tandem::Error naming the operation")
            elif not has_error and not result["launcher_names_lost_rank"]:
                failures.append(f"rank {r} printed no tandem::Error naming the operation, and "
                                "the launcher did not name the lost rank")
        all_text = "".join(read(os.path.join(directory, name)) or ""
                           for name in sorted(os.listdir(directory)) if name.startswith("err"))
        sanitizer = re.search(r"(ERROR: \w+Sanitizer[^\n]*|WARNING: ThreadSanitizer[^\n]*|"
                              r"runtime error:[^\n]*)", all_text)
        if sanitizer:
            failures.append(f"a sanitizer reported: {sanitizer.group(1)}")
        if job["launcher"] is not None:
            if launcher_end is None or launcher_end[0] > limit:
                result["hang"] = True
                late = "" if launcher_end is None else f" (it ended {launcher_end[0]:.1f} s after)"
                result["ended_late"] = launcher_end is not None
                failures.append(f"the launcher still alive {limit:.1f} s after the fault{late}")
            elif launcher_end[1] == 0:
                failures.append("the launcher exited 0")
        result["failures"] = failures
        result["passed"] = not failures
        return result
    finally:
        kill_everything(job, list(worker_pids.values()))


def summarise(rows):
    """Markdown table rows, one per (backend, mode, signal)."""
    groups = {}
    for row in rows:
        groups.setdefault((row["backend"], row["mode"], row["signal"], row["world"],
                           row["timeout_s"]), []).append(row)
    lines = ["| backend | mode | fault | ranks | timeout s | trials | passed | hangs | max s | median s | "
             "ended late | points (before/inside/after) | survivors with their own Error | "
             "lost rank named | example Error |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|---|"]
    for (backend, mode, sig, world, timeout_s), trials in groups.items():
        times = [t["detection_s"] for t in trials if t.get("detection_s") is not None]
        never = [t for t in trials if t.get("detection_s") is None and "watched_s" in t]
        longest = f"{max(times):.2f}" if times else "-"
        if never:  # something never ended while watched: the maximum is unknown
            longest = f"> {min(t['watched_s'] for t in never):.0f} ({len(never)} never ended)"
        points = [sum(1 for t in trials if t["point"] == p) for p in ("before", "inside", "after")]
        named = sum(1 for t in trials
                    if any(s.get("names_lost_rank") for s in t.get("survivors", {}).values())
                    or t.get("launcher_names_lost_rank"))
        survivors = [s for t in trials for s in t.get("survivors", {}).values()]
        own = sum(1 for s in survivors if s.get("error_line"))
        # An Error that names the lost rank if there is one, else any, else the launcher's words.
        lines_seen = [(s.get("names_lost_rank", False), s["error_line"]) for t in trials
                      for s in t.get("survivors", {}).values() if s.get("error_line")]
        lines_seen.sort(key=lambda pair: not pair[0])
        example = lines_seen[0][1] if lines_seen else ""
        if not example:
            said = [line.strip() for t in trials for line in t.get("launcher_lines", [])
                    if "noticed" in line or "Root Cause" not in line]
            example = said[0] if said else ""
        example = example.replace("|", "\\|")
        if len(example) > 220:
            example = example[:217] + "..."
        lines.append(
            f"| {backend} | {mode} | {sig} | {world} | {timeout_s:g} | {len(trials)} | "
            f"{sum(t['passed'] for t in trials)} | {sum(t['hang'] for t in trials)} | "
            f"{longest} | {statistics.median(times):.2f} | "
            f"{sum(bool(t.get('ended_late')) for t in trials)} | {points[0]}/{points[1]}/{points[2]} | {own}/{len(survivors)} | "
            f"{named}/{len(trials)} | `{example}` |"
            if times else
            f"| {backend} | {mode} | {sig} | {world} | {timeout_s:g} | {len(trials)} | 0 | - | - "
            "| - | - | - "
            "| - | |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker")
    parser.add_argument("--tandemrun")
    parser.add_argument("--mpirun")
    parser.add_argument("--backend", choices=["local", "gloo", "shm", "hierarchical", "mpi"])
    parser.add_argument("--mode", choices=["threads", "env", "tandemrun", "mpirun"])
    parser.add_argument("--signal", choices=["kill", "stop", "exit"])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout-ms", type=int, default=2000)
    parser.add_argument("--startup-s", type=float, default=90.0)
    parser.add_argument("--json", help="append each trial's result to this file (JSON lines)")
    parser.add_argument("--report", help="print the markdown table of a JSON-lines file")
    parser.add_argument("--keep", action="store_true", help="keep each trial's directory")
    parser.add_argument("--require-named", action="store_true",
                        help="fail a trial where a survivor's Error does not say what became of "
                             "the lost rank (died, left, stopped, or waited for)")
    args = parser.parse_args()

    if args.report:
        with open(args.report, encoding="utf-8") as f:
            print(summarise([json.loads(line) for line in f if line.strip()]))
        return 0
    if not (args.worker and args.backend and args.mode and args.signal):
        parser.error("--worker, --backend, --mode and --signal are needed")
    expected = {"local": ("threads",), "gloo": ("env", "tandemrun"), "shm": ("env", "tandemrun"),
                "hierarchical": ("env",), "mpi": ("mpirun",)}
    if args.mode not in expected[args.backend]:
        parser.error(f"backend {args.backend} runs in mode {expected[args.backend]}")
    if (args.backend == "local") != (args.signal in ("exit", "stop") and args.mode == "threads"):
        if args.backend == "local" or args.signal == "exit":
            parser.error("local takes --signal exit|stop; processes take kill|stop")
    if args.mode == "tandemrun" and not args.tandemrun:
        print("fault_driver: skipped: no tandemrun given (build with TANDEM_BUILD_TOOLS=ON)")
        return 77

    failed = 0
    for i in range(args.trials):
        rng = random.Random(args.seed * 1000003 + i)
        trial = plan_trial(rng, args, args.world)
        retried = []
        for _ in range(3):
            with tempfile.TemporaryDirectory(prefix="tandem-fault-") as directory:
                result = run_trial(args, trial, directory)
                if args.keep:
                    kept = tempfile.mkdtemp(prefix="tandem-fault-kept-")
                    subprocess.run(["cp", "-r", directory + "/.", kept], check=False)
                    result["kept"] = kept
            # A job that failed before its fault is no trial of the fault; where the machine
            # caused it, start again (twice at most, noted): the port picked for the job's store
            # taken by another process (any outgoing connection) before rank 0 listened on it,
            # or a rank so starved on a loaded machine that its rendezvous, or a collective before
            # the fault, outlasted the short collective timeout. Any other failure before the
            # fault fails the trial (and one that recurs three times fails it too).
            if not (result.get("setup_error") and
                    any(re.search(ENVIRONMENTAL, note) for note in result["notes"])):
                break
            retried.append(result["notes"][0])
        result["notes"] += [f"started again after: {why}" for why in retried]
        result["seed"] = args.seed
        result["index"] = i
        failed += not result["passed"]
        status = "PASS" if result["passed"] else "FAIL"
        detection = result.get("detection_s")
        print(f"[{status}] {args.backend}/{args.mode}/{args.signal} trial {i}: victim rank "
              f"{trial['victim']}, step {trial['step']}, {trial['point']} the {trial['target']} "
              f"collective (landed: {result.get('actual_point')}); ended "
              f"{'-' if detection is None else f'{detection:.2f}'} s after the fault")
        for r, s in result.get("survivors", {}).items():
            print(f"    rank {r}: exit {s.get('exit_code')}, "
                  f"{s.get('error_line') or s.get('error') or '(no error printed)'}")
        if result.get("launcher"):
            what = "process" if args.mode == "threads" else "launcher"
            print(f"    {what}: exit {result['launcher']['exit_code']}, ended "
                  f"{result['launcher']['ended_after']} s after the fault")
            for line in result.get("launcher_lines", []):
                print(f"      {line}")
        for note in result["notes"] + result.get("failures", []):
            print(f"    - {note}")
        sys.stdout.flush()
        if args.json:
            with open(args.json, "a", encoding="utf-8") as f:
                f.write(json.dumps(result) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
