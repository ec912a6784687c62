"""How far does a varlen call's time drift under sustained load, and with what SM clock? One case's forward +
backward called back to back (no flush, no hold: the load of a training loop), after a rest: each call's GPU ms
from events around it, and the SM clock right after it (the benchmark's probe, ``util.sm_clock_mhz``, cycles
against the global timer; a few µs of the GPU between calls). Under a long tensor-core load the H200 holds its
700 W cap by lowering the clock, so the first calls from rest run faster than the rest of the loop.

With settings (NAME:ITEM[,ITEM...] as in varlen_ab.py: plan fields and sm_90a build switches), the loop's calls
take turns among them (call i runs setting i mod n), so that each meets the same power state; each setting's
median over the last half of the loop is printed last.

    python dev/power_run.py [--precision tf32] [--case 16384/28/128] [--calls 40] [--rest 2] [NAME:ITEM ...]
    e.g. python dev/power_run.py --case 9216/16/80 --calls 60 split: whole:tail_parts=1
"""
from __future__ import annotations

import argparse
import statistics
import time

import common
from varlen_ab import case_list


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--precision", default="tf32", choices=("bf16", "tf32", "fp32"))
    ap.add_argument("--case", type=case_list, default=case_list("16384/28/128"),
                    help="LENGTHS/HEADS/HEAD_DIM as in varlen_ab.py (one case)")
    ap.add_argument("--calls", type=int, default=40, help="calls back to back (default 40)")
    ap.add_argument("--rest", type=float, default=2.0, help="seconds idle before the loop (default 2)")
    ap.add_argument("settings", nargs="*", type=common.build_setting, metavar="NAME:ITEM[,...]",
                    help="plans taking turns (default: the library's alone)")
    a = ap.parse_args(argv)
    names = [n for n, _ in a.settings]
    if len(set(names)) != len(names):
        ap.error("setting names must differ")
    if a.settings and a.calls < 2 * len(a.settings):
        ap.error(f"--calls must give each of the {len(a.settings)} settings two calls at least")
    return a


def main(argv=None) -> None:
    a = parse_args(argv)
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

    settings = a.settings or [("library", ({}, ()))]

    def call(i):
        _, (fields, defines) = settings[i % len(settings)]
        plan = common.plan_override(fields)
        with common.sm90_build(defines):
            o, lse = cr.varlen_attention_forward(q, k, v, cu, precision=p, max_seqlen=top, out=out, plan=plan)
            return cr.varlen_attention_backward(g, q, k, v, o, lse, cu, precision=p, max_seqlen=top, plan=plan)

    probe = launcher("util", "sm_clock_mhz", "qp")
    s = cupy.cuda.get_current_stream()
    mhz = cupy.full((a.calls,), np.nan, np.float32)
    ev = [cupy.cuda.Event() for _ in range(2 * a.calls)]
    for i in range(len(settings)):  # each setting's kernels built and its GEMMs chosen before the rest
        call(i)
    s.synchronize()
    time.sleep(a.rest)
    for i in range(a.calls):
        ev[2 * i].record(s)
        call(i)
        ev[2 * i + 1].record(s)
        probe((1, 1, 1), (32, 1, 1), (CLOCK_PROBE_NS, mhz.data.ptr + 4 * i), s.ptr)
    s.synchronize()
    ms = [cupy.cuda.get_elapsed_time(ev[2 * i], ev[2 * i + 1]) for i in range(a.calls)]
    clk = mhz.get()
    print(f"{a.precision} {len(lens)} x {top} (T {cu[-1]}), {nh} heads, head dim {d}: {a.calls} calls after "
          f"{a.rest:g} s idle")
    n = len(settings)
    for i in range(a.calls):
        print(f"  call {i:3d}  {ms[i]:9.3f} ms  {clk[i]:6.0f} MHz" + (f"  {settings[i % n][0]}" if n > 1 else ""))
    half = a.calls // 2
    print(f"first call {ms[0]:.3f} ms at {clk[0]:.0f} MHz")
    for j, (name, _) in enumerate(settings):
        last = [i for i in range(half, a.calls) if i % n == j]
        t_ms, t_mhz = statistics.median([ms[i] for i in last]), statistics.median([float(clk[i]) for i in last])
        print(f"{name:>12}: median of its {len(last)} calls in the last {a.calls - half}: {t_ms:.3f} ms at "
              f"{t_mhz:.0f} MHz")


if __name__ == "__main__":
    main()
