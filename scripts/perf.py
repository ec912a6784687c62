"""Development aid: the tf32 backward with K-major weight-gradient operands (TF32_KMAJOR) against
plain ones, on the seed workloads given as TxN (graph replay on, as in the bench; the cache is cleared between
settings so a replay never runs the other setting's recording)."""
import sys

import cupy

import cupy_rope as cr
from cupy_rope import attention as A
from cupy_rope import workloads as W
from cupy_rope._bench import Timer
from cupy_rope.bench_attention import make_inputs

timer = Timer()
rng = cupy.random.default_rng(0)
KEYS = ("grad_output", "hidden_states", "qkv_weight", "qkv_bias", "proj_weight", "proj_bias", "cos", "sin", "cu_seqlens")
cases = W.attn_cases(sys.argv[1] if len(sys.argv) > 1 else "131x1,373x3,613x4,919x6,1176x6")
for t, n in cases:
    x = make_inputs(t, n, rng)
    args = [x[k] for k in KEYS]
    res = []
    for kmajor in (True, False):
        A.TF32_KMAJOR = kmajor
        cr.clear_graph_cache()
        res.append(timer.gpu_us(lambda: cr.vision_attention_backward(*args, precision="tf32"), reps=20))
    A.TF32_KMAJOR = True
    cr.clear_graph_cache()
    print(f"T={t:5d} tf32 kmajor {res[0]:8.1f}  plain {res[1]:8.1f}", flush=True)
