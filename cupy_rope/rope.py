"""2D RoPE position encoding (HunyuanImage-3): backward and forward, one fused launch each."""
from __future__ import annotations

import dataclasses

import numpy as np

from . import _checks as C
from ._kernels import MAXDIM, launcher

_SUFFIX = {C.F32: "f32", C.F16: "f16", C.BF16: "bf16"}
_BLOCK = 256
_ALIGN = 16
_GRID_X_MAX = 2**31 - 1  # CUDA's limit on gridDim.x
# Up to this many elements the backward runs 2 elements per thread (latency-bound sizes: more threads,
# less dependent work each); above it, 8 per thread with 16-byte accesses (bandwidth-bound sizes).
VEC2_MAX_ELEMENTS = 1 << 23
_PER_THREAD = {"vec2": 2, "vec8": 8, "strided": 1}


@dataclasses.dataclass(frozen=True)
class RopePlan:
    """How :func:`rope_2d_backward` runs one call: the kernel, and with it the whole launch configuration.

    ``path``: ``"vec2"`` (``rope_bwd_vec2``: 2 elements per thread, 8-byte accesses), ``"vec8"``
    (``rope_bwd_vec``: 8 per thread, 16-byte accesses) or ``"strided"`` (``rope_bwd_strided``: any strides,
    one element per thread in a grid-stride loop). The two vectorised paths need every array C-contiguous and
    16-byte aligned. All three compute the same bits for the same elements; they differ in speed only."""

    path: str

    def __post_init__(self):
        if self.path not in _PER_THREAD:
            raise ValueError(f"RopePlan.path must be one of {tuple(_PER_THREAD)}, got {self.path!r}")

    @property
    def vector(self) -> bool:
        return self.path != "strided"

    @property
    def per_thread(self) -> int:
        return _PER_THREAD[self.path]


VEC2, VEC8, STRIDED = RopePlan("vec2"), RopePlan("vec8"), RopePlan("strided")


def _grid_vec(n: int, per_thread: int = 8) -> int:
    return (n + per_thread * _BLOCK - 1) // (per_thread * _BLOCK)


def _grid_strided(n: int) -> int:
    return max(1, min((n + _BLOCK - 1) // _BLOCK, 132 * 32))


def make_rope_plan(n: int, *, vectorizable: bool) -> RopePlan:
    """The plan :func:`rope_2d_backward` chooses for ``n`` elements; ``vectorizable``: every array (inputs and
    output) C-contiguous and 16-byte aligned. Pure: the same arguments give the same plan.

    A vectorised grid wider than CUDA's 2^31 - 1 blocks (from 4.4e12 elements, 17 TB of fp32 output: past any
    GPU's memory) would take the strided path, whose grid is capped and whose indices are 64-bit."""
    if vectorizable:
        plan = VEC2 if n <= VEC2_MAX_ELEMENTS else VEC8
        if _grid_vec(n, plan.per_thread) <= _GRID_X_MAX:
            return plan
    return STRIDED


def _resolve_plan(plan, chosen: RopePlan, vectorizable: bool, n: int) -> RopePlan:
    """``plan`` as given to rope_2d_backward (None, a RopePlan, or a callable RopePlan -> RopePlan applied to
    ``chosen``), checked against the call before anything is launched."""
    if plan is None:
        return chosen
    if not isinstance(plan, RopePlan) and callable(plan):
        plan = plan(chosen)
    if not isinstance(plan, RopePlan):
        raise TypeError(f"plan must be a RopePlan or a callable returning one, got {type(plan).__name__}")
    if plan.vector:
        if not vectorizable:
            raise ValueError(f"plan path {plan.path!r} needs every array C-contiguous and 16-byte aligned, and "
                             "these are not; use RopePlan('strided')")
        if _grid_vec(n, plan.per_thread) > _GRID_X_MAX:
            raise ValueError(f"plan path {plan.path!r} cannot launch {n} elements (grid wider than 2^31 - 1 "
                             "blocks); use RopePlan('strided')")
    return plan


def _pad(xs):
    xs = list(xs)
    return tuple(xs + [1] * (MAXDIM - len(xs)))


def _vectorizable(arrays) -> bool:
    return all(a._c_contiguous and a.data.ptr % _ALIGN == 0 for a in arrays)


def _contiguous_strides(shape) -> list:
    """Element strides of a C-contiguous array of ``shape`` (the layout of a freshly allocated output)."""
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return out[::-1]


def _strided_layout(shape, stride_sets, what: str, fix: str):
    """(dims, strides per array) after merging contiguous dimensions; too many left is an error."""
    dims, strides = C.collapse_dims(shape, *stride_sets)
    if len(dims) > MAXDIM:
        raise ValueError(f"{what} need{'s' if len(stride_sets) == 1 else ''} {len(dims)} dimensions after merging "
                         f"contiguous ones; at most {MAXDIM} are supported ({fix})")
    return dims, strides


def _elem_strides(a) -> list:
    return [st // a.itemsize for st in a.strides]  # exact: require_aligned checked every stride


def rope_2d_backward(grad_cos, grad_sin, idx_theta, *, out=None, stream=None, plan=None):
    """Gradient of a loss with respect to ``idx_theta`` through ``cos(idx_theta)`` and ``sin(idx_theta)``.

    ``grad_idx_theta = -float(grad_cos) * sin(idx_theta) + float(grad_sin) * cos(idx_theta)``, computed in
    fp32 with accurate sin/cos, in one launch.

    Args:
        grad_cos, grad_sin: CuPy arrays of one shape ``[..., D]``, dtype bfloat16 (``ml_dtypes.bfloat16``),
            float16 or float32 (both the same dtype).
        idx_theta: float32 CuPy array of the same shape.
        out: optional float32 array of that shape to write into; must not overlap any input, and no two of
            its elements may share memory (no broadcast views).
        stream: a ``cupy.cuda.Stream``; default the current stream.
        plan: the kernel to run (for tests and measurements): a :class:`RopePlan`, or a callable given the
            plan the library would choose (see :func:`make_rope_plan`) and returning the one to use.
            Default: the library's choice.

    Returns:
        float32 CuPy array ``grad_idx_theta`` (``out`` if given). Any strides are accepted, as long as every
        element is aligned to its size (a view into a byte buffer at an odd offset is refused) and the views
        have at most 6 dimensions once the dimensions contiguous in all of them are merged; C-contiguous,
        16-byte aligned arrays take a vectorised kernel.
    """
    C.require_one_device(dict(grad_cos=grad_cos, grad_sin=grad_sin, idx_theta=idx_theta, out=out))
    dev = C.require_cupy_all(grad_cos=grad_cos, grad_sin=grad_sin, idx_theta=idx_theta)
    C.require_dtype(grad_cos, "grad_cos", (C.BF16, C.F16, C.F32))
    if grad_sin.dtype != grad_cos.dtype:
        raise TypeError(f"grad_sin must have the dtype of grad_cos ({C.dtype_name(grad_cos.dtype)}), "
                        f"got {C.dtype_name(grad_sin.dtype)}")
    C.require_dtype(idx_theta, "idx_theta", (C.F32,))
    shape = grad_cos.shape
    C.require_shape(grad_sin, "grad_sin", shape, " (the shape of grad_cos)")
    C.require_shape(idx_theta, "idx_theta", shape, " (the shape of grad_cos)")
    C.require_aligned(grad_cos, "grad_cos", grad_cos.itemsize)
    C.require_aligned(grad_sin, "grad_sin", grad_sin.itemsize)
    C.require_aligned(idx_theta, "idx_theta", 4)
    inputs = (grad_cos, grad_sin, idx_theta)
    if out is not None:
        C.require_cupy(out, "out", dev)
        C.require_dtype(out, "out", (C.F32,))
        C.require_shape(out, "out", shape, " (the shape of grad_cos)")
        C.require_aligned(out, "out", 4)
        C.require_no_self_overlap(out, "out")
        C.require_no_overlap(out, "out", {"grad_cos": grad_cos, "grad_sin": grad_sin, "idx_theta": idx_theta})
    n = grad_cos.size
    # A fresh out is C-contiguous and 16-byte aligned (CuPy's pool hands out 512-byte aligned blocks).
    vectorizable = _vectorizable(inputs if out is None else inputs + (out,))
    p = _resolve_plan(plan, make_rope_plan(n, vectorizable=vectorizable), vectorizable, n)
    layout = None
    if not p.vector and n:
        strides = [_elem_strides(a) for a in inputs]
        strides.append(_contiguous_strides(shape) if out is None else _elem_strides(out))
        layout = _strided_layout(shape, strides, "rope_2d_backward: these strided views", "pass contiguous arrays")
    ctx, s = C.on_stream(stream)
    with ctx:
        if out is None:
            out = C.cupy_module().empty(shape, dtype=np.float32)
        if n:
            _launch_backward(p, layout, grad_cos, grad_sin, idx_theta, out, s, dev)
    return out


def _launch_backward(p: RopePlan, layout, grad_cos, grad_sin, idx_theta, out, s: int, dev: int) -> None:
    n = out.size
    suf = _SUFFIX[grad_cos.dtype]
    if p.vector:
        if p.path == "vec2":
            lau = launcher("rope", "rope_bwd_vec2_" + suf, "ppppq", device=dev)
        else:
            lau = launcher("rope", "rope_bwd_vec_" + suf, "ppppq", device=dev)
        lau((_grid_vec(n, p.per_thread), 1, 1), (_BLOCK, 1, 1),
            (grad_cos.data.ptr, grad_sin.data.ptr, idx_theta.data.ptr, out.data.ptr, n), s)
        return
    dims, strides = layout
    launcher("rope", "rope_bwd_strided_" + suf, "ppppqiSSSSS", device=dev)(
        (_grid_strided(n), 1, 1), (_BLOCK, 1, 1),
        (grad_cos.data.ptr, grad_sin.data.ptr, idx_theta.data.ptr, out.data.ptr, n, len(dims), _pad(dims),
         *[_pad(st) for st in strides]), s)


def rope_2d_forward(idx_theta, *, dtype=C.BF16, stream=None):
    """``(cos(idx_theta), sin(idx_theta))`` in one launch, stored as ``dtype`` (bfloat16 by default,
    float16 or float32); the forward that :func:`rope_2d_backward` differentiates. ``idx_theta``: a float32 CuPy
    array, strided as for :func:`rope_2d_backward`; ``stream``: a ``cupy.cuda.Stream``, default the current
    stream."""
    import cupy

    C.require_cupy(idx_theta, "idx_theta")
    C.require_dtype(idx_theta, "idx_theta", (C.F32,))
    if dtype is None:  # np.dtype(None) would read it as float64
        raise TypeError("dtype must be bfloat16, float16 or float32, got None")
    try:
        dt = np.dtype(dtype)
    except (TypeError, ValueError) as e:  # e.g. "x", or an object that is no dtype
        raise TypeError(f"dtype must be bfloat16, float16 or float32, got {dtype!r} ({e})") from None
    if dt not in _SUFFIX:
        raise TypeError(f"dtype must be bfloat16, float16 or float32, got {C.dtype_name(dt)}")
    C.require_aligned(idx_theta, "idx_theta", 4)
    n = idx_theta.size
    # cos and sin are fresh (C-contiguous, aligned): the vectorised kernel whenever idx_theta allows it.
    vector = _vectorizable((idx_theta,)) and _grid_vec(n) <= _GRID_X_MAX
    layout = None
    if not vector and n:
        dims, (st,) = _strided_layout(idx_theta.shape, [_elem_strides(idx_theta)], "rope_2d_forward: idx_theta",
                                      "pass a contiguous array")
        layout = dims, st
    ctx, s = C.on_stream(stream)
    with ctx:
        cos = cupy.empty(idx_theta.shape, dtype=dt)
        sin = cupy.empty(idx_theta.shape, dtype=dt)
        if n:
            _launch_forward(layout, idx_theta, cos, sin, s)
    return cos, sin


def _launch_forward(layout, idx_theta, cos, sin, s: int) -> None:
    n = cos.size
    suf = _SUFFIX[cos.dtype]
    if layout is None:
        launcher("rope", "rope_fwd_vec_" + suf, "pppq")(
            (_grid_vec(n), 1, 1), (_BLOCK, 1, 1), (idx_theta.data.ptr, cos.data.ptr, sin.data.ptr, n), s)
        return
    dims, st = layout
    launcher("rope", "rope_fwd_strided_" + suf, "pppqiSS")(
        (_grid_strided(n), 1, 1), (_BLOCK, 1, 1),
        (idx_theta.data.ptr, cos.data.ptr, sin.data.ptr, n, len(dims), _pad(dims), _pad(st)), s)
