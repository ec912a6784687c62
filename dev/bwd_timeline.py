"""Where a bf16 backward unit spends its time: the specialised sm_90a backward kernels (unsplit units) built with
``-DCUPY_ROPE_PROBE_TIMES=1`` (backward_ws.cuh: every unit stamped by consumer thread 0 and writer thread 0; the
same results), run once per setting on the benchmark's inputs (varlen attention alone, or with --block the vision
block on seed workloads), the stamps read back and summed per kernel and per key tile's place in its sequence:
unit length, its K/V wait, its steps, its epilogue (dK/dV stores), the waits inside the steps (full Q/dO stages,
the staging tile read by the writers), the writers' waits (full staging tiles, the previous key tile's count),
and the idle time of each SM between units. Needs an H200 (sm_90a).

    python dev/bwd_timeline.py [--cases 256*32/28/128,...] [--block 8192x32,...] [--json out.json] NAME:ITEM ...
    e.g. python dev/bwd_timeline.py --cases 256*32/28/128 lib:
         python dev/bwd_timeline.py --cases "" --block 8192x32,1024x8 lib:
"""
from __future__ import annotations

import argparse
import statistics

import common
from varlen_ab import case_list

PROBE = "-DCUPY_ROPE_PROBE_TIMES=1"
FIELDS = ("gt0", "c0", "c_kv", "c_steps", "c_end", "w_qdo", "w_staging", "gt1", "smid", "nit", "w_full",
          "w_count", "c_writer", "kind")
KINDS = {1: "fused dQ", 2: "plain", 3: "RoPE epilogue"}


def summarise(rec) -> dict:
    """Per (kernel, key tile's place) means, in µs, of a probe buffer's stamped rows (numpy [n, 16] uint64)."""
    import numpy as np

    rows = rec[rec[:, 13] != 0].astype(np.int64)
    if not len(rows):
        return {}
    # cycles -> µs from the units themselves (the SM clock over the global timer's ns)
    ns_per_cycle = (rows[:, 7] - rows[:, 0]).sum() / max(1, (rows[:, 4] - rows[:, 1]).sum())
    us = lambda c: float(c) * ns_per_cycle / 1e3  # noqa: E731
    out = dict(units=int(len(rows)), ghz=1.0 / ns_per_cycle,
               span_us=(rows[:, 7].max() - rows[:, 0].min()) / 1e3)
    # idle time of each SM between one unit's end and the next unit's start (both from consumer thread 0)
    gaps = []
    for sm in np.unique(rows[:, 8]):
        r = rows[rows[:, 8] == sm]
        r = r[np.argsort(r[:, 0])]
        gaps += list((r[1:, 0] - r[:-1, 7]) / 1e3)
    out["sm_gap_us"] = statistics.fmean(gaps) if gaps else 0.0
    groups = {}
    for kind in np.unique(rows[:, 13]):
        r = rows[rows[:, 13] == kind]
        name = f"{KINDS.get(int(kind) & 15, kind)}, key tile {int(kind) >> 4}"
        groups[name] = dict(
            units=int(len(r)), steps=float(r[:, 9].mean()),
            unit_us=us((r[:, 4] - r[:, 1]).mean()), kv_wait_us=us((r[:, 2] - r[:, 1]).mean()),
            steps_us=us((r[:, 3] - r[:, 2]).mean()), store_us=us((r[:, 4] - r[:, 3]).mean()),
            qdo_wait_us=us(r[:, 5].mean()), staging_wait_us=us(r[:, 6].mean()),
            writer_full_wait_us=us(r[:, 10].mean()), writer_count_wait_us=us(r[:, 11].mean()),
            writer_end_after_steps_us=us((r[:, 12] - r[:, 3]).mean()))
    out["groups"] = groups
    return out


def main(argv=None) -> None:
    import cupy
    import numpy as np

    import cupy_rope as cr
    from cupy_rope import _kernels as K
    from cupy_rope.attention import hopper
    from cupy_rope.bench_varlen import make_inputs
    from cupy_rope.workloads import VarlenCase

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--cases", type=lambda t: case_list(t) if t else [], default=case_list("256*32/28/128"),
                    help="varlen attention alone: LENGTHS/HEADS/HEAD_DIM,... ('' for none)")
    ap.add_argument("--block", type=common.attn_case_list, default=[],
                    help="the vision block's backward (bf16) on seed workloads TxN,...")
    ap.add_argument("--json", default=None)
    ap.add_argument("settings", nargs="+", type=common.build_setting, metavar="NAME:ITEM[,...]")
    a = ap.parse_args(argv)
    report = []
    runs = []
    for lens, nh, d in a.cases:
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        q, k, v, g = make_inputs(VarlenCase("tl", nh, d, tuple(lens)), "bf16", 0)
        mx = max(lens)
        o, lse = cr.varlen_attention_forward(q, k, v, cu, precision="bf16", max_seqlen=mx)
        label = f"{'+'.join(map(str, lens)) if len(lens) < 4 else f'{len(lens)}x{lens[0]}'}/{nh}/{d}"
        runs.append((label, d, lambda plan, g=g, q=q, k=k, v=v, o=o, lse=lse, cu=cu, mx=mx:
                     cr.varlen_attention_backward(g, q, k, v, o, lse, cu, precision="bf16", plan=plan,
                                                  max_seqlen=mx)))
    for t, n in a.block:
        from cupy_rope.workloads import ATTN_HEAD_DIM

        args = common.attn_inputs(t, n)
        runs.append((f"block {t}x{n}", ATTN_HEAD_DIM,
                     lambda plan, args=args: cr.vision_attention_backward(*args, precision="bf16", plan=plan)))
    for label, d, run in runs:
        for name, (fields, defines) in a.settings:
            defines = tuple(defines) + (PROBE,)
            plan = common.plan_override(fields)

            def call():
                with common.sm90_build(defines):
                    return run(plan)

            call()  # builds the module
            mod = K._module("attention_sm90", cupy.cuda.runtime.getDevice(),
                            hopper.part_options("BF16_BWD", d, defines))  # the probed kernels' part
            ptr = mod.module.get_global_var("hop_probe_out")
            if not isinstance(ptr, cupy.cuda.MemoryPointer):  # a bare address in some CuPy versions
                ptr = cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(int(ptr), 8 << 21, mod), 0)
            buf = cupy.ndarray((1 << 21,), np.uint64, memptr=ptr)
            res = []
            for _ in range(3):
                buf.fill(0)
                cupy.cuda.runtime.deviceSynchronize()
                call()
                cupy.cuda.runtime.deviceSynchronize()
                res.append(summarise(buf.get().reshape(-1, 16)))
            best = min(res, key=lambda r: r.get("span_us", 0.0))
            report.append(dict(case=label, setting=name, **best))
            print(f"{label} {name}: {best.get('units')} units, span {best.get('span_us', 0):.1f} µs, "
                  f"SM gap {best.get('sm_gap_us', 0):.2f} µs, clock {best.get('ghz', 0):.2f} GHz", flush=True)
            for gname, gv in best.get("groups", {}).items():
                print(f"   {gname:>24}: " + ", ".join(f"{k} {v:.2f}" for k, v in gv.items()), flush=True)
    common.write_json(a.json, report)


if __name__ == "__main__":
    main()
