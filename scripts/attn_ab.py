"""Development aid: the whole backward under two or more settings of module switches, alternating, median GPU µs,
on seed workloads given as TxN (default: all 16), graph replay on as in the bench (the graph cache is cleared
between settings; with a _cublas switch among the settings, the GEMM choices are re-timed for each).

Usage: attn_ab.py [precisions] [TxN,...|all] [NAME:MODULE.ATTR=VALUE,...] ...
  MODULE is attention or _cublas; VALUE an int, or inf. Default settings: two streams against one,
  "two:attention.CONCURRENT_MAX_TOKENS=inf" "one:attention.CONCURRENT_MAX_TOKENS=0".
  e.g. attn_ab.py fp32 all "plain:attention.FP32_NT_MIN_TOKENS=inf,attention.FP32_NT_QKV_MIN_TOKENS=inf"
       "nt:attention.FP32_NT_MIN_TOKENS=0,attention.FP32_NT_QKV_MIN_TOKENS=inf"
       attn_ab.py fp32 131x1,773x5 "split:_cublas.SPLIT_ROWS=128" "whole:_cublas.SPLIT_ROWS=inf"
"""
import sys

import cupy
import numpy as np

import cupy_rope as cr
from cupy_rope import _cublas
from cupy_rope import attention as A
from cupy_rope import workloads as W
from cupy_rope._bench import Timer
from cupy_rope.bench_attention import make_inputs

KEYS = ("grad_output", "hidden_states", "qkv_weight", "qkv_bias", "proj_weight", "proj_bias", "cos", "sin", "cu_seqlens")
MODULES = {"attention": A, "_cublas": _cublas}


def parse(spec):
    name, _, assigns = spec.partition(":")
    out = []
    for item in assigns.split(","):
        target, _, value = item.partition("=")
        mod, _, attr = target.partition(".")
        if mod not in MODULES or not hasattr(MODULES[mod], attr):
            raise SystemExit(f"unknown switch {target!r}")
        out.append((MODULES[mod], attr, 1 << 40 if value == "inf" else int(value)))
    return name, out


precisions = sys.argv[1].split(",") if len(sys.argv) > 1 else ["fp32", "tf32", "bf16"]
cases = W.attn_cases(sys.argv[2] if len(sys.argv) > 2 else "all")
settings = dict(parse(s) for s in (sys.argv[3:] or ["two:attention.CONCURRENT_MAX_TOKENS=inf",
                                                    "one:attention.CONCURRENT_MAX_TOKENS=0"]))
saved = {(m, a): getattr(m, a) for assigns in settings.values() for m, a, _ in assigns}
retime = any(m is _cublas for m, _ in saved)
timer = Timer()
means = {p: dict.fromkeys(settings, 0.0) for p in precisions}
first = next(iter(settings))
for t, n in cases:
    x = make_inputs(t, n, cupy.random.default_rng(0))
    args = [x[k] for k in KEYS]
    for prec in precisions:
        got = {name: [] for name in settings}
        for _ in range(2):
            for name, assigns in settings.items():
                for (m, a), v in saved.items():
                    setattr(m, a, v)
                for m, a, v in assigns:
                    setattr(m, a, v)
                if retime:
                    _cublas._lt_plans.clear()
                cr.clear_graph_cache()
                got[name].append(timer.gpu_us(lambda: cr.vision_attention_backward(*args, precision=prec), reps=10))
        med = {name: float(np.median(v)) for name, v in got.items()}
        for name in settings:
            means[prec][name] += med[name] / len(cases)
        print(f"T={t:5d} {prec}  " + "  ".join(
            f"{name} {med[name]:.1f} ({' '.join(f'{v:.0f}' for v in got[name])}"
            + (f", {med[name] / med[first] - 1:+.1%})" if name != first else ")") for name in settings), flush=True)
for (m, a), v in saved.items():
    setattr(m, a, v)
for prec, m in means.items():
    print(f"mean {prec}: " + "  ".join(f"{name} {v:.1f}" for name, v in m.items()))
