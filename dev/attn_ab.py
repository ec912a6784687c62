"""Is one schedule setting faster than another? The whole attention backward under two or more plans, timed in
turn (rounds alternate, so drift hits all alike), median GPU µs per setting on each workload and the mean.

A setting is NAME:ITEM[,ITEM...]: fields of the plan the library would choose (FIELD=VALUE), replaced
(``dataclasses.replace``) and passed as ``plan=``, and build switches of the sm_90a kernels (-DNAME=VALUE: that
build, compiled once, runs the setting's calls); NAME: alone is the library's own plan and build. With --module (and
--path), one more setting runs another tree's library as it stands, on the same inputs: the reference for a
kernel or schedule change (e.g. the previous code kept under .old/base as package cupy_rope_base).

Calls are timed as the benchmark times them: through a per-layer handle (VisionAttentionBackward, a CUDA graph
replay up to the plan's graph limit); an older tree without handles by direct calls with its own replay. With
--direct, every call is issued directly (no replay: small workloads then include the host's issue time). With
--phases, each setting's phases instead (profile_split: one direct call, phases on one stream, events between).

    python dev/attn_ab.py                                   # two:concurrent=True one:concurrent=False
    python dev/attn_ab.py --precisions tf32 kmajor:kmajor=True plain:kmajor=False
    python dev/attn_ab.py --precisions fp32 --cases 613x4,8192x32 plain:nt=False,nt_qkv=False nt:nt=True
    python dev/attn_ab.py --path .old/base --module cupy_rope_base new:
    python dev/attn_ab.py --phases --precisions tf32 lib:   # where the time of one backward goes
    python dev/attn_ab.py --long --precisions bf16 --rounds 3 one:concurrent=False two:concurrent=True
    python dev/attn_ab.py --long --precisions tf32 base: off:-DCUPY_ROPE_TF32_DO_APART=0
"""
from __future__ import annotations

import argparse
import importlib

import common


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawTextHelpFormatter)
    common.add_workload_args(ap)
    ap.add_argument("settings", nargs="*", type=common.build_setting, metavar="NAME:ITEM[,...]",
                    help="plan settings to compare (default: two:concurrent=True one:concurrent=False)")
    ap.add_argument("--long", action="store_true",
                    help="the long-sequence workloads (workloads.LONG_CASES, their own model sizes) for --cases")
    ap.add_argument("--rounds", type=int, default=2, help="times each setting is timed, in turn (default 2)")
    ap.add_argument("--reps", type=int, default=10, help="repetitions per timing (default 10)")
    how = ap.add_mutually_exclusive_group()
    how.add_argument("--direct", action="store_true", help="issue every call directly (no graph replay)")
    how.add_argument("--phases", action="store_true", help="time each phase (profile_split) instead of the call")
    common.add_library_args(ap, "another tree's library to time as one more setting")
    a = ap.parse_args(argv)
    if a.path and not a.module:
        ap.error("--path needs --module")
    from cupy_rope import workloads

    # (T, N, model sizes): the seed model's unless --long
    a.cases = ([(sum(c.seq_lens), len(c.seq_lens), {"hidden": c.hidden, "head_dim": c.head_dim})
                for c in workloads.LONG_CASES] if a.long else [(t, n, {}) for t, n in a.cases])
    if not a.settings and not a.module:
        a.settings = [common.build_setting("two:concurrent=True"), common.build_setting("one:concurrent=False")]
    return a


def profile_split_of(lib):
    """The phase profiler of a library tree (its attention package's profile module, or an older single
    attention module's function)."""
    try:
        return importlib.import_module(lib.__name__ + ".attention.profile").profile_split
    except ImportError:
        return importlib.import_module(lib.__name__ + ".attention").profile_split


class Setting:
    """One way of calling the backward: a library tree and, for this tree, a plan override and build switches
    of the sm_90a kernels."""

    def __init__(self, lib, plan, takes_plan: bool, defines: tuple = ()):
        self.lib, self.plan, self.takes_plan, self.defines = lib, plan, takes_plan, defines
        self.kw = {"plan": plan} if takes_plan else {}

    def call(self, args, precision, mode: str, timer, reps: int):
        """The function to time for one workload and precision."""
        fn = self._call(args, precision, mode, timer, reps)
        if not self.defines:
            return fn

        def built():
            with common.sm90_build(self.defines):
                return fn()
        return built

    def _call(self, args, precision, mode: str, timer, reps: int):
        lib = self.lib
        if mode == "phases":
            split = profile_split_of(lib)
            return lambda: split(timer, *args, precision=precision, reps=reps, **self.kw)
        if mode == "handle" and hasattr(lib, "VisionAttentionBackward"):
            import numpy as np

            cu = np.asarray(args[-1].get())
            handle = lib.VisionAttentionBackward(cu, hidden_size=args[1].shape[1], head_dim=args[6].shape[1],
                                                 precision=precision, **self.kw)
            block = args[:-1]
            return lambda: handle(*block)
        return lambda: lib.vision_attention_backward(*args, precision=precision, **self.kw)


def main(argv=None) -> int:
    a = parse_args(argv)
    import cupy_rope
    from cupy_rope._bench import Timer

    mode = "phases" if a.phases else "direct" if a.direct else "handle"
    runs = {name: Setting(cupy_rope, common.plan_override(fields), True, defines)
            for name, (fields, defines) in a.settings}
    if a.module:
        other = common.import_library(a.module, a.path)
        if hasattr(other, "set_graph_replay"):  # an older tree's implicit replay: on as its bench ran, or off
            other.set_graph_replay(mode == "handle")
        runs[a.module] = Setting(other, None, False)
    if len(runs) != len(a.settings) + bool(a.module):
        raise SystemExit("setting names must differ (and differ from --module)")
    names = list(runs)
    first = names[0]
    timer = Timer()
    means = {p: dict.fromkeys(names, 0.0) for p in a.precisions}
    measure = (lambda fn: fn()) if a.phases else (lambda fn: timer.gpu_us(fn, reps=a.reps))
    for t, n, shape in a.cases:
        args = common.attn_inputs(t, n, **shape)
        for prec in a.precisions:
            fns = {name: runs[name].call(args, prec, mode, timer, a.reps) for name in names}
            got = common.interleaved(fns, measure, a.rounds)
            del fns  # handles release their recordings
            if a.phases:
                for name in names:
                    phases = {k: common.median([r[k] for r in got[name]]) for k in got[name][0]}
                    means[prec][name] += sum(v for k, v in phases.items() if k not in ("cublas", "kernels")) \
                        / len(a.cases)
                    print(f"T={t:5d} {prec} {name:>10}  " + "  ".join(f"{k} {v:.1f}" for k, v in phases.items()),
                          flush=True)
                continue
            med = {name: common.median(v) for name, v in got.items()}
            for name in names:
                means[prec][name] += med[name] / len(a.cases)
            print(f"T={t:5d} {prec}  " + "  ".join(
                f"{name} {med[name]:.1f} ({' '.join(f'{v:.0f}' for v in got[name])}"
                + (f", {med[name] / med[first] - 1:+.1%})" if name != first else ")") for name in names), flush=True)
        del args
        common.free_gpu()
    what = "sum of phases" if a.phases else f"GPU us, {mode} calls"
    for prec, m in means.items():
        print(f"mean {prec} ({what}): " + "  ".join(
            f"{name} {v:.1f}" + (f" ({v / m[first] - 1:+.1%})" if name != first else "") for name, v in m.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
