"""Development aid: where the host time of a call goes, and a GPU kernel timeline of one flushed call.

Host phases of a directly issued call are timed while a spin kernel keeps the GPU busy, so the host never
waits on the device (a call with a probe is never replayed from a CUDA graph).
Usage: python scripts/host_profile.py OUTDIR
"""
import json
import statistics
import sys
import time

import cupy
import numpy as np

import cupy_rope as cr
from cupy_rope import attention as A
from cupy_rope._bench import Timer
from cupy_rope.bench_attention import make_inputs

OUT = sys.argv[1] if len(sys.argv) > 1 else "."
KEYS = ("grad_output", "hidden_states", "qkv_weight", "qkv_bias", "proj_weight", "proj_bias", "cos", "sin", "cu_seqlens")
_spin = cupy.RawKernel(r'''
extern "C" __global__ void spin(long long ns) {
  long long t0, t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0)); t = t0;
  while (t - t0 < ns) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
}''', "spin")


def spin(ms):
    _spin((1,), (1,), (np.int64(ms * 1e6),))


def host_phases(args, precision, reps=5):
    """Host µs of each phase of _backward with the GPU kept busy (numpy cu_seqlens: no read-back)."""
    g, x, wq, bq, wp, bp, cos, sin, cu = args
    cu_h = cupy.asnumpy(cu)
    runs = []
    for _ in range(reps):
        cupy.cuda.runtime.deviceSynchronize()
        spin(30)
        stamps = [("call", time.perf_counter())]
        t, h, nh, d = A._validate(g, x, wq, bq, wp, bp, cos, sin, cu_h, 0.0, None, precision)
        stamps.append(("validate", time.perf_counter()))
        s = cupy.cuda.get_current_stream().ptr
        A._backward(g, x, wq, bq, wp, cos, sin, cu_h, t, h, nh, d, d ** -0.5, precision, s,
                    lambda label: stamps.append((label, time.perf_counter())))
        stamps.append(("end", time.perf_counter()))
        ph = {}
        for (_, t0), (lab, t1) in zip(stamps[:-1], stamps[1:]):
            ph[lab] = ph.get(lab, 0) + (t1 - t0) * 1e6
        runs.append(ph)
    cupy.cuda.runtime.deviceSynchronize()
    return {k: round(statistics.median(r[k] for r in runs), 1) for k in runs[0]}


def host_loop(fn, n=200, busy_ms=None):
    fn()
    cupy.cuda.runtime.deviceSynchronize()
    if busy_ms:
        spin(busy_ms)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    cupy.cuda.runtime.deviceSynchronize()
    return round((t1 - t0) / n * 1e6, 2)


def main():
    rng = cupy.random.default_rng(0)
    report = {}
    timer = Timer()
    for t, n in ((131, 1), (1176, 6), (8192, 32)):
        xs = make_inputs(t, n, rng)
        args = [xs[k] for k in KEYS]
        for prec in ("tf32", "bf16", "fp32") if t == 131 else ("tf32",):
            key = f"T{t}_{prec}"
            report[key + "_host_phases"] = host_phases(args, prec)
            report[key + "_gpu_us_device_cu"] = timer.gpu_us(lambda: cr.vision_attention_backward(*args, precision=prec), reps=10)
            args_h = args[:-1] + [cupy.asnumpy(args[-1])]
            report[key + "_gpu_us_host_cu"] = timer.gpu_us(lambda: cr.vision_attention_backward(*args_h, precision=prec), reps=10)
            print(key, report[key + "_host_phases"], report[key + "_gpu_us_device_cu"], report[key + "_gpu_us_host_cu"], flush=True)
    # gemm host cost (GPU busy)
    from cupy_rope._cublas import gemm
    a = cupy.ones((131, 3584), np.float32)
    w = cupy.ones((10752, 3584), np.float32)
    c = cupy.empty((131, 10752), np.float32)
    s = cupy.cuda.get_current_stream().ptr
    for prec in ("tf32", "fp32"):
        report[f"gemm_host_us_{prec}"] = host_loop(lambda: gemm(a, w, c, trans_a=False, trans_b=True, precision=prec, stream=s), n=20, busy_ms=50)
    report["cupy_empty_host_us"] = host_loop(lambda: cupy.empty((131, 3584), np.float32), n=2000)
    # RoPE host components
    from cupy_rope._kernels import launcher
    from cupy_backends.cuda.api import driver
    gc = rng.standard_normal((2, 256, 128), dtype=np.float32).astype(cr._checks.BF16)
    gs = rng.standard_normal((2, 256, 128), dtype=np.float32).astype(cr._checks.BF16)
    th = rng.standard_normal((2, 256, 128), dtype=np.float32)
    out = cupy.empty_like(th)
    lau = launcher("rope", "rope_bwd_vec_bf16", "ppppq")
    nn = out.size
    args5 = (gc.data.ptr, gs.data.ptr, th.data.ptr, out.data.ptr, nn)
    report["rope_host_full_out"] = host_loop(lambda: cr.rope_2d_backward(gc, gs, th, out=out), n=2000, busy_ms=20)
    report["rope_host_full_alloc"] = host_loop(lambda: cr.rope_2d_backward(gc, gs, th), n=2000, busy_ms=20)
    report["rope_host_launcher"] = host_loop(lambda: lau((16, 1, 1), (256, 1, 1), args5, s), n=2000, busy_ms=20)
    report["rope_host_driver"] = host_loop(lambda: driver.launchKernel(lau._ptr, 16, 1, 1, 256, 1, 1, 0, s, lau._params_addr, 0), n=2000, busy_ms=20)
    report["rope_host_full_out_idle"] = host_loop(lambda: cr.rope_2d_backward(gc, gs, th, out=out), n=2000)
    print({k: v for k, v in report.items() if "rope" in k or "gemm" in k or "empty" in k}, flush=True)
    # kernel timeline of flushed calls through torch's profiler (CUPTI sees CuPy's kernels too)
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
        torch.cuda.init()
        for t, n in ((131, 1), (8192, 32)):
            xs = make_inputs(t, n, rng)
            args = [xs[k] for k in KEYS]
            cr.vision_attention_backward(*args)
            cupy.cuda.runtime.deviceSynchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    timer._flush()
                    cr.vision_attention_backward(*args)
                cupy.cuda.runtime.deviceSynchronize()
            prof.export_chrome_trace(f"{OUT}/trace_T{t}.json")
    except Exception as e:  # noqa: BLE001
        print("trace failed:", repr(e))
    with open(f"{OUT}/host_profile.json", "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
