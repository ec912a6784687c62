"""Fused varlen (cu_seqlens) vision attention with 2D RoPE (Qwen-VL vision tower): backward and forward.

Structure of the backward (``T`` tokens, hidden ``H``, ``NH`` heads of ``D``):

1. cuBLAS ``qkv = X Wqkv^T`` and ``dO = dY Wp``.
2. ``attn_prep``: bias + RoPE, operands packed per head in the mode's element type.
3. ``attn_fwd_dq``: per 128-query tile and head, flash forward (O, log-sum-exp, ``delta = rowsum(dO*O)``),
   then dQ with the RoPE backward fused, straight into ``grad_qkv[:, 0:H]``.
4. ``attn_dkdv``: per 128-key tile and head, dK (RoPE backward fused) and dV into ``grad_qkv[:, H:3H]``.
   In fp32, while sequences span at most DQ_PARTIAL_MAX_TILES tiles, step 3 stops after the forward
   (``attn_fwd_stats``), ``attn_dkdv_dqp`` also writes each key tile's share of dQ, and ``attn_dq_reduce``
   sums the shares in order and applies the RoPE backward.
5. cuBLAS ``grad_proj_weight = dY^T O``, ``grad_hidden_states = grad_qkv Wqkv``,
   ``grad_qkv_weight = grad_qkv^T X``; bias gradients are fixed-order column sums (per-tile partials
   written by the attention kernels for ``grad_qkv_bias``).

Up to CONCURRENT_MAX_TOKENS tokens (FP32_CONCURRENT_MAX_TOKENS in fp32), ``dO`` runs beside ``qkv``,
``grad_proj_weight`` beside step 4 and ``grad_qkv_weight`` beside ``grad_hidden_states``, on a second stream
(_Side).

``cu_seqlens`` is read back and checked before the first launch. A call that repeats an earlier one exactly
(up to GRAPH_MAX_TOKENS tokens) is replayed from a recorded CUDA graph; see _GraphCache.

Extra device memory: ``qkv`` and ``grad_qkv`` (3·T·H floats each), ``dO`` and ``O`` (T·H each), the
packed operands (4·T·H), the log-sum-exp and delta (2·NH·T), the bias partials (3·H per 128-token tile),
the fp32 dQ partials (at most DQ_PARTIAL_MAX_TILES·T·H), in ``tf32`` transposed copies of X, dY and
grad_qkv (O only transposed), in ``fp32`` of dY and grad_qkv (and from FP32_NT_QKV_MIN_TOKENS of X and
Wqkv), and in ``bf16`` mode bf16 copies of X, dY and both weights: O(T·H + H²), never O(L²).
"""
from __future__ import annotations

import threading

import numpy as np

from . import _checks as C
from . import _cublas
from ._cublas import PRECISIONS, gemm
from ._kernels import OPTIONS, launcher
from ._once import once

TILE = 128  # rows per attention block (BM in attention.cu: 16 per warp)
INNER = 32  # rows streamed per inner step (BN in attention.cu)
HEAD_DIMS = (64, 72, 80, 96, 128)
LOG2E = 1.4426950408889634
_NWARP = 8
# tf32 tensor cores read both GEMM operands along the contraction (K-major). The two weight gradients contract
# over tokens, which every operand holds along rows; with TF32_KMAJOR the tf32 backward feeds cuBLAS K-major
# operands for them (transposed copies of X and dY; O^T and grad_qkv^T written by the attention kernels), which
# was measured faster than the plain layouts at every seed size (131 tokens up). The other products run as
# stored: their best cuBLAS kernels are as fast as with transposed weights, whose copies would cost more than
# they save.
TF32_KMAJOR = True
# FFMA SGEMM (the fp32 mode) is fastest when both stored operands hold the contraction along their rows (row-major
# C = A^T B with A stored [K, M] and B [K, N]: cuBLAS's "NT"), the layout the weight gradients have as stored:
# 54.1 TFLOP/s at 8192^3 against 51.6 for the plain layout, and 5-7% faster at the backward's large products
# (scripts/gemm_layout_probe.py). From FP32_NT_MIN_TOKENS tokens the fp32 backward feeds cuBLAS that layout for
# dO (from a transposed copy of dY) and grad_hidden_states (from grad_qkv^T, written by the attention kernels
# beside grad_qkv); from FP32_NT_QKV_MIN_TOKENS for qkv too, which takes transposed copies of X and of Wqkv
# (3 H^2 floats, 154 MB at H = 3584, paid back only by a long product). Measured on the whole backward
# (scripts/attn_ab.py, seed workloads): dO and grad_hidden so fed were 0-6% faster at every size (0% at 131
# tokens, 3-6% at 613-1024, 2% from 2048); qkv as well was 3-10% slower up to 392 tokens and 0.3-0.9% faster
# from 4096.
FP32_NT_MIN_TOKENS = 0
FP32_NT_QKV_MIN_TOKENS = 4096
# Independent products of the backward on a second stream (see _Side) up to this many tokens; 0: everything on the
# caller's stream. Measured (scripts/attn_ab.py): up to 12% faster up to 2048 tokens, from 5% faster to 4%
# slower at 2940-4096; from 4704 tokens, where every product is many waves long, 3% faster to 4% slower.
CONCURRENT_MAX_TOKENS = 4096
# fp32, whose attention kernels are shorter beside its FFMA GEMMs: the second stream at every size. Measured
# (attn_ab.py, fp32 from 4704 tokens) 0.8-2.3% faster than one stream there.
FP32_CONCURRENT_MAX_TOKENS = 1 << 62
# fp32 (head dims a multiple of 16) takes dQ from the dK/dV kernel while no sequence has more than this many
# TILE-token tiles: each key tile's block adds dS K for every query of its sequence into its own partial
# (DQ_PARTIAL_MAX_TILES x T x H floats at most), and a reduction sums them in order. That drops the forward
# kernel's second pass over K and V (3 of its 5 L^2-products); longer sequences keep it (the partials would
# grow with the sequence).
DQ_PARTIAL_MAX_TILES = 2


_SIGNATURES = {"prep": "ppppppiii", "fwd_dq": "ppppppppppppiiiff", "fwd": "pppiif", "dkdv": "pppppppppiiiff",
               "fwd_stats": "ppppppppppppiiiff", "dkdv_dqp": "ppppppppppiiiff", "dq_reduce": "pppppppiii"}
FP32_ONLY = ("fwd_stats", "dkdv_dqp", "dq_reduce")  # compiled for head dims that are a multiple of 16


def _smem_bytes(precision: str, d: int, kernel: str) -> int:
    """Dynamic shared memory of one block (must match the carve-up in attention.cu)."""
    dk = (d + 15) // 16 * 16
    ld, es = (dk + 8, 2) if precision == "bf16" else (dk + 4, 4)
    tiles = (2 * TILE + 4 * INNER) * ld * es  # two resident tiles + two double-buffered streamed tiles
    extra = 4 * INNER * 4 if kernel.startswith("dkdv") else 0  # lse / delta, double-buffered
    scratch = _NWARP * max(16 * (INNER + 4), 20 * INNER) * 4 if precision == "fp32" else 0  # RsScratch
    staging = TILE * (d + 4) * 4  # fp32 gradient tile in the epilogue (reuses the same memory)
    if kernel == "dq_reduce":
        return staging
    return max(tiles + extra + scratch, staging)


def _attn_kernel(kernel: str, precision: str, d: int):
    """Launcher of one attention kernel, compiled for head_dim ``d``, with its shared memory limit raised."""
    lau = launcher("attention", f"attn_{kernel}_{precision}", _SIGNATURES[kernel],
                   options=OPTIONS + (f"-DATTN_HEAD_DIM={d}",))
    if kernel != "prep":
        need = _smem_bytes(precision, d, "fwd_dq" if kernel in ("fwd", "fwd_stats") else kernel)
        if need > lau.max_smem:
            have = _smem_optin()
            if need > have:
                raise RuntimeError(f"vision attention ({precision}, head_dim {d}) needs {need} bytes of shared memory "
                                   f"per block; this GPU allows {have} (Hopper-class GPUs allow 232448)")
            lau.set_max_dynamic_smem(need)
    return lau


def _smem_optin() -> int:
    import cupy

    dev = cupy.cuda.runtime.getDevice()
    return int(cupy.cuda.runtime.getDeviceProperties(dev)["sharedMemPerBlockOptin"])


def _prepare(qkv, bqkv, cos, sin, dO, t, h, nh, d, precision, s):
    """Attention operands P[which][NH][T][DK] (q', k', v[, dO]) in the mode's element type."""
    import cupy

    nwhich = 3 if dO is None else 4
    dk = (d + 15) // 16 * 16
    P = cupy.empty((nwhich, nh, t, dk), dtype=C.BF16 if precision == "bf16" else np.float32)
    units = nwhich * t * nh * (d // 8)
    _attn_kernel("prep", precision, d)((max(1, min((units + 255) // 256, 132 * 16)), 1, 1), (256, 1, 1),
                                       (qkv.data.ptr, bqkv.data.ptr, cos.data.ptr, sin.data.ptr,
                                        0 if dO is None else dO.data.ptr, P.data.ptr, t, h, nwhich), s)
    return P


def _tile_table(cu: np.ndarray) -> np.ndarray:
    """[(first token, sequence start, sequence end)] for every TILE-token tile, longest sequences first."""
    starts, ends = cu[:-1].astype(np.int64), cu[1:].astype(np.int64)
    order = np.argsort(starts - ends, kind="stable")  # longest first, ties in sequence order
    counts = (ends[order] - starts[order] + TILE - 1) // TILE
    seq = np.repeat(order, counts)
    within = np.arange(seq.size, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    table = np.empty((seq.size, 3), dtype=np.int32)
    table[:, 0] = starts[seq] + within * TILE
    table[:, 1] = starts[seq]
    table[:, 2] = ends[seq]
    return table


_inflight: list = []  # (event, pinned buffer) pairs of uploads that may still be reading their buffer


def _upload(a: np.ndarray, stream: int):
    """Asynchronous host-to-device copy of a small array through pinned memory (no host sync)."""
    import cupy

    while _inflight and _inflight[0][0].done:
        _inflight.pop(0)
    pinned = cupy.cuda.alloc_pinned_memory(max(a.nbytes, 1))
    np.frombuffer(pinned, dtype=a.dtype, count=a.size)[:] = a.ravel()
    out = cupy.empty(a.shape, dtype=a.dtype)
    if a.nbytes:
        cupy.cuda.runtime.memcpyAsync(out.data.ptr, pinned.ptr, a.nbytes, cupy.cuda.runtime.memcpyHostToDevice,
                                      stream)
    ev = cupy.cuda.Event(block=False, disable_timing=True)
    cupy.cuda.runtime.eventRecord(ev.ptr, stream)
    _inflight.append((ev, pinned))
    return out


def _validate(grad_output, hidden_states, qkv_weight, qkv_bias, proj_weight, proj_bias, cos, sin, cu_seqlens,
              attention_dropout, num_heads, precision):
    """Shape/dtype/layout checks of everything (``grad_output`` None for the forward) and of the form of
    ``cu_seqlens`` (its values are checked by :func:`_cu_seqlens_host`); returns (T, H, NH, D)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if attention_dropout != 0.0:
        raise NotImplementedError(
            f"attention_dropout={attention_dropout}: a backward with dropout needs the forward's dropout mask, "
            "which this op does not take; only attention_dropout=0.0 is supported")
    arrays = dict(grad_output=grad_output, hidden_states=hidden_states, qkv_weight=qkv_weight, qkv_bias=qkv_bias,
                  proj_weight=proj_weight, proj_bias=proj_bias, cos=cos, sin=sin)
    if grad_output is None:
        del arrays["grad_output"]
    for name, x in arrays.items():
        C.require_cupy(x, name)
        C.require_dtype(x, name, (C.F32,))
    if hidden_states.ndim != 2:
        raise ValueError(f"hidden_states must be 2-D [tokens, hidden], got shape {hidden_states.shape}")
    t, h = hidden_states.shape
    if cos.ndim != 2:
        raise ValueError(f"cos must be 2-D [tokens, head_dim], got shape {cos.shape}")
    d = cos.shape[1]
    if d not in HEAD_DIMS:
        raise ValueError(f"head_dim (cos.shape[1]) must be one of {HEAD_DIMS}, got {d}")
    nh = h // d if num_heads is None else int(num_heads)
    if nh * d != h:
        raise ValueError(f"hidden size {h} must equal num_heads * head_dim = {nh} * {d}")
    shapes = dict(grad_output=(t, h), qkv_weight=(3 * h, h), qkv_bias=(3 * h,), proj_weight=(h, h),
                  proj_bias=(h,), cos=(t, d), sin=(t, d))
    for name, shape in shapes.items():
        if name in arrays:
            C.require_shape(arrays[name], name, shape, f" (tokens={t}, hidden={h}, head_dim={d})")
    for name, x in arrays.items():
        C.require_contiguous(x, name)
        if x.data.ptr % 16:
            raise ValueError(f"{name} must be 16-byte aligned (got a view at an offset); pass a copy")
    C.check_cu_seqlens_form(cu_seqlens)
    if t > 2**31 - 1 or cu_seqlens.shape[0] - 1 > 2**31 - 1:
        raise ValueError("too many tokens or sequences for int32 indexing")
    return t, h, nh, d


_tls = threading.local()  # per thread: a pinned buffer and an event for reading cu_seqlens back


def _cu_seqlens_read(cu_seqlens, stream: int):
    """Start reading a device ``cu_seqlens`` back to the host (a copy on ``stream``, not a kernel launch),
    so the caller can allocate while it is in flight. Host arrays are returned as they are."""
    if isinstance(cu_seqlens, np.ndarray):
        return cu_seqlens
    import cupy

    rt = cupy.cuda.runtime
    nbytes = cu_seqlens.nbytes
    buf = getattr(_tls, "buf", None)
    if buf is None or buf.mem.size < nbytes:
        buf = _tls.buf = cupy.cuda.alloc_pinned_memory(max(nbytes, 4096))
    events = getattr(_tls, "events", None)
    if events is None:
        events = _tls.events = {}
    dev = rt.getDevice()
    event = events.get(dev)
    if event is None:
        event = events[dev] = cupy.cuda.Event(block=False, disable_timing=True)
    rt.memcpyAsync(buf.ptr, cu_seqlens.data.ptr, nbytes, rt.memcpyDeviceToHost, stream)
    rt.eventRecord(event.ptr, stream)
    return buf, event, cu_seqlens.dtype, cu_seqlens.shape[0]


def _cu_seqlens_host(pending, t: int) -> np.ndarray:
    """The values of ``cu_seqlens`` on the host (waiting for the read started by :func:`_cu_seqlens_read`),
    checked: 0 first, non-decreasing, ``t`` last."""
    if isinstance(pending, np.ndarray):
        cu = pending
    else:
        buf, event, dtype, n = pending
        event.synchronize()
        cu = np.frombuffer(buf, dtype=dtype, count=n).copy()
    C.check_cu_seqlens(cu, t)
    return cu


class _Buffers:
    """Operands of the GEMMs in the mode's storage type (bf16 copies in ``bf16`` mode)."""

    def __init__(self, precision, stream):
        self.precision, self.stream = precision, stream

    def operand(self, x):
        if self.precision != "bf16":
            return x
        import cupy

        out = cupy.empty(x.shape, dtype=C.BF16)
        n = x.size
        launcher("util", "cast_f32_bf16", "ppq")(((n + 2047) // 2048, 1, 1), (256, 1, 1),
                                                 (x.data.ptr, out.data.ptr, n), self.stream)
        return out

    def empty(self, shape):
        import cupy

        return cupy.empty(shape, dtype=C.BF16 if self.precision == "bf16" else np.float32)


def colsum(x, stream: int, out=None):
    """Column sums of a C-contiguous fp32 [rows, cols] matrix in a fixed order (deterministic)."""
    import cupy

    rows, cols = x.shape
    if out is None:
        out = cupy.empty((cols,), dtype=np.float32)
    chunk = 256
    nchunk = max(1, (rows + chunk - 1) // chunk)
    part = cupy.empty((nchunk, cols), dtype=np.float32)
    launcher("util", "colsum_partial", "ppiiqi")(((cols + 31) // 32, nchunk, 1), (256, 1, 1),
                                                 (x.data.ptr, part.data.ptr, rows, cols, cols, chunk), stream)
    _colsum_finish(part, out, stream)
    return out


def _colsum_finish(part, out, stream: int) -> None:
    n, cols = part.shape
    launcher("util", "colsum_finish", "ppii")(((cols + 255) // 256, 1, 1), (256, 1, 1),
                                              (part.data.ptr, out.data.ptr, n, cols), stream)


def _dq_partials(precision: str, d: int, cu: np.ndarray) -> int:
    """Number of dQ partials the backward uses for sequence boundaries ``cu`` (0: dQ from the forward kernel)."""
    if precision != "fp32" or d % 16 or cu.size < 2:
        return 0
    tiles = int(((np.diff(cu.astype(np.int64)) + TILE - 1) // TILE).max())
    return tiles if tiles <= DQ_PARTIAL_MAX_TILES else 0


def _attention_core(P, cos, sin, dO, tiles, t, h, nh, d, scaling, precision, bufs, stream, mark,
                    o_t=False, gqkv_t=False, after_fwd=None, dq_parts=0):
    """Run the attention kernels. Returns (O, (grad_qkv, grad_qkv^T or None), bias partials) with O and grad_qkv
    as GEMM operands in the mode's operand type; with ``o_t``, O as fp32 O^T [H, _padded(T)] instead; with
    ``gqkv_t``, grad_qkv^T [3H, _padded(T)] (fp32, pad zeroed) as well. ``after_fwd(O)`` is called once O is
    enqueued, before the dK/dV kernel. With ``dq_parts`` (see _dq_partials), dQ comes from the dK/dV kernel's
    partials [dq_parts, T, H] and their reduction."""
    import cupy

    ntiles = tiles.shape[0]
    tp = _padded(t)
    o = None if o_t else bufs.empty((t, h))
    ot = cupy.empty((h, tp), np.float32) if o_t else None
    gqkv = bufs.empty((t, 3 * h))
    gqkvt = cupy.empty((3 * h, tp), np.float32) if gqkv_t else None
    lse = cupy.empty((nh, t), dtype=np.float32)
    delta = cupy.empty((nh, t), dtype=np.float32)
    part = cupy.empty((ntiles, 3 * h), dtype=np.float32)
    ptr = lambda a: 0 if a is None else a.data.ptr  # noqa: E731
    tail = (t, tp, h, float(scaling * LOG2E), float(scaling))
    k1 = _attn_kernel("fwd_stats" if dq_parts else "fwd_dq", precision, d)
    k1((ntiles, nh, 1), (32 * _NWARP, 1, 1),
       (P.data.ptr, cos.data.ptr, sin.data.ptr, dO.data.ptr, tiles.data.ptr, ptr(o), ptr(ot), lse.data.ptr,
        delta.data.ptr, gqkv.data.ptr, ptr(gqkvt), part.data.ptr) + tail, stream, k1.max_smem)
    mark("attn_fwd_dq")
    if after_fwd is not None:
        after_fwd(ot if o_t else o)
    grid, block = (ntiles, nh, 1), (32 * _NWARP, 1, 1)
    common = (P.data.ptr, cos.data.ptr, sin.data.ptr, tiles.data.ptr, lse.data.ptr, delta.data.ptr, gqkv.data.ptr,
              ptr(gqkvt), part.data.ptr)
    if dq_parts:
        dqp = cupy.empty((dq_parts, t, h), np.float32)
        k2 = _attn_kernel("dkdv_dqp", precision, d)
        k2(grid, block, common + (dqp.data.ptr,) + tail, stream, k2.max_smem)
        mark("attn_dkdv")
        k3 = _attn_kernel("dq_reduce", precision, d)
        k3(grid, block, (dqp.data.ptr, cos.data.ptr, sin.data.ptr, tiles.data.ptr, gqkv.data.ptr, ptr(gqkvt),
                         part.data.ptr, t, tp, h), stream, k3.max_smem)
        mark("attn_dq_reduce")
    else:
        k2 = _attn_kernel("dkdv", precision, d)
        k2(grid, block, common + tail, stream, k2.max_smem)
        mark("attn_dkdv")
    return (ot if o_t else o), (gqkv, gqkvt), part


def _padded(t: int) -> int:
    """Row length of the K-major (transposed) operands: tokens rounded up to 32, pad zero-filled."""
    return (t + 31) // 32 * 32


def transpose(x, stream: int, pad: bool = False):
    """Transposed copy of a C-contiguous fp32 [r, c] matrix: [c, r], or [c, _padded(r)] zero-padded."""
    import cupy

    r, c = x.shape
    ld = _padded(r) if pad else r
    out = cupy.empty((c, ld), np.float32)
    if c % 4 == 0 and ld % 4 == 0:  # 16-byte rows both ways (hidden sizes are multiples of 8)
        launcher("util", "transpose_f32_v4", "ppiii")(((c + 63) // 64, (ld + 63) // 64, 1), (256, 1, 1),
                                                      (x.data.ptr, out.data.ptr, r, c, ld), stream)
    else:
        launcher("util", "transpose_f32", "ppiii")(((c + 31) // 32, (ld + 31) // 32, 1), (32, 8, 1),
                                                   (x.data.ptr, out.data.ptr, r, c, ld), stream)
    return out


def vision_attention_backward(grad_output, hidden_states, qkv_weight, qkv_bias, proj_weight, proj_bias, cos, sin,
                              cu_seqlens, attention_dropout=0.0, scaling=None, *, num_heads=None,
                              precision="tf32", stream=None):
    """All five gradients of the fused varlen vision attention block with 2D RoPE.

    Args:
        grad_output: fp32 ``[T, H]``, the gradient of the block's output.
        hidden_states: fp32 ``[T, H]``; qkv_weight fp32 ``[3H, H]``; qkv_bias ``[3H]``;
            proj_weight ``[H, H]``; proj_bias ``[H]``; cos, sin fp32 ``[T, D]`` (any values: not assumed
            to be rotary tables). All C-contiguous.
        cu_seqlens: int32 (or int64) ``[N+1]``, cupy or numpy: sequence boundaries, 0 first, T last,
            non-decreasing (empty sequences allowed).
        attention_dropout: must be 0.0 (a dropout backward needs the forward's mask).
        scaling: softmax scale, default ``D ** -0.5``.
        num_heads: default ``H // D``.
        precision: ``"tf32"`` (default), ``"fp32"`` or ``"bf16"`` (see the README for error bounds).
        stream: a ``cupy.cuda.Stream``; default the current stream.

    Returns:
        ``(grad_hidden_states [T, H], grad_qkv_weight [3H, H], grad_qkv_bias [3H], grad_proj_weight [H, H],
        grad_proj_bias [H])``, all fp32.
    """
    t, h, nh, d = _validate(grad_output, hidden_states, qkv_weight, qkv_bias, proj_weight, proj_bias, cos, sin,
                            cu_seqlens, attention_dropout, num_heads, precision)
    scaling = d ** -0.5 if scaling is None else float(scaling)
    ctx, s = C.on_stream(stream)
    with ctx:
        return _backward(grad_output, hidden_states, qkv_weight, qkv_bias, proj_weight, cos, sin,
                         _cu_seqlens_read(cu_seqlens, s), t, h, nh, d, scaling, precision, s)


def _backward(grad_output, hidden_states, qkv_weight, qkv_bias, proj_weight, cos, sin, cu_pending, t, h, nh, d,
              scaling, precision, s, probe=None):
    import cupy

    f32 = np.float32
    # Outputs first, while cu_seqlens is on its way back; its values are checked before any launch.
    outs = (cupy.empty((t, h), f32), cupy.empty((3 * h, h), f32), cupy.empty((3 * h,), f32),
            cupy.empty((h, h), f32), cupy.empty((h,), f32))
    cu = _cu_seqlens_host(cu_pending, t)
    if t == 0:
        for z in outs[1:]:
            z.fill(0)
        return outs
    args = (grad_output, hidden_states, qkv_weight, qkv_bias, proj_weight, cos, sin, cu, t, h, nh, d, scaling,
            precision, s)
    if (probe is None and t <= GRAPH_MAX_TOKENS and _graphs.enabled and _cublas.capturable()
            and _graphs.replay(args, outs)):
        return outs
    _issue(*args, outs, None, probe or (lambda label: None), concurrent=probe is None)
    return outs


def _issue(grad_output, hidden_states, qkv_weight, qkv_bias, proj_weight, cos, sin, cu, t, h, nh, d, scaling,
           precision, s, outs, tiles, mark, concurrent=True):
    """Enqueue the whole backward on stream ``s``, which is the current stream (validated inputs, T > 0), with
    the tile table ``tiles`` (device array) or, if None, uploaded here. With ``concurrent`` (and at most
    CONCURRENT_MAX_TOKENS tokens, FP32_CONCURRENT_MAX_TOKENS in fp32) the products that do not depend on
    each other run on a second stream (see _Side); all work has joined ``s`` on return. Temporaries only ``s``
    uses are freed as soon as they are dead."""
    import cupy

    f32 = np.float32
    g_hidden, g_wqkv, g_bqkv, g_wp, g_bp = outs
    kmajor = precision == "tf32" and TF32_KMAJOR
    nt = precision == "fp32" and t >= FP32_NT_MIN_TOKENS  # dO and grad_hidden from transposed token operands
    nt_qkv = precision == "fp32" and t >= FP32_NT_QKV_MIN_TOKENS
    limit = FP32_CONCURRENT_MAX_TOKENS if precision == "fp32" else CONCURRENT_MAX_TOKENS
    side = _Side.of(s) if concurrent and t <= limit else _Side.serial(s)
    bufs, side_bufs = _Buffers(precision, s), _Buffers(precision, side.ptr)
    mark("start")
    dO = cupy.empty((t, h), f32)  # written on the side stream, read on s after the join
    side.fork()
    with side.ctx:  # side: dO = dY Wp and grad_proj_bias
        dy_op, wp_op = side_bufs.operand(grad_output), side_bufs.operand(proj_weight)
        mark("cast")  # (the marks are events on s: the phase profile runs with every side == s)
        if nt:
            dyt = transpose(grad_output, side.ptr, pad=True)  # released after the join below
            mark("transpose")
            gemm(dyt[:, :t], wp_op, dO, trans_a=True, trans_b=False, precision=precision, stream=side.ptr)
        else:
            gemm(dy_op, wp_op, dO, trans_a=False, trans_b=False, precision=precision, stream=side.ptr)
        del wp_op
        mark("gemm_dO")
        colsum(grad_output, side.ptr, out=g_bp)
        mark("bias_sums")
    # The QKV product on s, while the host builds and uploads the tile table.
    x_op, wqkv_op = bufs.operand(hidden_states), bufs.operand(qkv_weight)
    mark("cast")
    qkv = cupy.empty((t, 3 * h), f32)
    if nt_qkv:
        xt, wqkvt = transpose(hidden_states, s, pad=True), transpose(qkv_weight, s)
        mark("transpose")
        gemm(xt[:, :t], wqkvt, qkv, trans_a=True, trans_b=False, precision=precision, stream=s)
        del xt, wqkvt
    else:
        gemm(x_op, wqkv_op, qkv, trans_a=False, trans_b=True, precision=precision, stream=s)
    mark("gemm_qkv")
    if tiles is None:
        tiles = _upload(_tile_table(cu), s)
    side.join()
    if nt:
        del dyt
    P = _prepare(qkv, qkv_bias, cos, sin, dO, t, h, nh, d, precision, s)
    del qkv
    mark("attn_prep")

    def over_tokens(a, b, out, stream):  # out = a^T b, contracting over the tokens (kmajor: a, b given transposed)
        gemm(a, b, out, trans_a=not kmajor, trans_b=kmajor, precision=precision, stream=stream)

    def grad_proj_weight(o):  # dY^T O on the side stream, beside the dK/dV kernel
        side.fork()
        with side.ctx:
            a = dy_op
            if kmajor:
                a = transpose(grad_output, side.ptr, pad=True)
                mark("transpose")
            over_tokens(a, o, g_wp, side.ptr)
        mark("gemm_grad_proj_weight")

    o, (gqkv, gqkvt), part = _attention_core(P, cos, sin, dO, tiles, t, h, nh, d, scaling, precision, bufs, s,
                                             mark, o_t=kmajor, gqkv_t=kmajor or nt, after_fwd=grad_proj_weight,
                                             dq_parts=_dq_partials(precision, d, cu))
    del P, dO
    _colsum_finish(part, g_bqkv, s)
    mark("bias_sums")
    side.fork()  # grad_qkv is complete: grad_qkv_weight on the side stream (enqueued below), grad_hidden on s
    if nt:
        gemm(gqkvt[:, :t], wqkv_op, g_hidden, trans_a=True, trans_b=False, precision=precision, stream=s)
        del gqkvt  # read on s only
    else:
        gemm(gqkv, wqkv_op, g_hidden, trans_a=False, trans_b=False, precision=precision, stream=s)
    mark("gemm_grad_hidden")
    with side.ctx:
        a, b = (gqkvt, None) if kmajor else (gqkv, x_op)
        if kmajor:
            del gqkv  # read only by grad_hidden on s (queued); on one stream its memory serves X^T
            b = transpose(hidden_states, side.ptr, pad=True)
            mark("transpose")
        over_tokens(a, b, g_wqkv, side.ptr)
    mark("gemm_grad_qkv_weight")
    side.join()
    # Arrays read on the side stream (o, x_op, gqkv, ...) are released only here, after the join: memory freed
    # earlier could be handed to a later allocation on s while the side stream still reads it.


_private: dict = {}  # (role, device, caller stream) -> (stream, event, event)


def _private_stream(role: str, s: int):
    """(stream, event, event): this module's own non-blocking stream for ``role`` beside caller stream ``s`` on
    the current device, with two events for forking to it and joining from it; made once and kept."""
    from cupy_backends.cuda.api import runtime

    def make():
        import cupy

        return (cupy.cuda.Stream(non_blocking=True), cupy.cuda.Event(disable_timing=True),
                cupy.cuda.Event(disable_timing=True))

    return once(_private, (role, runtime.getDevice(), s), make)


class _Side:
    """A second stream on which the backward runs the products that do not depend on the main sequence:
    ``dO = dY Wp`` beside ``qkv = X Wqkv^T``, ``grad_proj_weight`` beside the dK/dV kernel, and
    ``grad_qkv_weight`` beside ``grad_hidden_states``. cuBLAS kernels (and the dK/dV kernel) leave SMs idle
    in their last wave; the other stream's blocks fill them. One side stream, with its own cuBLAS workspace,
    per caller stream, forked from and joined back into it with events, which a CUDA-graph recording turns
    into parallel branches. ``serial`` is the same interface on the caller's stream alone (no events), for the
    phase-by-phase profile and above CONCURRENT_MAX_TOKENS (FP32_CONCURRENT_MAX_TOKENS)."""

    def __init__(self, s, entry):
        self.main = s
        if entry is None:
            self.ptr, self.ctx, self._ev = s, C._NULL_CONTEXT, None
        else:
            stream, fork_ev, join_ev = entry
            self.ptr, self.ctx, self._ev = stream.ptr, stream, (fork_ev.ptr, join_ev.ptr)

    @classmethod
    def of(cls, s):
        return cls(s, _private_stream("side", s))

    @classmethod
    def serial(cls, s):
        return cls(s, None)

    def fork(self):
        """Work enqueued on the side stream from now on starts after the work enqueued on the main one so far."""
        if self._ev is not None:
            from cupy_backends.cuda.api import runtime

            runtime.eventRecord(self._ev[0], self.main)
            runtime.streamWaitEvent(self.ptr, self._ev[0], 0)

    def join(self):
        """Work enqueued on the main stream from now on starts after the side stream's work so far."""
        if self._ev is not None:
            from cupy_backends.cuda.api import runtime

            runtime.eventRecord(self._ev[1], self.ptr)
            runtime.streamWaitEvent(self.main, self._ev[1], 0)


# ---- CUDA-graph replay of repeated small calls -------------------------------------------------------------
# Up to a couple of thousand tokens the GPU work of a backward (~0.3-2 ms) is not much longer than the host's
# cost of issuing its ~20 launches and cuBLAS calls one by one, so the GPU may wait on Python. A call whose every
# argument is the same as in an earlier call - the same device pointers and shapes (so the same memory is
# read and written), the same cu_seqlens values, scaling, precision and stream, under the same module switches -
# is the same launch sequence.
# The second such call records the sequence into a CUDA graph (possible when _cublas reaches cuBLAS directly:
# CuPy's bindings refuse capture); later ones replay it with one launch. A training loop whose buffers come back at
# the same addresses from CuPy's memory pool hits the cache; anything else runs the sequence as usual.
# The graph keeps its own temporaries (O(T*H), at most GRAPH_MAX_TOKENS tokens) until it is evicted from the
# small LRU (GRAPH_CACHE_SIZE entries) or clear_graph_cache() is called.
GRAPH_MAX_TOKENS = 2048
GRAPH_CACHE_SIZE = 4


class _GraphCache:
    def __init__(self):
        import collections

        self.enabled = True
        self.lock = threading.Lock()
        self.entries: collections.OrderedDict = collections.OrderedDict()  # key -> (exec, graph, kept, stream)
        self.seen: collections.OrderedDict = collections.OrderedDict()     # keys met once
        self.records = 0  # graphs recorded so far (a statistic)

    @staticmethod
    def key(args, outs):
        (g, x, wq, bq, wp, cos, sin, cu, t, h, nh, d, scaling, precision, s) = args
        from cupy_backends.cuda.api import runtime

        # the module's switches choose the launch sequence too (operand layouts, second stream)
        switches = (TF32_KMAJOR, FP32_NT_MIN_TOKENS, FP32_NT_QKV_MIN_TOKENS, CONCURRENT_MAX_TOKENS,
                    FP32_CONCURRENT_MAX_TOKENS, DQ_PARTIAL_MAX_TILES)
        return (runtime.getDevice(), s, precision, t, h, nh, d, scaling, cu.dtype.str, cu.tobytes(), switches,
                tuple(a.data.ptr for a in (g, x, wq, bq, wp, cos, sin)), tuple(o.data.ptr for o in outs))

    def replay(self, args, outs) -> bool:
        """Launch the recorded graph of this exact call (recording it on its second occurrence); False when the
        caller should run the sequence itself."""
        from cupy_backends.cuda.api import runtime

        key = self.key(args, outs)
        s = args[-1]
        with self.lock:
            entry = self.entries.get(key)
            if entry is not None:
                self.entries.move_to_end(key)
                runtime.graphLaunch(entry[0], s)
                return True
            if key not in self.seen:
                self.seen[key] = None
                while len(self.seen) > 4 * GRAPH_CACHE_SIZE:
                    self.seen.popitem(last=False)
                return False
            entry = self._record(args, outs)
            self.records += 1
            self.entries[key] = entry
            while len(self.entries) > GRAPH_CACHE_SIZE:
                self._release(self.entries.popitem(last=False)[1])
            runtime.graphLaunch(entry[0], s)
            return True

    def _record(self, args, outs):
        """Record the launch sequence of this call into an instantiated graph. It is recorded on a private stream
        (CuPy's default stream cannot be captured), one per caller stream, whose cuBLAS workspace the graph then
        owns; it is replayed on the caller's stream."""
        import cupy
        from cupy_backends.cuda.api import runtime

        s, cu = args[-1], args[7]
        rec = _private_stream("record", s)[0]
        pool = cupy.get_default_memory_pool()
        kept = []

        def keep_alloc(nbytes):  # every temporary of the recorded sequence lives as long as the graph
            mem = pool.malloc(nbytes)
            kept.append(mem)
            return mem

        with rec:
            tiles = cupy.asarray(_tile_table(cu))  # uploaded before recording: the graph only reads it
            kept.append(tiles)
            rec.synchronize()
            runtime.streamBeginCapture(rec.ptr, runtime.streamCaptureModeRelaxed)
            try:
                with cupy.cuda.using_allocator(keep_alloc):
                    _issue(*args[:-1], rec.ptr, outs, tiles, lambda label: None)
            except BaseException:
                runtime.graphDestroy(runtime.streamEndCapture(rec.ptr))
                raise
            graph = runtime.streamEndCapture(rec.ptr)
        return runtime.graphInstantiate(graph), graph, kept, s

    @staticmethod
    def _release(entry):
        from cupy_backends.cuda.api import runtime

        exe, graph, kept, s = entry
        runtime.streamSynchronize(s)  # a replay may still be running
        runtime.graphExecDestroy(exe)
        runtime.graphDestroy(graph)
        kept.clear()

    def clear(self):
        with self.lock:
            while self.entries:
                self._release(self.entries.popitem()[1])
            self.seen.clear()


_graphs = _GraphCache()


def clear_graph_cache() -> None:
    """Release the CUDA graphs (and the temporaries they keep) recorded for repeated small backward calls."""
    _graphs.clear()


def set_graph_replay(enabled: bool) -> None:
    """Turn the CUDA-graph replay of repeated small backward calls on (the default) or off."""
    if not enabled:
        _graphs.clear()
    _graphs.enabled = bool(enabled)


def profile_split(timer, grad_output, hidden_states, qkv_weight, qkv_bias, proj_weight, proj_bias, cos, sin,
                  cu_seqlens, attention_dropout=0.0, scaling=None, *, num_heads=None, precision="tf32", reps=5):
    """GPU µs of each phase of one backward (dict phase -> µs, plus totals "cublas" and "kernels"), from CUDA
    events recorded between the phases; median over ``reps`` calls."""
    import statistics

    import cupy

    t, h, nh, d = _validate(grad_output, hidden_states, qkv_weight, qkv_bias, proj_weight, proj_bias, cos, sin,
                            cu_seqlens, attention_dropout, num_heads, precision)
    scaling = d ** -0.5 if scaling is None else float(scaling)
    s = cupy.cuda.get_current_stream()
    cu = _cu_seqlens_host(_cu_seqlens_read(cu_seqlens, s.ptr), t)
    runs = []
    for _ in range(reps):
        events = []

        def probe(label):
            ev = cupy.cuda.Event()
            ev.record(s)
            events.append((label, ev))

        _backward(grad_output, hidden_states, qkv_weight, qkv_bias, proj_weight, cos, sin, cu, t, h, nh, d,
                  scaling, precision, s.ptr, probe)
        events[-1][1].synchronize()
        phases: dict = {}
        for (_, e0), (label, e1) in zip(events[:-1], events[1:]):
            phases[label] = phases.get(label, 0.0) + cupy.cuda.get_elapsed_time(e0, e1) * 1e3
        runs.append(phases)
    out = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    out["cublas"] = sum(v for k, v in out.items() if k.startswith("gemm"))
    out["kernels"] = sum(v for k, v in out.items() if not k.startswith("gemm") and k != "cublas")
    return out


def vision_attention_forward(hidden_states, qkv_weight, qkv_bias, proj_weight, proj_bias, cos, sin, cu_seqlens,
                             scaling=None, *, num_heads=None, precision="tf32", stream=None):
    """Output ``[T, H]`` (fp32) of the attention block whose gradients :func:`vision_attention_backward`
    computes, from the same kernels (QKV GEMM, bias + RoPE on load, flash attention, projection GEMM)."""
    import cupy

    t, h, nh, d = _validate(None, hidden_states, qkv_weight, qkv_bias, proj_weight, proj_bias, cos, sin,
                            cu_seqlens, 0.0, num_heads, precision)
    scaling = d ** -0.5 if scaling is None else float(scaling)
    ctx, s = C.on_stream(stream)
    with ctx:
        bufs = _Buffers(precision, s)
        out = cupy.empty((t, h), np.float32)
        cu = _cu_seqlens_host(_cu_seqlens_read(cu_seqlens, s), t)
        if t == 0:
            return out
        table = _tile_table(cu)
        tiles = _upload(table, s)
        x_op, wqkv_op, wp_op = bufs.operand(hidden_states), bufs.operand(qkv_weight), bufs.operand(proj_weight)
        qkv = cupy.empty((t, 3 * h), np.float32)
        gemm(x_op, wqkv_op, qkv, trans_a=False, trans_b=True, precision=precision, stream=s)
        P = _prepare(qkv, qkv_bias, cos, sin, None, t, h, nh, d, precision, s)
        del qkv
        o = bufs.empty((t, h))
        k = _attn_kernel("fwd", precision, d)
        k((table.shape[0], nh, 1), (32 * _NWARP, 1, 1), (P.data.ptr, tiles.data.ptr, o.data.ptr, t, h,
                                                float(scaling * LOG2E)), s, k.max_smem)
        del P
        launcher("util", "fill_rows_f32", "ppqi")((min(4096, (t * h // 4 + 255) // 256), 1, 1), (256, 1, 1),
                                                 (out.data.ptr, proj_bias.data.ptr, t, h), s)
        gemm(o, wp_op, out, trans_a=False, trans_b=True, precision=precision, stream=s, accumulate=True)
    return out
