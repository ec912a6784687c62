"""Development aid: each GEMM of the attention backward timed in each of the four operand layouts that give
the same row-major product (A or A^T stored, B or B^T stored), fastest kernel of each (cublasGemmEx and
cublasLt's candidates, as gemm() autotunes), with the TFLOP/s it reaches.
Usage: gemm_layout_probe.py [precision] [token counts]"""
import sys

import cupy
import numpy as np

from cupy_rope import _checks as C
from cupy_rope import _cublas
from cupy_rope._bench import Timer

H = 3584
timer = Timer()
rng = cupy.random.default_rng(0)
precision = sys.argv[1] if len(sys.argv) > 1 else "fp32"
tokens = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [131, 773, 2048, 8192]
s = cupy.cuda.get_current_stream().ptr
assert _cublas.capturable() and _cublas._lt_library() is not None, _cublas._lt


def best_us(a, b, c, ta, tb):
    """Fastest of cublasGemmEx and the cublasLt candidates for c = op(a) op(b)."""
    plan = _cublas.plan_for(a, b, c, trans_a=ta, trans_b=tb, precision=precision)
    times = {}
    for i in [-1] + list(range(len(plan.algos))):
        try:
            times[i] = timer.gpu_us(lambda: plan.run(i, a, b, c, s, False), reps=7, warmup=2)
        except RuntimeError:
            pass
    i = min(times, key=times.__getitem__)
    return times[i], i


def variants(a, b, c):
    """The four layouts of c = a b (a, b given plain): (label, a_stored, b_stored, trans_a, trans_b)."""
    at, bt = cupy.ascontiguousarray(a.T), cupy.ascontiguousarray(b.T)
    return [("a b", a, b, False, False), ("a bT", a, bt, False, True),
            ("aT b", at, b, True, False), ("aT bT", at, bt, True, True)]


f = np.float32
r = lambda *shape: rng.standard_normal(shape, dtype=f)  # noqa: E731
cases = [("square8192", 8192, lambda t: (r(8192, 8192), r(8192, 8192)))]
for t in tokens:
    cases += [(f"qkv T={t}", t, lambda t: (r(t, H), r(H, 3 * H))),  # X Wqkv^T
              (f"dO T={t}", t, lambda t: (r(t, H), r(H, H))),  # dY Wp
              (f"gX T={t}", t, lambda t: (r(t, 3 * H), r(3 * H, H))),  # grad_qkv Wqkv
              (f"gWp T={t}", t, lambda t: (r(H, t), r(t, H))),  # dY^T O
              (f"gWq T={t}", t, lambda t: (r(3 * H, t), r(t, H)))]  # grad_qkv^T X
for name, t, make in cases:
    a, b = make(t)
    if precision == "bf16":
        a, b = a.astype(C.BF16), b.astype(C.BF16)
    c = cupy.empty((a.shape[0], b.shape[1]), f)
    flop = 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
    row = []
    for label, ao, bo, ta, tb in variants(a, b, c):
        us, i = best_us(ao, bo, c, ta, tb)
        row.append(f"[{label}] {us:8.1f} us {flop / us / 1e6:5.1f} TF/s (#{i})")
    print(f"{precision} {name:12s} " + "  ".join(row), flush=True)
    del a, b, c
    cupy.get_default_memory_pool().free_all_blocks()
