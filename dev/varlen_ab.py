"""Is one plan setting of varlen attention faster than another? The forward and the backward of
``varlen_attention_forward`` / ``varlen_attention_backward`` alone, under two or more plans, timed in turn (rounds
alternate, so drift hits all alike), on inputs made as the benchmark makes them (bf16 in bf16 mode, host
``max_seqlen``): median GPU ms (the benchmark's timer: L2 flushed, median of the repetitions), TFLOP/s and the
median SM clock of its timings per setting (at the power cap the clock moves with what ran before), and whether
each setting's outputs are bit-identical to the first setting's.

A setting is NAME:ITEM[,ITEM...]: fields of the plan the library would choose (FIELD=VALUE), and build switches
of the sm_90a kernels (-DNAME=VALUE: that build, compiled once, runs the setting's calls); NAME: alone is the
library's plan and build. With --module (and --path), one more setting runs another tree's library as it
stands, in the same process, on the same inputs (e.g. the previous code kept under .old/base as package
cupy_rope_base by dev/snapshot.sh): separate processes differ by more than a small change at short lengths. A
case is LENGTHS/HEADS/HEAD_DIM with LENGTHS like 8192 or 1024*8 or 1+64+3000+0+700.

    python dev/varlen_ab.py [--precision bf16] [--cases ...] NAME:ITEM ...
    e.g. python dev/varlen_ab.py --precision tf32 --cases 8192/16/64,8192/28/128 one:stages=1 two:stages=2
         python dev/varlen_ab.py --cases 16384/28/128 plain:fwd_specialised=False ws:fwd_specialised=True
         python dev/varlen_ab.py base: soft:-DCUPY_ROPE_SOFT_BF16
         python dev/varlen_ab.py --only backward --path .old/base --module cupy_rope_base new:
"""
from __future__ import annotations

import argparse

import common

DEFAULT_CASES = "1+64+3000+0+700+5000+17/16/64,8192/16/64,9216/16/80,8192/16/96,8192/28/128,1024*8/28/128"


def lengths(text: str) -> list[int]:
    out = []
    for part in text.split("+"):
        n, _, times = part.partition("*")
        out += [int(n)] * (int(times) if times else 1)
    if not out or min(out) < 0 or sum(out) == 0:
        raise argparse.ArgumentTypeError(f"sequence lengths like 8192, 1024*8 or 1+64+3000, got {text!r}")
    return out


def case_list(text: str) -> list[tuple[list[int], int, int]]:
    cases = []
    for item in text.split(","):
        parts = item.split("/")
        if len(parts) != 3:
            raise argparse.ArgumentTypeError(f"a case is LENGTHS/HEADS/HEAD_DIM, got {item!r}")
        cases.append((lengths(parts[0]), int(parts[1]), int(parts[2])))
    return cases


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--precision", choices=("bf16", "tf32", "fp32"), default="bf16")
    ap.add_argument("--cases", type=case_list, default=case_list(DEFAULT_CASES), help=f"default {DEFAULT_CASES}")
    ap.add_argument("--only", choices=("forward", "backward", "both"), default="both")
    ap.add_argument("--rounds", type=int, default=2, help="times each setting is timed, in turn (default 2)")
    ap.add_argument("--reps", type=int, default=10, help="repetitions per timing (default 10)")
    ap.add_argument("--json", default=None, help="write the medians as JSON")
    ap.add_argument("settings", nargs="*", type=common.build_setting, metavar="NAME:ITEM[,...]")
    common.add_library_args(ap, "another tree's library, timed as one more setting")
    a = ap.parse_args(argv)
    if a.path and not a.module:
        ap.error("--path needs --module")
    if not a.settings and not a.module:
        ap.error("give at least one setting or --module")
    if a.module and a.module in dict(a.settings):
        ap.error("setting names must differ from --module")
    return a


def main(argv=None) -> None:
    import numpy as np

    import cupy_rope as cr
    from cupy_rope._bench import Timer
    from cupy_rope.bench_varlen import make_inputs
    from cupy_rope.workloads import VarlenCase

    a = parse_args(argv)
    settings = dict(a.settings)
    other = common.import_library(a.module, a.path) if a.module else None
    clock = Timer()
    mhz = []  # the SM clock of each timing, in the order taken (the timer's median over its repetitions)

    def measure(fn) -> float:  # ms, the benchmark's median
        ms = clock.gpu_us(fn, reps=a.reps) / 1e3
        mhz.append(clock.last_sm_mhz)
        return ms
    rows = []
    for lens, nh, d in a.cases:
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        # inputs as the benchmark makes them (bf16 in bf16 mode: no casts inside the timed calls), host max_seqlen
        q, k, v, g = make_inputs(VarlenCase("ab", nh, d, tuple(lens)), a.precision, 0)
        mx = max(lens)
        o, lse = cr.varlen_attention_forward(q, k, v, cu, precision=a.precision, max_seqlen=mx)
        flop = 4 * sum(n * n for n in lens) * d * nh  # forward: two products; the backward 2.5x that
        label = f"{'+'.join(map(str, lens)) if len(lens) < 4 else f'{len(lens)}seq'}/{nh}/{d}"
        for part in (("forward", "backward") if a.only == "both" else (a.only,)):
            fns, outs = {}, {}
            for name, (fields, defines) in settings.items():
                plan = common.plan_override(fields)
                if part == "forward":
                    def call(plan=plan, defines=defines):
                        with common.sm90_build(defines):
                            return cr.varlen_attention_forward(q, k, v, cu, precision=a.precision, plan=plan,
                                                               max_seqlen=mx)
                else:
                    def call(plan=plan, defines=defines):
                        with common.sm90_build(defines):
                            return cr.varlen_attention_backward(g, q, k, v, o, lse, cu, precision=a.precision,
                                                                plan=plan, max_seqlen=mx)
                fns[name] = call
                outs[name] = fns[name]()
            if other is not None:
                if part == "forward":
                    fns[a.module] = lambda: other.varlen_attention_forward(q, k, v, cu, precision=a.precision,
                                                                           max_seqlen=mx)
                else:
                    fns[a.module] = lambda: other.varlen_attention_backward(g, q, k, v, o, lse, cu,
                                                                            precision=a.precision, max_seqlen=mx)
                outs[a.module] = fns[a.module]()
            first = next(iter(outs.values()))
            mhz.clear()
            got = common.interleaved(fns, measure, a.rounds)
            for i, (name, ms) in enumerate(got.items()):
                med = common.median(ms)
                clocks = [x for x in mhz[i::len(got)] if x is not None]  # interleaved: this setting's timings
                sm = common.median(clocks) if clocks else None
                tf = flop * (2.5 if part == "backward" else 1) / med / 1e9
                same = all(common.same_bits(x, y) for x, y in zip(outs[name], first))
                rows.append(dict(case=label, part=part, setting=name, ms=med, tflops=tf, sm_mhz=sm,
                                 same_bits_as_first=same))
                mhz_text = f"{sm:6.0f}" if sm is not None else "     -"
                print(f"{label:>24} {part:<8} {name:>10}: {med:8.3f} ms {tf:6.1f} TFLOP/s {mhz_text} MHz  "
                      f"same bits: {same}", flush=True)
    described = {k: dict(plan=f, build=list(d)) for k, (f, d) in settings.items()}
    if other is not None:
        described[a.module] = dict(library=a.module, path=a.path)
    common.write_json(a.json, dict(precision=a.precision, settings=described, rows=rows))


if __name__ == "__main__":
    main()
