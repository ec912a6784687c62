"""Development aid: GPU µs of each phase of one backward (attention.profile_split, phases issued serially) on seed
workloads. Usage: phase_split.py [precisions] [TxN,...|all]"""
import sys

import cupy

from cupy_rope import attention as A
from cupy_rope import workloads as W
from cupy_rope._bench import Timer
from cupy_rope.bench_attention import make_inputs

KEYS = ("grad_output", "hidden_states", "qkv_weight", "qkv_bias", "proj_weight", "proj_bias", "cos", "sin", "cu_seqlens")
precisions = sys.argv[1].split(",") if len(sys.argv) > 1 else ["fp32", "tf32", "bf16"]
cases = W.attn_cases(sys.argv[2] if len(sys.argv) > 2 else "all")
timer = Timer()
for t, n in cases:
    x = make_inputs(t, n, cupy.random.default_rng(0))
    for prec in precisions:
        ph = A.profile_split(timer, *[x[k] for k in KEYS], precision=prec, reps=5)
        print(f"T={t:5d} {prec} " + " ".join(f"{k} {v:.0f}" for k, v in ph.items()), flush=True)
    del x
