"""``selfcheck``: a small data-parallel correctness case, run by the tests under the launcher.

Every rank builds the same batch, takes its shard, runs :class:`DataParallelBackward` and compares the
summed gradients (and its own rows of ``grad_hidden_states``) with the single-GPU backward of the whole
batch and with the float64 reference. Rank 0 writes ``OUT/result.json``; each rank writes
``OUT/rank{r}.json`` with SHA-256 digests of its outputs (bit-identity across runs). ``--fail-rank R`` makes
rank R pass a bad ``cos`` so that every rank must raise. Exit status 0 when every error is within bounds.
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np

from . import _batch as Bt
from .data_parallel import OUTPUTS, DataParallelBackward
from .group import init
from .shard import shard_sequences


def parse(argv):
    p = argparse.ArgumentParser(prog="selfcheck")
    p.add_argument("--hidden", type=int, default=448)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--lengths", default="100,37,0,250,5,130", help="comma-separated sequence lengths")
    p.add_argument("--precision", choices=tuple(Bt.TOL), default="tf32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fail-rank", type=int, default=None, help="this rank passes a bad cos")
    p.add_argument("--no-autotune", action="store_true", help="cuBLAS heuristic kernels (same in every process)")
    p.add_argument("--out", default=None, help="folder for result.json and rank{r}.json")
    return p.parse_args(argv)


def main(argv) -> int:
    a = parse(argv)
    import cupy

    import cupy_rope
    from cupy_rope import reference

    g = init()
    if a.no_autotune:
        cupy_rope.set_gemm_autotune(False)
    cu = Bt.cu_from_lengths([int(x) for x in a.lengths.split(",") if x != ""])
    shard = shard_sequences(cu, g.world_size, hidden=a.hidden, head_dim=a.head_dim)[g.rank]
    batch = Bt.make_batch(cu, a.hidden, a.head_dim, a.seed)
    args = list(Bt.args_of(batch, shard.rows()))
    if a.fail_rank == g.rank:
        args[6] = cupy.zeros((shard.tokens, a.head_dim + 1), np.float32)  # cos of the wrong width
    dp = DataParallelBackward(g, hidden=a.hidden, head_dim=a.head_dim, precision=a.precision)
    outs = dp(*args, shard.cu_seqlens)
    again = dp(*args, shard.cu_seqlens)  # same call twice in one process: the same bits
    repeat_identical = all(bool((x == y).all()) for x, y in zip(outs, again))
    nh = a.hidden // a.head_dim
    one = cupy_rope.vision_attention_backward(*Bt.args_of(batch), cu, num_heads=nh, precision=a.precision)
    ref = reference.vision_attention_backward(*Bt.args_of(batch), cu, num_heads=nh)
    rows = shard.rows()
    err_one = [Bt.rel_err(outs[0], one[0][rows])] + [Bt.rel_err(o, r) for o, r in zip(outs[1:], one[1:])]
    err_ref = [Bt.rel_err(outs[0], ref[0][rows])] + [Bt.rel_err(o, r) for o, r in zip(outs[1:], ref[1:])]
    worst = g.host_all_reduce(np.array(err_one + err_ref + [0.0 if repeat_identical else 1.0]), op="max")
    bound = Bt.TOL[a.precision]
    result = {"world_size": g.world_size, "precision": a.precision, "hidden": a.hidden, "head_dim": a.head_dim,
              "cu_seqlens": cu.tolist(), "shards": [[s.token_start, s.token_end] for s in
                                                    shard_sequences(cu, g.world_size, hidden=a.hidden,
                                                                    head_dim=a.head_dim)],
              "rel_err_vs_one_gpu": dict(zip(OUTPUTS, worst[:5].tolist())),
              "rel_err_vs_fp64": dict(zip(OUTPUTS, worst[5:10].tolist())),
              "repeat_identical": bool(worst[10] == 0), "bound": bound, "streamed": dp._streamed}
    result["pass"] = bool(max(worst[:10]) <= bound and result["repeat_identical"])
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, f"rank{g.rank}.json"), "w") as f:
            json.dump({"rank": g.rank, "tokens": shard.tokens, "digest": Bt.digest(outs)}, f)
        if g.rank == 0:
            with open(os.path.join(a.out, "result.json"), "w") as f:
                json.dump(result, f, indent=1)
    if g.rank == 0:
        print(json.dumps(result))
    return 0 if result["pass"] else 1
