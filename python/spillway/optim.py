"""Host optimizer steps in C: Adam, AdamW and SGD over tensors in host memory, threaded and
vectorized, computing what torch.optim's single-tensor path (foreach=False) computes.

    import spillway.optim as so
    state_step += 1
    so.adamw_step(params, grads, exp_avgs, exp_avg_sqs, step=state_step, lr=1e-3)

Arrays are torch CPU tensors or numpy arrays: contiguous, fp32 (gradients may also be bf16 or
fp16), updated in place; one list entry per parameter, every list as long as params. The
writes bypass autograd's version counters, as optimizer updates under torch.no_grad() would
not need them. This module never imports torch; it reads the tensors it is given.

ctypes releases the GIL while the C step runs, so a step may run on a background thread while
the main thread goes on.
"""
from __future__ import annotations

import ctypes
import sys
from typing import Any, List, Optional, Sequence, Tuple, Union

from . import _lib
from .errors import InvalidArgument, check

__all__ = ["Pool", "adam_step", "adamw_step", "sgd_step", "isa", "torch_moment_formula", "keep_freed",
           "KEEP_FREED_MAX"]

ArrayLike = Any
Arrays = Union[ArrayLike, Sequence[ArrayLike]]

_TORCH_DTYPES = {
    "torch.float32": _lib.OPTIM_F32,
    "torch.bfloat16": _lib.OPTIM_BF16,
    "torch.float16": _lib.OPTIM_F16,
}
_NUMPY_DTYPES = {"<f4": _lib.OPTIM_F32, "<f2": _lib.OPTIM_F16}


class Pool:
    """A pool of threads for the steps (the calling thread included); threads=0: one per CPU
    this process may use. Steps given no pool share one such pool, started on first use.

        with spillway.optim.Pool(8) as pool:
            spillway.optim.adamw_step(..., pool=pool)
    """

    def __init__(self, threads: int = 0) -> None:
        if not isinstance(threads, int) or threads < 0:
            raise InvalidArgument(f"Pool: threads = {threads!r} (want an int >= 0)")
        handle = _lib.optim_pool_p()
        check(_lib.lib.spw_optim_pool_create(threads, ctypes.byref(handle)))
        self._handle: Optional[int] = handle.value

    @property
    def threads(self) -> int:
        """Threads a step runs on, the caller included."""
        return int(_lib.lib.spw_optim_pool_threads(self._handle)) if self._handle else 0

    @property
    def handle(self) -> Optional[int]:
        """The spw_optim_pool pointer (None once closed)."""
        return self._handle

    def close(self) -> None:
        """Stop the workers. Idempotent."""
        if self._handle:
            _lib.lib.spw_optim_pool_destroy(self._handle)
            self._handle = None

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

    def __repr__(self) -> str:
        return f"spillway.optim.Pool(threads={self.threads})" if self._handle else "spillway.optim.Pool(closed)"


def isa() -> str:
    """The instruction set the steps use on this CPU ("avx512", "avx2" or "generic")."""
    return _lib.lib.spw_optim_isa().decode()


#: keep_freed's largest size: 2 GiB less 1 MiB (spw_optim_keep_freed's bound; mallopt takes ints)
KEEP_FREED_MAX = (1 << 31) - 1 - (1 << 20)


def keep_freed(nbytes: int) -> int:
    """Keep freed host allocations of up to nbytes in the process's heap (glibc's mmap and trim
    thresholds, for the whole process), so that a host step spillway does not run itself, whose
    temporaries are the size of a parameter, reuses their pages instead of faulting them in on
    every step (spw_optim_keep_freed in spillway_optim.h). Returns the size now kept, which only
    grows over calls; 0 where the environment sets glibc's malloc thresholds itself, which stand.
    Raises InvalidArgument for 0 or above KEEP_FREED_MAX, UnsupportedError off glibc."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise InvalidArgument(f"keep_freed: nbytes = {nbytes!r} (want an int >= 1)")
    kept = ctypes.c_size_t(0)
    check(_lib.lib.spw_optim_keep_freed(nbytes, ctypes.byref(kept)))
    return int(kept.value)


def torch_moment_formula() -> str:
    """How the torch in this process updates Adam's first moment: "lerp" (torch 2) or
    "mul_add" (torch 1.x); "lerp" when torch is not imported."""
    torch = sys.modules.get("torch")
    version = getattr(torch, "__version__", "") if torch is not None else ""
    major = version.split(".", 1)[0]
    return "mul_add" if major.isdigit() and int(major) < 2 else "lerp"


def _as_list(x: Arrays, what: str) -> List[ArrayLike]:
    if isinstance(x, (list, tuple)):
        return list(x)
    if x is None:
        raise InvalidArgument(f"{what} is None")
    return [x]


def _array(x: ArrayLike, what: str, grad: bool = False) -> Tuple[int, int, int]:
    """(address, elements, dtype code) of a contiguous host array, checked."""
    if hasattr(x, "data_ptr") and hasattr(x, "is_contiguous"):  # a torch.Tensor
        if x.device.type != "cpu":
            raise InvalidArgument(f"{what} is on {x.device}: host steps need CPU tensors")
        if str(x.layout) != "torch.strided":
            raise InvalidArgument(f"{what} has layout {x.layout}: want a dense (strided) tensor")
        if not x.is_contiguous():
            raise InvalidArgument(f"{what} is not contiguous (strides {tuple(x.stride())})")
        code = _TORCH_DTYPES.get(str(x.dtype))
        n = x.numel()
        ptr = x.data_ptr() if n else 0
    elif hasattr(x, "__array_interface__"):  # numpy and friends
        ai = x.__array_interface__
        if ai.get("strides") is not None and not x.flags["C_CONTIGUOUS"]:
            raise InvalidArgument(f"{what} is not contiguous")
        if not grad and ai["data"][1]:
            raise InvalidArgument(f"{what} is read-only")
        code = _NUMPY_DTYPES.get(ai["typestr"])
        n = 1
        for d in ai["shape"]:
            n *= d
        ptr = ai["data"][0] if n else 0
    else:
        raise TypeError(f"{what}: want a torch CPU tensor or a numpy array, got {type(x).__name__}")
    if code is None or (not grad and code != _lib.OPTIM_F32):
        want = "float32, bfloat16 or float16" if grad else "float32"
        got = getattr(x, "dtype", None)
        raise InvalidArgument(f"{what} has dtype {got}: want {want}")
    return ptr, n, code


def _same_length(lists: Sequence[Tuple[str, List[ArrayLike]]]) -> int:
    count = len(lists[0][1])
    for name, lst in lists[1:]:
        if len(lst) != count:
            raise InvalidArgument(f"{name} has {len(lst)} entries, {lists[0][0]} has {count}")
    return count


def _pool_handle(pool: Optional[Pool]) -> Optional[int]:
    if pool is None:
        return None
    if not isinstance(pool, Pool):
        raise TypeError(f"pool: want a spillway.optim.Pool, got {type(pool).__name__}")
    if not pool.handle:
        raise InvalidArgument("pool is closed")
    return pool.handle


def _step_number(step: Any) -> int:
    if hasattr(step, "item"):  # torch's state["step"] is a 0-dim tensor
        step = step.item()
    if isinstance(step, float) and step.is_integer():
        step = int(step)
    if not isinstance(step, int) or isinstance(step, bool):
        raise InvalidArgument(f"step = {step!r}: want an integer >= 1")
    return step


# The optional outputs of an Adam step, in spw_adam_tensor's order.
_OUT_NAMES = ("params_out", "exp_avgs_out", "exp_avg_sqs_out", "max_exp_avg_sqs_out")


def _adam(
    fn_name: str,
    params: Arrays,
    grads: Arrays,
    exp_avgs: Arrays,
    exp_avg_sqs: Arrays,
    step: Any,
    lr: float,
    betas: Tuple[float, float],
    eps: float,
    weight_decay: float,
    max_exp_avg_sqs: Optional[Arrays],
    maximize: bool,
    moment: Optional[str],
    pool: Optional[Pool],
    out: Optional[Tuple[Arrays, Arrays, Arrays, Optional[Arrays]]] = None,
) -> None:
    lists = [
        ("params", _as_list(params, "params")),
        ("grads", _as_list(grads, "grads")),
        ("exp_avgs", _as_list(exp_avgs, "exp_avgs")),
        ("exp_avg_sqs", _as_list(exp_avg_sqs, "exp_avg_sqs")),
    ]
    if max_exp_avg_sqs is not None:
        lists.append(("max_exp_avg_sqs", _as_list(max_exp_avg_sqs, "max_exp_avg_sqs")))
    outs: List[Optional[List[ArrayLike]]] = [None, None, None, None]
    if out is not None:
        if len(out) != 4:
            raise InvalidArgument("out: want (params_out, exp_avgs_out, exp_avg_sqs_out, max_exp_avg_sqs_out)")
        for k, (name, o) in enumerate(zip(_OUT_NAMES, out)):
            if o is not None:
                outs[k] = _as_list(o, name)
                lists.append((name, outs[k]))
        if outs[3] is not None and max_exp_avg_sqs is None:
            raise InvalidArgument("max_exp_avg_sqs_out given without max_exp_avg_sqs")
    count = _same_length(lists)
    if moment is None:
        moment = torch_moment_formula()
    if moment not in ("lerp", "mul_add"):
        raise InvalidArgument(f"moment = {moment!r}: want 'lerp' (torch 2) or 'mul_add' (torch 1.x)")
    try:
        beta1, beta2 = betas
    except (TypeError, ValueError):
        raise InvalidArgument(f"betas = {betas!r}: want (beta1, beta2)") from None
    hp = _lib.AdamHparams(
        lr=float(lr),
        beta1=float(beta1),
        beta2=float(beta2),
        eps=float(eps),
        weight_decay=float(weight_decay),
        step=_step_number(step),
        flags=(_lib.ADAM_MAXIMIZE if maximize else 0)
        | (_lib.ADAM_MOMENT_MUL_ADD if moment == "mul_add" else 0),
    )
    arr = (_lib.AdamTensor * max(count, 1))()
    for i in range(count):
        p, n, _ = _array(lists[0][1][i], f"params[{i}]")
        g, gn, gdt = _array(lists[1][1][i], f"grads[{i}]", grad=True)
        m, mn, _ = _array(lists[2][1][i], f"exp_avgs[{i}]")
        v, vn, _ = _array(lists[3][1][i], f"exp_avg_sqs[{i}]")
        sizes = [("grads", gn), ("exp_avgs", mn), ("exp_avg_sqs", vn)]
        mx = None
        if max_exp_avg_sqs is not None:
            mx, xn, _ = _array(lists[4][1][i], f"max_exp_avg_sqs[{i}]")
            sizes.append(("max_exp_avg_sqs", xn))
        optr = [None, None, None, None]
        for k, (name, o) in enumerate(zip(_OUT_NAMES, outs)):
            if o is not None:
                optr[k], on, _ = _array(o[i], f"{name}[{i}]")
                sizes.append((name, on))
        for name, k in sizes:
            if k != n:
                raise InvalidArgument(f"{name}[{i}] has {k} elements, params[{i}] has {n}")
        arr[i] = _lib.AdamTensor(p, g, m, v, mx, n, gdt, *optr)
    fn = getattr(_lib.lib, fn_name)
    check(fn(_pool_handle(pool), ctypes.byref(hp), arr, count))


def _outs(*outs: Optional[Arrays]) -> Optional[Tuple[Arrays, Arrays, Arrays, Optional[Arrays]]]:
    return None if all(o is None for o in outs) else outs  # type: ignore[return-value]


def adamw_step(
    params: Arrays,
    grads: Arrays,
    exp_avgs: Arrays,
    exp_avg_sqs: Arrays,
    step: Any,
    *,
    lr: float = 1e-3,
    betas: Tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    max_exp_avg_sqs: Optional[Arrays] = None,
    maximize: bool = False,
    moment: Optional[str] = None,
    pool: Optional[Pool] = None,
    params_out: Optional[Arrays] = None,
    exp_avgs_out: Optional[Arrays] = None,
    exp_avg_sqs_out: Optional[Arrays] = None,
    max_exp_avg_sqs_out: Optional[Arrays] = None,
) -> None:
    """One torch.optim.AdamW update (decoupled weight decay) of every parameter, in place.

    step is the step count after this update (torch's state["step"] once incremented: 1 on
    the first), an int or a 0-dim tensor. Defaults are torch's. Giving max_exp_avg_sqs turns
    on amsgrad. moment picks the first-moment formula of torch 2 ("lerp") or 1.x ("mul_add");
    None follows the torch this process has imported. Raises spillway.InvalidArgument (a
    ValueError) on bad input, before anything is written.

    params_out, exp_avgs_out, exp_avg_sqs_out and max_exp_avg_sqs_out, each a list like
    params, receive the updated values instead of the inputs, which are then only read (an
    update computed ahead, to keep or drop); each is optional (None: that array in place).
    """
    _adam("spw_adamw_step", params, grads, exp_avgs, exp_avg_sqs, step, lr, betas, eps,
          weight_decay, max_exp_avg_sqs, maximize, moment, pool,
          _outs(params_out, exp_avgs_out, exp_avg_sqs_out, max_exp_avg_sqs_out))


def adam_step(
    params: Arrays,
    grads: Arrays,
    exp_avgs: Arrays,
    exp_avg_sqs: Arrays,
    step: Any,
    *,
    lr: float = 1e-3,
    betas: Tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    max_exp_avg_sqs: Optional[Arrays] = None,
    maximize: bool = False,
    moment: Optional[str] = None,
    pool: Optional[Pool] = None,
    params_out: Optional[Arrays] = None,
    exp_avgs_out: Optional[Arrays] = None,
    exp_avg_sqs_out: Optional[Arrays] = None,
    max_exp_avg_sqs_out: Optional[Arrays] = None,
) -> None:
    """One torch.optim.Adam update (weight decay added to the gradient); as adamw_step."""
    _adam("spw_adam_step", params, grads, exp_avgs, exp_avg_sqs, step, lr, betas, eps,
          weight_decay, max_exp_avg_sqs, maximize, moment, pool,
          _outs(params_out, exp_avgs_out, exp_avg_sqs_out, max_exp_avg_sqs_out))


def sgd_step(
    params: Arrays,
    grads: Arrays,
    momentum_buffers: Optional[Arrays] = None,
    *,
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    maximize: bool = False,
    first_step: bool = False,
    pool: Optional[Pool] = None,
) -> None:
    """One torch.optim.SGD update of every parameter, in place.

    With momentum, momentum_buffers holds one fp32 buffer per parameter; first_step=True says
    they hold nothing yet (torch's None): they are set to the gradient, as torch does.
    """
    lists = [("params", _as_list(params, "params")), ("grads", _as_list(grads, "grads"))]
    if momentum:
        if momentum_buffers is None:
            raise InvalidArgument(f"momentum = {momentum}: momentum_buffers are needed")
        lists.append(("momentum_buffers", _as_list(momentum_buffers, "momentum_buffers")))
    count = _same_length(lists)
    hp = _lib.SgdHparams(
        lr=float(lr),
        momentum=float(momentum),
        dampening=float(dampening),
        weight_decay=float(weight_decay),
        flags=(_lib.SGD_MAXIMIZE if maximize else 0)
        | (_lib.SGD_NESTEROV if nesterov else 0)
        | (_lib.SGD_FIRST_STEP if first_step else 0),
    )
    arr = (_lib.SgdTensor * max(count, 1))()
    for i in range(count):
        p, n, _ = _array(lists[0][1][i], f"params[{i}]")
        g, gn, gdt = _array(lists[1][1][i], f"grads[{i}]", grad=True)
        if gn != n:
            raise InvalidArgument(f"grads[{i}] has {gn} elements, params[{i}] has {n}")
        b = None
        if len(lists) == 3:
            b, bn, _ = _array(lists[2][1][i], f"momentum_buffers[{i}]")
            if bn != n:
                raise InvalidArgument(f"momentum_buffers[{i}] has {bn} elements, params[{i}] has {n}")
        arr[i] = _lib.SgdTensor(p, g, b, n, gdt)
    check(_lib.lib.spw_sgd_step(_pool_handle(pool), ctypes.byref(hp), arr, count))
