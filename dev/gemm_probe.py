"""How fast is each GEMM of the attention backward, per operand layout and per cuBLAS kernel? Each of the five
products, in each of the four stored layouts that give the same row-major result, timed as gemm() runs it
(auto: the kernel its first call picks by timing) and with every candidate forced: cublasGemmEx's own kernel,
the row split, and each cublasLt heuristic candidate. TFLOP/s and the share of the 8192^3 rate measured in the
same run (the benchmark's GEMM ceiling).

    python dev/gemm_probe.py --precisions tf32 --tokens 131,773,2048,8192
    python dev/gemm_probe.py --precisions fp32 --products dO,gX --layouts NN,TN --all-candidates
    python dev/gemm_probe.py --precisions bf16 --lt-candidates 16 --split-rows 256
    python dev/gemm_probe.py --precisions tf32,bf16 --tokens 131 --split-k 2,3,4,6,8 --all-candidates

Products (H = hidden 3584, T tokens): qkv = X Wqkv^T [T, 3H], dO = dY Wp [T, H], gX = G Wqkv [T, H],
gWp = dY^T O [H, H], gWq = G^T X [3H, H]. Layouts are gemm()'s (trans_a, trans_b): N uses the operand as
stored, T its transpose (the stored array holds op(x)^T). Operands whose rows run along tokens are stored with
the token count padded to --pad (a column slice of a wider array), as the library's transposed copies are.
--lt-candidates, --split-rows and --split-k pass a GemmConfig to gemm() and to its plan; candidates are
named as _LtPlan.label names them (lt2k4: the heuristic's third kernel, contraction split 4 ways).
"""
from __future__ import annotations

import common

H = 3584
PRODUCTS = {  # name -> (m, k, n) of C[m, n] = A[m, k] B[k, n], as functions of T; which of m, k is the tokens
    "qkv": (lambda t: (t, H, 3 * H), "m"),
    "dO": (lambda t: (t, H, H), "m"),
    "gX": (lambda t: (t, 3 * H, H), "m"),
    "gWp": (lambda t: (H, t, H), "k"),
    "gWq": (lambda t: (3 * H, t, H), "k"),
}
LAYOUTS = {"NN": (False, False), "NT": (False, True), "TN": (True, False), "TT": (True, True)}


def parse_args(argv=None):
    ap = common.gemm_lab_parser(__doc__, precisions="tf32", tokens="131,773,2048,8192")
    ap.add_argument("--products", default=",".join(PRODUCTS), help=f"subset of {','.join(PRODUCTS)}")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"subset of {','.join(LAYOUTS)}")
    ap.add_argument("--pad", type=int, default=32, help="token count padding of token-major operands (1: none)")
    ap.add_argument("--all-candidates", action="store_true", help="print every candidate's time")
    ap.add_argument("--reps", type=int, default=7, help="repetitions per timing (default 7)")
    ap.add_argument("--lt-candidates", type=int, default=None, help="GemmConfig.lt_candidates")
    ap.add_argument("--split-rows", type=int, default=None, help="GemmConfig.split_rows")
    ap.add_argument("--split-k", default=None, help="GemmConfig.split_k, comma-separated counts (e.g. 2,3,4,8)")
    a = ap.parse_args(argv)
    a.products = a.products.split(",")
    a.layouts = a.layouts.split(",")
    if any(p not in PRODUCTS for p in a.products) or any(x not in LAYOUTS for x in a.layouts):
        ap.error("unknown product or layout")
    return a


def operands(m, k, n, token_dim, ta, tb, pad, precision, rng):
    """Random stored a, b and an output c for C[m, n] = op(a) op(b) in layout (ta, tb)."""
    import cupy
    import ml_dtypes
    import numpy as np

    def stored(rows, cols, cols_are_tokens):
        width = -(-cols // pad) * pad if cols_are_tokens else cols
        x = rng.standard_normal((rows, width), dtype=np.float32)[:, :cols]
        return x.astype(ml_dtypes.bfloat16) if precision == "bf16" else x

    a = stored(k, m, token_dim == "m") if ta else stored(m, k, token_dim == "k")
    b = stored(n, k, token_dim == "k") if tb else stored(k, n, False)
    return a, b, cupy.empty((m, n), np.float32)


def main(argv=None) -> int:
    a = parse_args(argv)
    import cupy

    from cupy_rope import _bench as B
    from cupy_rope import _cublas

    kw = {}
    split_k = tuple(int(v) for v in a.split_k.split(",")) if a.split_k else None
    if a.lt_candidates is not None or a.split_rows is not None or split_k is not None:
        fields = {k: v for k, v in (("lt_candidates", a.lt_candidates), ("split_rows", a.split_rows),
                                    ("split_k", split_k)) if v is not None}
        kw["config"] = _cublas.GemmConfig(**fields)
    timer = B.Timer()
    s = cupy.cuda.get_current_stream().ptr
    rng = cupy.random.default_rng(0)
    for precision in a.precisions:
        ceiling = B.gemm_TFLOPs(timer, precision)
        print(f"# {precision}: 8192^3 through gemm() {ceiling:.1f} TFLOP/s", flush=True)
        for t in a.tokens:
            sums = {lay: [0.0, 0.0] for lay in a.layouts}  # auto, best
            for name in a.products:
                shape, token_dim = PRODUCTS[name]
                m, k, n = shape(t)
                flop = 2.0 * m * n * k
                for lay in a.layouts:
                    ta, tb = LAYOUTS[lay]
                    x, y, c = operands(m, k, n, token_dim, ta, tb, a.pad, precision, rng)
                    gemm = lambda x=x, y=y, c=c: _cublas.gemm(  # noqa: E731
                        x, y, c, trans_a=ta, trans_b=tb, precision=precision, stream=s, **kw)
                    auto = timer.gpu_us(gemm, reps=a.reps, warmup=2)
                    try:
                        plan = _cublas.plan_for(x, y, c, trans_a=ta, trans_b=tb, precision=precision, **kw)
                    except Exception as e:  # noqa: BLE001 - no direct cuBLAS path or cublasLt: auto only
                        raise SystemExit(f"per-candidate timing needs cuBLAS's direct path and cublasLt: {e}")
                    times = {}
                    for i in plan.candidates():
                        try:
                            times[i] = timer.gpu_us(lambda p=plan, x=x, y=y, c=c: p.run(i, x, y, c, s, False),
                                                    reps=a.reps, warmup=2)
                        except RuntimeError:  # a candidate that refuses these operands
                            pass
                    best = min(times, key=times.__getitem__)
                    sums[lay][0] += auto
                    sums[lay][1] += times[best]
                    line = (f"{precision} T={t:5d} {name:4s} {lay}  auto {auto:8.1f} us {flop / auto / 1e6:6.1f} TF/s "
                            f"{flop / auto / 1e6 / ceiling:4.0%}  best {plan.label(best):7s} "
                            f"{times[best]:8.1f}  gemmEx {times.get(-1, float('nan')):8.1f}")
                    if a.all_candidates:
                        line += "  all " + " ".join(f"{plan.label(i)}={v:.0f}" for i, v in times.items())
                    print(line, flush=True)
                    del x, y, c, plan
                    common.free_gpu()
            print(f"{precision} T={t:5d} SUM  " + "  ".join(f"{lay} auto {v[0]:8.1f} best {v[1]:8.1f}"
                                                             for lay, v in sums.items()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
