"""varlen_attention_forward / varlen_attention_backward on the GPU against the float64 reference (README bounds):
every output within the precision's bound, bit-identical repeats, host and device cu_seqlens, empty and
one-token sequences, no tokens, and bad arguments refused before any launch."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import cupy_rope as cr
from cupy_rope import reference as R
from cupy_rope.precision import Precision
from tests.helpers import PRECISION_TOLS, TOL, assert_no_launch, poisoned_allocations, rel_err, same_bits

pytestmark = pytest.mark.gpu

CUS = {"mixed": [0, 1, 130, 130, 385, 400], "one": [0, 300], "tiny": [0, 1, 2, 3, 5, 8, 13]}


def inputs(rng, cu, nh, d, dtype=np.float32):
    import cupy

    t = cu[-1]
    x = [rng.standard_normal((t, nh, d), dtype=np.float32) for _ in range(4)]
    if dtype != np.float32:
        x = [a.astype(dtype) for a in x]
    cupy.cuda.runtime.deviceSynchronize()
    return x


@pytest.mark.parametrize("precision,tol", PRECISION_TOLS)
@pytest.mark.parametrize("kind,nh,d", [("mixed", 4, 64), ("one", 2, 128), ("tiny", 3, 80), ("mixed", 2, 96)])
def test_forward_and_backward(kind, nh, d, precision, tol, rng):
    import cupy

    cu = np.asarray(CUS[kind], np.int32)
    q, k, v, g = inputs(rng, cu, nh, d)
    scaling = 0.9 * d ** -0.5
    with poisoned_allocations():
        o, lse = cr.varlen_attention_forward(q, k, v, cu, scaling=scaling, precision=precision)
    ro, rlse = R.varlen_attention_forward(q, k, v, cu, scaling=scaling)
    assert o.shape == q.shape and lse.shape == (nh, cu[-1]) and lse.dtype == np.float32
    assert rel_err(o.get().astype(np.float32), ro) <= tol, precision  # o is bf16 in bf16 mode
    assert rel_err(lse, rlse) <= tol
    with poisoned_allocations():
        grads = cr.varlen_attention_backward(g, q, k, v, o, lse, cu, scaling=scaling, precision=precision)
    ref = R.varlen_attention_backward(g, q, k, v, cu, scaling=scaling)
    for name, a, b in zip(("dq", "dk", "dv"), grads, ref):
        assert a.shape == q.shape and a.dtype == np.float32
        err = rel_err(a, b)
        assert err <= tol, f"{name} [{precision}] {err:.2e}"
    again = cr.varlen_attention_backward(g, q, k, v, o, lse, cupy.asarray(cu), scaling=scaling, precision=precision)
    assert all(same_bits(a, b) for a, b in zip(grads, again)), "two runs (host and device cu_seqlens) differ"
    o2, lse2 = cr.varlen_attention_forward(q, k, v, cupy.asarray(cu), scaling=scaling, precision=precision)
    assert same_bits(o, o2) and same_bits(lse, lse2)



@pytest.mark.parametrize("precision,tol", [pt for pt in PRECISION_TOLS if pt.values[0] != "bf16"])
@pytest.mark.parametrize("lens,nh,d", [([256] * 3, 2, 128), ([0, 105, 105, 104, 0], 3, 80), ([1, 1, 7], 2, 64),
                                       ([33] * 4 + [2], 2, 96)])
def test_dense_form(lens, nh, d, precision, tol, rng):
    """The dense form (forced: batched products over stored scores) into a NaN-filled ``out``, every allocation
    poisoned with NaN: o, lse and the gradients within the bound, the same bits twice."""
    import cupy

    with poisoned_allocations():
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        q, k, v, g = inputs(rng, cu, nh, d)
        dense = lambda p: dataclasses.replace(p, hopper=False, dense=True)  # noqa: E731
        out = cupy.full(q.shape, np.nan, np.float32)
        o, lse = cr.varlen_attention_forward(q, k, v, cu, precision=precision, out=out, plan=dense)
        assert o is out
        ro, rlse = R.varlen_attention_forward(q, k, v, cu)
        assert rel_err(o, ro) <= tol and rel_err(lse, rlse) <= tol, precision
        grads = cr.varlen_attention_backward(g, q, k, v, o, lse, cu, precision=precision, plan=dense)
        for name, a, b in zip(("dq", "dk", "dv"), grads, R.varlen_attention_backward(g, q, k, v, cu)):
            err = rel_err(a, b)
            assert err <= tol, f"{name} [{precision}] {err:.2e}"
        again = cr.varlen_attention_backward(g, q, k, v, o, lse, cu, precision=precision, plan=dense)
        assert all(same_bits(a, b) for a, b in zip(grads, again)), "two runs differ"
        o2, lse2 = cr.varlen_attention_forward(q, k, v, cu, precision=precision, plan=dense)
        assert same_bits(o, o2) and same_bits(lse, lse2)


@pytest.mark.parametrize("lens,dense", [([131], True), ([256, 256], True), ([105, 106], False), ([256] * 4, False)])
def test_fp32_forward_form_follows_the_rule(lens, dense, rng):
    """fp32: the library's forward runs the dense form on one short run and the flash kernel elsewhere
    (plan.dense_forward), into allocations poisoned with NaN: its bits are those of the form forced, within the
    bound, while the backward keeps the dense form on all four."""
    from cupy_rope.attention import flash
    from cupy_rope.attention.varlen import Varlen

    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    vl = Varlen(cu, int(cu[-1]))
    assert flash._choose_plan(Precision.FP32, 64, vl, None).dense
    q, k, v, _ = inputs(rng, cu, 3, 64)
    with poisoned_allocations():
        o, lse = cr.varlen_attention_forward(q, k, v, cu, precision="fp32")
    form = lambda p: dataclasses.replace(p, dense=dense, dense_in_place=False)  # noqa: E731
    other = lambda p: dataclasses.replace(p, dense=not dense, dense_in_place=False)  # noqa: E731
    o1, lse1 = cr.varlen_attention_forward(q, k, v, cu, precision="fp32", plan=form)
    o2, _ = cr.varlen_attention_forward(q, k, v, cu, precision="fp32", plan=other)
    assert same_bits(o, o1) and same_bits(lse, lse1)
    assert not same_bits(o, o2)  # the two forms differ in their last bits: the test tells them apart
    ro, rlse = R.varlen_attention_forward(q, k, v, cu)
    assert rel_err(o, ro) <= TOL["fp32"] and rel_err(lse, rlse) <= TOL["fp32"]


def test_dense_form_more_batch_entries_than_a_grid_dimension(rng):
    """33,000 two-token sequences of 2 heads: one run of 66,000 batch entries, past cuBLAS's 65,535 per call, so
    each product runs in two calls; every output within the fp32 bound. (One-token sequences would give dq = dk
    = 0 exactly, whose relative error is undefined.)"""
    from cupy_rope.attention import flash
    from cupy_rope.attention.varlen import Varlen

    with poisoned_allocations():
        cu = np.arange(0, 66001, 2, dtype=np.int32)
        vl = Varlen(cu, 66000)
        assert len(vl.runs) == 1 and flash._choose_plan(Precision.FP32, 64, vl, None).dense
        q, k, v, g = inputs(rng, cu, 2, 64)
        ro, rlse = R.varlen_attention_forward(q, k, v, cu)
        dense = lambda p: dataclasses.replace(p, dense=True)  # noqa: E731  (the library's forward is the flash one)
        for plan in (dense, None):
            o, lse = cr.varlen_attention_forward(q, k, v, cu, precision="fp32", plan=plan)
            assert rel_err(o, ro) <= TOL["fp32"] and rel_err(lse, rlse) <= TOL["fp32"]
        grads = cr.varlen_attention_backward(g, q, k, v, o, lse, cu, precision="fp32")
        for name, a, b in zip(("dq", "dk", "dv"), grads, R.varlen_attention_backward(g, q, k, v, cu)):
            assert rel_err(a, b) <= TOL["fp32"], name

def test_bf16_inputs_and_out(rng):
    import cupy
    import ml_dtypes

    cu = np.asarray(CUS["mixed"], np.int32)
    q, k, v, g = inputs(rng, cu, 2, 64)
    qb, kb, vb, gb = (a.astype(ml_dtypes.bfloat16) for a in (q, k, v, g))
    out = cupy.full(q.shape, 0x7FC0, cupy.uint16).view(ml_dtypes.bfloat16)  # NaN in every element
    o, lse = cr.varlen_attention_forward(qb, kb, vb, cu, precision="bf16", out=out)
    assert o is out
    f32 = [cupy.asarray(a.get().astype(np.float32)) for a in (qb, kb, vb, gb)]
    ro, _ = R.varlen_attention_forward(*f32[:3], cu)
    assert rel_err(cupy.asarray(o.get().astype(np.float32)), ro) <= 2e-2
    grads = cr.varlen_attention_backward(gb, qb, kb, vb, o, lse, cu, precision="bf16")
    ref = R.varlen_attention_backward(f32[3], *f32[:3], cu)
    for a, b in zip(grads, ref):
        assert rel_err(a, b) <= 2e-2
    # fp32 inputs count as their bf16 roundings, delta included: the same bits as those roundings passed in
    g32 = g * 1.001  # not bf16 values
    from_f32 = cr.varlen_attention_backward(g32, q, k, v, o, lse, cu, precision="bf16")
    b16 = [a.astype(ml_dtypes.bfloat16) for a in (g32, q, k, v)]
    from_b16 = cr.varlen_attention_backward(*b16, o, lse, cu, precision="bf16")
    assert all(same_bits(a, b) for a, b in zip(from_f32, from_b16)), "fp32 inputs are not read as their bf16 roundings"


@pytest.mark.parametrize("precision,tol", PRECISION_TOLS)
def test_mma_backward_reads_o_and_lse_as_given(precision, tol, rng):
    """The backward on the mma.sync kernels (fp32 always; tf32 and bf16 forced off Hopper) reads the forward's o
    and lse: lse + ln 2 halves every probability and so every gradient, and dq is linear in o through delta
    (dq(2o) + 2 dq(o / 2) = 3 dq(o)), which a backward that recomputed o and lse would not show."""
    plan = lambda p: dataclasses.replace(p, hopper=False, dense=False, dense_in_place=False)  # noqa: E731
    cu = np.asarray(CUS["mixed"], np.int32)
    q, k, v, g = inputs(rng, cu, 2, 64)
    o, lse = cr.varlen_attention_forward(q, k, v, cu, precision=precision, plan=plan)
    back = lambda o_, lse_: cr.varlen_attention_backward(g, q, k, v, o_, lse_, cu, precision=precision,  # noqa
                                                         plan=plan)
    grads = back(o, lse)
    for name, a, b in zip(("dq", "dk", "dv"), grads, R.varlen_attention_backward(g, q, k, v, cu)):
        assert rel_err(a, b) <= tol, name
    for name, a, b in zip(("dq", "dk", "dv"), back(o, lse + np.float32(np.log(2.0))), grads):
        assert rel_err(a, 0.5 * b) <= tol, f"{name}: lse + ln 2 did not halve it"
    scaled = lambda c: (o.astype(np.float32) * c).astype(o.dtype)  # noqa: E731  (exact: powers of two)
    dq2, dq_half = back(scaled(2.0), lse)[0], back(scaled(0.5), lse)[0]
    assert rel_err(dq2 + 2 * dq_half, 3 * grads[0]) <= tol
    assert rel_err(dq2, grads[0]) > 10 * tol, "dq does not depend on o"


def test_no_tokens(rng):
    import cupy

    z = cupy.empty((0, 2, 64), np.float32)
    o, lse = cr.varlen_attention_forward(z, z, z, np.asarray([0, 0], np.int32))
    assert o.shape == (0, 2, 64) and lse.shape == (2, 0)
    grads = cr.varlen_attention_backward(z, z, z, z, z, lse, np.asarray([0], np.int32))
    assert all(a.shape == (0, 2, 64) for a in grads)


def test_bad_arguments_refused_before_launch(rng):
    import cupy

    cu = np.asarray([0, 5, 9], np.int32)
    q, k, v, g = inputs(rng, cu, 2, 64)
    o, lse = cr.varlen_attention_forward(q, k, v, cu)
    cases = [
        (lambda: cr.varlen_attention_forward(q, k[:, :1], v, cu), ValueError, "k must have shape"),
        (lambda: cr.varlen_attention_forward(q[:, :, :48], k[:, :, :48], v[:, :, :48], cu), ValueError, "head_dim"),
        (lambda: cr.varlen_attention_forward(q, k, v, np.asarray([0, 5, 8], np.int32)), ValueError, "must end"),
        (lambda: cr.varlen_attention_forward(q, k, v, cu, max_seqlen=3), ValueError, "max_seqlen"),
        (lambda: cr.varlen_attention_forward(q.astype(np.float64), k, v, cu), TypeError, "float32"),
        (lambda: cr.varlen_attention_forward(q, k, v, cu, out=q), ValueError, "overlaps"),
        (lambda: cr.varlen_attention_backward(g, q, k, v, o, lse[:1], cu), ValueError, "lse must have shape"),
        (lambda: cr.varlen_attention_backward(g[:4], q, k, v, o, lse, cu), ValueError, "grad_o must have shape"),
        (lambda: cr.varlen_attention_backward(g, q, k, v, o, lse, cu, precision="TF32"), ValueError, "precision"),
        (lambda: cr.varlen_attention_forward(cupy.asfortranarray(q), k, v, cu), ValueError, "C-contiguous"),
        (lambda: cr.varlen_attention_forward(q[:, :0], k[:, :0], v[:, :0], cu), ValueError, "at least one head"),
        (lambda: cr.varlen_attention_forward(q, k, v, cu, scaling=float("inf")), ValueError, "scaling must be finite"),
        (lambda: cr.varlen_attention_backward(g, q, k, v, o, lse, cu, scaling=True), TypeError, "scaling must be a"),
        # a caller's plan is checked with no tokens too
        (lambda: cr.varlen_attention_forward(q[:0], k[:0], v[:0], np.asarray([0]), plan="x"), TypeError, "plan must"),
        (lambda: cr.varlen_attention_backward(g[:0], q[:0], k[:0], v[:0], o[:0], lse[:, :0], np.asarray([0]),
                                              plan=42), TypeError, "plan must"),
    ]
    for call, exc, match in cases:
        with assert_no_launch(), pytest.raises(exc, match=match):
            call()


@pytest.mark.parametrize("precision,tol", [pt for pt in PRECISION_TOLS if pt.values[0] != "fp32"])
def test_more_key_units_than_the_sm90_grid_holds(precision, tol, rng):
    """Many short sequences: past what the sm_90a backward's grid holds (its key units on the grid's second
    dimension, at most 65535 blocks) the backward runs on the mma.sync kernels, the forward alone still on the
    sm_90a kernels (its query tiles on the first); every output within its bound, the same bits twice. The
    reference: float64 on the three long sequences, and for a one-token sequence o = v, lse = its score, dq = dk
    = 0, dv = grad_o."""
    from cupy_rope.attention import flash, hopper, plan as P

    most = (P.GRID_Y_MAX - P.SPLIT_ROWS_BOUND) // (2 if precision == "tf32" else 1)
    long = [200, 3, 130]
    lens = [1] * (most - 3) + long  # most + 2 tiles of 128 tokens
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    q, k, v, g = inputs(rng, cu, 1, 64)
    vl = flash._varlen.resolve(cu, int(cu[-1]))
    assert vl.ntiles == most + 2
    p = Precision.parse(precision)
    assert not flash._choose_plan(p, 64, vl, None).hopper
    assert flash._choose_plan(p, 64, vl, None, forward=True).hopper == hopper.supported()
    n1 = most - 3  # one-token sequences, then the long ones
    tail = np.concatenate([[0], np.cumsum(long)]).astype(np.int32)
    qh, kh, vh, gh = (x.get().astype(np.float64) for x in (q, k, v, g))
    scaling = 64 ** -0.5
    ro, rlse = vh.copy(), np.empty((1, cu[-1]))
    rlse[0, :n1] = scaling * np.sum(qh[:n1, 0] * kh[:n1, 0], axis=-1)
    to, tlse = R.varlen_attention_forward(qh[n1:], kh[n1:], vh[n1:], tail)
    ro[n1:], rlse[:, n1:] = to, tlse
    rdq, rdk, rdv = np.zeros_like(qh), np.zeros_like(qh), gh.copy()
    for a, b in zip((rdq, rdk, rdv), R.varlen_attention_backward(gh[n1:], qh[n1:], kh[n1:], vh[n1:], tail)):
        a[n1:] = b
    o, lse = cr.varlen_attention_forward(q, k, v, cu, precision=precision)
    assert rel_err(o.get().astype(np.float32), ro) <= tol and rel_err(lse, rlse) <= tol
    grads = cr.varlen_attention_backward(g, q, k, v, o, lse, cu, precision=precision)
    for name, a, b in zip(("dq", "dk", "dv"), grads, (rdq, rdk, rdv)):
        assert rel_err(a, b) <= tol, f"{name} [{precision}]"
    again = cr.varlen_attention_backward(g, q, k, v, o, lse, cu, precision=precision)
    assert all(same_bits(a, b) for a, b in zip(grads, again))


def test_tf32_many_tiny_sequences_backward_off_the_sm90_kernels(rng):
    """Sequences of under 32 tokens on average: tf32's sm_90a backward would lay K^T out by tile (14 times K here),
    so the library's backward takes the mma.sync kernels, the forward alone still the sm_90a kernels; outputs made
    in NaN-poisoned memory, every one within its bound against float64, the backward the same bits twice. On
    Hopper the sm_90a backward, forced, still meets the bound there."""
    from cupy_rope.attention import flash, hopper, plan as P

    lens = [1, 3, 0, 17, 2, 31, 1, 5] * 40 + [130]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    q, k, v, g = inputs(rng, cu, 2, 64)
    vl = flash._varlen.resolve(cu, int(cu[-1]))
    assert P.TILE * vl.ntiles > 10 * vl.tokens
    assert not flash._choose_plan(Precision.TF32, 64, vl, None).hopper
    assert flash._choose_plan(Precision.TF32, 64, vl, None, forward=True).hopper == hopper.supported()
    tol = TOL["tf32"]
    with poisoned_allocations():
        o, lse = cr.varlen_attention_forward(q, k, v, cu, precision="tf32")
        grads = cr.varlen_attention_backward(g, q, k, v, o, lse, cu, precision="tf32")
    ro, rlse = R.varlen_attention_forward(q, k, v, cu)
    assert rel_err(o, ro) <= tol and rel_err(lse, rlse) <= tol
    ref = R.varlen_attention_backward(g, q, k, v, cu)
    for name, a, b in zip(("dq", "dk", "dv"), grads, ref):
        assert rel_err(a, b) <= tol, name
    again = cr.varlen_attention_backward(g, q, k, v, o, lse, cu, precision="tf32")
    assert all(same_bits(a, b) for a, b in zip(grads, again))
    if hopper.supported():
        with poisoned_allocations():
            forced = cr.varlen_attention_backward(g, q, k, v, o, lse, cu, precision="tf32",
                                                  plan=lambda p: dataclasses.replace(p, hopper=True))
        for name, a, b in zip(("dq", "dk", "dv"), forced, ref):
            assert rel_err(a, b) <= tol, f"{name}: the forced sm_90a backward"
