"""Varlen (``cu_seqlens``) flash attention alone, forward and backward: what ``flash_attn_varlen_func`` is to
PyTorch users, for CuPy, in the three precision modes.

On Hopper (head dims 64, 80, 96 and 128; 72 takes the mma.sync kernels below) in bf16 both run on the sm_90a kernels
(:mod:`.hopper`) on q, k, v as they are: one pass over K and V per query tile forward, one pass over the queries per
key tile backward (dQ summed in key-tile order). In tf32 they run on the sm_90a tf32 kernels, on q, k, v and grad_o
as they are where a kernel rounds them to tf32 in registers, elsewhere on copies rounded to tf32 (most written by
the same passes as the transposed copies those kernels read): nothing is packed, and no rotation or bias is applied.
Elsewhere they run on the vision block's attention kernels: ``q``, ``k``, ``v`` are packed by the block's
preparation kernel (with no bias and the identity rotation, cos = 1 and sin = 0), the forward is the block's forward
pass alone (``attn_fwd``, with the log-sum-exp), and the backward is the block's attention core on the ``o`` and
``lse`` given (delta and lse2 from them by the shared delta pass, no forward pass again). In fp32, the backward on
sequences of at most 256 tokens in a few runs of one length takes the block's dense form instead (batched cuBLAS
products over stored scores, attention/dense.py), which recomputes the scores and reads neither ``o`` nor ``lse``;
its forward runs the flash kernel there, but on one run of fewer than 1024 tokens (plan.dense_forward). Memory stays
O(T·H).
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

from .. import _checks as C
from ..precision import Precision
from . import dense, hopper, kernels as K
from . import plan as _plan
from . import schedule
from . import varlen as _varlen

LN2 = K.LN2  # the kernels keep the log-sum-exp in the log2 domain


def _none(*args) -> None:
    return None


def _validate(q, k, v, cu_seqlens, precision, extra: dict, max_seqlen, out=None):
    """Checks of q, k, v (and ``extra``: name -> (array, dtypes or None for q's)) and of the form of
    ``cu_seqlens``, and that they and ``out`` are on one GPU; returns (Precision, T, NH, D)."""
    p = Precision.parse(precision)
    allowed = (C.F32, C.BF16) if p == Precision.BF16 else (C.F32,)
    arrays = dict(q=q, k=k, v=v)
    C.require_one_device({**arrays, **{name: x for name, (x, _, _) in extra.items()}, "out": out,
                          "cu_seqlens": cu_seqlens})
    for name, x in arrays.items():
        C.require_cupy(x, name)
        C.require_dtype(x, name, allowed)
    if q.ndim != 3:
        raise ValueError(f"q must be 3-D [tokens, heads, head_dim], got shape {q.shape}")
    t, nh, d = q.shape
    if nh < 1:
        raise ValueError(f"q must have at least one head (q.shape[1]), got shape {q.shape}")
    if d not in K.HEAD_DIMS:
        raise ValueError(f"head_dim (q.shape[2]) must be one of {K.HEAD_DIMS}, got {d}")
    for name, x in (("k", k), ("v", v)):
        C.require_shape(x, name, q.shape, " (the shape of q)")
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have the dtype of q ({C.dtype_name(q.dtype)}), got {C.dtype_name(x.dtype)}")
    for name, (x, dtypes, shape) in extra.items():
        C.require_cupy(x, name)
        C.require_dtype(x, name, dtypes or (q.dtype,))
        C.require_shape(x, name, shape)
        arrays[name] = x
    for name, x in arrays.items():
        C.require_kernel_operand(x, name)
    C.check_cu_seqlens_form(cu_seqlens)
    C.check_token_limits(t, nh * d, nh)
    if max_seqlen is not None:
        C.require_int(max_seqlen, "max_seqlen", minimum=0)
    return p, t, nh, d


def _choose_plan(p, d, vl, plan, forward: bool = False):
    """The library's plan for this call (``forward``: the forward alone), or the caller's override. On Hopper, bf16
    and tf32 take the sm_90a kernels at every size here: the mma.sync path of this API repacks q, k, v, and was
    1.7-4.2x slower in bf16 when it also recomputed the forward (bench/NOTES.md), where the block's threshold weighs
    small launches against its own fused kernels; but for a backward with more key tiles than the sm_90a grid holds
    (tens of thousands of short sequences), or in tf32 with sequences of under 32 tokens on average, where its K^T
    laid out by tile would be many times K (plan.library_hopper_backward). A backward off those kernels takes the
    dense form where the block's plan does (fp32, and tf32 off them: sequences of at most 256 tokens, few runs of one
    length; attention/dense.py); a forward takes it only where plan.dense_forward says so. On the sm_90a kernels,
    the parts of them that the call runs are compiled ahead, side by side; a forward's with the backward's that
    mostly follows it (a training step), so that the pair waits for the longer of them, not for the forward's and
    then the backward's (bf16, D = 128, an H100 host: the pair's first call 8.1 s against 12.9; a process that runs
    forwards alone waits for the longer backward part, once per machine, as the disk cache keeps it)."""
    sm90 = hopper.supported()
    chosen = _library_plan(p, d, vl.tokens, vl.max_tiles, sm90, len(vl.runs), forward, vl.ntiles)
    chosen = _plan.resolve(plan, chosen, vl.max_tiles, vl.ntiles, backward=not forward)
    hopper.require_supported(chosen.hopper, sm90)
    if chosen.hopper and vl.tokens:
        hopper.compile_ahead(chosen, forward=forward)
    return chosen


@functools.lru_cache(maxsize=1024)
def _library_plan(p, d: int, tokens: int, max_tiles: int, sm90: bool, runs: int, forward: bool,
                  tiles: int | None = None):
    # the forward's grid holds any call; a backward's must hold its key units, and tf32's K^T by tile stay near K's
    # size (plan.library_hopper_backward)
    fits = forward or tiles is None or _plan.library_hopper_backward(p, tiles, tokens)
    chosen = _plan.make_plan(p, head_dim=d, tokens=tokens, max_tiles=max_tiles, sm90=sm90, runs=runs,
                             tiles=None if forward else tiles)
    if chosen.precision != Precision.FP32 and d in _plan.HOPPER_HEAD_DIMS and sm90 and fits:
        chosen = dataclasses.replace(chosen, hopper=True, dense=False, dense_in_place=False)
    if forward and chosen.dense and not _plan.dense_forward(chosen.precision, tokens, runs):
        chosen = dataclasses.replace(chosen, dense=False, dense_in_place=False)
    return chosen


def _bf16(x, s):
    """x as a C-contiguous bf16 array (cast on stream ``s`` if fp32)."""
    return x if x.dtype != np.float32 else K.Buffers(Precision.BF16, s).operand(x)


def _check_max_seqlen(vl, max_seqlen) -> None:
    if max_seqlen is not None and vl.max_len > max_seqlen:
        raise ValueError(f"max_seqlen={max_seqlen} but cu_seqlens has a sequence of {vl.max_len} tokens")


def _as_f32(x):
    """fp32 of an fp32 or bf16 array (bf16 widened exactly: its bits are the high half of an fp32's)."""
    import cupy

    if x.dtype == np.float32:
        return x
    return (x.view(cupy.uint16).astype(cupy.uint32) << 16).view(cupy.float32)


def _operands(q, k, v, dO, t, nh, d, p, s, rotation=True, dense_map=None):
    """The block's packed operands of q, k, v and dO (no bias, the identity rotation; in the dense order with
    ``dense_map``) and the cos / sin used (None with ``rotation=False``, for kernels that take no rotation)."""
    import cupy

    h = nh * d
    qkv = tuple(_as_f32(x).reshape(t, h) for x in (q, k, v))  # read in place (fp32), no [T, 3H] copy
    cos, sin = cupy.ones((t, d), np.float32), cupy.zeros((t, d), np.float32)
    P = K.prepare(qkv, cupy.zeros((3 * h,), np.float32), cos, sin, dO, t, h, nh, d, p, s, dense_map=dense_map)
    return (P, cos, sin) if rotation else (P, None, None)


def _dense(q, k, v, dO, vl, t, nh, d, scaling, p, s):
    """The dense form (attention/dense.py) on q, k, v (and dO) packed in its order."""
    rows = vl.device_dense_rows(nh, s)
    P, _, _ = _operands(q, k, v, dO, t, nh, d, p, s, rotation=False, dense_map=rows)
    return dense.Dense(P, vl.runs, rows, t, nh, d, scaling, p, s)


def varlen_attention_forward(q, k, v, cu_seqlens, *, scaling=None, precision="tf32", max_seqlen=None, out=None,
                             stream=None, plan=None):
    """Varlen attention: per sequence ``[cu[i], cu[i+1])`` and head, ``o = softmax(scaling q k^T) v``.

    Args:
        q, k, v: ``[T, NH, D]`` CuPy arrays, fp32 (``fp32``/``tf32``), fp32 or bf16 (``bf16``), C-contiguous,
            16-byte aligned (a fresh CuPy array is).
        cu_seqlens: int32/int64 ``[N+1]``, NumPy (nothing read back from the device) or CuPy.
        scaling: a finite number, default ``D ** -0.5``. precision: ``"fp32"``, ``"tf32"`` (default) or ``"bf16"``.
        max_seqlen: optional host bound on the sequence lengths (checked).
        out: optional ``[T, NH, D]`` array for ``o`` (fp32; bf16 in ``bf16`` mode).
        stream: a ``cupy.cuda.Stream``; default the current stream.
        plan: a :class:`~cupy_rope.attention.plan.Plan` or a function of the library's plan returning one (for
            example forcing ``hopper=False``, the kernels of GPUs before Hopper).

    Returns:
        ``(o, lse)``: ``o`` ``[T, NH, D]`` (fp32; bf16 in ``bf16`` mode), ``lse`` ``[NH, T]`` fp32, the natural
        log-sum-exp of each row of ``scaling q k^T``.
    """
    import cupy

    p, t, nh, d = _validate(q, k, v, cu_seqlens, precision, {}, max_seqlen, out)
    o_dtype = K.operand_dtype(p)
    if out is not None:
        C.require_cupy(out, "out")
        C.require_dtype(out, "out", (o_dtype,))
        C.require_shape(out, "out", (t, nh, d))
        C.require_kernel_operand(out, "out")
        C.require_no_overlap(out, "out", dict(q=q, k=k, v=v))
    scaling = C.attention_scaling(scaling, d)
    ctx, s = C.on_stream(stream)
    with ctx:
        pending = _varlen.read_async(cu_seqlens, s)  # a device cu_seqlens comes back while the outputs are made
        o = cupy.empty((t, nh, d), o_dtype) if out is None else out
        lse = cupy.empty((nh, t), np.float32)
        vl = _varlen.resolve(pending, t)
        _check_max_seqlen(vl, max_seqlen)
        chosen = _choose_plan(p, d, vl, plan, forward=True)  # a caller's plan is checked even with no tokens
        if t == 0:
            return o, lse
        h = nh * d
        if chosen.dense:
            dn = _dense(q, k, v, None, vl, t, nh, d, scaling, p, s)
            dn.scores(lse=lse, lse_scale=LN2)
            od = dn.output()
            dn.release()
            dn.scatter(od, 1, out=o, out_ld=h)
            return o, lse
        if chosen.hopper and p == Precision.TF32:
            # the operands where the kernel reads them: k rounded, v's rounded transposed copy, q as given where
            # the kernel rounds it in registers (lse_scale: the natural log-sum-exp, the kernels' lse2 times ln 2)
            rq = hopper.registers_round(chosen.fwd_specialised, forward=True)
            qr, kr = (q if rq else hopper.round32(q, s)), hopper.round32(k, s)
            vt = hopper.transposed(hopper.token_rows(v), t, nh, d, True, s)
            hopper.forward_tf32_rows(hopper.token_rows(qr), hopper.token_rows(kr), vt,
                                     vl.device_table(s), vl.ntiles, o, h, lse, t, nh, d, scaling * K.LOG2E, s,
                                     lse_scale=LN2, specialised=chosen.fwd_specialised,
                                     tail=hopper.forward_tail(vl.table, nh, chosen))
            return o, lse
        if chosen.hopper:
            qb, kb, vb = (_bf16(x, s) for x in (q, k, v))
            kn = chosen.fwd_keys
            maps = (hopper.token_major_map(qb, hopper.BM), hopper.token_major_map(kb, kn),
                    hopper.token_major_map(vb, kn))
            hopper.forward(maps, vl.device_table(s), vl.ntiles, o, h, lse, t, nh, d, scaling * K.LOG2E, s,
                           specialised=chosen.fwd_specialised, keys=kn, persistent=chosen.fwd_persistent,
                           lse_scale=LN2, o_bulk=chosen.fwd_o_bulk)
            return o, lse
        P, _, _ = _operands(q, k, v, None, t, nh, d, p, s, rotation=False)
        tiles = vl.device_table(s)  # held until the launch is enqueued: its memory is not reused before
        K.launch("fwd", p, d, (vl.ntiles, nh, 1),
                 (P.data.ptr, tiles.data.ptr, o.data.ptr, lse.data.ptr, t, h, float(scaling * K.LOG2E)), s)
        K.scale(lse, LN2, s, out=lse)  # the kernels keep it in the log2 domain
    return o, lse


def varlen_attention_backward(grad_o, q, k, v, o, lse, cu_seqlens, *, scaling=None, precision="tf32",
                              max_seqlen=None, stream=None, plan=None):
    """Gradients ``(dq, dk, dv)`` (fp32 ``[T, NH, D]``) of varlen attention for the output gradient ``grad_o``.

    ``grad_o`` and ``o`` as ``q`` (``o`` may also be bf16 in ``bf16`` mode, as the forward returns it), ``lse``
    ``[NH, T]`` fp32; the other arguments as for :func:`varlen_attention_forward`. The kernels read ``o`` and
    ``lse`` as given (delta = rowsum(grad_o * o) from ``o`` and the ``grad_o`` that dP is made of: in bf16 mode
    its bf16 rounding, so an fp32 ``grad_o`` gives the bits of its bf16 rounding), but for the dense form (short
    sequences in fp32 and tf32), which recomputes the scores and reads neither. Deterministic: two runs give the
    same bits.
    """
    import cupy

    shape = tuple(q.shape) if getattr(q, "ndim", 0) == 3 else None
    o_dtypes = (C.F32, C.BF16) if Precision.parse(precision) == Precision.BF16 else (C.F32,)
    extra = {} if shape is None else dict(grad_o=(grad_o, None, shape), o=(o, o_dtypes, shape),
                                          lse=(lse, (C.F32,), (shape[1], shape[0])))
    p, t, nh, d = _validate(q, k, v, cu_seqlens, precision, extra, max_seqlen)
    scaling = C.attention_scaling(scaling, d)
    ctx, s = C.on_stream(stream)
    with ctx:
        vl = _varlen.resolve(_varlen.read_async(cu_seqlens, s), t)
        _check_max_seqlen(vl, max_seqlen)
        plan = _choose_plan(p, d, vl, plan)
        if t == 0:
            return tuple(cupy.empty((t, nh, d), np.float32) for _ in range(3))
        h = nh * d
        if plan.dense:
            dn = _dense(q, k, v, _as_f32(grad_o).reshape(t, h), vl, t, nh, d, scaling, p, s)
            dn.scores_and_gradients()
            grads = dn.gradients()
            dn.release()
            outs = tuple(cupy.empty((t, nh, d), np.float32) for _ in range(3))
            for g, out in zip(grads, outs):
                dn.scatter(g, 1, out=out, out_ld=h)
            return outs
        if plan.hopper and p == Precision.TF32:
            return _backward_sm90_tf32(grad_o, q, k, v, o, lse, vl, t, nh, d, scaling, s, plan)
        if plan.hopper:
            return _backward_sm90(grad_o, q, k, v, o, lse, vl, t, nh, d, scaling, s, plan)
        dO = _as_f32(grad_o).reshape(t, h)
        P, cos, sin = _operands(q, k, v, dO, t, nh, d, p, s)
        tiles = vl.device_table(s)
        bf16 = p == Precision.BF16  # grad_qkv is then a bf16 GEMM operand: take its fp32 transpose instead
        _, (gqkv, gqkvt), _ = schedule.attention_core(P, cos, sin, dO, tiles, vl.ntiles, t, h, nh, d, scaling, plan,
                                                      K.Buffers(p, s), s, _none, gqkv_t=bf16,
                                                      stats=(o.reshape(t, h), lse))
        del P
        g = K.transpose(gqkvt, s)[:t] if bf16 else gqkv  # [T, 3H] fp32
        return tuple(cupy.ascontiguousarray(g[:, i * h:(i + 1) * h]).reshape(t, nh, d) for i in range(3))


def _backward_sm90(grad_o, q, k, v, o, lse, vl, t, nh, d, scaling, s, plan):
    """The backward on the sm_90a kernels: delta from ``o`` as given and the bf16 ``grad_o`` the kernels read
    (the values dP is made of, as in the block), then one key-stationary pass (dK, dV, ordered dQ) and the dQ
    write."""
    import cupy

    h = nh * d
    qb, kb, vb, gb = (_bf16(x, s) for x in (q, k, v, grad_o))
    bq = plan.query_rows
    maps = (hopper.token_major_map(qb, bq), hopper.token_major_map(kb, hopper.BM),
            hopper.token_major_map(vb, hopper.BM), hopper.token_major_map(gb, bq))
    # delta, with lse2 (the kernels work in the log2 domain) and the dQ counts zeroed in the same pass
    lse2, dlt = cupy.empty((nh, t), np.float32), cupy.empty((nh, t), np.float32)
    sem = cupy.empty((nh, t), np.int32)
    hopper.delta(o, h, gb, h, dlt, t, nh, d, s, lse=lse, lse2=lse2, lse_k=1.0 / LN2, sem=sem)
    dqacc = cupy.empty((nh, t, d), np.float32)
    dq, dk, dv = (cupy.empty((t, nh, d), np.float32) for _ in range(3))
    part = cupy.empty((1,), np.float32)  # the plain kernels write no bias sums
    hopper.backward(maps, vl.device_table(s), vl.ntiles, lse2, dlt, dqacc, sem, dq.data.ptr, dk.data.ptr,
                    dv.data.ptr, h, None, None, part, None, 0, t, nh, d, scaling, s, block=False,
                    order=plan.head_group, specialised=plan.specialised, fused_dq=plan.fused_dq,
                    tail_parts=plan.tail_parts, query_rows=bq)
    return dq, dk, dv


def _backward_sm90_tf32(grad_o, q, k, v, o, lse, vl, t, nh, d, scaling, s, plan):
    """The backward on the sm_90a tf32 kernels: the transposed copies of q, grad_o and k, which also write the
    rounded row copies of q and grad_o from the same reads (k's too where the kernel does not round K and V in
    registers, v's then by a copy of its own), grad_o's with delta from ``o`` and ``grad_o`` as given (and lse2,
    the dQ counts zeroed); one key-stationary pass and the dQ write."""
    import cupy

    h = nh * d
    tiles = vl.device_table(s)
    qr, dor = cupy.empty_like(q), cupy.empty_like(grad_o)
    lse2, dlt = cupy.empty((nh, t), np.float32), cupy.empty((nh, t), np.float32)
    sem = cupy.empty((nh, t), np.int32)
    qt = hopper.transposed(hopper.token_rows(q), t, nh, d, True, s, rows=qr)
    dot = hopper.transposed_delta(hopper.token_rows(grad_o), hopper.token_rows(o), t, nh, d, s, dor, dlt, lse,
                                  lse2, 1.0 / LN2, sem)
    if hopper.registers_round(plan.specialised, plan.stages):
        kr, vr = k, v
        kt = hopper.transposed(hopper.token_rows(k), t, nh, d, False, s, tiles, vl.ntiles)
    else:
        kr = cupy.empty_like(k)
        kt = hopper.transposed(hopper.token_rows(k), t, nh, d, False, s, tiles, vl.ntiles, rows=kr)
        vr = hopper.round32(v, s)
    stores = hopper.first_tile_stores(vl, plan)
    dqacc = hopper.dq_accumulator_tf32(t, nh, d, not stores)
    dq, dk, dv = (cupy.empty((t, nh, d), np.float32) for _ in range(3))
    # no bias sums in the plain epilogues, but each key tile's second half still zeroes its q columns here
    part = cupy.empty((2 * vl.ntiles, 3 * h), np.float32)
    ops = tuple(hopper.token_rows(x) for x in (qr, kr, vr, dor))
    hopper.backward_tf32_rows(ops, (kt, qt, dot), tiles, vl.ntiles, lse2, dlt, dqacc, sem, dq.data.ptr,
                              dk.data.ptr, dv.data.ptr, h, None, None, part, None, 0, t, nh, d, scaling, s,
                              block=False, specialised=plan.specialised, order=plan.head_group, stages=plan.stages,
                              tail_parts=plan.tail_parts, first_stores=stores)
    return dq, dk, dv
