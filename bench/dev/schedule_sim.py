#!/usr/bin/env python3
"""Step times of upload schedules on a recorded resident timeline (bench/dev/room_bound.py
--json), against its room bound: what a schedule could reach on the device, with the link and
the compute as they are and every host cost left out.

Schedules (a unit is whole on the device while an interval that needs it runs; the link carries
one upload at a time at the measured rate; the budget holds the units' bytes):
  belady      no prefetch: a missing unit is uploaded when its interval comes (the farthest-used
              units make room), the compute waits for it
  conservative  after each interval starts, the next missing units are uploaded in order, each
              only into room whose victim is used after everything before the incoming unit's
              use (the plan policy's rule: no extra bytes)
  aggressive  the same, with victims used after the incoming unit itself (Cao et al.'s
              aggressive prefetching: more bytes, the link never idle while room can be made)

    python3 bench/dev/schedule_sim.py ROOM.json [--cycles 6]
"""
from __future__ import annotations

import argparse
import json
from typing import Dict, List, Tuple


def simulate(items: List[Tuple[float, List[int]]], sizes: Dict[int, int], room: int, bytes_per_ms: float,
             rule: str, cycles: int) -> Tuple[float, float]:
    """(ms of the last cycle, bytes uploaded in it)."""
    n = len(items)
    seq = [need for _, need in items]
    uses: Dict[int, List[int]] = {}
    for i, need in enumerate(seq):
        for u in need:
            uses.setdefault(u, []).append(i)

    def next_use(u: int, pos: int) -> int:
        """Absolute position of u's first use at or after absolute position pos."""
        c, i = divmod(pos, n)
        for j in uses[u]:
            if j >= i:
                return c * n + j
        return (c + 1) * n + uses[u][0]

    resident: Dict[int, float] = {}  # unit -> time its upload is done
    held = 0
    link_free = 0.0
    now = 0.0
    marks = []
    moved = 0

    def upload(u: int, start: float) -> float:
        nonlocal link_free, held, moved
        t0 = max(start, link_free)
        link_free = t0 + sizes[u] / bytes_per_ms
        resident[u] = link_free
        held += sizes[u]
        moved += sizes[u]
        return link_free

    def make_room(need: int, pos: int, keep: set, floor: int) -> bool:
        """Evict farthest-used units (not in keep, next use beyond floor) until need bytes fit."""
        nonlocal held
        while held + need > room:
            cands = [(next_use(v, pos), v) for v in resident if v not in keep]
            cands = [c for c in cands if c[0] > floor]
            if not cands:
                return False
            _, v = max(cands)
            held -= sizes[v]
            del resident[v]
        return True

    for pos in range(cycles * n):
        if pos % n == 0:
            marks.append((now, moved))
        need = set(seq[pos % n])
        ready = now
        for u in need:
            if u not in resident:
                if not make_room(sizes[u], pos, need, pos):
                    raise RuntimeError("a unit does not fit")
                upload(u, now)
            ready = max(ready, resident[u])
        now = ready
        if rule != "belady":
            floor = pos  # the latest next use of what runs between now and the incoming unit's use
            for ahead in range(pos + 1, pos + n):
                stop = False
                for u in seq[ahead % n]:
                    if u in resident or u in need:
                        continue
                    bar = max(floor, ahead) if rule == "conservative" else ahead
                    if not make_room(sizes[u], pos + 1, need, bar):
                        stop = True
                        break
                    upload(u, now)
                if stop:
                    break
                for u in seq[ahead % n]:
                    floor = max(floor, next_use(u, ahead + 1))
        now += items[pos % n][0]
    marks.append((now, moved))
    (t0, m0), (t1, m1) = marks[-2], marks[-1]
    return t1 - t0, m1 - m0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("json")
    ap.add_argument("--cycles", type=int, default=6)
    args = ap.parse_args()
    for r in json.load(open(args.json)):
        items = [(ms, need) for ms, need in r["timeline"]]
        sizes = {int(k): v for k, v in r["sizes"].items()}
        room = r["budget"] - r["top_bytes"]
        bpm = r["link_gbps"] * 1e6
        print(f"{r['model']} at {r['budget'] / 2**30:.2f} GiB: resident {r['resident_ms']:.1f} ms, simple bound "
              f"{r['simple_bound_ms']:.1f}, room bound {r['room_bound_ms']:.1f}")
        for rule in ("belady", "conservative", "aggressive"):
            ms, moved = simulate(items, sizes, room, bpm, rule, args.cycles)
            print(f"  {rule:12} {ms:7.1f} ms ({ms / r['room_bound_ms']:.3f}x the room bound), "
                  f"{moved / 2**30:.2f} GiB a step")


if __name__ == "__main__":
    main()
