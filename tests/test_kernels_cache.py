"""The on-disk cache of the modules the library compiles itself (_kernels.cubin) and ``python -m cupy_rope
compile``: a second process gets the same bytes without compiling, anything that defines the binary keys it, a
damaged file is compiled again, and a cache that cannot be written or is turned off costs a compile, never an
error. NVRTC alone (the small util module for sm_80): runs in CI on a CPU-only machine."""
from __future__ import annotations

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


def test_compile_command_fills_the_cache_once(cache, monkeypatch, capsys):
    """``compile --jobs 1`` runs in this process: its compiles go through the counted compile_for_arch, here
    stubbed (the real sm_90a build of a head dim takes ~40 s; test_kernels_compile.py builds them)."""
    root, calls = cache
    monkeypatch.setattr(K, "compile_for_arch",
                        lambda module, arch="sm_90", options=K.OPTIONS: calls.append(options) or
                        b"\x7fELF stand-in " + "|".join(options).encode())
    assert M.main(["compile", "--head-dims", "64,128", "--jobs", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(calls) == 2 and [line.split()[3] for line in out] == ["compiled", "compiled"]
    assert K.cubin("attention_sm90", "sm_90a", K.OPTIONS + ("-DATTN_HEAD_DIM=128",)).endswith(b"=128")
    assert M.main(["compile", "--head-dims", "128,64,128", "--jobs", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(calls) == 2 and [line.split()[3] for line in out] == ["cached", "cached"]
    assert len(list(root.iterdir())) == 2


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
