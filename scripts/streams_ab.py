"""Development aid: the whole backward with its independent products on a second stream and on the caller's stream
alone (cupy_rope.attention.CONCURRENT_MAX_TOKENS and _OVERLAPS), alternating, median GPU µs.
Usage: streams_ab.py [precisions] [TxN,...] [config,...]; a config is "one" (a single stream) or a "+"-joined set of
the overlaps dO, grad_proj_weight, grad_qkv_weight (default: all three, and one). Graph replay stays on, as in the
bench; the graph cache is cleared between settings."""
import sys

import cupy
import numpy as np

import cupy_rope as cr
from cupy_rope import attention as A
from cupy_rope import workloads as W
from cupy_rope._bench import Timer
from cupy_rope.bench_attention import make_inputs

KEYS = ("grad_output", "hidden_states", "qkv_weight", "qkv_bias", "proj_weight", "proj_bias", "cos", "sin", "cu_seqlens")
ALL = "dO+grad_proj_weight+grad_qkv_weight"
precisions = sys.argv[1].split(",") if len(sys.argv) > 1 else ["fp32", "tf32", "bf16"]
cases = [(int(a), int(b)) for a, b in (c.split("x") for c in sys.argv[2].split(","))] if len(sys.argv) > 2 else \
    list(W.ATTN_CASES)
configs = sys.argv[3].split(",") if len(sys.argv) > 3 else [ALL, "one"]
timer = Timer()
limit, overlaps = A.CONCURRENT_MAX_TOKENS, A._OVERLAPS
means = {p: dict.fromkeys(configs, 0.0) for p in precisions}
for t, n in cases:
    x = make_inputs(t, n, cupy.random.default_rng(0))
    args = [x[k] for k in KEYS]
    for prec in precisions:
        got = {c: [] for c in configs}
        for _ in range(2):
            for c in configs:
                A.CONCURRENT_MAX_TOKENS = 0 if c == "one" else 1 << 30
                A._OVERLAPS = frozenset(c.split("+"))
                cr.clear_graph_cache()
                got[c].append(timer.gpu_us(lambda: cr.vision_attention_backward(*args, precision=prec), reps=10))
        med = {c: float(np.median(v)) for c, v in got.items()}
        for c in configs:
            means[prec][c] += med[c] / len(cases)
        print(f"T={t:5d} {prec}  " + "  ".join(f"{c} {med[c]:.1f} ({' '.join(f'{v:.0f}' for v in got[c])})"
                                                for c in configs), flush=True)
A.CONCURRENT_MAX_TOKENS, A._OVERLAPS = limit, overlaps
for prec, m in means.items():
    print(f"mean {prec}: " + "  ".join(f"{c} {v:.1f}" for c, v in m.items()))
