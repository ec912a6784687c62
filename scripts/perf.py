"""Development aid: time variants of the attention backward on a few workloads."""

import cupy

import cupy_rope as cr
from cupy_rope import attention as A
from cupy_rope._bench import Timer
from cupy_rope.bench_attention import make_inputs

timer = Timer()
rng = cupy.random.default_rng(0)
KEYS = ("grad_output", "hidden_states", "qkv_weight", "qkv_bias", "proj_weight", "proj_bias", "cos", "sin", "cu_seqlens")
cases = [(131, 1), (613, 4), (1176, 6), (2940, 15), (8192, 32)]
for t, n in cases:
    x = make_inputs(t, n, rng)
    args = [x[k] for k in KEYS]
    res = []
    for thr in (0, 10**9):
        A.KMAJOR_MIN_TOKENS = thr
        res.append(timer.gpu_us(lambda: cr.vision_attention_backward(*args, precision="tf32"), reps=10))
    A.KMAJOR_MIN_TOKENS = 0
    line = f"T={t:5d} tf32 kmajor {res[0]:8.1f}  plain {res[1]:8.1f}"
    for prec in ("bf16", "fp32") if t in (613, 8192) else ():
        line += f"  {prec} {timer.gpu_us(lambda: cr.vision_attention_backward(*args, precision=prec), reps=5):8.1f}"
    print(line, flush=True)
    if t == 8192:
        for prec in ("tf32", "bf16", "fp32"):
            sp = A.profile_split(timer, *args, precision=prec)
            print(prec, {k: round(v, 1) for k, v in sp.items()}, flush=True)
