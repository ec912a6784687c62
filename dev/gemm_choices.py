"""Does the GEMM autotuner keep the fastest kernel? For each workload, the block's backward is called (its first
call times every product's cuBLAS candidates once and keeps the fastest); then each product's five fastest
candidates by that timing are timed again alone, in interleaved rounds on fresh operands of the same layout, and
the phase split of one direct call is printed beside them.

    python dev/gemm_choices.py --precisions fp32 --cases 131x1,1024x4,2048x8
    python dev/gemm_choices.py --precisions tf32 --cases 8192x32 --rounds 5

Each product line: its shape and layout (m, n, k, trans_a, trans_b, row strides), the chosen candidate and the
first call's times (µs, fastest first); then "alone": each candidate's min / max over the rounds.
"""
from __future__ import annotations

import argparse

import common


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawTextHelpFormatter)
    common.add_workload_args(ap, precisions="fp32", cases="131x1,1024x4")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the re-timing (default 3)")
    ap.add_argument("--reps", type=int, default=5, help="repetitions per timing (default 5)")
    ap.add_argument("--top", type=int, default=5, help="candidates re-timed per product (default 5)")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    import cupy
    import numpy as np

    import cupy_rope as cr
    from cupy_rope import _bench as B
    from cupy_rope import _cublas as CB
    from cupy_rope.attention.profile import profile_split

    a = parse_args(argv)
    timer = B.Timer(True)
    rng = cupy.random.default_rng(7)
    for precision in a.precisions:
        for t, n in a.cases:
            args = common.attn_inputs(t, n)
            seen = set(CB._lt_plans)
            for _ in range(2):
                cr.vision_attention_backward(*args, precision=precision)
            cupy.cuda.runtime.deviceSynchronize()
            split = profile_split(timer, *args, precision=precision)
            print(f"== {precision} T={t} N={n} phases (us): " + " ".join(f"{k} {v:.1f}" for k, v in split.items()))
            for key in [k for k in CB._lt_plans if k not in seen]:  # the plans this workload's calls made
                plan, ex = CB._lt_plans[key], key[1]
                m, nn, k, ta, tb, lda, ldb = ex[0], ex[1], ex[2], ex[3], ex[4], ex[7], ex[8]
                times = sorted((getattr(plan, "times_us", None) or {}).items(), key=lambda kv: kv[1])
                chosen = plan.label(plan.chosen) if plan.chosen is not None else None
                print(f"  m={m} n={nn} k={k} ta={ta} tb={tb} lda={lda} ldb={ldb} chosen={chosen} first: "
                      + " ".join(f"{plan.label(i)}={v:.0f}" for i, v in times[:8]))
                if not times or ex[5] != CB.CUDA_R_32F:
                    continue
                sa = cupy.asarray(rng.standard_normal((k, lda) if ta else (m, lda), dtype=np.float32))
                sb = cupy.asarray(rng.standard_normal((nn, ldb) if tb else (k, ldb), dtype=np.float32))
                op_a, op_b = (sa[:, :m] if ta else sa[:, :k]), (sb[:, :k] if tb else sb[:, :nn])
                c = cupy.empty((m, nn), np.float32)
                s = cupy.cuda.get_current_stream().ptr
                alone: dict = {}
                for _ in range(a.rounds):
                    for i, _ in times[:a.top]:
                        us = timer.gpu_us(lambda i=i: plan.run(i, op_a, op_b, c, s, False), reps=a.reps)
                        alone.setdefault(plan.label(i), []).append(us)
                print("     alone (min/max over rounds): "
                      + " ".join(f"{lab}={min(v):.0f}/{max(v):.0f}" for lab, v in alone.items()))
            del args
            common.free_gpu()


if __name__ == "__main__":
    main()
