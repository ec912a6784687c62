"""Does a build variant of the attention kernels (extra -D options for a switch added to kernels_cu/attention/)
change their speed or their results? The attention kernels of the backward, built with each variant's options
and with none, run on the same packed operands (the plan the library chooses decides which kernels and output
layouts): every output of a variant compared bit for bit with the default build's, the largest relative error of
grad_qkv against it, and each kernel's median GPU µs, builds timed in turn.

    python dev/attn_variants.py [--precisions P,...] [--cases TxN,...] NAME=-DFOO[,-DBAR] ...
    e.g. python dev/attn_variants.py --precisions fp32,tf32 --cases 8192x32,1176x6 try=-DATTN_EXPERIMENT

Correctness also runs on small mixed-length sequences (1, 129, 0, 259 and 256 tokens) at head dims 128, 80, 72.
The default build is the one the tests check against float64; a variant that differs from it in any bit shows its
relative error here, to be read against the precision's bound.
"""
from __future__ import annotations

import argparse

import common

SMALL = [0, 1, 130, 130, 389, 645]  # cu_seqlens of the small mixed-length correctness cases
SMALL_HEAD_DIMS = (128, 80, 72)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawTextHelpFormatter)
    common.add_workload_args(ap, cases="8192x32,2048x8,613x4,131x1")
    ap.add_argument("variants", nargs="+", metavar="NAME=-DFOO[,-DBAR...]", help="build variants")
    ap.add_argument("--rounds", type=int, default=3, help="times each build is timed, in turn (default 3)")
    ap.add_argument("--reps", type=int, default=7, help="repetitions per timing (default 7)")
    a = ap.parse_args(argv)
    builds = {"default": ()}
    for spec in a.variants:
        name, sep, opts = spec.partition("=")
        if not sep or not name or name in builds or not opts:
            ap.error(f"a variant is NAME=-DFOO[,-DBAR...] with a new NAME, got {spec!r}")
        builds[name] = tuple(opts.split(","))
    a.builds = builds
    return a


class Core:
    """The attention kernels of one backward on fixed packed operands, as the schedule launches them for the
    library's plan, with the kernels of any build: outputs written into buffers allocated once."""

    def __init__(self, args, precision):
        import cupy
        import numpy as np

        from cupy_rope._cublas import gemm
        from cupy_rope.attention import kernels as K
        from cupy_rope.attention.plan import make_plan
        from cupy_rope.attention.varlen import Varlen
        from cupy_rope.precision import Precision

        g, x, wq, bq, wp, _bp, cos, sin, cu = args
        p = Precision.parse(precision)
        t, h = x.shape
        d = cos.shape[1]
        nh = h // d
        s = cupy.cuda.get_current_stream().ptr
        bufs = K.Buffers(p, s)
        qkv, dO = cupy.empty((t, 3 * h), np.float32), cupy.empty((t, h), np.float32)
        gemm(bufs.operand(x), bufs.operand(wq), qkv, trans_a=False, trans_b=True, precision=p.label, stream=s)
        gemm(bufs.operand(g), bufs.operand(wp), dO, trans_a=False, trans_b=False, precision=p.label, stream=s)
        self.P = K.prepare(qkv, bq, cos, sin, dO, t, h, nh, d, p, s)
        varlen = Varlen(cupy.asnumpy(cu), t)
        plan = make_plan(p, head_dim=d, tokens=t, max_tiles=varlen.max_tiles)
        tp = K.padded(t)
        o_t, gqkv_t = plan.kmajor, plan.kmajor or plan.nt
        self.out = {"o": cupy.empty((h, tp), np.float32) if o_t else bufs.empty((t, h)),
                    "grad_qkv": bufs.empty((t, 3 * h)), "lse": cupy.empty((nh, t), np.float32),
                    "delta": cupy.empty((nh, t), np.float32), "part": cupy.empty((varlen.ntiles, 3 * h), np.float32)}
        if gqkv_t:
            self.out["grad_qkv_t"] = cupy.zeros((3 * h, tp), np.float32)
        if plan.dq_partials or plan.dq_ordered:  # ordered: one sum, and its counts (zeroed before each pass)
            self.out["dq_partials"] = cupy.empty((plan.dq_partials or 1, t, h), np.float32)
        if plan.dq_ordered:
            self.out["dq_counts"] = cupy.zeros((nh, t), np.int32)
        self.K, self.p, self.d, self.s, self.plan = K, p, d, s, plan
        self.grid = (varlen.ntiles, nh, 1)
        self.tiles = varlen.device_table(s)
        self.cos, self.sin, self.dO = cos, sin, dO
        self.tail = (t, tp, h, float(d ** -0.5 * K.LOG2E), float(d ** -0.5))
        self.o_t, self.gqkv_t = o_t, gqkv_t

    def launches(self, options: tuple) -> dict:
        """{kernel name: launch()} in schedule order, for the build with these extra options."""
        K, o = self.K, self.out
        ptr = lambda name: o[name].data.ptr if name in o else 0  # noqa: E731
        common_args = (self.P.data.ptr, self.cos.data.ptr, self.sin.data.ptr, self.tiles.data.ptr, ptr("lse"),
                       ptr("delta"), ptr("grad_qkv"), ptr("grad_qkv_t"), ptr("part"))
        t, tp, h = self.tail[:3]
        o_ptr, ot_ptr = (0, ptr("o")) if self.o_t else (ptr("o"), 0)
        parts = self.plan.dq_partials or int(self.plan.dq_ordered)
        seq = [("fwd_stats" if parts else "fwd_dq",
                (self.P.data.ptr, self.cos.data.ptr, self.sin.data.ptr, self.dO.data.ptr, self.tiles.data.ptr,
                 o_ptr, ot_ptr, ptr("lse"), ptr("delta"), ptr("grad_qkv"), ptr("grad_qkv_t"), ptr("part"))
                + self.tail)]
        if parts:
            seq.append(("dkdv_dqp", common_args + (ptr("dq_partials"), ptr("dq_counts")) + self.tail))
            seq.append(("dq_reduce", (ptr("dq_partials"), self.cos.data.ptr, self.sin.data.ptr, self.tiles.data.ptr,
                                      ptr("grad_qkv"), ptr("grad_qkv_t"), ptr("part"), t, tp, h, parts)))
        else:
            seq.append(("dkdv", common_args + self.tail))
        out = {"dq_counts": lambda: o["dq_counts"].fill(0)} if "dq_counts" in o else {}  # before the ordered adds
        for name, args in seq:
            k = K.attn_kernel(name, self.p, self.d, options=options)
            out[name] = (lambda k=k, args=args: k(self.grid, (K.THREADS, 1, 1), args, self.s, k.max_smem))
        return out

    def run(self, options: tuple) -> dict:
        """Every output of one pass of the build's kernels (copies)."""
        for launch in self.launches(options).values():
            launch()
        return {k: v.copy() for k, v in self.out.items()}


def compare(core, builds) -> dict:
    """{build: (outputs that differ in any bit from the default build's, grad_qkv's relative error vs it)}."""
    ref = core.run(())
    res = {}
    for name, opts in builds.items():
        if name == "default":
            continue
        got = core.run(opts)
        res[name] = ([k for k in ref if not common.same_bits(got[k], ref[k])],
                     common.rel_err(got["grad_qkv"], ref["grad_qkv"]))
    return res


def report(label, res):
    for name, (differ, err) in res.items():
        print(f"{name:10s} {label}  " + (f"DIFFER: {', '.join(differ)}; grad_qkv rel err {err:.1e}" if differ
                                          else "bit-identical to default"), flush=True)


def main(argv=None) -> int:
    a = parse_args(argv)
    import cupy

    from cupy_rope._bench import Timer

    timer = Timer()
    for prec in a.precisions:  # correctness on small mixed-length sequences, odd head dims included
        for d in SMALL_HEAD_DIMS:
            args = common.attn_inputs(SMALL[-1], 1, seed=1, hidden=4 * d, head_dim=d)
            args[-1] = cupy.asarray(SMALL, dtype=cupy.int32)
            report(f"{prec} small d={d:3d}", compare(Core(args, prec), a.builds))
            common.free_gpu()
    for t, n in a.cases:
        args = common.attn_inputs(t, n)
        for prec in a.precisions:
            core = Core(args, prec)
            report(f"{prec} T={t:5d}", compare(core, a.builds))
            runs = {name: core.launches(opts) for name, opts in a.builds.items()}
            got = common.interleaved(runs, lambda ks: {k: timer.gpu_us(f, reps=a.reps) for k, f in ks.items()},
                                     a.rounds)
            for name in a.builds:
                med = {k: common.median([r[k] for r in got[name]]) for k in got[name][0]}
                print(f"{name:10s} {prec} T={t:5d}  " + "  ".join(f"{k} {v:8.1f}" for k, v in med.items())
                      + f"  sum {sum(med.values()):8.1f}", flush=True)
            del core, runs
            common.free_gpu()
        del args
        common.free_gpu()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
