"""Host-side validation and pure helpers, tested without a GPU (CuPy imports on a CPU machine; nothing here
touches a device). The checks of cupy_rope._checks run on NumPy arrays here (they read only addresses, shapes
and strides); the GPU tests run them through the ops.

The last section holds the vision attention's own validation and host-side pieces (cupy_rope.attention)."""
from __future__ import annotations

import dataclasses
import itertools
import math

import ml_dtypes
import numpy as np
import pytest

import cupy_rope
from cupy_rope import _bench as B
from cupy_rope import _checks as C
from cupy_rope import rope as RP
from cupy_rope import workloads as W
from tests.helpers import gpu_problem

BF16 = np.dtype(ml_dtypes.bfloat16)


# ---- NumPy arrays are refused with a hint ------------------------------------------------------------

def test_rope_backward_refuses_numpy(np_rng):
    shape = (2, 3, 8)
    gc = np_rng.standard_normal(shape).astype(BF16)
    gs = np_rng.standard_normal(shape).astype(BF16)
    th = np_rng.standard_normal(shape).astype(np.float32)
    with pytest.raises(TypeError, match=r"grad_cos must be a cupy\.ndarray.*cupy\.asarray\(grad_cos\)"):
        cupy_rope.rope_2d_backward(gc, gs, th)


def test_rope_backward_refuses_other_types():
    with pytest.raises(TypeError, match=r"grad_cos must be a cupy\.ndarray, got builtins\.list$"):
        cupy_rope.rope_2d_backward([1.0], [1.0], [1.0])


def test_rope_forward_refuses_numpy(np_rng):
    with pytest.raises(TypeError, match=r"cupy\.asarray\(idx_theta\)"):
        cupy_rope.rope_2d_forward(np_rng.standard_normal((4, 8)).astype(np.float32))


def test_on_stream_refuses_other_objects():
    with pytest.raises(TypeError, match="stream must be a cupy.cuda.Stream"):
        C.on_stream(7)


def test_on_stream_takes_foreign_streams_as_cupy_wraps_them():
    """A foreign stream (another framework's) wrapped by CuPy: Stream.from_external (CuPy 14) or ExternalStream
    (CuPy 13, deprecated in 14); made here without touching a device."""
    import warnings

    import cupy

    class Foreign:
        def __cuda_stream__(self):
            return 0, 4096

    wrapped = []
    if hasattr(cupy.cuda.Stream, "from_external"):
        wrapped.append(cupy.cuda.Stream.from_external(Foreign()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        wrapped.append(cupy.cuda.ExternalStream(4096))
    for stream in wrapped:
        assert C.is_stream(stream) and C.on_stream(stream) == (stream, 4096)


# ---- arrays on several GPUs ----------------------------------------------------------------------------
# CuPy array headers over memory that is never read (UnownedMemory with a chosen device id) and a chosen current
# device: the device checks run as on a machine with two GPUs, and each refusal comes before any launch.

_HEADERS: list = []


def device_header(shape, dtype, dev: int):
    import cupy
    from cupy.cuda import memory as M

    nbytes = max(math.prod(shape) * np.dtype(dtype).itemsize, 16)
    mem = M.UnownedMemory((len(_HEADERS) + 1) << 24, nbytes, None, device_id=dev)
    _HEADERS.append(mem)
    return cupy.ndarray(shape, dtype, memptr=M.MemoryPointer(mem, 0))


@pytest.fixture
def current_device(monkeypatch):
    """Sets the current device the checks see: ``current_device(k)``."""
    import cupy

    def choose(dev: int) -> None:
        monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: dev)
    return choose


ONE_GPU = "every array of a call must be on one GPU"


@pytest.mark.parametrize("current", [0, 1])
def test_rope_arrays_on_two_gpus_refused_as_such(current, current_device):
    """Whichever GPU is current, the message names the two GPUs (not a switch to the other one, which would only
    move the complaint)."""
    current_device(current)
    gc, th = device_header((4, 8), BF16, 0), device_header((4, 8), np.float32, 0)
    with pytest.raises(ValueError, match=rf"grad_cos is on GPU 0 but grad_sin on GPU 1; {ONE_GPU}"):
        cupy_rope.rope_2d_backward(gc, device_header((4, 8), BF16, 1), th)
    with pytest.raises(ValueError, match=rf"grad_cos is on GPU 0 but out on GPU 1; {ONE_GPU}"):
        cupy_rope.rope_2d_backward(gc, device_header((4, 8), BF16, 0), th, out=device_header((4, 8), np.float32, 1))


def test_arrays_on_one_other_gpu_told_to_switch(current_device):
    current_device(0)
    gc, gs, th = (device_header((4, 8), dt, 1) for dt in (BF16, BF16, np.float32))
    with pytest.raises(ValueError, match=r"grad_cos lives on GPU 1 but the current device is GPU 0; call inside "
                                         r"`with cupy.cuda.Device\(1\):`"):
        cupy_rope.rope_2d_backward(gc, gs, th)


@pytest.mark.parametrize("current", [0, 1])
def test_attention_arrays_on_two_gpus_refused_as_such(current, current_device):
    current_device(current)
    t, nh, d = 8, 2, 64
    q, k, v, g, o = (device_header((t, nh, d), np.float32, 0) for _ in range(5))
    cu = np.asarray([0, 3, 8], np.int32)
    other = device_header((t, nh, d), np.float32, 1)
    with pytest.raises(ValueError, match=rf"q is on GPU 0 but k on GPU 1; {ONE_GPU}"):
        cupy_rope.varlen_attention_forward(q, other, v, cu)
    with pytest.raises(ValueError, match=rf"q is on GPU 0 but cu_seqlens on GPU 1; {ONE_GPU}"):
        cupy_rope.varlen_attention_forward(q, k, v, device_header((3,), np.int32, 1))
    with pytest.raises(ValueError, match=rf"q is on GPU 0 but out on GPU 1; {ONE_GPU}"):
        cupy_rope.varlen_attention_forward(q, k, v, cu, out=other)
    with pytest.raises(ValueError, match=rf"q is on GPU 0 but lse on GPU 1; {ONE_GPU}"):
        cupy_rope.varlen_attention_backward(g, q, k, v, o, device_header((nh, t), np.float32, 1), cu)
    h = nh * d
    block = dict(grad_output=(t, h), hidden_states=(t, h), qkv_weight=(3 * h, h), qkv_bias=(3 * h,),
                 proj_weight=(h, h), proj_bias=(h,), cos=(t, d), sin=(t, d))
    arrays = {name: device_header(shape, np.float32, 1 if name == "proj_weight" else 0)
              for name, shape in block.items()}
    with pytest.raises(ValueError, match=rf"grad_output is on GPU 0 but proj_weight on GPU 1; {ONE_GPU}"):
        cupy_rope.vision_attention_backward(*arrays.values(), cu)


# ---- dtype / shape / layout helpers ------------------------------------------------------------------

def test_require_dtype():
    C.require_dtype(np.zeros(2, BF16), "x", (C.BF16, C.F16))
    with pytest.raises(TypeError, match=r"x must have dtype bfloat16 or float16, got float32"):
        C.require_dtype(np.zeros(2, np.float32), "x", (C.BF16, C.F16))
    assert C.dtype_name(BF16) == "bfloat16" and C.dtype_name(np.float16) == "float16"
    swapped = np.dtype(np.float32).newbyteorder()
    with pytest.raises(TypeError, match=rf"got float32 \({swapped.str}, not in this machine's byte order\)"):
        C.require_dtype(np.zeros(2, swapped), "x", (C.F32,))


def test_rope_forward_dtype_refused_by_name(current_device):
    current_device(0)
    th = device_header((4, 8), np.float32, 0)
    with pytest.raises(TypeError, match="dtype must be bfloat16, float16 or float32, got None"):
        cupy_rope.rope_2d_forward(th, dtype=None)
    swapped = np.dtype(np.float32).newbyteorder()
    with pytest.raises(TypeError, match=rf"got float32 \({swapped.str}, not in"):
        cupy_rope.rope_2d_forward(th, dtype=swapped)
    for bad in ("x", object(), 3.5):  # not a dtype at all: NumPy's own message alone would not name the argument
        with pytest.raises(TypeError, match="dtype must be bfloat16, float16 or float32, got"):
            cupy_rope.rope_2d_forward(th, dtype=bad)


def test_require_shape_and_contiguous():
    x = np.ones((4, 6), np.float32)
    C.require_shape(x, "x", (4, 6))
    with pytest.raises(ValueError, match=r"x must have shape \(4, 5\) \(why\), got \(4, 6\)"):
        C.require_shape(x, "x", (4, 5), " (why)")
    C.require_contiguous(x, "x")
    for view in (x.T, x[:, ::2], x[:, 1:]):
        with pytest.raises(ValueError, match="C-contiguous"):
            C.require_contiguous(view, "x")
    C.require_contiguous(x[1:], "x")  # a row slice stays C-contiguous


# ---- cu_seqlens ------------------------------------------------------------------------------------

@pytest.mark.parametrize("cu,total", [([0, 3, 7], 7), ([0, 0, 5, 5, 9], 9), ([0, 0], 0), ([0, 12], 12), ([0], 0)])
@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint32])
def test_cu_seqlens_valid(cu, total, dtype):
    C.check_cu_seqlens(np.asarray(cu, dtype), total)


@pytest.mark.parametrize("cu,total,match", [
    ([1, 3, 7], 7, "must start at 0, got 1"),
    ([0, 5, 3, 7], 7, r"non-decreasing; cu_seqlens\[2\] = 3 < cu_seqlens\[1\] = 5"),
    ([0, 3, 6], 7, "must end at the number of tokens 7, got 6"),
    ([0, 3, 8], 7, "must end at the number of tokens 7, got 8"),
    ([], 0, "at least 1 entry"),
    ([0], 3, "must end at the number of tokens 3, got 0"),
    ([[0, 3], [3, 7]], 7, "1-D"),
])
def test_cu_seqlens_invalid(cu, total, match):
    with pytest.raises(ValueError, match=match):
        C.check_cu_seqlens(np.asarray(cu, np.int32), total)


def test_cu_seqlens_that_wrap_refused():
    """Entries whose differences overflow their dtype: compared, not subtracted."""
    big = np.iinfo(np.int64)
    with pytest.raises(ValueError, match=rf"cu_seqlens\[2\] = {big.min} < cu_seqlens\[1\] = {big.max}"):
        C.check_cu_seqlens(np.asarray([0, big.max, big.min, -1, 8], np.int64), 8)
    top = np.iinfo(np.uint64).max
    with pytest.raises(ValueError, match=rf"cu_seqlens\[2\] = 8 < cu_seqlens\[1\] = {top}"):
        C.check_cu_seqlens(np.asarray([0, top, 8], np.uint64), 8)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.bool_])
def test_cu_seqlens_must_be_integer(dtype):
    with pytest.raises(TypeError, match="integer array"):
        C.check_cu_seqlens(np.asarray([0, 3, 7]).astype(dtype), 7)


def test_cu_seqlens_form_refuses_lists():
    with pytest.raises(TypeError, match="cu_seqlens must be a cupy or numpy integer array"):
        C.check_cu_seqlens_form([0, 3])
    with pytest.raises(TypeError, match="integer"):
        C.check_cu_seqlens_form(np.array([0.0, 3.0]))
    with pytest.raises(ValueError, match="1-D"):
        C.check_cu_seqlens_form(np.array([[0, 3]], np.int32))
    C.check_cu_seqlens_form(np.array([0, 3, 5], np.int64))


# ---- collapse_dims ----------------------------------------------------------------------------------

def _offsets(shape, strides):
    """Element offsets of a strided view, in row-major order of its index."""
    if len(shape) == 0:
        return [0]
    return [sum(i * s for i, s in zip(idx, strides)) for idx in itertools.product(*map(range, shape))]


def _elem_strides(a):
    return [s // a.itemsize for s in a.strides]


def _views(np_rng):
    base = np.arange(4 * 6 * 10, dtype=np.float32).reshape(4, 6, 10)
    b5 = np.zeros((2, 3, 4, 5, 6), np.float32)
    return [base, base[:, ::2], base[:, :, :7], base[::-1], base[:, ::-2, 1:], base.transpose(2, 0, 1),
            base[1:3, 2:3, ::3], base[:, 0], base[None, :, :, None], b5.transpose(4, 2, 0, 3, 1), b5[:, :, 1:3],
            base.reshape(-1)[1:].reshape(239, 1), base[:0]]


def test_collapse_dims_known_cases():
    assert C.collapse_dims((2, 3, 4), [12, 4, 1]) == ([24], [[1]])
    assert C.collapse_dims((1, 5, 1, 3), [15, 3, 3, 1]) == ([15], [[1]])
    assert C.collapse_dims((4, 4), [16, 2]) == ([4, 4], [[16, 2]])  # x[:, :4:2] of a (4, 16) array: stays 2-D
    assert C.collapse_dims((4, 4), [8, 2]) == ([16], [[2]])  # x[:, ::2] of a (4, 8) array: one stride-2 run
    assert C.collapse_dims((3, 4), [1, 3]) == ([3, 4], [[1, 3]])  # a transpose never merges
    assert C.collapse_dims((), ) == ([], [])
    assert C.collapse_dims((), [], []) == ([], [[], []])
    # merged only where *every* array is contiguous across the pair
    assert C.collapse_dims((2, 3), [3, 1], [1, 2]) == ([2, 3], [[3, 1], [1, 2]])
    assert C.collapse_dims((2, 3), [3, 1], [6, 2]) == ([6], [[1], [2]])


def test_collapse_dims_preserves_every_offset(np_rng):
    views = _views(np_rng)
    for a in views:
        dims, (st,) = C.collapse_dims(a.shape, _elem_strides(a))
        assert math.prod(dims) == a.size or a.size == 0
        assert 1 not in dims
        assert _offsets(dims, st) == _offsets(a.shape, _elem_strides(a)), (a.shape, a.strides)
    # pairs of arrays of one shape but different layouts
    for a, b in [(views[0], np.empty((10, 6, 4), np.float32).transpose(2, 1, 0)),
                 (views[0][:, ::2], np.empty((4, 3, 10), np.float32))]:
        dims, (sa, sb) = C.collapse_dims(a.shape, _elem_strides(a), _elem_strides(b))
        assert _offsets(dims, sa) == _offsets(a.shape, _elem_strides(a))
        assert _offsets(dims, sb) == _offsets(b.shape, _elem_strides(b))


# ---- byte extents and overlap -------------------------------------------------------------------------

def _ptr(a):
    return a.__array_interface__["data"][0]


def _ext(a):
    return C.byte_extent(_ptr(a), a.shape, a.strides, a.itemsize)


def _brute_extent(a):
    if a.size == 0:
        return None
    addrs = [_ptr(a) + o * a.itemsize for o in _offsets(a.shape, _elem_strides(a))]
    return min(addrs), max(addrs) + a.itemsize


def test_byte_extent_matches_brute_force(np_rng):
    for a in _views(np_rng):
        lo, hi = _ext(a)
        if a.size == 0:
            assert lo == hi
        else:
            assert (lo, hi) == _brute_extent(a), (a.shape, a.strides)


def test_byte_extent_negative_strides():
    a = np.arange(12, dtype=np.float32)
    assert _ext(a[::-1]) == _ext(a)
    r = a.reshape(3, 4)[::-1, ::-1]
    assert _ext(r) == (_ptr(a), _ptr(a) + 48)


def test_ranges_overlap():
    buf = np.arange(64, dtype=np.float32)
    assert C.ranges_overlap(_ext(buf[0:10]), _ext(buf[5:20]))
    assert C.ranges_overlap(_ext(buf), _ext(buf))
    assert C.ranges_overlap(_ext(buf.reshape(8, 8)), _ext(buf.reshape(8, 8).T))
    assert C.ranges_overlap(_ext(buf[::2]), _ext(buf[1::2]))  # interleaved: conservatively an overlap
    assert not C.ranges_overlap(_ext(buf[0:10]), _ext(buf[10:20]))  # adjacent, touching only at the boundary
    assert not C.ranges_overlap(_ext(buf[0:10]), _ext(np.arange(10, dtype=np.float32)))
    assert not C.ranges_overlap(_ext(buf[5:5]), _ext(buf))  # empty views touch nothing
    assert not C.ranges_overlap(_ext(buf[:0]), _ext(buf[:0]))
    assert not C.ranges_overlap((100, 100), (90, 110))
    assert C.ranges_overlap((0, 9), (8, 16)) and not C.ranges_overlap((0, 8), (8, 16))
    # the last element's own bytes count: a view ending at byte 40 meets one starting at byte 36
    assert C.ranges_overlap(_ext(buf[0:10]), _ext(buf[9:11]))


# ---- element alignment ----------------------------------------------------------------------------------

def _at_offset(dtype, shape, offset):
    """A C-contiguous NumPy view of ``shape`` whose data starts ``offset`` bytes past a 64-byte boundary."""
    n = math.prod(shape) * np.dtype(dtype).itemsize
    raw = np.zeros(n + 128, np.uint8)
    start = (-_ptr(raw)) % 64 + offset
    return raw[start:start + n].view(dtype).reshape(shape)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16, np.float64])
def test_require_aligned(dtype):
    size = np.dtype(dtype).itemsize
    for off in range(0, 2 * size):
        x = _at_offset(dtype, (3, 5), off)
        assert _ptr(x) % 64 == off
        if off % size == 0:
            C.require_aligned(x, "x", size)
            C.require_aligned(x[:, ::2], "x", size)  # whole-element strides
            C.require_aligned(x.T, "x", size)
        else:
            with pytest.raises(ValueError, match=rf"x must be aligned to {size} bytes \(its element size\); "
                                                 rf"its data starts {off % size} byte"):
                C.require_aligned(x, "x", size)
    # an empty view is never read: accepted wherever it points
    C.require_aligned(_at_offset(dtype, (0, 5), 1), "x", size)


def test_require_aligned_strides():
    base = _at_offset(np.float32, (64,), 0)
    ok = np.lib.stride_tricks.as_strided(base, shape=(8,), strides=(8,))
    C.require_aligned(ok, "x", 4)
    for st in (6, 2, 5):
        bad = np.lib.stride_tricks.as_strided(base, shape=(8,), strides=(st,))
        with pytest.raises(ValueError, match=r"x must have strides that are multiples of 4 bytes"):
            C.require_aligned(bad, "x", 4)
    # a stride that is not whole elements is harmless on a dimension of length 1 (never stepped)
    one = np.lib.stride_tricks.as_strided(base, shape=(1, 8), strides=(6, 4))
    C.require_aligned(one, "x", 4)
    # the vector path's 16-byte test: base address only for contiguous float32 (strides of 4 are its elements)
    C.require_aligned(_at_offset(np.float32, (8,), 16), "x", 4)
    with pytest.raises(ValueError, match="aligned to 16 bytes"):
        C.require_aligned(_at_offset(np.float32, (8,), 4), "x", 16)


def test_data_ptr():
    a = np.arange(10, dtype=np.float32)
    assert C.data_ptr(a[3:]) == _ptr(a) + 12


# ---- self-overlapping views ---------------------------------------------------------------------------------

def _brute_self_overlap(shape, strides, itemsize) -> bool:
    """Two elements share a byte: some pair of start addresses closer than itemsize."""
    if any(n == 0 for n in shape):
        return False
    starts = sorted(sum(i * s for i, s in zip(idx, strides)) for idx in itertools.product(*map(range, shape)))
    return any(b - a < itemsize for a, b in zip(starts, starts[1:]))


def _layouts():
    """(shape, byte strides, itemsize) of views made by slicing, transposing and reversing arrays, and of
    hand-made overlapping ones."""
    base = np.zeros((4, 6, 10), np.float32)
    views = [base, base[:, ::2], base[::-1, :, ::-3], base.transpose(2, 0, 1), base[1:3, 2:3, ::3], base[:, 0],
             base[None, :, :, None], base[:0], np.zeros((3, 5), np.uint16)[::-1, 1:].T]
    made = [((3, 4), (0, 4), 4), ((4, 3), (4, 0), 4), ((1, 5), (0, 4), 4), ((5, 1), (4, 0), 4),
            ((2, 5, 16), (64, 32, 4), 4), ((2, 5, 16), (4, 16, 48), 4), ((2, 5, 16), (4, 16, 80), 4),
            ((10,), (2,), 4), ((10,), (-4,), 4), ((3, 3), (12, -4), 4), ((4, 4), (4, 16), 4), ((0, 3), (0, 0), 4)]
    return [(v.shape, v.strides, v.itemsize) for v in views] + made


def test_self_overlap_matches_brute_force_on_known_layouts():
    for shape, strides, size in _layouts():
        assert C.self_overlaps(shape, strides, size) == _brute_self_overlap(shape, strides, size), (shape, strides)


def test_self_overlap_never_passes_an_overlap(np_rng):
    """Random shapes and strides (any sign, zero included): every view the brute force finds overlapping is
    refused; the check's only error is the documented conservative one (refusing a rare interleaving)."""
    overlapping = passed = 0
    for _ in range(3000):
        ndim = int(np_rng.integers(1, 4))
        shape = tuple(int(n) for n in np_rng.integers(0, 5, ndim))
        strides = tuple(int(st) * 4 for st in np_rng.integers(-9, 10, ndim))
        brute = _brute_self_overlap(shape, strides, 4)
        got = C.self_overlaps(shape, strides, 4)
        assert got or not brute, (shape, strides)
        overlapping += brute
        passed += not got
    assert overlapping > 300 and passed > 300  # both kinds were exercised


def test_self_overlap_refuses_a_rare_interleaving():
    """The documented limit: shape (3, 2) with element strides (2, 3) touches offsets 0, 3, 2, 5, 4, 7 (no
    collision) but is refused; no slice or transpose of a contiguous array looks like it."""
    assert not _brute_self_overlap((3, 2), (8, 12), 4)
    assert C.self_overlaps((3, 2), (8, 12), 4)


def test_require_no_self_overlap():
    x = np.zeros((4, 8), np.float32)
    for ok in (x, x.T, x[::-1, ::2], x[:, None, :]):
        C.require_no_self_overlap(ok, "out")
    for bad in (np.broadcast_to(x[0], (4, 8)), np.broadcast_to(x[:, :1], (4, 8)),
                np.lib.stride_tricks.as_strided(x, shape=(4, 8), strides=(16, 4))):
        with pytest.raises(ValueError, match=r"out has elements that share memory \(shape \(4, 8\)"):
            C.require_no_self_overlap(bad, "out")


# ---- integers -------------------------------------------------------------------------------------------------

def test_attention_scaling():
    assert C.attention_scaling(None, 64) == 0.125 and C.attention_scaling(None, 80) == 80 ** -0.5
    for given in (0.1, 2, np.float32(0.5), np.int64(3), 0.0, -0.25):  # zero and negative taken as given
        assert C.attention_scaling(given, 64) == float(given)
    for bad in (float("nan"), float("inf"), -math.inf, np.float32("nan"), 10**400):
        with pytest.raises(ValueError, match="scaling must be finite"):
            C.attention_scaling(bad, 64)
    for bad in ("0.125", True, np.bool_(False), [0.1], np.ones(1), 1j):
        with pytest.raises(TypeError, match="scaling must be a real number or None"):
            C.attention_scaling(bad, 64)
    # the kernels take scaling * log2(e) as float32: past its range the scale would be inf on the GPU
    for given in (2e38, -2e38, np.float32(2.3e38)):
        assert C.attention_scaling(given, 64) == float(given)
    for bad in (1e39, -1e39, 2.4e38, 10**300):
        with pytest.raises(ValueError, match="past float32's range"):
            C.attention_scaling(bad, 64)


def test_attention_backward_needs_grad_output(np_rng):
    """None for grad_output is refused by name before anything else (the forward alone has no grad_output)."""
    args = [np_rng.standard_normal(s).astype(np.float32) for s in ((9, 128), (384, 128), (384,), (128, 128),
                                                                    (128,), (9, 64), (9, 64))]
    with pytest.raises(TypeError, match=r"grad_output must be a cupy\.ndarray, got builtins\.NoneType"):
        cupy_rope.vision_attention_backward(None, *args, np.array([0, 9], np.int32))


def test_graph_handle_checks_its_head_dim():
    """Refused when the handle is made, not at its first call."""
    with pytest.raises(ValueError, match=r"head_dim must be one of \(64, 72, 80, 96, 128\), got 48"):
        cupy_rope.VisionAttentionBackward(np.array([0, 9], np.int32), hidden_size=96, head_dim=48)


def test_graph_handle_close_waits_for_the_last_call():
    """close() waits for the last call's end event before it gives back its recordings, outputs and kept tables
    (a direct call on another stream may still be reading the table), and forgets the event, which belongs to
    the GPU that call ran on. Built on the host with stand-ins for the event and a recording."""
    import collections
    import threading

    from cupy_rope.attention.graphs import VisionAttentionBackward

    log = []

    class End:
        def synchronize(self):
            log.append("waited")

    class Recording:
        def release(self):
            log.append("released")

    h = object.__new__(VisionAttentionBackward)
    h._lock, h._graphs = threading.Lock(), collections.OrderedDict(key=Recording())
    h._outs, h._tiles, h._last_key = ("outputs",), {(0, "table"): ["kept"]}, "key"
    h._end = h._own_end = End()
    h.close()
    assert log == ["waited", "released"]
    assert h._outs is None and not h._tiles and h._end is None and h._own_end is None and h._last_key is None


def test_graph_handle_checks_its_scaling():
    with pytest.raises(ValueError, match="scaling must be finite"):
        cupy_rope.VisionAttentionBackward(np.array([0, 9], np.int32), hidden_size=128, head_dim=64,
                                          scaling=float("nan"))


def test_require_int():
    for v in (3, np.int32(3), np.int64(3), np.uint8(3), np.intp(3)):
        got = C.require_int(v, "num_heads")
        assert got == 3 and type(got) is int
    for v in (2.9, 3.0, np.float32(3), "3", None, 3 + 0j, np.array(3)):
        with pytest.raises(TypeError, match=r"num_heads must be an integer, got"):
            C.require_int(v, "num_heads")
    for v in (True, False, np.bool_(True)):
        with pytest.raises(TypeError, match=r"num_heads must be an integer, got (bool|bool_)"):
            C.require_int(v, "num_heads")
    for v in (0, -2, np.int8(-1)):
        with pytest.raises(ValueError, match=r"num_heads must be at least 1, got"):
            C.require_int(v, "num_heads")
    assert C.require_int(0, "n", minimum=0) == 0
    assert C.require_int(-5, "n", minimum=None) == -5


# ---- size limits ------------------------------------------------------------------------------------------------

def test_token_limits_follow_from_int32():
    """MAX_TOKENS is the largest token count whose 32-padded row length fits an int32; MAX_HIDDEN the largest
    hidden size whose 3 * hidden does; MAX_HEADS CUDA's grid-y limit."""
    i32 = 2**31 - 1
    pad = lambda t: (t + 31) // 32 * 32  # noqa: E731 - the transposed operands' row length
    assert pad(C.MAX_TOKENS) <= i32 < pad(C.MAX_TOKENS + 1)
    assert 3 * C.MAX_HIDDEN <= i32 < 3 * (C.MAX_HIDDEN + 1)
    assert C.MAX_HEADS == 65535
    assert C.MAX_TOKENS == 2_147_483_616 and C.MAX_HIDDEN == 715_827_882


def test_check_token_limits():
    C.check_token_limits(0, 64)
    C.check_token_limits(C.MAX_TOKENS, C.MAX_HIDDEN, C.MAX_HEADS)
    C.check_token_limits(5_000_000, 3584, 28)  # past the old grid-y limits of transpose (4.19 M) and colsum (16.7 M)
    C.check_token_limits(20_000_000, 1280, 16)
    with pytest.raises(ValueError, match=r"2147483617 tokens is more than this library supports \(2,147,483,616"):
        C.check_token_limits(C.MAX_TOKENS + 1, 64)
    with pytest.raises(ValueError, match=r"hidden size 715827883 is more than this library supports"):
        C.check_token_limits(1, C.MAX_HIDDEN + 1)
    with pytest.raises(ValueError, match=r"65536 heads is more than this library supports \(65535"):
        C.check_token_limits(1, 65536 * 64, 65536)


# ---- the RoPE plan ----------------------------------------------------------------------------------------------

def test_rope_plan_values():
    assert [(p.path, p.vector, p.per_thread) for p in (RP.VEC2, RP.VEC8, RP.STRIDED)] == \
        [("vec2", True, 2), ("vec8", True, 8), ("strided", False, 1)]
    assert RP.RopePlan("vec8") == RP.VEC8 and hash(RP.RopePlan("vec8")) == hash(RP.VEC8)
    with pytest.raises(ValueError, match=r"RopePlan.path must be one of \('vec2', 'vec8', 'strided'\), got 'vec4'"):
        RP.RopePlan("vec4")
    import dataclasses

    with pytest.raises(dataclasses.FrozenInstanceError):
        RP.VEC2.path = "vec8"


def test_make_rope_plan():
    """2 elements per thread up to VEC2_MAX_ELEMENTS, 8 above; the strided kernel whenever an array is not
    C-contiguous and 16-byte aligned, or a vector grid would pass CUDA's 2^31 - 1 blocks."""
    m = RP.VEC2_MAX_ELEMENTS
    assert m == 1 << 23
    for n in (0, 1, 2, 7, 2048, m - 1, m):
        assert RP.make_rope_plan(n, vectorizable=True) is RP.VEC2
    for n in (m + 1, 64 * 8192 * 128, (2**31 - 1) * 2048):
        assert RP.make_rope_plan(n, vectorizable=True) is RP.VEC8
    assert RP.make_rope_plan((2**31 - 1) * 2048 + 1, vectorizable=True) is RP.STRIDED
    for n in (0, 1, m, m + 1, 1 << 40):
        assert RP.make_rope_plan(n, vectorizable=False) is RP.STRIDED


def test_resolve_rope_plan():
    chosen = RP.VEC2
    assert RP._resolve_plan(None, chosen, True, 100) is chosen
    assert RP._resolve_plan(RP.STRIDED, chosen, True, 100) is RP.STRIDED
    seen = []
    assert RP._resolve_plan(lambda p: seen.append(p) or RP.VEC8, chosen, True, 100) is RP.VEC8
    assert seen == [chosen]
    assert RP._resolve_plan(RP.STRIDED, RP.STRIDED, False, 100) is RP.STRIDED
    for forced in (RP.VEC2, RP.VEC8, lambda p: RP.VEC8):
        with pytest.raises(ValueError, match=r"needs every array C-contiguous and 16-byte aligned"):
            RP._resolve_plan(forced, RP.STRIDED, False, 100)
    with pytest.raises(ValueError, match=r"grid wider than 2\^31 - 1 blocks"):
        RP._resolve_plan(RP.VEC2, RP.VEC8, True, (2**31 - 1) * 512 + 1)
    for bad in ("vec2", 2, lambda p: "vec2", lambda p: None):
        with pytest.raises(TypeError, match="plan must be a RopePlan or a callable returning one"):
            RP._resolve_plan(bad, chosen, True, 100)


def test_rope_module_has_no_tuning_setter():
    """The plan replaces the module global the tests used to reassign: nothing in rope.py writes a global."""
    import inspect

    src = inspect.getsource(RP)
    assert "global " not in src


# ---- workloads and the benchmark's error measure ------------------------------------------------------

def test_even_cu_seqlens():
    for t, n in W.ATTN_CASES + [(10, 3), (5, 7)]:
        cu = W.even_cu_seqlens(t, n)
        lens = np.diff(cu)
        assert cu[0] == 0 and cu[-1] == t and len(cu) == n + 1
        assert lens.max() - lens.min() <= 1
        assert (lens[: t % n] == t // n + 1).all() and (lens[t % n:] == t // n).all()


def test_workload_lists():
    assert len(W.ROPE_CASES) == 16 and len(W.ATTN_CASES) == 16
    assert W.ATTN_HIDDEN == W.ATTN_HEADS * W.ATTN_HEAD_DIM
    lens = [t / n for t, n in W.ATTN_CASES]
    assert 100 < min(lens) and max(lens) <= 256


def test_rope_theta():
    th = W.rope_theta(2, 5)
    assert th.shape == (2, 5, 128) and th.dtype == np.float32
    s, i = 3, 70  # i mod 64 = 6
    assert th[1, s, i] == np.float32(s * 10000.0 ** (-2 * 6 / 128))
    assert (th[:, 0] == 0).all() and (th[0] == th[1]).all()
    assert abs(float(W.rope_theta(1, 8192)[0, -1, 0]) - 8191) < 1e-3


def test_rel_err():
    ref = np.array([3.0, 4.0])
    assert B.rel_err(ref, ref) == 0.0
    assert B.rel_err(np.array([3.0, 4.5]), ref) == pytest.approx(0.1)
    assert B.rel_err(np.array([np.nan, 4.0]), ref) == math.inf
    assert B.rel_err(np.array([np.inf, 4.0]), ref) == math.inf


def test_cli_without_gpu(capsys):
    if gpu_problem() is None:
        pytest.skip("a GPU is present: the CLI would run the benchmark instead of refusing")
    from cupy_rope import _gpu
    from cupy_rope.__main__ import main

    assert main(["bench", "rope"]) == 1
    err = capsys.readouterr().err  # one plain paragraph on stderr, the library's own diagnosis
    assert "no NVIDIA GPU" in err and _gpu.gpu_problem() in err


def test_attn_cases_spec():
    """Workloads named on a development script's command line: "all" or TxN lists; anything else refused."""
    assert W.attn_cases("all") == W.ATTN_CASES
    assert W.attn_cases("131x1,8192x32") == [(131, 1), (8192, 32)]
    for bad in ("131", "131x", "ax2", ""):
        with pytest.raises(ValueError, match="TxN"):
            W.attn_cases(bad)


# ==== vision attention (cupy_rope.attention): public validation and host-side pieces ===========================
# Kept apart from the generic checks above: these follow the attention package's internal layout.
from cupy_rope.attention import kernels as K  # noqa: E402
from cupy_rope.attention import plan as P  # noqa: E402
from cupy_rope.attention import varlen as V  # noqa: E402
from cupy_rope.precision import Precision  # noqa: E402


def _attn_numpy(np_rng, t=10, hidden=128, d=64):
    f = np.float32
    return [np_rng.standard_normal((t, hidden)).astype(f), np_rng.standard_normal((t, hidden)).astype(f),
            np_rng.standard_normal((3 * hidden, hidden)).astype(f), np_rng.standard_normal(3 * hidden).astype(f),
            np_rng.standard_normal((hidden, hidden)).astype(f), np_rng.standard_normal(hidden).astype(f),
            np_rng.standard_normal((t, d)).astype(f), np_rng.standard_normal((t, d)).astype(f),
            np.array([0, 4, t], np.int32)]


def test_attention_backward_refuses_numpy(np_rng):
    args = _attn_numpy(np_rng)
    with pytest.raises(TypeError, match=r"grad_output must be a cupy\.ndarray.*cupy\.asarray\(grad_output\)"):
        cupy_rope.vision_attention_backward(*args)


def test_attention_forward_refuses_numpy(np_rng):
    args = _attn_numpy(np_rng)[1:]
    with pytest.raises(TypeError, match=r"must be a cupy\.ndarray.*cupy\.asarray\("):
        cupy_rope.vision_attention_forward(*args)


def test_attention_forward_error_names_its_own_argument(np_rng):
    args = _attn_numpy(np_rng)[1:]
    with pytest.raises(TypeError, match=r"cupy\.asarray\(hidden_states\)"):
        cupy_rope.vision_attention_forward(*args)


def test_attention_refuses_unknown_precision(np_rng):
    with pytest.raises(ValueError, match=r"precision must be one of"):
        cupy_rope.vision_attention_backward(*_attn_numpy(np_rng), precision="fp16")


@pytest.mark.parametrize("p", [0.1, 1e-9])
def test_attention_refuses_dropout(p, np_rng):
    with pytest.raises(NotImplementedError, match="attention_dropout"):
        cupy_rope.vision_attention_backward(*_attn_numpy(np_rng), attention_dropout=p)


@pytest.mark.parametrize("p", [None, "0.0", False, np.bool_(False), np.array([0.0, 0.1]), [0.0]])
def test_attention_dropout_must_be_a_number(p, np_rng):
    with pytest.raises(TypeError, match=r"attention_dropout must be a real number \(0\.0\), got"):
        cupy_rope.vision_attention_backward(*_attn_numpy(np_rng), attention_dropout=p)


def test_attention_accepts_integer_zero_dropout_check_order(np_rng):
    # attention_dropout=0 (an int) is "no dropout": the call gets past that check to the array checks.
    with pytest.raises(TypeError, match="cupy.asarray"):
        cupy_rope.vision_attention_backward(*_attn_numpy(np_rng), attention_dropout=0)


def test_captured_upload_copies_from_the_buffer_it_keeps(monkeypatch):
    """Inside a capture a table's copy reads its pinned buffer at every replay, so the buffer kept for the
    process must be the one copied from, also when another thread's capture kept one for the same table between
    this call's lookup and its copy (simulated: the allocation lets the other thread win)."""
    import types

    import cupy

    class Pinned(bytearray):  # host bytes with an address, as CuPy's pinned memory
        @property
        def ptr(self):
            return id(self)

    table = np.arange(6, dtype=np.int32).reshape(2, 3)
    key = (table.dtype.str, table.shape, table.tobytes())
    other = Pinned(table.nbytes)
    copies = []

    def alloc(nbytes):  # this call's buffer; meanwhile another thread's capture keeps its own
        V._captured.setdefault(key, other)
        return Pinned(nbytes)

    monkeypatch.setattr(V, "_captured", {})
    monkeypatch.setattr(V, "_capturing", lambda stream: True)
    monkeypatch.setattr(cupy, "empty", lambda shape, dtype: types.SimpleNamespace(data=types.SimpleNamespace(ptr=0)))
    monkeypatch.setattr(cupy.cuda, "alloc_pinned_memory", alloc)
    from cupy_backends.cuda.api import runtime

    monkeypatch.setattr(runtime, "memcpyAsync", lambda dst, src, n, kind, stream: copies.append(src))
    V.upload(table, 0)
    assert V._captured == {key: other} and copies == [other.ptr], "the copy reads a buffer nobody keeps"
    V.upload(table, 0)  # the same table in a later capture: the kept buffer, no new one
    assert copies == [other.ptr, other.ptr]


def test_kept_tables_in_a_store_of_their_own(monkeypatch):
    """varlen.device_table with a caller's store (a graph handle's): kept there past the module's count, waited
    for on later streams until seen complete, and inside a capture used only once seen complete (else the
    capture's own copy, stored nowhere)."""
    import contextlib
    import types

    import cupy
    from cupy_backends.cuda.api import runtime

    uploads, waits = [], []

    class Event:
        done = False
        ptr = 7

        def __init__(self, **kwargs):
            pass

    def upload(table, stream):
        uploads.append(stream)
        return ("table", len(uploads))

    capturing = [False]
    monkeypatch.setattr(V, "upload", upload)
    monkeypatch.setattr(V, "_capturing", lambda stream: capturing[0])
    monkeypatch.setattr(V, "_device_tables", {i: None for i in range(V.DEVICE_TABLES_MAX)})  # the module's full
    monkeypatch.setattr(runtime, "getDevice", lambda: 0)
    monkeypatch.setattr(runtime, "eventRecord", lambda ev, stream: None)
    monkeypatch.setattr(runtime, "streamWaitEvent", lambda stream, ev, flags: waits.append(stream))
    monkeypatch.setattr(cupy.cuda, "Event", Event)
    monkeypatch.setattr(cupy.cuda, "using_allocator", lambda malloc: contextlib.nullcontext())
    monkeypatch.setattr(cupy, "get_default_memory_pool", lambda: types.SimpleNamespace(malloc=None))
    vl = V.Varlen(np.array([0, 3, 300], np.int32), 300)
    assert vl.device_table(1) == ("table", 1) and vl.device_table(1) == ("table", 2)  # module full: per call
    store = {}
    kept = vl.device_table(1, store)
    assert kept == ("table", 3) and list(store) == [(0, vl.key)]
    capturing[0] = True  # not seen complete: the capture's own copy, not stored
    assert vl.device_table(5, store) == ("table", 4) and len(store) == 1 and waits == []
    capturing[0] = False
    assert vl.device_table(2, store) is kept and waits == [2]  # upload not done: stream 2 waits for it
    Event.done = True
    assert vl.device_table(3, store) is kept and waits == [2] and store[(0, vl.key)][2]  # seen complete
    capturing[0] = True
    assert vl.device_table(5, store) is kept and len(uploads) == 4


def test_cu_seqlens_host_arrays():
    """Host cu_seqlens need no read-back; their values are checked when the call's Varlen is built, and the
    checked Varlen is kept for the same values (a copy: the caller's array may change afterwards)."""
    cu = np.array([0, 3, 5], np.int64)
    assert V.read_async(cu, 0) is cu  # host arrays need no read-back
    vl = V.resolve(cu, 5)
    assert vl.cu is not cu and np.array_equal(vl.cu, cu)
    assert V.resolve(cu.copy(), 5) is vl
    assert V.resolve(cu.astype(np.int32), 5) is not vl  # another dtype, another key
    cu[2] = 4
    assert np.array_equal(vl.cu, [0, 3, 5])
    with pytest.raises(ValueError, match="must end at the number of tokens 5"):
        V.resolve(cu, 5)
    with pytest.raises(ValueError, match="must end at the number of tokens 6"):
        V.resolve(np.array([0, 3, 5], np.int64), 6)


def test_kept_host_varlens_are_bounded():
    for i in range(V.HOST_CACHE + 10):
        assert V.resolve(np.array([0, i], np.int64), i).tokens == i
    assert len(V._host) <= V.HOST_CACHE


def _cu_cases(np_rng):
    rnd = np.concatenate([[0], np.cumsum(np_rng.integers(0, 300, 40))])
    tiny = np.concatenate([[0], np.cumsum(np_rng.integers(0, 5, 120))])
    return [np.asarray(W.even_cu_seqlens(8192, 32)), np.asarray(W.even_cu_seqlens(211, 2)),
            np.array([0, 0, 1, 6, 6, 70, 135, 262]), rnd, tiny, np.array([0, 16384]), np.array([0, 0, 0]),
            np.array([0, 64, 128, 129])]


def test_tile_table(np_rng):
    for cu in _cu_cases(np_rng):
        cu = cu.astype(np.int32)
        tab = V.tile_table(cu)
        assert tab.dtype == np.int32 and tab.ndim == 2 and tab.shape[1] == 3
        lens = np.diff(cu)
        assert tab.shape[0] == sum(-(-int(n) // V.TILE) for n in lens)
        seqs = {(int(a), int(b)) for a, b in zip(cu[:-1], cu[1:]) if b > a}
        covered = np.zeros(int(cu[-1]), np.int64)
        for r, a, b in tab:
            assert (a, b) in seqs, "a tile names a sequence that is not in cu_seqlens (or an empty one)"
            assert a <= r < b and (r - a) % V.TILE == 0
            covered[r:min(r + V.TILE, b)] += 1
        assert (covered == 1).all(), "every token must be in exactly one tile"
        tl = tab[:, 2] - tab[:, 1]
        assert (np.diff(tl) <= 0).all(), "tiles of longer sequences must come first"


def test_tile_table_no_tokens():
    assert V.tile_table(np.array([0, 0, 0], np.int32)).shape == (0, 3)


def test_shared_memory_fits_hopper():
    """Every attention kernel configuration asks for at most the 227 KiB of dynamic shared memory an
    sm_90 block can opt into."""
    for p in Precision:
        for d in K.HEAD_DIMS:
            for k in ("fwd_dq", "dkdv"):
                assert 0 < K.smem_bytes(K.KERNELS[k], p, d) <= 227 * 1024, (p, d, k)
            for spec in K.KERNELS.values():
                assert K.smem_bytes(spec, p, d) <= 227 * 1024, (p, d, spec.name)


def _dq_partials(precision, d, cu):
    """The dQ partial count of the plan the library makes for sequence boundaries ``cu``."""
    vl = V.Varlen(cu, int(cu[-1]))
    return P.make_plan(precision, head_dim=d, tokens=vl.tokens, max_tiles=vl.max_tiles).dq_partials


def test_dq_partials_choice():
    """fp32 takes dQ from per-key-tile partials only for head dims with blocked scores (a multiple of 16) and
    while every sequence spans at most DQ_PARTIAL_MAX_TILES tiles; the count is the longest sequence's tiles."""
    cu = lambda *lens: np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)  # noqa: E731
    assert P.DQ_PARTIAL_MAX_TILES == 2 and V.TILE == 128
    assert _dq_partials("fp32", 128, cu(1, 0, 128)) == 1
    assert _dq_partials("fp32", 128, cu(129, 5)) == 2
    assert _dq_partials("fp32", 80, cu(256, 256)) == 2
    assert _dq_partials("fp32", 128, cu(257, 3)) == 0  # three tiles: dQ added in key-tile order instead
    assert _dq_partials("fp32", 72, cu(64)) == 0  # no blocked scores at head dim 72
    assert _dq_partials("tf32", 128, cu(64)) == 0 and _dq_partials("bf16", 128, cu(64)) == 0
    assert _dq_partials("fp32", 128, cu(0, 0)) == 0  # no tokens at all: nothing to partial


def test_dq_ordered_choice():
    """Past DQ_PARTIAL_MAX_TILES tiles fp32 (blocked scores) adds the dK/dV kernel's dQ shares into one sum in
    key-tile order; no other precision, head dim or length does, and a plan cannot ask for both forms."""
    cu = lambda *lens: np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)  # noqa: E731

    def plan(precision, d, c):
        vl = V.Varlen(c, int(c[-1]))
        return P.make_plan(precision, head_dim=d, tokens=vl.tokens, max_tiles=vl.max_tiles)

    assert P.DQ_ORDERED
    assert plan("fp32", 128, cu(257, 3)).dq_ordered and plan("fp32", 64, cu(5000)).dq_ordered
    assert not plan("fp32", 128, cu(256, 3)).dq_ordered  # partials there
    assert not plan("fp32", 72, cu(5000)).dq_ordered  # no blocked scores at head dim 72
    assert not plan("tf32", 128, cu(5000)).dq_ordered and not plan("bf16", 128, cu(5000)).dq_ordered
    p = plan("fp32", 128, cu(257, 3))
    with pytest.raises(ValueError, match="dq_ordered"):
        dataclasses.replace(p, dq_partials=3)
    with pytest.raises(ValueError, match="dq_ordered"):
        dataclasses.replace(plan("tf32", 128, cu(257, 3)), dq_ordered=True)


# ---- the column-sum and transpose helpers refuse what their kernels cannot take, before any launch ----------

def _stand_in(shape, dtype=np.float32, ptr=0):
    """A device array's host-visible fields (the helpers read no more before they launch)."""
    from types import SimpleNamespace

    return SimpleNamespace(shape=tuple(shape), ndim=len(shape), dtype=np.dtype(dtype), data=SimpleNamespace(ptr=ptr))


@pytest.mark.parametrize("x, part, width", [
    (_stand_in((100, 96), np.float64), _stand_in((2, 96)), 128),  # not fp32
    (_stand_in((100, 96)), _stand_in((2, 96), np.float64), 128),
    (_stand_in((100, 94)), _stand_in((2, 94)), 128),  # columns not a multiple of 4
    (_stand_in((100, 96)), _stand_in((2, 96)), 126),  # width not a multiple of 4
    (_stand_in((100, 96)), _stand_in((2, 96)), 96),  # width below the rows
    (_stand_in((100, 96), ptr=8), _stand_in((2, 96)), 128),  # not 16-byte aligned
    (_stand_in((100, 96)), _stand_in((3, 96)), 128),  # partial rows are ceil(width / 64)
])
def test_transpose_colsum_refuses(x, part, width):
    from cupy_rope.attention import kernels as K

    with pytest.raises(ValueError, match="transpose_colsum"):
        K.transpose_colsum(x, part, 0, width)


@pytest.mark.parametrize("a, j", [
    (_stand_in((96, 128), np.float64), 100),  # not fp32
    (_stand_in((96,)), 100),  # not a matrix
    (_stand_in((64, 128)), 100),  # a row per column sum
    (_stand_in((96, 128)), 128),  # the column past the row
    (_stand_in((96, 128)), -1),
])
def test_colsum_finish_refuses_a_wrong_column(a, j):
    from cupy_rope.attention import kernels as K

    with pytest.raises(ValueError, match="colsum_finish"):
        K.colsum_finish(_stand_in((2, 96)), _stand_in((96,)), 0, column=(a, j))
