"""The sm_90a attention kernels on the GPU: correctness against float64 (on the GPU), repeat bits, and a quick
timing against the mma.sync kernels and PyTorch (where importable).

    python dev/hopper_check.py [--quick] [--json out.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import numpy as np

import common


def rel(a, b):
    import cupy

    a = a.astype(cupy.float64)
    return float(cupy.linalg.norm(a - b) / max(float(cupy.linalg.norm(b)), 1e-300))


def varlen_case(lens, nh, d, rng_seed=0, hopper=True, dtype="bf16"):
    import cupy

    import cupy_rope as cr
    from cupy_rope import reference as R

    rng = cupy.random.default_rng(rng_seed)
    t = int(sum(lens))
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    q, k, v, go = (rng.standard_normal((t, nh, d), dtype=cupy.float32) for _ in range(4))
    if dtype == "bf16":
        from cupy_rope.attention.flash import _bf16
        s = cupy.cuda.get_current_stream().ptr
        q, k, v, go = (_bf16(x, s) for x in (q, k, v, go))
    pl = lambda p: dataclasses.replace(p, hopper=hopper)  # noqa: E731
    o, lse = cr.varlen_attention_forward(q, k, v, cu, precision="bf16", plan=pl)
    dq, dk, dv = cr.varlen_attention_backward(go, q, k, v, o, lse, cu, precision="bf16", plan=pl)
    o2, lse2 = cr.varlen_attention_forward(q, k, v, cu, precision="bf16", plan=pl)
    dq2, dk2, dv2 = cr.varlen_attention_backward(go, q, k, v, o2, lse2, cu, precision="bf16", plan=pl)
    same = all(bool(cupy.array_equal(a.view(cupy.uint16) if a.dtype != cupy.float32 else a.view(cupy.uint32),
                                     b.view(cupy.uint16) if b.dtype != cupy.float32 else b.view(cupy.uint32)))
               for a, b in ((o, o2), (lse, lse2), (dq, dq2), (dk, dk2), (dv, dv2)))
    f = lambda x: x if x.dtype == cupy.float32 else (x.view(cupy.uint16).astype(cupy.uint32) << 16).view(cupy.float32)  # noqa
    q64, k64, v64, g64 = (f(x).astype(cupy.float64) for x in (q, k, v, go))
    ro, rl = R.varlen_attention_forward(q64, k64, v64, cu)
    rq, rk, rv = R.varlen_attention_backward(g64, q64, k64, v64, cu)
    errs = dict(o=rel(f(o), ro), lse=rel(lse, rl), dq=rel(dq, rq), dk=rel(dk, rk), dv=rel(dv, rv))
    nan = any(bool(cupy.isnan(x).any()) for x in (f(o), lse, dq, dk, dv))
    return errs, same, nan


def time_varlen(lens, nh, d, hopper=True, reps=10):
    import cupy

    import cupy_rope as cr
    from cupy_rope._bench import Timer

    rng = cupy.random.default_rng(1)
    t = int(sum(lens))
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    from cupy_rope.attention.flash import _bf16
    s = cupy.cuda.get_current_stream().ptr
    q, k, v, go = (_bf16(rng.standard_normal((t, nh, d), dtype=cupy.float32), s) for _ in range(4))
    pl = lambda p: dataclasses.replace(p, hopper=hopper)  # noqa: E731
    ml = int(max(lens))

    def fwd():
        return cr.varlen_attention_forward(q, k, v, cu, precision="bf16", plan=pl, max_seqlen=ml)

    o, lse = fwd()

    def bwd():
        return cr.varlen_attention_backward(go, q, k, v, o, lse, cu, precision="bf16", plan=pl, max_seqlen=ml)

    def both():
        o_, l_ = fwd()
        return cr.varlen_attention_backward(go, q, k, v, o_, l_, cu, precision="bf16", plan=pl, max_seqlen=ml)

    timer = Timer()
    flop = sum(14 * L * L * d * nh for L in lens)
    out = {}
    for name, fn, fl in (("fwd", fwd, flop * 4 / 14), ("bwd", bwd, flop * 10 / 14), ("fwd+bwd", both, flop)):
        us = timer.gpu_us(fn, reps=reps)
        out[name] = (round(us, 1), round(fl / us / 1e6, 1))
    return out


def torch_varlen(lens, nh, d, reps=10):
    try:
        import torch
        from torch.nn.attention.varlen import varlen_attn
    except Exception as e:  # noqa: BLE001
        return {"error": repr(e)}
    from cupy_rope._bench import Timer

    t = int(sum(lens))
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32), device="cuda")
    q, k, v = (torch.randn(t, nh, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    go = torch.randn(t, nh, d, device="cuda", dtype=torch.bfloat16)
    ml = int(max(lens))

    def both():
        o = varlen_attn(q, k, v, cu, cu, ml, ml)
        return torch.autograd.grad(o, (q, k, v), go)

    out = {}
    timer = Timer()
    try:
        us = timer.gpu_us(both, reps=reps)
        out["varlen_attn"] = (round(us, 1), round(sum(14 * L * L * d * nh for L in lens) / us / 1e6, 1))
    except Exception as e:  # noqa: BLE001
        out["varlen_attn"] = repr(e)[:300]
    if len(set(lens)) == 1:
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        b, L = len(lens), lens[0]
        qd, kd, vd = (torch.randn(b, nh, L, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                      for _ in range(3))
        god = torch.randn(b, nh, L, d, device="cuda", dtype=torch.bfloat16)

        def cud():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o = F.scaled_dot_product_attention(qd, kd, vd)
            return torch.autograd.grad(o, (qd, kd, vd), god)
        try:
            us = timer.gpu_us(cud, reps=reps)
            out["cudnn"] = (round(us, 1), round(sum(14 * L * L * d * nh for L in lens) / us / 1e6, 1))
        except Exception as e:  # noqa: BLE001
            out["cudnn"] = repr(e)[:300]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--skip-time", action="store_true")
    a = ap.parse_args()
    res = {"correct": [], "time": []}
    cases = [((1,), 2, 64), ((5, 0, 130, 1), 3, 64), ((200, 300), 2, 128), ((128, 256, 64), 2, 80),
             ((700, 17, 1, 0, 333), 2, 96), ((1000,), 2, 128), ((3000, 64), 1, 64)]
    for lens, nh, d in cases:
        t0 = time.time()
        try:
            errs, same, nan = varlen_case(lens, nh, d)
            row = dict(lens=lens, nh=nh, d=d, errs=errs, same=same, nan=nan, ok=max(errs.values()) < 2e-2 and same
                       and not nan)
        except Exception:  # noqa: BLE001
            import traceback
            row = dict(lens=lens, nh=nh, d=d, error=traceback.format_exc()[-1500:])
        row["s"] = round(time.time() - t0, 2)
        print(json.dumps(row), flush=True)
        res["correct"].append(row)
    if not a.skip_time:
        tcases = [((16384,), 28, 128), ((4096,) * 4, 28, 128), ((256,) * 32, 28, 128), ((9216,), 16, 80),
                  ((1, 64, 3000, 0, 700, 5000, 17), 16, 64)]
        if a.quick:
            tcases = tcases[:3]
        for lens, nh, d in tcases:
            row = dict(lens=lens[:3], n=len(lens), nh=nh, d=d)
            for hop in (True, False):
                try:
                    row["hopper" if hop else "mma"] = time_varlen(lens, nh, d, hopper=hop)
                except Exception as e:  # noqa: BLE001
                    row["hopper" if hop else "mma"] = repr(e)[:500]
            row["torch"] = torch_varlen(lens, nh, d)
            print(json.dumps(row), flush=True)
            res["time"].append(row)
    common.write_json(a.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
