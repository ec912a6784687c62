"""Row-major GEMMs through cuBLAS (``cublasGemmEx``) in the three precision modes.

Private cuBLAS handles keep the math mode fixed (CuPy's own handle follows ``CUPY_TF32``):
``fp32`` uses ``CUBLAS_COMPUTE_32F`` with the default math mode, so no tensor cores; ``tf32`` uses
``CUBLAS_COMPUTE_32F_FAST_TF32``; ``bf16`` takes bf16 operands with ``CUBLAS_COMPUTE_32F``. Outputs are fp32.
"""
from __future__ import annotations

import threading

import numpy as np

CUDA_R_32F = 0
CUDA_R_16BF = 14
COMPUTE_32F = 68
COMPUTE_32F_FAST_TF32 = 77
GEMM_DEFAULT = -1
PRECISIONS = ("fp32", "tf32", "bf16")

_handles: dict = {}  # device -> handle of CuPy's bindings (used where the direct path cannot load)
_lock = threading.Lock()
_ONE = np.ones(1, np.float32)
_ZERO = np.zeros(1, np.float32)
_ONE_PTR, _ZERO_PTR = _ONE.ctypes.data, _ZERO.ctypes.data  # host scalars alpha/beta (kept alive above)
_lib = None  # (cupy_backends runtime, cublas), imported on first use: importing them needs the CUDA libraries


def _libs():
    global _lib
    if _lib is None:
        from cupy_backends.cuda.api import runtime
        from cupy_backends.cuda.libs import cublas

        _lib = (runtime, cublas)
    return _lib


def _handle(device: int) -> int:
    entry = _handles.get(device)
    if entry is None:
        with _lock:
            entry = _handles.get(device)
            if entry is None:
                entry = _handles[device] = _libs()[1].create()
    return entry


# cublasGemmEx is called through ctypes on the libcublas CuPy has loaded, with a handle and an explicit
# workspace per (device, stream): CuPy's bindings refuse every cuBLAS call while a stream is being captured,
# and the attention backward records its launch sequence into a CUDA graph (see attention.py). With its own
# workspace a recorded GEMM never allocates, and two streams never share scratch memory. Where that library
# cannot be found, GEMMs go through CuPy's bindings and nothing is recorded.
_WORKSPACE_BYTES = 32 << 20
_direct = None  # ctypes library, or the reason it is unavailable (a str)
_direct_handles: dict = {}  # (device, stream) -> (handle, workspace array)


def _load_direct():
    global _direct
    if _direct is None:
        import ctypes
        import re

        _libs()  # makes CuPy load libcublas into the process
        try:
            with open("/proc/self/maps") as f:
                paths = set(re.findall(r"(/\S*/libcublas\.so[.\d]*)\s*$", f.read(), re.M))
            if len(paths) != 1:
                raise OSError(f"expected one loaded libcublas, found {sorted(paths) or 'none'}")
            lib = ctypes.CDLL(paths.pop())
            vp, i32 = ctypes.c_void_p, ctypes.c_int
            lib.cublasCreate_v2.argtypes = [ctypes.POINTER(vp)]
            lib.cublasSetStream_v2.argtypes = [vp, vp]
            lib.cublasSetWorkspace_v2.argtypes = [vp, vp, ctypes.c_size_t]
            lib.cublasGemmEx.argtypes = [vp, i32, i32, i32, i32, i32, vp, vp, i32, i32, vp, i32, i32, vp, vp, i32,
                                         i32, i32, i32]
            _direct = lib
        except (OSError, AttributeError) as e:
            _direct = f"{type(e).__name__}: {e}"
    return _direct


def capturable() -> bool:
    """Whether GEMMs can be recorded into a CUDA graph here (cuBLAS reached directly)."""
    return not isinstance(_load_direct(), str)


def _check(status: int, what: str) -> None:
    if status:
        raise RuntimeError(f"{what} failed with cuBLAS status {status}")


def _direct_handle(device: int, stream: int) -> int:
    entry = _direct_handles.get((device, stream))
    if entry is None:
        import ctypes

        import cupy

        lib = _load_direct()
        h = ctypes.c_void_p()
        _check(lib.cublasCreate_v2(ctypes.byref(h)), "cublasCreate")
        ws = cupy.empty(_WORKSPACE_BYTES, dtype=np.uint8)
        _check(lib.cublasSetStream_v2(h, stream), "cublasSetStream")
        _check(lib.cublasSetWorkspace_v2(h, ws.data.ptr, _WORKSPACE_BYTES), "cublasSetWorkspace")
        entry = _direct_handles[(device, stream)] = (h.value, ws)
    return entry[0]


def gemm(a, b, c, *, trans_a: bool, trans_b: bool, precision: str, stream: int, accumulate: bool = False) -> None:
    """``c = op(a) @ op(b)`` for C-contiguous row-major 2-D arrays; op transposes when asked.

    ``a``/``b`` are fp32 (``fp32``/``tf32``) or bf16 (``bf16``); ``c`` is fp32 and is overwritten, or
    added to when ``accumulate``. ``stream`` must be the current stream."""
    runtime, cublas = _lib or _libs()
    m, k = (a.shape[1], a.shape[0]) if trans_a else a.shape
    kb, n = (b.shape[1], b.shape[0]) if trans_b else b.shape
    if k != kb or c.shape != (m, n):
        raise ValueError(f"gemm shapes do not agree: {a.shape}{'^T' if trans_a else ''} x "
                         f"{b.shape}{'^T' if trans_b else ''} -> {c.shape}")
    if m == 0 or n == 0:
        return
    if k == 0:
        if not accumulate:
            c.fill(0)
        return
    dtype = CUDA_R_16BF if precision == "bf16" else CUDA_R_32F
    compute = COMPUTE_32F_FAST_TF32 if precision == "tf32" else COMPUTE_32F
    # Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: swap the operands.
    args = (1 if trans_b else 0, 1 if trans_a else 0, n, m, k,  # CUBLAS_OP_T = 1, CUBLAS_OP_N = 0
            _ONE_PTR, b.data.ptr, dtype, b.shape[1], a.data.ptr, dtype, a.shape[1],
            _ONE_PTR if accumulate else _ZERO_PTR, c.data.ptr, CUDA_R_32F, n, compute, GEMM_DEFAULT)
    device = runtime.getDevice()
    if capturable():
        _check(_direct.cublasGemmEx(_direct_handle(device, stream), *args), "cublasGemmEx")
    else:  # CuPy's gemmEx binds the handle to the current stream itself
        cublas.gemmEx(_handle(device), *args)
