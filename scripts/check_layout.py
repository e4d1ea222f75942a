#!/usr/bin/env python3
"""Checks the rooms of include/tandem (docs/rooms.dox, DESIGN.md "Layout") and prints each
folder's share of the library's lines.

    python3 scripts/check_layout.py [include/tandem]     # exit 1 and say why when a rule breaks

A room is a folder; a backend folder under comm/ (comm/gloo/, ...) is a room of its own, and a
detail/ folder belongs to the room above it. The rules checked:
  - rendezvous/ includes only core/ and itself: the stores never need a communicator, and
    comm/init.hpp includes rendezvous/, so the other way would be a circle;
  - a backend (comm/<name>/) includes only comm/, core/, tensor/, rendezvous/, itself, and its
    engine's room (cuda/ for nccl); never another backend;
  - comm/ itself never includes a backend;
  - arena/ includes only core/ and tensor/; optim/, ema.hpp and amp/ never include ddp/;
  - core/ includes only itself, tensor/ only core/ and itself;
  - no circle between rooms;
  - no folder holds more than 25 % of the library's lines.
Forwarding headers (old paths kept for a release) and the umbrella headers are not rooms' code and
are skipped.
"""
import os
import re
import sys

MAX_SHARE = 0.25
INCLUDE = re.compile(r'^\s*#\s*include\s*"tandem/([^"]+)"', re.M)
BACKEND_ENGINE_ROOMS = {"comm/nccl": {"cuda"}}


def room_of(path):
    """'comm/gloo/detail/x.hpp' -> 'comm/gloo'; 'ema.hpp' -> 'ema'; 'comm/init.hpp' -> 'comm'."""
    parts = [p for p in path.split("/")[:-1] if p != "detail"]
    if not parts:
        return os.path.splitext(path)[0]
    if parts[0] == "comm" and len(parts) > 1:
        return "comm/" + parts[1]
    return parts[0]


def is_backend(room):
    return room.startswith("comm/")


def allowed(room, target):
    """None when `room` may include `target`, else the rule it breaks."""
    if target == room:
        return None
    if room == "rendezvous":
        return None if target == "core" else "rendezvous/ includes only core/ and itself"
    if is_backend(room):
        if is_backend(target):
            return "a backend never includes another backend"
        if target in {"comm", "core", "tensor", "rendezvous"}:
            return None
        if target in BACKEND_ENGINE_ROOMS.get(room, set()):
            return None
        return "a backend includes only comm/, core/, tensor/, rendezvous/ and its engine"
    if room == "comm" and is_backend(target):
        return "comm/ never includes a backend"
    if room == "arena" and target not in {"core", "tensor"}:
        return "arena/ includes only core/ and tensor/"
    if room in {"optim", "ema", "amp"} and target == "ddp":
        return "optim/, ema and amp/ use the arena, never ddp/"
    if room == "core":
        return "core/ includes only itself"
    if room == "tensor" and target != "core":
        return "tensor/ includes only core/ and itself"
    return None


def skipped(path, text):
    return path in {"tandem.hpp", "cuda.hpp"} or "DEPRECATED: forwards to" in text[:300]


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
    for path, text in sorted(headers.items()):
        if skipped(path, text):
            continue
        room = room_of(path)
        count = text.count("\n")
        lines[room] = lines.get(room, 0) + count
        total += count
        for target_path in INCLUDE.findall(text):
            target = room_of(target_path)
            if target != room:
                graph.setdefault(room, set()).add(target)
            why = allowed(room, target)
            if why:
                failures.append(f"{path} includes tandem/{target_path}: {why}")

    cycle = find_cycle(graph)
    if cycle:
        failures.append("a circle between rooms: " + " -> ".join(cycle))

    print(f"{'folder':<16}{'lines':>8}{'share':>9}")
    for room, count in sorted(lines.items(), key=lambda kv: -kv[1]):
        share = count / total
        print(f"{room + '/':<16}{count:>8}{share:>8.1%}")
        if share > MAX_SHARE:
            failures.append(f"{room}/ holds {share:.1%} of the library's lines (at most "
                            f"{MAX_SHARE:.0%})")
    print(f"{'all':<16}{total:>8}")

    for failure in failures:
        print("check_layout: " + failure)
    if failures:
        return 1
    print(f"check_layout: {len(headers)} headers, {len(lines)} rooms, rules hold, no circle")
    return 0


if __name__ == "__main__":
    sys.exit(main())
