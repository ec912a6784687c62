"""Varlen attention alone (SPEC 2b) on the CPU: the float64 reference is the derivative of its forward (central
finite differences), its log-sum-exp is the rows' log-sum-exp, and bad arguments are refused without a GPU."""
from __future__ import annotations

import numpy as np
import pytest

import cupy_rope as cr
from cupy_rope import reference as R
from tests.helpers import rel_err


def _qkv(rng, cu, nh=2, d=4):
    t = int(cu[-1])
    return [rng.standard_normal((t, nh, d)) for _ in range(4)]


@pytest.mark.parametrize("cu", [[0, 5], [0, 3, 3, 8], [0, 1, 2, 7]])
def test_forward_is_softmax_attention_per_sequence(cu, np_rng):
    q, k, v, _ = _qkv(np_rng, cu)
    o, lse = R.varlen_attention_forward(q, k, v, np.asarray(cu), scaling=0.7)
    for a, b in zip(cu[:-1], cu[1:]):
        if a == b:
            continue
        for h in range(q.shape[1]):
            s = 0.7 * q[a:b, h] @ k[a:b, h].T
            p = np.exp(s - s.max(1, keepdims=True))
            p /= p.sum(1, keepdims=True)
            assert np.allclose(o[a:b, h], p @ v[a:b, h], rtol=1e-12, atol=1e-12)
            assert np.allclose(lse[h, a:b], np.log(np.exp(s).sum(1)), rtol=1e-12, atol=1e-12)


def test_backward_is_the_gradient(np_rng):
    cu = np.asarray([0, 3, 3, 7])
    q, k, v, g = _qkv(np_rng, cu)
    grads = R.varlen_attention_backward(g, q, k, v, cu, scaling=0.6)

    def loss():
        return float(np.sum(g * R.varlen_attention_forward(q, k, v, cu, scaling=0.6)[0]))

    for x, dx in zip((q, k, v), grads):
        fd = np.empty_like(x)
        for i in np.ndindex(x.shape):
            orig = x[i]
            x[i] = orig + 1e-6
            up = loss()
            x[i] = orig - 1e-6
            dn = loss()
            x[i] = orig
            fd[i] = (up - dn) / 2e-6
        assert np.linalg.norm(fd) > 1e-2
        assert rel_err(dx, fd) < 1e-6


def test_no_attention_across_sequences(np_rng):
    cu = np.asarray([0, 4, 9])
    q, k, v, g = _qkv(np_rng, cu)
    o, _ = R.varlen_attention_forward(q, k, v, cu)
    v2 = v.copy()
    v2[4:] += 10.0  # the second sequence's values must not move the first's outputs
    o2, _ = R.varlen_attention_forward(q, k, v2, cu)
    assert np.array_equal(o[:4], o2[:4]) and not np.allclose(o[4:], o2[4:])


def test_numpy_inputs_refused():
    x = np.zeros((4, 2, 64), np.float32)
    with pytest.raises(TypeError, match=r"q must be a cupy.ndarray.*cupy\.asarray\(q\)"):
        cr.varlen_attention_forward(x, x, x, np.asarray([0, 4]))
    with pytest.raises(TypeError, match="q must be a cupy.ndarray"):
        cr.varlen_attention_backward(x, x, x, x, x, np.zeros((2, 4), np.float32), np.asarray([0, 4]))
    with pytest.raises(ValueError, match="precision"):
        cr.varlen_attention_forward(x, x, x, np.asarray([0, 4]), precision="fp16")
