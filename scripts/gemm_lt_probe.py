"""Development aid: each GEMM of the attention backward (the layouts attention.py uses) timed through
cublasGemmEx and through every cublasLt candidate kernel, against the FLOP floor at the measured GEMM rate.
Usage: gemm_lt_probe.py [precisions] [token counts] [number of cublasLt candidates asked for]"""
import sys

import cupy
import numpy as np

from cupy_rope import _checks as C
from cupy_rope import _cublas
from cupy_rope._bench import Timer

H = 3584
RATE = {"fp32": 50.8, "tf32": 422.0, "bf16": 777.0}  # TFLOP/s, the bench's 8192^3 ceilings
timer = Timer()
rng = cupy.random.default_rng(0)
precisions = sys.argv[1].split(",") if len(sys.argv) > 1 else ["tf32", "bf16", "fp32"]
tokens = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [131, 392, 773, 1176, 2048, 8192]
if len(sys.argv) > 3:
    _cublas._LT_CANDIDATES = int(sys.argv[3])
s = cupy.cuda.get_current_stream().ptr
assert _cublas._lt_library() is not None, _cublas._lt


def gemmex(a, b, c, ta, tb, precision):
    lt, _cublas._lt = _cublas._lt, "off"
    try:
        _cublas.gemm(a, b, c, trans_a=ta, trans_b=tb, precision=precision, stream=s)
    finally:
        _cublas._lt = lt


tot = {}
for precision in precisions:
    for t in tokens:
        f = np.float32
        tp = (t + 31) // 32 * 32
        r = lambda *shape: rng.standard_normal(shape, dtype=f)  # noqa: E731
        X, dY, Wq, Wp, G, O = r(t, H), r(t, H), r(3 * H, H), r(H, H), r(t, 3 * H), r(t, H)
        shapes = [("qkv", X, Wq, (t, 3 * H), False, True), ("dO", dY, Wp, (t, H), False, False),
                  ("gWp", dY, O, (H, H), True, False), ("gX", G, Wq, (t, H), False, False),
                  ("gWq", G, X, (3 * H, H), True, False)]
        if precision == "tf32":  # the weight gradients on K-major operands (dY^T, O^T, grad_qkv^T, X^T), as attention.py
            shapes[2] = ("gWp", r(H, tp), r(H, tp), (H, H), False, True)
            shapes[4] = ("gWq", r(3 * H, tp), r(H, tp), (3 * H, H), False, True)
        for name, a, b, cs, ta, tb in shapes:
            if precision == "bf16":
                a, b = a.astype(C.BF16), b.astype(C.BF16)
            c = cupy.empty(cs, f)
            flop = 2.0 * cs[0] * cs[1] * (a.shape[0] if ta else a.shape[1])
            ideal = flop / RATE[precision] / 1e6
            ex = timer.gpu_us(lambda: gemmex(a, b, c, ta, tb, precision), reps=10)
            plan = _cublas.plan_for(a, b, c, trans_a=ta, trans_b=tb, precision=precision)
            lts = [timer.gpu_us(lambda: plan.run(i, a, b, c, s, False), reps=10)
                   for i in range(len(plan.algos))]
            best = min(range(len(lts)), key=lts.__getitem__)
            key = (precision, t)
            e, b0, bb = tot.get(key, (0, 0, 0))
            tot[key] = (e + ex, b0 + lts[0], bb + lts[best])
            print(f"{precision} T={t:5d} {name:4s} ideal {ideal:8.1f}  gemmEx {ex:8.1f}  lt0 {lts[0]:8.1f}  "
                  f"best {lts[best]:8.1f} (#{best} of {len(lts)})  all {' '.join(f'{x:.0f}' for x in lts)}",
                  flush=True)
        del X, dY, Wq, Wp, G, O, shapes
        e, b0, bb = tot[(precision, t)]
        print(f"{precision} T={t:5d} SUM gemmEx {e:8.1f}  lt0 {b0:8.1f}  best {bb:8.1f}", flush=True)
