"""How far does a varlen call's time drift under sustained load, and with what SM clock? One case's forward +
backward called back to back (no flush, no hold: the load of a training loop), after a rest: each call's GPU ms
from events around it, and the SM clock right after it (the benchmark's probe, ``util.sm_clock_mhz``, cycles
against the global timer; a few µs of the GPU between calls). Under a long tensor-core load the H200 holds its
700 W cap by lowering the clock, so the first calls from rest run faster than the rest of the loop.

    python dev/power_run.py [--precision tf32] [--case 16384/28/128] [--calls 40] [--rest 2]
"""
from __future__ import annotations

import argparse
import statistics
import time

from varlen_ab import case_list


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--precision", default="tf32", choices=("bf16", "tf32", "fp32"))
    ap.add_argument("--case", type=case_list, default=case_list("16384/28/128"),
                    help="LENGTHS/HEADS/HEAD_DIM as in varlen_ab.py (one case)")
    ap.add_argument("--calls", type=int, default=40, help="calls back to back (default 40)")
    ap.add_argument("--rest", type=float, default=2.0, help="seconds idle before the loop (default 2)")
    a = ap.parse_args(argv)
    import cupy
    import numpy as np

    import cupy_rope as cr
    from cupy_rope._bench import CLOCK_PROBE_NS
    from cupy_rope._kernels import launcher
    from cupy_rope.bench_varlen import make_inputs
    from cupy_rope.workloads import VarlenCase

    (lens, nh, d), = a.case
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    q, k, v, g = make_inputs(VarlenCase("power", nh, d, tuple(lens)), a.precision, 0)
    out = cupy.empty_like(q)
    p, top = a.precision, max(lens)

    def call():
        o, lse = cr.varlen_attention_forward(q, k, v, cu, precision=p, max_seqlen=top, out=out)
        return cr.varlen_attention_backward(g, q, k, v, o, lse, cu, precision=p, max_seqlen=top)

    probe = launcher("util", "sm_clock_mhz", "qp")
    s = cupy.cuda.get_current_stream()
    mhz = cupy.full((a.calls,), np.nan, np.float32)
    ev = [cupy.cuda.Event() for _ in range(2 * a.calls)]
    call()
    s.synchronize()
    time.sleep(a.rest)
    for i in range(a.calls):
        ev[2 * i].record(s)
        call()
        ev[2 * i + 1].record(s)
        probe((1, 1, 1), (32, 1, 1), (CLOCK_PROBE_NS, mhz.data.ptr + 4 * i), s.ptr)
    s.synchronize()
    ms = [cupy.cuda.get_elapsed_time(ev[2 * i], ev[2 * i + 1]) for i in range(a.calls)]
    clk = mhz.get()
    print(f"{a.precision} {len(lens)} x {top} (T {cu[-1]}), {nh} heads, head dim {d}: {a.calls} calls after "
          f"{a.rest:g} s idle")
    for i in range(a.calls):
        print(f"  call {i:3d}  {ms[i]:9.3f} ms  {clk[i]:6.0f} MHz")
    half = a.calls // 2
    print(f"first call {ms[0]:.3f} ms at {clk[0]:.0f} MHz; median of the last {a.calls - half}: "
          f"{statistics.median(ms[half:]):.3f} ms at {statistics.median(clk[half:].tolist()):.0f} MHz")


if __name__ == "__main__":
    main()
