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
varlen and block); the bf16 forward over 176-key tiles (head dim 128).
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
    on = lambda p: dataclasses.replace(p, hopper=True)  # noqa: E731
    fused = lambda p: dataclasses.replace(p, hopper=True, fused_dq=True)  # noqa: E731 - dQ from the last key tile
    rng = cupy.random.default_rng(0)
    for d, lens, dt in ((64, (5, 0, 600, 1), cupy.float32), (80, (200, 70), "bf16")):
        t, nh = sum(lens), 2
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        x = [rng.standard_normal((t, nh, d), dtype=cupy.float32) for _ in range(4)]
        if dt == "bf16":
            from cupy_rope.attention.flash import _bf16
            x = [_bf16(a, cupy.cuda.get_current_stream().ptr) for a in x]
        q, k, v, go = x
        o, lse = cr.varlen_attention_forward(q, k, v, cu, precision="bf16", plan=on)
        cr.varlen_attention_backward(go, q, k, v, o, lse, cu, precision="bf16", plan=on)
        cr.varlen_attention_backward(go, q, k, v, o, lse, cu, precision="bf16", plan=fused)
    for d, lens in ((64, (5, 0, 130, 1)), (80, (3, 200, 70))):  # tf32: sequence starts off the 8-token grid
        t, nh = sum(lens), 2
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        q, k, v, go = (rng.standard_normal((t, nh, d), dtype=cupy.float32) for _ in range(4))
        o, lse = cr.varlen_attention_forward(q, k, v, cu, precision="tf32", plan=on)
        cr.varlen_attention_backward(go, q, k, v, o, lse, cu, precision="tf32", plan=on)
    t, h, nh = 300, 256, 2
    f = lambda *s: rng.standard_normal(s, dtype=cupy.float32)  # noqa: E731
    cu = np.array([0, 131, 300], np.int32)
    for precision in ("bf16", "tf32"):
        cr.vision_attention_backward(f(t, h), f(t, h), f(3 * h, h) * 0.02, f(3 * h) * 0.01, f(h, h) * 0.02,
                                     f(h) * 0.01, f(t, h // nh), f(t, h // nh), cu, num_heads=nh, precision=precision,
                                     plan=on)
    # the tail split of the specialised bf16 backward (more units than SMs: the first ones in parts, some with no
    # steps), varlen with and without the dQ write in the last key tile, and the block's epilogue
    lens = (2, 1500, 0, 700, 1)
    t, nh, d = sum(lens), 8, 64
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    q, k, v, go = (rng.standard_normal((t, nh, d), dtype=cupy.float32) for _ in range(4))
    o, lse = cr.varlen_attention_forward(q, k, v, cu, precision="bf16", plan=on)
    for fd in (False, True):
        split = lambda p, fd=fd: dataclasses.replace(p, hopper=True, fused_dq=fd, tail_parts=3,  # noqa: E731
                                                     query_rows=64)
        cr.varlen_attention_backward(go, q, k, v, o, lse, cu, precision="bf16", plan=split)
    t, h, nh = 2202, 1024, 8
    cu = np.array([0, 2, 1502, 2202], np.int32)
    split = lambda p: dataclasses.replace(p, hopper=True, tail_parts=3, query_rows=64)  # noqa: E731
    q80 = lambda p: dataclasses.replace(p, hopper=True, fused_dq=False, query_rows=80)  # noqa: E731
    for plan in (split, q80):
        cr.vision_attention_backward(f(t, h), f(t, h), f(3 * h, h) * 0.02, f(3 * h) * 0.01, f(h, h) * 0.02,
                                     f(h) * 0.01, f(t, h // nh), f(t, h // nh), cu, num_heads=nh, precision="bf16",
                                     plan=plan)
    # 80-row query steps (head dim 128): sequences ending before, on and after a step's edge
    lens = (1, 0, 81, 700, 160)
    t, nh, d = sum(lens), 2, 128
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    q, k, v, go = (rng.standard_normal((t, nh, d), dtype=cupy.float32) for _ in range(4))
    o, lse = cr.varlen_attention_forward(q, k, v, cu, precision="bf16", plan=on)
    cr.varlen_attention_backward(go, q, k, v, o, lse, cu, precision="bf16", plan=q80)
    k176 = lambda p: dataclasses.replace(p, hopper=True, fwd_keys=176)  # noqa: E731 - K/V tiles of 176 keys
    cr.varlen_attention_forward(q, k, v, cu, precision="bf16", plan=k176)
    cupy.cuda.runtime.deviceSynchronize()
    print("sanitize_sm90: done")


if __name__ == "__main__":
    import common  # dev/common.py: the kernels built with -lineinfo for the whole run when asked

    with common.sm90_build(("-lineinfo",) if "--lineinfo" in sys.argv[1:] else ()):
        main()
