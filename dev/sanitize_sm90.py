"""Small calls of every sm_90a attention kernel, for compute-sanitizer (memcheck, racecheck):

    compute-sanitizer --tool memcheck python3 dev/sanitize_sm90.py
    compute-sanitizer --tool racecheck --show-backtrace no python3 dev/sanitize_sm90.py --lineinfo

``--lineinfo`` builds the sm_90a kernels with line information, so that reports name source lines (of the
module as NVRTC sees it, includes inlined: ``cupy_rope._kernels.source("attention_sm90")``).
Varlen attention forward and backward (bf16 with bf16 and fp32 inputs, with and without the dQ write in the
last key tile, and tf32; head dims 64 and 80, empty and one-token sequences, a sequence of five key tiles (the
forward's three K/V stages reused), sequences starting and ending
mid-tile) and the vision block's bf16 and tf32 backward, all on
the Hopper path; the bf16 backward's tail split (varlen and block) and its 80-row query steps (head dim 128,
varlen and block); the bf16 forward over 192-key tiles (head dim 128). The bf16 specialised backward's full
query steps at head dims 64 and 128 (80 rows) add dQ through tensor reductions, its partial ones by threads:
both are in these calls.
"""
from __future__ import annotations

import dataclasses
import sys

import numpy as np


def main():
    import cupy

    import cupy_rope as cr
    from cupy_rope.attention import hopper

    assert hopper.supported(), "needs an sm_90 GPU"
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
        mark(f"varlen bf16 D {d}")
    for d, lens in ((64, (5, 0, 130, 1)), (80, (3, 200, 70))):  # tf32: sequence starts off the 8-token grid
        cu, q, k, v, go = varlen(lens, 2, d)
        o, lse = cr.varlen_attention_forward(q, k, v, cu, precision="tf32", plan=plan())
        cr.varlen_attention_backward(go, q, k, v, o, lse, cu, precision="tf32", plan=plan())
        mark(f"varlen tf32 D {d}")
    for precision in ("bf16", "tf32"):
        block(np.array([0, 131, 300], np.int32), 256, 2, precision, plan())
        mark(f"block {precision}")
    # the tail split of the specialised bf16 backward (more units than SMs: the first ones in parts, some with no
    # steps), varlen with and without the dQ write in the last key tile, and the block's epilogue
    cu, q, k, v, go = varlen((2, 1500, 0, 700, 1), 8, 64)
    o, lse = cr.varlen_attention_forward(q, k, v, cu, precision="bf16", plan=plan())
    for fd in (False, True):
        cr.varlen_attention_backward(go, q, k, v, o, lse, cu, precision="bf16",
                                     plan=plan(fused_dq=fd, tail_parts=3, query_rows=64))
    mark("varlen bf16 tail split")
    cu = np.array([0, 2, 1502, 2202], np.int32)
    q80 = plan(fused_dq=False, query_rows=80)
    for p in (plan(tail_parts=3, query_rows=64), q80):  # and 80-row query steps (head dim 128)
        block(cu, 1024, 8, "bf16", p)
    mark("block bf16 tail split, 80 rows")
    # 80-row query steps (head dim 128): sequences ending before, on and after a step's edge; K/V tiles of 192 keys
    cu, q, k, v, go = varlen((1, 0, 81, 700, 160), 2, 128)
    o, lse = cr.varlen_attention_forward(q, k, v, cu, precision="bf16", plan=plan())
    cr.varlen_attention_backward(go, q, k, v, o, lse, cu, precision="bf16", plan=q80)
    cr.varlen_attention_forward(q, k, v, cu, precision="bf16", plan=plan(fwd_keys=192))
    mark("varlen bf16 80 rows, 192 keys")
    print("sanitize_sm90: done")


if __name__ == "__main__":
    import common  # dev/common.py: the kernels built with -lineinfo for the whole run when asked

    with common.sm90_build(("-lineinfo",) if "--lineinfo" in sys.argv[1:] else ()):
        main()
