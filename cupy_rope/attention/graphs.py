"""Recording and replaying the backward as a CUDA graph, through an object the caller holds.

Up to a couple of thousand tokens the GPU work of a backward (~0.3-2 ms) is not much longer than issuing its ~20
launches and cuBLAS calls from Python, so the GPU waits on the host. A :class:`VisionAttentionBackward` handle (one
per layer) fixes the sequence boundaries, shapes and precision; it runs its first call directly (compiling kernels
and timing GEMM candidates), records the launch sequence the second time it sees the same input buffers, and
replays the recording with one launch after that. Its memory (the outputs, the recording's temporaries) is the
handle's, released by :meth:`VisionAttentionBackward.close` or when the handle is dropped.

:class:`GraphMemory` is the allocator a recording needs: every block allocated while it is active stays allocated
until it is released, because a recorded graph reads and writes the same addresses at every replay. Callers who
capture a whole training step into their own graph use it the same way (README: "Capturing a training step").
"""
from __future__ import annotations

import collections
import threading

import numpy as np

from .. import _checks as C
from .. import _cublas
from ..precision import Precision
from . import api, schedule, streams
from .kernels import HEAD_DIMS
from .varlen import Varlen


class GraphMemory:
    """An allocator context: blocks allocated from CuPy's pool inside ``with memory:`` (this thread) are kept until
    :meth:`release` (or until the object is dropped), so a graph recorded inside can replay safely."""

    def __init__(self):
        self._blocks: list = []
        self._ctx = None

    def malloc(self, nbytes: int):
        import cupy

        mem = cupy.get_default_memory_pool().malloc(nbytes)
        self._blocks.append(mem)
        return mem

    @property
    def nbytes(self) -> int:
        return sum(b.mem.size for b in self._blocks if b.mem is not None)

    def __enter__(self):
        import cupy

        self._ctx = cupy.cuda.using_allocator(self.malloc)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        ctx, self._ctx = self._ctx, None
        return ctx.__exit__(*exc)

    def release(self) -> None:
        self._blocks.clear()


class _Graph:
    """One instantiated recording, its memory, and an event marking the end of its last replay."""

    def __init__(self, exe, graph, memory: GraphMemory, workspaces: tuple):
        import cupy

        self.exe, self.graph, self.memory = exe, graph, memory
        self.workspaces = workspaces  # the cuBLAS workspaces the recorded products use
        self.done = cupy.cuda.Event(block=False, disable_timing=True)

    def launch(self, s: int) -> None:
        from cupy_backends.cuda.api import runtime

        runtime.graphLaunch(self.exe, s)
        runtime.eventRecord(self.done.ptr, s)

    def release(self) -> None:
        """Free everything once the last replay has finished (the event, not the stream: the caller's stream may
        be gone by now)."""
        from cupy_backends.cuda.api import runtime

        if self.exe is None:
            return
        self.done.synchronize()
        runtime.graphExecDestroy(self.exe)
        runtime.graphDestroy(self.graph)
        self.exe = self.graph = None
        self.memory.release()
        self.workspaces = ()


def _record_stream():
    """This thread's private stream for recordings (CuPy's default stream cannot be captured)."""
    import cupy
    from cupy_backends.cuda.api import runtime

    cache = getattr(_tls, "rec", None)
    if cache is None:
        cache = _tls.rec = {}
    dev = runtime.getDevice()
    if dev not in cache:
        cache[dev] = cupy.cuda.Stream(non_blocking=True)
    return cache[dev]


_tls = threading.local()
_CAPTURE_ERRORS = range(900, 910)  # cudaErrorStreamCapture* / CUDA_ERROR_STREAM_CAPTURE_*, cudaErrorCapturedEvent


_CAPTURE_INVALIDATED = 2  # cudaStreamCaptureStatusInvalidated


def _capture_error(e: BaseException) -> bool:
    """Whether ``e`` says the capture itself was invalidated (by another thread, say), not the work."""
    return getattr(e, "status", None) in _CAPTURE_ERRORS


def _invalidated(stream: int) -> bool:
    """Whether the capture on ``stream`` has been invalidated. Another thread's device-wide synchronisation
    during a relaxed-mode capture invalidates it, and the next call into the capture then fails with an error of
    its own (``cudaErrorInvalidValue`` from a cross-stream wait, say) rather than a capture error."""
    from cupy_backends.cuda.api import runtime

    try:
        return runtime.streamIsCapturing(stream) == _CAPTURE_INVALIDATED
    except Exception:  # noqa: BLE001 - the query itself refused: not a state we can read
        return False


class VisionAttentionBackward:
    """The backward of one attention layer with fixed sequence boundaries, replayed from a CUDA graph.

    Args:
        cu_seqlens: NumPy integer array ``[N+1]`` (host: the boundaries decide the launches).
        hidden_size, head_dim: the block's dims; ``num_heads`` (an int) defaults to ``hidden_size // head_dim``.
        precision, scaling: as for :func:`cupy_rope.vision_attention_backward`.
        max_graphs: recordings kept (one per distinct set of input buffers; the oldest is dropped).

    Call it with the eight arrays of :func:`cupy_rope.vision_attention_backward` (``grad_output`` ...
    ``sin``), optionally ``stream=``. It returns the five gradients in arrays **owned by the handle**, which its
    next call overwrites (copy them to keep them). The first call runs directly; the second with the same input
    buffers records a graph (up to ``plan.GRAPH_MAX_TOKENS`` tokens; longer calls always run directly) and every
    later call with those buffers replays it. Each call's work follows the previous call's, whatever streams they
    run on. Inside the caller's own stream capture it runs directly (recording nothing of its own). It may be
    called on several GPUs in turn (its outputs move with it). :meth:`close` (or the handle's collection) waits
    for the last call's work before freeing what it holds.
    """

    def __init__(self, cu_seqlens, *, hidden_size: int, head_dim: int, num_heads=None, precision="tf32",
                 scaling=None, max_graphs: int = 2, plan=None):
        if not isinstance(cu_seqlens, np.ndarray):
            raise TypeError("cu_seqlens must be a NumPy array for a graph handle (its values decide the launches)")
        C.check_cu_seqlens_form(cu_seqlens)
        self.hidden_size = C.require_int(hidden_size, "hidden_size", minimum=1)
        self.head_dim = C.require_int(head_dim, "head_dim", minimum=1)
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {self.head_dim}")
        self.precision = Precision.parse(precision)
        nh = self.hidden_size // self.head_dim if num_heads is None else C.require_int(num_heads, "num_heads",
                                                                                         minimum=1)
        if nh * self.head_dim != self.hidden_size:
            raise ValueError(f"hidden_size {hidden_size} must equal num_heads * head_dim = {nh} * {head_dim}")
        self.num_heads = nh
        self.varlen = Varlen(np.array(cu_seqlens), int(cu_seqlens[-1]))
        self.tokens = self.varlen.tokens
        self.scaling = C.attention_scaling(scaling, self.head_dim)
        from cupy_backends.cuda.api import runtime

        self._plan_given = plan
        self.plan = api.choose_plan(self.precision, self.head_dim, self.varlen, plan)  # for the current device
        self._plans = {runtime.getDevice(): self.plan}  # a plan per device: Hopper or not decides the kernels
        self.max_graphs = C.require_int(max_graphs, "max_graphs", minimum=1)
        self.records = 0  # recordings made
        self.replays = 0  # calls served by a replay
        self._graphs: collections.OrderedDict = collections.OrderedDict()  # key -> _Graph
        self._last_key = None
        self._outs = None
        self._tiles = {}  # the tile tables it keeps on each device (varlen.device_table's store)
        self._end = None  # event after the last call's work (its outputs written), on its stream
        self._own_end = None  # the event recorded for that after a direct call
        self._lock = threading.Lock()

    def __call__(self, grad_output, hidden_states, qkv_weight, qkv_bias, proj_weight, proj_bias, cos, sin, *,
                 stream=None):
        p, t, h, nh, d = api.validate(grad_output, hidden_states, qkv_weight, qkv_bias, proj_weight, proj_bias, cos,
                                      sin, self.varlen.cu, 0.0, self.num_heads, self.precision)
        if (t, h, d) != (self.tokens, self.hidden_size, self.head_dim):
            raise ValueError(f"this handle is for {self.tokens} tokens, hidden {self.hidden_size}, head_dim "
                             f"{self.head_dim}; got {t}, {h}, {d}")
        ctx, s = C.on_stream(stream)
        args = (grad_output, hidden_states, qkv_weight, qkv_bias, proj_weight, cos, sin)
        with ctx, self._lock:
            from cupy_backends.cuda.api import runtime

            dev = runtime.getDevice()
            plan = self._plans.get(dev)
            if plan is None:  # refused here, before any launch, if a caller's plan does not suit this GPU
                plan = self._plans[dev] = api.choose_plan(self.precision, self.head_dim, self.varlen,
                                                          self._plan_given)
            self.plan = plan
            capturing = runtime.streamIsCapturing(s) != 0
            # the recordings hold GEMMs only where cuBLAS is reached directly (CuPy's bindings refuse captures)
            graph = plan.graph and not capturing and _cublas.capturable()
            if self._outs is None or self._outs[0].data.device_id != dev:
                # new outputs: the recordings write the old ones, which go with them, once the last call (on the
                # old GPU) has finished with them; its end event belongs to that GPU, so a new one is made here
                self._drop_outputs()
                self._outs = api.empty_grads(t, h)
            elif self._end is not None and not capturing and not self._end.done:
                runtime.streamWaitEvent(s, self._end.ptr, 0)  # the last call, on any stream, writes outs first
            outs = self._outs
            ended = None  # what marks this call's end: a replay's own event, else the handle's
            try:
                if t == 0:
                    for z in outs[1:]:
                        z.fill(0)
                    return outs
                key = (dev, s) + tuple(a.data.ptr for a in args)
                g = self._graphs.get(key) if graph else None
                if g is None:  # a replay reads the buffers its recording was checked with
                    names = ("grad_output", "hidden_states", "qkv_weight", "qkv_bias", "proj_weight", "cos", "sin")
                    for name, o in zip(api.OUTPUTS, outs):
                        C.require_no_overlap(o, f"this handle's {name}", dict(zip(names, args)))
                # inside the caller's capture the table comes from the process-wide store (or a copy kept for
                # the process): the caller's graph may replay after this handle has closed
                tiles = self.varlen.device_table(s, None if capturing else self._tiles)
                if not graph:
                    self._direct(args, s, tiles)
                    return outs
                if g is None and key == self._last_key:
                    g = self._record(args, tiles)
                    if g is not None:
                        self._graphs[key] = g
                        while len(self._graphs) > self.max_graphs:
                            self._graphs.popitem(last=False)[1].release()
                self._last_key = key
                if g is None:
                    self._direct(args, s, tiles)
                    return outs
                self._graphs.move_to_end(key)
                g.launch(s)
                ended = g.done
                self.replays += 1
                return outs
            finally:  # also after a failure: work it queued may still write outs
                if not capturing:
                    self._ended(s, ended)

    def _ended(self, s: int, event) -> None:
        """Mark the end of this call's work on ``s``: ``event`` if it is recorded there already, else the
        handle's own event, recorded now."""
        if event is None:
            if self._own_end is None:
                import cupy

                self._own_end = cupy.cuda.Event(block=False, disable_timing=True)
            from cupy_backends.cuda.api import runtime

            runtime.eventRecord(self._own_end.ptr, s)
            event = self._own_end
        self._end = event

    def _direct(self, args, s: int, tiles) -> None:
        g, x, wq, bq, wp, cos, sin = args
        schedule.backward(g, x, wq, bq, wp, cos, sin, self.varlen, self.num_heads, self.scaling, self.plan, s,
                          self._outs, tiles=tiles)

    def _record(self, args, tiles):
        """A recording of the launch sequence with these buffers, or None when the capture failed (another
        thread's device-wide synchronisation can invalidate it): the call then runs directly."""
        from cupy_backends.cuda.api import runtime

        rec = _record_stream()
        memory = GraphMemory()
        g, x, wq, bq, wp, cos, sin = args
        with rec, memory:
            runtime.streamBeginCapture(rec.ptr, runtime.streamCaptureModeRelaxed)
            try:
                schedule.backward(g, x, wq, bq, wp, cos, sin, self.varlen, self.num_heads, self.scaling, self.plan,
                                  rec.ptr, self._outs, tiles=tiles)
            except BaseException as e:
                invalidated = _invalidated(rec.ptr)
                try:
                    runtime.graphDestroy(runtime.streamEndCapture(rec.ptr))
                except Exception as end:  # noqa: BLE001 - the first error is the one raised
                    # the end of the capture says it was invalidated even where the state query did not (the
                    # other thread's synchronisation can land between the failed call and the query); a call
                    # that failed on its own account fails again on the direct path
                    invalidated = invalidated or _capture_error(end)
                memory.release()
                if isinstance(e, Exception) and (invalidated or _capture_error(e)):
                    return None
                raise
            try:
                graph = runtime.streamEndCapture(rec.ptr)
            except Exception as e:  # noqa: BLE001
                memory.release()
                if _capture_error(e):
                    return None
                raise
        self.records += 1
        sides = (streams.side_stream(rec.ptr).ptr,) if self.plan.concurrent else ()  # a serial plan made none
        workspaces = _cublas.take_captured_workspaces(rec.ptr, *sides)
        return _Graph(runtime.graphInstantiate(graph), graph, memory, workspaces)

    @property
    def graph_bytes(self) -> int:
        """Device memory held by the recordings' temporaries."""
        with self._lock:
            return sum(g.memory.nbytes for g in self._graphs.values())

    def _drop_outputs(self) -> None:
        """Release the recordings (after their last replay) and the outputs and kept tables, once the last call's
        work, on whatever stream it ran, has finished with them."""
        if self._end is not None:
            self._end.synchronize()
        while self._graphs:
            self._graphs.popitem()[1].release()
        self._outs = None
        self._tiles.clear()
        self._last_key = self._end = self._own_end = None

    def close(self) -> None:
        """Release the recordings and the outputs, after the last call's work has finished (a blocking wait)."""
        with self._lock:
            self._drop_outputs()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def __repr__(self) -> str:
        return (f"VisionAttentionBackward(tokens={self.tokens}, sequences={len(self.varlen.lengths)}, "
                f"hidden={self.hidden_size}, heads={self.num_heads}x{self.head_dim}, precision={self.precision.label},"
                f" graphs={len(self._graphs)}, records={self.records}, replays={self.replays})")


