"""Development aid: one attention backward (T tokens in N sequences, a precision) for a profiler to look at."""
import sys

import cupy

import cupy_rope as cr
from cupy_rope.bench_attention import make_inputs

t, n, prec = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
KEYS = ("grad_output", "hidden_states", "qkv_weight", "qkv_bias", "proj_weight", "proj_bias", "cos", "sin", "cu_seqlens")
x = make_inputs(t, n, cupy.random.default_rng(0))
for _ in range(2):
    cr.vision_attention_backward(*[x[k] for k in KEYS], precision=prec)
cupy.cuda.runtime.deviceSynchronize()
