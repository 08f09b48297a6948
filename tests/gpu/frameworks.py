"""GPU acceptance checks of the interposer for Python frameworks, run by run_shim_tests.sh.

usage: frameworks.py torch-info BUDGET | torch-oom | torch-train | jax BUDGET | cupy-oom
Prints one result line; exit 0 pass, 1 fail, 77 when the framework is not installed.
"""
import sys

GiB = 1 << 30


def need(mod):
    try:
        return __import__(mod)
    except Exception as e:  # not installed, or no usable CUDA build
        print(f"SKIP: {mod} not importable: {e}")
        sys.exit(77)


def torch_info(budget):
    torch = need("torch")
    free, total = torch.cuda.mem_get_info()
    print(f"torch.cuda.mem_get_info: free {free} total {total}")
    sys.exit(0 if total == budget and 0 < free <= budget else 1)


def torch_oom():
    torch = need("torch")
    try:
        x = torch.empty(5 * GiB, dtype=torch.uint8, device="cuda")
        print(f"no error: a 5 GiB tensor was allocated ({x.numel()} B)")
        sys.exit(1)
    except torch.OutOfMemoryError as e:
        first = str(e).splitlines()[0]
        print(f"torch.OutOfMemoryError: {first}")
        sys.exit(0)
    except Exception as e:  # e.g. "unrecognized error code": the failure this shim exists to avoid
        print(f"wrong exception {type(e).__name__}: {e}")
        sys.exit(1)


def torch_train():
    torch = need("torch")
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)
    ).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 1024, generator=g).cuda()
    y = torch.randn(256, 1024, generator=g).cuda()
    for _ in range(5):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    torch.cuda.synchronize()
    print(f"loss {loss.item():.9e}")
    sys.exit(0)


def jax_check(budget):
    jax = need("jax")
    import jax.numpy as jnp

    x = jnp.ones((1024, 1024))
    s = float((x @ x).sum())
    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit", -1)
    print(f"jax {jax.__version__}: devices {jax.devices()}, sum {s}, bytes_limit {limit}")
    sys.exit(0 if 0 < limit <= budget and s == 1024.0 ** 3 else 1)


def cupy_oom():
    cupy = need("cupy")
    try:
        a = cupy.ones(3 * GiB, dtype=cupy.uint8)  # fits
        b = cupy.empty(2 * GiB, dtype=cupy.uint8)  # 5 GiB in all: past a 4 GiB budget
        print(f"no error: {a.nbytes + b.nbytes} B allocated")
        sys.exit(1)
    except cupy.cuda.memory.OutOfMemoryError as e:
        print(f"cupy.cuda.memory.OutOfMemoryError: {e}")
        sys.exit(0)
    except Exception as e:
        print(f"wrong exception {type(e).__name__}: {e}")
        sys.exit(1)


if __name__ == "__main__":
    mode = sys.argv[1]
    arg = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    {"torch-info": lambda: torch_info(arg), "torch-oom": torch_oom, "torch-train": torch_train,
     "jax": lambda: jax_check(arg), "cupy-oom": cupy_oom}[mode]()
