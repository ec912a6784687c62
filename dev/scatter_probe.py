"""How close is the dense form's gradient scatter to the rate its bytes allow? `dense_scatter` at the seed model's
shape (dq, dk, dv of NH heads x D back to grad_qkv [T, 3H] and its transpose [3H, T'], RoPE on dq and dk, the bias
column partials), beside the same launch with parts of its work left out and beside plain kernels that move the
same bytes in the same proportions (one read, two writes; one read, one write). GPU µs per launch (mean of
back-to-back launches, events) and the rate over the bytes each moves. Lab only: inputs random, results unused.

    python dev/scatter_probe.py [--tokens 8192] [--heads 28] [--head-dim 128] [--reps 50]
"""
from __future__ import annotations

import argparse

import cupy
import numpy as np

from cupy_rope.attention import kernels as K
from cupy_rope.attention import dense

PLAIN = r"""
extern "C" __global__ void read1_write2(const float4* __restrict__ x, float4* __restrict__ a, float4* __restrict__ b,
                                        long long n) {
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
        const float4 v = x[i];
        a[i] = v;
        b[i] = v;
    }
}
extern "C" __global__ void read1_write1(const float4* __restrict__ x, float4* __restrict__ a, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        a[i] = x[i];
}
"""


def timed(fn, reps):
    fn()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) * 1e3 / reps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=28)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=50)
    a = ap.parse_args(argv)
    t, nh, d = a.tokens, a.heads, a.head_dim
    h, tp = nh * d, K.padded(t)
    rng = cupy.random.default_rng(0)
    src = rng.standard_normal((3, nh * t, d), dtype=np.float32)
    rows = cupy.stack([cupy.arange(t, dtype=np.int32), cupy.full(t, t, np.int32)], axis=1)  # [NH][T][D] order
    cos, sin = (rng.standard_normal((t, d), dtype=np.float32) for _ in range(2))
    out = cupy.empty((t, 3 * h), np.float32)
    out_t = cupy.empty((3 * h, tp), np.float32)
    part = cupy.empty((dense.scatter_chunks(t), 3 * h), np.float32)
    grid = (dense.scatter_chunks(t), 3 * nh, 1)
    kern = K.attn_kernel("dense_scatter", "tf32", d)
    ptr = lambda x: 0 if x is None else x.data.ptr  # noqa: E731
    mb = src.nbytes

    def scatter(rope=2, o=out, ot=out_t, p=part, tables=True):
        args = (src.data.ptr, rows.data.ptr, ptr(cos if tables else None), ptr(sin if tables else None), 0, rope,
                ptr(o), 3 * h, ptr(ot), tp, ptr(p), t, nh)
        return lambda: kern(grid, (K.THREADS, 1, 1), args, 0, kern.max_smem)

    mod = cupy.RawModule(code=PLAIN)
    r1w2, r1w1 = mod.get_function("read1_write2"), mod.get_function("read1_write1")
    n4 = src.size // 4
    y1, y2 = cupy.empty_like(src), cupy.empty_like(src)
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    cases = [
        ("scatter as the library runs it", scatter(), 3 * mb),
        ("  no RoPE", scatter(rope=0, tables=False), 3 * mb),
        ("  no bias partials", scatter(p=None), 3 * mb),
        ("  token-major out only", scatter(ot=None, p=None), 2 * mb),
        ("  transposed out only (+partials)", scatter(o=None), 2 * mb),
        ("plain: read 1, write 2", lambda: r1w2((sms * 8,), (256,), (src, y1, y2, np.int64(n4))), 3 * mb),
        ("plain: read 1, write 1", lambda: r1w1((sms * 8,), (256,), (src, y1, np.int64(n4))), 2 * mb),
    ]
    print(f"dense_scatter probe: T {t}, {nh} heads, D {d}, src {mb / 1e6:.0f} MB, {a.reps} launches each")
    for name, fn, nbytes in cases:
        us = timed(fn, a.reps)
        print(f"{name:36s} {us:8.1f} us  {nbytes / us / 1e6:5.2f} TB/s over {nbytes / 1e6:.0f} MB")


if __name__ == "__main__":
    main()
