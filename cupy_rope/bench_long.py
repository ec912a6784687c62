"""Benchmark of the whole attention block (``vision_attention_backward``) on long sequences
(:data:`cupy_rope.workloads.LONG_CASES`: real images give one sequence of thousands of patches).

Inputs are built as the seed benchmark builds them (:func:`cupy_rope.bench_attention.make_inputs`). There the
attention outweighs the GEMMs, so the FLOP count is the GEMMs' plus 14 L^2 D per head and sequence (the attention's
forward and backward, as the backward recomputes the forward). The float64 reference runs on the GPU with the
attention in query chunks (:func:`cupy_rope.bench_varlen.attention_reference`), never NH·L^2 at once.
Peers: PyTorch autocast (bf16) with ``varlen_attn``, what a user would pick, and fp32 autograd with TF32 and
``scaled_dot_product_attention`` per sequence for tf32 rows.
"""
from __future__ import annotations

import math

import numpy as np

from . import _bench as B
from . import _torch_peers as TP
from . import reference as R
from .attention.api import OUTPUTS
from .bench_attention import TOL, gemm_flops, make_inputs
from .bench_varlen import attention_flops, attention_reference, drive, seq_lens_json, summary, tflops_of
from .workloads import LONG_CASES, cu_seqlens_of

OP = "vision_attention_long"
PEERS = {"torch_bf16_block": ("bf16", "tf32"), "torch_tf32_block": ("tf32",)}
DEFAULT_REPS = 5
ARG_KEYS = ("grad_output", "hidden_states", "qkv_weight", "qkv_bias", "proj_weight", "proj_bias", "cos", "sin")


def block_flops(case) -> float:
    """GEMMs (2·T·H·11H) plus attention forward + backward (14·L^2·D per head and sequence)."""
    return gemm_flops(sum(case.seq_lens), case.hidden) + attention_flops(case.seq_lens, case.num_heads,
                                                                          case.head_dim)


def make_row(case, precision: str, *, gpu_us: float, host_us, gemm_tflops: float, peers_us: dict,
             peer_errors: dict, rel_errors: dict, deterministic: bool, sm_mhz=None) -> dict:
    """One case of the JSON; ``ratio_to_peer`` is each peer's time over ours (None where the peer has none)."""
    flop = block_flops(case)
    err = max(rel_errors.values()) if rel_errors else float("inf")
    tflops = flop / gpu_us / 1e6
    return {"name": case.name, "precision": precision, "hidden": case.hidden, "num_heads": case.num_heads,
            "head_dim": case.head_dim, "seq_lens": seq_lens_json(case.seq_lens), "tokens": int(sum(case.seq_lens)),
            "gflop": round(flop / 1e9, 2), "gpu_us": round(gpu_us, 2),
            "host_us": None if host_us is None else round(host_us, 1), "sm_mhz": sm_mhz, "tflops": round(tflops, 2),
            "fraction_of_gemm_ceiling": round(tflops / gemm_tflops, 4), "peers_us": dict(peers_us),
            "peers_tflops": {k: tflops_of(flop, v) for k, v in peers_us.items()}, "peer_errors": dict(peer_errors),
            "ratio_to_peer": {k: None if v is None else round(v / gpu_us, 3) for k, v in peers_us.items()},
            "rel_errors": dict(rel_errors), "max_rel_error": err, "correct": bool(err <= TOL[precision]),
            "deterministic": bool(deterministic)}


def peer_geomeans(rows: list) -> dict:
    """Each peer's geometric mean of ``ratio_to_peer`` over the cases where it has one (None where it has none)."""
    ratios = {}
    for r in rows:
        for name, v in r.get("ratio_to_peer", {}).items():
            ratios.setdefault(name, [])
            if v:
                ratios[name].append(v)
    return {k: math.exp(sum(math.log(v) for v in vs) / len(vs)) if vs else None for k, vs in ratios.items()}


def block_reference(x: dict, num_heads: int, scaling=None, budget: int = 1 << 26):
    """The five gradients of the block in float64 (NumPy or CuPy, as ``x``): the formulas of
    :func:`cupy_rope.reference.vision_attention_backward`, with the attention in query chunks."""
    dy, hs = R._f64(x["grad_output"]), R._f64(x["hidden_states"])
    q, k, v = R._split_qkv(hs, x["qkv_weight"], x["qkv_bias"], num_heads)
    t, nh, d = q.shape
    cos, sin = x["cos"], x["sin"]
    qr, kr = R._rope(q, cos, sin), R._rope(k, cos, sin)
    do = (dy @ R._f64(x["proj_weight"])).reshape(t, nh, d)
    o, _, dq, dk, dv = attention_reference(qr, kr, v, do, x["cu_seqlens"], scaling, budget=budget)
    del qr, kr, q, k, v, do
    dq, dk = R._rope_backward(dq, cos, sin), R._rope_backward(dk, cos, sin)
    grad_qkv = R._xp(hs).stack([dq, dk, dv], axis=1).reshape(t, 3 * nh * d)
    del dq, dk, dv
    return (grad_qkv @ R._f64(x["qkv_weight"]), grad_qkv.T @ hs, grad_qkv.sum(0),
            dy.T @ o.reshape(t, nh * d), dy.sum(0))


def _peers(timer, x: dict, precision: str, reps: int):
    """(peers_us, peer_errors): every peer of the precision is a key, None where it has no time."""
    names = [n for n, ps in PEERS.items() if precision in ps]
    torch = B.torch_or_none()
    if torch is None:
        return {n: None for n in names}, {n: "PyTorch with CUDA is not importable" for n in names}

    def tf32_block():
        # PyTorch's choice among the fused backends; the math one (NH L^2 fp32 buffers) is left out, so a long
        # sequence fails plainly instead of exhausting memory
        from torch.nn.attention import SDPBackend

        fused = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION]
        return TP.block_peer(x, "sdpa", tf32_on=True, sdpa_backends=fused)

    makers = {"torch_bf16_block": lambda: TP.block_peer(x, "varlen", autocast_bf16=True),
              "torch_tf32_block": tf32_block}
    return TP.time_peers(timer, {n: makers[n] for n in names}, reps, torch)


def run_case(timer, case, precision: str, *, reps: int | None, peers: bool, gemm_tflops: float, seed: int) -> dict:
    import cupy

    from .attention import vision_attention_backward

    cu = cu_seqlens_of(case.seq_lens)
    x = make_inputs(cu[-1], len(case.seq_lens), cupy.random.default_rng(seed), hidden=case.hidden,
                    head_dim=case.head_dim, cu=cu)
    args = [x[k] for k in ARG_KEYS] + [np.asarray(cu, np.int32)]  # host cu_seqlens: nothing read back

    def call():
        return vision_attention_backward(*args, num_heads=case.num_heads, precision=precision)

    first, again = call(), call()
    deterministic = all(B.same_bits(a, b) for a, b in zip(first, again))
    del again
    ref = block_reference(x, case.num_heads)
    rel = {name: B.rel_err(a, r) for name, a, r in zip(OUTPUTS, first, ref)}
    del ref, first
    TP.release(None)
    reps = reps or DEFAULT_REPS
    gpu = timer.gpu_us(call, reps=reps)
    mhz = timer.last_sm_mhz
    host = timer.host_us(call, n=2, loops=3)
    TP.release(None)
    peers_us, peer_errors = _peers(timer, x, precision, reps) if peers else ({}, {})
    return make_row(case, precision, gpu_us=gpu, host_us=host, gemm_tflops=gemm_tflops, peers_us=peers_us,
                    peer_errors=peer_errors, rel_errors=rel, deterministic=deterministic, sm_mhz=mhz)


def run(precision: str = "tf32", out_path: str | None = None, reps: int | None = None, peers: bool = True,
        cases=None, hold_host: bool = True) -> int:
    """Time every case (``cases``: LongCase list, default all), print a table as it goes, write the JSON to
    ``out_path``; 1 when any case fails (error, outside the bound, or not bit-identical on repeat), else 0."""
    def means(rows):
        m = summary(rows)
        m.pop("geomean_ratio_to_best_peer")
        m["geomean_ratio_to_peer"] = peer_geomeans(rows)
        return m

    return drive("vision_attention_backward, long sequences", OP,
                 "one call = vision_attention_backward (host cu_seqlens); FLOP = GEMMs 2*T*H*11H + attention "
                 "14 L^2 D per head and sequence (forward recompute + backward); errors vs float64 on the GPU",
                 LONG_CASES, cases,
                 lambda timer, case, rate, seed: run_case(timer, case, precision, reps=reps, peers=peers,
                                                          gemm_tflops=rate, seed=seed),
                 precision, 22, 4048, out_path, means, hold_host)
