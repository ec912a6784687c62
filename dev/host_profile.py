"""What does a call cost the host, and what does the GPU do with it? Host µs of one call of each entry point
while a spin kernel keeps the GPU busy (so the host never waits on the device): an empty kernel through the
launcher, rope_2d_backward, a GEMM, vision_attention_backward issued directly (host cu_seqlens) and through
the per-layer handle VisionAttentionBackward (a CUDA graph replay); with the GPU µs of the attention calls
(device and host cu_seqlens, handle). --trace DIR also writes a kernel timeline of three flushed calls per
workload through torch.profiler (when PyTorch is there).

    python dev/host_profile.py [--cases 131x1,1176x6,8192x32] [--precisions tf32] [--out FILE.json] [--trace DIR]
"""
from __future__ import annotations

import argparse
import statistics
import time

import common

SPIN = r'''
extern "C" __global__ void spin(long long ns) {
  long long t0, t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0)); t = t0;
  while (t - t0 < ns) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
}'''


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawTextHelpFormatter)
    common.add_workload_args(ap, precisions="tf32", cases="131x1,1176x6,8192x32")
    ap.add_argument("--reps", type=int, default=20, help="calls timed per entry point (default 20)")
    ap.add_argument("--out", help="write the numbers as JSON to this file")
    ap.add_argument("--trace", metavar="DIR", help="write torch.profiler chrome traces into DIR")
    return ap.parse_args(argv)


class Busy:
    """Host µs of single calls made while the GPU runs a spin kernel: the call's own work queues behind it, so
    the host time is the issue cost alone (a call that waited on the device would show the spin's length)."""

    def __init__(self, spin_ms: float = 20.0):
        import cupy

        self.cupy = cupy
        self.kernel = cupy.RawKernel(SPIN, "spin")
        self.ns = int(spin_ms * 1e6)

    def host_us(self, fn, reps: int) -> float:
        import numpy as np

        fn()  # first-call work (compiles, plans) stays out of the figure
        times = []
        for _ in range(reps):
            self.cupy.cuda.runtime.deviceSynchronize()
            self.kernel((1,), (1,), (np.int64(self.ns),))
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        self.cupy.cuda.runtime.deviceSynchronize()
        return round(statistics.median(times), 2)


def trace(args, precision, path):
    """Kernel timeline of three flushed calls (CUPTI through torch.profiler sees CuPy's kernels too)."""
    import cupy
    import torch
    from torch.profiler import ProfilerActivity, profile

    import cupy_rope as cr

    from cupy_rope._bench import FLUSH_BYTES

    torch.cuda.init()
    flush = cupy.empty(FLUSH_BYTES, cupy.uint8)  # the benchmark's L2 flush, enqueued before each call
    cr.vision_attention_backward(*args, precision=precision)
    cupy.cuda.runtime.deviceSynchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            flush.fill(1)
            cr.vision_attention_backward(*args, precision=precision)
        cupy.cuda.runtime.deviceSynchronize()
    prof.export_chrome_trace(path)


def main(argv=None) -> int:
    a = parse_args(argv)
    import cupy
    import numpy as np

    import cupy_rope as cr
    from cupy_rope._bench import Timer
    from cupy_rope._cublas import gemm
    from cupy_rope._kernels import launcher

    timer, busy = Timer(), Busy()
    s = timer.stream.ptr
    report = {}
    empty = launcher("util", "empty_kernel", "")
    report["empty_kernel_launcher"] = busy.host_us(lambda: empty((1, 1, 1), (32, 1, 1), (), s), a.reps)
    gc, gs, th = common.rope_inputs(2, 256)
    out = cupy.empty(th.shape, np.float32)
    report["rope_out"] = busy.host_us(lambda: cr.rope_2d_backward(gc, gs, th, out=out), a.reps)
    report["rope_alloc"] = busy.host_us(lambda: cr.rope_2d_backward(gc, gs, th), a.reps)
    x, w = cupy.ones((131, 3584), np.float32), cupy.ones((3 * 3584, 3584), np.float32)
    c = cupy.empty((131, 3 * 3584), np.float32)
    for p in a.precisions:
        if p != "bf16":  # bf16 takes bf16 operands
            report[f"gemm_qkv_T131_{p}"] = busy.host_us(
                lambda: gemm(x, w, c, trans_a=False, trans_b=True, precision=p, stream=s), a.reps)
    print(report, flush=True)
    gc = gs = th = out = x = w = c = None  # freed before the attention cases (the lambdas above are done)
    for t, n in a.cases:
        args = common.attn_inputs(t, n)
        cu = cupy.asnumpy(args[-1])
        args_h = args[:-1] + [cu]
        h, d = args[1].shape[1], args[6].shape[1]
        for p in a.precisions:
            key = f"T{t}_{p}"
            handle = cr.VisionAttentionBackward(cu, hidden_size=h, head_dim=d, precision=p)
            direct = lambda: cr.vision_attention_backward(*args_h, precision=p)  # noqa: E731
            replay = lambda: handle(*args[:8])  # noqa: E731
            handle(*args[:8])  # records
            row = {"host_us_direct": busy.host_us(direct, a.reps), "host_us_handle": busy.host_us(replay, a.reps),
                   "gpu_us_device_cu": round(timer.gpu_us(lambda: cr.vision_attention_backward(*args, precision=p),
                                                          reps=10), 1),
                   "gpu_us_host_cu": round(timer.gpu_us(direct, reps=10), 1),
                   "gpu_us_handle": round(timer.gpu_us(replay, reps=10), 1)}
            report[key] = row
            print(key, row, flush=True)
            if a.trace:
                try:
                    trace(args, p, f"{a.trace}/trace_{key}.json")
                except Exception as e:  # noqa: BLE001 - no PyTorch or no CUPTI: the numbers above still stand
                    print("trace failed:", repr(e))
            handle.close()
        args = args_h = None  # freed before the next case
        common.free_gpu()
    common.write_json(a.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
