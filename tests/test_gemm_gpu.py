"""The GEMM layer (cupy_rope._cublas) on the GPU: every candidate the first call times (cuBLAS's kernels, and the
split into whole 128-row tiles plus the remaining rows) computes the product, overwriting or adding to its output
(relative Frobenius error vs float64 within the mode's bound); the timed choice is kept and gives bit-identical
results afterwards, and set_gemm_autotune(False) keeps cublasGemmEx's choice."""
from __future__ import annotations

import numpy as np
import pytest

from cupy_rope import _checks as C
from cupy_rope import _cublas

gpu = pytest.mark.gpu
# Bounds for a product of standard-normal operands with K up to a few thousand.
TOL = {"fp32": 1e-6, "tf32": 2e-3, "bf16": 1e-5}  # bf16: the reference uses the same rounded operands
# (m, n, k, trans_a, trans_b): the layouts the attention backward uses, at skinny and square sizes.
SHAPES = [(131, 1536, 512, False, True), (96, 512, 768, False, False), (512, 512, 131, True, False),
          (384, 1024, 384, False, True), (300, 640, 256, True, False)]


def _operands(cupy, rng, m, n, k, trans_a, trans_b, precision):
    a = rng.standard_normal((k, m) if trans_a else (m, k), dtype=np.float32)
    b = rng.standard_normal((n, k) if trans_b else (k, n), dtype=np.float32)
    if precision == "bf16":  # the reference multiplies the same rounded values
        a, b = a.astype(C.BF16), b.astype(C.BF16)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    ref = (a64.T if trans_a else a64) @ (b64.T if trans_b else b64)
    return a, b, ref


def _rel(cupy, c, ref) -> float:
    return float(cupy.linalg.norm(c.astype(np.float64) - ref) / cupy.linalg.norm(ref))


@gpu
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{m}x{n}x{k}{'T' * ta}{'T' * tb}" for m, n, k, ta, tb in SHAPES])
def test_every_candidate_and_the_choice(shape, precision, rng):
    import cupy

    m, n, k, trans_a, trans_b = shape
    a, b, ref = _operands(cupy, rng, m, n, k, trans_a, trans_b, precision)
    s = cupy.cuda.get_current_stream().ptr
    _cublas.set_gemm_autotune(True)
    c = cupy.full((m, n), np.nan, dtype=np.float32)
    _cublas.gemm(a, b, c, trans_a=trans_a, trans_b=trans_b, precision=precision, stream=s)
    assert _rel(cupy, c, ref) <= TOL[precision]
    if not _cublas.capturable() or _cublas._lt_library() is None:
        pytest.skip("cuBLAS is reached through CuPy's bindings here: no candidate kernels to check")
    plan = _cublas.plan_for(a, b, c, trans_a=trans_a, trans_b=trans_b, precision=precision)
    assert plan.chosen is not None and plan.chosen in plan.times_us, "the first call did not time the candidates"
    assert -1 in plan.times_us and len(plan.times_us) >= 2
    assert (_cublas.SPLIT in plan.times_us) == (m > 128 and m % 128 != 0)
    base = rng.standard_normal((m, n), dtype=np.float32)
    for i in plan.candidates():
        c = cupy.full((m, n), np.nan, dtype=np.float32)
        plan.run(i, a, b, c, s, False)
        assert _rel(cupy, c, ref) <= TOL[precision], f"candidate {i}"
        c = base.copy()  # the same candidate adding to its output
        plan.run(i, a, b, c, s, True)
        assert _rel(cupy, c, ref + base.astype(np.float64)) <= TOL[precision], f"candidate {i}, accumulating"
    outs = []
    for _ in range(2):  # later calls use the kept choice: bit-identical
        c = cupy.full((m, n), np.nan, dtype=np.float32)
        _cublas.gemm(a, b, c, trans_a=trans_a, trans_b=trans_b, precision=precision, stream=s)
        outs.append(c)
    assert bool(cupy.array_equal(outs[0], outs[1]))
    c = cupy.full((m, n), np.nan, dtype=np.float32)
    plan.run(plan.chosen, a, b, c, s, False)
    assert bool(cupy.array_equal(outs[0], c))


@gpu
def test_autotune_off_uses_gemmex_and_accumulate(rng):
    import cupy

    m, n, k = 200, 640, 320
    a, b, ref = _operands(cupy, rng, m, n, k, False, True, "fp32")
    s = cupy.cuda.get_current_stream().ptr
    try:
        _cublas.set_gemm_autotune(False)
        c = cupy.full((m, n), np.nan, dtype=np.float32)
        _cublas.gemm(a, b, c, trans_a=False, trans_b=True, precision="fp32", stream=s)
        assert _rel(cupy, c, ref) <= TOL["fp32"]
        if _cublas.capturable() and _cublas._lt_library() is not None:
            plan = _cublas.plan_for(a, b, c, trans_a=False, trans_b=True, precision="fp32")
            assert plan.chosen is None  # nothing timed: cublasGemmEx ran
    finally:
        _cublas.set_gemm_autotune(True)
    base = rng.standard_normal((m, n), dtype=np.float32)
    c = base.copy()
    _cublas.gemm(a, b, c, trans_a=False, trans_b=True, precision="fp32", stream=s, accumulate=True)
    assert _rel(cupy, c, ref + base.astype(np.float64)) <= TOL["fp32"]


@gpu
@pytest.mark.parametrize("precision", ["fp32", "tf32"])
@pytest.mark.parametrize("trans_a", [True, False])
def test_row_padded_operands(trans_a, precision, rng):
    """Operands given as the first columns of wider arrays (a transposed copy whose rows are padded, as the
    attention backward passes them): the product of the used columns only, whatever the padding holds."""
    import cupy

    m, n, k = 261, 384, 200
    a, b, ref = _operands(cupy, rng, m, n, k, trans_a, False, precision)
    pad = 27
    wide = cupy.full((a.shape[0], a.shape[1] + pad), np.nan, dtype=np.float32)
    wide[:, :a.shape[1]] = a
    view = wide[:, :a.shape[1]]
    assert not view.flags.c_contiguous
    s = cupy.cuda.get_current_stream().ptr
    c = cupy.full((m, n), np.nan, dtype=np.float32)
    _cublas.gemm(view, b, c, trans_a=trans_a, trans_b=False, precision=precision, stream=s)
    assert _rel(cupy, c, ref) <= TOL[precision]
    with pytest.raises(ValueError, match="contiguous rows"):
        _cublas.gemm(cupy.asfortranarray(a), b, c, trans_a=trans_a, trans_b=False, precision=precision, stream=s)
