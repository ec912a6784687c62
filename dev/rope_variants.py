"""Which vectorised RoPE backward kernel is faster at each size? The two kernels (2 and 8 elements per thread)
launched directly on the 16 RoPE workloads, next to rope_2d_backward as it dispatches (the threshold between
them) and a device copy of the same bytes, median GPU µs.

    python dev/rope_variants.py [--cases all|BxS,...] [--dtypes bf16,f16,f32] [--reps 100]
"""
from __future__ import annotations

import argparse

import common

BLOCK = 256  # threads per block of the vectorised kernels (rope.py launches them so)
SUFFIX = {"bf16": "bf16", "f16": "f16", "f32": "f32"}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--cases", type=common.rope_case_list, default="all", metavar="all|BxS[,BxS...]")
    ap.add_argument("--dtypes", default="bf16", help="grad dtypes among bf16,f16,f32 (default bf16)")
    ap.add_argument("--reps", type=int, default=100)
    a = ap.parse_args(argv)
    a.dtypes = a.dtypes.split(",")
    if any(d not in SUFFIX for d in a.dtypes):
        ap.error("--dtypes is a subset of bf16,f16,f32")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    import cupy
    import ml_dtypes
    import numpy as np

    import cupy_rope as cr
    from cupy_rope._bench import Timer, copy_us
    from cupy_rope._kernels import launcher

    dtypes = {"bf16": ml_dtypes.bfloat16, "f16": np.float16, "f32": np.float32}
    timer = Timer()
    s = timer.stream.ptr
    for dt in a.dtypes:
        kernels = {f"vec{per}": (launcher("rope", f"rope_bwd_{name}_{SUFFIX[dt]}", "ppppq"), per)
                   for name, per in (("vec2", 2), ("vec", 8))}
        for b, seq in a.cases:
            gc, gs, th = common.rope_inputs(b, seq)
            gc, gs = gc.astype(dtypes[dt]), gs.astype(dtypes[dt])
            out = cupy.empty(th.shape, np.float32)
            n = th.size
            ptrs = (gc.data.ptr, gs.data.ptr, th.data.ptr, out.data.ptr, n)
            res = {}
            for name, (k, per) in kernels.items():
                grid = (-(-n // (per * BLOCK)), 1, 1)
                res[name] = timer.gpu_us(lambda: k(grid, (BLOCK, 1, 1), ptrs, s), reps=a.reps)
            res["library"] = timer.gpu_us(lambda: cr.rope_2d_backward(gc, gs, th, out=out), reps=a.reps)
            res["copy"] = copy_us(timer, (2 * gc.itemsize + 8) * n // 2, reps=a.reps // 2)
            print(f"{dt} {b:3d} x {seq:5d}  n={n:9d}  " + "  ".join(f"{k} {v:7.2f}" for k, v in res.items()),
                  flush=True)
            gc = gs = th = out = None  # freed before the next case
            common.free_gpu()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
