"""Development aid: the attention kernels compiled with extra preprocessor options against the default build:
worst relative error of the five outputs vs float64 on small mixed-length cases (head_dim 128, 80, 72), and the
GPU µs of the two attention kernels (profile_split) on seed workloads.

Usage: attn_variants.py [precisions] [TxN,...] NAME=-DFOO[,-DBAR] ...
  e.g. attn_variants.py fp32,tf32 8192x32,1176x6 skip=-DATTN_SKIP_IDLE both=-DATTN_SKIP_IDLE,-DATTN_FP32_S44"""
import sys

import cupy
import numpy as np

import cupy_rope as cr
from cupy_rope import attention as A
from cupy_rope import reference as R
from cupy_rope import workloads as W
from cupy_rope._bench import Timer
from cupy_rope.bench_attention import make_inputs

KEYS = ("grad_output", "hidden_states", "qkv_weight", "qkv_bias", "proj_weight", "proj_bias", "cos", "sin", "cu_seqlens")
TOL = {"fp32": 1e-5, "tf32": 5e-3, "bf16": 2e-2}
BASE = A.OPTIONS
args = sys.argv[1:]
precisions = args.pop(0).split(",") if args and "=" not in args[0] else ["fp32", "tf32", "bf16"]
seeds = [(8192, 32), (2048, 8), (613, 4), (131, 1)]
if args and "=" not in args[0]:
    seeds = W.attn_cases(args.pop(0))
variants = {"default": ()}
for spec in args:
    name, _, opts = spec.partition("=")
    variants[name] = tuple(opts.split(","))
rng = cupy.random.default_rng(1)


def small(d):
    """The bench's inputs (hidden 4 * d, 4 heads), re-split into sequences of 1, 129, 0, 259 and 256 tokens."""
    x = make_inputs(645, 1, rng, hidden=4 * d, head_dim=d)
    x["cu_seqlens"] = cupy.asarray([0, 1, 130, 130, 389, 645], dtype=cupy.int32)
    return x


def rel(o, r):
    o = cupy.asarray(o, dtype=cupy.float64)
    return float(cupy.linalg.norm(o - r) / cupy.linalg.norm(r)) if bool(cupy.isfinite(o).all()) else float("inf")


cases = {d: small(d) for d in (128, 80, 72)}
refs = {d: R.vision_attention_backward(*[x[k] for k in KEYS], num_heads=4) for d, x in cases.items()}
timer = Timer()
for name, opts in variants.items():
    A.OPTIONS = BASE + opts
    cr.clear_graph_cache()
    for prec in precisions:
        errs = []
        for d, x in cases.items():
            outs = cr.vision_attention_backward(*[x[k] for k in KEYS], precision=prec)
            errs.append(max(rel(o, r) for o, r in zip(outs, refs[d])))
        ok = all(e <= TOL[prec] for e in errs)
        print(f"{name:8s} {prec} worst error d128 {errs[0]:.2e} d80 {errs[1]:.2e} d72 {errs[2]:.2e} {'ok' if ok else 'OVER BOUND'}",
              flush=True)
# Timing: the two builds alternate, ROUNDS times, so that clock and power drift hit both alike; median per build.
ROUNDS = 3
for (t, nseq) in seeds:
    x = make_inputs(t, nseq, cupy.random.default_rng(0))
    for prec in precisions:
        got = {name: [] for name in variants}
        for _ in range(ROUNDS):
            for name, opts in variants.items():
                A.OPTIONS = BASE + opts
                got[name].append(A.profile_split(timer, *[x[k] for k in KEYS], precision=prec, reps=7))
        for name in variants:
            med = {k: float(np.median([r[k] for r in got[name]])) for k in ("attn_fwd_dq", "attn_dkdv", "kernels", "cublas")}
            print(f"{name:8s} {prec} T={t:5d}  fwd_dq {med['attn_fwd_dq']:8.1f}  dkdv {med['attn_dkdv']:8.1f}  "
                  f"kernels {med['kernels']:8.1f}  cublas {med['cublas']:8.1f}", flush=True)
    del x
A.OPTIONS = BASE
