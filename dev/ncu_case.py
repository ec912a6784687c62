"""One attention backward (T tokens in N sequences, a precision, optional plan overrides), issued twice, for a
profiler to look at (ncu_stalls.sh, compute-sanitizer, nsys).

    python dev/ncu_case.py T N PRECISION [FIELD=VALUE ...]     e.g. 8192 32 fp32 dq_partials=0
"""
from __future__ import annotations

import argparse

import common


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("tokens", type=int)
    ap.add_argument("sequences", type=int)
    ap.add_argument("precision", choices=common.PRECISIONS)
    ap.add_argument("fields", nargs="*", metavar="FIELD=VALUE", help="plan field overrides")
    a = ap.parse_args(argv)
    import cupy

    import cupy_rope as cr

    plan = common.plan_override(common.plan_fields(a.fields))
    args = common.attn_inputs(a.tokens, a.sequences)
    for _ in range(2):
        cr.vision_attention_backward(*args, precision=a.precision, plan=plan)
    cupy.cuda.runtime.deviceSynchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
