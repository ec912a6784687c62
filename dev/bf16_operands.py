"""bf16 GEMM operands: cast the fp32 inputs to bf16 copies first, or let cuBLAS read them as stored
(COMPUTE_32F_FAST_16BF)? Each product whose operands differ between the two ways, timed both ways (the casts
it needs plus the bf16 product, against the FAST_16BF product on the fp32 arrays), and the whole bf16 backward
with ``Plan.cast_operands`` forced each way (through a per-layer handle, as the benchmark times it): which way
``Plan.cast_operands`` should choose.

    python dev/bf16_operands.py --out $OUT/bf16_operands.json
    python dev/bf16_operands.py --cases 131x1,392x2,1024x4,2048x8,8192x32 --reps 10

Products (H = hidden 3584, T tokens, G = grad_qkv [T, 3H]): qkv = X Wqkv^T, dO = dY Wp, gX = G Wqkv,
gWq = G^T X. Cast way: X, dY, Wqkv, Wp cast as the product needs them (G is bf16 from the attention kernels);
fp32 way: the fp32 arrays, G as the fp32 G^T [3H, padded T] that the kernels then also write. grad_proj_weight
(dY^T O) is the same both ways and left out. A product's cast cost is (cast+bf16) - bf16; in the block the Wqkv
cast serves two products (qkv and gX), so the block saves less than the sum of the rows.
"""
from __future__ import annotations

import argparse
import dataclasses

import common

CASES = "131x1,1024x4,8192x32"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--cases", type=common.attn_case_list, default=CASES, metavar="all|TxN[,TxN...]",
                    help=f"workloads, T tokens in N sequences (default {CASES})")
    ap.add_argument("--reps", type=int, default=15, help="repetitions per timing (default 15)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds of the whole backward (default 2)")
    ap.add_argument("--out", default=None, metavar="FILE", help="write the results as JSON here")
    return ap.parse_args(argv)


def products(x, s):
    """{name: {"cast+bf16": fn, "bf16": fn, "fp32": fn}} for one workload's inputs."""
    import cupy
    import numpy as np

    from cupy_rope._cublas import gemm
    from cupy_rope.attention import kernels as K
    from cupy_rope.precision import Precision

    bufs = K.Buffers(Precision.BF16, s)
    dy, xs, wq, wp = x["grad_output"], x["hidden_states"], x["qkv_weight"], x["proj_weight"]
    t, h = xs.shape
    g = cupy.random.default_rng(1).standard_normal((t, 3 * h), dtype=np.float32)
    gt = cupy.zeros((3 * h, K.padded(t)), np.float32)
    gt[:, :t] = g.T
    g16 = bufs.operand(g)
    out = {"qkv": cupy.empty((t, 3 * h), np.float32), "dO": cupy.empty((t, h), np.float32),
           "gX": cupy.empty((t, h), np.float32), "gWq": cupy.empty((3 * h, h), np.float32)}
    # name -> (fp32 operands to cast, how the bf16 product takes (a, b), the fp32 product's (a, b, ta, tb))
    spec = {"qkv": ((xs, wq), (False, True), (xs, wq, False, True)),
            "dO": ((dy, wp), (False, False), (dy, wp, False, False)),
            "gX": ((wq,), (False, False), (gt[:, :t], wq, True, False)),
            "gWq": ((xs,), (True, False), (gt[:, :t], xs, False, False))}
    fixed = {"gX": g16, "gWq": g16}  # the kernels' bf16 G, the first operand of both

    def run(name, cast, bf16_ops=None):
        casts, (ta, tb), (a32, b32, fa, fb) = spec[name]
        if cast is None:  # fp32 operands, FAST_16BF
            return gemm(a32, b32, out[name], trans_a=fa, trans_b=fb, precision="bf16", stream=s)
        ops = [bufs.operand(c) for c in casts] if cast else bf16_ops
        a, b = (fixed[name], ops[0]) if name in fixed else ops
        gemm(a, b, out[name], trans_a=ta, trans_b=tb, precision="bf16", stream=s)

    fns = {}
    for name, (casts, _, _) in spec.items():
        pre = [bufs.operand(c) for c in casts]  # bf16 copies made once, for the product alone
        fns[name] = {"cast+bf16": lambda n=name: run(n, True), "bf16": lambda n=name, p=pre: run(n, False, p),
                     "fp32": lambda n=name: run(n, None)}
    return fns


def main(argv=None) -> int:
    a = parse_args(argv)
    import cupy

    import cupy_rope as cr
    from cupy_rope._bench import Timer
    from cupy_rope.attention.plan import make_plan

    timer = Timer()
    s = cupy.cuda.get_current_stream().ptr
    dev = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())["name"]
    result = {"device": dev.decode() if isinstance(dev, bytes) else str(dev), "products": [], "backward": []}
    print(f"# {result['device']}; GPU us, median of {a.reps}")
    print(f"{'T':>5} {'product':8} {'cast+bf16':>10} {'bf16':>8} {'fp32':>8} {'fp32/(cast+bf16)':>17}")
    for t, n in a.cases:
        args = common.attn_inputs(t, n)
        x = dict(zip(common.ATTN_KEYS, args))
        for name, fns in products(x, s).items():
            row = {k: timer.gpu_us(fn, reps=a.reps, warmup=3) for k, fn in fns.items()}
            result["products"].append({"tokens": t, "product": name, **row})
            print(f"{t:5d} {name:8} {row['cast+bf16']:10.1f} {row['bf16']:8.1f} {row['fp32']:8.1f} "
                  f"{row['fp32'] / row['cast+bf16']:17.2f}", flush=True)
        block = args[:-1]
        handles = {cast: cr.VisionAttentionBackward(
            cupy.asnumpy(x["cu_seqlens"]), hidden_size=x["hidden_states"].shape[1], head_dim=x["cos"].shape[1],
            precision="bf16", plan=lambda p, c=cast: dataclasses.replace(p, cast_operands=c)) for cast in (True, False)}
        fns = {f"cast_operands={cast}": (lambda hd=hd, b=block: hd(*b)) for cast, hd in handles.items()}
        got = common.interleaved(fns, lambda fn: timer.gpu_us(fn, reps=a.reps, warmup=3), a.rounds)
        med = {k: common.median(v) for k, v in got.items()}
        on, off = med["cast_operands=True"], med["cast_operands=False"]
        chosen = handles[True].plan
        library = make_plan("bf16", head_dim=chosen.head_dim, tokens=t,
                            max_tiles=handles[True].varlen.max_tiles).cast_operands  # the library's own choice
        result["backward"].append({"tokens": t, "sequences": n, "cast_us": on, "fp32_us": off,
                                   "library_casts": library, "hopper": chosen.hopper})
        print(f"{t:5d} backward cast {on:9.1f}  fp32 {off:9.1f}  fp32/cast {off / on:5.2f}  "
              f"(library: cast_operands={library}, hopper={chosen.hopper})", flush=True)
        del handles, fns, block, args, x
        common.free_gpu()
    common.write_json(a.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
