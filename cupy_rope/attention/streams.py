"""The backward's second stream: fork, join, and the join on every path.

cuBLAS kernels (and the dK/dV kernel) leave SMs idle in their last wave; independent work on a second stream fills
them. The side stream is forked from the caller's stream with an event and joined back into it with another; a
CUDA-graph recording turns the pair into parallel branches. :meth:`Side.scope` joins on exit whatever happens
inside, so an exception (an out-of-memory error, a failing launch) never leaves the side stream writing into
temporaries that have gone back to CuPy's pool.

Side streams and their events are per thread (several threads may share one stream pointer: every thread's
per-thread default stream has the same one) and per (device, caller stream), at most MAX_PER_THREAD per thread;
an evicted side stream has been joined, and CUDA destroys a stream only once its work is done.
"""
from __future__ import annotations

import collections
import contextlib
import threading

from .. import _checks as C

MAX_PER_THREAD = 8

_tls = threading.local()


def _side_entry(s: int):
    """(stream, fork event, join event) of this thread beside caller stream ``s`` on the current device."""
    import cupy
    from cupy_backends.cuda.api import runtime

    cache = getattr(_tls, "sides", None)
    if cache is None:
        cache = _tls.sides = collections.OrderedDict()
    key = (runtime.getDevice(), s)
    entry = cache.get(key)
    if entry is None:
        entry = cache[key] = (cupy.cuda.Stream(non_blocking=True), cupy.cuda.Event(disable_timing=True),
                              cupy.cuda.Event(disable_timing=True))
        while len(cache) > MAX_PER_THREAD:
            cache.popitem(last=False)
    else:
        cache.move_to_end(key)
    return entry


def side_stream(s: int):
    """This thread's side stream beside caller stream ``s`` (current device)."""
    return _side_entry(s)[0]


class Side:
    """A second stream beside caller stream ``main`` (``ptr``; ``ctx`` makes it current so that allocations made
    for it belong to it in CuPy's pool), or, when serial, the caller's stream itself with no events."""

    def __init__(self, main: int, concurrent: bool):
        self.main = main
        if concurrent:  # the objects are held here: evicted from the cache meanwhile, they stay until the join
            stream, fork_ev, join_ev = self._held = _side_entry(main)
            self.ptr, self.ctx, self._ev = stream.ptr, stream, (fork_ev.ptr, join_ev.ptr)
        else:
            self.ptr, self.ctx, self._ev, self._held = main, C._NULL_CONTEXT, None, None
        self._forked = False

    def fork(self) -> None:
        """Work enqueued on the side stream from now on starts after the work enqueued on the main one so far."""
        if self._ev is not None:
            from cupy_backends.cuda.api import runtime

            runtime.eventRecord(self._ev[0], self.main)
            runtime.streamWaitEvent(self.ptr, self._ev[0], 0)
            self._forked = True

    def join(self) -> None:
        """Work enqueued on the main stream from now on starts after the side stream's work so far."""
        if self._ev is not None and self._forked:
            from cupy_backends.cuda.api import runtime

            runtime.eventRecord(self._ev[1], self.ptr)
            runtime.streamWaitEvent(self.main, self._ev[1], 0)
            self._forked = False

    @contextlib.contextmanager
    def scope(self):
        """Use the side stream inside; on the way out, normal or not, the main stream waits for it."""
        try:
            yield self
        finally:
            self.join()
