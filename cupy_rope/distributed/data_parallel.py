"""Data-parallel backward of the vision attention block: each rank runs the backward on its own sequences and
the weight and bias gradients are summed across ranks with NCCL, overlapped with the rest of the backward.

One call, on every rank (see docs/distributed.md for the picture):

1. Local checks of the inputs, then one tiny all-reduce of a status word per rank, enqueued on the group's stream
   before anything else; the host reads it only once the backward is enqueued (the only host wait of the call,
   long complete by then, so the GPU never idles for it). If any rank's inputs are bad, that rank issues its
   buckets with zeros and every rank raises: the bad rank its own error, the others a
   :class:`DistributedError` quoting it. No rank is left waiting in a collective its peers never issue.
2. The backward is enqueued on the caller's stream. As each reduced gradient's last producing work is
   enqueued, the backward calls ``on_output(name, array, stream_ptr)``; an event recorded there lets the
   group's communication stream start that gradient's bucket (an in-place NCCL all-reduce) while the rest of
   the backward still runs. Buckets are issued in one fixed order on every rank (NCCL needs it), a bucket
   waiting for every earlier one to be issued: grad_proj_weight + grad_proj_bias first, then grad_qkv_bias
   and the q, k and v row blocks of grad_qkv_weight (merged while they fit ``bucket_bytes``), which the backward
   computes one after another before grad_hidden_states, so each block's transfer overlaps later products.
3. The caller's stream waits for the communication stream (an event), and the call returns without a host
   synchronisation. ``grad_hidden_states`` stays with its rank.

A backward without the ``on_output`` keyword still works: the buckets then start after it returns.
"""
from __future__ import annotations

import inspect
import threading

import numpy as np

from .. import _checks as C
from ..attention.api import OUTPUTS, grad_shapes
from ..precision import Precision
from .group import DistributedError, ProcessGroup

__all__ = ["DataParallelBackward", "OUTPUTS", "REDUCED", "plan_buckets", "DEFAULT_BUCKET_BYTES"]

# The order the backward finishes them in (a fixed order; it is also the NCCL issue order). With ``on_output`` the
# backward reports grad_qkv_weight as its q, k and v row blocks, each as soon as its product is enqueued.
QKV_BLOCKS = tuple(f"grad_qkv_weight[{i}]" for i in range(3))
REDUCED = ("grad_proj_weight", "grad_proj_bias", "grad_qkv_bias") + QKV_BLOCKS
DEFAULT_BUCKET_BYTES = 64 << 20
_MSG_BYTES = 400  # per rank, for the failing ranks' messages


def _sizes(hidden: int) -> dict:
    h = hidden
    return dict({"grad_proj_weight": h * h, "grad_proj_bias": h, "grad_qkv_bias": 3 * h},
                **{name: h * h for name in QKV_BLOCKS})


def _part(name: str, outs, hidden: int):
    """The array of reduced output ``name`` (a row block of grad_qkv_weight for its blocks) in the backward's
    5-tuple."""
    if name in QKV_BLOCKS:
        i = QKV_BLOCKS.index(name)
        return outs[OUTPUTS.index("grad_qkv_weight")][i * hidden:(i + 1) * hidden]
    return outs[OUTPUTS.index(name)]


def plan_buckets(hidden: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> tuple:
    """The buckets (tuples of output names, in issue order) for a model of width ``hidden``.

    The projection gradients always form the first bucket: they are finished first (before the dK/dV
    kernel ends), so their all-reduce hides behind the rest of the backward. The QKV gradients follow, merged
    into one bucket when their fp32 bytes fit ``bucket_bytes`` (one NCCL launch instead of two)."""
    sizes = _sizes(hidden)
    buckets, cur, cur_bytes = [("grad_proj_weight", "grad_proj_bias")], [], 0
    for name in REDUCED[2:]:
        nbytes = 4 * sizes[name]
        if cur and cur_bytes + nbytes > bucket_bytes:
            buckets.append(tuple(cur))
            cur, cur_bytes = [], 0
        cur.append(name)
        cur_bytes += nbytes
    buckets.append(tuple(cur))
    return tuple(buckets)


def _backward_fn():
    import cupy_rope

    return cupy_rope.vision_attention_backward


def _accepts_on_output(fn) -> bool:
    try:
        return "on_output" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
        return False


class _Step:
    """The buckets of one call: which outputs are ready, and which buckets may be issued now. Bucket k is issued
    only after bucket k-1, whatever order the outputs arrive in, so every rank issues the same sequence of
    collectives even when their backwards (different token counts, different plans) finish in other orders."""

    def __init__(self, buckets):
        self.buckets = buckets
        self.ready: dict = {}  # name -> array
        self.issued = 0

    def mark(self, name: str, array) -> list:
        """Record ``name`` as ready; returns the buckets (lists of arrays, in order) that may be issued now."""
        self.ready.setdefault(name, array)
        out = []
        while self.issued < len(self.buckets) and all(n in self.ready for n in self.buckets[self.issued]):
            out.append([self.ready[n] for n in self.buckets[self.issued]])
            self.issued += 1
        return out

    @property
    def done(self) -> bool:
        return self.issued == len(self.buckets)


class DataParallelBackward:
    """Callable data-parallel backward for one layer's shapes.

    Args:
        group: the :class:`~cupy_rope.distributed.ProcessGroup` from :func:`cupy_rope.distributed.init`.
        hidden, head_dim: the model's sizes; ``num_heads`` defaults to ``hidden // head_dim``.
        precision: ``"tf32"`` (default), ``"fp32"`` or ``"bf16"``, as in ``vision_attention_backward``.
        scaling: softmax scale, a finite number (default ``head_dim ** -0.5``).
        bucket_bytes: the QKV gradients share one all-reduce while their bytes fit (default 64 MiB).
        check: exchange a status word before the collectives so bad inputs on one rank fail every rank
            (default True). Without it a rank whose inputs are refused sends zeros and raises alone: the
            peers' sums of that call lack its share, and nothing tells them.
        backward: the single-GPU backward to wrap (default ``cupy_rope.vision_attention_backward``).
        **backward_kwargs: passed on to it (for example ``plan=``).

    Call it with this rank's row slices of the batch and the shard's local ``cu_seqlens`` (NumPy int32, so the
    backward reads no device value back); it returns the five fp32 gradients, the four weight and bias ones
    summed over every rank, ``grad_hidden_states`` for this rank's tokens only. The sums are complete for
    work enqueued on ``stream`` after the call (the caller's current stream by default).
    """

    def __init__(self, group, *, hidden: int, head_dim: int, num_heads: int | None = None, precision: str = "tf32",
                 scaling: float | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES, check: bool = True,
                 backward=None, **backward_kwargs):
        for name, v in (("hidden", hidden), ("head_dim", head_dim), ("bucket_bytes", bucket_bytes)):
            C.require_int(v, name, minimum=1)
        if hidden % head_dim:
            raise ValueError(f"hidden ({hidden}) must be a multiple of head_dim ({head_dim})")
        nh = hidden // head_dim if num_heads is None else C.require_int(num_heads, "num_heads", minimum=1)
        if nh * head_dim != hidden:
            raise ValueError(f"hidden ({hidden}) must equal num_heads * head_dim = {nh} * {head_dim}")
        precision = Precision.parse(precision).label  # a Precision or its label; the backward gets the label
        scaling = None if scaling is None else C.attention_scaling(scaling, head_dim)
        self.group = group if isinstance(group, ProcessGroup) else _wrap_backend(group)
        self.hidden, self.head_dim, self.num_heads, self.precision = int(hidden), int(head_dim), nh, precision
        self.scaling = scaling
        self.check = bool(check)
        self.buckets = plan_buckets(self.hidden, int(bucket_bytes))
        self._backward = backward or _backward_fn()
        self._kwargs = backward_kwargs
        self._streamed = _accepts_on_output(self._backward)
        self._events: dict = {}
        self._failed_before: str | None = None  # a failure after the status exchange, reported next call

    # -- the call -------------------------------------------------------------------------------------------

    def __call__(self, grad_output, hidden_states, qkv_weight, qkv_bias, proj_weight, proj_bias, cos, sin,
                 cu_seqlens, *, stream=None):
        import cupy

        g = self.group
        # a stream that is not one is refused with the inputs (below), or by the backward, which gets it as given
        # (check=False): the failure path joins the current stream then
        s = stream if C.is_stream(stream) else cupy.cuda.get_current_stream()
        step = _Step(self.buckets)
        problem, pending = None, None
        if self.check:
            try:  # a device cu_seqlens comes back on the host, and the backward gets that (read once)
                cu_seqlens = self._check_inputs(grad_output, hidden_states, qkv_weight, qkv_bias, proj_weight,
                                                proj_bias, cos, sin, cu_seqlens, stream, s)
            except Exception as e:  # noqa: BLE001 - re-raised below, after the peers have been told
                problem = e
            pending = self._post_status(problem)
        if problem is not None:  # this rank's inputs are refused: zeros for the peers' collectives, then raise
            try:
                self._finish_with_zeros(step)
            finally:
                self._join(s)
            self._await_status(pending, f"{type(problem).__name__}: {problem}")
            raise problem
        kwargs = dict(self._kwargs, num_heads=self.num_heads, precision=self.precision,
                      stream=s if stream is None else stream)
        if self.scaling is not None:
            kwargs["scaling"] = self.scaling
        if self._streamed:
            kwargs["on_output"] = lambda name, array, stream_ptr: self._ready(step, name, array, stream_ptr)
        try:
            with cupy.cuda.Device(g.device):
                outs = self._backward(grad_output, hidden_states, qkv_weight, qkv_bias, proj_weight, proj_bias,
                                      cos, sin, cu_seqlens, **kwargs)
                for name in REDUCED:  # outputs the backward did not report (or no hook): ready on s now
                    if name not in step.ready:
                        self._ready(step, name, _part(name, outs, self.hidden), s.ptr)
        except BaseException as e:
            message = f"{type(e).__name__}: {e}"
            self._finish_with_zeros(step)
            if pending is not None and not self.group.closed:
                # this call's status exchange is read before the next call's is posted (they share a pinned
                # buffer), and after the buckets, in the peers' order: a message exchange it starts is joined
                try:
                    self._await_status(pending, message)
                except Exception:  # noqa: BLE001 - the backward's own error is the one raised
                    pass
            self._failed_before = message  # every rank hears of it at the next call's exchange
            raise
        finally:
            self._join(s)
        if pending is not None:  # long done by now: the status collective was enqueued before the backward
            self._await_status(pending, None)
        return outs

    def all_reduce_gradients(self, grads, *, stream=None):
        """Sum already computed gradients across ranks, in place, with the same buckets: ``grads`` is the
        5-tuple of the backward (``grad_hidden_states`` is left alone). The collectives start after the work
        already on ``stream``, and ``stream`` waits for them; returns ``grads``.

        Every array is checked (fp32, C-contiguous, this layer's shape, on the group's GPU) before the first
        bucket is sent: a bucket refused halfway would leave the peers pairing collectives this rank never
        sends, and a shape of another layer would pair all-reduces of other sizes. There is no status exchange
        here: a rank that raises leaves its peers waiting until the group's timeout (or the launcher stops
        them)."""
        import cupy

        self._check_gradients(grads, stream)
        s = stream if stream is not None else cupy.cuda.get_current_stream()
        step = _Step(self.buckets)
        try:
            for name in REDUCED:
                self._ready(step, name, _part(name, grads, self.hidden), s.ptr)
        finally:
            self._join(s)
        return grads

    # -- buckets ------------------------------------------------------------------------------------------

    def _event(self, name):
        import cupy

        ev = self._events.get(name)
        if ev is None:
            with cupy.cuda.Device(self.group.device):
                ev = self._events[name] = cupy.cuda.Event(disable_timing=True)
        return ev

    def _ready(self, step: _Step, name: str, array, stream_ptr: int) -> None:
        """``array`` (output ``name``) is complete for work enqueued on ``stream_ptr`` from now on: make the
        communication stream wait for that point, then issue every bucket whose turn has come."""
        from cupy_backends.cuda.api import runtime

        if name not in REDUCED or name in step.ready:
            return
        ev = self._event(name)
        runtime.eventRecord(ev.ptr, stream_ptr)
        runtime.streamWaitEvent(self.group.stream.ptr, ev.ptr, 0)
        for arrays in step.mark(name, array):
            try:
                self.group.all_reduce_(arrays)
            except BaseException:
                # the bucket counts as issued: this rank can no longer keep the peers' order of collectives,
                # so the communicator is aborted rather than left to pair mismatched ones
                self.group.failed = True
                self.group.abort()
                raise

    def _finish_with_zeros(self, step: _Step) -> None:
        """Issue the remaining buckets with zeros so no peer waits forever: this rank's inputs were refused (the
        status exchange of this call reports it), or its backward failed after the status exchange (reported to
        every rank at the next call's exchange). Nothing once the communicator is closed (aborted after a failed
        all-reduce): the peers then stop at their timeout."""
        import cupy

        if self.group.closed:
            return
        try:
            with cupy.cuda.Device(self.group.device), self.group.stream:
                sizes = _sizes(self.hidden)
                for name in REDUCED:
                    if name not in step.ready:
                        z = cupy.zeros(sizes[name], np.float32)  # on the comm stream: freed in its order
                        self._ready(step, name, z, self.group.stream.ptr)
        except Exception:  # noqa: BLE001 - cannot even send zeros: abort so nothing waits on this rank
            self.group.failed = True
            self.group.abort()

    def _join(self, s) -> None:
        """The caller's stream waits for every collective issued so far (memory the caller frees afterwards is
        then reused only after the all-reduces that read it)."""
        import cupy

        if self.group.closed:
            return
        ev = self._event("__join__")
        ev.record(self.group.stream)
        with cupy.cuda.Device(self.group.device):
            s.wait_event(ev)

    # -- status exchange ------------------------------------------------------------------------------------

    def _post_status(self, problem):
        """Enqueue the all-reduce of a status word per rank (bit 0: this call's inputs are refused, bit 1: the
        previous call failed after its collectives started) on the group's stream, without waiting: the host
        reads it (:meth:`_await_status`) once the backward is enqueued, so the GPU never idles for it."""
        g = self.group
        codes = np.zeros(g.world_size, np.int32)
        codes[g.rank] = (1 if problem is not None else 0) | (2 if self._failed_before else 0)
        return g.host_all_reduce_start(codes)

    def _await_status(self, pending, problem: str | None) -> None:
        """The status words of every rank; if any is set, a second exchange carries the messages and every rank
        raises (this rank's own refused inputs are re-raised by the caller, more precise than the report)."""
        g = self.group
        codes = g.host_all_reduce_finish(pending)
        if not codes.any():
            return
        width = min(_MSG_BYTES, (32 << 10) // g.world_size)
        text = "; ".join(m for m in (problem, self._failed_before and
                                     f"its previous call failed during the backward ({self._failed_before}); "
                                     "the gradients that call returned on every rank are wrong") if m)
        self._failed_before = None
        msgs = np.zeros((g.world_size, width), np.uint8)
        raw = text.encode("utf-8", "replace")[:width]
        msgs[g.rank, :len(raw)] = np.frombuffer(raw, np.uint8)
        msgs = g.host_all_reduce(msgs)
        lines = []
        for r in np.flatnonzero(codes):
            lines.append(f"rank {r}: " + bytes(msgs[r]).rstrip(b"\0").decode("utf-8", "replace"))
        report = "data-parallel backward refused on every rank because " + " | ".join(lines)
        if problem:
            return
        raise DistributedError(f"rank {g.rank}: {report}")

    def _check_gradients(self, grads, stream) -> None:
        """:meth:`all_reduce_gradients`' arguments, checked on the host before any collective."""
        import cupy

        C.on_stream(stream)
        if not isinstance(grads, (tuple, list)) or len(grads) != len(OUTPUTS):
            raise TypeError(f"grads must be the backward's {len(OUTPUTS)} gradients {OUTPUTS}, got "
                            f"{type(grads).__name__}" + (f" of {len(grads)}" if isinstance(grads, (tuple, list))
                                                         else ""))
        with cupy.cuda.Device(self.group.device):
            for name, shape in list(grad_shapes(0, self.hidden).items())[1:]:  # grad_hidden_states is not summed
                x = grads[OUTPUTS.index(name)]
                C.require_cupy(x, name)
                C.require_dtype(x, name, (C.F32,))
                C.require_shape(x, name, shape, f" (this layer's hidden {self.hidden})")
                C.require_contiguous(x, name)

    def _check_inputs(self, grad_output, hidden_states, qkv_weight, qkv_bias, proj_weight, proj_bias, cos, sin,
                      cu_seqlens, stream, s):
        """The checks that can fail on one rank only (shapes depend on the shard): the single-GPU backward's own
        validation (which the backward repeats), on this rank's device, plus the layer's dims, the ``stream`` (``s``:
        the call's stream, ``stream`` once it is known good), the values of the local ``cu_seqlens`` (a device one
        read on ``s``, where the backward would read it) and a ``plan=`` passed on to the backward (resolved against
        this shard). Returns ``cu_seqlens`` on the host. Raises TypeError/ValueError like the single-GPU
        backward."""
        import cupy

        from ..attention import api, varlen

        C.on_stream(stream)
        with cupy.cuda.Device(self.group.device):
            p, t, h, _, d = api.validate(grad_output, hidden_states, qkv_weight, qkv_bias, proj_weight, proj_bias,
                                         cos, sin, cu_seqlens, 0.0, self.num_heads, self.precision)
            if (h, d) != (self.hidden, self.head_dim):
                raise ValueError(f"this layer is for hidden {self.hidden}, head_dim {self.head_dim}; got hidden "
                                 f"{h}, head_dim {d}")
            cu = cu_seqlens.get(stream=s) if isinstance(cu_seqlens, cupy.ndarray) else cu_seqlens
            vl = varlen.Varlen(cu, t)  # the values: 0 first, non-decreasing, the shard's token count last
            if self._kwargs.get("plan") is not None:  # a plan the backward would refuse for this shard alone
                api.choose_plan(p, d, vl, self._kwargs["plan"])
        return cu


_WRAP_LOCK = threading.Lock()


def _wrap_backend(backend) -> ProcessGroup:
    """The ProcessGroup around a ``cupyx.distributed`` NCCLBackend made by the caller: one per backend, kept on
    it, so that every layer built from one backend issues its collectives on one stream, in one order (NCCL
    pairs a communicator's operations by their order on each rank; on several streams that order is the GPU's
    to choose)."""
    import cupy

    if not hasattr(backend, "_comm") or not hasattr(backend, "rank"):
        raise TypeError("group must be a cupy_rope.distributed.ProcessGroup (from init()) or a "
                        f"cupyx.distributed NCCLBackend, got {type(backend).__name__}")
    with _WRAP_LOCK:
        group = getattr(backend, "_cupy_rope_group", None)
        if group is None or group.closed:
            group = ProcessGroup(backend, backend.rank, backend._n_devices, cupy.cuda.runtime.getDevice())
            try:
                backend._cupy_rope_group = group
            except AttributeError:  # a backend that takes no attribute: a group for this layer alone
                pass
    return group
