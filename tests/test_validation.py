"""Host-side validation and pure helpers, tested without a GPU (CuPy imports on a CPU machine; nothing here
touches a device)."""
from __future__ import annotations

import itertools
import math

import ml_dtypes
import numpy as np
import pytest

import cupy_rope
from cupy_rope import _bench as B
from cupy_rope import _checks as C
from cupy_rope import attention as A
from cupy_rope import workloads as W

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


def test_attention_accepts_integer_zero_dropout_check_order(np_rng):
    # attention_dropout=0 (an int) is "no dropout": the call gets past that check to the array checks.
    with pytest.raises(TypeError, match="cupy.asarray"):
        cupy_rope.vision_attention_backward(*_attn_numpy(np_rng), attention_dropout=0)


def test_on_stream_refuses_other_objects():
    with pytest.raises(TypeError, match="stream must be a cupy.cuda.Stream"):
        C.on_stream(7)


def test_cu_seqlens_form_refuses_lists():
    with pytest.raises(TypeError, match="cu_seqlens must be a cupy or numpy integer array"):
        C.check_cu_seqlens_form([0, 3])
    with pytest.raises(TypeError, match="integer"):
        C.check_cu_seqlens_form(np.array([0.0, 3.0]))
    with pytest.raises(ValueError, match="1-D"):
        C.check_cu_seqlens_form(np.array([[0, 3]], np.int32))
    cu = np.array([0, 3, 5], np.int64)
    C.check_cu_seqlens_form(cu)
    assert A._cu_seqlens_read(cu, 0) is cu  # host arrays need no read-back
    assert A._cu_seqlens_host(cu, 5) is cu
    with pytest.raises(ValueError, match="must end at the number of tokens 6"):
        A._cu_seqlens_host(cu, 6)


# ---- dtype / shape / layout helpers ------------------------------------------------------------------

def test_require_dtype():
    C.require_dtype(np.zeros(2, BF16), "x", (C.BF16, C.F16))
    with pytest.raises(TypeError, match=r"x must have dtype bfloat16 or float16, got float32"):
        C.require_dtype(np.zeros(2, np.float32), "x", (C.BF16, C.F16))
    assert C.dtype_name(BF16) == "bfloat16" and C.dtype_name(np.float16) == "float16"


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

@pytest.mark.parametrize("cu,total", [([0, 3, 7], 7), ([0, 0, 5, 5, 9], 9), ([0, 0], 0), ([0, 12], 12)])
@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint32])
def test_cu_seqlens_valid(cu, total, dtype):
    C.check_cu_seqlens(np.asarray(cu, dtype), total)


@pytest.mark.parametrize("cu,total,match", [
    ([1, 3, 7], 7, "must start at 0, got 1"),
    ([0, 5, 3, 7], 7, r"non-decreasing; cu_seqlens\[2\] = 3 < cu_seqlens\[1\] = 5"),
    ([0, 3, 6], 7, "must end at the number of tokens 7, got 6"),
    ([0, 3, 8], 7, "must end at the number of tokens 7, got 8"),
    ([0], 0, "at least 2 entries"),
    ([[0, 3], [3, 7]], 7, "1-D"),
])
def test_cu_seqlens_invalid(cu, total, match):
    with pytest.raises(ValueError, match=match):
        C.check_cu_seqlens(np.asarray(cu, np.int32), total)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.bool_])
def test_cu_seqlens_must_be_integer(dtype):
    with pytest.raises(TypeError, match="integer array"):
        C.check_cu_seqlens(np.asarray([0, 3, 7]).astype(dtype), 7)


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


# ---- attention tile table ----------------------------------------------------------------------------

def _cu_cases(np_rng):
    rnd = np.concatenate([[0], np.cumsum(np_rng.integers(0, 300, 40))])
    tiny = np.concatenate([[0], np.cumsum(np_rng.integers(0, 5, 120))])
    return [np.asarray(W.even_cu_seqlens(8192, 32)), np.asarray(W.even_cu_seqlens(211, 2)),
            np.array([0, 0, 1, 6, 6, 70, 135, 262]), rnd, tiny, np.array([0, 16384]), np.array([0, 0, 0]),
            np.array([0, 64, 128, 129])]


def test_tile_table(np_rng):
    for cu in _cu_cases(np_rng):
        cu = cu.astype(np.int32)
        tab = A._tile_table(cu)
        assert tab.dtype == np.int32 and tab.ndim == 2 and tab.shape[1] == 3
        lens = np.diff(cu)
        assert tab.shape[0] == sum(-(-int(n) // A.TILE) for n in lens)
        seqs = {(int(a), int(b)) for a, b in zip(cu[:-1], cu[1:]) if b > a}
        covered = np.zeros(int(cu[-1]), np.int64)
        for r, a, b in tab:
            assert (a, b) in seqs, "a tile names a sequence that is not in cu_seqlens (or an empty one)"
            assert a <= r < b and (r - a) % A.TILE == 0
            covered[r:min(r + A.TILE, b)] += 1
        assert (covered == 1).all(), "every token must be in exactly one tile"
        tl = tab[:, 2] - tab[:, 1]
        assert (np.diff(tl) <= 0).all(), "tiles of longer sequences must come first"


def test_tile_table_no_tokens():
    assert A._tile_table(np.array([0, 0, 0], np.int32)).shape == (0, 3)


def test_shared_memory_fits_hopper():
    """Every attention kernel configuration asks for at most the 227 KiB of dynamic shared memory an
    sm_90 block can opt into."""
    for p in ("fp32", "tf32", "bf16"):
        for d in A.HEAD_DIMS:
            for k in ("fwd_dq", "dkdv"):
                assert 0 < A._smem_bytes(p, d, k) <= 227 * 1024, (p, d, k)


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
    from conftest import gpu_problem

    if gpu_problem() is None:
        pytest.skip("a GPU is present: the CLI would run the benchmark instead of refusing")
    from cupy_rope.__main__ import main

    assert main(["bench", "rope"]) == 1
    assert "no usable CUDA GPU" in capsys.readouterr().out


def test_dq_partials_choice():
    """fp32 takes dQ from per-key-tile partials only for head dims with blocked scores (a multiple of 16) and
    while every sequence spans at most DQ_PARTIAL_MAX_TILES tiles; the count is the longest sequence's tiles."""
    cu = lambda *lens: np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)  # noqa: E731
    assert A.DQ_PARTIAL_MAX_TILES == 2 and A.TILE == 128
    assert A._dq_partials("fp32", 128, cu(1, 0, 128)) == 1
    assert A._dq_partials("fp32", 128, cu(129, 5)) == 2
    assert A._dq_partials("fp32", 80, cu(256, 256)) == 2
    assert A._dq_partials("fp32", 128, cu(257, 3)) == 0  # three tiles: dQ from the forward kernel
    assert A._dq_partials("fp32", 72, cu(64)) == 0  # no blocked scores at head dim 72
    assert A._dq_partials("tf32", 128, cu(64)) == 0 and A._dq_partials("bf16", 128, cu(64)) == 0
    assert A._dq_partials("fp32", 128, cu(0, 0)) == 0  # no tokens at all: nothing to partial


def test_attn_cases_spec():
    """Workloads named on a development script's command line: "all" or TxN lists; anything else refused."""
    assert W.attn_cases("all") == W.ATTN_CASES
    assert W.attn_cases("131x1,8192x32") == [(131, 1), (8192, 32)]
    for bad in ("131", "131x", "ax2", ""):
        with pytest.raises(ValueError, match="TxN"):
            W.attn_cases(bad)
