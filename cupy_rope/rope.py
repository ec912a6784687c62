"""2D RoPE position encoding (HunyuanImage-3): backward and forward, one fused launch each."""
from __future__ import annotations

import numpy as np

from . import _checks as C
from ._kernels import MAXDIM, launcher

_SUFFIX = {C.F32: "f32", C.F16: "f16", C.BF16: "bf16"}
_BLOCK = 256
_ALIGN = 16
# Up to this many elements the backward runs 2 elements per thread (latency-bound sizes: more threads,
# less dependent work each); above it, 8 per thread with 16-byte accesses (bandwidth-bound sizes).
VEC2_MAX_ELEMENTS = 1 << 23


def _grid_vec(n: int, per_thread: int = 8) -> int:
    return (n + per_thread * _BLOCK - 1) // (per_thread * _BLOCK)


def _grid_strided(n: int) -> int:
    return max(1, min((n + _BLOCK - 1) // _BLOCK, 132 * 32))


def _pad(xs):
    xs = list(xs)
    return tuple(xs + [1] * (MAXDIM - len(xs)))


def _vector_ok(*arrays) -> bool:
    return all(a._c_contiguous and a.data.ptr % _ALIGN == 0 for a in arrays)


def rope_2d_backward(grad_cos, grad_sin, idx_theta, *, out=None, stream=None):
    """Gradient of a loss with respect to ``idx_theta`` through ``cos(idx_theta)`` and ``sin(idx_theta)``.

    ``grad_idx_theta = -float(grad_cos) * sin(idx_theta) + float(grad_sin) * cos(idx_theta)``, computed in
    fp32 with accurate sin/cos, in one launch.

    Args:
        grad_cos, grad_sin: CuPy arrays of one shape ``[..., D]``, dtype bfloat16 (``ml_dtypes.bfloat16``),
            float16 or float32 (both the same dtype).
        idx_theta: float32 CuPy array of the same shape.
        out: optional float32 array of that shape to write into; must not overlap any input.
        stream: a ``cupy.cuda.Stream``; default the current stream.

    Returns:
        float32 CuPy array ``grad_idx_theta`` (``out`` if given). Any strides are accepted; C-contiguous,
        16-byte aligned arrays take the vectorised path.
    """
    dev = C.require_cupy_all(grad_cos=grad_cos, grad_sin=grad_sin, idx_theta=idx_theta)
    C.require_dtype(grad_cos, "grad_cos", (C.BF16, C.F16, C.F32))
    if grad_sin.dtype != grad_cos.dtype:
        raise TypeError(f"grad_sin must have the dtype of grad_cos ({C.dtype_name(grad_cos.dtype)}), "
                        f"got {C.dtype_name(grad_sin.dtype)}")
    C.require_dtype(idx_theta, "idx_theta", (C.F32,))
    shape = grad_cos.shape
    C.require_shape(grad_sin, "grad_sin", shape, " (the shape of grad_cos)")
    C.require_shape(idx_theta, "idx_theta", shape, " (the shape of grad_cos)")
    if out is not None:
        C.require_cupy(out, "out", dev)
        C.require_dtype(out, "out", (C.F32,))
        C.require_shape(out, "out", shape, " (the shape of grad_cos)")
        C.require_no_overlap(out, "out", {"grad_cos": grad_cos, "grad_sin": grad_sin, "idx_theta": idx_theta})
    ctx, s = C.on_stream(stream)
    with ctx:
        if out is None:
            out = C.cupy_module().empty(shape, dtype=np.float32)
        _launch_backward(grad_cos, grad_sin, idx_theta, out, s, dev)
    return out


def _launch_backward(grad_cos, grad_sin, idx_theta, out, s: int, dev: int) -> None:
    n = out.size
    if n == 0:
        return
    suf = _SUFFIX[grad_cos.dtype]
    if _vector_ok(grad_cos, grad_sin, idx_theta, out):
        if n <= VEC2_MAX_ELEMENTS:
            lau, per_thread = launcher("rope", "rope_bwd_vec2_" + suf, "ppppq", device=dev), 2
        else:
            lau, per_thread = launcher("rope", "rope_bwd_vec_" + suf, "ppppq", device=dev), 8
        lau((_grid_vec(n, per_thread), 1, 1), (_BLOCK, 1, 1),
            (grad_cos.data.ptr, grad_sin.data.ptr, idx_theta.data.ptr, out.data.ptr, n), s)
        return
    arrays = (grad_cos, grad_sin, idx_theta, out)
    dims, strides = C.collapse_dims(grad_cos.shape, *[[st // a.itemsize for st in a.strides] for a in arrays])
    if len(dims) > MAXDIM:
        raise ValueError(f"rope_2d_backward: these strided views need {len(dims)} dimensions after merging "
                         f"contiguous ones; at most {MAXDIM} are supported (pass contiguous arrays)")
    launcher("rope", "rope_bwd_strided_" + suf, "ppppqiSSSSS", device=dev)(
        (_grid_strided(n), 1, 1), (_BLOCK, 1, 1),
        (*[a.data.ptr for a in arrays], n, len(dims), _pad(dims), *[_pad(st) for st in strides]), s)


def rope_2d_forward(idx_theta, *, dtype=C.BF16, stream=None):
    """``(cos(idx_theta), sin(idx_theta))`` in one launch, stored as ``dtype`` (bfloat16 by default,
    float16 or float32); the forward that :func:`rope_2d_backward` differentiates."""
    import cupy

    C.require_cupy(idx_theta, "idx_theta")
    C.require_dtype(idx_theta, "idx_theta", (C.F32,))
    dt = np.dtype(dtype)
    if dt not in _SUFFIX:
        raise TypeError(f"dtype must be bfloat16, float16 or float32, got {C.dtype_name(dt)}")
    ctx, s = C.on_stream(stream)
    with ctx:
        cos = cupy.empty(idx_theta.shape, dtype=dt)
        sin = cupy.empty(idx_theta.shape, dtype=dt)
        _launch_forward(idx_theta, cos, sin, s)
    return cos, sin


def _launch_forward(idx_theta, cos, sin, s: int) -> None:
    n = cos.size
    if n == 0:
        return
    suf = _SUFFIX[cos.dtype]
    if _vector_ok(idx_theta, cos, sin):
        launcher("rope", "rope_fwd_vec_" + suf, "pppq")(
            (_grid_vec(n), 1, 1), (_BLOCK, 1, 1), (idx_theta.data.ptr, cos.data.ptr, sin.data.ptr, n), s)
        return
    dims, (st,) = C.collapse_dims(idx_theta.shape, [x // 4 for x in idx_theta.strides])
    if len(dims) > MAXDIM:
        raise ValueError(f"rope_2d_forward: idx_theta needs {len(dims)} dimensions after merging contiguous "
                         f"ones; at most {MAXDIM} are supported (pass a contiguous array)")
    launcher("rope", "rope_fwd_strided_" + suf, "pppqiSS")(
        (_grid_strided(n), 1, 1), (_BLOCK, 1, 1),
        (idx_theta.data.ptr, cos.data.ptr, sin.data.ptr, n, len(dims), _pad(dims), _pad(st)), s)
