"""Benchmark of vision_attention_backward over the built-in workloads (see README, "Benchmark")."""
from __future__ import annotations

import sys

import numpy as np

from . import _bench as B
from . import _torch_peers as TP
from . import reference
from .attention import VisionAttentionBackward, vision_attention_backward
from .attention.api import OUTPUTS
from .attention.profile import profile_split
from .workloads import ATTN_CASES, ATTN_HEAD_DIM, ATTN_HEADS, ATTN_HIDDEN, even_cu_seqlens

OP = "vision_attention_backward"  # the JSON's "op"; the file in bench/results is <OP>_<precision>.json

TOL = {"fp32": 1e-5, "tf32": 5e-3, "bf16": 2e-2}


def make_inputs(t, nseq, rng, hidden=ATTN_HIDDEN, head_dim=ATTN_HEAD_DIM, cu=None):
    """The benchmark's input generation: activations and cos/sin standard normal, weights x 0.02, biases x 0.01.
    ``cu``: the cu_seqlens (a list); default ``nseq`` nearly equal sequences."""
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
             cu_seqlens=cupy.asarray(even_cu_seqlens(t, nseq) if cu is None else cu, dtype=np.int32))
    return x


def gemm_flops(t, hidden=ATTN_HIDDEN) -> float:
    """FLOPs of the block's five GEMMs: 2*T*H*(3H*3 + H*2)."""
    return 2.0 * t * hidden * (9 * hidden + 2 * hidden)


def flops(cu, hidden=ATTN_HIDDEN, heads=ATTN_HEADS, head_dim=ATTN_HEAD_DIM) -> float:
    """GEMM FLOPs (:func:`gemm_flops`) plus attention (heads * 12 * L^2 * D per sequence)."""
    gemm = gemm_flops(cu[-1], hidden)
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
    """The PyTorch peers of a precision (what a PyTorch user would run), name -> a function building the timed ``fn()``:
    autograd of the seed forward for fp32 and tf32 (and the same with ``scaled_dot_product_attention`` per sequence
    for tf32, TF32 enabled), autocast (bf16) with ``varlen_attn`` for bf16. Empty without PyTorch and CUDA."""
    if B.torch_or_none() is None:
        return {}
    if precision == "fp32":
        return {"torch_autograd_fp32": lambda: TP.block_peer(x, "softmax")}
    if precision == "bf16":
        return {"torch_bf16_varlen": lambda: TP.block_peer(x, "varlen", autocast_bf16=True)}
    return {"torch_autograd_tf32": lambda: TP.block_peer(x, "softmax", tf32_on=True),
            "torch_sdpa_tf32": lambda: TP.block_peer(x, "sdpa", tf32_on=True)}


def run(precision: str = "tf32", out_path: str | None = None, reps: int = 20, peers: bool = True,
        cases=None, hold_host: bool = True) -> int:
    import cupy

    timer = B.Timer(hold_host)
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
        for o in handle(*block):  # poisoned after the direct call: the recorded call must write every output
            o.fill(np.nan)
        outs = tuple(o.copy() for o in handle(*block))  # the handle's arrays: its next call overwrites them
        direct = vision_attention_backward(*args, precision=precision)
        errs = check(x, outs, direct)
        deterministic = all(B.same_bits(a, b) for a, b in zip(outs, direct))  # recorded call and direct call
        del outs, direct
        err = max(errs.values())
        ok = err <= TOL[precision]
        failed += not ok
        fn = lambda: handle(*block)  # noqa: E731
        gpu = timer.gpu_us(fn, reps=reps)
        mhz = timer.last_sm_mhz
        replayed = handle.replays > 0  # the timed calls ran from a recorded graph
        host = timer.host_us(fn, n=5, loops=3)
        split = profile_split(timer, *args, precision=precision)  # phases of one direct call, on one stream
        pool.free_all_blocks()
        handle.close()
        peak = _peak_bytes(lambda: vision_attention_backward(*args, precision=precision), base)
        cu = even_cu_seqlens(t, nseq)
        fl = flops(cu)
        floor = max(fl / rate / 1e6, min_bytes(t) / copy / 1e6)
        peer_us, peer_errors = {}, {}
        if peers:
            timed, peer_errors = TP.time_peers(timer, _torch_peers(x, precision), max(5, reps // 2),
                                               B.torch_or_none())
            peer_us = {k: v for k, v in timed.items() if v is not None}  # failures: peer_errors says why
        row = {"shape": [t, nseq], "gpu_us": round(gpu, 2), "host_us": round(host, 1), "sm_mhz": mhz,
               "floor_us": round(floor, 2),
               "TFLOPs": round(fl / gpu / 1e6, 2), "fraction_of_roofline": round(floor / gpu, 4),
               "gflop": round(fl / 1e9, 2), "cublas_us": round(split["cublas"], 2),
               "kernels_us": round(split["kernels"], 2),
               "phases_us": {k: round(v, 2) for k, v in split.items() if k not in ("cublas", "kernels")},
               "peak_extra_MB": round(peak / 2**20, 1), "graph_replay": replayed, "peers_us": peer_us,
               "max_rel_error": err, "rel_errors": errs, "correct": ok, "deterministic": deterministic}
        if peer_errors:
            row["peer_errors"] = peer_errors
        rows.append(row)
        ptxt = "  ".join([f"{k} {v:.0f} ({v / gpu:.2f}x)" for k, v in peer_us.items()]
                         + [f"{k} failed" for k in peer_errors])
        print(f"{t:>5} {nseq:>3} {gpu:>9.1f} {row['TFLOPs']:>7.1f} {floor:>8.1f} {100 * floor / gpu:>5.1f}% "
              f"{split['cublas']:>9.1f} {split['kernels']:>8.1f} {row['peak_extra_MB']:>7.0f} {err:>8.1e}  {ptxt}"
              + ("" if ok else "  FAILED"))
        sys.stdout.flush()
        x = args = block = fn = handle = None  # release this case's inputs before the next
        pool.free_all_blocks()
    mean, geo = B.summarize(rows)
    print(f"mean {mean:.1f} us, geomean {geo:.1f} us, mean floor {sum(r['floor_us'] for r in rows) / len(rows):.1f} us")
    TP.print_summary(rows)
    payload = {"op": OP, "precision": precision, "device": info["device"], "env": info,
               "ceilings": {"copy_TBps": copy, "gemm_TFLOPs": rate},
               "method": timer.method(),
               "cases": rows, "mean_gpu_us": mean, "geomean_gpu_us": geo}
    if out_path:
        B.write_json(out_path, payload)
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
