"""What the dev scripts share: workloads named on the command line, inputs built exactly as the benchmarks build
them, plan overrides, the library imported from another tree, interleaved timing and freeing memory.

Inputs, timer and workload lists come from the library itself (``cupy_rope.bench_attention.make_inputs``,
``cupy_rope._bench.Timer``, ``cupy_rope.workloads``), so a script measures what the benchmark measures.
Nothing here changes library state: settings reach the library as arguments (``plan=``, ``config=``), except
:func:`sm90_build`, which swaps the sm_90a kernels' build for the duration of a call (build switches, lab only).
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import importlib
import re
import statistics
import sys
from pathlib import Path

PRECISIONS = ("fp32", "tf32", "bf16")
# vision_attention_backward's positional arguments, in order (make_inputs' keys)
ATTN_KEYS = ("grad_output", "hidden_states", "qkv_weight", "qkv_bias", "proj_weight", "proj_bias", "cos", "sin",
             "cu_seqlens")
ATTN_OUTPUTS = ("grad_hidden_states", "grad_qkv_weight", "grad_qkv_bias", "grad_proj_weight", "grad_proj_bias")


# ---- command-line workloads ---------------------------------------------------------------------------------

def precision_list(text: str) -> list[str]:
    """argparse type: comma-separated precision names."""
    out = [p.strip() for p in text.split(",") if p.strip()]
    if not out or any(p not in PRECISIONS for p in out):
        raise argparse.ArgumentTypeError(f"precisions are a comma-separated subset of {','.join(PRECISIONS)}, "
                                         f"got {text!r}")
    return out


def token_list(text: str) -> list[int]:
    """argparse type: comma-separated token counts."""
    try:
        out = [int(x) for x in text.split(",")]
    except ValueError:
        out = []
    if not out or any(t < 1 for t in out):
        raise argparse.ArgumentTypeError(f"token counts are comma-separated positive integers, got {text!r}")
    return out


def gemm_lab_parser(doc: str, precisions: str, tokens: str) -> argparse.ArgumentParser:
    """The GEMM lab scripts' parser (description and epilog from their docstring ``doc``), with --precisions and
    --tokens (T, the block products' token count) and these defaults."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0], epilog=doc.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--precisions", type=precision_list, default=precisions, metavar="P[,P...]",
                    help=f"precision modes (default {precisions})")
    ap.add_argument("--tokens", type=token_list, default=tokens, help=f"token counts T (default {tokens})")
    return ap


def attn_case_list(text: str) -> list[tuple[int, int]]:
    """argparse type: "all" (the 16 seed workloads) or TxN[,TxN...] (T tokens in N sequences)."""
    from cupy_rope import workloads

    try:
        return workloads.attn_cases(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def rope_case_list(text: str) -> list[tuple[int, int]]:
    """argparse type: "all" (the 16 RoPE workloads) or BxS[,BxS...] (batch x sequence, head dim 128)."""
    from cupy_rope import workloads

    if text == "all":
        return list(workloads.ROPE_CASES)
    try:
        return [(int(b), int(s)) for b, s in (c.split("x") for c in text.split(","))]
    except ValueError:
        raise argparse.ArgumentTypeError(f"RoPE workloads are 'all' or BxS[,BxS...], got {text!r}") from None


def add_workload_args(ap: argparse.ArgumentParser, precisions: str = "fp32,tf32,bf16", cases: str = "all") -> None:
    """--precisions and --cases (attention workloads), with these defaults."""
    ap.add_argument("--precisions", type=precision_list, default=precisions, metavar="P[,P...]",
                    help=f"precision modes among {','.join(PRECISIONS)} (default {precisions})")
    ap.add_argument("--cases", type=attn_case_list, default=cases, metavar="all|TxN[,TxN...]",
                    help=f"attention workloads: all 16 seed workloads, or T tokens in N sequences (default {cases})")


# ---- inputs ---------------------------------------------------------------------------------------------------

def attn_inputs(t: int, n: int, seed: int = 0, **shape) -> list:
    """vision_attention_backward's nine arguments for T tokens in N nearly equal sequences, built as the
    benchmark builds them (``shape``: hidden=, head_dim= for other than the seed model's sizes)."""
    import cupy

    from cupy_rope.bench_attention import make_inputs

    x = make_inputs(t, n, cupy.random.default_rng(seed), **shape)
    return [x[k] for k in ATTN_KEYS]


def rope_inputs(batch: int, seq: int, seed: int = 0) -> tuple:
    """(grad_cos, grad_sin, idx_theta) as the RoPE benchmark builds them: bfloat16 grads, standard normal, and
    the real RoPE angles, [batch, seq, 128]."""
    import cupy
    import ml_dtypes
    import numpy as np

    from cupy_rope import workloads

    rng = cupy.random.default_rng(seed)
    shape = (batch, seq, workloads.ROPE_HEAD_DIM)
    gc = rng.standard_normal(shape, dtype=np.float32).astype(ml_dtypes.bfloat16)
    gs = rng.standard_normal(shape, dtype=np.float32).astype(ml_dtypes.bfloat16)
    return gc, gs, cupy.asarray(workloads.rope_theta(batch, seq))


def free_gpu() -> None:
    """Give the memory pool's cached blocks back, so that one case's buffers never crowd the next."""
    import cupy

    cupy.cuda.runtime.deviceSynchronize()
    cupy.get_default_memory_pool().free_all_blocks()


def same_bits(x, y) -> bool:
    """Bitwise equality of two device arrays (NaN payloads and the sign of zero included)."""
    import cupy

    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    return bool(cupy.all(x.view(cupy.uint8) == y.view(cupy.uint8)))


def _float64(x):
    """A float64 copy; bfloat16 widened through its bits (the upper half of a float32)."""
    import cupy

    if x.dtype.name == "bfloat16":
        return (x.view(cupy.uint16).astype(cupy.uint32) << 16).view(cupy.float32).astype(cupy.float64)
    return x.astype(cupy.float64)


def rel_err(x, ref) -> float:
    """||x - ref|| / ||ref|| (Frobenius, float64) of two device arrays; inf where x is not finite."""
    import cupy

    x64, r64 = _float64(x), _float64(ref)
    if not bool(cupy.isfinite(x64).all()):
        return float("inf")
    den = float(cupy.linalg.norm(r64))
    num = float(cupy.linalg.norm(x64 - r64))
    return num / den if den > 0 else num


# ---- plan overrides -------------------------------------------------------------------------------------------

def _value(text: str):
    """true/false (any case), an int, a float or a quoted string."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise argparse.ArgumentTypeError(f"a plan field value is true/false or a number, got {text!r}") from None


def plan_fields(items: list[str]) -> dict:
    """FIELD=VALUE items as a dict of Plan field overrides, checked against the Plan dataclass's fields."""
    from cupy_rope.attention.plan import Plan

    known = {f.name for f in dataclasses.fields(Plan)}
    out = {}
    for item in items:
        field, sep, value = item.partition("=")
        field = field.strip()
        if not sep or field not in known:
            raise argparse.ArgumentTypeError(f"{item!r}: expected FIELD=VALUE with FIELD one of "
                                             f"{', '.join(sorted(known))}")
        out[field] = _value(value.strip())
    return out


_DEFINE = re.compile(r"-D[A-Za-z_]\w*(=\S*)?")


def build_setting(text: str) -> tuple[str, tuple[dict, tuple]]:
    """argparse type: NAME:ITEM[,ITEM...], each item a plan field (FIELD=VALUE) or a build switch of the sm_90a
    kernels (-DNAME or -DNAME=VALUE); NAME: alone is the library's plan and build. Returns (name, (fields,
    defines))."""
    name, sep, rest = text.partition(":")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"a setting is NAME:ITEM[,...] or NAME:, got {text!r}")
    items = [s.strip() for s in rest.split(",") if s.strip()]
    defines = tuple(i for i in items if i.startswith("-D"))
    for d in defines:
        if not _DEFINE.fullmatch(d):
            raise argparse.ArgumentTypeError(f"{d!r}: a build switch is -DNAME or -DNAME=VALUE")
    return name, (plan_fields([i for i in items if not i.startswith("-D")]), defines)


@contextlib.contextmanager
def sm90_build(defines: tuple):
    """Within the block, the sm_90a attention kernels are those built with these extra defines (each build
    compiled once and cached by the library's launcher, keyed by its options)."""
    if not defines:
        yield
        return
    from cupy_rope.attention import hopper

    saved = hopper._kernel
    hopper._kernel = lambda name, d: saved(name, d, tuple(defines))
    try:
        yield
    finally:
        hopper._kernel = saved


def plan_override(fields: dict):
    """The ``plan=`` argument for these overrides: None (the library's plan) or a callable Plan -> Plan."""
    if not fields:
        return None
    return lambda plan: dataclasses.replace(plan, **fields)


# ---- the library from another tree ----------------------------------------------------------------------------

def add_library_args(ap: argparse.ArgumentParser, what: str) -> None:
    ap.add_argument("--module", default=None, metavar="NAME", help=f"package name of {what}")
    ap.add_argument("--path", default=None, metavar="DIR",
                    help="folder put first on sys.path before importing --module (e.g. .old/base)")


def import_library(module: str = "cupy_rope", path: str | None = None):
    """The library package ``module``, imported from folder ``path`` (put first on sys.path) when given. Two
    trees imported under two package names keep separate state, so one process can run both."""
    if path is not None:
        folder = Path(path).resolve()
        if not folder.is_dir():
            raise SystemExit(f"--path {path}: no such folder")
        sys.path.insert(0, str(folder))
    return importlib.import_module(module)


# ---- timing and printing --------------------------------------------------------------------------------------

def interleaved(fns: dict, measure, rounds: int) -> dict:
    """{name: [measure(fn) per round]} with the functions taken in turn, round after round, so that clock and
    power drift over the run hit every one alike."""
    got = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            got[name].append(measure(fn))
    return got


def median(values) -> float:
    return float(statistics.median(values))


def write_json(path: str | None, payload) -> None:
    """A lab result as the benchmarks write theirs (``_bench.write_json``); nothing when ``path`` is None."""
    if path:
        from cupy_rope._bench import write_json as write

        write(path, payload)


def case_label(t: int, n: int) -> str:
    return f"{t}x{n}"
