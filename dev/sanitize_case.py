"""Does any kernel read or write out of bounds, race, or read uninitialised memory? Small calls of every kernel
and every schedule path, for compute-sanitizer (memcheck, racecheck, initcheck):

    compute-sanitizer --tool memcheck python3 dev/sanitize_case.py [--gemm-heuristic] [--groups rope,attention,varlen]

RoPE: both vectorised backward kernels (launched directly on sizes that are not a multiple of their vector
width), the strided backward, both forwards, for each dtype. Attention, each precision and two head dims:
a direct call on two streams and on one, a per-layer handle (recorded, then replayed), the forward; in fp32
also the QKV product from transposed operands and dQ from the dK/dV kernel's partials and from the forward
kernel's second pass, and its shares added in key-tile order. varlen: the varlen API on the mma.sync / FFMA
kernels (fp32, tf32 and bf16 forced off Hopper), three head dims. With --gemm-heuristic, cuBLAS runs its
heuristic's kernels instead of the timed choice.
Each group of calls is followed by a device synchronisation and a line naming it, so that where a tool stops the
process, the last line printed says which group had finished.
"""
from __future__ import annotations

import argparse

import common


def done(what):
    """Wait for the group's kernels, then say it finished (flushed: a tool may end the process next)."""
    import cupy

    cupy.cuda.runtime.deviceSynchronize()
    print(f"sanitize_case: {what} done", flush=True)


def rope_calls(rng):
    import cupy
    import ml_dtypes
    import numpy as np

    import cupy_rope as cr
    from cupy_rope._kernels import launcher

    s = cupy.cuda.get_current_stream().ptr
    for dt, suffix in ((ml_dtypes.bfloat16, "bf16"), (np.float16, "f16"), (np.float32, "f32")):
        gc = rng.standard_normal((3, 37, 130), dtype=np.float32).astype(dt)
        gs = rng.standard_normal((3, 37, 130), dtype=np.float32).astype(dt)
        th = rng.standard_normal((3, 37, 130), dtype=np.float32) * 100
        out = cr.rope_2d_backward(gc, gs, th)  # the library's choice at this size
        n = out.size
        for name, per in (("vec2", 2), ("vec", 8)):  # each vectorised kernel, with a partial last vector
            k = launcher("rope", f"rope_bwd_{name}_{suffix}", "ppppq")
            k((-(-n // (per * 256)), 1, 1), (256, 1, 1), (gc.data.ptr, gs.data.ptr, th.data.ptr, out.data.ptr, n), s)
        cr.rope_2d_backward(gc[:, ::2], gs[:, ::2], th[:, ::2])
        cr.rope_2d_forward(th, dtype=dt)
        cr.rope_2d_forward(th[:, 1:], dtype=dt)
        done(f"rope {suffix}")


def attention_calls():
    import cupy

    import cupy_rope as cr

    one_stream = common.plan_override({"concurrent": False})
    for prec in ("tf32", "bf16", "fp32"):
        for hidden, d, t, n in ((256, 128, 150, 3), (160, 80, 70, 2)):
            args = common.attn_inputs(t, n, seed=7, hidden=hidden, head_dim=d)
            cr.vision_attention_backward(*args, precision=prec)
            done(f"{prec} D {d}: backward, two streams")
            cr.vision_attention_backward(*args, precision=prec, plan=one_stream)
            done(f"{prec} D {d}: backward, one stream")
            handle = cr.VisionAttentionBackward(cupy.asnumpy(args[-1]), hidden_size=hidden, head_dim=d, precision=prec)
            for _ in range(3):  # issued directly, recorded into a CUDA graph, replayed
                handle(*args[:8])
            handle.close()
            done(f"{prec} D {d}: handle, direct, recorded, replayed")
            cr.vision_attention_forward(*args[1:], precision=prec)
            done(f"{prec} D {d}: forward")
    # fp32 QKV product from transposed copies of X and Wqkv
    cr.vision_attention_backward(*args, precision="fp32", plan=common.plan_override({"nt_qkv": True}))
    done("fp32: QKV product from transposed operands")
    # sequences of two tiles: dQ from the dK/dV kernel's two partials, its shares added in key-tile order, then
    # from the forward kernel's second pass
    args = common.attn_inputs(300, 2, seed=7, hidden=256, head_dim=128)
    apart = {"dense": False, "dense_in_place": False}  # the kernels' dQ paths, not the dense form's
    for fields in ({"dq_partials": 2, "dq_ordered": False, **apart}, {"dq_partials": 0, "dq_ordered": True, **apart},
                   {"dq_partials": 0, "dq_ordered": False, **apart}):
        cr.vision_attention_backward(*args, precision="fp32", plan=common.plan_override(fields))
        done(f"fp32: {fields}")


def varlen_calls():
    """The varlen API on the mma.sync / FFMA kernels (fp32; tf32 and bf16 forced off Hopper): the forward with its
    log-sum-exp, the statistics from the o and lse given, the dQ pass alone, fp32's partials and ordered dQ sum."""
    import dataclasses

    import cupy
    import numpy as np

    import cupy_rope as cr

    off = lambda p: dataclasses.replace(p, hopper=False, dense=False, dense_in_place=False)  # noqa: E731
    rng = cupy.random.default_rng(7)
    for prec in ("fp32", "tf32", "bf16"):
        for d, lens in ((128, [1, 300, 0, 77]), (80, [130, 260]), (64, [200, 50])):
            cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
            q, k, v, g = (rng.standard_normal((int(cu[-1]), 2, d), dtype=np.float32) for _ in range(4))
            o, lse = cr.varlen_attention_forward(q, k, v, cu, precision=prec, plan=off)
            cr.varlen_attention_backward(g, q, k, v, o, lse, cu, precision=prec, plan=off)
            done(f"varlen {prec} D {d}: forward, backward on the o and lse given")


def rope_group():
    import cupy

    rope_calls(cupy.random.default_rng(7))


GROUPS = {"rope": rope_group, "attention": attention_calls, "varlen": varlen_calls}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--gemm-heuristic", action="store_true", help="cuBLAS heuristic kernels (no autotuning)")
    ap.add_argument("--groups", default=",".join(GROUPS), help=f"comma-separated, of {', '.join(GROUPS)} (all)")
    a = ap.parse_args(argv)
    groups = a.groups.split(",")
    if not set(groups) <= set(GROUPS):
        ap.error(f"--groups: one or more of {', '.join(GROUPS)}")
    import cupy

    import cupy_rope as cr

    if a.gemm_heuristic:
        cr.set_gemm_autotune(False)
    for name in groups:
        GROUPS[name]()
    cupy.cuda.runtime.deviceSynchronize()
    print("sanitize_case: all calls done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
