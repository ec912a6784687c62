"""Row-major GEMMs through cuBLAS (``cublasGemmEx``) in the three precision modes.

A private cuBLAS handle per device keeps the math mode fixed (CuPy's own handle follows ``CUPY_TF32``):
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

_handles: dict = {}
_lock = threading.Lock()
_ONE = np.ones(1, np.float32)
_ZERO = np.zeros(1, np.float32)


def _handle(device: int) -> int:
    h = _handles.get(device)
    if h is None:
        from cupy_backends.cuda.libs import cublas

        with _lock:
            h = _handles.get(device)
            if h is None:
                h = cublas.create()
                _handles[device] = h
    return h


def gemm(a, b, c, *, trans_a: bool, trans_b: bool, precision: str, stream: int, accumulate: bool = False) -> None:
    """``c = op(a) @ op(b)`` for C-contiguous row-major 2-D arrays; op transposes when asked.

    ``a``/``b`` are fp32 (``fp32``/``tf32``) or bf16 (``bf16``); ``c`` is fp32 and is overwritten, or
    added to when ``accumulate``."""
    from cupy_backends.cuda.api import runtime
    from cupy_backends.cuda.libs import cublas

    m = a.shape[1] if trans_a else a.shape[0]
    k = a.shape[0] if trans_a else a.shape[1]
    kb = b.shape[1] if trans_b else b.shape[0]
    n = b.shape[0] if trans_b else b.shape[1]
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
    h = _handle(runtime.getDevice())
    cublas.setStream(h, stream)
    # Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: swap the operands.
    cublas.gemmEx(h, cublas.CUBLAS_OP_T if trans_b else cublas.CUBLAS_OP_N,
                  cublas.CUBLAS_OP_T if trans_a else cublas.CUBLAS_OP_N,
                  n, m, k, _ONE.ctypes.data, b.data.ptr, dtype, b.shape[1], a.data.ptr, dtype, a.shape[1],
                  (_ONE if accumulate else _ZERO).ctypes.data, c.data.ptr, CUDA_R_32F, n, compute, GEMM_DEFAULT)
