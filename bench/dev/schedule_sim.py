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
  split-K     a fixed set stays resident, spread evenly over the step; the other units stream
              in their order of use through room for K of the largest, each upload starting as
              soon as the link is free and the room holds it (the units it replaces released)

    PYTHONPATH=$PWD/python python3 bench/dev/schedule_sim.py ROOM.json [--resident-ms sdxl=60.7]
"""
from __future__ import annotations

import argparse
from typing import Dict, List, Tuple

from room_bound import best_division, saved_cases  # same directory


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


def order_of_use(items: List[Tuple[float, List[int]]]) -> Tuple[List[int], Dict[int, int]]:
    """(units in order of first use, unit -> index of its last interval)."""
    order: List[int] = []
    last: Dict[int, int] = {}
    for i, (_, need) in enumerate(items):
        for u in need:
            if u not in last:
                order.append(u)
            last[u] = i
    return order, last


def spread(order: List[int], sizes: Dict[int, int], room: int, forced: frozenset = frozenset()) -> set:
    """The split's fixed set: `forced`, then units in order of first use, each earning its share of
    the fixed bytes left and fixed once that covers it (spread evenly over the step)."""
    rest = [u for u in order if u not in forced]
    free = room - sum(sizes[u] for u in forced)
    frac = max(free, 0) / max(sum(sizes[u] for u in rest), 1)
    fixed, acc = set(forced), 0.0
    for u in rest:
        acc += frac * sizes[u]
        if acc >= sizes[u]:
            fixed.add(u)
            acc -= sizes[u]
    return fixed


def stream(items: List[Tuple[float, List[int]]], sizes: Dict[int, int], fixed: set, room: int,
           bytes_per_ms: float, cycles: int) -> Tuple[float, float]:
    """(ms of the last cycle, bytes uploaded in it): `fixed` stays resident, the other units stream
    in their order of use through `room` bytes, each upload starting as soon as the link is free
    and the room holds it (the units it replaces released). RuntimeError where a streamed unit
    does not fit the room."""
    order, last = order_of_use(items)
    streamed = [u for u in order if u not in fixed]
    if streamed and max(sizes[u] for u in streamed) > room:
        raise RuntimeError("a streamed unit does not fit its room")
    uploads = [(c, u) for c in range(cycles) for u in streamed]
    index = {key: j for j, key in enumerate(uploads)}
    ready: List[float] = []  # upload j done (the link takes them one after another)
    release: Dict[int, float] = {}  # upload j's unit released (its last use in its cycle done)

    def ensure(j: int) -> None:
        while len(ready) <= j:
            m = len(ready)
            tot, p = sizes[uploads[m][1]], m - 1
            while p >= 0 and tot + sizes[uploads[p][1]] <= room:  # the room holds m with these
                tot += sizes[uploads[p][1]]
                p -= 1
            start = max(ready[-1] if ready else 0.0, release[p] if p >= 0 else 0.0)
            ready.append(start + sizes[uploads[m][1]] / bytes_per_ms)

    now, marks = 0.0, []
    for c in range(cycles):
        marks.append(now)
        for i, (ms, need) in enumerate(items):
            t = now
            for u in need:
                if u not in fixed:
                    j = index[(c, u)]
                    ensure(j)
                    t = max(t, ready[j])
            now = t + ms
            for u in need:
                if u not in fixed and last[u] == i:
                    release[index[(c, u)]] = now
    marks.append(now)
    return marks[-1] - marks[-2], float(sum(sizes[u] for u in streamed))


def split(items: List[Tuple[float, List[int]]], sizes: Dict[int, int], budget: int, bytes_per_ms: float,
          k: int, cycles: int) -> Tuple[float, float]:
    """(ms of the last cycle, bytes uploaded in it) of the static split with room for k units."""
    order, _ = order_of_use(items)
    room = k * max(sizes[u] for u in order)
    fixed = spread(order, sizes, budget - room)
    return stream(items, sizes, fixed, budget - sum(sizes[u] for u in fixed), bytes_per_ms, cycles)


def split_below(items: List[Tuple[float, List[int]]], sizes: Dict[int, int], budget: int, bytes_per_ms: float,
                k: int, cycles: int) -> Tuple[float, float, int]:
    """The static split whose streamed units are all at most a size T: every larger unit fixed,
    room for k units of size T, the rest spread; the fastest T. (ms, bytes, T)."""
    order, _ = order_of_use(items)
    best = None
    for t in sorted({sizes[u] for u in order}):
        forced = frozenset(u for u in order if sizes[u] > t)
        if sum(sizes[u] for u in forced) + k * t > budget:
            continue
        fixed = spread(order, sizes, budget - k * t, forced)
        try:
            ms, moved = stream(items, sizes, fixed, budget - sum(sizes[u] for u in fixed), bytes_per_ms, cycles)
        except (RuntimeError, KeyError):
            continue
        if best is None or ms < best[0]:
            best = (ms, moved, t)
    if best is None:
        raise RuntimeError("no size fits")
    return best


def searched(items: List[Tuple[float, List[int]]], sizes: Dict[int, int], budget: int, bytes_per_ms: float,
             cycles: int, start: set, tries: int, seed: int = 0) -> Tuple[float, float]:
    """A fixed set improved from `start` by random swaps, adds and drops (each kept if the step
    gets faster): how far a better choice of fixed set could go. (ms, bytes)."""
    import random
    rnd = random.Random(seed)
    order, _ = order_of_use(items)

    def cost(f: set) -> Tuple[float, float]:
        room = budget - sum(sizes[u] for u in f)
        if room < 0:
            raise RuntimeError("over")
        return stream(items, sizes, f, room, bytes_per_ms, 3)

    cur = set(start)
    cur_ms = cost(cur)[0]
    for _ in range(tries):
        f = set(cur)
        a = [u for u in order if u not in f]
        op = rnd.random()
        if op < 0.4 and a:
            f.add(rnd.choice(a))
        elif op < 0.6 and f:
            f.discard(rnd.choice(sorted(f)))
        elif a and f:
            f.discard(rnd.choice(sorted(f)))
            f.add(rnd.choice(a))
        try:
            ms = cost(f)[0]
        except (RuntimeError, KeyError):
            continue
        if ms < cur_ms:
            cur, cur_ms = f, ms
    return stream(items, sizes, cur, budget - sum(sizes[u] for u in cur), bytes_per_ms, cycles)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("json")
    ap.add_argument("--cycles", type=int, default=6)
    ap.add_argument("--search", type=int, default=0, help="also a fixed set searched by this many random moves")
    ap.add_argument("--resident-ms", default="", help="MODEL=MS,...: each timeline scaled to that resident step")
    ap.add_argument("--dump", default="", help="MODEL=FILE: write that case's (scaled) timeline as text for "
                    "bench/dev/sim_units.c -t, and simulate nothing")
    args = ap.parse_args()
    for c in saved_cases(args.json, args.resident_ms):
        r, sizes, room, bpm, simple = c.record, c.sizes, c.room, c.bytes_per_ms, c.simple
        items = [(ms, sorted(need)) for ms, need in c.items]
        if args.dump:
            model, path = args.dump.split("=", 1)
            if r["model"] == model:
                with open(path, "w") as f:
                    f.write(f"room {room}\nlink {bpm}\n")
                    f.writelines(f"size {sizes[u]}\n" for u in range(len(sizes)))
                    f.writelines(f"item {ms} {' '.join(map(str, need))}\n" for ms, need in items)
            continue
        bound = best_division(c.items, sizes, room, bpm, 48)[0]
        print(f"{r['model']} at {r['budget'] / 2**30:.2f} GiB: resident {c.resident:.1f} ms, simple bound "
              f"{simple:.1f}, room bound {bound:.1f}")
        runs = [(rule, lambda rule=rule: simulate(items, sizes, room, bpm, rule, args.cycles))
                for rule in ("belady", "conservative", "aggressive")]
        runs += [(f"split-{k}", lambda k=k: split(items, sizes, room, bpm, k, args.cycles)) for k in (2, 3, 4)]
        runs += [(f"below-{k}", lambda k=k: split_below(items, sizes, room, bpm, k, args.cycles)[:2]) for k in (1.25, 2, 3)]
        if args.search:
            order, _ = order_of_use(items)
            start = spread(order, sizes, room - 2 * max(sizes.values()))
            runs.append(("searched", lambda: searched(items, sizes, room, bpm, args.cycles, start, args.search)))
        for name, run in runs:
            try:
                ms, moved = run()
            except RuntimeError as e:
                print(f"  {name:12} not possible ({e})")
                continue
            except KeyError:  # an upload waits for the release of a unit used after it
                print(f"  {name:12} not possible (its room cannot hold a unit used in two places)")
                continue
            print(f"  {name:12} {ms:7.1f} ms ({ms / bound:.3f}x the room bound, {ms / simple:.3f}x the simple one), "
                  f"{moved / 2**30:.2f} GiB a step")


if __name__ == "__main__":
    main()
