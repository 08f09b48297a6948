"""Lets diffusers' model classes import and run on Debian's CPU torch 1.13, for the emu runs of
bench/dev/diffusers_zoo.py. Debian has neither huggingface_hub, safetensors nor tqdm, and
torch 1.13 lacks names diffusers touches at import (torch.xpu, float8 dtypes, nn.RMSNorm,
F.scaled_dot_product_attention, ...). install() puts permissive stand-ins in their place: enough
to build a model from a config and call its forward, nothing that loads or saves a checkpoint.
Only a development aid: no test or benchmark of the GPU machine goes through it."""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import inspect
import math
import sys
import types

_MISSING = ("huggingface_hub", "safetensors", "tqdm")
_VALUES = {"HF_HOME": "/tmp/hf", "HUGGINGFACE_HUB_CACHE": "/tmp/hf/hub", "HF_HUB_CACHE": "/tmp/hf/hub",
           "HF_MODULES_CACHE": "/tmp/hf/modules", "HF_TOKEN_PATH": "/tmp/hf/token", "HF_HUB_OFFLINE": True,
           "HF_HUB_DISABLE_TELEMETRY": True, "ENDPOINT": "http://localhost", "DEFAULT_REVISION": "main",
           "HUGGINGFACE_CO_RESOLVE_ENDPOINT": "http://localhost", "REPO_TYPES": ["model"]}
_VERSIONS = {"huggingface-hub": "0.36.0", "huggingface_hub": "0.36.0", "safetensors": "0.5.0", "filelock": "3.9.0",
             "regex": "2022.10.31", "tqdm": "4.64.1", "importlib_metadata": "4.12", "importlib-metadata": "4.12"}


class _AnyMeta(type):
    """A class every attribute, call, subscript and union of which is itself: a decorator used
    as `@x` returns the function, a base class or annotation is accepted."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Any

    def __call__(cls, *a, **k):
        if len(a) == 1 and callable(a[0]) and not k:
            return a[0]
        return super().__call__()

    def __getitem__(cls, key):
        return cls

    def __or__(cls, other):
        return cls

    __ror__ = __or__


class _Any(Exception, metaclass=_AnyMeta):
    def __init__(self, *a, **k):
        pass

    def __getattr__(self, name):
        return _Any

    def __call__(self, *a, **k):
        return _Any

    def __iter__(self):
        return iter(())

    def __bool__(self):
        return False


class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name in _VALUES:
            return _VALUES[name]
        if name.startswith("__"):
            raise AttributeError(name)
        return _Any


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Stand-in modules: the packages Debian lacks (first on the path), and torch's submodules
    that 1.13 does not have (last: only what torch itself cannot find)."""

    def __init__(self, match):
        self.match = match

    def find_spec(self, name, path, target=None):
        return importlib.machinery.ModuleSpec(name, self, is_package=True) if self.match(name) else None

    def create_module(self, spec):
        m = _Module(spec.name)
        m.__path__ = []
        m.__version__ = "0.36.0"
        return m

    def exec_module(self, module):
        pass


class _Namespace(types.SimpleNamespace):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *a, **k: None


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    import torch
    s = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        r = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(r, dim=-3), value.repeat_interleave(r, dim=-3)
    w = (query @ key.transpose(-2, -1)) * s
    if is_causal:
        keep = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device).tril()
        w = w.masked_fill(keep.logical_not(), float("-inf"))
    if attn_mask is not None:
        w = w.masked_fill(attn_mask.logical_not(), float("-inf")) if attn_mask.dtype == torch.bool else w + attn_mask
    return w.softmax(-1) @ value


def _patch_torch() -> None:
    import torch
    import torch.distributed
    import torch.nn as nn
    import torch.nn.functional as F
    for name in ("xpu", "mps", "mtia"):
        if not hasattr(torch, name):
            setattr(torch, name, _Namespace(is_available=lambda: False, device_count=lambda: 0))
    if not hasattr(torch.backends, "mps"):
        torch.backends.mps = _Namespace(is_available=lambda: False)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "uint16", "uint32", "uint64"):
        if not hasattr(torch, name):
            setattr(torch, name, torch.uint8)
    if not hasattr(torch.distributed, "device_mesh"):
        torch.distributed.device_mesh = types.SimpleNamespace(DeviceMesh=object, init_device_mesh=None)
    if not hasattr(torch, "compiler"):
        torch.compiler = _Namespace(is_compiling=lambda: False, is_dynamo_compiling=lambda: False,
                                    disable=lambda fn=None, **k: fn if fn else (lambda g: g))
    if not hasattr(F, "scaled_dot_product_attention"):
        F.scaled_dot_product_attention = _sdpa
    if not hasattr(nn, "RMSNorm"):
        class RMSNorm(nn.Module):
            def __init__(self, normalized_shape, eps=None, elementwise_affine=True, device=None, dtype=None):
                super().__init__()
                self.normalized_shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
                self.eps = eps
                self.weight = nn.Parameter(torch.ones(self.normalized_shape, device=device, dtype=dtype)) \
                    if elementwise_affine else None

            def forward(self, x):
                eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
                y = x * torch.rsqrt(x.pow(2).mean(tuple(range(-len(self.normalized_shape), 0)), keepdim=True) + eps)
                return y * self.weight if self.weight is not None else y
        nn.RMSNorm = RMSNorm
    if "bias" not in inspect.signature(nn.LayerNorm.__init__).parameters:
        init = nn.LayerNorm.__init__

        def layer_norm(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True, device=None, dtype=None):
            init(self, normalized_shape, eps, elementwise_affine, device=device, dtype=dtype)
            if elementwise_affine and not bias:
                self.bias = None
        nn.LayerNorm.__init__ = layer_norm


def install() -> None:
    """Idempotent; call before importing diffusers."""
    if getattr(install, "done", False):
        return
    missing = {m for m in _MISSING if importlib.util.find_spec(m) is None}
    sys.meta_path.insert(0, _Finder(lambda n: n.split(".")[0] in missing))
    sys.meta_path.append(_Finder(lambda n: n.startswith("torch.")))
    real = importlib.metadata.version

    def version(name):
        try:
            return real(name)
        except importlib.metadata.PackageNotFoundError:
            if name in _VERSIONS:
                return _VERSIONS[name]
            raise
    importlib.metadata.version = version
    _patch_torch()
    install.done = True
