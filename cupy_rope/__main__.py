"""Command line: ``python -m cupy_rope bench {rope,attention,varlen-attention,attention-long} [options]``, and
``python -m cupy_rope compile`` (the sm_90a kernels built into the on-disk cache ahead of the first call)."""
from __future__ import annotations

import argparse
import os
import sys

from ._gpu import gpu_problem

OPS = ["rope", "attention", "varlen-attention", "attention-long"]
# the precisions of each attention command, in the order ``--precision all`` runs them (rope has none)
PRECISIONS = {"attention": ("fp32", "tf32", "bf16"), "varlen-attention": ("bf16", "tf32", "fp32"),
              "attention-long": ("bf16", "tf32")}
ALL_ALLOWED = ("varlen-attention", "attention-long")
JSON_OP = {"attention": "vision_attention_backward", "varlen-attention": "varlen_attention",
           "attention-long": "vision_attention_long"}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cupy_rope", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bench", help="time an op on its built-in workloads against the roofline and peers")
    b.add_argument("op", choices=OPS)
    b.add_argument("--precision", choices=["fp32", "tf32", "bf16", "all"], default=None,
                   help="attention commands only (default tf32); 'all' for varlen-attention (bf16, tf32, fp32) "
                        "and attention-long (bf16, tf32)")
    b.add_argument("--out", help="write the results as JSON to this file; '{precision}' in it is replaced by the "
                                 "precision; with --precision all and no '{precision}', or when it names a folder, "
                                 "the folder gets one <op>_<precision>.json per precision")
    b.add_argument("--reps", type=int, default=None, help="timed repetitions per case")
    b.add_argument("--no-peers", action="store_true", help="skip the peer implementations")
    b.add_argument("--hold-host", action=argparse.BooleanOptionalAction, default=True,
                   help="after each flush, keep the GPU busy for the call's host issue time (a spin kernel), so "
                        "that a call slower to issue than the flush runs is timed on the GPU alone, peers too "
                        "(default; --no-hold-host times with the flush alone)")
    b.add_argument("--cases", help="rope, attention: comma-separated case indices (0-15); varlen-attention, "
                                   "attention-long: comma-separated case names or indices; default all")
    c = sub.add_parser("compile", help="build the sm_90a attention kernels into the on-disk cache (NVRTC only: "
                                       "needs no GPU), the parts of every head dim side by side")
    c.add_argument("--head-dims", default=None,
                   help="comma-separated head dims (default: every one the sm_90a kernels are built for)")
    c.add_argument("--jobs", type=int, default=None, help="compiles at once (default: one per CPU)")
    c.add_argument("--reference", action="store_true",
                   help="also the kernels no plan of the library chooses (the tests' reference forms)")
    return p


def head_dims(text: str | None) -> tuple:
    """The head dims of ``compile --head-dims`` (all of the sm_90a kernels' by default); ValueError on others."""
    from .attention.plan import HOPPER_HEAD_DIMS

    if not text:
        return HOPPER_HEAD_DIMS
    try:
        dims = tuple(dict.fromkeys(int(x) for x in text.split(",")))
    except ValueError:
        raise ValueError(f"--head-dims: comma-separated integers, got {text!r}") from None
    bad = [d for d in dims if d not in HOPPER_HEAD_DIMS]
    if bad:
        raise ValueError(f"--head-dims: the sm_90a kernels are built for {HOPPER_HEAD_DIMS}, got {bad}")
    return dims


def compile_main(a) -> int:
    """``python -m cupy_rope compile``: the parts of the sm_90a module (``hopper.PARTS``) at each head dim into the
    disk cache, ``--jobs`` at once (:func:`_kernels.compile_jobs`: NVRTC compiles one module on one CPU)."""
    from . import _kernels as K
    from .attention import hopper

    try:
        dims = head_dims(a.head_dims)
    except ValueError as e:
        print(f"python -m cupy_rope compile: {e}", file=sys.stderr)
        return 2
    if K.cache_dir() is None:
        print("python -m cupy_rope compile: the cache is off (CUPY_ROPE_CACHE_DIR is empty): nothing would be kept",
              file=sys.stderr)
        return 2
    parts = tuple(hopper.PARTS) if a.reference else hopper.LIBRARY_PARTS
    names = [(d, part) for d in dims for part in parts]
    work = [("attention_sm90", "sm_90a", hopper.part_options(part, d)) for d, part in names]
    results = K.compile_jobs(work, a.jobs or os.cpu_count() or 1)
    for (d, part), (sec, built, path) in zip(names, results):
        print(f"head dim {d:3d} {part.lower():9s} {'compiled' if built else 'cached  '} {sec:6.1f} s  {path}")
    return 0


def out_paths(out: str | None, op: str, precisions) -> list:
    """The JSON path of each precision's run: None without ``--out``; else ``out`` with ``{precision}`` replaced,
    and where that is a folder (existing, or ending in a separator) or is shared by several precisions, the file
    named as in ``bench/results`` (:func:`json_name`) inside it."""
    if not out:
        return [None] * len(precisions)
    if "{precision}" in out:
        paths = [out.replace("{precision}", p) for p in precisions]
    else:
        paths = [out] * len(precisions)
    return [os.path.join(path, json_name(op, p)) if len(set(paths)) < len(paths) or _folder(path) else path
            for path, p in zip(paths, precisions)]


def _folder(path: str) -> bool:
    """Whether ``--out``'s path names a folder: one that exists, or a name ending in a separator."""
    return os.path.isdir(path) or path.endswith(("/", os.sep))


def json_name(op: str, precision: str) -> str:
    """The file name of a run's JSON in ``bench/results``: ``<op>_<precision>.json`` with op as in the JSON's
    "op"; RoPE's has no precision (it runs every dtype)."""
    if op == "rope":
        return "rope_2d_backward.json"
    return f"{JSON_OP.get(op, op.replace('-', '_'))}_{precision}.json"


def parse(argv=None):
    """The parsed command line with ``runs`` ([(precision, out path)]) and, for the named-case commands,
    ``selected`` (the workloads); argument errors exit through argparse before anything touches the GPU."""
    p = parser()
    a = p.parse_args(argv)
    if a.cmd == "compile":
        return a
    precision = a.precision or "tf32"
    allowed = PRECISIONS.get(a.op, ("fp32", "tf32", "bf16")) + (("all",) if a.op in ALL_ALLOWED else ())
    if precision not in allowed:  # rope takes any single precision and ignores it, as it always has
        p.error(f"bench {a.op}: --precision must be one of {', '.join(allowed)}, got {precision}")
    precisions = PRECISIONS[a.op] if precision == "all" else (precision,)
    a.runs = list(zip(precisions, out_paths(a.out, a.op, precisions)))
    a.selected = None
    if a.op in ALL_ALLOWED:
        from . import workloads as W

        try:
            a.selected = W.select_cases(W.VARLEN_CASES if a.op == "varlen-attention" else W.LONG_CASES, a.cases)
        except ValueError as e:
            p.error(str(e))
    return a


def main(argv=None) -> int:
    a = parse(argv)
    if a.cmd == "compile":
        return compile_main(a)
    problem = gpu_problem()
    if problem:  # before any import that would touch the GPU: one plain paragraph, not a CUDA traceback
        print(problem, file=sys.stderr)
        return 1
    if a.op in ALL_ALLOWED:
        if a.op == "varlen-attention":
            from .bench_varlen import run
        else:
            from .bench_long import run
        rc = 0
        for precision, out in a.runs:
            rc = max(rc, run(precision, out, reps=a.reps, peers=not a.no_peers, cases=a.selected,
                             hold_host=a.hold_host))
        return rc
    cases = None if not a.cases else {int(c) for c in a.cases.split(",")}
    if a.op == "rope":
        from .bench_rope import run

        return run(a.runs[0][1], reps=a.reps or 100, peers=not a.no_peers, cases=cases, hold_host=a.hold_host)
    from .bench_attention import run

    return run(a.runs[0][0], a.runs[0][1], reps=a.reps or 20, peers=not a.no_peers, cases=cases, hold_host=a.hold_host)


if __name__ == "__main__":
    sys.exit(main())
