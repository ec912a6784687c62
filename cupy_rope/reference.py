"""NumPy float64 references for both ops: the definitions the kernels are tested against.

Everything is computed in float64. The functions are written once against the array API that NumPy and
CuPy share: NumPy inputs give a NumPy result (the CPU tests prove these against finite differences); CuPy
inputs run the very same float64 code on the GPU, which is how the GPU tests and the benchmark check large
cases quickly.
"""
from __future__ import annotations

import numpy as np


def _xp(x):
    try:
        import cupy

        if isinstance(x, cupy.ndarray):
            return cupy
    except ImportError:  # pragma: no cover
        pass
    return np


def _f64(x):
    return _xp(x).asarray(x, dtype=np.float64)


# ---- 2D RoPE position encoding ---------------------------------------------------------------

def rope_2d_forward(idx_theta):
    """``(cos(idx_theta), sin(idx_theta))`` in float64."""
    t = _f64(idx_theta)
    xp = _xp(t)
    return xp.cos(t), xp.sin(t)


def rope_2d_backward(grad_cos, grad_sin, idx_theta):
    """``-grad_cos * sin(idx_theta) + grad_sin * cos(idx_theta)`` in float64."""
    t = _f64(idx_theta)
    xp = _xp(t)
    return -_f64(grad_cos) * xp.sin(t) + _f64(grad_sin) * xp.cos(t)


# ---- fused varlen vision attention with 2D RoPE -----------------------------------------------

def _rotate_half(x):
    h = x.shape[-1] // 2
    return _xp(x).concatenate([-x[..., h:], x[..., :h]], axis=-1)


def _rotate_half_inverse(y):
    h = y.shape[-1] // 2
    return _xp(y).concatenate([y[..., h:], -y[..., :h]], axis=-1)


def _split_qkv(hidden_states, qkv_weight, qkv_bias, num_heads):
    x = _f64(hidden_states)
    qkv = x @ _f64(qkv_weight).T + _f64(qkv_bias)
    t = x.shape[0]
    d = qkv.shape[1] // (3 * num_heads)
    qkv = qkv.reshape(t, 3, num_heads, d)
    return qkv[:, 0], qkv[:, 1], qkv[:, 2]


def _rope(x, cos, sin):
    c, s = _f64(cos)[:, None, :], _f64(sin)[:, None, :]
    return x * c + _rotate_half(x) * s


def _rope_backward(g, cos, sin):
    c, s = _f64(cos)[:, None, :], _f64(sin)[:, None, :]
    return g * c + _rotate_half_inverse(g * s)


def _segments(cu_seqlens):
    cu = cu_seqlens.get() if hasattr(cu_seqlens, "get") else cu_seqlens
    cu = np.asarray(cu, dtype=np.int64)
    return [(int(a), int(b)) for a, b in zip(cu[:-1], cu[1:])]


def _softmax(s):
    m = s.max(axis=-1, keepdims=True)
    e = _xp(s).exp(s - m)
    return e / e.sum(axis=-1, keepdims=True)


def vision_attention_forward(hidden_states, qkv_weight, qkv_bias, proj_weight, proj_bias, cos, sin, cu_seqlens,
                             scaling=None, *, num_heads):
    """Output ``[T, hidden]`` of the attention block, float64."""
    q, k, v = _split_qkv(hidden_states, qkv_weight, qkv_bias, num_heads)
    d = q.shape[-1]
    scaling = d ** -0.5 if scaling is None else scaling
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    o = _xp(v).zeros_like(v)
    for a, b in _segments(cu_seqlens):
        if b > a:
            qs, ks, vs = (x[a:b].transpose(1, 0, 2) for x in (q, k, v))  # [NH, L, D]
            p = _softmax(scaling * qs @ ks.transpose(0, 2, 1))
            o[a:b] = (p @ vs).transpose(1, 0, 2)
    t, nh, d = o.shape
    return o.reshape(t, nh * d) @ _f64(proj_weight).T + _f64(proj_bias)


def _attention_grads(do, q, k, v, cu_seqlens, scaling):
    """``(o, dq, dk, dv)`` [T, NH, D] of per-sequence softmax attention for the output gradient ``do``, float64,
    as written in the specification (dS = scaling P (dP - rowsum(dO O)))."""
    xp = _xp(q)
    o, dq, dk, dv = xp.zeros_like(v), xp.zeros_like(q), xp.zeros_like(k), xp.zeros_like(v)
    for a, b in _segments(cu_seqlens):
        if b == a:
            continue
        qs, ks, vs, dos = (z[a:b].transpose(1, 0, 2) for z in (q, k, v, do))
        p = _softmax(scaling * qs @ ks.transpose(0, 2, 1))
        os_ = p @ vs
        o[a:b] = os_.transpose(1, 0, 2)
        dp = dos @ vs.transpose(0, 2, 1)
        ds = scaling * p * (dp - (dos * os_).sum(-1, keepdims=True))
        dq[a:b] = (ds @ ks).transpose(1, 0, 2)
        dk[a:b] = (ds.transpose(0, 2, 1) @ qs).transpose(1, 0, 2)
        dv[a:b] = (p.transpose(0, 2, 1) @ dos).transpose(1, 0, 2)
    return o, dq, dk, dv


def vision_attention_backward(grad_output, hidden_states, qkv_weight, qkv_bias, proj_weight, proj_bias, cos, sin,
                              cu_seqlens, scaling=None, *, num_heads):
    """The five gradients ``(grad_hidden_states, grad_qkv_weight, grad_qkv_bias, grad_proj_weight,
    grad_proj_bias)`` of the attention block, float64, computed as written in the specification."""
    dy = _f64(grad_output)
    x = _f64(hidden_states)
    q, k, v = _split_qkv(x, qkv_weight, qkv_bias, num_heads)
    t, nh, d = q.shape
    scaling = d ** -0.5 if scaling is None else scaling
    qr, kr = _rope(q, cos, sin), _rope(k, cos, sin)
    xp = _xp(x)
    do = (dy @ _f64(proj_weight)).reshape(t, nh, d)
    o, dq, dk, dv = _attention_grads(do, qr, kr, v, cu_seqlens, scaling)
    dq, dk = _rope_backward(dq, cos, sin), _rope_backward(dk, cos, sin)
    grad_qkv = xp.stack([dq, dk, dv], axis=1).reshape(t, 3 * nh * d)
    return (grad_qkv @ _f64(qkv_weight), grad_qkv.T @ x, grad_qkv.sum(0),
            dy.T @ o.reshape(t, nh * d), dy.sum(0))


def varlen_attention_forward(q, k, v, cu_seqlens, scaling=None):
    """``(o [T, NH, D], lse [NH, T])`` of varlen attention, float64: per sequence and head
    ``o = softmax(scaling q k^T) v`` and ``lse`` the natural log-sum-exp of each row of ``scaling q k^T``."""
    q, k, v = _f64(q), _f64(k), _f64(v)
    t, nh, d = q.shape
    scaling = d ** -0.5 if scaling is None else scaling
    xp = _xp(q)
    o = xp.zeros_like(v)
    lse = xp.zeros((nh, t))
    for a, b in _segments(cu_seqlens):
        if b > a:
            qs, ks, vs = (x[a:b].transpose(1, 0, 2) for x in (q, k, v))  # [NH, L, D]
            s = scaling * qs @ ks.transpose(0, 2, 1)
            m = s.max(axis=-1, keepdims=True)
            e = xp.exp(s - m)
            tot = e.sum(axis=-1, keepdims=True)
            o[a:b] = ((e / tot) @ vs).transpose(1, 0, 2)
            lse[:, a:b] = (m + xp.log(tot))[..., 0]
    return o, lse


def varlen_attention_backward(grad_o, q, k, v, cu_seqlens, scaling=None):
    """``(dq, dk, dv)`` [T, NH, D] of varlen attention, float64: the gradient of ``sum(grad_o * o)``."""
    q = _f64(q)
    d = q.shape[-1]
    scaling = d ** -0.5 if scaling is None else scaling
    return _attention_grads(_f64(grad_o), q, _f64(k), _f64(v), cu_seqlens, scaling)[1:]
