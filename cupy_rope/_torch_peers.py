"""PyTorch peers shared by the benchmarks: the attention block's forward as a user would write it, run through
autograd, and the fail-soft timing of any peer.

A peer is what a PyTorch user would run for the same work; it shares our inputs (DLPack, no copy) and is timed the
same way in the same run. PyTorch versions differ (``torch.nn.attention.varlen`` is recent and its signature has
changed), so a peer that cannot run reports ``None`` and the reason, and the benchmark goes on.
"""
from __future__ import annotations

import contextlib
import inspect
import math
import sys

import numpy as np

from . import _checks as C


class NotApplicable(Exception):
    """A peer that does not apply to a case (its message says why); reported as ``None`` and the reason."""


def error_text(e: BaseException, limit: int = 300) -> str:
    """One line for the JSON: the exception's type and the first line of its message."""
    lines = str(e).strip().splitlines()
    text = f"{type(e).__name__}: {lines[0] if lines else ''}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def to_torch(torch, x):
    """A torch view of a CuPy array (DLPack, shared memory). bf16 goes through its uint16 bits, which every DLPack
    version carries, and is viewed back as bfloat16."""
    if C.BF16 is not None and x.dtype == C.BF16:
        import cupy

        return torch.from_dlpack(x.view(cupy.uint16)).view(torch.bfloat16)
    return torch.from_dlpack(x)


@contextlib.contextmanager
def tf32(torch, enabled: bool):
    """TF32 allowed (or not) in cuBLAS and cuDNN for the duration; the previous settings restored after."""
    m, c = torch.backends.cuda.matmul, torch.backends.cudnn
    before = (m.allow_tf32, c.allow_tf32)
    m.allow_tf32 = c.allow_tf32 = enabled
    try:
        yield
    finally:
        m.allow_tf32, c.allow_tf32 = before


def varlen_attn(torch, head_dim: int, scale: float | None = None):
    """``f(q, k, v, cu, max_len) -> o`` through ``torch.nn.attention.varlen.varlen_attn`` (packed ``[T, NH, D]``
    bf16, int32 CUDA cu_seqlens). Raises ImportError where the module is absent (PyTorch before 2.9)."""
    from torch.nn.attention.varlen import varlen_attn as fn

    return adapt_varlen(fn, head_dim, scale)


def adapt_varlen(fn, head_dim: int, scale: float | None = None):
    """``f(q, k, v, cu, max_len) -> o`` calling ``fn`` (a ``varlen_attn``) whatever its keyword arguments: the first
    seven parameters (query, key, value, cu_seq_q, cu_seq_k, max_q, max_k) are positional in every version;
    ``scale`` is passed where it exists (versions without it use ``head_dim ** -0.5``, and another scale is not
    applicable there); a tuple result (output and auxiliary outputs) gives its output."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: pass nothing beyond the seven
        params = {}
    kw = {}
    if scale is not None:
        if "scale" in params:
            kw["scale"] = float(scale)
        elif not math.isclose(scale, head_dim ** -0.5, rel_tol=1e-12):
            raise NotApplicable("this varlen_attn has no scale parameter (it uses head_dim ** -0.5)")

    def call(q, k, v, cu, max_len):
        o = fn(q, k, v, cu, cu, int(max_len), int(max_len), **kw)
        return o[0] if isinstance(o, (tuple, list)) else o

    return call


# ---- the attention block (bench_attention's seed forward, and the long-sequence benchmark) ---------------------

ATTENTIONS = ("softmax", "sdpa", "varlen")


def block_peer(x: dict, attention: str, *, tf32_on: bool = False, autocast_bf16: bool = False,
               sdpa_backends=None):
    """``fn()`` -> the five gradients of the attention block by PyTorch autograd of its forward, on the CuPy
    inputs ``x`` (bench_attention.make_inputs' keys) shared through DLPack.

    attention: ``"softmax"`` (written out per sequence), ``"sdpa"`` (``F.scaled_dot_product_attention`` per
    sequence; ``sdpa_backends`` a list of ``SDPBackend`` to restrict it, None for PyTorch's choice) or
    ``"varlen"`` (``varlen_attn`` on the packed q, k, v, cast to bf16 as it requires).
    tf32_on: TF32 allowed during the call. autocast_bf16: the forward under ``torch.autocast(bfloat16)``, with the
    projections through ``F.linear`` as ``nn.Linear`` does (the fp32 peers keep the seed's ``x @ W.T + b``).
    """
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
    import torch
    import torch.nn.functional as F

    t_ = {k: to_torch(torch, v) for k, v in x.items()}
    cu_host = x["cu_seqlens"]
    cu = [int(c) for c in (cu_host.get() if hasattr(cu_host, "get") else cu_host)]
    cu_dev = t_["cu_seqlens"] if t_["cu_seqlens"].is_cuda else t_["cu_seqlens"].cuda()
    cu_dev = cu_dev.to(torch.int32)
    max_len = max((b - a for a, b in zip(cu[:-1], cu[1:])), default=0)
    h = t_["hidden_states"].shape[1]
    d = t_["cos"].shape[1]
    nh = h // d
    scale = d ** -0.5
    params = {k: t_[k].clone().requires_grad_(True) for k in ("hidden_states", "qkv_weight", "qkv_bias",
                                                               "proj_weight", "proj_bias")}
    flash = varlen_attn(torch, d, scale) if attention == "varlen" else None
    grad_out = t_["grad_output"]
    grad_cast = grad_out.to(torch.bfloat16) if autocast_bf16 else grad_out  # the output's dtype under autocast

    def linear(z, w, b):
        return F.linear(z, w, b) if autocast_bf16 else z @ w.T + b

    def rot(z):
        return torch.cat([-z[..., d // 2:], z[..., : d // 2]], dim=-1)

    def sdpa(qs, ks, vs):
        if sdpa_backends is None:
            return F.scaled_dot_product_attention(qs, ks, vs, scale=scale)
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel(sdpa_backends):
            return F.scaled_dot_product_attention(qs, ks, vs, scale=scale)

    def forward():
        p = params
        qkv = linear(p["hidden_states"], p["qkv_weight"], p["qkv_bias"]).view(-1, 3, nh, d)
        q, k, v = qkv.unbind(1)
        c, s = t_["cos"][:, None, :], t_["sin"][:, None, :]
        q, k = q * c + rot(q) * s, k * c + rot(k) * s
        if attention == "varlen":
            q, k, v = (z.to(torch.bfloat16).contiguous() for z in (q, k, v))
            o = flash(q, k, v, cu_dev, max_len).reshape(-1, h)
        else:
            outs = []
            for a, b in zip(cu[:-1], cu[1:]):
                qs, ks, vs = (z[a:b].transpose(0, 1) for z in (q, k, v))
                if attention == "sdpa":
                    o = sdpa(qs[None], ks[None], vs[None])[0]
                else:
                    o = torch.softmax(qs @ ks.transpose(-1, -2) * scale, dim=-1) @ vs
                outs.append(o.transpose(0, 1))
            o = torch.cat(outs).reshape(-1, h)
        return linear(o, p["proj_weight"], p["proj_bias"])

    def fn():
        with tf32(torch, tf32_on):
            if autocast_bf16:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    out = forward()
            else:
                out = forward()
            g = grad_cast if grad_cast.dtype == out.dtype else grad_out.to(out.dtype)
            return torch.autograd.grad(out, list(params.values()), g)

    return fn


# ---- fail-soft timing ---------------------------------------------------------------------------------------

def release(torch) -> None:
    """Hand PyTorch's and CuPy's cached blocks back (between peers and cases: keeps peak memory modest)."""
    import cupy

    if torch is not None:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    cupy.cuda.runtime.deviceSynchronize()
    cupy.get_default_memory_pool().free_all_blocks()


def time_peers(timer, makers: dict, reps: int, torch=None, cleanup=None) -> tuple[dict, dict]:
    """GPU µs of each peer, timed as ours (``timer.gpu_us``), and the reason of each that has none.

    makers: name -> a function building the peer's ``fn()`` (it may raise :class:`NotApplicable`), or a string:
    the reason the peer does not apply. Any exception, out of memory included, makes that peer ``None``.
    cleanup: called after each peer (default :func:`release`: the peer's memory goes back before the next)."""
    cleanup = cleanup or (lambda: release(torch))
    us, errors = {}, {}
    for name, make in makers.items():
        if isinstance(make, str):
            us[name], errors[name] = None, make
            continue
        try:
            us[name] = round(timer.gpu_us(make(), reps=reps), 1)
        except NotApplicable as e:
            us[name], errors[name] = None, str(e)
        except Exception as e:  # noqa: BLE001 - a peer that fails must not stop the benchmark
            us[name], errors[name] = None, error_text(e)
        try:
            cleanup()
        except Exception as e:  # noqa: BLE001 - a sticky CUDA error shows in the next timed call anyway
            print(f"  cleanup after peer {name} failed: {error_text(e)}", file=sys.stderr, flush=True)
    return us, errors


def print_summary(rows: list, key: str = "peers_us") -> None:
    """Mean and geometric mean of each peer's GPU time over the cases where it has one."""
    names = []
    for r in rows:
        names += [n for n in r.get(key, {}) if n not in names]
    for name in names:
        vals = [r[key][name] for r in rows if r.get(key, {}).get(name) is not None]
        if vals:
            geo = math.exp(sum(math.log(v) for v in vals) / len(vals))
            print(f"  peer {name}: mean {np.mean(vals):.2f} us, geomean {geo:.2f} us over {len(vals)} cases")
        else:
            print(f"  peer {name}: no timing")
