"""rope_2d_backward / rope_2d_forward on the GPU against the float64 reference (SPEC sections 1 and 3).

Every case: fresh random grads (standard normal, stored as bf16 / fp16 / fp32), the output buffer poisoned with
NaN before the call, relative Frobenius error vs float64 <= 2e-6, and a second run bit-identical to the first.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import cupy_rope as cr
from cupy_rope import reference as R
from cupy_rope import workloads as W

pytestmark = pytest.mark.gpu

BF16 = np.dtype(ml_dtypes.bfloat16)
GRAD_DTYPES = [pytest.param(BF16, id="bf16"), pytest.param(np.dtype(np.float16), id="f16"),
               pytest.param(np.dtype(np.float32), id="f32")]
TOL = 2e-6
BIG = 1e5  # |theta| up to 1e5 (SPEC section 1)


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64 on the device; any NaN/inf in out gives inf."""
    import cupy

    o = out.astype(cupy.float64).ravel()
    ref = ref.ravel()
    if not bool(cupy.isfinite(o).all()):
        return math.inf
    return float(cupy.linalg.norm(o - ref) / cupy.linalg.norm(ref))


def same_bits(a, b) -> bool:
    """Bit-for-bit equality (NaN payloads included), for any of the float dtypes used here."""
    import cupy

    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    u = {2: cupy.uint16, 4: cupy.uint32, 8: cupy.uint64}[a.itemsize]
    return bool(cupy.array_equal(a.view(u), b.view(u)))


def grads(rng, shape, dtype):
    import cupy

    if math.prod(shape) == 0:
        return cupy.empty(shape, dtype), cupy.empty(shape, dtype)
    return (rng.standard_normal(shape, dtype=np.float32).astype(dtype),
            rng.standard_normal(shape, dtype=np.float32).astype(dtype))


def angles(rng, shape, scale=BIG):
    return rng.uniform(-scale, scale, size=shape).astype(np.float32)


def nan_like(shape):
    import cupy

    return cupy.full(shape, np.nan, dtype=np.float32)


def check_backward(gc, gs, th, tol=TOL):
    """Poisoned out, error vs float64, determinism. Returns the output."""
    import cupy

    out = nan_like(th.shape)
    ret = cr.rope_2d_backward(gc, gs, th, out=out)
    assert ret is out
    ref = R.rope_2d_backward(gc, gs, th)
    assert isinstance(ref, cupy.ndarray) and ref.dtype == np.float64
    err = rel_err(out, ref)
    assert err <= tol, f"relative error {err:.3e} > {tol:.0e} (shape {th.shape}, {gc.dtype})"
    again = cr.rope_2d_backward(gc, gs, th)
    assert again.dtype == np.float32 and again.shape == th.shape and again.flags.c_contiguous
    assert same_bits(again, out), "two runs differ"
    return out


@pytest.fixture
def no_launch(monkeypatch):
    """Any kernel launch fails the test: errors must come from validation, before anything runs."""
    from cupy_rope import _kernels

    def boom(self, *a, **k):
        raise AssertionError(f"kernel {self.name} was launched although the input is invalid")

    monkeypatch.setattr(_kernels.Launcher, "__call__", boom)


# ---- the 16 benchmark shapes -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", GRAD_DTYPES)
@pytest.mark.parametrize("theta", ["rope", "uniform"])
@pytest.mark.parametrize("case", range(len(W.ROPE_CASES)), ids=[f"{b}x{s}" for b, s in W.ROPE_CASES])
def test_seed_shapes(case, theta, dtype, rng):
    import cupy

    b, s = W.ROPE_CASES[case]
    shape = (b, s, W.ROPE_HEAD_DIM)
    gc, gs = grads(rng, shape, dtype)
    th = cupy.asarray(W.rope_theta(b, s)) if theta == "rope" else angles(rng, shape)
    check_backward(gc, gs, th)


# ---- odd shapes and layouts --------------------------------------------------------------------------

ODD_SHAPES = [(3, 5, 2), (2, 7, 64), (3, 5, 130), (1, 7, 13), (1, 1, 1), (7,), (2, 3, 4, 5, 6, 7, 2), (1, 3, 8)]


@pytest.fixture(params=["vec2", "vec8"])
def vector_path(request, monkeypatch):
    """Run a test through each vectorised kernel: 2 elements per thread (small tensors) and 8 (large ones)."""
    from cupy_rope import rope

    monkeypatch.setattr(rope, "VEC2_MAX_ELEMENTS", 1 << 62 if request.param == "vec2" else -1)
    return request.param


@pytest.mark.parametrize("dtype", GRAD_DTYPES)
@pytest.mark.parametrize("shape", ODD_SHAPES, ids=str)
def test_odd_shapes(shape, dtype, rng, vector_path):
    gc, gs = grads(rng, shape, dtype)
    check_backward(gc, gs, angles(rng, shape))


@pytest.mark.parametrize("dtype", GRAD_DTYPES)
@pytest.mark.parametrize("n", [1, 2, 7, 8, 9, 2047, 2048 * 256 + 3], ids=str)
def test_vector_tails(n, dtype, rng, vector_path):
    """Element counts around the per-thread and per-block widths of both vectorised kernels."""
    gc, gs = grads(rng, (n,), dtype)
    check_backward(gc, gs, angles(rng, (n,)))


@pytest.mark.parametrize("dtype", GRAD_DTYPES)
def test_zero_dim(dtype, rng):
    gc, gs = grads(rng, (1,), dtype)
    th = angles(rng, (1,))
    check_backward(gc.reshape(()), gs.reshape(()), th.reshape(()))


@pytest.mark.parametrize("dtype", GRAD_DTYPES)
def test_strided_views(dtype, rng):
    """x[:, ::2] views (non-contiguous) of all three inputs, with contiguous and strided outputs."""
    shape = (4, 10, 128)
    gc, gs = grads(rng, shape, dtype)
    th = angles(rng, shape)
    v = (gc[:, ::2], gs[:, ::2], th[:, ::2])
    assert not v[0].flags.c_contiguous
    out = check_backward(*v)
    # a strided out: only its own elements are written
    big = nan_like((4, 5, 256))
    cr.rope_2d_backward(*v, out=big[:, :, ::2])
    import cupy

    assert same_bits(big[:, :, ::2], out)
    assert bool(cupy.isnan(big[:, :, 1::2]).all()), "wrote outside the strided out view"


@pytest.mark.parametrize("dtype", GRAD_DTYPES)
def test_mixed_layouts(dtype, rng):
    """Three inputs of one shape with three different layouts (contiguous, transposed, sliced)."""
    shape = (4, 6, 8)
    gc, _ = grads(rng, shape, dtype)
    _, gs_t = grads(rng, (8, 6, 4), dtype)
    gs = gs_t.transpose(2, 1, 0)
    th = angles(rng, (4, 6, 16))[:, :, 1::2]
    assert gs.shape == th.shape == shape
    check_backward(gc, gs, th)


@pytest.mark.parametrize("dtype", GRAD_DTYPES)
def test_misaligned_views(dtype, rng):
    """flat[1:].reshape(...): C-contiguous but not 16-byte aligned (the general path must take these)."""
    import cupy

    shape = (3, 7, 129)
    n = math.prod(shape)
    gcf, gsf = grads(rng, (n + 1,), dtype)
    thf = angles(rng, (n + 1,))
    gc, gs, th = gcf[1:].reshape(shape), gsf[1:].reshape(shape), thf[1:].reshape(shape)
    assert gc.flags.c_contiguous and gc.data.ptr % 16 != 0
    out = check_backward(gc, gs, th)
    # a misaligned out, and aligned inputs with it
    flat = nan_like((n + 1,))
    cr.rope_2d_backward(gc, gs, th, out=flat[1:].reshape(shape))
    assert bool(cupy.isnan(flat[0])), "wrote before the start of out"
    assert same_bits(flat[1:].reshape(shape), out)
    gc2, gs2, th2 = cupy.ascontiguousarray(gc), cupy.ascontiguousarray(gs), cupy.ascontiguousarray(th)
    flat2 = nan_like((n + 1,))
    cr.rope_2d_backward(gc2, gs2, th2, out=flat2[1:].reshape(shape))
    assert same_bits(flat2[1:].reshape(shape), out)


@pytest.mark.parametrize("dtype", GRAD_DTYPES)
def test_five_dim_transpose(dtype, rng):
    base_shape = (3, 4, 5, 6, 7)
    perm = (4, 2, 0, 3, 1)
    gc, gs = grads(rng, base_shape, dtype)
    th = angles(rng, base_shape)
    check_backward(gc.transpose(perm), gs.transpose(perm), th.transpose(perm))
    # and a different permutation for theta than for the grads
    th2 = angles(rng, (4, 6, 3, 5, 7)).transpose(4, 3, 2, 1, 0)
    assert th2.shape == gc.transpose(perm).shape
    check_backward(gc.transpose(perm), gs.transpose(perm), th2)


def test_too_many_strided_dims(rng, no_launch):
    """Seven dimensions that cannot be merged are refused (MAXDIM = 6), before any launch."""
    shape = (2,) * 7
    gc, gs = grads(rng, shape, np.float32)
    th = angles(rng, shape)
    perm = tuple(range(7))[::-1]
    out = nan_like(shape)
    with pytest.raises(ValueError, match="at most 6"):
        cr.rope_2d_backward(gc.transpose(perm), gs.transpose(perm), th.transpose(perm), out=out)
    import cupy

    assert bool(cupy.isnan(out).all())


@pytest.mark.parametrize("dtype", GRAD_DTYPES)
@pytest.mark.parametrize("shape", [(0, 5, 128), (3, 0, 128), (2, 3, 0), (0,)], ids=str)
def test_empty(shape, dtype, rng):
    import cupy

    gc, gs = grads(rng, shape, dtype)
    th = cupy.empty(shape, np.float32)
    out = cr.rope_2d_backward(gc, gs, th)
    assert out.shape == shape and out.dtype == np.float32
    given = cupy.empty(shape, np.float32)
    assert cr.rope_2d_backward(gc, gs, th, out=given) is given


def test_out_none_allocates_fresh(rng):
    gc, gs = grads(rng, (2, 9, 128), BF16)
    th = angles(rng, (2, 9, 128))
    a = cr.rope_2d_backward(gc, gs, th)
    b = cr.rope_2d_backward(gc, gs, th)
    assert a.data.ptr != b.data.ptr


@pytest.mark.parametrize("dtype", GRAD_DTYPES)
@pytest.mark.parametrize("shape", [(2, 256, 128), (3, 5, 130), (64, 613, 128)], ids=str)
def test_default_and_explicit_current_stream_agree(shape, dtype, rng):
    """stream=None and the current stream passed explicitly launch the same kernel: same bits, with and
    without out, and the float64 reference agrees."""
    import cupy

    gc, gs = grads(rng, shape, dtype)
    th = angles(rng, shape)
    implicit = cr.rope_2d_backward(gc, gs, th)
    implicit_out = cr.rope_2d_backward(gc, gs, th, out=nan_like(shape))
    general = cr.rope_2d_backward(gc, gs, th, stream=cupy.cuda.get_current_stream())
    assert same_bits(implicit, general) and same_bits(implicit_out, general)
    assert rel_err(general, R.rope_2d_backward(gc, gs, th)) <= TOL


def test_stream(rng):
    import cupy

    shape = (8, 1024, 128)
    gc, gs = grads(rng, shape, BF16)
    th = angles(rng, shape)
    expect = cr.rope_2d_backward(gc, gs, th)
    cupy.cuda.runtime.deviceSynchronize()
    s = cupy.cuda.Stream(non_blocking=True)
    got = cr.rope_2d_backward(gc, gs, th, stream=s)
    out = nan_like(shape)
    cupy.cuda.runtime.deviceSynchronize()
    got2 = cr.rope_2d_backward(gc, gs, th, out=out, stream=s)
    s.synchronize()
    assert got2 is out
    assert same_bits(got, expect) and same_bits(out, expect)
    assert rel_err(got, R.rope_2d_backward(gc, gs, th)) <= TOL
    # the current stream is left as it was
    assert cupy.cuda.get_current_stream() != s


# ---- bad inputs: refused before any launch ------------------------------------------------------------

SHAPE = (2, 5, 16)


@pytest.fixture
def good(rng):
    import cupy

    gc, gs = grads(rng, SHAPE, BF16)
    th = angles(rng, SHAPE)
    return dict(gc=gc, gs=gs, th=th, cupy=cupy, rng=rng)


def _expect(exc, match, gc, gs, th, **kw):
    import cupy

    out = kw.get("out")
    snap = isinstance(out, cupy.ndarray) and out.dtype == np.float32
    before = cupy.array(out, copy=True) if snap else None
    with pytest.raises(exc, match=match):
        cr.rope_2d_backward(gc, gs, th, **kw)
    if snap:  # nothing was written
        assert same_bits(out, before)


def test_bad_shapes(good, no_launch):
    g = good
    _expect(ValueError, r"grad_sin must have shape \(2, 5, 16\)", g["gc"], g["gs"][:, :4], g["th"])
    _expect(ValueError, r"idx_theta must have shape \(2, 5, 16\)", g["gc"], g["gs"], g["th"].reshape(10, 16))
    _expect(ValueError, r"out must have shape", g["gc"], g["gs"], g["th"], out=nan_like((2, 5, 17)))
    _expect(ValueError, r"out must have shape", g["gc"], g["gs"], g["th"], out=nan_like((10, 16)))


def test_bad_dtypes(good, no_launch):
    g = good
    cp, rng = g["cupy"], g["rng"]
    gc, gs, th = g["gc"], g["gs"], g["th"]
    gc16, gs16 = grads(rng, SHAPE, np.float16)
    gc32, gs32 = grads(rng, SHAPE, np.float32)
    _expect(TypeError, r"grad_sin must have the dtype of grad_cos \(bfloat16\), got float16", gc, gs16, th)
    _expect(TypeError, r"grad_sin must have the dtype of grad_cos \(float32\), got bfloat16", gc32, gs, th)
    _expect(TypeError, r"grad_cos must have dtype", gc32.astype(np.float64), gs32.astype(np.float64), th)
    ints = rng.integers(-3, 3, size=SHAPE, dtype=np.int32)
    _expect(TypeError, r"grad_cos must have dtype", ints, ints.copy(), th)
    for bad in (th.astype(np.float64), th.astype(np.float16), th.astype(BF16)):
        _expect(TypeError, r"idx_theta must have dtype float32", gc, gs, bad)
    for bad in (np.float64, np.float16, BF16):
        _expect(TypeError, r"out must have dtype float32", gc, gs, th, out=cp.empty(SHAPE, bad))
    assert gs16.dtype == np.float16


def test_host_arrays_refused(good, no_launch):
    g = good
    gc, gs, th = g["gc"], g["gs"], g["th"]
    _expect(TypeError, r"grad_cos must be a cupy\.ndarray.*cupy\.asarray\(grad_cos\)", gc.get(), gs, th)
    _expect(TypeError, r"grad_sin must be a cupy\.ndarray.*cupy\.asarray\(grad_sin\)", gc, gs.get(), th)
    _expect(TypeError, r"idx_theta must be a cupy\.ndarray.*cupy\.asarray\(idx_theta\)", gc, gs, th.get())
    _expect(TypeError, r"out must be a cupy\.ndarray", gc, gs, th, out=np.full(SHAPE, np.nan, np.float32))
    _expect(TypeError, r"stream must be a cupy\.cuda\.Stream", gc, gs, th, stream=0)


def test_out_aliasing_refused(good, no_launch):
    g = good
    cp, rng = g["cupy"], g["rng"]
    n = math.prod(SHAPE)
    # f32 grads so that out could literally be one of them
    gc, gs = grads(rng, SHAPE, np.float32)
    th = g["th"]
    for name, arr in (("grad_cos", gc), ("grad_sin", gs), ("idx_theta", th)):
        _expect(ValueError, f"out overlaps the memory of input {name}", gc, gs, th, out=arr)
    # a view that overlaps idx_theta partly
    buf = angles(rng, (2 * n,))
    th_v = buf[:n].reshape(SHAPE)
    _expect(ValueError, "overlaps the memory of input idx_theta", gc, gs, th_v, out=buf[n // 2: n // 2 + n].reshape(SHAPE))
    # a strided view interleaved with an input (conservatively refused)
    buf2 = cp.full(SHAPE + (2,), np.nan, np.float32)
    buf2[..., 0] = th
    _expect(ValueError, "overlaps the memory of input idx_theta", gc, gs, buf2[..., 0], out=buf2[..., 1])


def test_out_adjacent_to_input_is_fine(rng):
    """The overlap check is not over-eager: an out right after idx_theta in the same buffer is accepted."""
    import cupy

    n = math.prod(SHAPE)
    gc, gs = grads(rng, SHAPE, BF16)
    buf = cupy.full((2 * n,), np.nan, np.float32)
    buf[:n] = angles(rng, (n,))
    th = buf[:n].reshape(SHAPE)
    th_before = th.copy()
    out = cr.rope_2d_backward(gc, gs, th, out=buf[n:].reshape(SHAPE))
    assert bool(cupy.array_equal(th, th_before))
    assert rel_err(out, R.rope_2d_backward(gc, gs, th_before)) <= TOL


def test_inputs_not_modified(rng):
    import cupy

    shape = (4, 33, 128)
    gc, gs = grads(rng, shape, BF16)
    th = angles(rng, shape)
    copies = [cupy.array(a, copy=True) for a in (gc, gs, th)]
    cr.rope_2d_backward(gc, gs, th)
    cr.rope_2d_forward(th)
    for a, b in zip((gc, gs, th), copies):
        assert same_bits(a, b)


# ---- forward ------------------------------------------------------------------------------------------

# (relative Frobenius bound, per-element bound relative to |value|: about one unit in the last place)
FWD_TOL = {BF16: (4e-3, 2.0 ** -7), np.dtype(np.float16): (1e-3, 2.0 ** -10), np.dtype(np.float32): (1e-6, 2.0 ** -21)}


@pytest.mark.parametrize("dtype", GRAD_DTYPES)
@pytest.mark.parametrize("layout", ["contiguous", "strided", "misaligned"])
@pytest.mark.parametrize("shape", [(8, 1024, 128), (1, 7, 13), (3, 5, 130)], ids=str)
def test_forward(shape, layout, dtype, rng):
    import cupy

    frob, rel = FWD_TOL[np.dtype(dtype)]
    if layout == "contiguous":
        th = angles(rng, shape)
    elif layout == "strided":
        th = angles(rng, shape[:-1] + (2 * shape[-1],))[..., ::2]
    else:
        th = angles(rng, (math.prod(shape) + 1,))[1:].reshape(shape)
    cos, sin = cr.rope_2d_forward(th, dtype=dtype)
    assert cos.dtype == sin.dtype == dtype and cos.shape == sin.shape == shape
    rc, rs = R.rope_2d_forward(th)
    for name, got, ref in (("cos", cos, rc), ("sin", sin, rs)):
        err = rel_err(got, ref)
        assert err <= frob, f"{name}: relative error {err:.2e} > {frob:.0e}"
        dev = cupy.abs(got.astype(np.float64) - ref) - (rel * cupy.abs(ref) + 1e-7)
        assert float(dev.max()) <= 0, f"{name}: an element is off by more than one {dtype} ulp"
    c2, s2 = cr.rope_2d_forward(th, dtype=dtype)
    assert same_bits(c2, cos) and same_bits(s2, sin)


def test_forward_default_dtype_and_empty(rng):
    import cupy

    th = angles(rng, (2, 3, 8))
    c, s = cr.rope_2d_forward(th)
    assert c.dtype == BF16 and s.dtype == BF16
    c, s = cr.rope_2d_forward(cupy.empty((0, 8), np.float32), dtype=np.float32)
    assert c.shape == s.shape == (0, 8)


def test_forward_bad_inputs(rng, no_launch):
    th = angles(rng, (2, 3, 8))
    with pytest.raises(TypeError, match="dtype must be bfloat16, float16 or float32"):
        cr.rope_2d_forward(th, dtype=np.float64)
    with pytest.raises(TypeError, match="idx_theta must have dtype float32"):
        cr.rope_2d_forward(th.astype(np.float64))
    with pytest.raises(TypeError, match=r"cupy\.asarray\(idx_theta\)"):
        cr.rope_2d_forward(th.get())


def test_forward_then_backward_consistent(rng):
    """With fp32 storage, the backward equals -gc*sin + gs*cos built from the forward's own cos/sin."""
    import cupy

    shape = (4, 100, 128)
    th = angles(rng, shape)
    gc, gs = grads(rng, shape, np.float32)
    cos, sin = cr.rope_2d_forward(th, dtype=np.float32)
    composed = -gc.astype(np.float64) * sin + gs.astype(np.float64) * cos
    assert rel_err(cr.rope_2d_backward(gc, gs, th), composed) <= 1e-6
    assert isinstance(cos, cupy.ndarray)
