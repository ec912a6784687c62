"""Input validation shared by the ops. Everything here runs on the host, before any launch."""
from __future__ import annotations

import contextlib

import numpy as np

try:
    import ml_dtypes

    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a dependency
    BF16 = None

_cupy = None


def cupy_module():
    """The cupy module, imported on first use (this module must import on machines without CUDA)."""
    global _cupy
    if _cupy is None:
        import cupy as module

        _cupy = module
    return _cupy


F32 = np.dtype(np.float32)
F16 = np.dtype(np.float16)


def dtype_name(dt) -> str:
    dt = np.dtype(dt)
    return "bfloat16" if dt == BF16 else dt.name


def require_cupy(x, name: str, dev: int | None = None) -> int:
    """``x`` must be a ``cupy.ndarray`` on the current device (``dev``, looked up if not given); returns it."""
    cupy = _cupy or cupy_module()
    if not isinstance(x, cupy.ndarray):
        kind = type(x).__module__.split(".")[0] + "." + type(x).__name__
        hint = f"; move it to the GPU first with cupy.asarray({name})" if isinstance(x, np.ndarray) else ""
        raise TypeError(f"{name} must be a cupy.ndarray, got {kind}{hint}")
    if dev is None:
        dev = cupy.cuda.runtime.getDevice()
    if x.data.device_id != dev:
        raise ValueError(f"{name} lives on GPU {x.data.device_id} but the current device is GPU {dev}; "
                         f"call inside `with cupy.cuda.Device({x.data.device_id}):`")
    return dev


def require_cupy_all(**arrays) -> int:
    """Every keyword argument must be a ``cupy.ndarray`` on the current device; returns the device id."""
    cupy = _cupy or cupy_module()
    for name, x in arrays.items():  # types first: this part needs no device
        if not isinstance(x, cupy.ndarray):
            require_cupy(x, name)  # raises with the full message
    dev = cupy.cuda.runtime.getDevice()
    for name, x in arrays.items():
        if x.data.device_id != dev:
            require_cupy(x, name, dev)
    return dev


def require_dtype(x, name: str, allowed) -> None:
    if x.dtype in allowed:  # the passing path: no conversions
        return
    allowed = [np.dtype(a) for a in allowed]
    if x.dtype not in allowed:
        raise TypeError(f"{name} must have dtype {' or '.join(dtype_name(a) for a in allowed)}, "
                        f"got {dtype_name(x.dtype)}")


def require_shape(x, name: str, shape: tuple, what: str = "") -> None:
    if x.shape != shape and tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}{what}, got {tuple(x.shape)}")


def require_contiguous(x, name: str) -> None:
    if not x.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (got strides {x.strides}); pass cupy.ascontiguousarray({name})")


def byte_extent(ptr: int, shape, strides, itemsize: int) -> tuple[int, int]:
    """Half-open byte range [lo, hi) touched by an array view (empty views touch nothing)."""
    if any(s == 0 for s in shape):
        return ptr, ptr
    lo = hi = ptr
    for n, st in zip(shape, strides):
        if st >= 0:
            hi += (n - 1) * st
        else:
            lo += (n - 1) * st
    return lo, hi + itemsize


def ranges_overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1] and a[0] < a[1] and b[0] < b[1]


def extent(x) -> tuple[int, int]:
    if x._c_contiguous:  # fast path: one block of nbytes
        p = x.data.ptr
        return p, p + x.nbytes
    return byte_extent(x.data.ptr, x.shape, x.strides, x.itemsize)


def require_no_overlap(out, out_name: str, inputs: dict) -> None:
    """``out`` must share no memory with any input (a conservative check on the byte ranges)."""
    eo = extent(out)
    for name, x in inputs.items():
        if ranges_overlap(eo, extent(x)):
            raise ValueError(f"{out_name} overlaps the memory of input {name}; the op reads its inputs while "
                             f"writing {out_name}, so pass a separate array")


_NULL_CONTEXT = contextlib.nullcontext()


def on_stream(stream):
    """(context manager, raw stream pointer) for running an op on ``stream`` (default: the current stream).

    Allocations made inside the context belong to that stream in CuPy's memory pool, so temporaries freed
    by the op are never handed to another stream while the op's kernels may still use them."""
    cupy = _cupy or cupy_module()
    if stream is None:
        return _NULL_CONTEXT, cupy.cuda.get_current_stream().ptr
    if isinstance(stream, cupy.cuda.Stream):
        return stream, stream.ptr
    raise TypeError(f"stream must be a cupy.cuda.Stream or None, got {type(stream).__name__}")


def collapse_dims(shape, *stride_sets):
    """Merge adjacent dimensions that are contiguous in every array; drop size-1 dimensions.

    Returns (shape, [strides per array]) in elements; an empty shape means a single element."""
    dims = [(n, [s[i] for s in stride_sets]) for i, n in enumerate(shape) if n != 1]
    out: list = []
    for n, st in dims:
        if out:
            pn, pst = out[-1]
            if all(ps == s * n for ps, s in zip(pst, st)):
                out[-1] = (pn * n, st)
                continue
        out.append((n, st))
    return [n for n, _ in out], [[st[k] for _, st in out] for k in range(len(stride_sets))]


def check_cu_seqlens_form(cu) -> None:
    """The form of cu_seqlens, no values read: a NumPy array, or a contiguous CuPy array on the current device;
    1-D, at least 2 entries, integer."""
    if not isinstance(cu, np.ndarray):
        cupy = _cupy or cupy_module()
        if not isinstance(cu, cupy.ndarray):
            raise TypeError(f"cu_seqlens must be a cupy or numpy integer array, got {type(cu).__name__}")
        require_cupy(cu, "cu_seqlens")
        if not cu.flags.c_contiguous:
            raise ValueError("cu_seqlens must be contiguous; pass cupy.ascontiguousarray(cu_seqlens)")
    if cu.ndim != 1 or cu.shape[0] < 2:
        raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries (N+1 for N sequences), got shape {cu.shape}")
    if cu.dtype.kind not in "iu":
        raise TypeError(f"cu_seqlens must be an integer array (int32 or int64), got {cu.dtype.name}")


def check_cu_seqlens(cu: np.ndarray, total: int) -> None:
    """Validate cu_seqlens on the host: 1-D integer, starts at 0, non-decreasing, ends at ``total``."""
    check_cu_seqlens_form(cu)
    if int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {int(cu[0])}")
    d = np.diff(cu.astype(np.int64))
    if (d < 0).any():
        i = int(np.argmax(d < 0))
        raise ValueError(f"cu_seqlens must be non-decreasing; cu_seqlens[{i + 1}] = {int(cu[i + 1])} "
                         f"< cu_seqlens[{i}] = {int(cu[i])}")
    if int(cu[-1]) != total:
        raise ValueError(f"cu_seqlens must end at the number of tokens {total}, got {int(cu[-1])}")
