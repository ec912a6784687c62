"""Command line: ``python -m cupy_rope bench {rope,attention} [options]``."""
from __future__ import annotations

import argparse
import sys

from ._gpu import gpu_problem


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cupy_rope", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bench", help="time an op on its built-in workloads against the roofline and peers")
    b.add_argument("op", choices=["rope", "attention"])
    b.add_argument("--precision", choices=["fp32", "tf32", "bf16"], default="tf32", help="attention only")
    b.add_argument("--out", help="write the results as JSON to this file")
    b.add_argument("--reps", type=int, default=None, help="timed repetitions per case")
    b.add_argument("--no-peers", action="store_true", help="skip the peer implementations")
    b.add_argument("--cases", help="comma-separated case indices (0-15) to run; default all")
    a = p.parse_args(argv)
    problem = gpu_problem()
    if problem:  # before any import that would touch the GPU: one plain paragraph, not a CUDA traceback
        print(problem, file=sys.stderr)
        return 1
    cases = None if not a.cases else {int(c) for c in a.cases.split(",")}
    if a.op == "rope":
        from .bench_rope import run

        return run(a.out, reps=a.reps or 100, peers=not a.no_peers, cases=cases)
    from .bench_attention import run

    return run(a.precision, a.out, reps=a.reps or 20, peers=not a.no_peers, cases=cases)


if __name__ == "__main__":
    sys.exit(main())
