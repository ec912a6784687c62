"""What does a many-layer loop cost per call, with graph handles and without, against a reference tree?

A vision tower calls the attention backward once per layer per step. This times a loop over LAYERS layers (each its
own weights and activations, seed dims, TOKENS tokens in sequences of 256) as wall clock over the whole loop,
synchronised once at the end, and reports µs per call:

* ``handles``: one ``VisionAttentionBackward`` per layer (records on its second call, replays after);
* ``direct``: plain ``vision_attention_backward`` calls;
* with ``--path DIR --module NAME`` (a copy of an earlier tree importable as NAME), the same process also times that
  tree: ``ref_replay_one_layer`` (one layer repeated, replayed by its implicit graph cache, when it has one) and
  ``ref_direct`` (the loop with that cache switched off).

    python dev/layer_loop.py --layers 32 --tokens 1024 --path .old/base --module cupy_rope_base --out $OUT/layers.json
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import time

import numpy as np

import common


def layer_inputs(cupy, rng, t, h, d):
    f = np.float32
    return [rng.standard_normal((t, h), dtype=f), rng.standard_normal((t, h), dtype=f),
            rng.standard_normal((3 * h, h), dtype=f) * f(0.02), rng.standard_normal((3 * h,), dtype=f) * f(0.01),
            rng.standard_normal((h, h), dtype=f) * f(0.02), rng.standard_normal((h,), dtype=f) * f(0.01),
            rng.standard_normal((t, d), dtype=f), rng.standard_normal((t, d), dtype=f)]


def per_call_us(cupy, step, calls: int, rounds: int) -> float:
    """Median over rounds of (wall time of ``step()`` run so that it makes ``calls`` calls, synchronised once)."""
    times = []
    for _ in range(rounds):
        cupy.cuda.runtime.deviceSynchronize()
        t0 = time.perf_counter()
        step()
        cupy.cuda.runtime.deviceSynchronize()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return float(np.median(times))


SPIN = r'''
extern "C" __global__ void spin(long long ns) {
  long long t0, t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0)); t = t0;
  while (t - t0 < ns) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
}'''


def host_us(cupy, call, calls: int, profile: str | None = None) -> float:
    """Host µs per call while a spin kernel keeps the GPU busy (the calls queue behind it, so nothing waits on the
    device); with ``profile``, a cProfile of those calls is printed (top entries by own time)."""
    spin = cupy.RawKernel(SPIN, "spin")
    call()
    cupy.cuda.runtime.deviceSynchronize()
    spin((1,), (1,), (np.int64(calls * 3_000_000),))  # 3 ms of spinning per call: more than any call's issue
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    t0 = time.perf_counter()
    for _ in range(calls):
        call()
    us = (time.perf_counter() - t0) / calls * 1e6
    if prof is not None:
        import pstats

        prof.disable()
        print(f"--- host profile: {profile} ({us:.1f} us per call)")
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    cupy.cuda.runtime.deviceSynchronize()
    return us


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--precision", default="tf32")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--path", help="folder to put on sys.path for --module")
    ap.add_argument("--module", help="an earlier tree's package name to time in the same process")
    ap.add_argument("--profile", action="store_true", help="print cProfile tables of the direct calls' host work")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    import cupy

    import cupy_rope as cr
    from cupy_rope.workloads import ATTN_HEAD_DIM, ATTN_HIDDEN, even_cu_seqlens

    t, h, d, n = a.tokens, ATTN_HIDDEN, ATTN_HEAD_DIM, a.layers
    cu = np.asarray(even_cu_seqlens(t, max(1, t // 256)), np.int32)
    cu_dev = cupy.asarray(cu)
    rng = cupy.random.default_rng(7)
    layers = [layer_inputs(cupy, rng, t, h, d) for _ in range(n)]
    res = {"layers": n, "tokens": t, "precision": a.precision, "sequences": int(cu.size - 1)}

    handles = [cr.VisionAttentionBackward(cu, hidden_size=h, head_dim=d, precision=a.precision) for _ in layers]

    def with_handles():
        for hd, x in zip(handles, layers):
            hd(*x)

    def direct():
        for x in layers:
            cr.vision_attention_backward(*x, cu, precision=a.precision)

    for fn in (with_handles, with_handles, direct):  # warm-up: compile, tune, record
        fn()
    res["handles_us"] = per_call_us(cupy, with_handles, n, a.rounds)
    res["direct_us"] = per_call_us(cupy, direct, n, a.rounds)
    res["direct_device_cu_us"] = per_call_us(
        cupy, lambda: [cr.vision_attention_backward(*x, cu_dev, precision=a.precision) for x in layers], n, a.rounds)
    x0 = layers[0]
    res["host_direct_us"] = host_us(cupy, lambda: cr.vision_attention_backward(*x0, cu, precision=a.precision), 20,
                                    "direct" if a.profile else None)
    res["host_handle_us"] = host_us(cupy, lambda: handles[0](*x0), 20)
    res["handle_records"] = sum(hd.records for hd in handles)
    res["graph_MB"] = round(sum(hd.graph_bytes for hd in handles) / 2**20, 1)
    for hd in handles:
        hd.close()

    if a.module:
        if a.path:
            sys.path.insert(0, a.path)
        ref = importlib.import_module(a.module)
        def one_layer():  # the earlier tree's implicit cache: the same call repeated replays its graph
            for _ in range(n):
                ref.vision_attention_backward(*x0, cu_dev, precision=a.precision)

        def ref_loop():
            for x in layers:
                ref.vision_attention_backward(*x, cu_dev, precision=a.precision)

        for fn in (one_layer, one_layer):
            fn()
        res["ref_replay_one_layer_us"] = per_call_us(cupy, one_layer, n, a.rounds)
        if hasattr(ref, "set_graph_replay"):
            ref.set_graph_replay(False)
        ref_loop()
        res["ref_direct_us"] = per_call_us(cupy, ref_loop, n, a.rounds)
        res["ref_host_direct_us"] = host_us(cupy, lambda: ref.vision_attention_backward(*x0, cu, precision=a.precision),
                                            20, "reference direct" if a.profile else None)
        res["handles_vs_ref_replay"] = round(res["handles_us"] / res["ref_replay_one_layer_us"], 3)
        res["direct_vs_ref_direct"] = round(res["direct_device_cu_us"] / res["ref_direct_us"], 3)
    print(json.dumps(res, indent=1))
    common.write_json(a.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
