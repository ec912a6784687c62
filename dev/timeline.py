"""Where does a varlen attention call's GPU time go, kernel by kernel, beside cuDNN's? A kernel timeline of
``varlen_attention_forward`` + ``varlen_attention_backward`` (bf16, inputs made as the benchmark makes them, host
``cu_seqlens`` and ``max_seqlen``) and of PyTorch's cuDNN SDPA forward + ``torch.autograd.grad`` on the same
q, k, v and grad_o (the benchmark's peer; equal lengths only), both recorded by CUPTI through ``torch.profiler``:
per call, each kernel's GPU µs and count, their sum, and the span from the first kernel's start to the last one's
end (the sum plus the gaps between launches). Kernel time alone, so the host's issue time never enters it.

A case is SEQUENCES/LENGTH/HEADS/HEAD_DIM; a setting NAME:ITEM[,...] as in varlen_ab.py (plan fields and sm_90a
build switches; NAME: alone is the library's plan).

    python dev/timeline.py [--cases 32/256/28/128,4/4096/28/128] [--calls 10] [NAME:ITEM ...]
    e.g. python dev/timeline.py --cases 32/256/28/128 lib: unit:fwd_persistent=False

With --block TxN[,...] (and --precision), the vision block's backward on the seed model instead (inputs as the
benchmark makes them), every kernel of one call in order of start: its start and end from the call's first
kernel, in µs, so that the gaps and the overlap of the two streams show (cuBLAS, ours, the batched products).

    python dev/timeline.py --cases "" --block 8192x32 --precision tf32 lib: serial:concurrent=False
"""
from __future__ import annotations

import argparse
import collections

import common


def case_list(text: str) -> list[tuple[int, int, int, int]]:
    """argparse type: comma-separated SEQUENCES/LENGTH/HEADS/HEAD_DIM."""
    out = []
    for item in filter(None, text.split(",")):
        try:
            n, length, nh, d = (int(x) for x in item.split("/"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"a case is SEQUENCES/LENGTH/HEADS/HEAD_DIM, got {item!r}") from None
        if min(n, length, nh, d) < 1:
            raise argparse.ArgumentTypeError(f"every part of a case is positive, got {item!r}")
        out.append((n, length, nh, d))
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--cases", type=case_list, default=case_list("32/256/28/128,4/4096/28/128"),
                    help="default 32/256/28/128,4/4096/28/128")
    ap.add_argument("--calls", type=int, default=10, help="calls recorded per setting (default 10)")
    ap.add_argument("--no-peer", action="store_true", help="leave out cuDNN")
    ap.add_argument("--flush", action="store_true",
                    help="flush L2 before each call, as the benchmark does (its memset is listed as one more line)")
    ap.add_argument("--top", type=int, default=12, help="kernels listed per setting (default 12)")
    ap.add_argument("--block", type=common.attn_case_list, default=[], metavar="TxN[,...]",
                    help="the vision block's backward on these seed-model cases (default none)")
    ap.add_argument("--precision", default=None,
                    help="bf16 or tf32 (default: tf32 for --block, bf16 for the varlen cases; cuDNN only beside bf16)")
    ap.add_argument("--handle", action="store_true",
                    help="the block through its per-layer handle: the profiled call is a graph replay where the plan "
                         "records one")
    ap.add_argument("settings", nargs="*", type=common.build_setting, metavar="NAME:ITEM[,...]")
    a = ap.parse_args(argv)
    if a.calls < 1:
        ap.error("--calls must be at least 1")
    a.settings = a.settings or [common.build_setting("lib:")]
    return a


def kernel_table(torch, fn, calls: int) -> tuple[dict, dict, float]:
    """({kernel: µs per call}, {kernel: launches per call}, span per call in µs) of ``calls`` calls of fn."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total, count = collections.defaultdict(float), collections.Counter()
    for e in gpu:
        total[e.name] += getattr(e, "device_time", None) or e.cuda_time
        count[e.name] += 1
    starts = [e.time_range.start for e in gpu]
    ends = [e.time_range.end for e in gpu]
    span = (max(ends) - min(starts)) / calls if gpu else 0.0
    return ({k: v / calls for k, v in total.items()}, {k: c / calls for k, c in count.items()}, span)


def kernel_sequence(torch, fn) -> list[tuple[float, float, str]]:
    """[(start, end, name)] in µs from the first kernel's start, of one call of fn (after three warm-up calls)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    gpu = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA)
    t0 = gpu[0][0] if gpu else 0
    return [(a - t0, b - t0, name) for a, b, name in gpu]


def block(a) -> None:
    """The --block cases: each setting's kernel sequence of one backward."""
    a.precision = a.precision or "tf32"
    import cupy
    import torch

    import cupy_rope as cr

    for t, n in a.block:
        args = common.attn_inputs(t, n)
        print(f"== block {t} x {n}, {a.precision}")
        for name, (fields, defines) in a.settings:
            plan = common.plan_override(fields)

            handle = None
            if a.handle:  # the per-layer handle: first call direct, second recorded, then replays
                handle = cr.VisionAttentionBackward(cupy.asnumpy(args[-1]), hidden_size=args[1].shape[1],
                                                    head_dim=args[6].shape[1], precision=a.precision, plan=plan)

            def ours(plan=plan, defines=defines, x=args, handle=handle):
                with common.sm90_build(defines):
                    if handle is not None:
                        return handle(*x[:-1])
                    return cr.vision_attention_backward(*x, precision=a.precision, plan=plan)

            seq = kernel_sequence(torch, ours)
            busy = sum(e - s for s, e, _ in seq)
            how = f", replayed: {handle.replays > 0}" if handle is not None else ""
            print(f"{name}: {len(seq)} kernels, span {seq[-1][1] if seq else 0:.1f} µs, kernel time {busy:.1f}{how}")
            if handle is not None:
                handle.close()
            for s_, e_, k in seq:
                print(f"  {s_:9.1f} {e_:9.1f} {e_ - s_:8.1f}  {k[:110]}")
            del ours
        del args
        common.free_gpu()


def flushed(fn, flush: bool):
    """fn, or fn after the benchmark's L2 flush (a memset of FLUSH_BYTES on the current stream)."""
    if not flush:
        return fn
    import cupy

    from cupy_rope._bench import FLUSH_BYTES

    buf = cupy.empty(FLUSH_BYTES, cupy.uint8)

    def call():
        cupy.cuda.runtime.memsetAsync(buf.data.ptr, 1, FLUSH_BYTES, cupy.cuda.get_current_stream().ptr)
        return fn()

    return call


def show(label: str, table, top: int) -> None:
    us, count, span = table
    print(f"{label}: kernels {sum(us.values()):.1f} µs per call, span {span:.1f} µs")
    for name, t in sorted(us.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {t:9.1f} µs  x{count[name]:g}  {name[:100]}")


def main(argv=None) -> None:
    a = parse_args(argv)
    import numpy as np
    import torch

    prec = a.precision or "bf16"
    if a.block:
        block(a)
    import cupy_rope as cr
    from cupy_rope import _torch_peers as TP
    from cupy_rope.bench_varlen import make_inputs
    from cupy_rope.workloads import VarlenCase

    for n, length, nh, d in a.cases:
        lens = (length,) * n
        cu = np.arange(n + 1, dtype=np.int32) * length
        q, k, v, g = make_inputs(VarlenCase("timeline", nh, d, lens), prec, 0)
        print(f"== {n} x {length}, {nh} heads, head dim {d}, {prec}")
        for name, (fields, defines) in a.settings:
            plan = common.plan_override(fields)

            def ours(plan=plan, defines=defines):
                with common.sm90_build(defines):
                    o, lse = cr.varlen_attention_forward(q, k, v, cu, precision=prec, plan=plan, max_seqlen=length)
                    return cr.varlen_attention_backward(g, q, k, v, o, lse, cu, precision=prec, plan=plan,
                                                        max_seqlen=length)

            show(name, kernel_table(torch, flushed(ours, a.flush), a.calls), a.top)
        if a.no_peer or prec != "bf16":
            continue
        from torch.nn.attention import SDPBackend, sdpa_kernel

        leaves = tuple(TP.to_torch(torch, z).detach().requires_grad_(True) for z in (q, k, v))
        dense = lambda z: z.view(n, length, nh, d).transpose(1, 2)  # noqa: E731 - [T, NH, D] as [B, NH, L, D]
        grad = dense(TP.to_torch(torch, g))

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o = torch.nn.functional.scaled_dot_product_attention(*(dense(z) for z in leaves), scale=d ** -0.5)
                return torch.autograd.grad(o, leaves, grad)

        show("cudnn_sdpa", kernel_table(torch, flushed(cudnn, a.flush), a.calls), a.top)
        common.free_gpu()


if __name__ == "__main__":
    main()
