"""Development aid: the whole backward with and without the row-split GEMM candidate (cupy_rope._cublas.SPLIT_ROWS),
alternating, on seed workloads given as TxN (default: those whose token count is not a multiple of 128). The GEMM
choices are re-timed for each setting (plans cleared), and the graph cache is cleared too."""
import sys

import cupy
import numpy as np

import cupy_rope as cr
from cupy_rope import _cublas
from cupy_rope._bench import Timer
from cupy_rope.bench_attention import make_inputs

KEYS = ("grad_output", "hidden_states", "qkv_weight", "qkv_bias", "proj_weight", "proj_bias", "cos", "sin", "cu_seqlens")
precisions = sys.argv[1].split(",") if len(sys.argv) > 1 else ["fp32", "tf32", "bf16"]
cases = [(int(a), int(b)) for a, b in (c.split("x") for c in sys.argv[2].split(","))] if len(sys.argv) > 2 else \
    [(131, 1), (373, 3), (773, 5), (1176, 6), (2940, 15), (5880, 30)]
timer = Timer()
for t, n in cases:
    x = make_inputs(t, n, cupy.random.default_rng(0))
    args = [x[k] for k in KEYS]
    for prec in precisions:
        got = {"split": [], "whole": []}
        for _ in range(2):
            for name, rows in (("split", 128), ("whole", 1 << 40)):
                _cublas.SPLIT_ROWS = rows
                _cublas._lt_plans.clear()
                cr.clear_graph_cache()
                got[name].append(timer.gpu_us(lambda: cr.vision_attention_backward(*args, precision=prec), reps=10))
        print(f"T={t:5d} {prec}  split {np.median(got['split']):9.1f}  whole {np.median(got['whole']):9.1f}  "
              f"({' '.join(f'{v:.0f}' for v in got['split'])} / {' '.join(f'{v:.0f}' for v in got['whole'])})", flush=True)
_cublas.SPLIT_ROWS = 128
