"""Development aid: the five backward GEMM shapes in bf16 mode three ways: native bf16 operands (after a cast),
fp32 operands with CUBLAS_COMPUTE_32F_FAST_16BF (cuBLAS converts on the fly), and the latter with K-major operands."""
import cupy
import numpy as np

from cupy_rope import _checks as C
from cupy_rope import _cublas
from cupy_rope._bench import Timer

H = 3584
timer = Timer()
rng = cupy.random.default_rng(0)


def gemm_fast16bf(a, b, c, trans_a, trans_b):
    runtime, cublas = _cublas._libs()
    m, k = (a.shape[1], a.shape[0]) if trans_a else a.shape
    kb, n = (b.shape[1], b.shape[0]) if trans_b else b.shape
    assert k == kb and c.shape == (m, n)
    h = _cublas._handle(runtime.getDevice())  # CuPy's gemmEx binds it to the current stream
    cublas.gemmEx(h, 1 if trans_b else 0, 1 if trans_a else 0, n, m, k, _cublas._ONE_PTR, b.data.ptr, 0, b.shape[1],
                  a.data.ptr, 0, a.shape[1], _cublas._ZERO_PTR, c.data.ptr, 0, n, 75, -1)


for t in (131, 1176, 8192):
    f = np.float32
    X = rng.standard_normal((t, H), dtype=f)
    dY = rng.standard_normal((t, H), dtype=f)
    Wq = rng.standard_normal((3 * H, H), dtype=f)
    Wp = rng.standard_normal((H, H), dtype=f)
    G = rng.standard_normal((t, 3 * H), dtype=f)
    O = rng.standard_normal((t, H), dtype=f)
    s = cupy.cuda.get_current_stream().ptr
    # (name, a, b, c-shape, trans_a, trans_b); K-major variants use transposed copies
    shapes = [("qkv", X, Wq, (t, 3 * H), False, True, None),
              ("dO", dY, Wp, (t, H), False, False, (dY, cupy.ascontiguousarray(Wp.T), False, True)),
              ("gWp", dY, O, (H, H), True, False, (cupy.ascontiguousarray(dY.T), cupy.ascontiguousarray(O.T), False, True)),
              ("gX", G, Wq, (t, H), False, False, (G, cupy.ascontiguousarray(Wq.T), False, True)),
              ("gWq", G, X, (3 * H, H), True, False, (cupy.ascontiguousarray(G.T), cupy.ascontiguousarray(X.T), False, True))]
    for name, a, b, cs, ta, tb, km in shapes:
        c = cupy.empty(cs, f)
        ab, bb = a.astype(C.BF16), b.astype(C.BF16)
        t_bf16 = timer.gpu_us(lambda: _cublas.gemm(ab, bb, c, trans_a=ta, trans_b=tb, precision="bf16", stream=s), reps=10)
        t_cast = timer.gpu_us(lambda: (a.astype(C.BF16), b.astype(C.BF16)), reps=10)
        t_tf32 = timer.gpu_us(lambda: _cublas.gemm(a, b, c, trans_a=ta, trans_b=tb, precision="tf32", stream=s), reps=10)
        t_f16 = timer.gpu_us(lambda: gemm_fast16bf(a, b, c, ta, tb), reps=10)
        line = f"T={t:5d} {name:4s} bf16 {t_bf16:8.1f} (+cast {t_cast:7.1f})  tf32 {t_tf32:8.1f}  fp32in-fast16bf {t_f16:8.1f}"
        if km is not None:
            a2, b2, ta2, tb2 = km
            line += f"  kmajor {timer.gpu_us(lambda: gemm_fast16bf(a2, b2, c, ta2, tb2), reps=10):8.1f}"
        print(line, flush=True)

X = rng.standard_normal((131, H), dtype=np.float32)
W = rng.standard_normal((3 * H, H), dtype=np.float32)
c = cupy.empty((131, 3 * H), np.float32)
gemm_fast16bf(X, W, c, False, True)
ref = X.astype(np.float64) @ W.astype(np.float64).T
print("fast16bf rel err", float(cupy.linalg.norm(c - ref) / cupy.linalg.norm(ref)))
