"""The float64 references in cupy_rope.reference, proven on the CPU.

* RoPE: the backward equals central finite differences of the scalar loss sum(gc*cos(theta) + gs*sin(theta)).
* Attention: the forward equals an independent per-token loop written from the op's definition; all five gradients of
  the backward equal central finite differences of loss = sum(grad_output * forward(...)); tokens never attend
  across sequences; empty sequences contribute nothing.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from cupy_rope import reference as R
from tests.helpers import OUTPUTS as NAMES
from tests.helpers import rel_err  # NaN for a non-finite out: every comparison with it fails


# ---- RoPE ------------------------------------------------------------------------------------------

ROPE_SHAPES = [(3, 5, 8), (2, 7, 13, 2), (1, 1, 128), (4, 64), (2, 3, 130)]


@pytest.mark.parametrize("shape", ROPE_SHAPES)
@pytest.mark.parametrize("scale", [3.0, 1e5])
@pytest.mark.parametrize("gdtype", [np.float32, ml_dtypes.bfloat16, np.float16])
def test_rope_backward_is_the_derivative(shape, scale, gdtype, np_rng):
    gc = np_rng.standard_normal(shape).astype(gdtype)
    gs = np_rng.standard_normal(shape).astype(gdtype)
    th = np_rng.uniform(-scale, scale, shape).astype(np.float32)
    got = R.rope_2d_backward(gc, gs, th)
    assert got.dtype == np.float64 and got.shape == shape

    c, s, t = gc.astype(np.float64), gs.astype(np.float64), th.astype(np.float64)

    def term(tt):  # loss = sum(term(theta)); the terms are independent, so d loss / d theta_i = term_i'
        return c * np.cos(tt) + s * np.sin(tt)

    h = 1e-5
    tp, tm = t + h, t - h
    fd = (term(tp) - term(tm)) / (tp - tm)  # the actual (rounded) step, exact at |theta| ~ 1e5
    assert rel_err(got, fd) < 1e-8
    assert np.abs(got - fd).max() < 1e-7 * (np.abs(c).max() + np.abs(s).max())


def test_rope_backward_against_whole_loss(np_rng):
    """The same check through the full scalar loss, perturbing a few single angles."""
    shape = (2, 9, 16)
    gc = np_rng.standard_normal(shape)
    gs = np_rng.standard_normal(shape)
    t = np_rng.uniform(-1e5, 1e5, shape)
    got = R.rope_2d_backward(gc, gs, t)

    def loss(tt):
        return float(np.sum(gc * np.cos(tt) + gs * np.sin(tt)))

    flat = np.arange(t.size)
    for i in np_rng.choice(flat, 12, replace=False):
        idx = np.unravel_index(i, shape)
        tp, tm = t.copy(), t.copy()
        tp[idx] += 1e-4
        tm[idx] -= 1e-4
        fd = (loss(tp) - loss(tm)) / (tp[idx] - tm[idx])
        assert abs(fd - got[idx]) < 1e-6 * (1 + abs(got[idx])), (idx, fd, got[idx])


def test_rope_backward_sign_convention():
    # d/dtheta [gc cos + gs sin] = -gc sin + gs cos; at theta = pi/2 with gc = 1, gs = 0 it is -1.
    out = R.rope_2d_backward(np.array([1.0, 0.0]), np.array([0.0, 1.0]), np.array([np.pi / 2, 0.0]))
    np.testing.assert_allclose(out, [-1.0, 1.0], atol=1e-15)


def test_rope_forward(np_rng):
    th = np_rng.uniform(-1e5, 1e5, (4, 33)).astype(np.float32)
    c, s = R.rope_2d_forward(th)
    assert c.dtype == s.dtype == np.float64
    np.testing.assert_allclose(c, np.cos(th.astype(np.float64)), rtol=0, atol=1e-15)
    np.testing.assert_allclose(s, np.sin(th.astype(np.float64)), rtol=0, atol=1e-15)
    np.testing.assert_allclose(c * c + s * s, 1.0, atol=1e-14)


# ---- attention ---------------------------------------------------------------------------------------

HIDDEN, HEADS = 16, 2
CU = [0, 3, 4, 4, 9]  # sequences of 3, 1, 0 and 5 tokens
SCALING = 0.61  # not the default 8 ** -0.5


def make_attn(np_rng, t=CU[-1], hidden=HIDDEN, heads=HEADS):
    d = hidden // heads
    return dict(grad_output=np_rng.standard_normal((t, hidden)),
                hidden_states=np_rng.standard_normal((t, hidden)),
                qkv_weight=np_rng.standard_normal((3 * hidden, hidden)) * 0.3,
                qkv_bias=np_rng.standard_normal(3 * hidden) * 0.2,
                proj_weight=np_rng.standard_normal((hidden, hidden)) * 0.3,
                proj_bias=np_rng.standard_normal(hidden) * 0.2,
                cos=np_rng.standard_normal((t, d)),  # random, not rotary tables: cos[:, i] != cos[:, i + d/2]
                sin=np_rng.standard_normal((t, d)))


PARAMS = ("hidden_states", "qkv_weight", "qkv_bias", "proj_weight", "proj_bias")


def fwd(x, cu=CU, scaling=SCALING, heads=HEADS):
    return R.vision_attention_forward(*(x[k] for k in PARAMS), x["cos"], x["sin"], np.asarray(cu, np.int32),
                                      scaling, num_heads=heads)


def bwd(x, cu=CU, scaling=SCALING, heads=HEADS):
    return R.vision_attention_backward(x["grad_output"], *(x[k] for k in PARAMS), x["cos"], x["sin"],
                                       np.asarray(cu, np.int32), scaling, num_heads=heads)


def naive_forward(x, cu, scaling, heads):
    """Token by token, head by head, straight from the op's definition (no shared code with the reference)."""
    xs, wqkv, bqkv, wp, bp = (x[k] for k in PARAMS)
    t, hid = xs.shape
    d = hid // heads
    h2 = d // 2

    def rope(v, c, s):
        out = np.empty(d)
        for i in range(h2):
            out[i] = v[i] * c[i] - v[i + h2] * s[i]  # rotate_half([x1, x2]) = [-x2, x1]
            out[i + h2] = v[i + h2] * c[i + h2] + v[i] * s[i + h2]
        return out

    o = np.zeros((t, hid))
    for a, b in zip(cu[:-1], cu[1:]):
        for h in range(heads):
            qs, ks, vs = [], [], []
            for j in range(a, b):
                row = np.array([sum(wqkv[r, c] * xs[j, c] for c in range(hid)) for r in range(3 * hid)]) + bqkv
                qs.append(rope(row[h * d:(h + 1) * d], x["cos"][j], x["sin"][j]))
                ks.append(rope(row[hid + h * d:hid + (h + 1) * d], x["cos"][j], x["sin"][j]))
                vs.append(row[2 * hid + h * d:2 * hid + (h + 1) * d])
            for i in range(b - a):
                sc = [scaling * float(np.dot(qs[i], ks[j])) for j in range(b - a)]
                m = max(sc)
                e = [np.exp(v - m) for v in sc]
                tot = sum(e)
                o[a + i, h * d:(h + 1) * d] = sum((e[j] / tot) * vs[j] for j in range(b - a))
    return np.array([[sum(wp[r, c] * o[j, c] for c in range(hid)) + bp[r] for r in range(hid)] for j in range(t)])


@pytest.mark.parametrize("cu", [CU, [0, 9], [0, 0, 9, 9]])
def test_attention_forward_matches_naive_loop(cu, np_rng):
    x = make_attn(np_rng)
    got = fwd(x, cu)
    ref = naive_forward(x, cu, SCALING, HEADS)
    assert rel_err(got, ref) < 1e-13


def test_attention_forward_default_scaling(np_rng):
    x = make_attn(np_rng)
    d = HIDDEN // HEADS
    np.testing.assert_array_equal(fwd(x, scaling=None), fwd(x, scaling=d ** -0.5))
    assert rel_err(fwd(x, scaling=None), fwd(x, scaling=SCALING)) > 1e-3  # the scale matters


def test_attention_length_one_sequences_are_value_projection(np_rng):
    """With every sequence of length 1 the softmax is 1: out = (X Wv^T + bv) Wp^T + bp, whatever q, k, cos, sin."""
    x = make_attn(np_rng)
    cu = list(range(CU[-1] + 1))
    v = x["hidden_states"] @ x["qkv_weight"][2 * HIDDEN:].T + x["qkv_bias"][2 * HIDDEN:]
    expect = v @ x["proj_weight"].T + x["proj_bias"]
    np.testing.assert_allclose(fwd(x, cu), expect, rtol=1e-12, atol=1e-12)


def _fd_grad(x, name, h):
    """Central differences of loss = sum(grad_output * forward) over every element of x[name]."""
    g = x["grad_output"]
    p = x[name]
    out = np.empty_like(p)
    for i in range(p.size):
        idx = np.unravel_index(i, p.shape)
        orig = p[idx]
        p[idx] = orig + h
        up = p[idx]
        lp = float(np.sum(g * fwd(x)))
        p[idx] = orig - h
        dn = p[idx]
        lm = float(np.sum(g * fwd(x)))
        p[idx] = orig
        out[idx] = (lp - lm) / (up - dn)
    return out


def test_attention_backward_is_the_gradient(np_rng):
    x = make_attn(np_rng)
    grads = bwd(x)
    shapes = [x[k].shape for k in PARAMS]
    assert [g.shape for g in grads] == shapes
    for name, g in zip(PARAMS, grads):
        fd = _fd_grad(x, name, 1e-6)
        assert np.linalg.norm(fd) > 1e-2, f"{name}: degenerate test (gradient ~ 0)"
        err = rel_err(g, fd)
        assert err < 1e-6, f"d loss / d {name}: relative error {err:.2e} against finite differences"


def test_attention_backward_defaults_match_explicit(np_rng):
    x = make_attn(np_rng)
    d = HIDDEN // HEADS
    a = R.vision_attention_backward(x["grad_output"], *(x[k] for k in PARAMS), x["cos"], x["sin"], CU,
                                    num_heads=HEADS)
    b = bwd(x, scaling=d ** -0.5)
    for u, v in zip(a, b):
        np.testing.assert_array_equal(u, v)


def _rows(cu, i):
    return slice(cu[i], cu[i + 1])


def test_no_attention_across_sequences(np_rng):
    x = make_attn(np_rng)
    base = fwd(x)
    y = {k: v.copy() for k, v in x.items()}
    y["hidden_states"][_rows(CU, 3)] += np_rng.standard_normal((CU[4] - CU[3], HIDDEN))
    pert = fwd(y)
    # the perturbed sequence changes ...
    assert rel_err(pert[_rows(CU, 3)], base[_rows(CU, 3)]) > 1e-2
    # ... and no other sequence does
    np.testing.assert_allclose(pert[:CU[3]], base[:CU[3]], rtol=1e-13, atol=1e-13)
    # each sequence run alone gives the same rows as the batch
    for i in range(len(CU) - 1):
        a, b = CU[i], CU[i + 1]
        if b == a:
            continue
        alone = {k: (v[a:b] if k in ("grad_output", "hidden_states", "cos", "sin") else v) for k, v in x.items()}
        np.testing.assert_allclose(fwd(alone, [0, b - a]), base[a:b], rtol=1e-12, atol=1e-12)
    # one long sequence instead of four gives a different answer (cu_seqlens is not ignored)
    assert rel_err(fwd(x, [0, CU[-1]]), base) > 1e-3


def test_backward_stays_within_sequences(np_rng):
    """grad_hidden_states of one sequence does not depend on grad_output of another sequence."""
    x = make_attn(np_rng)
    g0 = bwd(x)[0]
    y = dict(x)
    y["grad_output"] = x["grad_output"].copy()
    y["grad_output"][_rows(CU, 0)] += np_rng.standard_normal((CU[1], HIDDEN))
    g1 = bwd(y)[0]
    assert rel_err(g1[_rows(CU, 0)], g0[_rows(CU, 0)]) > 1e-2
    np.testing.assert_allclose(g1[CU[1]:], g0[CU[1]:], rtol=1e-12, atol=1e-12)


def test_empty_sequences_contribute_nothing(np_rng):
    x = make_attn(np_rng)
    without = [0, 3, 4, 9]
    for cu in (CU, [0, 0, 3, 4, 4, 9, 9, 9]):
        np.testing.assert_allclose(fwd(x, cu), fwd(x, without), rtol=1e-14, atol=1e-14)
        for name, a, b in zip(NAMES, bwd(x, cu), bwd(x, without)):
            np.testing.assert_allclose(a, b, rtol=1e-14, atol=1e-14, err_msg=name)


def test_no_tokens_backward():
    """T = 0: an empty grad_hidden_states and all-zero parameter gradients (sums over no tokens)."""
    rng = np.random.default_rng(5)
    x = make_attn(rng, t=0)
    gh, gw, gb, gpw, gpb = bwd(x, [0, 0])
    assert gh.shape == (0, HIDDEN)
    assert [g.shape for g in (gw, gb, gpw, gpb)] == [(3 * HIDDEN, HIDDEN), (3 * HIDDEN,), (HIDDEN, HIDDEN), (HIDDEN,)]
    for g in (gw, gb, gpw, gpb):
        assert not g.any()


def test_no_tokens_forward():
    rng = np.random.default_rng(6)
    x = make_attn(rng, t=0)
    assert fwd(x, [0, 0]).shape == (0, HIDDEN)
