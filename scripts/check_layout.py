#!/usr/bin/env python3
"""Checks the include rule of include/tandem's rooms (docs/layout.md, "Include rule") and prints
each folder's share of the library's lines. CTest runs it as `layout_rules`.

    python3 scripts/check_layout.py [include/tandem]     # exit 1 and say why when a rule breaks

A room is a folder (or a single header at the top, such as cuda.hpp: cuda/'s); a backend folder under comm/
(comm/gloo/, ...) is a room of its own, and a detail/ folder belongs to the room above it.

The rule: a header includes its own room, core/, tensor/, and other rooms' concept headers
(CONCEPT_HEADERS) only. A backend (comm/<name>/) also includes comm/ (the room it sits in) and its
engine's room (ENGINE_ROOMS), and never another backend. Besides:
  - rendezvous/ includes core/ only, so that comm/ may include it without a circle;
  - no circle between rooms, allowed includes or not;
  - no folder holds more than 25 % of the library's lines.
What still breaks the rule is listed, one include a line and with the reason, in ALLOWED; a new
violation fails, and so does an entry of ALLOWED that no header needs any more (delete it).
tandem.hpp, the umbrella of every room, is skipped.
"""
import os
import re
import sys

MAX_SHARE = 0.25
INCLUDE = re.compile(r'^\s*#\s*include\s*"tandem/([^"]+)"', re.M)

# The headers another room may include: a room's concept (and the types it names), or functions
# written on another room's concept alone.
CONCEPT_HEADERS = {
    "comm/communicator.hpp": "the Communicator concept, ReduceOp, groups",
    "comm/work.hpp": "Work, what a Communicator's _async collectives return",
    "comm/metrics.hpp": "reduce_mean, all_gather_unequal, broadcast_vector: on the concept alone",
    "comm/shared_memory.hpp": "SharedBlock and the SharedMemoryComm concept (memory a "
    "communicator lends, where DDP puts its gradients)",
    "comm/stream_order.hpp": "order_after, hand_back: the one stream-ordering contract, on the "
    "Communicator and Executor concepts alone",
    "comm/detail/host_values.hpp": "collectives over a few host values on any Communicator: on "
    "the concept alone",
    "rendezvous/store.hpp": "the Store concept",
    "arena/parameters.hpp": "the arena of parameters the training rooms (ddp/, optim/) share",
    "optim/optimizer.hpp": "the Optimizer concept",
    "data/dataset.hpp": "the Dataset concept",
    "nn/detail/sync_statistics.hpp": "SyncBatchNorm's per-channel core (wire format, merge, "
    "checks, commit), which torch/'s SyncBatchNorm shares: on core/ and tensor/ alone",
}

# The room whose library a backend drives.
ENGINE_ROOMS = {"comm/nccl": {"cuda"}}

# What still breaks the rule: (including header, included header) -> why it may, for now.
ALLOWED = {
    # By design: init_process_group is where ranks that met through a store become a
    # communicator; rendezvous/ includes core/ only, so this cannot close a circle.
    ("comm/init.hpp", "rendezvous/init_method.hpp"): "init_process_group parses the init method",
    ("comm/init.hpp", "rendezvous/join.hpp"): "init_process_group opens and joins the store",
    # Issue 32: an elastic group rebuilds its communicator after a loss the way init_process_group
    # builds it (a backend's rendezvous over the job's store), so it opens and joins the store too.
    ("elastic/elastic.hpp", "comm/init.hpp"): "ProcessGroupBackend: rendezvous over a store",
    ("elastic/elastic.hpp", "rendezvous/init_method.hpp"): "Elastic(url) parses the init method",
    ("elastic/elastic.hpp", "rendezvous/join.hpp"): "Elastic(url) opens and joins the store",
    # tandemrun sets the flight recorder's settings for its workers and reads their records when
    # one fails; the recorder lives with the communicators that keep it.
    ("launch/plan.hpp", "comm/flight_settings.hpp"): "the launcher's flight-recorder flags",
    ("launch/launcher.hpp", "comm/flight_settings.hpp"): "the workers' flight-recorder variables",
    ("launch/launcher.hpp", "comm/flight_trace.hpp"): "the failure summary reads the records",
    ("launch/detail/supervise.hpp", "comm/flight_trace.hpp"): "the failure summary reads them",
    # data/'s device delivery drives the CUDA engine (a .cu-only header, like comm/nccl/).
    ("data/cuda_delivery.hpp", "cuda/memory.hpp"): "pinned and device buffers",
    ("data/cuda_delivery.hpp", "cuda/runtime.hpp"): "CUDA runtime errors",
    ("data/cuda_delivery.hpp", "cuda/stream.hpp"): "the copy stream and its events",
    # By design: torch/ is the libtorch bridge, and its DistributedDataParallel is tandem's
    # (buckets, overlap, policies, checks) driven by autograd's hooks over torch tensors; a second
    # DDP in torch/ would be a copy. ddp/ includes nothing of torch/, so there is no circle.
    ("torch/ddp.hpp", "ddp/ddp.hpp"): "the bridge's DDP is tandem's DDP over torch tensors",
    ("torch/ddp.hpp", "ddp/policies.hpp"): "and takes the same policies",
    ("torch/cuda.hpp", "cuda/detail/nvcc_only.hpp"): "stops a build that is not nvcc's",
    ("torch/cuda.hpp", "cuda/exec.hpp"): "the bridge's CUDA modules run on cuda_exec",
}


def room_of(path):
    """'comm/gloo/detail/x.hpp' -> 'comm/gloo'; 'cuda.hpp' -> 'cuda'; 'comm/init.hpp' -> 'comm'."""
    parts = [p for p in path.split("/")[:-1] if p != "detail"]
    if not parts:
        return os.path.splitext(path)[0]
    if parts[0] == "comm" and len(parts) > 1:
        return "comm/" + parts[1]
    return parts[0]


def is_backend(room):
    return room.startswith("comm/")


def allowed(room, target_path):
    """None when a header of `room` may include `target_path`, else the rule it breaks."""
    target = room_of(target_path)
    if target == room:
        return None
    if room == "rendezvous":
        return None if target == "core" else "rendezvous/ includes only core/ and itself"
    if is_backend(room) and is_backend(target):
        return "a backend never includes another backend"
    if room == "comm" and is_backend(target):
        return "comm/ never includes a backend"
    if target in {"core", "tensor"} or target_path in CONCEPT_HEADERS:
        return None
    if is_backend(room) and (target == "comm" or target in ENGINE_ROOMS.get(room, set())):
        return None
    return (f"{room}/ includes its own folder, core/, tensor/ and other rooms' concept headers "
            f"only")


def skipped(path):
    return path == "tandem.hpp"


def find_cycle(graph):
    """One circle of rooms as a list, or None (depth-first search, colours)."""
    colour = {}
    stack = []

    def visit(node):
        colour[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if colour.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if colour.get(nxt) is None:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        colour[node] = 2
        return None

    for node in sorted(graph):
        if colour.get(node) is None:
            found = visit(node)
            if found:
                return found
    return None


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "include", "tandem")
    root = os.path.normpath(root)
    headers = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            if name.endswith((".hpp", ".h", ".cuh")):
                full = os.path.join(dirpath, name)
                rel = os.path.relpath(full, root).replace(os.sep, "/")
                with open(full, encoding="utf-8") as f:
                    headers[rel] = f.read()
    if not headers:
        print(f"check_layout: no headers under {root}")
        return 1

    failures = []
    graph = {}
    lines = {}
    total = 0
    used_allowances = set()
    for path, text in sorted(headers.items()):
        if skipped(path):
            continue
        room = room_of(path)
        count = text.count("\n")
        lines[room] = lines.get(room, 0) + count
        total += count
        for target_path in INCLUDE.findall(text):
            target = room_of(target_path)
            if target != room:
                graph.setdefault(room, set()).add(target)
            if target_path not in headers:
                failures.append(f"{path} includes tandem/{target_path}, which does not exist")
                continue
            why = allowed(room, target_path)
            if why and (path, target_path) in ALLOWED:
                used_allowances.add((path, target_path))
            elif why:
                failures.append(f"{path} includes tandem/{target_path}: {why}")

    for including, included in sorted(set(ALLOWED) - used_allowances):
        failures.append(f"ALLOWED lists {including} -> {included}, which no longer breaks the "
                        f"rule: delete the entry")

    cycle = find_cycle(graph)
    if cycle:
        failures.append("a circle between rooms: " + " -> ".join(cycle))

    print(f"{'folder':<20}{'lines':>8}{'share':>9}")
    for room, count in sorted(lines.items(), key=lambda kv: -kv[1]):
        share = count / total
        print(f"{room + '/':<20}{count:>8}{share:>8.1%}")
        if share > MAX_SHARE:
            failures.append(f"{room}/ holds {share:.1%} of the library's lines (at most "
                            f"{MAX_SHARE:.0%})")
    print(f"{'all':<20}{total:>8}")

    for failure in failures:
        print("check_layout: " + failure)
    if failures:
        return 1
    print(f"check_layout: {len(headers)} headers, {len(lines)} rooms, the include rule holds "
          f"({len(ALLOWED)} allowed exceptions), no circle")
    return 0


if __name__ == "__main__":
    sys.exit(main())
