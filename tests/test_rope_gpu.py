"""rope_2d_backward / rope_2d_forward on the GPU against the float64 reference, within the README's bound.

Every case: fresh random grads (standard normal, stored as bf16 / fp16 / fp32), the output buffer poisoned with
NaN before the call (the forward, which allocates its outputs, into NaN-poisoned allocations), relative
Frobenius error vs float64 <= 2e-6, and a second run bit-identical to the first.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

import cupy_rope as cr
from cupy_rope import reference as R
from cupy_rope import workloads as W
from cupy_rope.rope import RopePlan
from tests.helpers import BF16, GRAD_DTYPES, assert_no_launch, poison, poisoned_allocations, rel_err, same_bits
from tests.helpers import rope_angles as angles
from tests.helpers import rope_grads as grads
from tests.helpers import ROPE_TOL as TOL

pytestmark = pytest.mark.gpu


def check_backward(gc, gs, th, tol=TOL, plan=None):
    """Poisoned out, error vs float64, determinism (both runs with ``plan``). Returns the output."""
    import cupy

    out = poison(th.shape)
    ret = cr.rope_2d_backward(gc, gs, th, out=out, plan=plan)
    assert ret is out
    ref = R.rope_2d_backward(gc, gs, th)
    assert isinstance(ref, cupy.ndarray) and ref.dtype == np.float64
    err = rel_err(out, ref)
    assert err <= tol, f"relative error {err:.3e} > {tol:.0e} (shape {th.shape}, {gc.dtype})"
    again = cr.rope_2d_backward(gc, gs, th, plan=plan)
    assert again.dtype == np.float32 and again.shape == th.shape and again.flags.c_contiguous
    assert same_bits(again, out), "two runs differ"
    return out


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
def vector_plan(request):
    """Each vectorised kernel, forced through ``plan=``: 2 elements per thread (the library's choice for small
    tensors) and 8 (large ones). A forced vector plan on inputs that cannot take it raises, so a test cannot
    silently fall back to the strided kernel."""
    return RopePlan(request.param)


@pytest.mark.parametrize("dtype", GRAD_DTYPES)
@pytest.mark.parametrize("shape", ODD_SHAPES, ids=str)
def test_odd_shapes(shape, dtype, rng, vector_plan):
    gc, gs = grads(rng, shape, dtype)
    check_backward(gc, gs, angles(rng, shape), plan=vector_plan)


@pytest.mark.parametrize("dtype", GRAD_DTYPES)
@pytest.mark.parametrize("n", [1, 2, 7, 8, 9, 2047, 2048 * 256 + 3], ids=str)
def test_vector_tails(n, dtype, rng, vector_plan):
    """Element counts around the per-thread and per-block widths of both vectorised kernels."""
    gc, gs = grads(rng, (n,), dtype)
    check_backward(gc, gs, angles(rng, (n,)), plan=vector_plan)


@pytest.mark.parametrize("dtype", GRAD_DTYPES)
@pytest.mark.parametrize("shape", [(3, 5, 130), (2, 256, 128), (1, 7, 13)], ids=str)
def test_every_path_same_bits(shape, dtype, rng):
    """The three kernels compute each element with the same code (sincosf, one fma): on contiguous aligned
    inputs the library's choice, vec2, vec8 and the strided kernel give the same bits, and a callable plan
    sees the library's choice."""
    from cupy_rope.rope import make_rope_plan

    gc, gs = grads(rng, shape, dtype)
    th = angles(rng, shape)
    seen = []
    default = cr.rope_2d_backward(gc, gs, th, plan=lambda p: seen.append(p) or p)
    assert seen == [make_rope_plan(math.prod(shape), vectorizable=True)]
    assert rel_err(default, R.rope_2d_backward(gc, gs, th)) <= TOL
    for path in ("vec2", "vec8", "strided"):
        got = check_backward(gc, gs, th, plan=RopePlan(path))
        assert same_bits(got, default), f"path {path} differs from the library's choice"


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
    big = poison((4, 5, 256))
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
    flat = poison((n + 1,))
    cr.rope_2d_backward(gc, gs, th, out=flat[1:].reshape(shape))
    assert bool(cupy.isnan(flat[0])), "wrote before the start of out"
    assert same_bits(flat[1:].reshape(shape), out)
    gc2, gs2, th2 = cupy.ascontiguousarray(gc), cupy.ascontiguousarray(gs), cupy.ascontiguousarray(th)
    flat2 = poison((n + 1,))
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
    out = poison(shape)
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
    implicit_out = cr.rope_2d_backward(gc, gs, th, out=poison(shape))
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
    out = poison(shape)
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
    with assert_no_launch(), pytest.raises(exc, match=match):
        cr.rope_2d_backward(gc, gs, th, **kw)
    if snap:  # nothing was written
        assert same_bits(out, before)


def test_bad_shapes(good, no_launch):
    g = good
    _expect(ValueError, r"grad_sin must have shape \(2, 5, 16\)", g["gc"], g["gs"][:, :4], g["th"])
    _expect(ValueError, r"idx_theta must have shape \(2, 5, 16\)", g["gc"], g["gs"], g["th"].reshape(10, 16))
    _expect(ValueError, r"out must have shape", g["gc"], g["gs"], g["th"], out=poison((2, 5, 17)))
    _expect(ValueError, r"out must have shape", g["gc"], g["gs"], g["th"], out=poison((10, 16)))


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
    _expect(ValueError, "overlaps the memory of input idx_theta", gc, gs, th_v,
            out=buf[n // 2: n // 2 + n].reshape(SHAPE))
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


def _byte_view(dtype, shape, offset):
    """(a C-contiguous view of ``shape`` starting ``offset`` bytes into a fresh byte buffer, that buffer).
    Nothing may read such a view on the device when its elements are misaligned: the kernel would fault with
    a sticky misaligned-address error that ends the CUDA context, so the tests compare the byte buffer only."""
    import cupy

    n = math.prod(shape) * np.dtype(dtype).itemsize
    buf = cupy.zeros(n + 16, cupy.uint8)
    return buf[offset:offset + n].view(dtype).reshape(shape), buf


def _refused(exc, match, fn, *args, **kw):
    """``fn(*args, **kw)`` raises ``exc`` matching ``match`` and launches nothing."""
    with assert_no_launch(), pytest.raises(exc, match=match):
        fn(*args, **kw)


@pytest.mark.parametrize("dtype", GRAD_DTYPES)
def test_misaligned_elements_refused(dtype, rng, no_launch):
    """Views whose elements start mid-element (``buf[1:].view(float32)`` of a byte buffer) or whose strides are
    not whole elements are refused before any launch, inputs and out alike; the byte buffers stay untouched."""
    import cupy
    from cupy.lib.stride_tricks import as_strided

    gc, gs = grads(rng, SHAPE, dtype)
    th = angles(rng, SHAPE)
    size = np.dtype(dtype).itemsize
    for off in range(1, size):
        for name in ("grad_cos", "grad_sin"):
            bad, buf = _byte_view(dtype, SHAPE, off)
            before = buf.copy()
            args = (bad, gs, th) if name == "grad_cos" else (gc, bad, th)
            _refused(ValueError, rf"{name} must be aligned to {size} bytes", cr.rope_2d_backward, *args)
            assert bool((buf == before).all())
    for off in (1, 2, 3):
        bad, buf = _byte_view(np.float32, SHAPE, off)
        before = buf.copy()
        _refused(ValueError, r"idx_theta must be aligned to 4 bytes", cr.rope_2d_backward, gc, gs, bad)
        _refused(ValueError, r"out must be aligned to 4 bytes", cr.rope_2d_backward, gc, gs, th, out=bad)
        _refused(ValueError, r"idx_theta must be aligned to 4 bytes", cr.rope_2d_forward, bad)
        assert bool((buf == before).all()), "a misaligned out was written"
    # an aligned start, but strides of 6 bytes: every other element starts mid-float
    n = 10
    g1, s1 = grads(rng, (n,), dtype)
    raw = poison((n * 2,))
    odd = as_strided(raw, shape=(n,), strides=(6,))
    _refused(ValueError, r"idx_theta must have strides that are multiples of 4", cr.rope_2d_backward, g1, s1, odd)
    _refused(ValueError, r"out must have strides that are multiples of 4", cr.rope_2d_backward, g1, s1,
             angles(rng, (n,)), out=odd)
    assert bool(cupy.isnan(raw).all())


def test_self_overlapping_out_refused(good, no_launch):
    """An out whose elements share memory (a broadcast, rows closer than their length) would be written in a
    schedule-dependent order: refused before any launch, nothing written."""
    import cupy
    from cupy.lib.stride_tricks import as_strided

    gc, gs, th = good["gc"], good["gs"], good["th"]
    row = poison((SHAPE[2],))
    cases = [cupy.broadcast_to(row, SHAPE),  # strides (0, 0, 4)
             as_strided(poison((200,)), SHAPE, (16 * 4, 8 * 4, 4)),  # rows 8 floats apart, 16 long
             as_strided(poison((200,)), SHAPE, (4, 4 * 4, 4 * 4 * 3))]  # transposed: [0, 3, 0] is [0, 0, 1]
    for out in cases:
        _expect(ValueError, "out has elements that share memory", gc, gs, th, out=out)
    assert bool(cupy.isnan(row).all())


@pytest.mark.parametrize("dtype", GRAD_DTYPES)
def test_reversed_and_permuted_out_accepted(dtype, rng):
    """The self-overlap check is not over-eager: negative strides and a permuted layout are distinct elements,
    accepted, and give the bits of a contiguous out."""
    import cupy

    gc, gs = grads(rng, SHAPE, dtype)
    th = angles(rng, SHAPE)
    expect = check_backward(gc, gs, th)
    rev = poison(SHAPE)[::-1, :, ::-1]
    perm = poison((SHAPE[2], SHAPE[0], SHAPE[1])).transpose(1, 2, 0)
    for out in (rev, perm):
        assert cr.rope_2d_backward(gc, gs, th, out=out) is out
        assert same_bits(cupy.ascontiguousarray(out), expect)


def test_forced_plan_checked_before_launch(rng, no_launch):
    """A forced vector plan on inputs that cannot take it (not 16-byte aligned, or strided) is refused before any
    launch; plan must be a RopePlan or a callable returning one."""
    gc, gs = grads(rng, (4, 33), np.float32)
    th = angles(rng, (4, 33))
    flat = angles(rng, (4 * 33 + 1,))
    shifted = flat[1:].reshape(4, 33)  # C-contiguous, 4 bytes past 16-byte alignment
    wide = angles(rng, (4, 66))[:, ::2]  # strided
    for path in ("vec2", "vec8"):
        _refused(ValueError, "16-byte aligned", cr.rope_2d_backward, gc, gs, shifted, plan=RopePlan(path))
        _refused(ValueError, "16-byte aligned", cr.rope_2d_backward, gc, gs, wide, plan=RopePlan(path))
        _refused(ValueError, "16-byte aligned", cr.rope_2d_backward, gc, gs, th, out=poison((4, 66))[:, ::2],
                 plan=lambda p, path=path: RopePlan(path))
    _refused(TypeError, "plan must be a RopePlan", cr.rope_2d_backward, gc, gs, th, plan="vec2")
    _refused(TypeError, "plan must be a RopePlan", cr.rope_2d_backward, gc, gs, th, plan=lambda p: None)


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

# (storage dtype, relative Frobenius bound, per-element bound relative to |value|: about one unit in the last place)
FWD_CASES = [pytest.param(BF16, 4e-3, 2.0 ** -7, id="bf16"),
             pytest.param(np.dtype(np.float16), 1e-3, 2.0 ** -10, id="f16"),
             pytest.param(np.dtype(np.float32), 1e-6, 2.0 ** -21, id="f32")]


@pytest.mark.parametrize("dtype,frob,rel", FWD_CASES)
@pytest.mark.parametrize("layout", ["contiguous", "strided", "misaligned"])
@pytest.mark.parametrize("shape", [(8, 1024, 128), (1, 7, 13), (3, 5, 130)], ids=str)
def test_forward(shape, layout, dtype, frob, rel, rng):
    import cupy

    with poisoned_allocations():
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
