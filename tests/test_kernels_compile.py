"""The CUDA sources compile with NVRTC alone (no GPU, no driver) for sm_80 and sm_90a, every entry point the Python
side launches is in the binary, and its C parameter list is the signature Python packs. Runs in CI on a CPU-only
machine."""
from __future__ import annotations

import functools
import re
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

from cupy_rope import _kernels as K
from cupy_rope import rope as R
from cupy_rope.precision import PRECISIONS, Precision, compile_defines

try:
    from cupy_rope.attention import kernels as AK
except ImportError:  # the contract table is not there yet: the parser is still tested on the stand-in below
    AK = None
NO_KERNELS = "cupy_rope.attention.kernels not importable"


def _arch_90() -> str:
    """sm_90a (the Hopper build with its architecture-specific features) where NVRTC knows it (CUDA >= 12.0)."""
    from cupy_backends.cuda.libs import nvrtc

    return "sm_90a" if tuple(nvrtc.getVersion()) >= (12, 0) else "sm_90"


ARCHS = ("sm_80", _arch_90())


@dataclass(frozen=True)
class _Spec:
    """The fields of cupy_rope.attention.kernels.KernelSpec this test reads."""
    name: str
    params: str
    fp32_only: bool = False


# The attention kernels' contract as this test last knew it: exercises the parser whatever the state of the real
# table, and stands in for it in the other tests while cupy_rope.attention.kernels cannot be imported.
STAND_IN = {s.name: s for s in (
    _Spec("prep", "pppipppppiiip"),
    _Spec("fwd_dq", "ppppppppppppiiiff"),
    _Spec("fwd", "ppppiif"),
    _Spec("dq", "pppppppppiiiff"),
    _Spec("delta", "piqpqqpiippfp"),
    _Spec("dkdv", "pppppppppiiiff"),
    _Spec("fwd_stats", "ppppppppppppiiiff", fp32_only=True),
    _Spec("dkdv_dqp", "pppppppppppiiiff", fp32_only=True),
    _Spec("dq_reduce", "pppppppiiii", fp32_only=True),
    _Spec("dense_softmax", "ppqifpfiii"),
    _Spec("dense_softmax_dscores", "ppqiff"),
    _Spec("dense_scatter", "pppppipipipii"),
    _Spec("dense_pointers", "pqppppppppiiip"),
)}
KERNELS = AK.KERNELS if AK is not None else STAND_IN
try:
    from cupy_rope.attention.hopper import SIGNATURES as HOPPER_SIGNATURES
    from cupy_rope.attention.plan import HOPPER_HEAD_DIMS
except ImportError:
    HOPPER_SIGNATURES, HOPPER_HEAD_DIMS = {}, ()
HEAD_DIMS = AK.HEAD_DIMS if AK is not None else (64, 72, 80, 96, 128)


def _attention_names(specs: dict) -> dict:
    """attn_{name}_{precision} -> signature for every entry point a contract table promises."""
    return {f"attn_{s.name}_{p}": s.params for s in specs.values() for p in (("fp32",) if s.fp32_only else PRECISIONS)}


# ---- the extern "C" declarations, parsed from the module text after expanding the macros that generate them ----

_MACRO = re.compile(r"^[ \t]*#[ \t]*define[ \t]+(\w+)\(([^)]*)\)((?:[^\n]*\\\n)*[^\n]*)", re.M)
_ENTRY = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\((?:[^()]|\([^()]*\))*\)\s*)?(\w+)\s*'
                    r"\(([^)]*)\)")
_SCALARS = {"int": "i", "i64": "q", "long long": "q", "float": "f", "Strides": "S", "__grid_constant__ TmaDesc": "M"}


def expand_entry_macros(text: str) -> str:
    """``text`` with every function-like macro whose body declares an ``extern "C"`` entry point expanded at its
    uses (parameters substituted as whole tokens, ``##`` pasted) and its definition removed."""
    for m in list(_MACRO.finditer(text)):
        name, params, body = m.group(1), [p.strip() for p in m.group(2).split(",")], m.group(3)
        body = body.replace("\\\n", "\n")
        if 'extern "C"' not in body:
            continue
        text = text.replace(m.group(0), "")

        def use(u: re.Match, body=body, params=params) -> str:
            args = [a.strip() for a in u.group(1).split(",")]
            assert len(args) == len(params), f"{u.group(0)}: {len(args)} arguments for {params}"
            out = body
            for p, a in zip(params, args):
                out = re.sub(rf"\b{p}\b", a, out)
            return re.sub(r"\s*##\s*", "", out)

        text = re.sub(rf"^[ \t]*{name}\(([^()]*)\)", use, text, flags=re.M)
    return text


def param_letter(decl: str) -> str:
    """The signature letter of one C parameter declaration (``const float* __restrict__ x`` -> ``p``)."""
    decl = " ".join(decl.replace("*", " * ").split())
    if "*" in decl:
        return "p"
    words = [w for w in decl.split() if w not in ("const", "__restrict__")]
    typ = " ".join(words[:-1])  # the last word is the parameter's name
    if typ not in _SCALARS:
        raise ValueError(f"parameter {decl!r}: no signature letter for type {typ!r}")
    return _SCALARS[typ]


def entry_signatures(text: str) -> dict:
    """Entry point name -> signature string (one letter per C parameter) of every ``extern "C"`` kernel."""
    out = {}
    for m in _ENTRY.finditer(expand_entry_macros(text)):
        params = [p for p in m.group(2).split(",") if p.strip()]
        sig = "".join(param_letter(p) for p in params)
        assert out.setdefault(m.group(1), sig) == sig, f"{m.group(1)} declared twice with different parameters"
    return out


SIGNATURES = {m: entry_signatures(K.source(m)) for m in K.MODULES}


# ---- what Python launches --------------------------------------------------------------------------------------

_LITERAL = re.compile(r'launcher\(\s*"(\w+)",\s*"(\w+)"\s*,\s*"(\w*)"')
_PREFIXED = re.compile(r'launcher\(\s*"(\w+)",\s*"(\w+)"\s*\+\s*\w+\s*,\s*"(\w*)"')


def _launched() -> dict:
    """module -> {entry point -> signature} that the Python side launches, read from its source: literal names
    (``launcher("util", "colsum_partial", "ppiiqi")``), prefixes completed by a dtype suffix
    (``launcher("rope", "rope_bwd_vec_" + suf, "ppppq")``) and the attention kernels of the contract table."""
    pkg = Path(R.__file__).parent
    found: dict = {m: {} for m in K.MODULES}
    for py in sorted(pkg.rglob("*.py")):
        src = py.read_text()
        for mod, name, sig in _LITERAL.findall(src):
            found.setdefault(mod, {})[name] = sig
        for mod, prefix, sig in _PREFIXED.findall(src):
            found.setdefault(mod, {}).update({prefix + suf: sig for suf in R._SUFFIX.values()})
    found["attention"].update(_attention_names(KERNELS))
    found["attention_sm90"].update(HOPPER_SIGNATURES)
    return found


LAUNCHED = _launched()
FP32_ONLY = {f"attn_{s.name}_fp32" for s in KERNELS.values() if s.fp32_only}


def _symbols(cubin: bytes) -> set:
    """Null-terminated identifiers in the ELF string tables (a superset of the symbol names)."""
    return {m.decode() for m in re.findall(rb"[A-Za-z_][A-Za-z0-9_.$]*(?=\x00)", cubin)}


def _check_cubin(module: str, cubin: bytes, arch: str, optional: set = frozenset()) -> None:
    """The cubin is ELF and holds every entry point the source exports (but ``optional``)."""
    assert cubin[:4] == b"\x7fELF", f"{module} for {arch}: NVRTC did not return an ELF cubin"
    names = K.kernel_names(module)
    assert names, f"kernel_names({module!r}) found no entry points"
    assert set(names) == set(SIGNATURES[module]), "kernel_names() and the declaration parser disagree"
    syms = _symbols(cubin)
    missing = [n for n in names if n not in syms and n not in optional]
    assert not missing, f"{module} for {arch}: entry points missing from the cubin: {missing}"


def test_launched_names_were_found():
    """The source scan above sees the launches (a guard against the scan silently finding nothing)."""
    assert set(LAUNCHED) == set(K.MODULES), f"launches of unknown modules: {set(LAUNCHED) - set(K.MODULES)}"
    assert {"rope_bwd_vec_bf16", "rope_bwd_strided_f32", "rope_fwd_vec_f16"} <= set(LAUNCHED["rope"])
    assert {"attn_fwd_dq_tf32", "attn_dkdv_bf16", "attn_fwd_fp32", "attn_dkdv_dqp_fp32"} <= set(LAUNCHED["attention"])
    assert "attn_dkdv_dqp_tf32" not in LAUNCHED["attention"]
    assert {"empty_kernel", "cast_f32_bf16_x3", "cast_colsum_bf16_v4", "colsum_partial", "colsum_finish",
            "transpose_colsum_f32_v4"} <= set(LAUNCHED["util"])


@pytest.mark.parametrize("module", sorted(K.MODULES))
def test_launched_names_are_exported(module):
    """kernel_names() (parsed from the source, macro expansions included) lists every name Python launches."""
    names = set(K.kernel_names(module))
    missing = sorted(set(LAUNCHED[module]) - names)
    assert not missing, f"{module}.cu exports no entry point named {missing}"


@pytest.mark.parametrize("module", sorted(K.MODULES))
def test_launched_signatures_match_the_source(module):
    """Every launch packs exactly the C parameter list of the entry point it launches."""
    wrong = {n: (sig, SIGNATURES[module].get(n)) for n, sig in LAUNCHED[module].items()
             if SIGNATURES[module].get(n) != sig}
    assert not wrong, f"{module}: name -> (signature launched, signature in the source): {wrong}"


@pytest.mark.skipif(AK is None, reason=NO_KERNELS)
def test_attention_contract_matches_the_source():
    """cupy_rope.attention.kernels.KERNELS lists exactly the attention entry points, each with its C parameters."""
    want = _attention_names(AK.KERNELS)
    have = {n: s for n, s in SIGNATURES["attention"].items() if n.startswith("attn_")}
    assert set(have) == set(want), (f"entry points without a KERNELS entry: {sorted(set(have) - set(want))}; "
                                    f"KERNELS entries without an entry point: {sorted(set(want) - set(have))}")
    wrong = {n: (want[n], have[n]) for n in want if want[n] != have[n]}
    assert not wrong, f"name -> (KERNELS params, C parameters): {wrong}"


def test_signature_parser_on_the_stand_in():
    """The parser reads the attention entry points (macro-generated and plain) as the stand-in contract states
    them, and reads a declaration of each parameter kind right."""
    have = {n: s for n, s in SIGNATURES["attention"].items() if n.startswith("attn_")}
    assert have == _attention_names(STAND_IN)
    text = ("#define E(SUF, T) \\\n"
            '    extern "C" __global__ void __launch_bounds__(NWARP * 32, A == B ? 2 : 1) k_##SUF(\\\n'
            "        const T* __restrict__ x, int n, i64 m, float s, Strides st) { body(); }\n"
            'E(f32, float)\nE(bf16, u16)\nextern "C" __global__ void plain() {}\n')
    assert entry_signatures(text) == {"k_f32": "piqfS", "k_bf16": "piqfS", "plain": ""}
    with pytest.raises(ValueError, match="no signature letter"):
        entry_signatures('extern "C" __global__ void k(double x) {}')


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("module", [m for m in K.MODULES if m not in ("attention", "attention_sm90")])
def test_module_compiles(module, arch):
    cubin = K.compile_for_arch(module, arch, K.OPTIONS)
    _check_cubin(module, cubin, arch)
    syms = _symbols(cubin)
    assert set(LAUNCHED[module]) <= syms


@pytest.mark.skipif(AK is None, reason=NO_KERNELS)
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_attention_compiles_per_head_dim(head_dim, arch):
    """Every attention entry point compiles for every supported head dim, each precision's build (as the library
    makes it: attention.kernels.build_options) holding exactly that precision's; the fp32-only kernels (dQ from
    the key-tile kernel's partials) exactly for the head dims that are a multiple of 16, where the schedule uses
    them."""
    names = set(K.kernel_names("attention"))
    syms: set = set()
    for p in Precision:
        mine = {n for n in names if n.endswith(f"_{p.label}")}
        cubin = K.compile_for_arch("attention", arch, AK.build_options(p, head_dim))
        _check_cubin("attention", cubin, arch, optional=FP32_ONLY | (names - mine))
        have = _symbols(cubin) & names
        assert have <= mine, f"the {p.label} build holds other precisions' kernels: {sorted(have - mine)}"
        syms |= have
    assert set(LAUNCHED["attention"]) - FP32_ONLY <= syms
    assert (FP32_ONLY <= syms) == (head_dim % 16 == 0) and (FP32_ONLY & syms == set()) == (head_dim % 16 != 0)


def test_attention_modes_mask_is_checked():
    """A mask of no mode, or of a mode the source does not know, stops the attention module's compile."""
    for mask in (0, 8):
        with pytest.raises(RuntimeError, match="ATTN_MODES is a mask"):
            K.compile_for_arch("attention", ARCHS[0], K.OPTIONS + ("-DATTN_HEAD_DIM=64", f"-DATTN_MODES={mask}"))


# Kernels whose host shared-memory size (hopper.smem_bytes) the sm_90a compile checks against their layout.
SMEM_CHECKED = ("hop_fwd_bf16", "hop_fwd_bf16_ws", "hop_fwd_bf16_ws_k192", "hop_fwd_bf16_ws_persist",
                "hop_fwd_bf16_ws_persist_bulk", "hop_bwd_bf16", "hop_bwd_bf16_ws", "hop_bwd_bf16_ws_plain_dq",
                "hop_bwd_bf16_ws_plain_dq_split", "hop_bwd_bf16_ws_q80", "hop_fwd_tf32", "hop_fwd_tf32_ws",
                "hop_fwd_tf32_ws_tail",
                "hop_bwd_tf32")


def _sm90_extras(head_dim: int, switches: tuple = ()) -> tuple:
    """The compile tests' options beyond the library's: the host's shared-memory sizes of the checked kernels
    (static_asserts in the source compare them with the layouts) and extra ``switches``."""
    from cupy_rope.attention import hopper

    return tuple(f"-DHOP_HOST_SMEM_{name}={hopper.smem_bytes(name, head_dim)}" for name in SMEM_CHECKED) + switches


def _sm90_options(head_dim: int, switches: tuple = ()) -> tuple:
    """The whole sm_90a module's build options at ``head_dim`` (every part in one build), with
    :func:`_sm90_extras`."""
    return K.OPTIONS + (f"-DATTN_HEAD_DIM={head_dim}",) + _sm90_extras(head_dim, tuple(switches))


def _sm90_nvrtc(opts: tuple, arch: str, *flags: str) -> tuple[str, str | bytes]:
    """(compile log, output) of the sm_90a module through NVRTC directly: ``arch`` sm_90a gives the cubin (with
    ``--ptxas-options=-v`` among ``flags`` the log holds ptxas's report: one compile for both), compute_90a the
    PTX."""
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(K.source("attention_sm90"), "attention_sm90.cu", [], [])
    try:
        nvrtc.compileProgram(prog, [f"--gpu-architecture={arch}", *flags, *K.module_options("attention_sm90", opts)])
        log = nvrtc.getProgramLog(prog).replace("\x00", "")
        out = nvrtc.getPTX(prog) if arch.startswith("compute_") else nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    return log, out.decode() if arch.startswith("compute_") and isinstance(out, bytes) else out


# build switches of kernel alternatives kept for measurement, compiled here too so they keep building (each entry is
# one build with all its switches). 128: the two-stage tf32 backward's dQ^T rows split between its warpgroups, the
# one-stage kernel's dQ^T in one accumulator set, the bf16 backward storing bf16 gradients and the bf16 forwards
# storing no O (probes), the tf32 backward copying its streamed tiles once (a probe). 80: the two-stage tf32 backward
# adding dQ^T from warpgroup 1's registers (with the pair), the dQ counts released by warpgroup 1, the bf16
# specialised backward's RoPE epilogue on block-wide barriers with its row loop unrolled 2, the bf16 forwards storing
# O in plain stores, the delta pass's rows. 64: the tf32 dQ^T staged over Q^T with the epilogue on a named barrier of
# the consumers (and so their wait for the engine's last read), the one-stage kernel's lone dQ^T block issued after
# the turn's wait, the bf16 backward's repeated-steps probe, the bf16 specialised forwards without turns and the
# persistent one copying Q before a unit's first K/V tile. 96: the tf32 epilogue on the consumers' named barrier
# with dQ^T staged over the step's Q (their wait for the last stage's release) and over the 128-row tile, as before
# the key block's 64 rows; dQ^T staged over dO^T, with the epilogue probe leaving out its RoPE backward, sums and
# transposed copy. 64 again: the tf32 backward's dO released apart from Q, which the build does above D = 64 only.
SM90_SWITCH_BUILDS = [(128, ("-DCUPY_ROPE_TF32_DQ_SPLIT=1", "-DCUPY_ROPE_TF32_DQ_PAIR=0",
                             "-DCUPY_ROPE_PROBE_BF16_GRADS=1", "-DCUPY_ROPE_PROBE_FWD_NO_O=1",
                             "-DCUPY_ROPE_PROBE_TF32_NO_STREAM=1")),
                      (80, ("-DCUPY_ROPE_TF32_DQ_BULK=0", "-DCUPY_ROPE_TF32_RELEASER=0", "-DCUPY_ROPE_BWD_EPI_NAMED=0",
                            "-DCUPY_ROPE_BWD_EPI_UNROLL=2", "-DCUPY_ROPE_FWD_O_STORE=0", "-DCUPY_ROPE_DELTA_ROWS=4")),
                      (64, ("-DCUPY_ROPE_TF32_DQ_OVER_Q=0", "-DCUPY_ROPE_TF32_DQ_OVER_DOT=0",
                            "-DCUPY_ROPE_TF32_EPI_NAMED=1", "-DCUPY_ROPE_TF32_DQ_EARLY=0", "-DCUPY_ROPE_PROBE_REPEAT=2",
                            "-DCUPY_ROPE_FWD_TURNS=0", "-DCUPY_ROPE_FWD_KV_FIRST=0")),
                      (96, ("-DCUPY_ROPE_TF32_EPI_NAMED=1", "-DCUPY_ROPE_TF32_EPI_ROWS=128")),
                      (96, ("-DCUPY_ROPE_TF32_DQ_OVER_Q=0", "-DCUPY_ROPE_PROBE_TF32_EPI=7")),
                      (64, ("-DCUPY_ROPE_TF32_DO_APART=1", "-DCUPY_ROPE_PDL=1"))]


@pytest.mark.skipif(ARCHS[1] != "sm_90a", reason="this NVRTC does not know sm_90a (CUDA < 12.0)")
def test_sm90_time_stamps_probe_builds():
    """The bf16 specialised backward's per-unit clock (-DCUPY_ROPE_PROBE_TIMES=1, dev/bwd_timeline.py) assembles,
    with its stamp buffer in the module and every entry point Python launches (its extra registers may spill in
    the kernels it does not stamp: a lab build, not checked for that)."""
    cubin = K.compile_for_arch("attention_sm90", "sm_90a", _sm90_options(64, ("-DCUPY_ROPE_PROBE_TIMES=1",)))
    syms = _symbols(cubin)
    assert "hop_probe_out" in syms
    assert {"hop_bwd_bf16_ws", "hop_bwd_bf16_ws_plain_dq"} <= syms


@pytest.mark.skipif(ARCHS[1] != "sm_90a", reason="this NVRTC does not know sm_90a (CUDA < 12.0)")
def test_sm90_lab_builds_at_128():
    """A lab form at D = 128, where it spills a little (not checked: a lab build): the bf16 backward's dQ writers
    and the two-stage tf32 backward's dQ^T warp without their count waits (-DCUPY_ROPE_PROBE_NO_COUNT_WAIT=1,
    timing only; the bf16 split kernel spills 8 bytes) assembles with every backward it touches."""
    cubin = K.compile_for_arch("attention_sm90", "sm_90a", _sm90_options(128, ("-DCUPY_ROPE_PROBE_NO_COUNT_WAIT=1",)))
    assert {"hop_bwd_bf16_ws", "hop_bwd_bf16_ws_plain_dq", "hop_bwd_bf16_ws_q80",
            "hop_bwd_bf16_ws_split", "hop_bwd_tf32_ws2", "hop_bwd_tf32_ws2_plain"} <= _symbols(cubin)


@pytest.mark.skipif(ARCHS[1] != "sm_90a", reason="this NVRTC does not know sm_90a (CUDA < 12.0)")
@pytest.mark.parametrize("head_dim,switches", [pytest.param(d, (), id=str(d)) for d in HOPPER_HEAD_DIMS] + [
    pytest.param(d, sw, id=f"{d}-" + ",".join(x.removeprefix("-DCUPY_ROPE_") for x in sw))
    for d, sw in SM90_SWITCH_BUILDS])
def test_sm90_attention_compiles_per_head_dim(head_dim, switches):
    """The Hopper kernels (wgmma, TMA, mbarriers: sm_90a only) assemble for every head dim of their path, every
    entry point Python launches is in the cubin with the parameters Python packs, nothing spills, and the host
    gives each checked kernel at least the shared memory its layout uses. At the head dims, each part as the
    library builds it (hopper.part_options) holds exactly its kernels; a switch build, the whole module at once."""
    from cupy_rope.attention import hopper

    assert K.ARCH_MODULES["attention_sm90"] == "sm_90a"
    # the host's shared-memory sizes, checked against the kernels' layouts by static_asserts in the source
    source = K.source("attention_sm90")
    for name in SMEM_CHECKED:
        assert f"HOP_HOST_SMEM_{name}" in source, f"attention_sm90.cu checks no host size for {name}"
    # the q80 backward and the k192 forward are built at the head dims of their layouts only, and exactly there
    q80 = {n for n in LAUNCHED["attention_sm90"] if n.endswith(("_q80", "_k192"))}
    assert q80 == {"hop_bwd_bf16_ws_q80", "hop_bwd_bf16_ws_plain_q80", "hop_fwd_bf16_ws_k192"}
    assert set(hopper.PART) == set(LAUNCHED["attention_sm90"]) == set(K.kernel_names("attention_sm90"))
    builds = [(None, _sm90_options(head_dim, switches))] if switches else [
        (part, hopper.part_options(part, head_dim, _sm90_extras(head_dim))) for part in hopper.PARTS]
    syms: set = set()
    for part, o in builds:
        log, cubin = _sm90_nvrtc(o, "sm_90a", "--ptxas-options=-v")  # ptxas's report and the cubin, one compile
        others = set() if part is None else set(hopper.PART) - set(hopper.PARTS[part])
        _check_cubin("attention_sm90", cubin, "sm_90a", optional=q80 | others)
        have = _symbols(cubin) & set(hopper.PART)
        assert not have & others, f"part {part} builds kernels of other parts: {sorted(have & others)}"
        syms |= have
        _check_ptxas_log(log, head_dim)
    assert set(LAUNCHED["attention_sm90"]) - q80 <= syms
    assert (q80 <= syms) == (head_dim in hopper.Q80_HEAD_DIMS) and (q80 & syms == set()) != (q80 <= syms)


@pytest.mark.skipif(ARCHS[1] != "sm_90a", reason="this NVRTC does not know sm_90a (CUDA < 12.0)")
def test_sm90_parts_are_the_sources():
    """hopper.PARTS names the parts attention_sm90.cu defines and puts every kernel in one of them; a part the
    source does not define stops the compile (it would otherwise build no kernel), and the host refuses it."""
    from cupy_rope.attention import hopper

    names = [n for part in hopper.PARTS.values() for n in part]
    assert len(names) == len(set(names)) and set(names) == set(hopper.SIGNATURES)
    defined = re.findall(r"^#define HOP_PART_(\w+) \d+$", K.source("attention_sm90"), re.M)
    assert defined == list(hopper.PARTS)
    assert hopper.PART["hop_bwd_tf32_ws"] == "REFERENCE" and "REFERENCE" not in hopper.LIBRARY_PARTS
    with pytest.raises(ValueError, match="unknown part"):
        hopper.part_options("BF16", 64)
    with pytest.raises(RuntimeError, match="HOP_PART is one of"):
        K.compile_for_arch("attention_sm90", "sm_90a", K.OPTIONS + ("-DATTN_HEAD_DIM=64", "-DHOP_PART=HOP_PART_BF16"))


def _check_ptxas_log(log: str, head_dim: int) -> None:
    """ptxas's report of an sm_90a build: no stack or spills (but the bounded ones below), no serialised wgmma."""
    # Every kernel but one is free of stack and spills. The tf32 backward at head dim 128 holds dK and dV (128
    # registers) beside a step's S^T and dP^T at the 255-register limit: ptxas keeps about a dozen words in local
    # memory (48-56 bytes with CUDA 12.9 and 13.0; 92 in the one-consumer varlen kernel, not the plan's, since its
    # block index comes from the grouped block order); bounded here so that growth shows.
    funcs = re.findall(r"Function properties for (\w+)\D*?(\d+) bytes stack frame, (\d+) bytes spill stores", log)
    assert funcs, log
    for name, frame, spill in funcs:
        budget = 0 if head_dim != 128 or not name.startswith("hop_bwd_tf32") \
            else (96 if name == "hop_bwd_tf32_plain" else 64)
        assert int(frame) <= budget and int(spill) <= budget, f"{name}: stack {frame}, spills {spill}\n{log}"
    # ptxas reports each reason it serialises a kernel's wgmma (C7510, C7515, C7520, ...: "Potential Performance
    # Loss: wgmma.mma_async instructions are serialized due to ..."), and each warpgroup.arrive it has to add
    # because a wgmma operand register was written after the last fence (C7519); none may remain
    assert not re.search(r"Potential Performance Loss: wgmma", log), f"wgmma serialised by ptxas:\n{log}"
    assert "warpgroup.arrive is injected" not in log, f"ptxas added warpgroup.arrive:\n{log}"


@pytest.mark.skipif(ARCHS[1] != "sm_90a", reason="this NVRTC does not know sm_90a (CUDA < 12.0)")
def test_sm90_specialised_kernels_meet_block_barriers_unaligned():
    """A warp-specialised kernel's roles meet its block-wide barriers at different instructions (the producer's
    loop, the consumers' epilogue), which PTX allows only for the unaligned ``barrier.sync 0``: after the one
    aligned barrier before the roles split (the mbarriers' set-up), every ``__syncthreads()`` (``bar.sync 0``)
    in such a kernel would be one that compute-sanitizer's synccheck stops. Checked on the PTX of each entry."""
    entries = _sm90_entries(128)
    specialised = {n: body for n, body in entries.items() if "_ws" in n}
    assert {"hop_fwd_bf16_ws", "hop_bwd_bf16_ws", "hop_bwd_tf32_ws", "hop_bwd_tf32_ws2"} <= set(specialised)
    for name, body in specialised.items():
        aligned = len(re.findall(r"\bbar(?:rier)?\.sync(?:\.aligned)?\s+0;", body)) - len(
            re.findall(r"\bbarrier\.sync\s+0;", body))
        assert aligned == 1, f"{name}: {aligned} aligned block-wide barriers (one expected, before the roles split)"
    # the check sees the difference: the kernels with an epilogue the producer joins use the unaligned form (the
    # bf16 split kernel; the unsplit bf16 kernel's epilogue meets on a named barrier of its consumers alone)
    assert all(re.search(r"\bbarrier\.sync\s+0;", specialised[n])
               for n in ("hop_bwd_bf16_ws_split", "hop_bwd_tf32_ws"))
    assert not re.search(r"\bbarrier\.sync\s+0;", specialised["hop_bwd_bf16_ws"])


@functools.lru_cache(maxsize=None)
def _sm90_entries(head_dim: int, switches: tuple = ()) -> dict:
    """Each entry's PTX body (kernel name -> text) in the sm_90a module built at ``head_dim`` with ``switches``."""
    _, ptx = _sm90_nvrtc(_sm90_options(head_dim, switches), "compute_90a")
    return dict(re.findall(r"\.entry (\w+)\((.*?)(?=\.entry |\Z)", ptx, re.S))


# a PTX instruction that reads or writes global memory (or starts a copy that does)
_GLOBAL_ACCESS = re.compile(r"\b(?:ld|st|atom|red)\.(?!param|shared|local|const)[\w:.]*|\bcp\.(?:async|reduce)\b"
                            r"|\bprefetch\.global")


@pytest.mark.skipif(ARCHS[1] != "sm_90a", reason="this NVRTC does not know sm_90a (CUDA < 12.0)")
def test_sm90_kernels_wait_for_the_kernel_ahead():
    """Built with -DCUPY_ROPE_PDL=1, the sm_90a kernels are started with programmatic stream serialisation, so
    their blocks may run before the kernel ahead has ended: every entry must wait (griddepcontrol.wait) before
    its first access to global memory, and only then let the next kernel launch. The default build holds
    neither, and its launcher starts kernels as any other."""
    entries = _sm90_entries(64, (K.PDL_SWITCH,))
    # every launched entry but those built at other head dims only (the q80 backward, the k192 forward)
    assert {n for n in LAUNCHED["attention_sm90"] if not n.endswith(("_q80", "_k192"))} <= set(entries)
    for name, body in entries.items():
        wait, trigger = body.find("griddepcontrol.wait"), body.find("griddepcontrol.launch_dependents")
        first = _GLOBAL_ACCESS.search(body)
        assert wait >= 0 and trigger > wait, f"{name}: no wait, or the next kernel launched before it"
        assert first is None or first.start() > wait, f"{name}: {first.group(0)!r} before the wait"
    assert not any("griddepcontrol" in body for body in _sm90_entries(128).values())
    assert K.programmatic("attention", (K.PDL_SWITCH,)) is False
    assert K.programmatic("attention_sm90", ("-DATTN_HEAD_DIM=64",)) is False


def test_programmatic_launch_structures_are_the_drivers():
    """CUlaunchConfig and CUlaunchAttribute as cuda.h lays them out (x86-64 and aarch64): cuLaunchKernelEx reads
    these offsets."""
    import ctypes

    assert ctypes.sizeof(K._LaunchConfig) == 56 and ctypes.sizeof(K._LaunchAttribute) == 72
    assert (K._LaunchConfig.smem.offset, K._LaunchConfig.stream.offset, K._LaunchConfig.attrs.offset,
            K._LaunchConfig.nattrs.offset) == (24, 32, 40, 48)
    assert K._LaunchAttribute.value.offset == 8 and K._PROGRAMMATIC_STREAM_SERIALIZATION == 6


def test_sm90_head_dims_are_the_plans():
    from cupy_rope.attention.plan import HOPPER_HEAD_DIMS as PLAN_DIMS

    assert tuple(HOPPER_HEAD_DIMS) == tuple(PLAN_DIMS) and set(PLAN_DIMS) <= set(HEAD_DIMS)


def test_sm90_delta_blocks_are_the_launchers():
    """The delta pass's block of DELTA_TOKENS tokens by DELTA_HEADS heads (attention/delta.cuh) is the one the
    launchers' grid counts: a larger count there would leave heads or tokens unwritten."""
    from cupy_rope.attention import kernels as attention_kernels

    for module in ("attention_sm90", "attention"):  # both build it: hop_delta_* and attn_delta_*
        m = re.search(r"constexpr int DELTA_TOKENS = (\d+), DELTA_HEADS = (\d+)", K.source(module))
        assert m, f"the delta pass's block constants not found in the {module} source"
        assert (int(m.group(1)), int(m.group(2))) == (attention_kernels.DELTA_TOKENS, attention_kernels.DELTA_HEADS)


def test_attention_head_dims_cover_the_benchmark():
    from cupy_rope.workloads import ATTN_HEAD_DIM

    assert ATTN_HEAD_DIM in HEAD_DIMS
    assert all(d % 8 == 0 and d % 2 == 0 for d in HEAD_DIMS)


# ---- precision modes: named in the sources, valued by cupy_rope.precision ------------------------------------

def test_precision_defines_match_the_enum():
    assert compile_defines() == ("-DMODE_FP32=0", "-DMODE_TF32=1", "-DMODE_BF16=2")
    assert compile_defines() == tuple(f"-DMODE_{p.name}={p.value}" for p in Precision)
    assert PRECISIONS == ("fp32", "tf32", "bf16") == tuple(p.label for p in Precision)
    assert [Precision.parse(s) for s in PRECISIONS] == list(Precision)
    assert Precision.parse(Precision.TF32) is Precision.TF32
    with pytest.raises(ValueError, match=r"fp32.*tf32.*bf16"):
        Precision.parse("fp16")
    with pytest.raises(TypeError):
        Precision.parse(1)


def _kernel_files() -> list:
    files = sorted(p for p in K.kernels_dir().rglob("*") if p.suffix in (".cu", ".cuh"))
    assert any(p.parent.name == "attention" for p in files), "kernels_cu/attention/*.cuh not found"
    return files


# A precision mode written as an integer: compared with one, or as the argument of a mode-templated name.
_MODE_LITERAL = re.compile(r"\bMODE\s*[=!]=\s*\d|\b(?:Smem|to_smem|Layout|SkipIdle|Blocked|smem_pair|copy_tile|mm_ss"
                           r"|mm_rs|attn_prep|attn_fwd_dq|attn_dkdv)\s*<\s*\d|\bATTN_ENTRIES\(\s*\w+\s*,\s*\d")


@pytest.mark.parametrize("path", _kernel_files(), ids=lambda p: p.name)
def test_sources_name_the_modes(path):
    """No CUDA source writes a precision mode as an integer (``MODE == 2``, ``Smem<2>``, ``attn_dkdv<0, ...>``):
    the values come from cupy_rope.precision."""
    bad = [f"{path.name}:{i}: {line.strip()}" for i, line in enumerate(path.read_text().splitlines(), 1)
           if _MODE_LITERAL.search(line.split("//")[0])]
    assert not bad, "mode integers in the CUDA source:\n" + "\n".join(bad)


def test_attention_refuses_to_compile_without_the_mode_defines():
    """compile_for_arch adds the defines itself; NVRTC on the bare text stops at config.cuh's #error."""
    from cupy_backends.cuda.libs import nvrtc

    assert set(compile_defines()) <= set(K.module_options("attention"))
    assert K.module_options("attention", K.OPTIONS + compile_defines()) == K.OPTIONS + compile_defines()
    assert K.module_options("util") == K.OPTIONS
    prog = nvrtc.createProgram(K.source("attention"), "attention.cu", [], [])
    try:
        with pytest.raises(nvrtc.NVRTCError):
            nvrtc.compileProgram(prog, ["--gpu-architecture=sm_80", *K.OPTIONS])
        assert "MODE_FP32, MODE_TF32 and MODE_BF16 are not defined" in nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)


def test_launch_counter_is_per_thread():
    """launches() counts the calling thread's launches only: a fresh thread starts from zero."""
    seen = []
    t = threading.Thread(target=lambda: seen.append(K.launches()))
    t.start()
    t.join()
    assert seen == [0] and isinstance(K.launches(), int)


# ---- errors and the source files ---------------------------------------------------------------------------------

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
    assert (d / "attention" / "config.cuh").is_file()


def test_a_second_checkout_compiles_its_own_sources(tmp_path):
    """A checkout imported by path (another tree beside an installed one, as the lab's comparisons do) reads the
    kernel sources beside its own package, not those an installed package maps ``cupy_rope.kernels_cu`` to."""
    import os
    import shutil
    import subprocess
    import sys

    shutil.copytree(Path(K.__file__).resolve().parent, tmp_path / "cupy_rope",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(K.kernels_dir(), tmp_path / "kernels_cu")
    common = tmp_path / "kernels_cu" / "common.cuh"
    common.write_text("// the second checkout\n" + common.read_text())
    code = "import cupy_rope._kernels as K; print(K.kernels_dir(), K.source('util').count('// the second checkout'))"
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == [str(tmp_path / "kernels_cu"), "1"], out


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


def test_attention_headers_are_inlined_once():
    """Every header under kernels_cu/attention/ reaches the attention module, once, however often it is included
    (each one includes config.cuh, which includes mma.cuh)."""
    src = K.source("attention")
    for h in sorted((K.kernels_dir() / "attention").glob("*.cuh")):
        first = h.read_text().splitlines()[0]
        assert src.count(first) == 1, f"attention/{h.name}: its first line appears {src.count(first)} times"
    assert src.count("template <int MODE> struct Smem {") == 1


def test_unknown_module_is_refused():
    with pytest.raises(ValueError, match="unknown kernel module"):
        K.source("no_such_module")


@pytest.mark.skipif(AK is None, reason=NO_KERNELS)
@pytest.mark.parametrize("header,macro,module,name", [
    ("dense.cuh", "DENSE_ROWS", "dense", "SCATTER_ROWS"),  # dense_scatter's tokens per block: grid, bias partials
    ("sm90/forward_tf32.cuh", "HOP32_BN", "hopper", "TF32_FWD_STEP_KEYS"),  # forward_tail's key steps a part walks
    ("sm90/backward_tf32.cuh", "HOP32_BQ", "hopper", "TF32_STEP_ROWS"),  # first_tile_stores' whole query steps
])
def test_host_sizes_match_the_source(header, macro, module, name):
    """The sizes the host counts in (grids, split and store rules) are the kernels' own #defines."""
    import importlib

    host = importlib.import_module(f"cupy_rope.attention.{module}")
    text = (K.kernels_dir() / "attention" / header).read_text()
    m = re.search(rf"^#define {macro} (\d+)", text, re.M)
    assert m and int(m.group(1)) == getattr(host, name)
