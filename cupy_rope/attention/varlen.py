"""Every fact about the sequences of one call, in one place: the host ``cu_seqlens`` (checked), the lengths, the
tile table the attention kernels walk (with each sequence's first tile), and its device copy.

A call's ``cu_seqlens`` may be a NumPy array (nothing is read back from the device) or a CuPy array, which is
read back with an asynchronous copy (:func:`read_async`) while the caller allocates, then checked
(:func:`resolve`) before the first launch. The tile table ``[(first token, sequence start, sequence end)]``
has one row per ``TILE``-token tile, longest sequences first so that the longest blocks start first.
"""
from __future__ import annotations

import threading

import numpy as np

from .. import _checks as C

TILE = 128  # rows per attention block (BM in kernels_cu/attention/config.cuh: 16 per warp, 8 warps)


class Varlen:
    """The sequence boundaries of one call and what follows from them (immutable once built)."""

    __slots__ = ("cu", "tokens", "lengths", "max_tiles", "_table", "_key", "_runs", "_dense")

    def __init__(self, cu: np.ndarray, tokens: int):
        C.check_cu_seqlens(cu, tokens)
        self.cu = cu
        self.tokens = int(tokens)
        self.lengths = np.diff(cu.astype(np.int64))
        self.max_tiles = int((self.lengths.max() + TILE - 1) // TILE) if self.lengths.size else 0
        self._table = None
        self._key = None
        self._runs = None
        self._dense: dict = {}

    @property
    def key(self) -> tuple:
        """What the tile table depends on: the bytes of ``cu`` (with its dtype)."""
        if self._key is None:
            self._key = (self.cu.dtype.str, self.cu.tobytes())
        return self._key

    @property
    def table(self) -> np.ndarray:
        """The tile table (made on first use: the backward asks for it once the GPU has work queued)."""
        if self._table is None:
            self._table = tile_table(self.cu)
        return self._table

    @property
    def ntiles(self) -> int:
        return int(self.table.shape[0])

    @property
    def max_len(self) -> int:
        return int(self.lengths.max()) if self.lengths.size else 0

    def starts_aligned(self, n: int) -> bool:
        """Whether every non-empty sequence starts at a multiple of ``n`` tokens (a product writing a sequence's
        block of a token-major operand at its first token then has an ``n``-element-aligned pointer)."""
        key = ("aligned", n)
        if key not in self._dense:  # asked on every direct call of the block: kept with the layout
            starts = self.cu[:-1].astype(np.int64)[self.lengths > 0]
            self._dense[key] = bool((starts % n == 0).all())
        return self._dense[key]

    def whole_steps(self, rows: int) -> bool:
        """Whether every non-empty sequence holds whole steps of ``rows`` tokens or ends at the last token. Then
        every sequence starts at a multiple of ``rows`` (cu_seqlens starts at 0), and a kernel walking a
        sequence's queries in such steps from its start never reaches another sequence's tokens."""
        key = ("steps", rows)
        if key not in self._dense:
            full = self.lengths > 0
            ends = self.cu[1:].astype(np.int64)[full]
            self._dense[key] = bool(((self.lengths[full] % rows == 0) | (ends == self.tokens)).all())
        return self._dense[key]

    @property
    def runs(self) -> tuple:
        """Maximal runs of consecutive non-empty sequences of one length, ``((first token, sequences, length),
        ...)`` in token order (empty sequences take no tokens and do not break a run): the batches of the dense
        form (attention/dense.py)."""
        if self._runs is None:
            runs = []
            for start, n in zip(self.cu[:-1].tolist(), self.lengths.tolist()):
                if not n:
                    continue
                if runs and runs[-1][2] == n:
                    runs[-1][1] += 1
                else:
                    runs.append([int(start), 1, int(n)])
            self._runs = tuple(tuple(r) for r in runs)
        return self._runs

    def dense_rows(self, nh: int) -> np.ndarray:
        """int32 [T, 2]: the dense form's row of each token for ``nh`` heads, ``(base, L)``: token t of head h is
        row ``base + h * L`` of each operand (kernels_cu/attention/dense.cuh)."""
        rows = self._dense.get(nh)
        if rows is None:
            rows = np.empty((self.tokens, 2), np.int32)
            for t0, n, length in self.runs:
                i = np.arange(n * length, dtype=np.int64)
                rows[t0:t0 + n * length, 0] = nh * t0 + (i // length) * nh * length + i % length
                rows[t0:t0 + n * length, 1] = length
            if nh * self.tokens > 2**31 - 1:
                raise ValueError(f"the dense form indexes {nh} heads x {self.tokens} tokens rows with int32")
            self._dense[nh] = rows
        return rows

    def device_dense_rows(self, nh: int, stream: int):
        """:meth:`dense_rows` on the device (kept like the tile table: :func:`device_table`)."""
        return device_table(self.dense_rows(nh), self.key + ("dense", nh), stream)

    def dense_pointer_offsets(self, nh: int, d: int, o_ld: int = 0) -> np.ndarray:
        """int64 [6 E] (E = NH * the non-empty sequences): the byte offsets of the dense form's pointer arrays
        when V and dO are read where their products leave them (kernels_cu/attention/dense.cuh, dense_pointers):
        per batch entry (run, sequence s of it, head h), in the runs' order, six kinds of E: V in qkv [T, 3H] (from
        its column 2H), dO [T, H], the two score buffers, the dense O and dV ([NH T, D] rows). With ``o_ld``, O is
        O^T [H, o_ld] instead: entry (s, h) at row h D, column its first token."""
        key = ("pointers", nh, d, o_ld)
        off = self._dense.get(key)
        if off is None:
            h = nh * d
            parts = [[] for _ in range(6)]
            scores = 0
            for t0, n, length in self.runs:
                b = np.arange(n * nh, dtype=np.int64)
                s, hh = b // nh, b % nh
                rows = t0 + s * length
                parts[0].append((rows * 3 * h + hh * d) * 4)
                parts[1].append((rows * h + hh * d) * 4)
                sc = (scores + b * length * length) * 4
                parts[2].append(sc)
                parts[3].append(sc)
                dn = (nh * t0 + b * length) * d * 4
                parts[4].append((hh * d * o_ld + rows) * 4 if o_ld else dn)
                parts[5].append(dn)
                scores += n * nh * length * length
            off = np.concatenate([np.concatenate(p) if p else np.zeros(0, np.int64) for p in parts])
            self._dense[key] = off
        return off

    def device_dense_pointer_offsets(self, nh: int, d: int, stream: int, o_ld: int = 0):
        """:meth:`dense_pointer_offsets` on the device (kept like the tile table)."""
        return device_table(self.dense_pointer_offsets(nh, d, o_ld), self.key + ("dense_pointers", nh, d, o_ld),
                            stream)

    def device_table(self, stream: int, store: dict | None = None):
        """The tile table on the device, ready for work on ``stream``: uploaded once per device and kept
        (:func:`device_table`; in ``store`` if given), or copied asynchronously on ``stream`` for this call
        (:func:`upload`). int32, the table's rows one after another."""
        return device_table(self.table, self.key, stream, store)


def tile_table(cu: np.ndarray) -> np.ndarray:
    """[(first token, sequence start, sequence end)] for every TILE-token tile, longest sequences first."""
    starts, ends = cu[:-1].astype(np.int64), cu[1:].astype(np.int64)
    order = np.argsort(starts - ends, kind="stable")  # longest first, ties in sequence order
    counts = (ends[order] - starts[order] + TILE - 1) // TILE
    seq = np.repeat(order, counts)
    within = np.arange(seq.size, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    table = np.empty((seq.size, 3), dtype=np.int32)
    table[:, 0] = starts[seq] + within * TILE
    table[:, 1] = starts[seq]
    table[:, 2] = ends[seq]
    return table


# ---- host-to-device copies of small tables -------------------------------------------------------------------
# A copy from pinned memory is asynchronous: the pinned buffer must live until the copy has run. Outside a capture,
# an event recorded after the copy says when; the buffer is kept in _inflight until then. Inside a stream capture
# (the caller recording its own CUDA graph) the copy becomes a graph node that reads the buffer at every replay, and
# the event would never complete: the buffer is kept for the life of the process instead, one per distinct table
# (_captured), and nothing is added to _inflight.
_lock = threading.Lock()
_inflight: list = []  # (event, pinned buffer) of copies that may still be reading their buffer
_captured: dict = {}  # table bytes -> pinned buffer read by captured graphs


def _capturing(stream: int) -> bool:
    from cupy_backends.cuda.api import runtime

    return runtime.streamIsCapturing(stream) != 0


def upload(a: np.ndarray, stream: int):
    """Asynchronous host-to-device copy of a small array through pinned memory (no host synchronisation)."""
    import cupy
    from cupy_backends.cuda.api import runtime

    out = cupy.empty(a.shape, dtype=a.dtype)
    if not a.nbytes:
        return out
    capturing = _capturing(stream)
    key = (a.dtype.str, a.shape, a.tobytes()) if capturing else None
    with _lock:
        if capturing:
            pinned = _captured.get(key)
        else:
            while _inflight and _inflight[0][0].done:  # usually completed in order
                _inflight.pop(0)
            if len(_inflight) > 64:  # copies on several streams complete out of order
                _inflight[:] = [e for e in _inflight if not e[0].done]
            pinned = None
    if pinned is None:
        pinned = cupy.cuda.alloc_pinned_memory(a.nbytes)
        np.frombuffer(pinned, dtype=a.dtype, count=a.size)[:] = a.ravel()
        if capturing:  # the buffer kept is the one copied from: another thread's capture may have kept one first
            with _lock:
                pinned = _captured.setdefault(key, pinned)
    runtime.memcpyAsync(out.data.ptr, pinned.ptr, a.nbytes, runtime.memcpyHostToDevice, stream)
    if not capturing:
        ev = cupy.cuda.Event(block=False, disable_timing=True)
        runtime.eventRecord(ev.ptr, stream)
        with _lock:
            _inflight.append((ev, pinned))
    return out


# ---- tile tables kept on the device ---------------------------------------------------------------------------
# A training step passes the same cu_seqlens to every layer: its tile table is uploaded once per device and kept
# for the life of the process (never freed, so no stream can still be reading memory that was handed back). The
# first DEVICE_TABLES_MAX distinct tables are kept; past that a call uploads its own. A table is ready for another
# stream once its upload's event has completed, or once that stream waits for the event. Inside a stream capture
# no event may be queried or waited for: a kept table is used only if it was seen complete before, else the
# capture records its own copy (upload keeps that copy's buffer). An object that outlives its calls (a graph
# handle, whose recordings read its table) passes a store of its own: kept there whatever the count, by the same
# rules, and freed with it.
DEVICE_TABLES_MAX = 256
_device_tables: dict = {}  # (device, Varlen.key) -> [device array, event, seen complete]


def device_table(table: np.ndarray, key: tuple, stream: int, store: dict | None = None):
    """``table`` on the current device for work on ``stream`` (see the comment above)."""
    import cupy
    from cupy_backends.cuda.api import runtime

    if not table.size:
        return upload(table, stream)
    tables = _device_tables if store is None else store
    dev = runtime.getDevice()
    capturing = _capturing(stream)
    with _lock:
        entry = tables.get((dev, key))
    if entry is not None:
        if entry[2]:
            return entry[0]
        if not capturing:
            if entry[1].done:
                entry[2] = True
            else:
                runtime.streamWaitEvent(stream, entry[1].ptr, 0)
            return entry[0]
    if capturing or (store is None and len(tables) >= DEVICE_TABLES_MAX):
        return upload(table, stream)
    # from CuPy's default pool, whatever allocator the caller has set for this call: the table outlives the call
    with cupy.cuda.using_allocator(cupy.get_default_memory_pool().malloc):
        out = upload(table, stream)
    ev = cupy.cuda.Event(block=False, disable_timing=True)
    runtime.eventRecord(ev.ptr, stream)
    with _lock:  # a table another thread kept meanwhile wins; this call's own copy then ends with the call
        tables.setdefault((dev, key), [out, ev, False])
    return out


# ---- reading a device cu_seqlens back ----------------------------------------------------------------------------
_tls = threading.local()  # per thread: a pinned buffer, an event per device and the last read's event


def read_async(cu_seqlens, stream: int):
    """Start reading a device ``cu_seqlens`` back to the host (a copy on ``stream``, not a kernel launch), so the
    caller can allocate while it is in flight. Host arrays are returned as they are. A device array cannot be read
    while ``stream`` is being captured: the caller must then pass it as a NumPy array."""
    if isinstance(cu_seqlens, np.ndarray):
        return cu_seqlens
    import cupy

    rt = cupy.cuda.runtime
    if _capturing(stream):
        raise RuntimeError("cu_seqlens is a device array but the stream is being captured into a CUDA graph; "
                           "pass cu_seqlens as a NumPy array to record the call (its values decide the launches)")
    nbytes = cu_seqlens.nbytes
    last = getattr(_tls, "last", None)
    if last is not None:  # a read whose call failed before resolve may still be writing the buffer (rare)
        with cupy.cuda.Device(last[0]):
            last[1].synchronize()
    buf = getattr(_tls, "buf", None)
    if buf is None or buf.mem.size < nbytes:
        buf = _tls.buf = cupy.cuda.alloc_pinned_memory(max(nbytes, 4096))
    events = getattr(_tls, "events", None)
    if events is None:
        events = _tls.events = {}
    dev = rt.getDevice()
    event = events.get(dev)
    if event is None:
        event = events[dev] = cupy.cuda.Event(block=False, disable_timing=True)
    rt.memcpyAsync(buf.ptr, cu_seqlens.data.ptr, nbytes, rt.memcpyDeviceToHost, stream)
    rt.eventRecord(event.ptr, stream)
    _tls.last = (dev, event)
    return buf, event, cu_seqlens.dtype, cu_seqlens.shape[0]


# The last HOST_CACHE checked Varlen objects, by (cu_seqlens bytes, tokens): a model's layers share one
# cu_seqlens, and checking it and building its tile table cost more host time than the launches of a small call.
HOST_CACHE = 256
_host: dict = {}  # (dtype, bytes, tokens) -> Varlen, oldest first


def resolve(pending, tokens: int) -> Varlen:
    """The :class:`Varlen` of a read started by :func:`read_async` (waiting for it), values checked."""
    if isinstance(pending, np.ndarray):
        cu = pending
    else:
        buf, event, dtype, n = pending
        event.synchronize()
        _tls.last = None  # this thread's buffer is free again (read_async waits only for a read never resolved)
        cu = np.frombuffer(buf, dtype=dtype, count=n)
    if cu.ndim != 1:
        return Varlen(cu, tokens)  # refused there, with the reason
    key = (cu.dtype.str, cu.tobytes(), int(tokens))
    with _lock:
        vl = _host.pop(key, None)
        if vl is not None:
            _host[key] = vl  # now the newest
            return vl
    vl = Varlen(np.array(cu, copy=True), tokens)  # checked; a copy, so that the caller's array may change
    vl.table  # built now, while no other thread can see it
    with _lock:
        _host[key] = vl
        while len(_host) > HOST_CACHE:
            del _host[next(iter(_host))]
    return vl
