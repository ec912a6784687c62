"""How close do the tf32 operand copies run to the copy rate? GPU µs and TB/s (bytes read + written) of the
transposed copies the tf32 kernels read (`hopper.transposed`: permuted with the rounded row copy, as the
backward's Q^T and dO^T; permuted alone, as the forward's V^T; by tile, as the backward's K^T) and of the
rounded copy (`hopper.round32`), on a [T, NH, D] fp32 array as the varlen API passes it, timed as the benchmark
times (L2 flushed; the best of three medians); the device copy of the same bytes beside them.

    python dev/tf32_copies.py [--tokens 16384] [--heads 28] [--dims 128,80]
"""
from __future__ import annotations

import argparse

import common


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=28)
    ap.add_argument("--dims", type=common.token_list, default=[128, 80], help="head dims (default 128,80)")
    a = ap.parse_args(argv)
    import cupy
    import numpy as np

    from cupy_rope import _bench as B
    from cupy_rope.attention import hopper as H
    from cupy_rope.attention import varlen as V

    t, nh = a.tokens, a.heads
    timer = B.Timer()
    s = timer.stream.ptr
    vl = V.resolve(V.read_async(np.array([0, t], np.int32), s), t)
    tiles = vl.device_table(s)
    for d in a.dims:
        x = cupy.asarray(np.random.default_rng(0).standard_normal((t, nh, d), dtype=np.float32))
        rows = cupy.empty_like(x)
        mb = x.nbytes / 1e6
        copy = B.copy_us(timer, x.nbytes)
        print(f"T {t}, {nh} heads, head dim {d}: {mb:.0f} MB an array; device copy {copy:.1f} µs "
              f"({2 * mb / copy:.2f} TB/s)")
        for name, fn, nbytes in (
                ("transposed, permuted, with rows", lambda: H.transposed(H.token_rows(x), t, nh, d, True, s, rows=rows),
                 3 * mb),
                ("transposed, permuted", lambda: H.transposed(H.token_rows(x), t, nh, d, True, s), 2 * mb),
                ("transposed by tile", lambda: H.transposed(H.token_rows(x), t, nh, d, False, s, tiles, vl.ntiles),
                 2 * mb),
                ("rounded copy", lambda: H.round32(x, s), 2 * mb)):
            us = min(timer.gpu_us(fn, reps=30) for _ in range(3))
            print(f"  {name:34s} {us:8.1f} µs  {nbytes / us:5.2f} TB/s")


if __name__ == "__main__":
    main()
