"""Small calls of every sm_90a attention kernel, for compute-sanitizer (memcheck, racecheck):

    compute-sanitizer --tool memcheck python3 dev/sanitize_sm90.py
    compute-sanitizer --tool racecheck --show-backtrace no python3 dev/sanitize_sm90.py --lineinfo
    compute-sanitizer --tool synccheck python3 dev/sanitize_sm90.py --groups block-q80,varlen-q80

``--lineinfo`` builds the sm_90a kernels with line information, so that reports name source lines (of the
module as NVRTC sees it, includes inlined: ``cupy_rope._kernels.source("attention_sm90")``).
Varlen attention forward and backward (bf16 with bf16 and fp32 inputs, with and without the dQ write in the last
key tile; tf32; head dims 64, 80 (and 128 for tf32), empty and one-token sequences, a
sequence of five key tiles (the forward's three K/V stages reused), sequences starting and ending mid-tile) and the
vision block's
bf16 and tf32 backward, all on the Hopper path; the bf16 backward's tail split (varlen and block), the two-stage
tf32 backward's (varlen), and the bf16 one's 80-row
query steps (head dim 128, varlen and block); the bf16 forward over 192-key tiles (head dim 128); the persistent
bf16 forward with O from registers and through the copy engine (head dims 64, 96, 128; varlen and block). The bf16
specialised backward's full query steps at head dims 64 and 128 (80 rows) add dQ through tensor reductions, its
partial ones by threads: both are in these calls. The two-stage tf32 backward on sequences of whole 64-token
steps, whose first key tiles store their dQ^T into an accumulator that is not zeroed (varlen, tail split, block).
The calls run in named groups (``--groups``, all by default),
each synchronised and reported when done, so that a tool that slows them down can cover them over several
runs.
"""
from __future__ import annotations

import argparse
import dataclasses

import numpy as np


GROUPS = ("varlen-bf16", "varlen-tf32", "tf32-stores", "block", "tail-split", "block-q80", "varlen-q80",
          "fwd-persistent")


def main(groups=GROUPS):
    import cupy

    import cupy_rope as cr
    from cupy_rope.attention import hopper

    assert hopper.supported(), "needs an sm_90 GPU"
    # cuBLAS's heuristic choice for each product: timing every candidate under racecheck ended the process (a
    # block call with the autotuner finished in 7 s without it; bench/NOTES.md), and those kernels are not ours
    cr.set_gemm_autotune(False)
    rng = cupy.random.default_rng(0)
    f = lambda *s: rng.standard_normal(s, dtype=cupy.float32)  # noqa: E731

    def mark(what):  # each group's kernels finished before the next: a failure shows after the last mark
        cupy.cuda.runtime.deviceSynchronize()
        print("sanitize_sm90:", what, "done", flush=True)

    def plan(**fields):  # the library's plan on the Hopper path, with these fields replaced
        return lambda p: dataclasses.replace(p, hopper=True, **fields)

    def varlen(lens, nh, d):  # cu_seqlens of ``lens`` and fresh q, k, v, dO [T, nh, d] (fp32)
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        return (cu,) + tuple(f(int(cu[-1]), nh, d) for _ in range(4))

    def block(cu, h, nh, precision, p):  # the vision block's backward, hidden h, nh heads
        t = int(cu[-1])
        cr.vision_attention_backward(f(t, h), f(t, h), f(3 * h, h) * 0.02, f(3 * h) * 0.01, f(h, h) * 0.02,
                                     f(h) * 0.01, f(t, h // nh), f(t, h // nh), cu, num_heads=nh, precision=precision,
                                     plan=p)

    q80 = plan(fused_dq=False, query_rows=80)
    if "varlen-bf16" in groups:
        for d, lens, dt in ((64, (5, 0, 600, 1), cupy.float32), (80, (200, 70), "bf16")):
            cu, *x = varlen(lens, 2, d)
            if dt == "bf16":
                from cupy_rope.attention.flash import _bf16
                x = [_bf16(a, cupy.cuda.get_current_stream().ptr) for a in x]
            q, k, v, go = x
            o, lse = cr.varlen_attention_forward(q, k, v, cu, precision="bf16", plan=plan())
            cr.varlen_attention_backward(go, q, k, v, o, lse, cu, precision="bf16", plan=plan())
            # dQ from the last key tile
            cr.varlen_attention_backward(go, q, k, v, o, lse, cu, precision="bf16", plan=plan(fused_dq=True))
            mark(f"varlen-bf16 D {d}")
    if "varlen-tf32" in groups:
        # tf32: sequence starts off the 8-token grid; the two-stage specialised backward at each head dim (dQ^T
        # through the copy engine: D 64 one 64-row block, D 80 two with the second's rows past D not staged, D 128
        # two)
        for d, lens in ((64, (5, 0, 130, 1)), (80, (3, 200, 70)), (128, (3, 200, 70))):
            cu, q, k, v, go = varlen(lens, 2, d)
            o, lse = cr.varlen_attention_forward(q, k, v, cu, precision="tf32", plan=plan())
            cr.varlen_attention_backward(go, q, k, v, o, lse, cu, precision="tf32", plan=plan())
            mark(f"varlen-tf32 D {d}")
    if "tf32-stores" in groups:
        # sequences of whole 64-token steps (the last ends at T): the two-stage tf32 backward's first key tiles
        # store their dQ^T shares into an accumulator that is not zeroed (hopper.first_tile_stores); varlen at D 64
        # and 128, the tail split at D 80, the block
        for d in (64, 128):
            cu, q, k, v, go = varlen((128, 0, 64, 70), 2, d)
            o, lse = cr.varlen_attention_forward(q, k, v, cu, precision="tf32", plan=plan())
            cr.varlen_attention_backward(go, q, k, v, o, lse, cu, precision="tf32", plan=plan())
            mark(f"tf32-stores varlen D {d}")
        cu, q, k, v, go = varlen((1536, 0, 640, 64, 1), 8, 80)
        o, lse = cr.varlen_attention_forward(q, k, v, cu, precision="tf32", plan=plan())
        cr.varlen_attention_backward(go, q, k, v, o, lse, cu, precision="tf32", plan=plan(tail_parts=3))
        mark("tf32-stores tail split")
        block(np.array([0, 128, 200], np.int32), 256, 2, "tf32", plan())
        mark("tf32-stores block")
    if "block" in groups:
        for precision in ("bf16", "tf32"):
            block(np.array([0, 131, 300], np.int32), 256, 2, precision, plan())
            mark(f"block {precision}")
    if "tail-split" in groups:
        # the tail split of the specialised bf16 backward (more units than SMs: the first ones in parts, some with
        # no steps), varlen with and without the dQ write in the last key tile, and the block's epilogue
        cu, q, k, v, go = varlen((2, 1500, 0, 700, 1), 8, 64)
        o, lse = cr.varlen_attention_forward(q, k, v, cu, precision="bf16", plan=plan())
        for fd in (False, True):
            cr.varlen_attention_backward(go, q, k, v, o, lse, cu, precision="bf16",
                                         plan=plan(fused_dq=fd, tail_parts=3, query_rows=64))
        mark("tail-split varlen")
        # ... and of the two-stage tf32 backward (8 heads x 40 units of 64 keys, D 80: rows past D not staged)
        cu, q, k, v, go = varlen((2, 1500, 0, 700, 1), 8, 80)
        o, lse = cr.varlen_attention_forward(q, k, v, cu, precision="tf32", plan=plan())
        cr.varlen_attention_backward(go, q, k, v, o, lse, cu, precision="tf32", plan=plan(tail_parts=3))
        mark("tail-split varlen tf32")
        block(np.array([0, 2, 1502, 2202], np.int32), 1024, 8, "bf16", plan(tail_parts=3, query_rows=64))
        mark("tail-split block")
    if "block-q80" in groups:  # 80-row query steps (head dim 128) in the block
        block(np.array([0, 2, 1502, 2202], np.int32), 1024, 8, "bf16", q80)
        mark("block-q80")
    if "varlen-q80" in groups:
        # 80-row query steps (head dim 128): sequences ending before, on and after a step's edge; K/V tiles of 192
        cu, q, k, v, go = varlen((1, 0, 81, 700, 160), 2, 128)
        o, lse = cr.varlen_attention_forward(q, k, v, cu, precision="bf16", plan=plan())
        cr.varlen_attention_backward(go, q, k, v, o, lse, cu, precision="bf16", plan=q80)
        cr.varlen_attention_forward(q, k, v, cu, precision="bf16", plan=plan(fwd_keys=192))
        mark("varlen-q80 (and 192-key forward)")
    if "fwd-persistent" in groups:
        # the persistent bf16 forward, O from registers and through the copy engine (rows past a sequence's end
        # from registers), sequences of 0-2 query tiles ending before, on and after a tile's edge; with delta
        for d in (64, 96, 128):
            cu, q, k, v, go = varlen((5, 0, 200, 1, 128, 129, 256), 3, d)
            for bulk in (False, True):
                cr.varlen_attention_forward(q, k, v, cu, precision="bf16",
                                            plan=plan(fwd_persistent=True, fwd_o_bulk=bulk))
            mark(f"fwd-persistent D {d}")
        block(np.array([0, 131, 300, 301, 556], np.int32), 256, 2, "bf16", plan(fwd_persistent=True, fwd_o_bulk=True))
        mark("fwd-persistent block")
    print("sanitize_sm90: done")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--lineinfo", action="store_true", help="build the sm_90a kernels with line information")
    ap.add_argument("--switch", action="append", default=[], metavar="-DNAME=VALUE",
                    help="a build switch of the sm_90a kernels (repeatable), e.g. -DCUPY_ROPE_TF32_DQ_SPLIT=1")
    ap.add_argument("--groups", default=",".join(GROUPS),
                    help=f"comma-separated call groups to run, in this order (default all: {','.join(GROUPS)})")
    args = ap.parse_args(argv)
    args.groups = tuple(g for g in args.groups.split(",") if g)
    unknown = set(args.groups) - set(GROUPS)
    if unknown:
        ap.error(f"unknown group(s) {', '.join(sorted(unknown))}; groups: {', '.join(GROUPS)}")
    return args


if __name__ == "__main__":
    import common  # dev/common.py: the kernels built with -lineinfo for the whole run when asked

    args = parse_args()
    with common.sm90_build((("-lineinfo",) if args.lineinfo else ()) + tuple(args.switch)):
        main(args.groups)
