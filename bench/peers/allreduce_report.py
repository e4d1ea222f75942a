# bench/peers/allreduce_report.py - turns the RESULT/RUNS lines of bench/run_allreduce.sh's parts
# into its markdown report (bench/results/allreduce-peers.md): per rank count and size, every
# implementation's time, busbw and busbw / single-thread memcpy, and a verdict per size (is tandem
# ahead of oneCCL and Open MPI?).
#   python3 bench/peers/allreduce_report.py 2=RESULTS_OF_2_RANKS [4=RESULTS_OF_4_RANKS] > out.md
# Needs: Python 3; the facts of the header (machine, load, versions, notes) come from BENCH_*
# environment variables that run_allreduce.sh exports.
import os
import sys

env = os.environ.get

# The implementations in table order, with what each is.
LABEL = {
    "tandem-shm-segment": "tandem-shm-segment (buckets in the shared segment)",
    "tandem-shm": "tandem-shm (ShmComm, today's copy-in/copy-out path)",
    "tandem-shm-nospin": "tandem-shm, spin = 0 and yield = 0 (sleep at once)",
    "oneccl": "oneCCL (ATL/OFI, shm provider, tandemrun)",
    "oneccl-impi": "oneCCL (ATL/MPI over Intel MPI, mpiexec)",
    "raw-mpi": "Open MPI MPI_Allreduce",
    "tandem-mpi": "tandem-mpi (MpiComm)",
    "raw-mpi-single": "Open MPI MPI_Allreduce, plain MPI_Init",
    "deepspeed-shm": "DeepSpeed shm inference_all_reduce",
    "tandem-local": "tandem-local (threads)",
    "raw-gloo": "raw gloo::allreduce (TCP)",
    "tandem-gloo": "tandem-gloo (default options)",
    "tandem-gloo-nocheck": "tandem-gloo, check_collectives = false",
    "torch-gloo": "torch.distributed gloo",
}
TANDEM = ["tandem-shm-segment", "tandem-shm"]  # tandem's in-node candidates, best first
ONECCL = ["oneccl", "oneccl-impi"]
OPEN_MPI = ["raw-mpi", "raw-mpi-single"]  # MPI_THREAD_MULTIPLE (as MpiComm asks), and plain


def read(path):
    results, runs = {}, {}
    for line in open(path):
        f = line.split()
        if f and f[0] == "RESULT" and len(f) == 8:
            results[(f[1], int(f[2]))] = dict(ranks=int(f[3]), us=float(f[4]), spread=float(f[5]),
                                              fastest=float(f[6]), slowest=float(f[7]))
        elif f and f[0] == "RUNS":
            runs[(f[1], int(f[2]))] = [float(x) for x in f[3:]]
    return results, runs


def size_name(b):
    return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"


def time_name(us):
    if us >= 1000:
        return f"{us / 1000:.2f} ms"
    return f"{us:.1f} us" if us >= 10 else f"{us:.2f} us"


sets = {}  # ranks -> (results, runs)
for arg in sys.argv[1:]:
    ranks, path = arg.split("=", 1)
    sets[int(ranks)] = read(path)
memcpy = {}  # bytes -> GB/s, from the 2-rank set (one thread, independent of the rank count)
for ranks, (results, _) in sets.items():
    for (impl, size), r in results.items():
        if impl == "memcpy":
            memcpy[size] = size / r["us"] / 1e3


def busbw(r, size):
    n = r["ranks"]
    return size / r["us"] / 1e3 * 2 * (n - 1) / n


def verdict(tandem, rivals, missing):
    """The line answering "is tandem ahead of oneCCL and Open MPI at this size, and why?"."""
    name, t = tandem
    ahead, behind = [], []
    for rival, r in rivals:
        overlap = t["fastest"] <= r["slowest"] and r["fastest"] <= t["slowest"]
        text = (f"{rival} {time_name(r['us'])}, tandem / {rival} = {t['us'] / r['us']:.2f}"
                + (" (the run ranges overlap: within noise)" if overlap else ""))
        (behind if r["us"] < t["us"] else ahead).append(text)
    if behind:
        answer, why = "no", "faster: " + "; ".join(behind)
        if ahead:
            why += "; slower: " + "; ".join(ahead)
    else:
        answer, why = "yes", "both slower: " + "; ".join(ahead)
    if missing:
        answer += f" (not measured: {', '.join(missing)})"
    return (f"**Tandem ahead of oneCCL and Open MPI? {answer}** - {name} {time_name(t['us'])} "
            f"(runs {time_name(t['fastest'])} - {time_name(t['slowest'])}); {why}.")


def best(results, names, size):
    """(name, result) of the fastest of names at size, or None."""
    found = [(n, results[(n, size)]) for n in names if (n, size) in results]
    return min(found, key=lambda x: x[1]["us"]) if found else None


out = []
w = out.append
w("# all_reduce within one node: tandem beside oneCCL, Open MPI, DeepSpeed, Gloo and memcpy")
w("")
w(f"Date: {env('BENCH_DATE')}. Produced by `{env('BENCH_COMMAND', '').strip()}` (one run of the "
  "script; every number below comes from it).")
w("")
w(f"- Machine: {env('BENCH_NPROC')} CPUs ({env('BENCH_CPU')}), {env('BENCH_MEMORY')}, "
  f"{env('BENCH_OS')}, {env('BENCH_KERNEL')}. Shared with other work: load average (1, 5, 15 min) "
  f"{env('BENCH_LOAD_BEFORE')} before, {env('BENCH_LOAD_AFTER')} after; 1-minute load as each part "
  f"started: {env('BENCH_LOADS')}. Time per part: {env('BENCH_DURATIONS')}.")
w(f"- Build: {env('BENCH_BUILD_TYPE')}, {env('BENCH_COMPILER')}; tandem {env('BENCH_TANDEM')} "
  f"(commit {env('BENCH_TANDEM_COMMIT')}). Programs listed by bench_allreduce_rank --modes: "
  f"{env('BENCH_MODES') or 'none'}.")
w(f"- Peers: {env('BENCH_MPI')} (mpirun --bind-to none, shared-memory transport); "
  f"{env('BENCH_ONECCL')}; {env('BENCH_DEEPSPEED')}; {env('BENCH_GLOO')} (TCP, "
  f"GLOO_SOCKET_IFNAME=lo); {env('BENCH_TORCH')}.")
w("")
w("## Method")
w("")
w(f"all_reduce, sum, float32, in place, on one host. {env('BENCH_RUNS')} runs x "
  f"{env('BENCH_ITERS')} iterations per implementation and size, after a correctness check (ranks "
  "hold rank + 1; every element must come back as the sum, else the part fails and reports no "
  "number) and 5 warm-up iterations. An iteration is the implementation's own barrier, then a "
  "steady clock around one all_reduce on every rank; its time is the **maximum over the ranks** "
  "(the collective is done when its last rank is). A run's time is the median of its iterations; "
  "the table gives the **median of the run medians**, spread = slowest run / fastest run. "
  "Implementations of one engine run interleaved in the same processes (tandem-shm beside "
  "tandem-shm-segment; tandem-mpi beside raw MPI; tandem-gloo beside raw gloo); each peer runs "
  "in its own processes: oneCCL (bench/peers/oneccl_allreduce.cpp), DeepSpeed and torch "
  "(bench/allreduce_torch.py; DeepSpeed's barrier is its own all_reduce of one element, "
  "torch's is dist.barrier).")
w("")
w("busbw = bytes / time x 2(n-1)/n (nccl-tests' PERFORMANCE.md; = bytes / time for n = 2); "
  "GB = 10^9 bytes. **x memcpy** = busbw / the bandwidth of a single-thread memcpy of the same "
  "bytes (bench_allreduce, measured in the same run; it does not depend on the rank count). "
  "Issue 33's targets: tandem at 0.8 x memcpy at 64 MiB and 0.6 x at 4 MiB, with buckets in the "
  "segment, and ahead of oneCCL and Open MPI at every size. Each size's verdict sets tandem's "
  "faster shared-memory path against the faster oneCCL run and the faster Open MPI run (at "
  "MPI_THREAD_MULTIPLE or after a plain MPI_Init); where the two run ranges overlap the "
  "difference is within this run's noise.")

for ranks in sorted(sets):
    results, _ = sets[ranks]
    sizes = sorted({size for _, size in results})
    w("")
    if ranks > int(env("BENCH_NPROC", "2")):
        w(f"## {ranks} ranks (oversubscribed: {ranks} processes on {env('BENCH_NPROC')} CPUs)")
        w("")
        w("Every rank shares a CPU with another: these times measure how each implementation "
          "waits (spinning or sleeping) as much as how it moves bytes. Read them as a stress "
          f"test, not as bandwidth. Fewer runs here: {env('BENCH_OVER_COUNTS')} per "
          "implementation and size.")
    else:
        w(f"## {ranks} ranks")
    for size in sizes:
        w("")
        w(f"### {size_name(size)}, {ranks} ranks")
        w("")
        w("| implementation | median time | busbw GB/s | x memcpy | spread (fastest - slowest run) |")
        w("|---|---|---|---|---|")
        rows = [(impl, results[(impl, size)]) for impl in LABEL if (impl, size) in results]
        for impl, r in rows:
            bus = busbw(r, size)
            ratio = f"{bus / memcpy[size]:.2f}" if size in memcpy else "no memcpy"
            w(f"| {LABEL[impl]} | {time_name(r['us'])} | {bus:.3f} | {ratio} | {r['spread']:.2f}x "
              f"({time_name(r['fastest'])} - {time_name(r['slowest'])}) |")
        if size in memcpy and ranks == 2:
            w(f"| memcpy (1 thread, bytes copied / time) | {time_name(size / memcpy[size] / 1e3)} "
              f"| {memcpy[size]:.3f} | 1.00 | - |")
        t = best(results, TANDEM, size)
        rivals = [x for x in (best(results, ONECCL, size), best(results, OPEN_MPI, size)) if x]
        if t is None:
            w("")
            w("**Verdict: not measured** (no tandem shared-memory result at this size).")
            continue
        if not rivals:
            w("")
            w("**Verdict: no peer measured** (neither oneCCL nor Open MPI ran at this size).")
            continue
        w("")
        w(verdict(t, rivals, [g for g, names in (("oneCCL", ONECCL), ("Open MPI", OPEN_MPI))
                              if best(results, names, size) is None]))


def target(size, floor):
    parts = []
    for ranks in sorted(sets):
        results, _ = sets[ranks]
        t = best(results, TANDEM, size)
        if t is None or size not in memcpy:
            parts.append(f"{ranks} ranks: not run")
            continue
        ratio = busbw(t[1], size) / memcpy[size]
        parts.append(f"{ranks} ranks: {t[0]} {ratio:.2f} x memcpy "
                     f"({'met' if ratio >= floor else 'not met'})")
    return "; ".join(parts)


w("")
w("## Issue 33's bandwidth targets")
w("")
w(f"- 64 MiB at 0.8 x memcpy: {target(64 << 20, 0.8)}.")
w(f"- 4 MiB at 0.6 x memcpy: {target(4 << 20, 0.6)}.")
if 2 in sets and ("tandem-shm-segment", 64 << 20) not in sets[2][0]:
    w("- tandem-shm-segment: not in this build (bench_allreduce_rank does not list it), so the "
      "targets above are today's path.")

notes = env("BENCH_NOTES", "").strip()
if notes:
    w("")
    w("## Parts not run or failed")
    w("")
    for line in notes.splitlines():
        w(f"- {line}")
w("")
w("## Raw data")
w("")
w("Per rank count, implementation and size, the run medians in microseconds, in run order:")
w("")
w("```")
for ranks in sorted(sets):
    results, runs = sets[ranks]
    for (impl, size), values in sorted(runs.items(), key=lambda x: (x[0][1], x[0][0])):
        w(f"{ranks} {impl} {size} " + " ".join(f"{x:.1f}" for x in values))
w("```")
print("\n".join(out))
