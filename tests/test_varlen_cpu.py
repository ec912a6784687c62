"""Varlen attention alone on the CPU: the float64 reference is the derivative of its forward (central
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


@pytest.mark.parametrize("d", [4, 16])
def test_default_scaling_is_the_inverse_square_root_of_the_head_dim(d, np_rng):
    cu = np.asarray([0, 3, 7])
    q, k, v, g = _qkv(np_rng, cu, d=d)
    o, lse = R.varlen_attention_forward(q, k, v, cu)
    s = d ** -0.5 * q[3:, 1] @ k[3:, 1].T  # the second sequence, second head
    assert np.allclose(lse[1, 3:], np.log(np.exp(s).sum(1)), rtol=1e-12, atol=1e-12)
    given = R.varlen_attention_forward(q, k, v, cu, scaling=d ** -0.5)
    assert np.array_equal(o, given[0]) and np.array_equal(lse, given[1])
    grads = R.varlen_attention_backward(g, q, k, v, cu)
    assert all(np.array_equal(a, b) for a, b in zip(grads, R.varlen_attention_backward(g, q, k, v, cu,
                                                                                         scaling=d ** -0.5)))


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


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("nh", [1, 3, 28])
def test_dense_rows_are_a_permutation_in_run_batches(seed, nh):
    """Varlen.dense_rows: every (token, head) gets its own row of [0, NH T); within a run of equal lengths, the
    rows of a (sequence, head) are L consecutive rows starting at run base + ((seq - first seq) NH + head) L, so
    every run is one strided batch; runs cover the non-empty sequences in order, empty ones not breaking them."""
    from cupy_rope.attention.varlen import Varlen

    rng = np.random.default_rng(seed)
    lens = rng.choice([0, 1, 7, 7, 7, 256], size=int(rng.integers(1, 12))).tolist()
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    t = int(cu[-1])
    vl = Varlen(cu, t)
    rows = vl.dense_rows(nh)
    assert rows.shape == (t, 2) and rows.dtype == np.int32
    every = (rows[:, :1] + np.arange(nh)[None, :] * rows[:, 1:]).ravel()
    assert np.array_equal(np.sort(every), np.arange(nh * t)), "rows are not a permutation of NH T"
    nonempty = [n for n in lens if n]
    assert sum(r[1] for r in vl.runs) == len(nonempty)
    assert [r[2] for r in vl.runs for _ in range(r[1])] == nonempty
    for t0, n, length in vl.runs:
        for s in range(n):
            for h in range(nh):
                first = t0 + s * length
                got = rows[first:first + length, 0] + h * rows[first:first + length, 1]
                want = nh * t0 + (s * nh + h) * length + np.arange(length)
                assert np.array_equal(got, want), (t0, s, h)
    for a, b in zip(vl.runs, vl.runs[1:]):
        assert a[0] + a[1] * a[2] == b[0] and a[2] != b[2], "runs not maximal or not consecutive"


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("nh,d", [(1, 64), (3, 80), (28, 128)])
def test_dense_pointer_offsets_address_each_entry(seed, nh, d):
    """Varlen.dense_pointer_offsets: for batch entry e = (run, sequence s of it, head h), in the runs' order, the
    byte offset of V's first row (token t0 + s L of qkv [T, 3H], from its column 2H, which the base adds), of dO's
    ([T, H]), of the scores (the runs' n NH L^2 floats, consecutive), and of the dense O and dV rows (the dense
    row map's row of that first token, D floats a row): checked against the row map and the token layout."""
    from cupy_rope.attention.varlen import Varlen

    rng = np.random.default_rng(seed)
    lens = rng.choice([0, 1, 5, 5, 9, 256], size=int(rng.integers(1, 10))).tolist()
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    vl = Varlen(cu, int(cu[-1]))
    h = nh * d
    off = vl.dense_pointer_offsets(nh, d)
    entries = sum(n for _, n, _ in vl.runs) * nh
    assert off.dtype == np.int64 and off.shape == (6 * entries,)
    kinds = off.reshape(6, entries)
    rows = vl.dense_rows(nh)
    e, scores = 0, 0
    for t0, n, length in vl.runs:
        for s in range(n):
            first = t0 + s * length
            for hh in range(nh):
                assert kinds[0, e] == (first * 3 * h + hh * d) * 4
                assert kinds[1, e] == (first * h + hh * d) * 4
                assert kinds[2, e] == kinds[3, e] == (scores + (s * nh + hh) * length * length) * 4
                assert kinds[4, e] == kinds[5, e] == (rows[first, 0] + hh * rows[first, 1]) * d * 4
                e += 1
        scores += n * nh * length * length
    assert e == entries
    assert vl.dense_pointer_offsets(nh, d) is off  # kept
    # O^T [H, o_ld] instead of the dense O rows: entry (s, h) at row h D, column its first token; the rest as above
    o_ld = (vl.tokens + 1 + 31) // 32 * 32
    off_t = vl.dense_pointer_offsets(nh, d, o_ld)
    assert off_t is not off and off_t.shape == off.shape
    kinds_t = off_t.reshape(6, entries)
    assert np.array_equal(np.delete(kinds_t, 4, axis=0), np.delete(kinds, 4, axis=0))
    e = 0
    for t0, n, length in vl.runs:
        for s in range(n):
            for hh in range(nh):
                assert kinds_t[4, e] == (hh * d * o_ld + t0 + s * length) * 4
                e += 1


@pytest.mark.parametrize("lens,want", [([131], True), ([256, 256, 0, 4], True), ([0, 8, 0, 12, 5], True),
                                       ([105, 106], False), ([4, 4, 2, 7], False), ([0], True)])
def test_starts_aligned(lens, want):
    """Varlen.starts_aligned(4): every non-empty sequence starts at a multiple of 4 tokens (empty ones and the
    last sequence's length do not matter); kept per alignment, so a second ask and another alignment agree."""
    from cupy_rope.attention.varlen import Varlen

    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    vl = Varlen(cu, int(cu[-1]))
    assert vl.starts_aligned(4) is want
    assert vl.starts_aligned(1) is True and vl.starts_aligned(4) is want


@pytest.mark.parametrize("cu, want", [
    ([0, 5], True),  # one sequence: it ends at the last token
    ([0, 64, 64, 192, 200], True),  # whole steps, an empty sequence, the last ends at T
    ([0, 64, 100, 164], False),  # the second sequence ends mid-step before T
    ([0, 4, 68], False),  # the first is no whole step (and the second starts off the step grid)
    ([0, 0, 0], True),  # no tokens
])
def test_whole_steps(cu, want):
    """The fact behind the tf32 backward's unzeroed dQ accumulator (hopper.first_tile_stores): every non-empty
    sequence holds whole 64-token steps, or ends at the last token (so each starts on the step grid)."""
    import dataclasses

    from cupy_rope.attention import hopper
    from cupy_rope.attention.plan import make_plan
    from cupy_rope.attention.varlen import Varlen

    vl = Varlen(np.asarray(cu, np.int32), cu[-1])
    assert vl.whole_steps(64) == want
    plan = dataclasses.replace(make_plan("tf32", head_dim=128, tokens=max(cu[-1], 1), max_tiles=max(vl.max_tiles, 1),
                                         sm90=True), hopper=True, specialised=True, stages=2,
                               tf32_first_stores=True)
    assert hopper.first_tile_stores(vl, plan) == want
    for off in (dict(stages=1), dict(specialised=False), dict(tf32_first_stores=False), dict(hopper=False)):
        assert not hopper.first_tile_stores(vl, dataclasses.replace(plan, **off))
