"""Row-major GEMMs through cuBLAS in the three precision modes (``cublasGemmEx``, or the cublasLt kernel
found fastest for the product on its first call: see below).

Private cuBLAS handles keep the math mode fixed (CuPy's own handle follows ``CUPY_TF32``):
``fp32`` uses ``CUBLAS_COMPUTE_32F`` with the default math mode, so no tensor cores; ``tf32`` uses
``CUBLAS_COMPUTE_32F_FAST_TF32``; ``bf16`` takes bf16 operands with ``CUBLAS_COMPUTE_32F``. Outputs are fp32.
"""
from __future__ import annotations

import numpy as np

from ._once import once

CUDA_R_32F = 0
CUDA_R_16BF = 14
COMPUTE_32F = 68
COMPUTE_32F_FAST_TF32 = 77
GEMM_DEFAULT = -1
PRECISIONS = ("fp32", "tf32", "bf16")

_handles: dict = {}  # device -> handle of CuPy's bindings (used where the direct path cannot load)
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
    return once(_handles, device, lambda: _libs()[1].create())


# cublasGemmEx is called through ctypes on the libcublas CuPy has loaded, with a handle and an explicit
# workspace per (device, stream): CuPy's bindings refuse every cuBLAS call while a stream is being captured,
# and the attention backward records its launch sequence into a CUDA graph (see attention.py). With its own
# workspace a recorded GEMM never allocates, and two streams never share scratch memory. Where that library
# cannot be found, GEMMs go through CuPy's bindings and nothing is recorded.
_WORKSPACE_BYTES = 32 << 20
_direct = None  # ctypes library, or the reason it is unavailable (a str)
_direct_handles: dict = {}  # (device, stream) -> (handle, workspace array)


def _loaded(name: str) -> str:
    """Path of the one copy of library ``name`` (e.g. "libcublas") mapped into this process."""
    import re

    with open("/proc/self/maps") as f:
        paths = set(re.findall(r"(/\S*/" + name + r"\.so[.\d]*)\s*$", f.read(), re.M))
    if len(paths) != 1:
        raise OSError(f"expected one loaded {name}, found {sorted(paths) or 'none'}")
    return paths.pop()


def _load_direct():
    global _direct
    if _direct is None:
        import ctypes

        _libs()  # makes CuPy load libcublas into the process
        try:
            lib = ctypes.CDLL(_loaded("libcublas"))
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


def _direct_handle(device: int, stream: int) -> tuple:
    """(cuBLAS handle bound to ``stream``, its workspace array), made once per (device, stream)."""

    def make():
        import ctypes

        import cupy

        lib = _load_direct()
        h = ctypes.c_void_p()
        _check(lib.cublasCreate_v2(ctypes.byref(h)), "cublasCreate")
        ws = cupy.empty(_WORKSPACE_BYTES, dtype=np.uint8)
        _check(lib.cublasSetStream_v2(h, stream), "cublasSetStream")
        _check(lib.cublasSetWorkspace_v2(h, ws.data.ptr, _WORKSPACE_BYTES), "cublasSetWorkspace")
        return h.value, ws

    return once(_direct_handles, (device, stream), make)


def _ld(x) -> int:
    """Row stride (elements) of a row-major 2-D array whose rows are contiguous (C-contiguous, or a column
    slice of one, such as the first T columns of a row-padded transposed copy)."""
    if x.ndim != 2 or x.strides[1] != x.itemsize or x.strides[0] % x.itemsize:
        raise ValueError(f"gemm operands must be row-major 2-D arrays with contiguous rows, got shape {x.shape} "
                         f"and strides {x.strides}")
    return max(x.strides[0] // x.itemsize, x.shape[1], 1)


def _product(a, b, c, trans_a: bool, trans_b: bool, precision: str) -> tuple:
    """The product ``c = op(a) @ op(b)`` checked and described: (m, n, k, trans_a, trans_b, dtype, compute, lda,
    ldb), which is also its cublasGemmEx call and, with the device and pointer alignments, its plan's key."""
    m, k = (a.shape[1], a.shape[0]) if trans_a else a.shape
    kb, n = (b.shape[1], b.shape[0]) if trans_b else b.shape
    if k != kb or c.shape != (m, n):
        raise ValueError(f"gemm shapes do not agree: {a.shape}{'^T' if trans_a else ''} x "
                         f"{b.shape}{'^T' if trans_b else ''} -> {c.shape}")
    if not c.flags.c_contiguous:
        raise ValueError("gemm output must be C-contiguous")
    dtype = CUDA_R_16BF if precision == "bf16" else CUDA_R_32F
    compute = COMPUTE_32F_FAST_TF32 if precision == "tf32" else COMPUTE_32F
    return m, n, k, trans_a, trans_b, dtype, compute, _ld(a), _ld(b)


def gemm(a, b, c, *, trans_a: bool, trans_b: bool, precision: str, stream: int, accumulate: bool = False) -> None:
    """``c = op(a) @ op(b)`` for row-major 2-D arrays; op transposes when asked.

    ``c`` is C-contiguous; ``a`` and ``b`` may also be column slices of C-contiguous arrays (rows padded).
    ``a``/``b`` are fp32 (``fp32``/``tf32``) or bf16 (``bf16``); ``c`` is fp32 and is overwritten, or
    added to when ``accumulate``. ``stream`` must be the current stream."""
    runtime, cublas = _lib or _libs()
    ex = _product(a, b, c, trans_a, trans_b, precision)
    m, n, k = ex[:3]
    if m == 0 or n == 0:
        return
    if k == 0:
        if not accumulate:
            c.fill(0)
        return
    device = runtime.getDevice()
    if not capturable():  # CuPy's gemmEx binds the handle to the current stream itself
        cublas.gemmEx(_handle(device), *_gemm_ex_args(ex, a, b, c, accumulate))
    elif _lt_library() is None:
        _gemm_ex(ex, a, b, c, device, stream, accumulate)
    else:
        plan = _lt_plan(device, ex, a, b, c)
        plan.run(plan.choose(a, b, c, stream, accumulate), a, b, c, stream, accumulate, device)


def plan_for(a, b, c, *, trans_a: bool, trans_b: bool, precision: str) -> "_LtPlan":
    """The cublasLt plan :func:`gemm` uses for this product on the current device (made if new; its
    candidates are timed by gemm's first call). Needs the direct cuBLAS path and cublasLt."""
    return _lt_plan(_libs()[0].getDevice(), _product(a, b, c, trans_a, trans_b, precision), a, b, c)


def _gemm_ex_args(ex, a, b, c, accumulate):
    """cublasGemmEx's arguments for product ``ex`` (see _product)."""
    m, n, k, trans_a, trans_b, dtype, compute, lda, ldb = ex
    # Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: swap the operands.
    return (1 if trans_b else 0, 1 if trans_a else 0, n, m, k,  # CUBLAS_OP_T = 1, CUBLAS_OP_N = 0
            _ONE_PTR, b.data.ptr, dtype, ldb, a.data.ptr, dtype, lda,
            _ONE_PTR if accumulate else _ZERO_PTR, c.data.ptr, CUDA_R_32F, n, compute, GEMM_DEFAULT)


def _gemm_ex(ex, a, b, c, device: int, stream: int, accumulate: bool) -> None:
    """cublasGemmEx through the direct library, on the stream's own handle and workspace."""
    _check(_direct.cublasGemmEx(_direct_handle(device, stream)[0], *_gemm_ex_args(ex, a, b, c, accumulate)),
           "cublasGemmEx")


# ---- cublasLt: the same products with the kernel chosen by measurement ------------------------------------
# cublasGemmEx takes the first kernel of cuBLAS's heuristic. For the skinny and mid-sized products of the
# attention backward (a few hundred tokens against 3584 x 10752 weights) that choice often leaves SMs idle in a
# last partial wave, where another tile shape or a split-K kernel fills them. The first call of each product
# (shapes, layouts, pointer alignment, precision) times cuBLAS's top candidates on the caller's stream and keeps
# the fastest (cublasGemmEx's own kernel among them) for the rest of the process, so calls after the first are
# deterministic, bit for bit; another process may time a different winner. A product first met while its stream
# is being captured, or that accumulates into its output, goes through cublasGemmEx.
# One more candidate where the rows of C (tokens, in the attention backward) are not a multiple of SPLIT_ROWS:
# the same product as two calls, the whole SPLIT_ROWS-row tiles and then the remainder rows, so that no kernel
# pays a whole row of tiles for a few rows (each part with its own timed choice).
_LT_CANDIDATES = 8  # cublasLt's heuristic offers at most 8 for these products, whatever is asked
SPLIT_ROWS = 128
SPLIT = -2  # the candidate index of the row split
_lt = None  # ctypes library, or the reason it is unavailable (a str)
_lt_handles: dict = {}  # device -> cublasLt handle
_lt_plans: dict = {}  # product key -> _LtPlan
_lt_autotune = True


def set_gemm_autotune(enabled: bool) -> None:
    """Choose each product's cuBLAS kernel by timing cuBLAS's candidates on first use (the default), or take
    cuBLAS's heuristic choice. Products already tuned keep their choice."""
    global _lt_autotune
    _lt_autotune = bool(enabled)


def _lt_library():
    global _lt
    if _lt is None:
        import ctypes

        _libs()
        try:
            lib = ctypes.CDLL(_loaded("libcublasLt"))
            vp, i32, u64, i64, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
            pvp = ctypes.POINTER(vp)
            lib.cublasLtCreate.argtypes = [pvp]
            lib.cublasLtMatmulDescCreate.argtypes = [pvp, i32, i32]
            lib.cublasLtMatmulDescSetAttribute.argtypes = [vp, i32, vp, sz]
            lib.cublasLtMatrixLayoutCreate.argtypes = [pvp, i32, u64, u64, i64]
            lib.cublasLtMatmulPreferenceCreate.argtypes = [pvp]
            lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [vp, i32, vp, sz]
            lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [vp, vp, vp, vp, vp, vp, vp, i32, vp, ctypes.POINTER(i32)]
            lib.cublasLtMatmul.argtypes = [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, sz, vp]
            _lt = lib
        except (OSError, AttributeError) as e:
            _lt = f"{type(e).__name__}: {e}"
    return None if isinstance(_lt, str) else _lt


_RESULT_BYTES = 96  # sizeof(cublasLtMatmulHeuristicResult_t): algo (64), workspaceSize, state, wavesCount, reserved[4]


class _LtPlan:
    """One product's cublasLt descriptors and candidate kernels (and, once timed, the chosen one)."""

    def __init__(self, lib, handle, ex, aligns):
        import ctypes

        def new(fn, *args):
            obj = ctypes.c_void_p()
            _check(fn(ctypes.byref(obj), *args), fn.__name__)
            return obj

        def setattr_(fn, obj, attr, v):  # v: a ctypes value of the attribute's type
            _check(fn(obj, attr, ctypes.byref(v), ctypes.sizeof(v)), fn.__name__)

        self.lib, self.handle = lib, handle
        self.ex = ex  # see _product: also the product's cublasGemmEx call
        m, n, k, trans_a, trans_b, dtype, compute, lda, ldb = ex
        # Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: cuBLAS's "A" is our b.
        self.desc = new(lib.cublasLtMatmulDescCreate, compute, CUDA_R_32F)
        setattr_(lib.cublasLtMatmulDescSetAttribute, self.desc, 3, ctypes.c_int32(int(trans_b)))  # TRANSA
        setattr_(lib.cublasLtMatmulDescSetAttribute, self.desc, 4, ctypes.c_int32(int(trans_a)))  # TRANSB
        la = new(lib.cublasLtMatrixLayoutCreate, dtype, *((k, n) if trans_b else (n, k)), ldb)
        lb = new(lib.cublasLtMatrixLayoutCreate, dtype, *((m, k) if trans_a else (k, m)), lda)
        lc = new(lib.cublasLtMatrixLayoutCreate, CUDA_R_32F, n, m, n)
        self.layouts = (la, lb, lc)
        pref = new(lib.cublasLtMatmulPreferenceCreate)
        setattr_(lib.cublasLtMatmulPreferenceSetAttribute, pref, 1, ctypes.c_uint64(_WORKSPACE_BYTES))  # MAX_WORKSPACE_BYTES
        for attr, align in zip((5, 6, 7, 8), aligns):  # MIN_ALIGNMENT_{A,B,C,D}_BYTES
            setattr_(lib.cublasLtMatmulPreferenceSetAttribute, pref, attr, ctypes.c_uint32(align))
        results = (ctypes.c_char * (_RESULT_BYTES * _LT_CANDIDATES))()
        count = ctypes.c_int(0)
        _check(lib.cublasLtMatmulAlgoGetHeuristic(handle, self.desc, la, lb, lc, lc, pref, _LT_CANDIDATES, results,
                                                  ctypes.byref(count)), "cublasLtMatmulAlgoGetHeuristic")
        lib.cublasLtMatmulPreferenceDestroy(pref)
        if count.value == 0:
            raise RuntimeError(f"cublasLt has no kernel for this product (m={m}, n={n}, k={k})")
        raw = bytes(results)
        self.algos = [ctypes.create_string_buffer(raw[i * _RESULT_BYTES:i * _RESULT_BYTES + 64], 64)
                      for i in range(count.value)]
        # rows of the first part of the split candidate (0: none): row slices of A, or column slices of A^T
        self.split = m - m % SPLIT_ROWS if m > SPLIT_ROWS and m % SPLIT_ROWS else 0
        self.chosen = None  # once timed: -1 (cublasGemmEx's own choice), SPLIT, or an index into algos
        self.times_us = None  # {candidate: µs} of the timing

    def candidates(self) -> list:
        return [-1] + ([SPLIT] if self.split else []) + list(range(len(self.algos)))

    def choose(self, a, b, c, stream: int, accumulate: bool) -> int:
        """The kernel to use: the timed choice, or cublasGemmEx's (-1) until there is one."""
        if self.chosen is not None:
            return self.chosen
        if accumulate or not _lt_autotune or _capturing(stream):
            return -1
        import cupy

        runtime = _libs()[0]
        times = {}
        runtime.deviceSynchronize()  # time each candidate alone (the attention backward uses two streams)
        ev0, ev1 = cupy.cuda.Event(), cupy.cuda.Event()
        for i in self.candidates():
            try:
                self.run(i, a, b, c, stream, False)  # warm-up: writes c, which the real call then overwrites
                runtime.eventRecord(ev0.ptr, stream)
                self.run(i, a, b, c, stream, False)
                runtime.eventRecord(ev1.ptr, stream)
                ev1.synchronize()
                times[i] = cupy.cuda.get_elapsed_time(ev0, ev1) * 1e3
            except RuntimeError:
                if i < 0:  # cublasGemmEx itself failed: a real error, not a candidate to skip
                    raise
                runtime.streamSynchronize(stream)
        self.times_us = times
        self.chosen = min(times, key=times.__getitem__)
        return self.chosen

    def run(self, index: int, a, b, c, stream: int, accumulate: bool, device: int | None = None) -> None:
        """``c = a b`` (as the plan's layouts say) with candidate ``index`` (-1: cublasGemmEx, SPLIT: two calls),
        on ``device`` (default: the current one)."""
        if index == SPLIT:  # each part goes through gemm(), with its own plan and timed choice
            m0, precision, trans_a = self.split, _precision(self.ex), self.ex[3]
            for rows in (slice(0, m0), slice(m0, None)):
                gemm(a[:, rows] if trans_a else a[rows], b, c[rows], trans_a=trans_a, trans_b=self.ex[4],
                     precision=precision, stream=stream, accumulate=accumulate)
            return
        if device is None:
            device = _libs()[0].getDevice()
        if index < 0:
            _gemm_ex(self.ex, a, b, c, device, stream, accumulate)
            return
        la, lb, lc = self.layouts
        ws = _direct_handle(device, stream)[1]  # the stream's workspace: its calls run in order
        _check(self.lib.cublasLtMatmul(self.handle, self.desc, _ONE_PTR, b.data.ptr, la, a.data.ptr, lb,
                                       _ONE_PTR if accumulate else _ZERO_PTR, c.data.ptr, lc, c.data.ptr, lc,
                                       self.algos[index], ws.data.ptr, _WORKSPACE_BYTES, stream), "cublasLtMatmul")


def _precision(ex) -> str:
    dtype, compute = ex[5], ex[6]
    return "bf16" if dtype == CUDA_R_16BF else "tf32" if compute == COMPUTE_32F_FAST_TF32 else "fp32"


def _capturing(stream: int) -> bool:
    runtime = _libs()[0]
    return runtime.streamIsCapturing(stream) != 0


def _alignment(ptr: int) -> int:
    return min(256, ptr & -ptr) if ptr else 256


def _lt_plan(device, ex, a, b, c) -> _LtPlan:
    aligns = (_alignment(b.data.ptr), _alignment(a.data.ptr), _alignment(c.data.ptr), _alignment(c.data.ptr))

    def new_handle():
        import ctypes

        h = ctypes.c_void_p()
        _check(_lt.cublasLtCreate(ctypes.byref(h)), "cublasLtCreate")
        return h.value

    return once(_lt_plans, (device, ex, aligns),
                lambda: _LtPlan(_lt, once(_lt_handles, device, new_handle), ex, aligns))
