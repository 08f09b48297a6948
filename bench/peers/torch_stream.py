#!/usr/bin/env python3
"""PyTorch peers of `spillway bench stream`, same shapes: 32 bf16 layers of 8192 x 8192 (4 GiB)
held in host memory, a chain of products x = x @ W at batch 16, the host waiting for each pass.

  resident        all weights on the device: the compute floor
  double buffer   weights in pinned host memory, two device slots, the next layer copied on a
                  side stream while the current one multiplies, events between: the hand-written
                  version that issue 3 names (78 ms on the H200)
  sync .to()      pageable host weights, W.to('cuda') before each product: what accelerate's
                  cpu_offload hooks do (591 ms in issue 3)

Prints ms per pass (median of the passes after the first), GB/s of weights moved, and the ratio
to the link bound (4 GiB / the pinned host-to-device rate measured here, 1 GiB, best of 3).
Every result is checked bitwise against the resident chain (same kernels, same data).
    python3 bench/peers/torch_stream.py
"""
import statistics
import sys
import time

import torch

L, K, BATCH, PASSES = 32, 8192, 16, 10
dev = torch.device("cuda")
bf16 = torch.bfloat16


def timed(run):
    times, out = [], None
    for _ in range(PASSES):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = run()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times[1:]), out


def main():
    g = torch.Generator().manual_seed(1)
    base = torch.randn(K, K, generator=g) / K**0.5
    host = [(base.roll(l, dims=1) * (1 + l / 64)).to(bf16) for l in range(L)]  # pageable
    pinned = [w.pin_memory() for w in host]
    x0 = torch.randn(BATCH, K, generator=g).to(bf16).to(dev)
    model_bytes = sum(w.numel() * w.element_size() for w in host)

    buf = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
    dbuf = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    best = float("inf")
    for _ in range(4):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dbuf.copy_(buf, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    link_gbps = (1 << 30) / best / 1e9
    del dbuf
    bound_ms = model_bytes / (link_gbps * 1e6)

    resident_w = [w.to(dev) for w in pinned]

    def resident():
        x = x0
        for w in resident_w:
            x = x @ w
        return x

    res_ms, ref = timed(resident)
    del resident_w
    torch.cuda.empty_cache()

    slots = [torch.empty(K, K, dtype=bf16, device=dev) for _ in range(2)]
    side = torch.cuda.Stream()
    ready = [torch.cuda.Event() for _ in range(2)]
    free = [torch.cuda.Event() for _ in range(2)]

    def double_buffer():
        cur = torch.cuda.current_stream()
        with torch.cuda.stream(side):
            side.wait_event(free[0])
            slots[0].copy_(pinned[0], non_blocking=True)
            ready[0].record(side)
        x = x0
        for l in range(L):
            s = l % 2
            if l + 1 < L:
                n = (l + 1) % 2
                with torch.cuda.stream(side):
                    side.wait_event(free[n])  # the product that last read slot n is done
                    slots[n].copy_(pinned[l + 1], non_blocking=True)
                    ready[n].record(side)
            cur.wait_event(ready[s])
            x = x @ slots[s]
            free[s].record(cur)
        return x

    def sync_to():
        x = x0
        for w in host:
            x = x @ w.to(dev)
        return x

    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, {L} layers of {K}x{K} bf16 "
          f"({model_bytes / 2**30:.2f} GiB), batch {BATCH}")
    print(f"link {link_gbps:.1f} GB/s pinned host to device; link bound {bound_ms:.2f} ms per pass")
    print(f"{'variant':<16}{'ms/pass':>10}{'GB/s':>8}{'vs link':>9}  result")
    print(f"{'resident':<16}{res_ms:>10.2f}{'':>8}{'':>9}  reference")
    ok = True
    for name, fn in (("double buffer", double_buffer), ("sync .to()", sync_to)):
        ms, out = timed(fn)
        diff = (out.float() - ref.float()).abs().max().item()
        ok &= diff <= 1e-2 * ref.float().abs().max().item()
        print(f"{name:<16}{ms:>10.2f}{model_bytes / (ms * 1e6):>8.1f}{bound_ms / ms:>9.3f}  "
              f"{'bitwise equal' if torch.equal(out, ref) else f'max abs diff {diff:.3g}'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
