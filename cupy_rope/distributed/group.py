"""The process group: NCCL through ``cupyx.distributed``, started from the launcher's environment, and a
shutdown that lets every process exit by itself.

Why a shutdown of our own. ``cupyx.distributed.init_process_group`` starts, on rank 0, a TCP rendezvous
store in a child process (``multiprocessing``, not a daemon) whose server loop runs until a shared flag is
cleared. Its own ``stop()`` does nothing once the interpreter is exiting (cupyx sets an exit flag in an
atexit hook), and ``multiprocessing`` joins non-daemon children at exit: rank 0 then waits forever for a
server that never stops. The store is only needed for the rendezvous (the NCCL unique id and one barrier),
and ``ncclCommInitRank`` returns on rank 0 only once every rank has joined, so :func:`init` stops the store
right after the communicator exists. :func:`shutdown` (also registered with ``atexit``) stops it if it is
still up, then destroys the communicator, or aborts it when collectives are still pending (a peer died):
``ncclCommDestroy`` would wait for them forever, ``ncclCommAbort`` makes the waiting kernels return.

Environment (set by ``python -m cupy_rope.distributed``; torchrun's names are read as a fallback):
``CUPY_ROPE_RANK`` (``RANK``), ``CUPY_ROPE_WORLD_SIZE`` (``WORLD_SIZE``), ``CUPY_ROPE_LOCAL_RANK``
(``LOCAL_RANK``; the GPU this process uses, default the rank), ``CUPY_ROPE_MASTER_ADDR`` (``MASTER_ADDR``,
default 127.0.0.1), ``CUPY_ROPE_MASTER_PORT`` (``MASTER_PORT``, default 13333), ``CUPY_ROPE_TIMEOUT``
(seconds a host wait on the other ranks may take before it raises, default 600).
"""
from __future__ import annotations

import atexit
import functools
import multiprocessing
import os
import sys
import threading
import time

import numpy as np

__all__ = ["ProcessGroup", "DistributedError", "NCCLUnavailableError", "init", "shutdown", "current",
           "INSTALL_HINT"]

INSTALL_HINT = ('pip install "cupy-rope[distributed-cuda12]" (CUDA 12) or '
                'pip install "cupy-rope[distributed-cuda13]" (CUDA 13)')
DEFAULT_TIMEOUT_S = 600.0
_STORE_STOP_S = 5.0  # the store's server loop polls its run flag every 0.5 s
_SMALL = 32 << 10  # bytes of the host all-reduce's staging buffers
_HIGHEST_PRIORITY = -100  # below any device's range: cudaStreamCreateWithPriority clamps it


class NCCLUnavailableError(ImportError, RuntimeError):
    """NCCL cannot be loaded by CuPy (the ``nvidia-nccl`` wheel is missing); both an ImportError and a
    RuntimeError, so either ``except`` catches it."""


class DistributedError(RuntimeError):
    """A collective step failed on one or more ranks; raised on every rank with the failing ranks' messages."""


def _env(names, default=None):
    for n in names:
        v = os.environ.get(n)
        if v not in (None, ""):
            return v
    return default


def _env_int(names, default=None):
    v = _env(names)
    if v is None:
        return default
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"environment variable {names[0]} must be an integer, got {v!r}") from None


def timeout_s() -> float:
    """Seconds a host wait on the other ranks may last before it raises (``CUPY_ROPE_TIMEOUT``)."""
    v = os.environ.get("CUPY_ROPE_TIMEOUT")
    return float(v) if v else DEFAULT_TIMEOUT_S


def nccl_module():
    """``cupy.cuda.nccl`` when NCCL loads, else :class:`NCCLUnavailableError` naming the install extra."""
    try:
        from cupy.cuda import nccl
    except ImportError as e:
        raise NCCLUnavailableError(f"NCCL is not available: importing cupy.cuda.nccl failed ({e}). "
                                   f"Install it with {INSTALL_HINT}.") from e
    if not getattr(nccl, "available", False):
        raise NCCLUnavailableError("NCCL is not available: CuPy could not load libnccl.so.2. "
                                   f"Install it with {INSTALL_HINT}.")
    return nccl


def _quiet_mpi4py():
    """cupyx.distributed imports mpi4py when it is installed, and ``from mpi4py import MPI`` calls MPI_Init,
    which outside mpirun can stall or fail; the TCP rendezvous used here needs no MPI, so keep it off."""
    if "mpi4py.MPI" in sys.modules:
        return
    try:
        import mpi4py
    except ImportError:
        return
    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = False


class ProcessGroup:
    """This process's NCCL communicator (one GPU per process) and the stream its collectives run on.

    Every collective of the group is enqueued on ``stream`` (a non-blocking stream of this device), so the
    order in which this process issues them is the order they run in: NCCL needs every rank to issue the
    same collectives in the same order."""

    def __init__(self, backend, rank: int, world_size: int, device: int):
        import cupy

        self.backend = backend  # the cupyx.distributed NCCLBackend (its ._comm is the NcclCommunicator)
        self.nccl = backend._comm
        self.rank, self.world_size, self.device = rank, world_size, device
        with cupy.cuda.Device(device):
            # High priority: an all-reduce enqueued while a long GEMM fills the GPU gets its few blocks onto
            # SMs as soon as GEMM blocks retire, instead of after the GEMM's last wave (no overlap then).
            # CUDA clamps the value to the device's highest priority.
            self.stream = cupy.cuda.Stream(non_blocking=True, priority=_HIGHEST_PRIORITY)
            self._done = cupy.cuda.Event(block=False, disable_timing=True)
            self._pinned = cupy.cuda.alloc_pinned_memory(2 * _SMALL)  # send half, receive half
            self._small = cupy.empty(_SMALL, np.uint8)  # only ever written by copies on self.stream
        self.closed = False
        self.failed = False  # set when a collective step failed on this rank; shutdown then aborts

    # -- collectives on self.stream ---------------------------------------------------------------------

    def all_reduce_(self, arrays, op: str = "sum") -> None:
        """In-place all-reduce of each array (one NCCL group, so one launch), enqueued on ``self.stream``."""
        from cupy.cuda import nccl

        self._require_open()
        types = {np.dtype(np.float32): nccl.NCCL_FLOAT32, np.dtype(np.float64): nccl.NCCL_FLOAT64,
                 np.dtype(np.int32): nccl.NCCL_INT32, np.dtype(np.int64): nccl.NCCL_INT64,
                 np.dtype(np.uint8): nccl.NCCL_UINT8}
        ops = {"sum": nccl.NCCL_SUM, "max": nccl.NCCL_MAX, "min": nccl.NCCL_MIN}
        for a in arrays:
            if not a.flags.c_contiguous or a.dtype not in types:
                raise ValueError(f"all_reduce_ needs C-contiguous arrays of {sorted(map(str, types))}, "
                                 f"got {a.dtype} (contiguous: {a.flags.c_contiguous})")
        nccl.groupStart()
        try:
            for a in arrays:
                self.nccl.allReduce(a.data.ptr, a.data.ptr, a.size, types[a.dtype], ops[op], self.stream.ptr)
        finally:
            nccl.groupEnd()

    def host_all_reduce(self, values, op: str = "sum") -> np.ndarray:
        """All-reduce a small host array (at most 32 KiB) across ranks and return the result on the host.

        It runs on the group's stream alone (copies from and to pinned memory), so it waits for earlier
        collectives of the group but not for work on the caller's streams. The wait is bounded by
        ``CUPY_ROPE_TIMEOUT``: past it the communicator is aborted and :class:`DistributedError` raised
        (a rank died or never reached this point)."""
        return self.host_all_reduce_finish(self.host_all_reduce_start(values, op))

    def host_all_reduce_start(self, values, op: str = "sum"):
        """Enqueue :meth:`host_all_reduce` without waiting for it; :meth:`host_all_reduce_finish` gives the
        result. One at a time (they share a pinned buffer)."""
        import cupy

        values = np.ascontiguousarray(values)
        n = values.nbytes
        if n > _SMALL:
            raise ValueError(f"host_all_reduce takes at most {_SMALL} bytes, got {n}")
        rt = cupy.cuda.runtime
        send = np.frombuffer(self._pinned, dtype=np.uint8, count=n)
        recv = np.frombuffer(self._pinned, dtype=values.dtype, count=values.size, offset=_SMALL)
        send[:] = values.view(np.uint8).reshape(-1)
        dev = self._small[:n].view(values.dtype)
        rt.memcpyAsync(dev.data.ptr, send.ctypes.data, n, rt.memcpyHostToDevice, self.stream.ptr)
        self.all_reduce_([dev], op)
        rt.memcpyAsync(recv.ctypes.data, dev.data.ptr, n, rt.memcpyDeviceToHost, self.stream.ptr)
        self._done.record(self.stream)
        return recv, values.shape

    def host_all_reduce_finish(self, pending) -> np.ndarray:
        recv, shape = pending
        self.wait(self._done, "the other ranks")
        return recv.reshape(shape).copy()

    def barrier(self) -> None:
        """Every rank reaches this point (an all-reduce of one integer, waited for on the host)."""
        self.host_all_reduce(np.zeros(1, np.int32))

    def wait(self, event, what: str) -> None:
        """Host wait for ``event`` with the group's timeout; NCCL has none of its own, so a collective whose
        peer never arrives would otherwise block this process forever."""
        deadline = time.monotonic() + timeout_s()
        spin_until = time.monotonic() + 0.002
        delay = 1e-5
        while not event.done:
            now = time.monotonic()
            if now > deadline:
                self.failed = True
                self.abort()
                raise DistributedError(f"rank {self.rank}: waited more than {timeout_s():.0f} s for {what} "
                                       "(a rank died or is stuck); the NCCL communicator was aborted")
            if now > spin_until:
                time.sleep(delay)
                delay = min(2 * delay, 1e-3)
                self._check_async_error()

    def _check_async_error(self) -> None:
        try:
            self.nccl.check_async_error()
        except AttributeError:  # pragma: no cover - very old CuPy
            pass
        except Exception as e:
            self.failed = True
            raise DistributedError(f"rank {self.rank}: NCCL reported an asynchronous error: {e}") from e

    def _require_open(self):
        if self.closed:
            raise DistributedError("the process group was shut down")

    # -- teardown ---------------------------------------------------------------------------------------

    def abort(self) -> None:
        """Abort the communicator: pending collectives return (their results are garbage) and nothing waits."""
        if not self.closed:
            self.closed = True
            try:
                self.nccl.abort()
            except Exception:  # noqa: BLE001 - best effort while failing
                pass

    def close(self, timeout: float = 10.0) -> None:
        """Destroy the communicator once this group's stream is idle; abort it if the stream does not drain
        within ``timeout`` seconds or a step failed (a peer that died leaves collectives pending forever)."""
        if self.closed:
            return
        if not self.failed:
            deadline = time.monotonic() + timeout
            self._done.record(self.stream)
            while not self._done.done and time.monotonic() < deadline:
                time.sleep(1e-3)
            if self._done.done:
                self.closed = True
                self.nccl.destroy()
                return
        self.abort()


_lock = threading.Lock()
_group: ProcessGroup | None = None
_atexit_registered = False


def current() -> ProcessGroup | None:
    """The group made by :func:`init` in this process, or None."""
    return _group


def _stop_store(backend) -> None:
    """Stop cupyx's rendezvous store (rank 0 only), whether or not the interpreter is exiting."""
    store = getattr(backend, "_store", None)
    proc = getattr(store, "_process", None)
    if proc is None:
        return
    join = functools.partial(multiprocessing.Process.join, proc)  # (cupyx's join() takes no timeout)
    try:
        with store._run.get_lock():
            store._run.value = 0
        join(_STORE_STOP_S)
        if proc.is_alive():
            proc.terminate()
            join(_STORE_STOP_S)
        if proc.is_alive():  # pragma: no cover - SIGTERM ignored
            proc.kill()
            join()
    finally:
        store._process = None


def init(world_size: int | None = None, rank: int | None = None, *, device: int | None = None,
         host: str | None = None, port: int | None = None) -> ProcessGroup:
    """Join the NCCL process group (one GPU per process) and return it; a second call returns the same group
    (refused with ValueError if it names another world size, rank or device).

    Arguments left out come from the environment the launcher sets (see the module docstring). The device
    (default ``CUPY_ROPE_LOCAL_RANK``, else the rank) becomes this thread's current CuPy device. NVLink
    multicast (NVLS) is kept off (``NCCL_NVLS_ENABLE=0``). Blocks until every rank has joined.

    Raises :class:`NCCLUnavailableError` (an ``ImportError``) naming the install extra when NCCL is missing.
    """
    global _group, _atexit_registered
    with _lock:
        if _group is not None and not _group.closed:
            asked = {"world_size": world_size, "rank": rank, "device": device}
            other = {k: v for k, v in asked.items() if v is not None and v != getattr(_group, k)}
            if other:
                raise ValueError(f"init(): this process already joined a group with world_size "
                                 f"{_group.world_size}, rank {_group.rank}, device {_group.device}; asked {other}")
            return _group
        nccl_module()
        if world_size is None:
            world_size = _env_int(("CUPY_ROPE_WORLD_SIZE", "WORLD_SIZE"))
        if rank is None:
            rank = _env_int(("CUPY_ROPE_RANK", "RANK"))
        if world_size is None or rank is None:
            raise ValueError("init() needs world_size and rank, or the environment variables CUPY_ROPE_WORLD_SIZE "
                             "and CUPY_ROPE_RANK (start the processes with python -m cupy_rope.distributed)")
        world_size, rank = int(world_size), int(rank)
        if world_size <= 0 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        if device is None:
            device = _env_int(("CUPY_ROPE_LOCAL_RANK", "LOCAL_RANK"), rank)
        host = host or _env(("CUPY_ROPE_MASTER_ADDR", "MASTER_ADDR"), "127.0.0.1")
        port = int(port if port is not None else _env_int(("CUPY_ROPE_MASTER_PORT", "MASTER_PORT"), 13333))
        os.environ["NCCL_NVLS_ENABLE"] = "0"  # read by NCCL when the communicator is made: never multicast
        import cupy

        ndev = cupy.cuda.runtime.getDeviceCount()
        if not 0 <= device < ndev:
            raise ValueError(f"rank {rank} wants GPU {device} but this machine has {ndev} GPU(s); "
                             "start at most one process per GPU")
        cupy.cuda.Device(device).use()
        _quiet_mpi4py()
        import cupyx.distributed

        backend = cupyx.distributed.init_process_group(world_size, rank, backend="nccl", host=host, port=port)
        _stop_store(backend)  # every rank has joined once the communicator exists on rank 0
        _group = ProcessGroup(backend, rank, world_size, device)
        if not _atexit_registered:
            atexit.register(shutdown)
            _atexit_registered = True
        return _group


def shutdown(timeout: float = 10.0) -> None:
    """Leave the process group: stop the rendezvous store if it is still up and destroy the communicator (or
    abort it when collectives are still pending after ``timeout`` seconds or a step failed). Safe to call
    twice; registered with ``atexit`` by :func:`init`, so a process that forgets it still exits."""
    global _group
    with _lock:
        g, _group = _group, None
    if g is None:
        return
    try:
        _stop_store(g.backend)
    finally:
        g.close(timeout)
