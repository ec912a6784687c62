"""Development aid: the whole backward with its independent products on a second stream and on the caller's stream
alone (cupy_rope.attention.CONCURRENT_MAX_TOKENS), alternating, median GPU µs, on seed workloads given as TxN
(default: all 16). Usage: streams_ab.py [precisions] [TxN,...]. Graph replay stays on, as in the bench; the graph
cache is cleared between settings."""
import sys

import cupy
import numpy as np

import cupy_rope as cr
from cupy_rope import attention as A
from cupy_rope import workloads as W
from cupy_rope._bench import Timer
from cupy_rope.bench_attention import make_inputs

KEYS = ("grad_output", "hidden_states", "qkv_weight", "qkv_bias", "proj_weight", "proj_bias", "cos", "sin", "cu_seqlens")
precisions = sys.argv[1].split(",") if len(sys.argv) > 1 else ["fp32", "tf32", "bf16"]
cases = [(int(a), int(b)) for a, b in (c.split("x") for c in sys.argv[2].split(","))] if len(sys.argv) > 2 else \
    list(W.ATTN_CASES)
timer = Timer()
limit = A.CONCURRENT_MAX_TOKENS
settings = {"two streams": 1 << 30, "one": 0}
means = {p: dict.fromkeys(settings, 0.0) for p in precisions}
for t, n in cases:
    x = make_inputs(t, n, cupy.random.default_rng(0))
    args = [x[k] for k in KEYS]
    for prec in precisions:
        got = {name: [] for name in settings}
        for _ in range(2):
            for name, tokens in settings.items():
                A.CONCURRENT_MAX_TOKENS = tokens
                cr.clear_graph_cache()
                got[name].append(timer.gpu_us(lambda: cr.vision_attention_backward(*args, precision=prec), reps=10))
        med = {name: float(np.median(v)) for name, v in got.items()}
        for name in settings:
            means[prec][name] += med[name] / len(cases)
        print(f"T={t:5d} {prec}  " + "  ".join(f"{name} {med[name]:.1f} ({' '.join(f'{v:.0f}' for v in got[name])})"
                                                for name in settings)
              + f"  ({med['two streams'] / med['one'] - 1:+.1%})", flush=True)
A.CONCURRENT_MAX_TOKENS = limit
for prec, m in means.items():
    print(f"mean {prec}: " + "  ".join(f"{name} {v:.1f}" for name, v in m.items()))
