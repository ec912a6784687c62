"""Input validation shared by the ops. Everything here runs on the host, before any launch."""
from __future__ import annotations

import contextlib
import math

import numpy as np

import ml_dtypes

BF16 = np.dtype(ml_dtypes.bfloat16)

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
FLOAT32_MAX = float(np.finfo(np.float32).max)
LOG2E = 1.4426950408889634  # the kernels' softmax runs in base 2: they take scaling * log2(e)


def dtype_name(dt) -> str:
    """``dt``'s name in messages; with its byte order where that is not the machine's (">f4" is no float32)."""
    dt = np.dtype(dt)
    if dt == BF16:
        return "bfloat16"
    return dt.name if dt.isnative else f"{dt.name} ({dt.str}, not in this machine's byte order)"


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
    """Every keyword argument must be a ``cupy.ndarray`` on the current device; returns the device id. (Arrays on
    two GPUs: :func:`require_one_device` first, which names both.)"""
    cupy = _cupy or cupy_module()
    for name, x in arrays.items():  # types first: this part needs no device
        if not isinstance(x, cupy.ndarray):
            require_cupy(x, name)  # raises with the full message
    dev = cupy.cuda.runtime.getDevice()
    for name, x in arrays.items():
        if x.data.device_id != dev:
            require_cupy(x, name, dev)
    return dev


def require_one_device(arrays: dict) -> None:
    """The CuPy arrays among ``arrays`` (name -> array) must all live on one GPU."""
    cupy = _cupy or cupy_module()
    first = None
    for name, x in arrays.items():
        if not isinstance(x, cupy.ndarray):  # other types are refused by the checks of each argument
            continue
        dev = x.data.device_id
        if first is None:
            first = (name, dev)
        elif dev != first[1]:
            raise ValueError(f"{first[0]} is on GPU {first[1]} but {name} on GPU {dev}; every array of a call "
                             "must be on one GPU")


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


def data_ptr(x) -> int:
    """Address of the first element of a CuPy (or, for host-side tests of these checks, NumPy) array."""
    if isinstance(x, np.ndarray):
        return x.__array_interface__["data"][0]
    return x.data.ptr


def _c_contiguous(x) -> bool:
    flag = getattr(x, "_c_contiguous", None)  # CuPy's cheap attribute; NumPy has only flags
    return x.flags.c_contiguous if flag is None else flag


def require_aligned(x, name: str, nbytes: int) -> None:
    """Every element of ``x`` must start at an address that is a multiple of ``nbytes`` (its element size).

    A view such as ``buf[1:].view(float32)`` of a byte buffer starts mid-element: a kernel reading it faults
    with a misaligned address, and that error is sticky (it ends the CUDA context), so it is refused here.
    Checked: the first element's address and, unless ``x`` is C-contiguous with an itemsize that is a multiple
    of ``nbytes``, every stride of a dimension longer than 1. Empty arrays are never read: accepted."""
    if x.size == 0:
        return
    off = data_ptr(x) % nbytes
    if off:
        raise ValueError(f"{name} must be aligned to {nbytes} bytes (its element size); its data starts "
                         f"{off} byte(s) past a multiple of {nbytes} (a view into a buffer of another dtype?); "
                         f"pass a copy ({name}.copy())")
    if _c_contiguous(x) and x.itemsize % nbytes == 0:
        return
    bad = [st for n, st in zip(x.shape, x.strides) if n > 1 and st % nbytes]
    if bad:
        raise ValueError(f"{name} must have strides that are multiples of {nbytes} bytes (its element size), "
                         f"got strides {tuple(x.strides)}; pass a copy ({name}.copy())")


def require_kernel_operand(x, name: str) -> None:
    """``x`` is read or written by the attention kernels as one dense block with 16-byte accesses: it must be
    C-contiguous and start on a 16-byte boundary."""
    require_contiguous(x, name)
    if x.data.ptr % 16:
        raise ValueError(f"{name} must be 16-byte aligned (got a view at an offset); pass a copy")


def self_overlaps(shape, strides, itemsize: int) -> bool:
    """Whether two elements of a strided view share a byte (strides in bytes, any sign).

    Dimensions of length 1 are dropped and the rest sorted by |stride|; the view is free of overlap when each
    |stride| is at least the bytes spanned by the dimensions inside it (``itemsize`` plus (n - 1) * |stride| of
    each). That never passes an overlapping view: a stride 0 on a dimension longer than 1, or rows closer than
    their own length, are caught. It also refuses the rare interleavings that happen not to collide (e.g. shape
    (3, 2) with element strides (2, 3)), which no contiguous array or slice of one produces."""
    if any(n == 0 for n in shape):
        return False
    span = itemsize
    for st, n in sorted((abs(st), n) for n, st in zip(shape, strides) if n > 1):
        if st < span:
            return True
        span += (n - 1) * st
    return False


def require_no_self_overlap(x, name: str) -> None:
    """No two elements of ``x`` may share memory (e.g. a stride-0 broadcast view): an output written through
    such a view gets whichever write lands last, so its contents would depend on the kernel's schedule."""
    if _c_contiguous(x):
        return
    if self_overlaps(x.shape, x.strides, x.itemsize):
        raise ValueError(f"{name} has elements that share memory (shape {tuple(x.shape)}, strides "
                         f"{tuple(x.strides)} bytes: a broadcast or overlapping view); pass an array whose "
                         f"elements are distinct, e.g. cupy.empty({tuple(x.shape)}, {name}.dtype)")


def attention_scaling(scaling, head_dim: int) -> float:
    """An attention call's softmax scale: ``head_dim ** -0.5`` for None, else a finite real number (a Python or
    NumPy int or float; bool, strings and arrays refused). Zero and negative scales are taken as given."""
    if scaling is None:
        return head_dim ** -0.5
    if isinstance(scaling, (bool, np.bool_)) or not isinstance(scaling, (int, float, np.integer, np.floating)):
        raise TypeError(f"scaling must be a real number or None, got {type(scaling).__name__} {scaling!r}")
    try:
        value = float(scaling)
    except OverflowError:  # an int past the float range
        value = math.inf
    if not math.isfinite(value):
        raise ValueError(f"scaling must be finite, got {value}")
    if abs(value) * LOG2E > FLOAT32_MAX:  # the kernels take scaling and scaling * log2(e) as float32
        raise ValueError(f"scaling={value} is past float32's range (|scaling| * log2(e) must be at most "
                         f"{FLOAT32_MAX:.7g}): the kernels take it as float32, where it would be inf")
    return value


def attention_dropout(value) -> None:
    """Refuse any ``attention_dropout`` but zero: a real number is required (bool, strings and arrays refused),
    and a nonzero one is not supported (a backward with dropout needs the forward's dropout mask)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"attention_dropout must be a real number (0.0), got {type(value).__name__} {value!r}")
    if value != 0:
        raise NotImplementedError(
            f"attention_dropout={value}: a backward with dropout needs the forward's dropout mask, which this op "
            "does not take; only attention_dropout=0.0 is supported")


def require_int(value, name: str, minimum: int | None = 1) -> int:
    """``value`` as an ``int``: a Python int or NumPy integer (bool refused), at least ``minimum`` (None: no
    bound). A float such as 2.9 is refused rather than truncated."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    v = int(value)
    if minimum is not None and v < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {v}")
    return v


# Sizes the attention kernels and their helpers index with 32-bit integers (kernels_cu/attention.cu, util.cu;
# every element offset itself is computed in 64 bits):
# * tokens: int32 token indices (the tile table, the kernels' T) and the row length of the transposed, 32-padded
#   GEMM operands (int ldt = tokens rounded up to 32), so tokens + 31 must fit in an int32;
# * hidden: the kernels add column offsets up to 3H in int (gqkv + 2H + h*D, the bias partials) and cuBLAS takes
#   the row stride 3H as an int, so 3 * hidden must fit in an int32;
# * heads: the attention kernels run one block row per head in grid y, at most 65535.
MAX_TOKENS = (2**31 - 1) // 32 * 32  # 2,147,483,616
MAX_HIDDEN = (2**31 - 1) // 3  # 715,827,882
MAX_HEADS = 65535


def check_token_limits(tokens: int, hidden: int, num_heads: int | None = None) -> None:
    """Raise ValueError for attention sizes past the library's 32-bit index limits (see MAX_TOKENS above).

    On today's GPUs memory runs out first (at MAX_TOKENS one [T, H] fp32 array is 550 GB even at the smallest
    hidden size, 64); the check keeps such a call from failing inside a launch with a CUDA error instead."""
    if tokens > MAX_TOKENS:
        raise ValueError(f"{tokens} tokens is more than this library supports ({MAX_TOKENS:,}: token indices "
                         "and the 32-padded row length of the transposed operands are int32); split the batch")
    if 3 * hidden > 2**31 - 1:
        raise ValueError(f"hidden size {hidden} is more than this library supports ({MAX_HIDDEN:,}: the qkv "
                         "row length 3 * hidden is an int32)")
    if num_heads is not None and num_heads > MAX_HEADS:
        raise ValueError(f"{num_heads} heads is more than this library supports ({MAX_HEADS}: one grid row "
                         "of the attention kernels per head)")


_NULL_CONTEXT = contextlib.nullcontext()


def on_stream(stream):
    """(context manager, raw stream pointer) for running an op on ``stream`` (default: the current stream).

    Allocations made inside the context belong to that stream in CuPy's memory pool, so temporaries freed
    by the op are never handed to another stream while the op's kernels may still use them."""
    cupy = _cupy or cupy_module()
    if stream is None:
        return _NULL_CONTEXT, cupy.cuda.get_current_stream().ptr
    if is_stream(stream):
        return stream, stream.ptr
    raise TypeError(f"stream must be a cupy.cuda.Stream or None, got {type(stream).__name__}")


def is_stream(x) -> bool:
    """Whether ``x`` is a CuPy stream: a ``cupy.cuda.Stream`` (CuPy 14 wraps foreign streams as one with
    ``Stream.from_external``) or a ``cupy.cuda.ExternalStream`` (CuPy 13's wrapper, deprecated in 14)."""
    cuda = (_cupy or cupy_module()).cuda
    return isinstance(x, (cuda.Stream, getattr(cuda, "ExternalStream", cuda.Stream)))


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
    1-D, integer, N+1 entries for N >= 0 sequences (``[0]``: no sequences, an empty batch)."""
    if not isinstance(cu, np.ndarray):
        cupy = _cupy or cupy_module()
        if not isinstance(cu, cupy.ndarray):
            raise TypeError(f"cu_seqlens must be a cupy or numpy integer array, got {type(cu).__name__}")
        require_cupy(cu, "cu_seqlens")
        if not cu.flags.c_contiguous:
            raise ValueError("cu_seqlens must be contiguous; pass cupy.ascontiguousarray(cu_seqlens)")
    if cu.ndim != 1 or cu.shape[0] < 1:
        raise ValueError(f"cu_seqlens must be 1-D with at least 1 entry (N+1 for N sequences), got shape {cu.shape}")
    if cu.dtype.kind not in "iu":
        raise TypeError(f"cu_seqlens must be an integer array (int32, int64, ...), got {dtype_name(cu.dtype)}")


def check_cu_seqlens(cu: np.ndarray, total: int) -> None:
    """Validate cu_seqlens on the host: 1-D integer, starts at 0, non-decreasing, ends at ``total``."""
    check_cu_seqlens_form(cu)
    if int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {int(cu[0])}")
    down = cu[1:] < cu[:-1]  # compared, not subtracted: a difference of int64 or uint64 entries can wrap
    if down.any():
        i = int(np.argmax(down))
        raise ValueError(f"cu_seqlens must be non-decreasing; cu_seqlens[{i + 1}] = {int(cu[i + 1])} "
                         f"< cu_seqlens[{i}] = {int(cu[i])}")
    if int(cu[-1]) != total:
        raise ValueError(f"cu_seqlens must end at the number of tokens {total}, got {int(cu[-1])}")
