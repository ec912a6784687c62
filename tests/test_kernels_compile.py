"""The CUDA sources compile with NVRTC alone (no GPU, no driver) for sm_80 and sm_90, and every entry point
the Python side launches is in the binary. Runs in CI on a CPU-only machine."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from cupy_rope import _kernels as K
from cupy_rope import attention as A
from cupy_rope import rope as R
from cupy_rope._cublas import PRECISIONS

ARCHS = ("sm_80", "sm_90")

def _launched_names() -> dict:
    """Entry points the Python side looks up by name, read from its source: literal names
    (``launcher("util", "colsum_partial", ...)``), prefixes completed by a dtype suffix
    (``launcher("rope", "rope_bwd_vec_" + suf, ...)``) and the attention kernels ``attn_{kernel}_{precision}``."""
    pkg = Path(R.__file__).parent
    found: dict = {m: set() for m in K.MODULES}
    for py in pkg.glob("*.py"):
        src = py.read_text()
        for mod, name in re.findall(r'launcher\(\s*"(\w+)",\s*"(\w+)"\s*,', src):
            found.setdefault(mod, set()).add(name)
        for mod, prefix in re.findall(r'launcher\(\s*"(\w+)",\s*"(\w+)"\s*\+', src):
            found.setdefault(mod, set()).update(prefix + suf for suf in R._SUFFIX.values())
    for k in A._SIGNATURES:
        found["attention"].update(f"attn_{k}_{p}" for p in (("fp32",) if k in A.FP32_ONLY else PRECISIONS))
    return {m: sorted(v) for m, v in found.items()}


LAUNCHED = _launched_names()


def _symbols(cubin: bytes) -> set:
    """Null-terminated identifiers in the ELF string tables (a superset of the symbol names)."""
    return {m.decode() for m in re.findall(rb"[A-Za-z_][A-Za-z0-9_.$]*(?=\x00)", cubin)}


def _check_cubin(module: str, cubin: bytes, arch: str, optional: set = frozenset()) -> None:
    """The cubin is ELF and holds every entry point the source exports (but ``optional``)."""
    assert cubin[:4] == b"\x7fELF", f"{module} for {arch}: NVRTC did not return an ELF cubin"
    names = K.kernel_names(module)
    assert names, f"kernel_names({module!r}) found no entry points"
    syms = _symbols(cubin)
    missing = [n for n in names if n not in syms and n not in optional]
    assert not missing, f"{module} for {arch}: entry points missing from the cubin: {missing}"


def test_launched_names_were_found():
    """The source scan above sees the launches (a guard against the scan silently finding nothing)."""
    assert set(LAUNCHED) == set(K.MODULES), f"launches of unknown modules: {set(LAUNCHED) - set(K.MODULES)}"
    assert {"rope_bwd_vec_bf16", "rope_bwd_strided_f32", "rope_fwd_vec_f16"} <= set(LAUNCHED["rope"])
    assert {"attn_fwd_dq_tf32", "attn_dkdv_bf16", "attn_fwd_fp32", "attn_dkdv_dqp_fp32"} <= set(LAUNCHED["attention"])
    assert "attn_dkdv_dqp_tf32" not in LAUNCHED["attention"]
    assert {"empty_kernel", "cast_f32_bf16", "colsum_partial", "colsum_finish"} <= set(LAUNCHED["util"])


@pytest.mark.parametrize("module", sorted(LAUNCHED))
def test_launched_names_are_exported(module):
    """kernel_names() (parsed from the source, macro expansions included) lists every name Python launches."""
    names = set(K.kernel_names(module))
    missing = sorted(set(LAUNCHED[module]) - names)
    assert not missing, f"{module}.cu exports no entry point named {missing}"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("module", [m for m in K.MODULES if m != "attention"])
def test_module_compiles(module, arch):
    cubin = K.compile_for_arch(module, arch, K.OPTIONS)
    _check_cubin(module, cubin, arch)
    syms = _symbols(cubin)
    assert set(LAUNCHED[module]) <= syms


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("head_dim", A.HEAD_DIMS)
def test_attention_compiles_per_head_dim(head_dim, arch):
    """Every attention entry point compiles for every supported head dim; the fp32 dQ-partial kernels exactly
    for the head dims that are a multiple of 16 (attention._dq_partials uses them only there)."""
    cubin = K.compile_for_arch("attention", arch, K.OPTIONS + (f"-DATTN_HEAD_DIM={head_dim}",))
    partial = {f"attn_{k}_fp32" for k in A.FP32_ONLY}
    _check_cubin("attention", cubin, arch, optional=partial)
    syms = _symbols(cubin)
    assert set(LAUNCHED["attention"]) - partial <= syms
    assert (partial <= syms) == (head_dim % 16 == 0) and (partial & syms == set()) == (head_dim % 16 != 0)


def test_attention_head_dims_cover_the_benchmark():
    from cupy_rope.workloads import ATTN_HEAD_DIM

    assert ATTN_HEAD_DIM in A.HEAD_DIMS
    assert all(d % 8 == 0 and d % 2 == 0 for d in A.HEAD_DIMS)


def test_compile_error_is_reported():
    """A failing NVRTC compile surfaces as RuntimeError naming the module and arch, not a silent None."""
    # A source error (the typedef of i64 is macro-ed away) comes back with NVRTC's log ...
    with pytest.raises(RuntimeError, match=r"(?s)NVRTC failed on rope\.cu for sm_90.*error"):
        K.compile_for_arch("rope", "sm_90", K.OPTIONS + ("-Di64=",))
    # ... and so does an option NVRTC rejects.
    with pytest.raises(RuntimeError, match=r"NVRTC failed on util\.cu for sm_1"):
        K.compile_for_arch("util", "sm_1", K.OPTIONS)


def test_kernel_sources_are_found():
    d = K.kernels_dir()
    assert d.is_dir()
    for m in K.MODULES:
        assert (d / f"{m}.cu").is_file(), f"{m}.cu not in {d}"
    assert (d / "common.cuh").is_file()


@pytest.mark.parametrize("module", K.MODULES)
def test_source_inlines_includes(module):
    src = K.source(module)
    assert not re.search(r'^\s*#\s*include\s*"', src, re.M), f"{module}: a local #include was left in the text"
    assert '#include "' not in src
    # common.cuh is reached by every module (directly or through mma.cuh) and must be inlined exactly once.
    assert src.count("struct BF16 {") == 1
    # The module's own text is there, not only the headers.
    own = (K.kernels_dir() / f"{module}.cu").read_text()
    first_code = next(line for line in own.splitlines() if line.strip() and not line.lstrip().startswith(("//", "#")))
    assert first_code in src


def test_unknown_module_is_refused():
    with pytest.raises(ValueError, match="unknown kernel module"):
        K.source("no_such_module")
