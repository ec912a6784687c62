"""Small calls of every kernel, for compute-sanitizer (memcheck, racecheck, initcheck).
With --gemm-heuristic, cuBLAS runs its heuristic's kernels instead of the ones the autotuner picks."""
import sys

import cupy
import numpy as np

import cupy_rope as cr
from cupy_rope import _checks as C
from cupy_rope import attention as A
from cupy_rope import rope
from cupy_rope.bench_attention import make_inputs

if "--gemm-heuristic" in sys.argv:
    cr.set_gemm_autotune(False)
rng = cupy.random.default_rng(7)
for dt in (C.BF16, C.F16, C.F32):
    gc = rng.standard_normal((3, 37, 130), dtype=np.float32).astype(dt)
    gs = rng.standard_normal((3, 37, 130), dtype=np.float32).astype(dt)
    th = rng.standard_normal((3, 37, 130), dtype=np.float32) * 100
    for per_thread_2 in (True, False):  # both vectorised kernels
        rope.VEC2_MAX_ELEMENTS = 1 << 62 if per_thread_2 else -1
        cr.rope_2d_backward(gc, gs, th)
    cr.rope_2d_backward(gc[:, ::2], gs[:, ::2], th[:, ::2])
    cr.rope_2d_forward(th, dtype=dt)
    cr.rope_2d_forward(th[:, 1:], dtype=dt)
for prec in ("tf32", "bf16", "fp32"):
    for hidden, d, t, n in ((256, 128, 150, 3), (160, 80, 70, 2)):
        x = make_inputs(t, n, rng, hidden=hidden, head_dim=d)
        args = [x[k] for k in ("grad_output", "hidden_states", "qkv_weight", "qkv_bias", "proj_weight", "proj_bias",
                               "cos", "sin", "cu_seqlens")]
        for _ in range(3):  # issued directly, then recorded into a CUDA graph, then replayed
            cr.vision_attention_backward(*args, precision=prec)
        cr.vision_attention_forward(*args[1:], precision=prec)
A.FP32_NT_QKV_MIN_TOKENS = 0  # the fp32 QKV product from transposed copies of X and Wqkv as well
for _ in range(3):
    cr.vision_attention_backward(*args, precision="fp32")
x = make_inputs(300, 2, rng, hidden=256, head_dim=128)  # sequences of two tiles: two fp32 dQ partials each
args = [x[k] for k in ("grad_output", "hidden_states", "qkv_weight", "qkv_bias", "proj_weight", "proj_bias",
                       "cos", "sin", "cu_seqlens")]
for tiles in (2, 0):  # dQ from the dK/dV kernel's partials, then from the forward kernel's second pass
    A.DQ_PARTIAL_MAX_TILES = tiles
    cr.vision_attention_backward(*args, precision="fp32")
cupy.cuda.runtime.deviceSynchronize()
print("sanitize_case: all calls done")
