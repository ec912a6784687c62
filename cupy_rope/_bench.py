"""Benchmark harness shared by both ops (the method of the README's "Timing" paragraph).

GPU time of one call: enqueue an L2 flush (a 256 MiB memset), record the start event, make the call,
record the end event; the median over many repetitions after warm-up. The flush keeps the GPU busy while
Python launches the call, so host overhead stays out of the GPU figure (the empty kernel shows the floor) as
long as the call is issued within the flush's ~85 µs. The hold (the default; ``Timer(hold_host=False)``, ``bench
--no-hold-host`` without it) keeps it busy with a spin kernel after the flush for the call's measured host
issue time as well, so that slower-issued calls (and PyTorch's autograd) are timed on the GPU alone.
Host time: a tight loop of calls, synchronised once at the end. Ceilings (copy rate, GEMM rates) are
measured in the same run.
"""
from __future__ import annotations

import json
import math
import platform
import statistics
import time

import numpy as np

FLUSH_BYTES = 256 << 20  # >= 4 x the H200's 60 MB L2


# The hold (Timer(hold_host=True)): after the flush, a spin kernel as long as the call's host issue time (the
# slowest of HOLD_PROBES issues on an idle GPU) times HOLD_FACTOR plus HOLD_SLACK_S, at most HOLD_MAX_S. The flush
# alone runs ~85 us on the H200, and a call that takes the host longer to issue (a 0.5 ms varlen call: ~230 us;
# PyTorch's autograd of a block: milliseconds) would otherwise have the GPU wait for the host inside its figure.
HOLD_PROBES, HOLD_FACTOR, HOLD_SLACK_S, HOLD_MAX_S = 3, 1.25, 20e-6, 0.05

# The SM clock after each timed repetition (outside its events): a warp counting cycles over CLOCK_PROBE_NS of the
# global timer. Under a long tensor-core load the H200 holds its 700 W cap by lowering the clock (to ~1.6-1.85 GHz
# from 1.98), so the same code measures several percent apart with the GPU's recent load; the figure says which.
CLOCK_PROBE_NS = 20_000


class Timer:
    def __init__(self, hold_host: bool = True):
        import cupy

        self.cupy = cupy
        self.flush = cupy.empty(FLUSH_BYTES, dtype=np.uint8)
        self.stream = cupy.cuda.get_current_stream()
        self.hold_host = hold_host
        self.last_sm_mhz = None  # median SM clock (MHz) right after the repetitions of the last gpu_us

    def _flush(self):
        self.cupy.cuda.runtime.memsetAsync(self.flush.data.ptr, 1, FLUSH_BYTES, self.stream.ptr)

    def _hold_ns(self, fn) -> int:
        """How long to keep the GPU busy before the start event: the call's host issue time, measured on an idle
        GPU (HOLD_PROBES issues, the slowest), with margin (see HOLD_FACTOR)."""
        sync = self.cupy.cuda.runtime.deviceSynchronize
        issue = []
        for _ in range(HOLD_PROBES):
            sync()
            t0 = time.perf_counter()
            fn()
            issue.append(time.perf_counter() - t0)
        sync()
        return int(min(max(issue) * HOLD_FACTOR + HOLD_SLACK_S, HOLD_MAX_S) * 1e9)

    def gpu_us(self, fn, reps: int = 50, warmup: int = 5, max_seconds: float = 3.0) -> float:
        """Median GPU microseconds of ``fn()`` over ``reps`` flushed repetitions (fewer if slow); with
        ``hold_host``, the GPU held busy after each flush until the call is issued (HOLD_FACTOR)."""
        cupy = self.cupy
        for _ in range(warmup):
            fn()
        cupy.cuda.runtime.deviceSynchronize()
        hold = self._hold_ns(fn) if self.hold_host else 0
        from ._kernels import launcher

        spin = launcher("util", "spin_ns", "q")
        probe = launcher("util", "sm_clock_mhz", "qp")
        with self.stream:  # the probes' slots, filled before the first probe writes one
            mhz = cupy.full((reps,), np.nan, np.float32)
        times = []
        t_end = time.perf_counter() + max_seconds
        for i in range(reps):
            ev0, ev1 = cupy.cuda.Event(), cupy.cuda.Event()
            self._flush()
            if hold:
                spin((1, 1, 1), (32, 1, 1), (hold,), self.stream.ptr)
            ev0.record(self.stream)
            fn()
            ev1.record(self.stream)
            probe((1, 1, 1), (32, 1, 1), (CLOCK_PROBE_NS, mhz.data.ptr + 4 * i), self.stream.ptr)
            ev1.synchronize()
            times.append(cupy.cuda.get_elapsed_time(ev0, ev1) * 1e3)
            if i >= 4 and time.perf_counter() > t_end:
                break
        self.last_sm_mhz = round(statistics.median(float(x) for x in mhz.get(stream=self.stream)[:len(times)]), 1)
        return statistics.median(times)

    def method(self) -> str:
        """The timing method, as the JSON files state it."""
        held = ", then the GPU held busy for the call's host issue time" if self.hold_host else ""
        return f"median GPU time over flushed repetitions (256 MiB memset before each{held}), CUDA events"

    def host_us(self, fn, n: int = 200, loops: int = 5) -> float:
        """Host microseconds per call: a tight loop of ``n`` calls, synchronised once at the end; the median
        over ``loops`` such loops (one loop is easily disturbed by other work on the machine)."""
        per_call = []
        for _ in range(loops):
            fn()
            self.cupy.cuda.runtime.deviceSynchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            t1 = time.perf_counter()
            self.cupy.cuda.runtime.deviceSynchronize()
            per_call.append((t1 - t0) / n * 1e6)
        return statistics.median(per_call)


def empty_kernel_us(timer: Timer) -> float:
    from ._kernels import launcher

    k = launcher("util", "empty_kernel", "")
    s = timer.stream.ptr
    return timer.gpu_us(lambda: k((1, 1, 1), (32, 1, 1), (), s), reps=200)


def copy_us(timer: Timer, nbytes: int, reps: int = 20) -> float:
    """GPU µs of a device-to-device cudaMemcpyAsync of ``nbytes`` (read once, written once), timed like the ops."""
    cupy = timer.cupy
    a = cupy.empty(nbytes, dtype=np.uint8)
    b = cupy.empty(nbytes, dtype=np.uint8)
    a.fill(3)
    s = timer.stream.ptr
    return timer.gpu_us(lambda: cupy.cuda.runtime.memcpyAsync(b.data.ptr, a.data.ptr, nbytes, 3, s), reps=reps)


def copy_TBps(timer: Timer, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy rate, counting bytes read plus bytes written."""
    return 2 * nbytes / copy_us(timer, nbytes) / 1e6


def gemm_TFLOPs(timer: Timer, precision: str, n: int = 8192) -> float:
    """An n x n x n product through the same cuBLAS path as the ops, on random data: the faster of A stored as
    is and A stored transposed (FFMA SGEMM, the fp32 mode, is faster with the contraction along A's rows)."""
    from . import _checks as C
    from ._cublas import gemm

    cupy = timer.cupy
    rng = cupy.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    if precision == "bf16":
        a, b = a.astype(C.BF16), b.astype(C.BF16)
    c = cupy.empty((n, n), dtype=np.float32)
    s = timer.stream.ptr
    us = min(timer.gpu_us(lambda: gemm(a, b, c, trans_a=ta, trans_b=False, precision=precision, stream=s), reps=10)
             for ta in (False, True))
    return 2 * n**3 / us / 1e6


def device_info() -> dict:
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    info = {"device": name, "sm_count": props["multiProcessorCount"], "sm_clock_max_mhz": props["clockRate"] / 1e3,
            "cupy": cupy.__version__,
            "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(), "python": platform.python_version()}
    try:
        import ml_dtypes

        info["ml_dtypes"] = ml_dtypes.__version__
    except ImportError:  # pragma: no cover
        pass
    return info


def torch_or_none():
    try:
        import torch

        if torch.cuda.is_available():
            return torch
    except Exception:  # noqa: BLE001 - any import failure means "no torch peer"
        pass
    return None


def same_bits(a, b) -> bool:
    """Bit-identical arrays (compared as integers: NaN bits count as equal, bf16 needs no arithmetic)."""
    import cupy

    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    ints = {2: cupy.uint16, 4: cupy.uint32, 8: cupy.uint64}[a.dtype.itemsize]
    return bool(cupy.array_equal(a.view(ints), b.view(ints)))


def rel_err(out, ref) -> float:
    """Relative Frobenius error ||out - ref|| / ||ref|| in float64; NaN anywhere gives inf."""
    if type(ref).__module__.split(".")[0] == "cupy":
        import cupy as xp
    else:
        xp = np
        out = out.get() if hasattr(out, "get") else out
    o = xp.asarray(out, dtype=np.float64)
    if not bool(xp.isfinite(o).all()):
        return math.inf
    den = float(xp.linalg.norm(ref))
    num = float(xp.linalg.norm(o - ref))
    return num / den if den > 0 else num


def summarize(cases: list, key: str = "gpu_us") -> tuple[float, float]:
    vals = [c[key] for c in cases]
    return statistics.mean(vals), math.exp(statistics.mean(math.log(v) for v in vals))


def print_peer_summary(rows: list) -> None:
    """Mean and geometric mean of each peer's GPU time over the cases."""
    for name in rows[0]["peers_us"] if rows else []:
        pm, pg = summarize([{"gpu_us": r["peers_us"][name]} for r in rows])
        print(f"  peer {name}: mean {pm:.2f} us, geomean {pg:.2f} us")


def write_json(path: str, payload: dict) -> None:
    """The benchmark's JSON at ``path`` (its folder created when missing), and a line saying so."""
    import os

    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
        f.write("\n")
    print(f"wrote {path}", flush=True)
