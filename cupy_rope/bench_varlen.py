"""Benchmark of varlen attention alone (``varlen_attention_forward`` + ``varlen_attention_backward``)
over the built-in workloads (:data:`cupy_rope.workloads.VARLEN_CASES`), with PyTorch peers timed the same way.

One timed call is the pair a training step makes: the forward, then the backward of its output, with host
``cu_seqlens`` and ``max_seqlen`` (nothing read back from the device). Each case is checked against a float64
reference computed on the GPU in query chunks (:func:`attention_reference`: memory O(T·H) plus a chunk, so a
16k-token sequence takes seconds) and for bit-identical repeats.
"""
from __future__ import annotations

import math
import statistics
import sys
import traceback

import numpy as np

from . import _bench as B
from . import _checks as C
from . import _torch_peers as TP
from . import reference as R
from .bench_attention import TOL
from .workloads import VARLEN_CASES, cu_seqlens_of

OP = "varlen_attention"
# name -> the precisions it is a peer for (what a PyTorch user would run for the same attention)
PEERS = {"varlen_attn": ("bf16",), "cudnn_sdpa": ("bf16",), "sdpa_math_tf32": ("tf32",),
         "sdpa_mem_efficient_fp32": ("tf32", "fp32")}
MATH_MEMORY_LIMIT = 60e9  # bytes: the math backend's O(L^2) autograd buffers (4 per head, fp32) must fit below
BIG_GFLOP = 100.0  # cases above this get fewer default repetitions
OUTPUT_NAMES = ("o", "lse", "dq", "dk", "dv")  # as attention_reference returns them


# ---- counts and the JSON row (pure) ------------------------------------------------------------------------------

def attention_flops(seq_lens, num_heads: int, head_dim: int) -> float:
    """Forward + backward FLOPs: 14 L^2 D per head and sequence (QK^T and PV forward; QK^T again, dP, dV, dQ, dK
    in the backward), summed over the sequences."""
    return sum(14.0 * n * n * head_dim * num_heads for n in seq_lens)


def default_reps(gflop: float) -> int:
    return 10 if gflop > BIG_GFLOP else 20


def seq_lens_json(seq_lens, limit: int = 16):
    """The sequence lengths as a list, or a summary when there are more than ``limit``."""
    lens = [int(n) for n in seq_lens]
    if len(lens) <= limit:
        return lens
    return {"count": len(lens), "min": min(lens), "max": max(lens), "total": sum(lens)}


def tflops_of(flop: float, us):
    return None if us is None else round(flop / us / 1e6, 2)


def best_peer_ratio(peers_us: dict, gpu_us: float):
    """The fastest peer's time over ours (above 1: we are faster); None when no peer has a time."""
    times = [v for v in peers_us.values() if v is not None]
    return round(min(times) / gpu_us, 3) if times else None


def make_row(case, precision: str, *, gpu_us: float, host_us, gemm_tflops: float, peers_us: dict,
             peer_errors: dict, rel_errors: dict, deterministic: bool, sm_mhz=None) -> dict:
    """One case of the JSON: our time and rate, the peers' (None where a peer has no time, with the reason in
    ``peer_errors``), the errors against float64 and the verdicts (the README's error bounds)."""
    flop = attention_flops(case.seq_lens, case.num_heads, case.head_dim)
    err = max(rel_errors.values()) if rel_errors else math.inf
    tflops = flop / gpu_us / 1e6
    return {"name": case.name, "precision": precision, "seq_lens": seq_lens_json(case.seq_lens),
            "tokens": int(sum(case.seq_lens)), "num_heads": case.num_heads, "head_dim": case.head_dim,
            "gflop": round(flop / 1e9, 2), "gpu_us": round(gpu_us, 2),
            "host_us": None if host_us is None else round(host_us, 1), "sm_mhz": sm_mhz, "tflops": round(tflops, 2),
            "fraction_of_gemm_ceiling": round(tflops / gemm_tflops, 4),
            "peers_us": dict(peers_us), "peers_tflops": {k: tflops_of(flop, v) for k, v in peers_us.items()},
            "peer_errors": dict(peer_errors), "ratio_to_best_peer": best_peer_ratio(peers_us, gpu_us),
            "rel_errors": dict(rel_errors), "max_rel_error": err, "correct": bool(err <= TOL[precision]),
            "deterministic": bool(deterministic)}


def summary(rows: list) -> dict:
    """Means over the cases that ran: GPU time (mean, geometric mean) and the geometric mean of the ratios."""
    ok = [r for r in rows if "gpu_us" in r]
    out = {"mean_gpu_us": None, "geomean_gpu_us": None, "geomean_ratio_to_best_peer": None}
    if ok:
        times = [r["gpu_us"] for r in ok]
        out["mean_gpu_us"] = statistics.mean(times)
        out["geomean_gpu_us"] = math.exp(statistics.mean(math.log(v) for v in times))
    ratios = [r.get("ratio_to_best_peer") for r in ok]
    ratios = [v for v in ratios if v]
    if ratios:
        out["geomean_ratio_to_best_peer"] = math.exp(statistics.mean(math.log(v) for v in ratios))
    return out


def math_layout(seq_lens, num_heads: int, limit: float = MATH_MEMORY_LIMIT):
    """How the math-backend peer runs a case: ``"dense"`` ([B, NH, L, D] at once: equal lengths, all B of the
    O(L^2) buffers fit), ``"per_sequence"``, or None when one sequence's 4 NH L^2 fp32 buffers exceed ``limit``."""
    lens = [int(n) for n in seq_lens if n > 0]
    if not lens:
        return None
    need = 4 * num_heads * max(lens) ** 2 * 4
    if need > limit:
        return None
    if len(set(lens)) == 1 and len(lens) == len(seq_lens) and need * len(lens) <= limit:
        return "dense"
    return "per_sequence"


# ---- float64 reference, chunked (NumPy or CuPy) --------------------------------------------------------------

def output_errors(outs, ref) -> dict:
    """Relative Frobenius error of every output (o, lse, dq, dk, dv) against its float64 reference."""
    return {name: B.rel_err(to_f64(a), r) for name, a, r in zip(OUTPUT_NAMES, outs, ref, strict=True)}


def to_f64(x):
    """float64 of a NumPy or CuPy array; bf16 widened through its bits (its bits are an fp32's high half), which
    needs no bf16 arithmetic from the array library."""
    xp = R._xp(x)
    if C.BF16 is not None and x.dtype == C.BF16:
        x = (x.view(xp.uint16).astype(xp.uint32) << 16).view(xp.float32)
    return xp.asarray(x, dtype=np.float64)


def attention_reference(q, k, v, grad_o, cu_seqlens, scaling=None, budget: int = 1 << 26):
    """``(o, lse, dq, dk, dv)`` of varlen attention in float64, on the arrays' device (NumPy or CuPy).

    The formulas of :func:`cupy_rope.reference.varlen_attention_forward` / ``varlen_attention_backward``, computed
    per sequence in chunks of query rows over all heads at once, ``budget`` elements per ``[NH, rows, L]`` score
    block: a row's softmax is complete within its chunk, so o, lse and dq come chunk by chunk while dk and dv add
    up over the chunks. Memory: the inputs and outputs plus a few score blocks (never NH·L^2 at once)."""
    q, k, v, g = (to_f64(z) for z in (q, k, v, grad_o))
    xp = R._xp(q)
    t, nh, d = q.shape
    scaling = d ** -0.5 if scaling is None else float(scaling)
    o, dq, dk, dv = (xp.zeros((t, nh, d)) for _ in range(4))
    lse = xp.zeros((nh, t))
    for a, b in R._segments(cu_seqlens):
        n = b - a
        if n == 0:
            continue
        qs, ks, vs, gs = (xp.ascontiguousarray(z[a:b].transpose(1, 0, 2)) for z in (q, k, v, g))  # [NH, L, D]
        kt, vt = ks.transpose(0, 2, 1), vs.transpose(0, 2, 1)
        dks, dvs = xp.zeros_like(ks), xp.zeros_like(vs)
        rows = max(1, min(n, budget // (nh * n)))
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            qc, gc = qs[:, r0:r1], gs[:, r0:r1]
            s = qc @ kt
            s *= scaling
            m = s.max(axis=-1, keepdims=True)
            s -= m
            p = xp.exp(s, out=s)
            tot = p.sum(axis=-1, keepdims=True)
            p /= tot
            oc = p @ vs
            o[a + r0:a + r1] = oc.transpose(1, 0, 2)
            lse[:, a + r0:a + r1] = (m + xp.log(tot))[..., 0]
            ds = gc @ vt  # dP, then dS = scaling P (dP - rowsum(dO O)) in place
            ds -= (gc * oc).sum(axis=-1, keepdims=True)
            ds *= p
            ds *= scaling
            dq[a + r0:a + r1] = (ds @ ks).transpose(1, 0, 2)
            dks += ds.transpose(0, 2, 1) @ qc
            dvs += p.transpose(0, 2, 1) @ gc
            del s, p, ds, oc
        dk[a:b] = dks.transpose(1, 0, 2)
        dv[a:b] = dvs.transpose(1, 0, 2)
    return o, lse, dq, dk, dv


# ---- the PyTorch peers -------------------------------------------------------------------------------------------

def _peer_makers(torch, arrays, case, cu: np.ndarray, precision: str) -> dict:
    """name -> a function building the peer's ``fn()`` (forward + autograd backward on our q, k, v and grad_o,
    shared through DLPack), or the reason it does not apply, for the peers of ``precision``."""
    q, k, v, g = (TP.to_torch(torch, z) for z in arrays)
    leaves = tuple(z.detach().requires_grad_(True) for z in (q, k, v))  # leaves sharing our memory
    nh, d = case.num_heads, case.head_dim
    lens = [int(n) for n in case.seq_lens]
    scale = d ** -0.5
    equal = len(set(lens)) == 1 and lens[0] > 0
    max_len = max(lens)
    makers = {}

    def dense(z):  # [T, NH, D] -> [B, NH, L, D] (a view: no copy in the timed call)
        return z.view(len(lens), lens[0], nh, d).transpose(1, 2)

    def sdpa_fn(backend, tf32_on, layout):
        import torch.nn.functional as F
        from torch.nn.attention import sdpa_kernel

        segs = [(a, b) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()) if b > a]

        def fn():
            with TP.tf32(torch, tf32_on), sdpa_kernel(backend):
                if layout == "dense":
                    o = F.scaled_dot_product_attention(*(dense(z) for z in leaves), scale=scale)
                    return torch.autograd.grad(o, leaves, dense(g))
                outs = [F.scaled_dot_product_attention(*(z[a:b].transpose(0, 1)[None] for z in leaves),
                                                       scale=scale)[0].transpose(0, 1) for a, b in segs]
                return torch.autograd.grad(torch.cat(outs), leaves, g)
        return fn

    def varlen_make():
        flash = TP.varlen_attn(torch, d, scale)
        cu_dev = torch.tensor(cu.tolist(), dtype=torch.int32, device="cuda")

        def fn():
            o = flash(*leaves, cu_dev, max_len)
            return torch.autograd.grad(o, leaves, g)
        return fn

    from torch.nn.attention import SDPBackend

    if precision == "bf16":
        makers["varlen_attn"] = varlen_make
        makers["cudnn_sdpa"] = ((lambda: sdpa_fn(SDPBackend.CUDNN_ATTENTION, False, "dense")) if equal else
                                "sequence lengths differ or one is 0 (the dense [B, NH, L, D] layout)")
    if precision == "tf32":
        math_how = math_layout(lens, nh)
        makers["sdpa_math_tf32"] = ((lambda: sdpa_fn(SDPBackend.MATH, True, math_how)) if math_how else
                                    f"O(L^2) memory above {MATH_MEMORY_LIMIT / 1e9:.0f} GB")
    if precision in ("tf32", "fp32"):
        eff_how = "dense" if equal else "per_sequence"
        makers["sdpa_mem_efficient_fp32"] = lambda: sdpa_fn(SDPBackend.EFFICIENT_ATTENTION, False, eff_how)
    return makers


def _peers(timer, arrays, case, cu, precision, reps):
    """(peers_us, peer_errors) of one case; every peer of the precision is a key, None where it has no time."""
    names = [n for n, ps in PEERS.items() if precision in ps]
    torch = B.torch_or_none()
    if torch is None:
        return {n: None for n in names}, {n: "PyTorch with CUDA is not importable" for n in names}
    try:
        makers = _peer_makers(torch, arrays, case, cu, precision)
    except Exception as e:  # noqa: BLE001 - e.g. a PyTorch without torch.nn.attention
        return {n: None for n in names}, {n: TP.error_text(e) for n in names}
    return TP.time_peers(timer, makers, reps, torch)


# ---- one case ----------------------------------------------------------------------------------------------------

def _nan_like(shape, dtype):
    import cupy

    if dtype == np.float32:
        return cupy.full(shape, np.nan, np.float32)
    return cupy.full(shape, 0x7FC0, cupy.uint16).view(dtype)  # bf16 NaN


def make_inputs(case, precision: str, seed: int):
    """q, k, v, grad_o ``[T, NH, D]``, standard normal, fresh per case (bf16 in bf16 mode, else fp32)."""
    import cupy

    rng = cupy.random.default_rng(seed)
    t = int(sum(case.seq_lens))
    xs = [rng.standard_normal((t, case.num_heads, case.head_dim), dtype=np.float32) for _ in range(4)]
    if precision == "bf16":
        xs = [x.astype(C.BF16) for x in xs]
    return xs


def run_case(timer, case, precision: str, *, reps: int | None, peers: bool, gemm_tflops: float, seed: int) -> dict:
    from .attention import varlen_attention_backward as bwd
    from .attention import varlen_attention_forward as fwd

    cu = np.asarray(cu_seqlens_of(case.seq_lens), np.int32)
    max_len = max(case.seq_lens)
    q, k, v, g = make_inputs(case, precision, seed)
    shape, o_dtype = q.shape, q.dtype

    def pair(out):
        o, lse = fwd(q, k, v, cu, precision=precision, max_seqlen=max_len, out=out)
        return (o, lse) + tuple(bwd(g, q, k, v, o, lse, cu, precision=precision, max_seqlen=max_len))

    first = pair(_nan_like(shape, o_dtype))  # outputs poisoned: a row never written shows as NaN
    again = pair(_nan_like(shape, o_dtype))
    deterministic = all(B.same_bits(a, b) for a, b in zip(first, again))
    del again
    ref = attention_reference(q, k, v, g, cu)
    rel = output_errors(first, ref)
    del ref, first
    TP.release(None)
    gflop = attention_flops(case.seq_lens, case.num_heads, case.head_dim) / 1e9
    reps = reps or default_reps(gflop)
    out = _nan_like(shape, o_dtype)
    fn = lambda: pair(out)  # noqa: E731
    gpu = timer.gpu_us(fn, reps=reps)
    mhz = timer.last_sm_mhz
    host = timer.host_us(fn, n=3, loops=3)
    fn = out = None
    peers_us, peer_errors = _peers(timer, (q, k, v, g), case, cu, precision, reps) if peers else ({}, {})
    return make_row(case, precision, gpu_us=gpu, host_us=host, gemm_tflops=gemm_tflops, peers_us=peers_us,
                    peer_errors=peer_errors, rel_errors=rel, deterministic=deterministic, sm_mhz=mhz)


def print_row(r: dict, width: int = 18) -> None:
    """One case of a long-sequence bench as a table row (name column ``width`` wide), or its failure."""
    if "error" in r:
        print(f"{r['name']:>{width}} FAILED: {r['error']}", flush=True)
        return
    ptxt = "  ".join(f"{k} {v:.0f} ({v / r['gpu_us']:.2f}x)" if v is not None else f"{k} -"
                     for k, v in r["peers_us"].items())
    verdict = ("" if r["correct"] else "  WRONG") + ("" if r["deterministic"] else "  NONDETERMINISTIC")
    mhz = r.get("sm_mhz")
    print(f"{r['name']:>{width}} {r['tokens']:>6} {r['gpu_us']:>10.1f} {r['tflops']:>7.1f} "
          f"{100 * r['fraction_of_gemm_ceiling']:>5.1f}% {r['max_rel_error']:>8.1e} {mhz or 0:>5.0f}  {ptxt}{verdict}",
          flush=True)


def _release_between() -> None:
    TP.release(B.torch_or_none())


def run_cases(cases, run_one, precision: str, width: int) -> tuple[list, int]:
    """``run_one(case)`` for every case, each row printed as it comes (``width``: the name column), the memory
    pools handed back after each; a case that raises becomes an error row and does not stop the others. Returns
    (rows, how many failed: an error, outside the bound, or not bit-identical on repeat)."""
    rows, failed = [], 0
    for case in cases:
        try:
            row = run_one(case)
            failed += not (row["correct"] and row["deterministic"])
        except Exception as e:  # noqa: BLE001 - one failing case must not hide the others
            traceback.print_exc()
            row = {"name": case.name, "precision": precision, "error": TP.error_text(e)}
            failed += 1
        rows.append(row)
        print_row(row, width)
        _release_between()
    return rows, failed


def report(op: str, precision: str, info: dict, ceilings: dict, method: str, rows: list, means: dict,
           out_path: str | None) -> None:
    """Print the means and the peers' summary, write the JSON payload to ``out_path`` (if given)."""
    if means["mean_gpu_us"] is not None:
        print(f"mean {means['mean_gpu_us']:.1f} us, geomean {means['geomean_gpu_us']:.1f} us")
    TP.print_summary([r for r in rows if "peers_us" in r])
    payload = {"op": op, "precision": precision, "device": info["device"], "env": info, "ceilings": ceilings,
               "method": method, "cases": rows, **means}
    if out_path:
        B.write_json(out_path, payload)
    sys.stdout.flush()


def header(title: str, precision: str, info: dict, copy: float, rate: float, width: int) -> None:
    print(f"# {title} [{precision}] on {info['device']}: copy {copy:.3f} TB/s, "
          f"GEMM {rate:.1f} TFLOP/s (8192^3, {precision})")
    print(f"{'case':>{width}} {'T':>6} {'gpu_us':>10} {'TFLOP/s':>7} {'%gemm':>6} {'max_err':>8} {'MHz':>5}  "
          "peers (us, ratio peer/ours)", flush=True)


def drive(title: str, op: str, method: str, all_cases, cases, run_one, precision: str, width: int, seed0: int,
          out_path: str | None, means=summary, hold_host: bool = True) -> int:
    """One benchmark: the copy and GEMM ceilings measured first, a header, every case (``cases``, default
    ``all_cases``) through ``run_one(timer, case, gemm_tflops, seed)`` -- seeds fixed per case name, so a case's
    inputs do not depend on which others run -- then the means (``means(rows)``) and the JSON. 1 when any case
    fails (error, outside the bound, or not bit-identical on repeat), else 0. ``hold_host``: B.Timer's hold."""
    timer = B.Timer(hold_host)
    info = B.device_info()
    copy = B.copy_TBps(timer)
    rate = B.gemm_TFLOPs(timer, precision)
    header(title, precision, info, copy, rate, width)
    seeds = {c.name: seed0 + i for i, c in enumerate(all_cases)}
    rows, failed = run_cases(all_cases if cases is None else cases,
                             lambda case: run_one(timer, case, rate, seeds.get(case.name, seed0)), precision, width)
    report(op, precision, info, {"copy_TBps": copy, "gemm_TFLOPs": rate}, f"{timer.method()}; {method}", rows,
           means(rows), out_path)
    return 1 if failed else 0


def run(precision: str = "tf32", out_path: str | None = None, reps: int | None = None, peers: bool = True,
        cases=None, hold_host: bool = True) -> int:
    """Time every case (``cases``: VarlenCase list, default all), print a table as it goes, write the JSON to
    ``out_path``; 1 when any case fails (error, outside the bound, or not bit-identical on repeat), else 0."""
    return drive("varlen attention forward + backward", OP,
                 "one call = varlen_attention_forward + varlen_attention_backward (host cu_seqlens, max_seqlen); "
                 "FLOP = 14 L^2 D per head and sequence; errors vs float64 on the GPU", VARLEN_CASES, cases,
                 lambda timer, case, rate, seed: run_case(timer, case, precision, reps=reps, peers=peers,
                                                          gemm_tflops=rate, seed=seed),
                 precision, 18, 2024, out_path, hold_host=hold_host)
