"""Bias gradients from cuBLASLt's BGRADB epilogue, against the library's way (the product, then a separate
fixed-order column sum): which is faster for the block's two weight-gradient products, and is the epilogue's sum
as accurate?

    python dev/bgrad_probe.py --out $OUT/bgrad.json
    python dev/bgrad_probe.py --precisions bf16 --tokens 131,8192

Products (H = 3584, T tokens), row-major c = a^T b over the tokens, the bias gradient being the column sums of a:
grad_proj_weight [H, H] = dY^T O (grad_proj_bias = sum of dY's rows) and grad_qkv_weight [3H, H] = G^T X
(grad_qkv_bias = sum of G's rows). Each in the two operand layouts the library feeds cuBLAS: tokens along rows
(a [T, A], b [T, B]: cuBLAS's B transposed) and K-major (a^T [A, T], b^T [B, T]: what the tf32 plan passes).
Row-major c is column-major c^T [B x A]: the bias runs along its columns, so it is cuBLAS's BGRADB (a reduction
of its B operand, our a, over k). Three ways per product: "plain" (cuBLASLt, no epilogue), "bgrad" (BGRADB, fp32
bias) and "sum" (the library's column-sum kernel on a as stored: fp32 in tf32, the fp32 array the bf16 copy is
cast from in bf16). Every heuristic candidate (up to --candidates) is timed and the fastest kept, as the library
does; GPU µs by ``cupy_rope._bench.Timer`` (L2 flushed, events, median). Errors: relative Frobenius error of the
bias against a float64 column sum of the fp32 values, and of c against a float64 product of the operands as
given. "refused" marks a layout for which cuBLASLt has no BGRADB kernel.
"""
from __future__ import annotations

import ctypes

import numpy as np

import common

H = 3584
PRODUCTS = {"grad_proj_weight": 1, "grad_qkv_weight": 3}  # rows of c (and columns of a) in units of H
EPILOGUE, BIAS_POINTER, BIAS_DATA_TYPE = 7, 8, 26  # cublasLtMatmulDescAttributes_t
DEFAULT, BGRADB = 1, 512  # cublasLtEpilogue_t


def parse_args(argv=None):
    ap = common.gemm_lab_parser(__doc__, precisions="tf32,bf16", tokens="131,1024,8192")
    ap.add_argument("--candidates", type=int, default=8, help="heuristic candidates timed per way (default 8)")
    ap.add_argument("--reps", type=int, default=20, help="flushed repetitions per timing (default 20)")
    ap.add_argument("--out", default=None, metavar="FILE", help="write the results as JSON here")
    return ap.parse_args(argv)


class LtProduct:
    """c = op(a) op(b) (row-major, as ``cupy_rope._cublas.gemm`` takes it) through cublasLt with an epilogue:
    every heuristic candidate, run by index."""

    def __init__(self, a, b, c, trans_a, trans_b, precision, epilogue, bias, candidates):
        from cupy_rope import _cublas as B

        self.B, self.args = B, (a, b, c)
        plan = B.plan_for(a, b, c, trans_a=trans_a, trans_b=trans_b, precision=precision)
        self.lib, self.handle = plan.lib, plan.handle
        m, n, k, ta, tb, dtype, compute, lda, ldb = plan.ex
        lib = self.lib

        def new(fn, *args):
            obj = ctypes.c_void_p()
            B._check(fn(ctypes.byref(obj), *args), fn.__name__)
            return obj

        def setattr_(fn, obj, attr, v):
            B._check(fn(obj, attr, ctypes.byref(v), ctypes.sizeof(v)), fn.__name__)

        self.desc = new(lib.cublasLtMatmulDescCreate, compute, B.CUDA_R_32F)
        setattr_(lib.cublasLtMatmulDescSetAttribute, self.desc, 3, ctypes.c_int32(int(tb)))  # TRANSA
        setattr_(lib.cublasLtMatmulDescSetAttribute, self.desc, 4, ctypes.c_int32(int(ta)))  # TRANSB
        setattr_(lib.cublasLtMatmulDescSetAttribute, self.desc, EPILOGUE, ctypes.c_uint32(epilogue))
        if epilogue != DEFAULT:
            setattr_(lib.cublasLtMatmulDescSetAttribute, self.desc, BIAS_POINTER, ctypes.c_void_p(bias.data.ptr))
            setattr_(lib.cublasLtMatmulDescSetAttribute, self.desc, BIAS_DATA_TYPE, ctypes.c_int32(B.CUDA_R_32F))
        la = new(lib.cublasLtMatrixLayoutCreate, dtype, *((k, n) if tb else (n, k)), ldb)
        lb = new(lib.cublasLtMatrixLayoutCreate, dtype, *((m, k) if ta else (k, m)), lda)
        lc = new(lib.cublasLtMatrixLayoutCreate, B.CUDA_R_32F, n, m, n)
        self.layouts = (la, lb, lc)
        pref = new(lib.cublasLtMatmulPreferenceCreate)
        setattr_(lib.cublasLtMatmulPreferenceSetAttribute, pref, 1, ctypes.c_uint64(B._WORKSPACE_BYTES))
        results = (ctypes.c_char * (B._RESULT_BYTES * candidates))()
        count = ctypes.c_int(0)
        status = lib.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, la, lb, lc, lc, pref, candidates,
                                                    results, ctypes.byref(count))
        lib.cublasLtMatmulPreferenceDestroy(pref)
        raw = bytes(results)
        self.algos = [] if status else [ctypes.create_string_buffer(raw[i * B._RESULT_BYTES:i * B._RESULT_BYTES + 64],
                                                                    64) for i in range(count.value)]
        import cupy

        self.ws = cupy.empty(B._WORKSPACE_BYTES, np.uint8)

    def run(self, i: int, stream: int) -> None:
        a, b, c = self.args
        la, lb, lc = self.layouts
        self.B._check(self.lib.cublasLtMatmul(self.handle, self.desc, self.B._ONE_PTR, b.data.ptr, la, a.data.ptr,
                                              lb, self.B._ZERO_PTR, c.data.ptr, lc, c.data.ptr, lc, self.algos[i],
                                              self.ws.data.ptr, self.B._WORKSPACE_BYTES, stream), "cublasLtMatmul")


def fastest(timer, prod, stream, reps):
    """(µs, candidate) of the fastest candidate that runs; (None, None) if none does."""
    best = (None, None)
    for i in range(len(prod.algos)):
        try:
            prod.run(i, stream)
        except RuntimeError:
            continue
        us = timer.gpu_us(lambda i=i: prod.run(i, stream), reps=reps)
        if best[0] is None or us < best[0]:
            best = (us, i)
    return best


def main(argv=None):
    a = parse_args(argv)
    import cupy

    from cupy_rope import _bench
    from cupy_rope.attention import kernels as K
    from cupy_rope.precision import Precision

    timer = _bench.Timer()
    stream = cupy.cuda.get_current_stream().ptr
    rng = np.random.default_rng(0)
    rows = []
    for precision in a.precisions:
        label = precision if isinstance(precision, str) else precision.label
        for t in a.tokens:
            for name, units in PRODUCTS.items():
                cols = units * H
                g32 = cupy.asarray(rng.standard_normal((t, cols), dtype=np.float32))  # a: dY or G
                x32 = cupy.asarray(rng.standard_normal((t, H), dtype=np.float32))  # b: O or X
                ref_bias = g32.astype(np.float64).sum(axis=0)
                if label == "bf16":  # bf16 copies (the library's cast), and their values widened for the reference
                    g, x = (K.Buffers(Precision.BF16, stream).operand(v) for v in (g32, x32))
                    ops32 = [(v.view(np.uint16).astype(np.uint32) << 16).view(np.float32) for v in (g, x)]
                else:
                    g, x, ops32 = g32, x32, (g32, x32)
                ref_c = ops32[0].astype(np.float64).T @ ops32[1].astype(np.float64)
                for layout in ("tokens", "kmajor"):
                    if layout == "tokens":
                        ops, ta, tb = (g, x), True, False
                    else:
                        bits = np.uint16 if label == "bf16" else np.float32  # (CuPy copies bf16 as its bits)
                        ops = tuple(cupy.ascontiguousarray(v.view(bits).T).view(v.dtype) for v in (g, x))
                        ta, tb = False, True
                    row = {"precision": label, "tokens": t, "product": name, "layout": layout}
                    for way, epi in (("plain", DEFAULT), ("bgrad", BGRADB)):
                        c = cupy.full((cols, H), np.nan, np.float32)
                        bias = cupy.full((cols,), np.nan, np.float32)
                        prod = LtProduct(ops[0], ops[1], c, ta, tb, label, epi, bias, a.candidates)
                        us, i = fastest(timer, prod, stream, a.reps)
                        row[f"{way}_us"] = us
                        if us is None:
                            row[f"{way}_note"] = "refused"
                            continue
                        c.fill(np.nan)
                        bias.fill(np.nan)
                        prod.run(i, stream)
                        row[f"{way}_c_err"] = _bench.rel_err(c, ref_c)
                        if epi != DEFAULT:
                            row["bgrad_bias_err"] = _bench.rel_err(bias, ref_bias)
                    out = cupy.full((cols,), np.nan, np.float32)
                    row["sum_us"] = timer.gpu_us(lambda: K.colsum(g32, stream, out=out), reps=a.reps)
                    row["sum_bias_err"] = _bench.rel_err(out, ref_bias)
                    if row.get("bgrad_us") is not None:
                        row["bgrad_minus_plain_us"] = row["bgrad_us"] - row["plain_us"]
                    rows.append(row)
                    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                   for k, v in row.items()), flush=True)
    if a.out:
        from cupy_rope._bench import device_info, write_json

        write_json(a.out, {"device": device_info(), "rows": rows})


if __name__ == "__main__":
    main()
