#!/usr/bin/env python3
"""Host time of the calls on the offload hot path, on the GPU (medians of 20, microseconds):
the enqueue of a 128 MiB host-to-device copy from cudaHostRegister'ed memory (what spillway's
registered buffers use) and from cudaHostAlloc'ed memory (torch pin_memory); and spw_acquire +
spw_release through ctypes for a resident buffer (hit), a buffer prefetched earlier, and a miss
that evicts (the demand load of no-prefetch plan and of lru).
    SPILLWAY_LIBRARY=build/libspillway.so PYTHONPATH=python python3 bench/dev/acquire_cost.py
"""
import statistics
import time

import torch

import spillway

MIB = 1 << 20
N, SZ = 12, 128 * MIB
dev = torch.device("cuda")
s = torch.cuda.current_stream().cuda_stream


def med(f, n=20):
    ts = []
    for _ in range(n):
        t = time.perf_counter_ns()
        f()
        ts.append(time.perf_counter_ns() - t)
        torch.cuda.synchronize()
    return statistics.median(ts) / 1e3


dst = torch.empty(SZ, dtype=torch.uint8, device=dev)
pinned = torch.empty(SZ, dtype=torch.uint8).pin_memory()
pageable = torch.empty(SZ + 4096, dtype=torch.uint8)
reg = pageable[(-pageable.data_ptr()) % 4096:][:SZ]
rt = torch.cuda.cudart()
assert rt.cudaHostRegister(reg.data_ptr(), SZ, 0) == 0
print(f"copy_ enqueue, cudaHostAlloc'ed source:   {med(lambda: dst.copy_(pinned, non_blocking=True)):8.1f} us")
print(f"copy_ enqueue, cudaHostRegister'ed source: {med(lambda: dst.copy_(reg, non_blocking=True)):8.1f} us")
rt.cudaHostUnregister(reg.data_ptr())
del dst
# does the enqueue cost grow with the size of the copy?
for mib in (1, 16, 128, 512):
    n = mib * MIB
    d2 = torch.empty(n, dtype=torch.uint8, device=dev)
    h2 = torch.empty(n + 4096, dtype=torch.uint8)
    h2 = h2[(-h2.data_ptr()) % 4096:][:n]
    assert rt.cudaHostRegister(h2.data_ptr(), n, 0) == 0
    print(f"copy_ enqueue, registered, {mib:4d} MiB:      {med(lambda: d2.copy_(h2, non_blocking=True)):8.1f} us")
    rt.cudaHostUnregister(h2.data_ptr())
    del d2, h2
ev = torch.cuda.Event()
print(f"event record:                              {med(lambda: ev.record()):8.1f} us")
print(f"event query:                               {med(lambda: ev.query()):8.1f} us")
print(f"stream wait event:                         {med(lambda: torch.cuda.current_stream().wait_event(ev)):8.1f} us")

hosts = []
with spillway.Context(budget=f"{4 * SZ // MIB + 8}MiB", policy="lru", backend="cuda") as ctx:
    bufs = []
    for i in range(N):
        h = torch.full((SZ + 4096,), i, dtype=torch.uint8)
        h = h[(-h.data_ptr()) % 4096:][:SZ]
        hosts.append(h)
        bufs.append(ctx.register_host(h.data_ptr(), SZ, read_only=True))

    def touch(b):
        b.acquire("r", s)
        b.release(s)

    touch(bufs[0])
    print(f"acquire+release, resident (hit):           {med(lambda: touch(bufs[0])):8.1f} us")
    k = [1]

    def miss():
        k[0] = k[0] % (N - 1) + 1  # cycle through 11 buffers with room for 4: always a miss
        touch(bufs[k[0]])

    print(f"acquire+release, miss with eviction:       {med(miss, 40):8.1f} us")

    def prefetched():
        k[0] = k[0] % (N - 1) + 1
        bufs[k[0]].prefetch(s)
        torch.cuda.synchronize()
        t = time.perf_counter_ns()
        touch(bufs[k[0]])
        return time.perf_counter_ns() - t

    ts = [prefetched() for _ in range(20)]
    print(f"acquire+release, prefetched and arrived:   {statistics.median(ts) / 1e3:8.1f} us")

    def prefetch_only():
        k[0] = k[0] % (N - 1) + 1
        bufs[k[0]].prefetch(s)

    print(f"prefetch of a missing buffer (evicting):   {med(prefetch_only, 40):8.1f} us")
