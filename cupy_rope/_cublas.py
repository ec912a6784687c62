"""Row-major GEMMs through cuBLAS in the three precision modes (``cublasGemmEx``, or the cublasLt kernel
found fastest for the product on its first call: see below).

Private cuBLAS handles keep the math mode fixed (CuPy's own handle follows ``CUPY_TF32``):
``fp32`` uses ``CUBLAS_COMPUTE_32F`` with the default math mode, so no tensor cores; ``tf32`` uses
``CUBLAS_COMPUTE_32F_FAST_TF32``; ``bf16`` takes bf16 operands with ``CUBLAS_COMPUTE_32F``, or fp32 operands with
``CUBLAS_COMPUTE_32F_FAST_16BF`` (rounded to bf16 inside the product: read once as stored, no bf16 copies made
first). Outputs are fp32.

Threads: every thread has its own cuBLAS handle per device and its own workspaces, so two threads never share
either, also when their stream pointers are equal (every thread's per-thread default stream is the same pointer).
Products, their cublasLt plans and the timed choices are shared by the whole process. Tuning is chosen per call
with a frozen :class:`GemmConfig`; the one process-wide switch is :func:`set_gemm_autotune`. :func:`calls`
counts the GEMMs the calling thread has issued (tests use it to show that validation raises before any).
"""
from __future__ import annotations

import collections
import dataclasses
import numbers
import sys
import threading
import types
import weakref

import numpy as np

from ._checks import BF16, F32, dtype_name
from ._once import once
from .precision import Precision

CUDA_R_32F = 0
CUDA_R_16BF = 14
COMPUTE_32F = 68
COMPUTE_32F_FAST_16BF = 75
COMPUTE_32F_FAST_TF32 = 77
GEMM_DEFAULT = -1
_INT_MAX = 2**31 - 1  # cublasGemmEx takes its sizes and row strides as int

_ONE = np.ones(1, np.float32)
_ZERO = np.zeros(1, np.float32)
_ONE_PTR, _ZERO_PTR = _ONE.ctypes.data, _ZERO.ctypes.data  # host scalars alpha/beta (kept alive above)
_libraries: dict = {}  # name -> module, ctypes library, or the reason it is unavailable (a str); made on first use


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """How :func:`gemm` chooses a product's kernel; part of the plan's key, so products tuned under different
    configs keep separate choices.

    ``split_rows``: the split candidate (see "cublasLt" below) cuts the rows of C into whole tiles of this many
    rows plus the remainder; 0: no split candidate. ``lt_candidates``: how many kernels cuBLAS's heuristic is
    asked for (it offers at most 8 for the attention products, whatever is asked). ``split_k``: for each
    heuristic kernel that accepts it, one more candidate per count here with the contraction split that many
    ways (cublasLt's split-K, partial sums reduced in the compute type); empty: none."""

    split_rows: int = 128
    lt_candidates: int = 8
    split_k: tuple = ()

    def __post_init__(self):
        for name, minimum in (("split_rows", 0), ("lt_candidates", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise TypeError(f"GemmConfig.{name} must be an integer, got {type(v).__name__} {v!r}")
            if v < minimum:
                raise ValueError(f"GemmConfig.{name} must be at least {minimum}, got {v}")
            object.__setattr__(self, name, int(v))  # numpy integers become ints: one hash for the plan key
        ks = self.split_k
        if not isinstance(ks, (tuple, list)) or any(isinstance(v, bool) or not isinstance(v, numbers.Integral)
                                                   or not 2 <= v <= 64 for v in ks):
            raise ValueError(f"GemmConfig.split_k must be a tuple of integers from 2 to 64, got {ks!r}")
        object.__setattr__(self, "split_k", tuple(sorted({int(v) for v in ks})))


DEFAULT_CONFIG = GemmConfig()

# ---- per-thread state ----------------------------------------------------------------------------------------
# A cuBLAS handle holds the stream and workspace of the call being made: two threads calling SetStream and a GEMM
# on one handle at the same time can run each other's GEMM on the wrong stream with the wrong scratch. So each
# thread has its own handle per device, bound to the call's stream and workspace right before every call
# (cublasSetStream, then cublasSetWorkspace: setting the stream resets the workspace). Workspaces are per
# (device, stream pointer) inside the thread's state: the stream's calls run in order, so one workspace per
# stream suffices, and a thread never lends one to another thread, whatever the pointer values.
#
# Lifetimes. A thread keeps at most _WORKSPACES_PER_THREAD workspaces outside captures (least recently used
# dropped first; a program that creates and drops streams does not grow). Each use records an event on the
# stream right after the call; a workspace is dropped (evicted, or its thread's state collected) only after
# synchronizing that event, never the stream: the caller's stream may be destroyed by then, and synchronizing a
# destroyed stream is undefined. Before each use the stream waits for that event too: a no-op on the stream that
# last used it, and the guard when a destroyed stream's pointer comes back as a new stream.
# Inside a stream capture the event would be a graph node, not a completion marker, and the workspace's address is
# baked into the recorded GEMMs: workspaces used while capturing are separate, never evicted, and kept for the
# thread's life. A graph that may be replayed after its recording thread has gone holds captured_workspaces().
# cuBLAS handles are not destroyed: cublasDestroy synchronizes the whole device, which would invalidate a capture
# running in another thread (this library's or another's). A dead thread's handles go to a pool that threads
# created later take from, so there are never more handles than threads that have used GEMMs at the same time.
_WORKSPACE_BYTES = 32 << 20
_WORKSPACES_PER_THREAD = 8
_tls = threading.local()  # .state: _ThreadState; .calls: GEMMs issued by the thread
_idle_handles: dict = {}  # (kind, device) -> handles of threads that have ended ("direct" or "cupy" bindings)
_idle_lock = threading.Lock()


def calls() -> int:
    """How many GEMMs the calling thread has issued so far (:func:`gemm` calls that reached cuBLAS, nested ones of
    the split candidate included)."""
    return getattr(_tls, "calls", 0)


class _Workspace:
    """cuBLAS scratch memory and, outside captures, the event recorded after its last use."""

    __slots__ = ("array", "ptr", "event")

    def __init__(self, marked: bool):
        import cupy

        runtime = _runtime()
        self.array = cupy.empty(_WORKSPACE_BYTES, dtype=np.uint8)
        self.ptr = self.array.data.ptr
        self.event = runtime.eventCreateWithFlags(runtime.eventDisableTiming) if marked else 0

    def begin(self, stream: int) -> None:
        if self.event:
            _runtime().streamWaitEvent(stream, self.event, 0)

    def end(self, stream: int) -> None:
        if self.event:
            _runtime().eventRecord(self.event, stream)

    def release(self) -> None:
        """Drop the memory once the work enqueued with it has finished (a captured one: at once, see above)."""
        if self.event:
            runtime = _runtime()
            event, self.event = self.event, 0
            runtime.eventSynchronize(event)
            runtime.eventDestroy(event)
        self.array = None


class _Timer:
    """A thread's private non-blocking stream on one device for timing candidates, with its own workspace."""

    def __init__(self):
        runtime = _runtime()
        self.stream = runtime.streamCreateWithFlags(runtime.streamNonBlocking)
        self.workspace = _Workspace(marked=True)

    def release(self) -> None:
        self.workspace.release()
        _runtime().streamDestroy(self.stream)  # returns at once; CUDA frees the stream when its work is done


class _ThreadState:
    """One thread's cuBLAS handles, workspaces and timing streams; released when the thread's state is collected
    (its thread has ended), by a finalizer that does not reference the state itself."""

    def __init__(self):
        self.handles: dict = {}  # device -> handle of the direct path
        self.cupy_handles: dict = {}  # device -> handle of CuPy's bindings (where the direct path cannot load)
        self.workspaces: collections.OrderedDict = collections.OrderedDict()  # (device, stream) -> _Workspace
        self.captured: dict = {}  # (device, stream) -> _Workspace used while the stream was being captured
        self.timers: dict = {}  # device -> _Timer
        fin = weakref.finalize(self, _release_thread, self.handles, self.cupy_handles, self.workspaces,
                               self.captured, self.timers)
        fin.atexit = False  # at interpreter exit CUDA may be gone; the process frees everything anyway

    def handle(self, device: int) -> int:
        h = self.handles.get(device)
        if h is None:
            h = self.handles[device] = _take_handle("direct", device)
        return h

    def cupy_handle(self, device: int) -> int:
        h = self.cupy_handles.get(device)
        if h is None:
            h = self.cupy_handles[device] = _take_handle("cupy", device)
        return h

    def timer(self, device: int) -> _Timer:
        t = self.timers.get(device)
        if t is None:
            t = self.timers[device] = _Timer()
        return t

    def workspace(self, device: int, stream: int) -> _Workspace:
        """The workspace for the thread's next cuBLAS call on ``stream``."""
        timer = self.timers.get(device)
        if timer is not None and timer.stream == stream:
            return timer.workspace
        key = (device, stream)
        if _capturing(stream):
            ws = self.captured.get(key)
            if ws is None:
                ws = self.captured[key] = _Workspace(marked=False)
            return ws
        ws = self.workspaces.get(key)
        if ws is not None:
            self.workspaces.move_to_end(key)
            return ws
        while len(self.workspaces) >= _WORKSPACES_PER_THREAD:  # before allocating: the pool may hand it back
            self.workspaces.popitem(last=False)[1].release()
        ws = self.workspaces[key] = _Workspace(marked=True)
        return ws


def _state() -> _ThreadState:
    st = getattr(_tls, "state", None)
    if st is None:
        st = _tls.state = _ThreadState()
    return st


def _take_handle(kind: str, device: int) -> int:
    """A handle for the calling thread on ``device`` (the current device): an ended thread's, or a new one."""
    with _idle_lock:
        pool = _idle_handles.get((kind, device))
        if pool:
            return pool.pop()
    if kind == "cupy":
        return _libs()[1].create()
    import ctypes

    h = ctypes.c_void_p()
    _check(_load_direct().cublasCreate_v2(ctypes.byref(h)), "cublasCreate")
    return h.value


def _release_thread(handles, cupy_handles, workspaces, captured, timers) -> None:
    """Finalizer of a _ThreadState: its handles to the pool, its memory back once its work has finished."""
    if sys.is_finalizing():
        return
    with _idle_lock:
        for kind, held in (("direct", handles), ("cupy", cupy_handles)):
            for device, h in held.items():
                _idle_handles.setdefault((kind, device), []).append(h)
            held.clear()
    errors = []
    for item in [*workspaces.values(), *timers.values()]:
        try:
            item.release()
        except Exception as e:  # noqa: BLE001 - release the rest; the first error is reported below
            errors.append(e)
    workspaces.clear()
    timers.clear()
    captured.clear()  # see "Lifetimes": a graph replayed later holds captured_workspaces() itself
    if errors:
        raise errors[0]


def captured_workspaces() -> tuple:
    """The workspaces (CuPy arrays) the calling thread's GEMMs have used while their stream was being captured.

    A recorded graph reads and writes them at every replay; the thread keeps them for its life. A graph that may
    be replayed after its recording thread has ended keeps a reference to these arrays (their memory stays
    allocated while referenced). Replays of graphs recorded on the same stream share a workspace: run them in
    order (on one stream), not concurrently."""
    return tuple(ws.array for ws in _state().captured.values())


def take_captured_workspaces(*streams: int) -> tuple:
    """Hand the workspaces the calling thread's GEMMs used while ``streams`` were being captured to the caller (a
    recorded graph, which keeps them as long as it lives): the thread forgets them, so a later capture on those
    streams (or on new streams at the same addresses) gets workspaces of its own and two recordings never share
    one."""
    st = _state()
    keys = [k for k in st.captured if k[1] in streams]
    return tuple(st.captured.pop(k).array for k in keys)


def _workspace_keys() -> list:
    """(device, stream) of the calling thread's workspaces outside captures, least recently used first."""
    return list(_state().workspaces)


# ---- libraries ------------------------------------------------------------------------------------------------
def _runtime():
    """cupy_backends' CUDA runtime module (importing it needs the CUDA runtime, not cuBLAS)."""

    def make():
        from cupy_backends.cuda.api import runtime

        return runtime

    return once(_libraries, "runtime", make)


def _libs():
    """(cupy_backends runtime, cublas), imported on first use: importing them needs the CUDA libraries."""

    def make():
        from cupy_backends.cuda.libs import cublas

        return _runtime(), cublas

    return once(_libraries, "bindings", make)


def _handle(device: int) -> int:
    """The calling thread's handle of CuPy's cuBLAS bindings on ``device`` (the current device)."""
    return _state().cupy_handle(device)


# cublasGemmEx is called through ctypes on the libcublas CuPy has loaded, with the thread's handle and an explicit
# workspace: CuPy's bindings refuse every cuBLAS call while a stream is being captured, and the attention backward
# records its launch sequence into a CUDA graph. With its own workspace a recorded GEMM never allocates, and two
# streams never share scratch memory. Where that library cannot be found, GEMMs go through CuPy's bindings
# (per-thread handles too, bound to the current stream by the bindings) and nothing is recorded.
def _loaded(name: str) -> str:
    """Path of the one copy of library ``name`` (e.g. "libcublas") mapped into this process."""
    import re

    with open("/proc/self/maps") as f:
        paths = set(re.findall(r"(/\S*/" + name + r"\.so[.\d]*)\s*$", f.read(), re.M))
    if len(paths) != 1:
        raise OSError(f"expected one loaded {name}, found {sorted(paths) or 'none'}")
    return paths.pop()


def _load_direct():
    """The ctypes library of libcublas, or the reason it is unavailable (a str)."""

    def make():
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
            i64 = ctypes.c_int64
            lib.cublasGemmStridedBatchedEx.argtypes = [vp, i32, i32, i32, i32, i32, vp, vp, i32, i32, i64, vp, i32,
                                                       i32, i64, vp, vp, i32, i32, i64, i32, i32, i32]
            lib.cublasGemmBatchedEx.argtypes = [vp, i32, i32, i32, i32, i32, vp, vp, i32, i32, vp, i32, i32, vp, vp,
                                                i32, i32, i32, i32, i32]
            return lib
        except (OSError, AttributeError) as e:
            return f"{type(e).__name__}: {e}"

    return once(_libraries, "direct", make)


def capturable() -> bool:
    """Whether GEMMs can be recorded into a CUDA graph here (cuBLAS reached directly)."""
    return not isinstance(_load_direct(), str)


def _check(status: int, what: str) -> None:
    if status:
        raise RuntimeError(f"{what} failed with cuBLAS status {status}")


def _capturing(stream: int) -> bool:
    return _runtime().streamIsCapturing(stream) != 0


# ---- the product ----------------------------------------------------------------------------------------------
def _ld(x) -> int:
    """Row stride (elements) of a row-major 2-D array whose rows are contiguous (C-contiguous, or a column
    slice of one, such as the first T columns of a row-padded transposed copy)."""
    if x.ndim == 2 and x.size == 0:  # nothing is read (the product is empty or its sum is): any strides
        return max(x.shape[1], 1)
    if x.ndim != 2 or x.strides[1] != x.itemsize or x.strides[0] % x.itemsize:
        raise ValueError(f"gemm operands must be row-major 2-D arrays with contiguous rows, got shape {x.shape} "
                         f"and strides {x.strides}")
    if x.shape[0] > 1 and x.strides[0] < x.shape[1] * x.itemsize:  # reversed, broadcast or overlapping rows
        raise ValueError(f"gemm operands must have rows that follow each other in memory without overlapping, got "
                         f"shape {x.shape} and strides {x.strides}")
    return max(x.strides[0] // x.itemsize, x.shape[1], 1)


def _product(a, b, c, trans_a: bool, trans_b: bool, precision) -> tuple:
    """The product ``c = op(a) @ op(b)`` checked and described: (m, n, k, trans_a, trans_b, dtype, compute, lda,
    ldb, ctype), which is also its cublasGemmEx call and, with the device, pointer alignments and config, its plan's
    key. Reads only shapes, strides and dtypes (no device)."""
    label = Precision.parse(precision).label
    trans_a, trans_b = bool(trans_a), bool(trans_b)
    allowed = (BF16, F32) if label == "bf16" else (F32,)
    for which, x in (("a", a), ("b", b), ("c", c)):
        want = ((F32, BF16) if a.dtype == BF16 else (F32,)) if which == "c" else allowed
        if x.dtype not in want:
            raise TypeError(f"gemm {which} must be {' or '.join(map(dtype_name, want))} for precision {label!r}, got "
                            f"{dtype_name(x.dtype)}")
    if a.dtype != b.dtype:  # bf16 with one operand of each: cuBLAS(Lt) has no such product
        raise TypeError(f"gemm a and b must both be bfloat16 or both float32 for precision 'bf16', got "
                        f"{dtype_name(a.dtype)} and {dtype_name(b.dtype)}: cast the float32 one to bfloat16 first")
    if a.ndim != 2 or b.ndim != 2 or c.ndim != 2:
        raise ValueError(f"gemm takes 2-D arrays, got {a.ndim}-D, {b.ndim}-D -> {c.ndim}-D")
    m, k = (a.shape[1], a.shape[0]) if trans_a else a.shape
    kb, n = (b.shape[1], b.shape[0]) if trans_b else b.shape
    if k != kb or c.shape != (m, n):
        raise ValueError(f"gemm shapes do not agree: {a.shape}{'^T' if trans_a else ''} x "
                         f"{b.shape}{'^T' if trans_b else ''} -> {c.shape}")
    if not c.flags.c_contiguous:
        raise ValueError("gemm output must be C-contiguous")
    dtype = CUDA_R_16BF if a.dtype == BF16 else CUDA_R_32F
    # bf16 on fp32 operands: COMPUTE_32F_FAST_16BF, which rounds them to bf16 inside the product
    compute = {"fp32": COMPUTE_32F, "tf32": COMPUTE_32F_FAST_TF32,
               "bf16": COMPUTE_32F if dtype == CUDA_R_16BF else COMPUTE_32F_FAST_16BF}[label]
    lda, ldb = _ld(a), _ld(b)
    if max(m, n, k, lda, ldb) > _INT_MAX:
        raise ValueError(f"gemm sizes and row strides must fit cuBLAS's int: m={m}, n={n}, k={k}, row strides "
                         f"{lda} and {ldb} (at most {_INT_MAX})")
    return m, n, k, trans_a, trans_b, dtype, compute, lda, ldb, CUDA_R_16BF if c.dtype == BF16 else CUDA_R_32F


def _checked(a, b, c, trans_a, trans_b, precision, config) -> tuple:
    """(product, config) after the host-side checks of :func:`gemm`'s arguments."""
    import cupy

    if config is None:
        config = DEFAULT_CONFIG
    elif not isinstance(config, GemmConfig):
        raise TypeError(f"config must be a GemmConfig or None, got {type(config).__name__}")
    for name, x in (("a", a), ("b", b), ("c", c)):
        if not isinstance(x, cupy.ndarray):
            raise TypeError(f"gemm {name} must be a cupy.ndarray, got {type(x).__module__}.{type(x).__name__}")
    return _product(a, b, c, trans_a, trans_b, precision), config


def _on_device(a, b, c) -> int:
    """The current device, which every operand must be on."""
    device = _runtime().getDevice()
    for name, x in (("a", a), ("b", b), ("c", c)):
        if x.data.device_id != device:
            raise ValueError(f"gemm {name} lives on GPU {x.data.device_id} but the current device is GPU {device}")
    return device


def gemm(a, b, c, *, trans_a: bool, trans_b: bool, precision, stream: int, accumulate: bool = False,
         config: GemmConfig | None = None, bias=None) -> None:
    """``c = op(a) @ op(b)`` for row-major 2-D arrays; op transposes when asked.

    ``c`` is C-contiguous; ``a`` and ``b`` may also be column slices of C-contiguous arrays (rows padded).
    ``a``/``b`` are fp32 (``fp32``/``tf32``), or both bf16 or both fp32 (``bf16``: fp32 operands are rounded to
    bf16 inside the product); ``c`` is fp32 (or bf16 where ``a`` and ``b`` are: the fp32 sum rounded once) and
    is overwritten, or added to when ``accumulate``.
    ``bias``: None, or a vector [n] of ``c``'s type (cuBLASLt's bias type: bf16 for a bf16 ``c``), 16-byte
    aligned, added to every row of the fp32 sum before it is rounded into ``c`` (cuBLASLt's BIAS epilogue; where
    cuBLASLt is not reached, ``c`` is filled with the rows first and the product added to them); not with
    ``accumulate``.
    ``precision``: a :class:`~cupy_rope.precision.Precision` or its label.
    ``stream``: the raw pointer of the stream to run on (the current stream where cuBLAS is reached through
    CuPy's bindings). ``config``: a :class:`GemmConfig` (default :data:`DEFAULT_CONFIG`).
    Everything is checked before any work is enqueued."""
    if isinstance(stream, bool) or not isinstance(stream, numbers.Integral):
        raise TypeError(f"stream must be a raw stream pointer (an int such as cupy.cuda.get_current_stream().ptr), "
                        f"got {type(stream).__name__}")
    ex, config = _checked(a, b, c, trans_a, trans_b, precision, config)
    device = _on_device(a, b, c)
    m, n, k = ex[:3]
    if bias is not None:
        _check_bias(bias, c, n, accumulate, device)
    stream = int(stream)
    if m == 0 or n == 0:
        return
    if bias is not None and (k == 0 or not capturable() or _lt_library() is None):
        _fill_rows(c, bias, stream)  # no epilogue here (or an empty sum): the bias rows first, the product added
        accumulate, bias = True, None
    if k == 0:
        if not accumulate:
            _runtime().memsetAsync(c.data.ptr, 0, c.nbytes, stream)  # an empty sum: zeros (+0.0 is all-zero bits)
        return
    direct = capturable()
    _tls.calls = calls() + 1
    if not direct:  # CuPy's gemmEx binds the handle to the current stream itself
        _libs()[1].gemmEx(_handle(device), *_gemm_ex_args(ex, a, b, c, accumulate))
    elif _lt_library() is None:
        _gemm_ex(ex, a, b, c, device, stream, accumulate)
    else:
        plan = _lt_plan(device, ex, a, b, c, config, bias)
        plan.run(plan.choose(a, b, c, stream, accumulate, bias), a, b, c, stream, accumulate, device, bias)


def _check_bias(bias, c, n: int, accumulate: bool, device: int) -> None:
    import cupy

    if not isinstance(bias, cupy.ndarray):
        raise TypeError(f"gemm bias must be a cupy.ndarray, got {type(bias).__module__}.{type(bias).__name__}")
    if bias.dtype != c.dtype or bias.shape != (n,) or not bias.flags.c_contiguous:
        raise ValueError(f"gemm bias must be a contiguous {dtype_name(c.dtype)} vector (the output's type) of its "
                         f"{n} columns, got {dtype_name(bias.dtype)} of shape {bias.shape}")
    if bias.data.ptr % 16:
        raise ValueError("gemm bias must be 16-byte aligned")
    if bias.data.device_id != device:
        raise ValueError(f"gemm bias lives on GPU {bias.data.device_id} but the current device is GPU {device}")
    if accumulate:
        raise ValueError("gemm takes a bias or accumulate, not both")


class _RawStream:
    """A raw stream pointer under the CUDA stream protocol (``__cuda_stream__``: version 0 and the handle)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple:
        return 0, self.ptr


def _fill_rows(c, bias, stream: int) -> None:
    import cupy

    # CuPy 14 wraps a foreign stream with Stream.from_external (ExternalStream is deprecated there); CuPy 13 has
    # only ExternalStream.
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    with from_external(_RawStream(stream)) if from_external else cupy.cuda.ExternalStream(stream):
        c[...] = bias[None, :]


def plan_for(a, b, c, *, trans_a: bool, trans_b: bool, precision, config: GemmConfig | None = None,
             bias=None) -> "_LtPlan":
    """The cublasLt plan :func:`gemm` uses for this product under ``config`` (and with ``bias``, its BIAS
    epilogue) on the current device (made if new; its candidates are timed by gemm's first call). Needs the
    direct cuBLAS path and cublasLt."""
    ex, config = _checked(a, b, c, trans_a, trans_b, precision, config)
    device = _on_device(a, b, c)
    if bias is not None:
        _check_bias(bias, c, ex[1], False, device)
    if not capturable() or _lt_library() is None:
        raise RuntimeError(f"no cublasLt plans here: {_lt_problem()}")
    return _lt_plan(device, ex, a, b, c, config, bias)


def _gemm_ex_args(ex, a, b, c, accumulate):
    """cublasGemmEx's arguments for product ``ex`` (see _product)."""
    m, n, k, trans_a, trans_b, dtype, compute, lda, ldb, ctype = ex
    # Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: swap the operands.
    return (1 if trans_b else 0, 1 if trans_a else 0, n, m, k,  # CUBLAS_OP_T = 1, CUBLAS_OP_N = 0
            _ONE_PTR, b.data.ptr, dtype, ldb, a.data.ptr, dtype, lda,
            _ONE_PTR if accumulate else _ZERO_PTR, c.data.ptr, ctype, n, compute, GEMM_DEFAULT)


def _direct_call(fn: str, args: tuple, device: int, stream: int) -> None:
    """cuBLAS function ``fn`` of the direct library on the thread's handle, bound to ``stream`` and its workspace
    (cublasSetStream resets the workspace, so both are set before every call)."""
    lib = _load_direct()
    st = _state()
    h = st.handle(device)
    ws = st.workspace(device, stream)
    ws.begin(stream)
    try:
        _check(lib.cublasSetStream_v2(h, stream), "cublasSetStream")
        _check(lib.cublasSetWorkspace_v2(h, ws.ptr, _WORKSPACE_BYTES), "cublasSetWorkspace")
        _check(getattr(lib, fn)(h, *args), fn)
    finally:
        ws.end(stream)


def _gemm_ex(ex, a, b, c, device: int, stream: int, accumulate: bool) -> None:
    """cublasGemmEx through the direct library (see _direct_call)."""
    _direct_call("cublasGemmEx", _gemm_ex_args(ex, a, b, c, accumulate), device, stream)


def _batch_compute(what, m, n, k, lda, trans_a, ldb, trans_b, ldc, batch, precision, stream):
    """The checks shared by the batched products: sizes and row strides, the stream; the cuBLAS compute type of
    ``precision``, or None when there is nothing to compute."""
    sizes = dict(m=m, n=n, k=k, lda=lda, ldb=ldb, ldc=ldc, batch=batch)
    for name, v in sizes.items():
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not 0 <= v <= _INT_MAX:
            raise ValueError(f"{what} {name} must be an int in [0, {_INT_MAX}], got {v!r}")
    if isinstance(stream, bool) or not isinstance(stream, numbers.Integral):
        raise TypeError(f"stream must be a raw stream pointer, got {type(stream).__name__}")
    rows_a, rows_b = (k, m) if trans_a else (m, k), (n, k) if trans_b else (k, n)
    if lda < max(1, rows_a[1]) or ldb < max(1, rows_b[1]) or ldc < max(1, n):
        raise ValueError(f"{what} row strides too short: lda={lda}, ldb={ldb}, ldc={ldc} for m={m}, n={n}, k={k}")
    label = Precision.parse(precision).label
    compute = {"fp32": COMPUTE_32F, "tf32": COMPUTE_32F_FAST_TF32, "bf16": COMPUTE_32F_FAST_16BF}[label]
    if not m or not n or not batch:
        return None
    if not k:
        raise ValueError(f"{what} needs k > 0 (an empty sum is the caller's zeros)")
    return compute


def gemm_strided_batched(m: int, n: int, k: int, a: int, lda: int, stride_a: int, trans_a: bool, b: int, ldb: int,
                         stride_b: int, trans_b: bool, c: int, ldc: int, stride_c: int, batch: int, *, precision,
                         stream: int) -> None:
    """``batch`` row-major products ``c_i = op(a_i) @ op(b_i)`` of fp32 matrices (``cublasGemmStridedBatchedEx``):
    ``a_i`` starts ``i * stride_a`` elements after the device address ``a`` and has row stride ``lda`` (likewise
    ``b``, ``c``); ``c_i`` is ``m x n`` and overwritten, the contraction ``k`` long. ``precision`` as for
    :func:`gemm` (``bf16`` rounds the fp32 operands inside the product). cuBLAS's heuristic kernel, deterministic;
    more than BATCH_MAX entries run as several calls. The caller owns the layout: only the sizes are checked."""
    compute = _batch_compute("gemm_strided_batched", m, n, k, lda, trans_a, ldb, trans_b, ldc, batch, precision,
                             stream)
    if compute is None:
        return
    device = _runtime().getDevice()
    for i in range(0, batch, BATCH_MAX):  # byte addresses; strides in fp32 elements
        args = (1 if trans_b else 0, 1 if trans_a else 0, n, m, k,  # row-major C = column-major C^T: swapped
                _ONE_PTR, int(b) + 4 * i * int(stride_b), CUDA_R_32F, ldb, int(stride_b),
                int(a) + 4 * i * int(stride_a), CUDA_R_32F, lda, int(stride_a), _ZERO_PTR,
                int(c) + 4 * i * int(stride_c), CUDA_R_32F, ldc, int(stride_c), min(BATCH_MAX, batch - i), compute,
                GEMM_DEFAULT)
        _batched_call(args, device, int(stream))


BATCH_MAX = 65535  # batch entries per cublasGemmStridedBatchedEx call (a grid dimension's limit)


def gemm_batched(m: int, n: int, k: int, a: int, lda: int, trans_a: bool, b: int, ldb: int, trans_b: bool, c: int,
                 ldc: int, batch: int, *, precision, stream: int) -> None:
    """``batch`` row-major products ``c_i = op(a_i) @ op(b_i)`` of fp32 matrices anywhere in memory
    (``cublasGemmBatchedEx``): ``a``, ``b`` and ``c`` are device addresses of arrays of ``batch`` device pointers,
    one matrix each, with row strides ``lda``, ``ldb``, ``ldc``; otherwise as :func:`gemm_strided_batched`. Needs
    the direct cuBLAS library (:func:`capturable`): CuPy's bindings have no such call."""
    compute = _batch_compute("gemm_batched", m, n, k, lda, trans_a, ldb, trans_b, ldc, batch, precision, stream)
    if compute is None:
        return
    if not capturable():
        raise RuntimeError(f"gemm_batched needs the cuBLAS library itself: {_load_direct()}")
    device = _runtime().getDevice()
    for i in range(0, batch, BATCH_MAX):  # the pointer arrays advance by 8 bytes an entry
        args = (1 if trans_b else 0, 1 if trans_a else 0, n, m, k,  # row-major C = column-major C^T: swapped
                _ONE_PTR, int(b) + 8 * i, CUDA_R_32F, ldb, int(a) + 8 * i, CUDA_R_32F, lda, _ZERO_PTR,
                int(c) + 8 * i, CUDA_R_32F, ldc, min(BATCH_MAX, batch - i), compute, GEMM_DEFAULT)
        _tls.calls = calls() + 1
        _direct_call("cublasGemmBatchedEx", args, device, int(stream))


def _batched_call(args: tuple, device: int, stream: int) -> None:
    """One cublasGemmStridedBatchedEx: through the direct library (thread's handle, bound to ``stream`` and its
    workspace) or, where that cannot load, CuPy's bindings on the current stream."""
    _tls.calls = calls() + 1
    if not capturable():
        _libs()[1].gemmStridedBatchedEx(_handle(device), *args)
        return
    _direct_call("cublasGemmStridedBatchedEx", args, device, stream)


# ---- cublasLt: the same products with the kernel chosen by measurement ------------------------------------
# cublasGemmEx takes the first kernel of cuBLAS's heuristic. For the skinny and mid-sized products of the
# attention backward (a few hundred tokens against 3584 x 10752 weights) that choice often leaves SMs idle in a
# last partial wave, where another tile shape or a split-K kernel fills them. The first call of each product
# (shapes, layouts, pointer alignment, precision, config) times cuBLAS's top candidates and keeps the fastest
# (cublasGemmEx's own kernel among them) for the rest of the process, so calls after the first are deterministic,
# bit for bit; another process may time a different winner. A product first met while its stream is being
# captured, or that accumulates into its output, goes through cublasGemmEx.
# One more candidate where the rows of C (tokens, in the attention backward) are not a multiple of
# config.split_rows: the same product as two calls, the whole split_rows-row tiles and then the remainder rows, so
# that no kernel pays a whole row of tiles for a few rows (each part with its own timed choice).
#
# Timing never synchronizes the device: a device-wide synchronize in one thread invalidates a stream capture in
# another. The candidates run on the thread's private stream, which first waits for the caller's stream (a, b and
# c as the caller has them); the host waits only for the private stream's events, and the caller's stream then
# waits for the private stream, since both write c. Work of other streams may overlap the timing: that can only
# change which kernel wins, never the result of the kernel that does.
SPLIT = -2  # the candidate index of the row split
_lt_handles: dict = {}  # device -> cublasLt handle (cublasLtMatmul takes the stream and workspace per call)
_lt_plans: dict = {}  # (device, product, alignments, config) -> _LtPlan
_autotune = threading.Event()  # set: time candidates (the default); see set_gemm_autotune
_autotune.set()


def set_gemm_autotune(enabled: bool) -> None:
    """Choose each product's cuBLAS kernel by timing cuBLAS's candidates on first use (the default), or take
    cuBLAS's heuristic choice. Products already tuned keep their choice. Process-wide; safe from any thread."""
    if enabled:
        _autotune.set()
    else:
        _autotune.clear()


def gemm_autotune() -> bool:
    """Whether products met for the first time are timed (see :func:`set_gemm_autotune`)."""
    return _autotune.is_set()


def _lt_load():
    def make():
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
            lib.cublasLtMatmulAlgoConfigSetAttribute.argtypes = [vp, i32, vp, sz]
            lib.cublasLtMatmulAlgoConfigGetAttribute.argtypes = [vp, i32, vp, sz, ctypes.POINTER(sz)]
            lib.cublasLtMatmulAlgoCheck.argtypes = [vp, vp, vp, vp, vp, vp, vp, vp]
            return lib
        except (OSError, AttributeError) as e:
            return f"{type(e).__name__}: {e}"

    return once(_libraries, "lt", make)


def _lt_library():
    """The ctypes library of libcublasLt, or None where it is unavailable (see _lt_problem)."""
    lib = _lt_load()
    return None if isinstance(lib, str) else lib


def _lt_problem() -> str | None:
    """Why GEMMs do not go through cublasLt here, or None."""
    direct = _load_direct()
    if isinstance(direct, str):
        return f"libcublas cannot be reached directly ({direct})"
    lt = _lt_load()
    return f"libcublasLt cannot be reached ({lt})" if isinstance(lt, str) else None


_RESULT_BYTES = 96  # sizeof(cublasLtMatmulHeuristicResult_t): algo (64), workspaceSize, state, wavesCount, reserved[4]


class _LtPlan:
    """One product's cublasLt descriptors and candidate kernels (and, once timed, the chosen one). Shared by all
    threads: the descriptors are only read, and the choice is made once, under the plan's lock."""

    def __init__(self, lib, handle, ex, aligns, config: GemmConfig):
        import ctypes

        def new(fn, *args):
            obj = ctypes.c_void_p()
            _check(fn(ctypes.byref(obj), *args), fn.__name__)
            return obj

        def setattr_(fn, obj, attr, v):  # v: a ctypes value of the attribute's type
            _check(fn(obj, attr, ctypes.byref(v), ctypes.sizeof(v)), fn.__name__)

        self.lib, self.handle, self.config = lib, handle, config
        self.ex = ex  # see _product: also the product's cublasGemmEx call
        self.bias = "bias" in aligns  # the BIAS epilogue (gemm's bias): no cublasGemmEx or split candidate
        m, n, k, trans_a, trans_b, dtype, compute, lda, ldb, ctype = ex
        # Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: cuBLAS's "A" is our b.
        self.desc = new(lib.cublasLtMatmulDescCreate, compute, CUDA_R_32F)
        setattr_(lib.cublasLtMatmulDescSetAttribute, self.desc, 3, ctypes.c_int32(int(trans_b)))  # TRANSA
        setattr_(lib.cublasLtMatmulDescSetAttribute, self.desc, 4, ctypes.c_int32(int(trans_a)))  # TRANSB
        if self.bias:  # column-major C^T's rows are our columns: the bias runs along them, of C's type (cuBLASLt
            # 13 refuses an fp32 bias, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, beside a bf16 C)
            setattr_(lib.cublasLtMatmulDescSetAttribute, self.desc, 7, ctypes.c_uint32(4))  # EPILOGUE = BIAS
            # the heuristic reads the pointer's alignment only: 16 bytes, as gemm requires of a bias
            setattr_(lib.cublasLtMatmulDescSetAttribute, self.desc, 8, ctypes.c_uint64(16))  # BIAS_POINTER
        self._desc_lock = threading.Lock()  # the bias pointer is set on the shared descriptor for each call
        la = new(lib.cublasLtMatrixLayoutCreate, dtype, *((k, n) if trans_b else (n, k)), ldb)
        lb = new(lib.cublasLtMatrixLayoutCreate, dtype, *((m, k) if trans_a else (k, m)), lda)
        lc = new(lib.cublasLtMatrixLayoutCreate, ctype, n, m, n)
        self.layouts = (la, lb, lc)
        pref = new(lib.cublasLtMatmulPreferenceCreate)
        max_workspace = ctypes.c_uint64(_WORKSPACE_BYTES)
        setattr_(lib.cublasLtMatmulPreferenceSetAttribute, pref, 1, max_workspace)  # MAX_WORKSPACE_BYTES
        for attr, align in zip((5, 6, 7, 8), aligns):  # MIN_ALIGNMENT_{A,B,C,D}_BYTES
            setattr_(lib.cublasLtMatmulPreferenceSetAttribute, pref, attr, ctypes.c_uint32(align))
        wanted = config.lt_candidates
        results = (ctypes.c_char * (_RESULT_BYTES * wanted))()
        count = ctypes.c_int(0)
        _check(lib.cublasLtMatmulAlgoGetHeuristic(handle, self.desc, la, lb, lc, lc, pref, wanted, results,
                                                  ctypes.byref(count)), "cublasLtMatmulAlgoGetHeuristic")
        lib.cublasLtMatmulPreferenceDestroy(pref)
        if count.value == 0:
            raise RuntimeError(f"cublasLt has no kernel for this product (m={m}, n={n}, k={k}"
                               f"{', bias epilogue' if self.bias else ''})")
        raw = bytes(results)
        self.algos = [ctypes.create_string_buffer(raw[i * _RESULT_BYTES:i * _RESULT_BYTES + 64], 64)
                      for i in range(count.value)]
        self.labels = [f"lt{i}" for i in range(count.value)]
        for i, algo in enumerate(list(self.algos)):
            for parts in config.split_k:
                split = self._split_k(lib, handle, algo, parts)
                if split is not None:
                    self.algos.append(split)
                    self.labels.append(f"lt{i}k{parts}")
        # rows of the first part of the split candidate (0: none): row slices of A, or column slices of A^T
        rows = config.split_rows
        self.split = m - m % rows if rows and m > rows and m % rows and not self.bias else 0
        self.chosen = None  # once timed: -1 (cublasGemmEx's own choice), SPLIT, or an index into algos
        self.times_us = None  # {candidate: µs} of the timing
        self._lock = threading.Lock()  # one thread times; the others wait for its choice

    def _split_k(self, lib, handle, algo, parts: int):
        """A copy of ``algo`` with the contraction split ``parts`` ways, or None where the kernel does not take
        it (cublasLtMatmulAlgoCheck refuses, or its workspace exceeds ours)."""
        import ctypes

        cur, written = ctypes.c_uint32(0), ctypes.c_size_t(0)
        if lib.cublasLtMatmulAlgoConfigGetAttribute(algo, 2, ctypes.byref(cur), 4, ctypes.byref(written)) != 0:
            return None  # no SPLITK_NUM attribute: a kernel that chooses its own split
        if cur.value == parts:
            return None
        copy = ctypes.create_string_buffer(algo.raw, 64)
        for attr, value in ((2, parts), (3, 2)):  # SPLITK_NUM; REDUCTION_SCHEME = COMPUTE_TYPE
            v = ctypes.c_uint32(value)
            if lib.cublasLtMatmulAlgoConfigSetAttribute(copy, attr, ctypes.byref(v), 4) != 0:
                return None
        result = (ctypes.c_char * _RESULT_BYTES)()
        la, lb, lc = self.layouts
        if lib.cublasLtMatmulAlgoCheck(handle, self.desc, la, lb, lc, lc, copy, result) != 0:
            return None
        workspace = int.from_bytes(bytes(result)[64:72], "little")
        return copy if workspace <= _WORKSPACE_BYTES else None

    def label(self, index: int) -> str:
        """A candidate's name: gemmEx (-1), split (SPLIT), lt<i> (the heuristic's i-th), lt<i>k<n> (split-K)."""
        return "gemmEx" if index == -1 else "split" if index == SPLIT else self.labels[index]

    def candidates(self) -> list:
        if self.bias:
            return list(range(len(self.algos)))
        return [-1] + ([SPLIT] if self.split else []) + list(range(len(self.algos)))

    def choose(self, a, b, c, stream: int, accumulate: bool, bias=None) -> int:
        """The kernel to use: the timed choice, or cublasGemmEx's (-1) until there is one (with the bias
        epilogue, the heuristic's first, 0)."""
        if self.chosen is not None:
            return self.chosen
        if accumulate or not _autotune.is_set() or _capturing(stream):
            return 0 if self.bias else -1
        with self._lock:
            if self.chosen is None:
                self._time(a, b, c, stream, bias)
        return self.chosen

    def _time(self, a, b, c, stream: int, bias=None) -> None:
        """Time every candidate on the thread's private stream (see above) and keep the fastest."""
        runtime = _runtime()
        device = runtime.getDevice()
        private = _state().timer(device).stream
        # Fresh events: the split candidate's parts time their own plans inside the warm-up run below.
        start, stop = runtime.eventCreate(), runtime.eventCreate()
        mark = runtime.eventCreateWithFlags(runtime.eventDisableTiming)
        times = {}
        try:
            if private != stream:  # the split's parts are timed on the private stream itself
                runtime.eventRecord(mark, stream)
                runtime.streamWaitEvent(private, mark, 0)
            for i in self.candidates():
                try:
                    self.run(i, a, b, c, private, False, device, bias)  # warm-up: c is overwritten after
                    runtime.eventRecord(start, private)
                    self.run(i, a, b, c, private, False, device, bias)
                    runtime.eventRecord(stop, private)
                    runtime.eventSynchronize(stop)
                    times[i] = runtime.eventElapsedTime(start, stop) * 1e3
                except RuntimeError:
                    if i < 0:  # cublasGemmEx itself failed: a real error, not a candidate to skip
                        raise
                    runtime.eventRecord(stop, private)
                    runtime.eventSynchronize(stop)
        finally:
            if private != stream:  # the caller's later work on c comes after the timing's writes
                runtime.eventRecord(mark, private)
                runtime.streamWaitEvent(stream, mark, 0)
            for ev in (start, stop, mark):
                runtime.eventDestroy(ev)
        self.times_us = times
        self.chosen = min(times, key=times.__getitem__)

    def run(self, index: int, a, b, c, stream: int, accumulate: bool, device: int | None = None,
            bias=None) -> None:
        """``c = a b`` (as the plan's layouts say; ``+ bias`` on every row where the plan has the epilogue, which
        then needs it) with candidate ``index`` (-1: cublasGemmEx, SPLIT: two calls), on ``device`` (default: the
        current one)."""
        if self.bias != (bias is not None):
            raise ValueError("this plan " + ("adds a bias: pass one" if self.bias else "has no bias epilogue"))
        if index == SPLIT:  # each part goes through gemm(), with its own plan and timed choice
            m0, precision, trans_a = self.split, _precision(self.ex), self.ex[3]
            for rows in (slice(0, m0), slice(m0, None)):
                gemm(a[:, rows] if trans_a else a[rows], b, c[rows], trans_a=trans_a, trans_b=self.ex[4],
                     precision=precision, stream=stream, accumulate=accumulate, config=self.config)
            return
        if device is None:
            device = _runtime().getDevice()
        if index < 0:
            _gemm_ex(self.ex, a, b, c, device, stream, accumulate)
            return
        la, lb, lc = self.layouts
        ws = _state().workspace(device, stream)
        ws.begin(stream)
        try:
            if self.bias:  # the descriptor is read when the call is issued: the pointer stays set that long
                import ctypes

                with self._desc_lock:
                    ptr = ctypes.c_uint64(bias.data.ptr)
                    _check(self.lib.cublasLtMatmulDescSetAttribute(self.desc, 8, ctypes.byref(ptr), 8),
                           "cublasLtMatmulDescSetAttribute")
                    self._matmul(index, a, b, c, stream, accumulate, ws)
            else:
                self._matmul(index, a, b, c, stream, accumulate, ws)
        finally:
            ws.end(stream)

    def _matmul(self, index, a, b, c, stream, accumulate, ws) -> None:
        la, lb, lc = self.layouts
        _check(self.lib.cublasLtMatmul(self.handle, self.desc, _ONE_PTR, b.data.ptr, la, a.data.ptr, lb,
                                       _ONE_PTR if accumulate else _ZERO_PTR, c.data.ptr, lc, c.data.ptr, lc,
                                       self.algos[index], ws.ptr, _WORKSPACE_BYTES, stream), "cublasLtMatmul")


def _precision(ex) -> str:
    dtype, compute = ex[5], ex[6]
    if dtype == CUDA_R_16BF or compute == COMPUTE_32F_FAST_16BF:
        return "bf16"
    return "tf32" if compute == COMPUTE_32F_FAST_TF32 else "fp32"


def _alignment(ptr: int) -> int:
    return min(256, ptr & -ptr) if ptr else 256


def _lt_plan(device, ex, a, b, c, config: GemmConfig, bias=None) -> _LtPlan:
    aligns = (_alignment(b.data.ptr), _alignment(a.data.ptr), _alignment(c.data.ptr), _alignment(c.data.ptr))
    if bias is not None:  # the BIAS epilogue's plan: its own heuristic candidates and timing
        aligns += ("bias",)
    lib = _lt_library()

    def new_handle():
        import ctypes

        h = ctypes.c_void_p()
        _check(lib.cublasLtCreate(ctypes.byref(h)), "cublasLtCreate")
        return h.value

    return once(_lt_plans, (device, ex, aligns, config),
                lambda: _LtPlan(lib, once(_lt_handles, device, new_handle), ex, aligns, config))


# ---- removed switches -----------------------------------------------------------------------------------------
# These were module variables that scripts reassigned; assigning one now would silently change nothing, so the
# module refuses it and says what replaced it.
_REPLACED = {
    "SPLIT_ROWS": "pass config=GemmConfig(split_rows=...) to gemm/plan_for",
    "_LT_CANDIDATES": "pass config=GemmConfig(lt_candidates=...) to gemm/plan_for",
    "_lt_autotune": "call set_gemm_autotune(enabled)",
    "_lt": "GEMMs use cublasLt wherever it loads; candidate -1 of a plan is cublasGemmEx",
    "_direct": "GEMMs reach libcublas directly wherever it loads (see capturable())",
}


class _Module(types.ModuleType):
    def __setattr__(self, name, value):
        if name in _REPLACED:
            raise AttributeError(f"cupy_rope._cublas.{name} no longer exists: {_REPLACED[name]}")
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Module
