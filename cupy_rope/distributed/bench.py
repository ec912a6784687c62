"""``bench``: the data-parallel benchmark, run under the launcher (``--nproc N bench [--precision P]``).

Model sizes of the seed (hidden 3584, 28 heads of 128). Two batches: 64 sequences of 105-256 tokens (lengths
from a seeded NumPy generator, 11,651 tokens) and 16 sequences of 1024. Per batch, in one run:

* ``gpu_us_one``: rank 0 alone runs the backward of the whole batch (the single-GPU peer);
* ``gpu_us_shard``: every rank runs the plain backward on its shard (no communication);
* ``allreduce_us``: the gradient all-reduces alone, same buffers and buckets;
* ``gpu_us_dp``: the data-parallel step (:class:`DataParallelBackward`).

Each figure is the median over repetitions of the GPU time of one call (an L2 flush, then the start event, the
call, the end event, on each rank's stream; unlike the one-GPU benchmarks no spin kernel covers the host's issue
time, so issue time beyond the flush counts); for the collective figures the
ranks meet at a barrier before each repetition and the slowest rank's time counts. Derived:
``hidden_fraction = 1 - (gpu_us_dp - gpu_us_shard) / allreduce_us`` (1: the all-reduce is fully hidden),
``speedup = gpu_us_one / gpu_us_dp`` and ``efficiency = speedup / N``. Rank 0 checks the summed gradients
(and every rank its rows of grad_hidden_states) against the single-GPU result: relative Frobenius error
within the error bound of the precision (README).
"""
from __future__ import annotations

import argparse
import os
import statistics

import numpy as np

from .._bench import write_json
from . import _batch as Bt
from .data_parallel import OUTPUTS, DataParallelBackward
from .group import init
from .shard import shard_sequences

HIDDEN, HEADS, HEAD_DIM = 3584, 28, 128
CASES = {"short64": lambda: Bt.cu_from_lengths(Bt.short_lengths()), "16x1024": lambda: Bt.cu_from_lengths([1024] * 16)}
BARS = {"short64": 1.75, "16x1024": 1.85}  # speedup wanted on two GPUs
FLUSH_BYTES = 256 << 20  # >= 4 x the H200's 60 MB L2


def parse(argv):
    p = argparse.ArgumentParser(prog="bench")
    p.add_argument("--precision", choices=tuple(Bt.TOL), default="tf32")
    p.add_argument("--out", default=None, help="write the results as JSON (rank 0)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from {', '.join(CASES)}")
    a = p.parse_args(argv)
    a.cases = [c for c in a.cases.split(",") if c]
    for c in a.cases:
        if c not in CASES:
            p.error(f"unknown case {c!r}; choose from {', '.join(CASES)}")
    return a


class Timer:
    """GPU microseconds of single calls on one stream, each after an L2 flush (the flush alone: no spin kernel
    covers the host's issue time, as ``_bench.Timer`` does by default)."""

    def __init__(self, stream):
        import cupy

        self.cupy, self.stream = cupy, stream
        self.flush = cupy.empty(FLUSH_BYTES, np.uint8)
        self.ev0, self.ev1 = cupy.cuda.Event(), cupy.cuda.Event()

    def times(self, fn, reps: int, warmup: int, group=None) -> list:
        """This rank's GPU time of each repetition; with ``group`` the ranks meet at a barrier before each."""
        rt = self.cupy.cuda.runtime
        for _ in range(warmup):
            fn()
        self.stream.synchronize()
        out = []
        for _ in range(reps):
            if group is not None:
                group.barrier()
            rt.memsetAsync(self.flush.data.ptr, 1, FLUSH_BYTES, self.stream.ptr)
            self.ev0.record(self.stream)
            fn()
            self.ev1.record(self.stream)
            self.ev1.synchronize()
            out.append(self.cupy.cuda.get_elapsed_time(self.ev0, self.ev1) * 1e3)
        return out


def slowest_median(group, times) -> float:
    """Median over repetitions of the slowest rank's time."""
    return float(statistics.median(group.host_all_reduce(np.asarray(times, np.float64), op="max")))


def run_case(name: str, a, g, timer, stream) -> dict:
    import cupy_rope

    cu = CASES[name]()
    shards = shard_sequences(cu, g.world_size, hidden=HIDDEN, head_dim=HEAD_DIM)
    mine = shards[g.rank]
    batch = Bt.make_batch(cu, HIDDEN, HEAD_DIM, seed=1)
    full, part = Bt.args_of(batch), Bt.args_of(batch, mine.rows())
    kw = dict(num_heads=HEADS, precision=a.precision, stream=stream)
    res = {}

    def one():
        res["one"] = cupy_rope.vision_attention_backward(*full, cu, **kw)

    one_us = None
    if g.rank == 0:  # the single-GPU peer: the whole batch on GPU 0 while the other ranks wait
        one_us = statistics.median(timer.times(one, a.reps, a.warmup))
    g.barrier()
    shard_us = slowest_median(g, timer.times(
        lambda: cupy_rope.vision_attention_backward(*part, mine.cu_seqlens, **kw), a.reps, a.warmup, g))
    dp = DataParallelBackward(g, hidden=HIDDEN, head_dim=HEAD_DIM, num_heads=HEADS, precision=a.precision)

    def step():
        res["dp"] = dp(*part, mine.cu_seqlens, stream=stream)

    step()
    ar_us = slowest_median(g, timer.times(lambda: dp.all_reduce_gradients(res["dp"], stream=stream),
                                          a.reps, a.warmup, g))
    dp_us = slowest_median(g, timer.times(step, a.reps, a.warmup, g))
    if "one" not in res:
        one()
    outs, ref = res["dp"], res["one"]
    errs = [Bt.rel_err(outs[0], ref[0][mine.rows()])] + [Bt.rel_err(o, r) for o, r in zip(outs[1:], ref[1:])]
    errs = g.host_all_reduce(np.asarray(errs, np.float64), op="max").tolist()
    stream.synchronize()
    row = {"name": name, "precision": a.precision, "tokens": int(cu[-1]), "sequences": int(cu.shape[0] - 1),
           "shards": [{"rank": s.rank, "tokens": s.tokens, "sequences": s.num_sequences,
                       "cost_gflop": round(s.cost / 1e9, 3)} for s in shards],
           "gpu_us_one": one_us, "gpu_us_shard": shard_us, "gpu_us_dp": dp_us, "allreduce_us": ar_us,
           "allreduce_bytes": 4 * (4 * HIDDEN * HIDDEN + 4 * HIDDEN), "buckets": [list(b) for b in dp.buckets],
           "rel_err": dict(zip(OUTPUTS, errs)), "max_rel_err": max(errs), "bound": Bt.TOL[a.precision]}
    row["pass"] = row["max_rel_err"] <= row["bound"]
    if g.rank == 0:
        row["hidden_fraction"] = 1.0 - (dp_us - shard_us) / ar_us if ar_us > 0 else None
        row["speedup"] = one_us / dp_us
        row["efficiency"] = row["speedup"] / g.world_size
        row["bar_speedup_2gpu"] = BARS[name]
        row["meets_bar"] = row["speedup"] >= BARS[name] if g.world_size == 2 else None
    return row


def _env_info(g) -> dict:
    import cupy

    info = {}
    try:
        from .. import _bench

        info = _bench.device_info()
    except Exception:  # noqa: BLE001 - the device description is informative only
        info = {"cupy": cupy.__version__}
    from cupy.cuda import nccl

    info["nccl"] = nccl.get_version()
    info["env"] = {k: os.environ.get(k) for k in ("NCCL_ALGO", "NCCL_PROTO", "NCCL_NVLS_ENABLE")}
    return info


def main(argv) -> int:
    a = parse(argv)
    import cupy

    g = init()
    stream = cupy.cuda.Stream(non_blocking=True)
    rows = []
    with stream:
        timer = Timer(stream)
        for name in a.cases:
            row = run_case(name, a, g, timer, stream)
            rows.append(row)
            if g.rank == 0:
                print(f"{name:8s} {a.precision} T={row['tokens']:6d}  one GPU {row['gpu_us_one']:9.1f} us  "
                      f"shard {row['gpu_us_shard']:9.1f} us  DP {row['gpu_us_dp']:9.1f} us  all-reduce "
                      f"{row['allreduce_us']:7.1f} us  hidden {row['hidden_fraction']:.2f}  speedup "
                      f"{row['speedup']:.3f}x (bar {row['bar_speedup_2gpu']})  max rel err "
                      f"{row['max_rel_err']:.2e} ({'ok' if row['pass'] else 'OVER ' + str(row['bound'])})",
                      flush=True)
            cupy.cuda.runtime.deviceSynchronize()
            cupy.get_default_memory_pool().free_all_blocks()
    if g.rank == 0:
        from .data_parallel import _accepts_on_output, _backward_fn

        payload = {"op": "vision_attention_data_parallel", "world_size": g.world_size, "precision": a.precision,
                   "hidden": HIDDEN, "heads": HEADS, "head_dim": HEAD_DIM, "reps": a.reps,
                   "streamed_buckets": _accepts_on_output(_backward_fn()), **_env_info(g),
                   "method": "median of per-repetition GPU time (L2 flush, events); collective figures: slowest "
                             "rank per repetition after a barrier", "cases": rows}
        if a.out:
            write_json(a.out, payload)
    return 0 if all(r["pass"] for r in rows) else 1
