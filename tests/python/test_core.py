"""The ctypes layer and the object API, on the emu backend (no torch needed)."""
from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import spillway
from spillway import _lib

REPO = Path(__file__).resolve().parents[2]
HEADER = (REPO / "include" / "spillway.h").read_text()
#: Every public header of libspillway: spillway.h and the PyTorch entry points' spillway_torch.h.
HEADERS = HEADER + (REPO / "include" / "spillway_torch.h").read_text()
MiB = 1 << 20


def emu(**kw):
    kw.setdefault("budget", "16MiB")
    return spillway.Context(backend="emu", from_env=False, **kw)


# ---- the header and the ctypes declarations agree ----

def test_stat_list_matches_header():
    block = re.search(r"#define SPW_STAT_LIST\(X\)(.*?)\n\n", HEADER, re.S).group(1)
    names = re.findall(r"X\((\w+),\s*[01],", block)
    assert len(names) > 20
    assert tuple(names) == _lib.STAT_NAMES
    fields = [f[0] for f in _lib.Stats._fields_]
    assert fields == list(names) + ["budget", "largest_free_block", "page", "budget_usable"]


def test_every_public_function_declared():
    declared = set(re.findall(r"SPW_API\s+[\w\s\*]*?\b(spw_\w+)\s*\(", HEADERS))
    assert len(declared) > 30
    assert declared == set(_lib.FUNCTION_NAMES)
    for name in declared:
        fn = getattr(_lib.lib, name)
        assert fn.argtypes is not None, name


def test_status_enum_matches_header():
    body = re.search(r"typedef enum spw_status \{(.*?)\} spw_status;", HEADER, re.S).group(1)
    names = re.findall(r"^\s*SPW_(\w+)", body, re.M)
    assert names[-1] == "STATUS_COUNT_"
    assert names[:-1] == [s.name for s in _lib.Status]
    for s in _lib.Status:
        assert _lib.status_name(s) == "SPW_" + s.name


def test_each_status_has_its_exception():
    classes = set()
    for s in _lib.Status:
        if s == _lib.Status.OK:
            continue
        err = spillway.errors.error_for(s, "msg")
        assert isinstance(err, spillway.Error) and err.status == s and str(err) == "msg"
        classes.add(type(err))
    assert len(classes) == len(_lib.Status) - 1
    assert issubclass(spillway.ConfigError, ValueError)
    assert issubclass(spillway.OutOfMemoryError, MemoryError)


# ---- library lookup ----

def _run(code: str, **env):
    e = {k: v for k, v in os.environ.items() if k != "SPILLWAY_LIBRARY"}
    e.update(env)
    return subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True)


def test_library_env_var_missing_file_is_named():
    r = _run("import spillway", SPILLWAY_LIBRARY="/nonexistent/libspillway.so")
    assert r.returncode != 0
    assert "SPILLWAY_LIBRARY='/nonexistent/libspillway.so' does not exist" in r.stderr


def test_library_found_in_build_tree_without_env():
    r = _run("import spillway; print(spillway.library_path)")
    if (REPO / "build" / "libspillway.so.0").exists():
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == str(REPO / "build" / "libspillway.so.0")
    else:  # another build directory: the error must say where it looked
        assert r.returncode == 0 or str(REPO / "build") in r.stderr


def test_version():
    assert spillway.__version__ == re.search(r'SPW_VERSION_STRING "([^"]+)"', HEADER).group(1)


# ---- sizes and configuration ----

def test_parse_size():
    assert spillway.parse_size("6GiB") == 6 << 30
    assert spillway.parse_size("512M") == 512 * MiB
    assert spillway.parse_size(4096) == 4096
    with pytest.raises(spillway.ConfigError, match="bad size 'lots'"):
        spillway.parse_size("lots")
    with pytest.raises(spillway.InvalidArgument):
        spillway.parse_size(-1)


def test_context_options_and_budget():
    with emu(budget="8MiB", policy="plan") as ctx:
        assert ctx.backend == "emu"
        assert ctx.budget == 8 * MiB
        assert ctx.options["policy"] == "plan"
    with pytest.warns(UserWarning, match=r"whole 2\.00 MiB pages, so of the budget 3\.00 MiB they can use only 2\.00 MiB") as w:
        ctx = emu(budget=3 * MiB)
    assert w[0].filename == __file__  # the caller's line, not the package's
    with ctx:
        assert ctx.budget == 3 * MiB
        st = ctx.stats()
        assert (st["page"], st["budget_usable"]) == (2 * MiB, 2 * MiB)
        text = ctx.summary()
        assert "budget 3.00 MiB, rounded down to 2.00 MiB: whole 2.00 MiB pages" in text
        assert "warning: the arenas hold whole 2.00 MiB pages, so 1.00 MiB of the 3.00 MiB budget (33.3%)" in text
        assert ctx.summary_json()["budget_usable"] == 2 * MiB
        with pytest.raises(spillway.OutOfMemoryError, match=r"budget 3\.00 MiB \(3145728 B\), usable 2\.00 MiB \(whole 2\.00 MiB pages\)"):
            ctx.malloc(3 * MiB)
    assert ctx.closed
    ctx.close()  # idempotent
    # rounding that loses at most 1% is said in the summary, without a warning
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with emu(budget=200 * MiB + 1) as ctx:
            text = ctx.summary()
            assert "rounded down to 200.00 MiB" in text and "warning" not in text


def test_config_errors_carry_the_message():
    with pytest.raises(spillway.ConfigError, match=r"unknown option 'colour'.*known: budget"):
        emu(colour="red")
    with pytest.raises(spillway.ConfigError, match=r"option 'budget'.*unknown unit 'XB'"):
        emu(budget="12XB")
    with pytest.raises(spillway.ConfigError, match=r"option 'policy'"):
        emu(policy="fifo")
    with pytest.raises(spillway.ConfigError, match="budget"):
        emu(budget=[1])


def test_config_object():
    with spillway.Config(from_env=False) as cfg:
        cfg.set("budget", "1GiB")
        assert cfg.get("budget") == str(1 << 30)
        cfg.parse("policy=plan,prefetch=on")
        assert cfg.get("prefetch") == "on"
        with pytest.raises(spillway.ConfigError):
            cfg.parse("policy=plan,nonsense=1")
        assert cfg.get("policy") == "plan"
    assert "budget" in spillway.options_help()


# ---- buffers ----

def test_buffer_round_trip_and_device_copy():
    with emu() as ctx:
        buf = ctx.buffer(3 * 4096)
        assert buf.size == len(buf) == 3 * 4096
        payload = bytes(range(256)) * 16
        buf.write(payload, offset=4096)
        assert buf.read(4096, offset=4096) == payload
        assert buf.read(16) == bytes(16)  # created zero-filled
        with buf.acquired("r") as dev:
            ctx.synchronize()
            assert ctx.stats()["pinned"]["current"] > 0
            # emu device memory is host memory: the upload is visible at the device address
            assert ctypes.string_at(dev + 4096, 4096) == payload
        assert ctx.stats()["pinned"]["current"] == 0
        out = bytearray(4096)
        buf.read_into(out, 4096)
        assert bytes(out) == payload


def test_register_host_and_dirty_write_back():
    host = bytearray(b"\x01" * 8192)
    with emu() as ctx:
        buf = ctx.register_host(host)
        with buf.acquired("rw") as dev:
            ctx.synchronize()
            ctypes.memset(dev, 7, 100)
        buf.evict()  # dirty: written back to the caller's memory (asynchronously)
        assert buf.read(101) == b"\x07" * 100 + b"\x01"  # waits for the write-back
        assert host[:100] == b"\x07" * 100 and host[100] == 1
        assert ctx.stats()["evictions_dirty"]["total"] == 1
        with pytest.raises(spillway.InvalidArgument, match="read-only"):
            ctx.register_host(b"immutable")


def test_host_writes_window():
    host = bytearray(b"\x01" * 8192)
    with emu() as ctx:
        buf = ctx.register_host(host, read_only=False)
        with buf.acquired("r"):
            pass
        assert ctx.stats()["bytes_h2d"]["total"] == 8192
        with buf.host_writes():
            host[:8] = b"\x05" * 8  # the caller's in-place write
            buf.prefetch()  # moves nothing while open
            assert ctx.stats()["bytes_h2d"]["total"] == 8192
            with pytest.raises(spillway.StateError, match="open for host writes"):
                buf.acquire()
            with pytest.raises(spillway.StateError, match="open for host writes"):
                buf.host_begin()
        with pytest.raises(spillway.StateError, match="not open"):
            buf.host_end()
        with buf.acquired("r") as dev:
            ctx.synchronize()
            assert ctypes.string_at(dev, 9) == b"\x05" * 8 + b"\x01"  # uploaded again, the new bytes
        assert ctx.stats()["bytes_h2d"]["total"] == 2 * 8192


def test_read_only_buffer_refuses_write_access():
    with emu() as ctx:
        buf = ctx.buffer(4096, read_only=True)
        with pytest.raises(spillway.InvalidArgument, match="read-only"):
            buf.acquire("w")
        with pytest.raises(spillway.InvalidArgument, match="mode"):
            buf.acquire("x")


def test_double_release_and_destroy_errors():
    with emu() as ctx:
        buf = ctx.buffer(4096)
        buf.acquire()
        with pytest.raises(spillway.StateError, match="acquired"):
            buf.close()  # an acquired buffer cannot be destroyed
        buf.release()
        with pytest.raises(spillway.StateError, match="released twice"):
            buf.release()
        buf.close()
        buf.close()  # the Python object is idempotent
        with pytest.raises(spillway.StateError, match="closed"):
            buf.read(1)
        # the library itself reports a second destroy of the same handle
        h = ctypes.c_void_p()
        assert _lib.lib.spw_buf_create(ctx._handle, 64, 0, ctypes.byref(h)) == 0
        assert _lib.lib.spw_buf_destroy(h) == 0
        assert _lib.lib.spw_buf_destroy(h) == _lib.Status.ERR_STATE
        assert _lib.last_error()


def test_closing_the_context_orphans_its_buffers():
    ctx = emu()
    buf = ctx.buffer(4096)
    s = ctx.stream()
    ctx.close()
    with pytest.raises(spillway.StateError):
        buf.acquire()
    with pytest.raises(spillway.StateError):
        ctx.stats()
    buf.close()
    s.close()


def test_out_of_memory_names_the_numbers():
    with emu(budget="2MiB", on_exhaust="fail") as ctx:
        buf = ctx.buffer(3 * MiB)
        with pytest.raises(spillway.OutOfMemoryError, match=r"budget 2\.00 MiB") as info:
            buf.acquire()
        assert info.value.status == _lib.Status.ERR_OUT_OF_MEMORY
        assert ctx.stats()["ooms"]["total"] >= 1


def test_eviction_under_budget_and_steps():
    with emu(budget="4MiB", policy="lru") as ctx:
        bufs = [ctx.buffer(MiB + 1, read_only=True) for _ in range(4)]
        for _ in range(2):
            with ctx.step():
                for b in bufs:
                    with b.acquired():
                        pass
        st = ctx.stats()
        assert st["held"]["peak"] <= 4 * MiB
        assert st["evictions_clean"]["total"] > 0
        assert st["bytes_d2h"]["total"] == 0  # read-only: never written back
        bufs[0].prefetch()
        bufs[0].evict()
        bufs[0].discard()


def test_allocator_and_streams():
    with emu(budget="8MiB") as ctx:
        s = ctx.stream()
        p = ctx.malloc("1MiB", s)
        assert p and ctx.memory_allocated() >= MiB
        ctx.free(p, s)
        s.synchronize()
        ctx.empty_cache()
        assert ctx.max_memory_allocated() >= MiB
        assert ctx.memory_reserved() <= ctx.budget
        with pytest.raises(spillway.StateError, match="not a live allocation"):
            ctx.free(p, s)  # twice


def test_stats_summary_and_json():
    with emu() as ctx:
        b = ctx.buffer(1000)
        with b.acquired():
            pass
        st = ctx.stats()
        assert set(st) == set(_lib.STAT_NAMES) | {"budget", "largest_free_block", "page", "budget_usable"}
        assert st["bytes_h2d"] == {"current": 1000, "peak": 1000, "total": 1000}
        assert st["budget"] == 16 * MiB
        flat = ctx.memory_stats()
        assert flat["bytes_h2d.total"] == 1000
        text = ctx.summary()
        assert "backend emu" in text and "bytes_h2d" in text and "largest_free_block" in text
        # the same table; stall times are measured as the stream's events complete, in between
        steady = [ln for ln in text.splitlines() if "stall" not in ln]
        assert [ln for ln in ctx.memory_summary().splitlines() if "stall" not in ln] == steady
        js = ctx.summary_json()
        assert js["backend"] == "emu" and js["bytes_h2d"]["total"] == 1000
