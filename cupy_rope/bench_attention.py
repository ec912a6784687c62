"""Benchmark of vision_attention_backward over the built-in workloads (see README, "Benchmark")."""
from __future__ import annotations

import sys

import numpy as np

from . import _bench as B
from . import reference
from .attention import VisionAttentionBackward, vision_attention_backward
from .attention.api import OUTPUTS
from .attention.profile import profile_split
from .workloads import ATTN_CASES, ATTN_HEAD_DIM, ATTN_HEADS, ATTN_HIDDEN, even_cu_seqlens

TOL = {"fp32": 1e-5, "tf32": 5e-3, "bf16": 2e-2}


def make_inputs(t, nseq, rng, hidden=ATTN_HIDDEN, head_dim=ATTN_HEAD_DIM):
    """The benchmark's input generation: activations and cos/sin standard normal, weights x 0.02, biases x 0.01."""
    import cupy

    f = np.float32
    x = dict(grad_output=rng.standard_normal((t, hidden), dtype=f),
             hidden_states=rng.standard_normal((t, hidden), dtype=f),
             qkv_weight=rng.standard_normal((3 * hidden, hidden), dtype=f) * f(0.02),
             qkv_bias=rng.standard_normal((3 * hidden,), dtype=f) * f(0.01),
             proj_weight=rng.standard_normal((hidden, hidden), dtype=f) * f(0.02),
             proj_bias=rng.standard_normal((hidden,), dtype=f) * f(0.01),
             cos=rng.standard_normal((t, head_dim), dtype=f),
             sin=rng.standard_normal((t, head_dim), dtype=f),
             cu_seqlens=cupy.asarray(even_cu_seqlens(t, nseq), dtype=np.int32))
    return x


def flops(cu, hidden=ATTN_HIDDEN, heads=ATTN_HEADS, head_dim=ATTN_HEAD_DIM) -> float:
    """GEMM FLOPs (five products, 2*T*H*(3H*3 + H*2)) plus attention (heads * 12 * L^2 * D per sequence)."""
    t = cu[-1]
    gemm = 2.0 * t * hidden * (9 * hidden + 2 * hidden)
    attn = sum(heads * 12.0 * (b - a) ** 2 * head_dim for a, b in zip(cu[:-1], cu[1:]))
    return gemm + attn


def min_bytes(t, hidden=ATTN_HIDDEN, head_dim=ATTN_HEAD_DIM) -> float:
    """Each input read once and each output written once, fp32."""
    h = hidden
    reads = 2 * t * h + 4 * h * h + 4 * h + 2 * t * head_dim
    writes = t * h + 4 * h * h + 4 * h
    return 4.0 * (reads + writes)


def check(x, *results):
    """Relative Frobenius error of each of the five outputs against the float64 reference (run on the GPU), the
    worst over ``results`` (each a tuple of the five outputs)."""
    ref = reference.vision_attention_backward(
        x["grad_output"], x["hidden_states"], x["qkv_weight"], x["qkv_bias"], x["proj_weight"], x["proj_bias"],
        x["cos"], x["sin"], x["cu_seqlens"], num_heads=x["hidden_states"].shape[1] // x["cos"].shape[1])
    return {name: max(B.rel_err(outs[i], r) for outs in results) for i, (name, r) in enumerate(zip(OUTPUTS, ref))}


def _torch_peers(x, precision):
    torch = B.torch_or_none()
    if torch is None or precision == "bf16":
        return {}
    import torch.nn.functional as F

    t_ = {k: torch.from_dlpack(v) for k, v in x.items()}
    cu = [int(c) for c in x["cu_seqlens"].get()]
    h = t_["hidden_states"].shape[1]
    d = t_["cos"].shape[1]
    nh = h // d
    params = {k: t_[k].clone().requires_grad_(True) for k in ("hidden_states", "qkv_weight", "qkv_bias",
                                                               "proj_weight", "proj_bias")}

    def rot(z):
        return torch.cat([-z[..., d // 2:], z[..., : d // 2]], dim=-1)

    def forward(sdpa):
        p = params
        qkv = (p["hidden_states"] @ p["qkv_weight"].T + p["qkv_bias"]).view(-1, 3, nh, d)
        q, k, v = qkv.unbind(1)
        c, s = t_["cos"][:, None, :], t_["sin"][:, None, :]
        q, k = q * c + rot(q) * s, k * c + rot(k) * s
        outs = []
        for a, b in zip(cu[:-1], cu[1:]):
            qs, ks, vs = (z[a:b].transpose(0, 1) for z in (q, k, v))
            if sdpa:
                o = F.scaled_dot_product_attention(qs[None], ks[None], vs[None], scale=d ** -0.5)[0]
            else:
                o = torch.softmax(qs @ ks.transpose(-1, -2) * d ** -0.5, dim=-1) @ vs
            outs.append(o.transpose(0, 1))
        o = torch.cat(outs).reshape(-1, h)
        return o @ p["proj_weight"].T + p["proj_bias"]

    def step(sdpa, tf32):
        def fn():
            torch.backends.cuda.matmul.allow_tf32 = tf32
            torch.backends.cudnn.allow_tf32 = tf32
            grads = torch.autograd.grad(forward(sdpa), list(params.values()), t_["grad_output"])
            torch.backends.cuda.matmul.allow_tf32 = False
            return grads
        return fn

    if precision == "fp32":
        return {"torch_autograd_fp32": step(False, False)}
    return {"torch_autograd_tf32": step(False, True), "torch_sdpa_tf32": step(True, True)}


def run(precision: str = "tf32", out_path: str | None = None, reps: int = 20, peers: bool = True,
        cases=None) -> int:
    import cupy

    timer = B.Timer()
    info = B.device_info()
    copy = B.copy_TBps(timer)
    rate = B.gemm_TFLOPs(timer, precision)
    print(f"# vision_attention_backward [{precision}] on {info['device']}: copy {copy:.3f} TB/s, "
          f"GEMM {rate:.1f} TFLOP/s (8192^3, {precision})")
    rng = cupy.random.default_rng(2024)
    rows, failed = [], 0
    print(f"{'T':>5} {'N':>3} {'gpu_us':>9} {'TFLOP/s':>7} {'floor_us':>8} {'%roof':>6} {'cublas_us':>9} "
          f"{'ours_us':>8} {'peakMB':>7} {'max_err':>8}  peers (us, ratio peer/ours)")
    for i, (t, nseq) in enumerate(ATTN_CASES):
        if cases is not None and i not in cases:
            continue
        x = make_inputs(t, nseq, rng)
        args = [x[k] for k in ("grad_output", "hidden_states", "qkv_weight", "qkv_bias", "proj_weight",
                               "proj_bias", "cos", "sin", "cu_seqlens")]
        pool = cupy.get_default_memory_pool()
        cupy.cuda.runtime.deviceSynchronize()
        base = pool.used_bytes()
        # The checked and timed calls go through a per-layer graph handle, as a training loop would: its first call
        # runs directly, the second records a CUDA graph (up to the plan's graph limit) and the rest replay it.
        handle = VisionAttentionBackward(np.asarray(even_cu_seqlens(t, nseq), np.int32), hidden_size=ATTN_HIDDEN,
                                         head_dim=ATTN_HEAD_DIM, precision=precision)
        block = args[:-1]
        handle(*block)
        outs = tuple(o.copy() for o in handle(*block))  # the handle's arrays: its next call overwrites them
        errs = check(x, outs, vision_attention_backward(*args, precision=precision))
        del outs
        err = max(errs.values())
        ok = err <= TOL[precision]
        failed += not ok
        fn = lambda: handle(*block)  # noqa: E731
        gpu = timer.gpu_us(fn, reps=reps)
        replayed = handle.replays > 0  # the timed calls ran from a recorded graph
        host = timer.host_us(fn, n=5, loops=3)
        split = profile_split(timer, *args, precision=precision)  # phases of one direct call, on one stream
        pool.free_all_blocks()
        handle.close()
        peak = _peak_bytes(lambda: vision_attention_backward(*args, precision=precision), base)
        cu = even_cu_seqlens(t, nseq)
        fl = flops(cu)
        floor = max(fl / rate / 1e6, min_bytes(t) / copy / 1e6)
        peer_us = {}
        if peers:
            for name, pf in _torch_peers(x, precision).items():
                peer_us[name] = round(timer.gpu_us(pf, reps=max(5, reps // 2)), 1)
        row = {"shape": [t, nseq], "gpu_us": round(gpu, 2), "host_us": round(host, 1), "floor_us": round(floor, 2),
               "TFLOPs": round(fl / gpu / 1e6, 2), "fraction_of_roofline": round(floor / gpu, 4),
               "gflop": round(fl / 1e9, 2), "cublas_us": round(split["cublas"], 2), "kernels_us": round(split["kernels"], 2),
               "phases_us": {k: round(v, 2) for k, v in split.items() if k not in ("cublas", "kernels")},
               "peak_extra_MB": round(peak / 2**20, 1), "graph_replay": replayed, "peers_us": peer_us, "max_rel_error": err,
               "rel_errors": errs, "correct": ok}
        rows.append(row)
        ptxt = "  ".join(f"{k} {v:.0f} ({v / gpu:.2f}x)" for k, v in peer_us.items())
        print(f"{t:>5} {nseq:>3} {gpu:>9.1f} {row['TFLOPs']:>7.1f} {floor:>8.1f} {100 * floor / gpu:>5.1f}% "
              f"{split['cublas']:>9.1f} {split['kernels']:>8.1f} {row['peak_extra_MB']:>7.0f} {err:>8.1e}  {ptxt}"
              + ("" if ok else "  FAILED"))
        sys.stdout.flush()
        x = args = block = fn = handle = None  # release this case's inputs before the next
        pool.free_all_blocks()
    mean, geo = B.summarize(rows)
    print(f"mean {mean:.1f} us, geomean {geo:.1f} us, mean floor {sum(r['floor_us'] for r in rows) / len(rows):.1f} us")
    B.print_peer_summary(rows)
    payload = {"op": "vision_attention_backward", "precision": precision, "device": info["device"], "env": info,
               "ceilings": {"copy_TBps": copy, "gemm_TFLOPs": rate},
               "method": "median GPU time over flushed repetitions (256 MiB memset before each), CUDA events",
               "cases": rows, "mean_gpu_us": mean, "geomean_gpu_us": geo}
    if out_path:
        B.write_json(out_path, payload)
        print(f"wrote {out_path}")
    return 1 if failed else 0


def _peak_bytes(fn, base: int) -> int:
    """Peak bytes held in CuPy's pool during the call beyond what existed before it (outputs included)."""
    import cupy

    pool = cupy.get_default_memory_pool()
    peak = 0

    def tracking(size):
        nonlocal peak
        mem = pool.malloc(size)
        peak = max(peak, pool.used_bytes())
        return mem

    previous = cupy.cuda.get_allocator()
    cupy.cuda.set_allocator(tracking)
    try:
        out = fn()
        cupy.cuda.runtime.deviceSynchronize()
    finally:
        cupy.cuda.set_allocator(previous)
    del out
    return peak - base
