"""The on-disk cache of the modules the library compiles itself (_kernels.cubin) and ``python -m cupy_rope
compile``: a second process gets the same bytes without compiling, anything that defines the binary keys it, a
damaged file is compiled again, and a cache that cannot be written or is turned off costs a compile, never an
error. NVRTC alone (the small util module for sm_80): runs in CI on a CPU-only machine."""
from __future__ import annotations

import numpy as np
import pytest

from cupy_rope import __main__ as M
from cupy_rope import _kernels as K

MOD, ARCH = "util", "sm_80"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh cache folder, and a count of the compiles made through compile_for_arch."""
    monkeypatch.setenv("CUPY_ROPE_CACHE_DIR", str(tmp_path / "c"))
    calls = []
    real = K.compile_for_arch

    def counted(module, arch="sm_90", options=K.OPTIONS):
        calls.append((module, arch, tuple(options)))
        return real(module, arch, options)

    monkeypatch.setattr(K, "compile_for_arch", counted)
    return tmp_path / "c", calls


def test_second_call_reads_the_file(cache):
    root, calls = cache
    a = K.cubin(MOD, ARCH)
    assert len(calls) == 1
    files = list(root.iterdir())
    assert [f.name for f in files] == [K.cache_path(MOD, ARCH).name]
    b = K.cubin(MOD, ARCH)
    assert len(calls) == 1 and a == b
    assert files[0].read_bytes().startswith(K.CACHE_MAGIC) and files[0].read_bytes().endswith(a)


def test_key_covers_source_arch_options_and_nvrtc(monkeypatch):
    base = K.cache_key(MOD, ARCH)
    assert K.cache_key(MOD, "sm_90") != base
    assert K.cache_key(MOD, ARCH, K.OPTIONS + ("-DX=1",)) != base
    assert K.cache_key("rope", ARCH) != base
    from cupy_backends.cuda.libs import nvrtc

    v = nvrtc.getVersion()
    monkeypatch.setattr(nvrtc, "getVersion", lambda: (v[0], v[1] + 1))
    assert K.cache_key(MOD, ARCH) != base
    monkeypatch.setattr(nvrtc, "getVersion", lambda: v)
    text = K.source(MOD)
    monkeypatch.setattr(K, "source", lambda m: text + "\n// one more line\n" if m == MOD else text)
    assert K.cache_key(MOD, ARCH) != base


@pytest.mark.parametrize("damage", ["flip", "cut", "magic", "empty"])
def test_damaged_file_is_compiled_again(cache, damage):
    root, calls = cache
    good = K.cubin(MOD, ARCH)
    path = K.cache_path(MOD, ARCH)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-100] ^= 0x40
    elif damage == "cut":
        data = data[: len(data) // 2]
    elif damage == "magic":
        data[0] ^= 1
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    assert K.cubin(MOD, ARCH) == good
    assert len(calls) == 2
    assert path.read_bytes().endswith(good)  # rewritten whole
    assert K.cubin(MOD, ARCH) == good and len(calls) == 2


def test_cache_off_compiles_every_time(cache, monkeypatch):
    root, calls = cache
    monkeypatch.setenv("CUPY_ROPE_CACHE_DIR", "")
    assert K.cache_dir() is None and K.cache_path(MOD, ARCH) is None
    a, b = K.cubin(MOD, ARCH), K.cubin(MOD, ARCH)
    assert a == b and len(calls) == 2 and not root.exists()


def test_unwritable_cache_still_returns_the_module(cache, monkeypatch, tmp_path):
    root, calls = cache
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("CUPY_ROPE_CACHE_DIR", str(blocker / "sub"))
    a = K.cubin(MOD, ARCH)
    assert len(calls) == 1 and a[:4] == b"\x7fELF"
    assert blocker.read_text() == "not a folder"


def test_default_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("CUPY_ROPE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert K.cache_dir() == tmp_path / "cupy_rope"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert K.cache_dir() == tmp_path / "home" / ".cache" / "cupy_rope"


def test_no_home_directory_turns_the_cache_off(cache, monkeypatch):
    """A process with no home directory to find (no HOME, no password entry) compiles without a cache instead
    of failing every launch."""
    import pathlib

    root, calls = cache

    def no_home(*args):
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv("CUPY_ROPE_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(pathlib.Path, "home", classmethod(no_home))
    monkeypatch.setattr(pathlib.Path, "expanduser", no_home)
    assert K.cache_dir() is None
    monkeypatch.setenv("CUPY_ROPE_CACHE_DIR", "~/cubins")
    assert K.cache_dir() is None
    a, b = K.cubin(MOD, ARCH), K.cubin(MOD, ARCH)
    assert a == b and len(calls) == 2


def test_compile_command_fills_the_cache_once(cache, monkeypatch, capsys):
    """``compile --jobs 1`` runs in this process: its compiles go through the counted compile_for_arch, here
    stubbed (the real sm_90a build of a head dim takes ~15 s; test_kernels_compile.py builds them): every part of
    the library at each head dim once, the reference part only when asked."""
    from cupy_rope.attention import hopper

    root, calls = cache
    monkeypatch.setattr(K, "compile_for_arch",
                        lambda module, arch="sm_90", options=K.OPTIONS: calls.append(options) or
                        b"\x7fELF stand-in " + "|".join(options).encode())
    parts = hopper.LIBRARY_PARTS
    assert "REFERENCE" in hopper.PARTS and "REFERENCE" not in parts and len(parts) == len(hopper.PARTS) - 1
    assert M.main(["compile", "--head-dims", "64,128", "--jobs", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(calls) == 2 * len(parts) and [line.split()[4] for line in out] == ["compiled"] * len(calls)
    assert [line.split()[2:4] for line in out] == [[str(d), p.lower()] for d in (64, 128) for p in parts]
    assert calls == [hopper.part_options(p, d) for d in (64, 128) for p in parts]
    want = K.OPTIONS + ("-DATTN_HEAD_DIM=128", "-DHOP_PART=HOP_PART_BF16_BWD")
    assert K.cubin("attention_sm90", "sm_90a", want).endswith(b"=128|-DHOP_PART=HOP_PART_BF16_BWD")
    assert M.main(["compile", "--head-dims", "128,64,128", "--jobs", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(calls) == 2 * len(parts) and [line.split()[4] for line in out] == ["cached"] * len(calls)
    assert M.main(["compile", "--head-dims", "64", "--jobs", "1", "--reference"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[3:5] for line in out] == [[p.lower(), "cached"] for p in parts] + [["reference", "compiled"]]
    assert calls[-1] == hopper.part_options("REFERENCE", 64)
    assert len(list(root.iterdir())) == 2 * len(parts) + 1


@pytest.mark.parametrize("arg", ["65", "64,x", "256"])
def test_compile_command_refuses_head_dims(cache, arg, capsys):
    assert M.main(["compile", "--head-dims", arg, "--jobs", "1"]) == 2
    assert "--head-dims" in capsys.readouterr().err
    assert not cache[0].exists()


def test_compile_command_with_the_cache_off(cache, monkeypatch, capsys):
    monkeypatch.setenv("CUPY_ROPE_CACHE_DIR", "")
    assert M.main(["compile", "--jobs", "1"]) == 2
    assert "cache is off" in capsys.readouterr().err
    assert cache[1] == []


def test_compile_ahead_runs_the_jobs_side_by_side(cache, monkeypatch):
    """compile_ahead compiles its jobs at once, a thread each (the stand-in compile below returns only once all
    three are running: run one after another, it would time out), into the cache the launches then read."""
    import threading

    root, calls = cache
    together = threading.Barrier(3, timeout=30)

    def stand_in(module, arch="sm_90", options=K.OPTIONS):
        calls.append(options)
        together.wait()
        return b"\x7fELF stand-in " + "|".join(options).encode()

    monkeypatch.setattr(K, "compile_for_arch", stand_in)
    monkeypatch.setattr(K.os, "cpu_count", lambda: 8)
    jobs = [(MOD, ARCH, K.OPTIONS + (f"-DPART={i}",)) for i in range(3)]
    done = K.compile_ahead(jobs)
    assert [built for _, built, _ in done] == [True] * 3 and len(calls) == 3
    assert sorted(f.name for f in root.iterdir()) == sorted(K.cache_path(*j).name for j in jobs)
    # the launches' reads: the cache's bytes, no compile (one more would wait at the barrier and fail)
    assert [K.cubin(*j) for j in jobs] == [b"\x7fELF stand-in " + "|".join(j[2]).encode() for j in jobs]
    assert len(calls) == 3
    assert K.compile_ahead(jobs) == [(pytest.approx(0, abs=5), False, K.cache_path(*j)) for j in jobs]


@pytest.fixture
def device_stand_in(monkeypatch):
    """CuPy's current device without a GPU: the caller's is 3; ``cupy.cuda.Device(n)`` as a context makes ``n``
    the current thread's. Returns the thread-local state (``current``)."""
    import threading

    import cupy

    state = threading.local()

    class Device:
        def __init__(self, n):
            self.n = n

        def __enter__(self):
            self.was, state.current = getattr(state, "current", None), self.n

        def __exit__(self, *exc):
            state.current = self.was

    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 3)
    monkeypatch.setattr(cupy.cuda, "Device", Device)
    return state


def test_compile_ahead_runs_functions_beside_the_jobs(cache, monkeypatch, device_stand_in):
    """A function given ``beside`` the jobs runs at the same time as their compiles (all three wait for each
    other below), on a thread of the pool with the caller's device current there, and has returned when
    compile_ahead does."""
    import threading

    root, calls = cache
    together = threading.Barrier(3, timeout=30)
    ran = []

    def stand_in(module, arch="sm_90", options=K.OPTIONS):
        calls.append(options)
        together.wait()
        return b"\x7fELF stand-in"

    def build():
        together.wait()
        ran.append((threading.current_thread().name, device_stand_in.current))

    monkeypatch.setattr(K, "compile_for_arch", stand_in)
    monkeypatch.setattr(K.os, "cpu_count", lambda: 8)
    jobs = [(MOD, ARCH, K.OPTIONS + (f"-DPART={i}",)) for i in range(2)]
    done = K.compile_ahead(jobs, beside=[build])
    assert [built for _, built, _ in done] == [True, True] and len(calls) == 2
    assert len(ran) == 1 and ran[0][0].startswith("cupy_rope-nvrtc") and ran[0][1] == 3


def test_compile_ahead_raises_what_a_function_beside_raised(cache, monkeypatch, device_stand_in):
    """A function beside the jobs that fails (the compile the launch would make fails) fails the call, after the
    jobs' compiles have finished and been kept."""
    root, calls = cache

    def build():
        raise RuntimeError("NVRTC failed on attention.cu")

    monkeypatch.setattr(K.os, "cpu_count", lambda: 4)
    jobs = [(MOD, ARCH, K.OPTIONS + ("-DPART=1",))]
    with pytest.raises(RuntimeError, match="NVRTC failed"):
        K.compile_ahead(jobs, beside=[build])
    assert len(calls) == 1 and K.cache_path(*jobs[0]).is_file()


@pytest.mark.parametrize("why", ["cache off", "one cpu", "one job"])
def test_compile_ahead_does_nothing_where_it_cannot_help(cache, monkeypatch, why):
    root, calls = cache
    jobs = [(MOD, ARCH, K.OPTIONS + (f"-DPART={i}",)) for i in range(2)]
    if why == "cache off":
        monkeypatch.setenv("CUPY_ROPE_CACHE_DIR", "")
    elif why == "one cpu":
        monkeypatch.setattr(K.os, "cpu_count", lambda: 1)
    else:
        jobs = jobs[:1]
    assert K.compile_ahead(jobs) == [] and calls == []


def test_hopper_compiles_each_part_once(monkeypatch):
    """hopper.compile_ahead asks for the passes, its precision's backward and (with forward) its forward that it
    has not built yet at that head dim, each once per process; a call that names another part (a caller's plan)
    compiles it at its launch."""
    from cupy_rope.attention import hopper, plan as P

    asked = []
    monkeypatch.setattr(hopper, "_AHEAD", set())
    monkeypatch.setattr(K, "compile_ahead", lambda jobs, beside=(): asked.append([j[2] for j in jobs]))
    bf16 = P.make_plan("bf16", head_dim=128, tokens=4096, max_tiles=32, sm90=True)
    tf32 = P.make_plan("tf32", head_dim=64, tokens=4096, max_tiles=32, sm90=True)
    bf16_64 = P.make_plan("bf16", head_dim=64, tokens=4096, max_tiles=32, sm90=True)
    hopper.compile_ahead(bf16, forward=False)
    hopper.compile_ahead(bf16, forward=False)
    hopper.compile_ahead(bf16)
    hopper.compile_ahead(bf16)
    hopper.compile_ahead(tf32)
    hopper.compile_ahead(bf16_64, forward=False)
    assert asked == [[hopper.part_options(p, 128) for p in ("PASSES", "BF16_BWD")],
                     [hopper.part_options("BF16_FWD", 128)],
                     [hopper.part_options(p, 64) for p in ("PASSES", "TF32_FWD", "TF32_BWD")],
                     [hopper.part_options("BF16_BWD", 64)]]


@pytest.mark.parametrize("precision", ["bf16", "tf32"])
def test_varlen_forward_builds_its_backward_alongside(monkeypatch, precision):
    """The varlen API's forward on the sm_90a kernels has the backward's part compiled beside its own (a training
    step waits for the longer of the two, not for both in turn); the backward that follows asks for nothing."""
    from cupy_rope.attention import flash, hopper
    from cupy_rope.attention.varlen import Varlen
    from cupy_rope.precision import Precision

    asked = []
    monkeypatch.setattr(hopper, "_AHEAD", set())
    monkeypatch.setattr(hopper, "supported", lambda: True)
    monkeypatch.setattr(K, "compile_ahead", lambda jobs, beside=(): asked.append([j[2] for j in jobs]))
    p, tag = Precision.parse(precision), precision.upper()
    vl = Varlen(np.array([0, 700, 2800], np.int32), 2800)
    assert flash._choose_plan(p, 128, vl, None, forward=True).hopper
    assert asked == [[hopper.part_options(x, 128) for x in ("PASSES", f"{tag}_FWD", f"{tag}_BWD")]]
    assert flash._choose_plan(p, 128, vl, None).hopper
    assert len(asked) == 1


def test_block_backward_compiles_its_preparation_beside(monkeypatch):
    """A block backward on the sm_90a kernels that packs its operands with the mma.sync module's preparation
    kernel (tf32) has that build compiled beside the parts, once per process and head dim; one that reads its
    operands in place (bf16) asks for no such build; a block forward (mma.sync kernels) asks for nothing."""
    from cupy_rope.attention import api, hopper, kernels as AK
    from cupy_rope.attention.varlen import Varlen
    from cupy_rope.precision import Precision

    asked = []
    monkeypatch.setattr(hopper, "_AHEAD", set())
    monkeypatch.setattr(hopper, "supported", lambda: True)
    monkeypatch.setattr(K, "compile_ahead", lambda jobs, beside=(): asked.append(
        ([j[2] for j in jobs], [(b.func, b.args) for b in beside])))
    vl = Varlen(np.array([0, 700, 2800], np.int32), 2800)
    assert api.choose_plan(Precision.TF32, 128, vl).hopper
    assert asked == [([hopper.part_options(x, 128) for x in ("PASSES", "TF32_FWD", "TF32_BWD")],
                      [(AK.attn_kernel, ("prep", Precision.TF32, 128))])]
    api.choose_plan(Precision.TF32, 128, vl)
    api.choose_plan(Precision.TF32, 128, vl, backward=False)
    assert len(asked) == 1
    assert api.choose_plan(Precision.BF16, 128, vl).hopper
    assert asked[1:] == [([hopper.part_options(x, 128) for x in ("BF16_FWD", "BF16_BWD")], [])]


def test_compile_ahead_into_an_unwritable_cache_compiles_once(cache, monkeypatch, tmp_path):
    """Where the cache folder cannot be written, the cubins compile_ahead made wait in memory for their launch
    (each taken once), so a first call still compiles each module once."""
    root, calls = cache
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("CUPY_ROPE_CACHE_DIR", str(blocker / "sub"))
    monkeypatch.setattr(K.os, "cpu_count", lambda: 4)
    monkeypatch.setattr(K, "_unkept", {})
    jobs = [(MOD, ARCH, K.OPTIONS + (f"-DPART={i}",)) for i in range(2)]
    done = K.compile_ahead(jobs)
    assert [built for _, built, _ in done] == [True, True] and len(calls) == 2
    assert all(K.cubin(*j)[:4] == b"\x7fELF" for j in jobs) and len(calls) == 2
    assert K.cubin(*jobs[0])[:4] == b"\x7fELF" and len(calls) == 3  # a second load compiles, as without it


def test_plan_forcing_the_sm90_kernels_elsewhere_is_refused_before_compiling(monkeypatch):
    """A caller's plan asking for the sm_90a kernels on a GPU that cannot run them (not compute capability 9.0)
    is refused before anything is compiled (it would fail mid-call, at the first sm_90a launch)."""
    import dataclasses

    from cupy_rope.attention import api, flash, hopper
    from cupy_rope.attention.varlen import Varlen
    from cupy_rope.precision import Precision

    asked = []
    monkeypatch.setattr(hopper, "supported", lambda: False)
    monkeypatch.setattr(K, "compile_ahead", lambda jobs, beside=(): asked.append(jobs))
    vl = Varlen(np.array([0, 700, 2800], np.int32), 2800)
    force = lambda c: dataclasses.replace(c, hopper=True)  # noqa: E731
    for p in (Precision.BF16, Precision.TF32):
        assert not api.choose_plan(p, 128, vl).hopper and not flash._choose_plan(p, 128, vl, None).hopper
        with pytest.raises(ValueError, match="need a Hopper GPU"):
            api.choose_plan(p, 128, vl, force)
        with pytest.raises(ValueError, match="need a Hopper GPU"):
            flash._choose_plan(p, 128, vl, force, forward=True)
    assert asked == []
