"""Under `spillway run --budget "0:A;1:B"`: PyTorch (default allocator) fills each device with
256 MiB tensors until the interposer refuses; prints one RESULT line with the bytes reached per
device (each device must stop at its own budget)."""
import json

import torch

out = {}
for d in range(torch.cuda.device_count()):
    keep = []
    try:
        while len(keep) < 400:
            keep.append(torch.empty(256 << 20, dtype=torch.uint8, device=f"cuda:{d}"))
        err = None
    except torch.OutOfMemoryError as e:
        err = str(e).splitlines()[0][:200]
    out[d] = dict(reached=len(keep) * (256 << 20), error=err)
    del keep
    torch.cuda.empty_cache()
print("RESULT " + json.dumps(out), flush=True)
