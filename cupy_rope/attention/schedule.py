"""The launch sequence of the vision attention block for a plan: cuBLAS products and attention kernels, on the
caller's stream and (``plan.concurrent``) a second one. Knows nothing of graphs or validation.

Backward (``T`` tokens, hidden ``H``, ``NH`` heads of ``D``):

1. cuBLAS ``dO = dY Wp`` (side stream, with ``grad_proj_bias``) beside ``qkv = X Wqkv^T``.
2. ``attn_prep``: bias + RoPE, operands packed per head in the mode's element type (bf16 on the sm_90a kernels,
   ``plan.in_place``: q and k in bf16 beside the bf16 outputs of the V (bias from its epilogue) and dO products).
3. ``attn_fwd_dq``: per 128-query tile and head, flash forward (O, log-sum-exp, ``delta = rowsum(dO*O)``), then dQ
   with the RoPE backward fused, into ``grad_qkv[:, 0:H]``. ``grad_proj_weight = dY^T O`` then starts on the side.
4. ``attn_dkdv``: per 128-key tile and head, dK (RoPE backward fused) and dV into ``grad_qkv[:, H:3H]``. With
   ``plan.dq_partials`` (or ``plan.dq_ordered``) step 3 stops after the forward (``attn_fwd_stats``),
   ``attn_dkdv_dqp`` also writes each key tile's share of dQ (or adds it into one sum in key-tile order), and
   ``attn_dq_reduce`` sums the shares in order and applies the RoPE backward.
   With ``plan.dense`` (fp32 / tf32, short sequences) steps 3 and 4 are batched cuBLAS products over stored scores
   with three kernels between them (:mod:`.dense`), on operands packed in the dense order.
5. ``grad_hidden_states = grad_qkv Wqkv`` beside ``grad_qkv_weight = grad_qkv^T X`` (side); bias gradients are
   fixed-order column sums (per-tile partials written by the attention kernels for ``grad_qkv_bias``).

``hook(label)``, if given, is called on the host after each phase is enqueued (phase timing records events there);
``on_output(name, array, stream)`` after the last work producing an output has been enqueued on ``stream``
(with it, grad_qkv_weight comes as its q, k and v row blocks "grad_qkv_weight[i]", before grad_hidden_states).
Temporaries only the caller's stream uses are freed as soon as they are dead; arrays read on the side stream are
released only after the join that follows their last use there.
"""
from __future__ import annotations

import numpy as np

from .. import _checks as C
from .._cublas import capturable, gemm
from ..precision import Precision
from . import dense, hopper, kernels as K
from .streams import Side


def _none(*args) -> None:
    return None


def reads_in_place(plan) -> bool:
    """Whether the backward reads its attention operands where the products leave them: bf16 on the sm_90a
    kernels with the inputs cast (``plan.in_place``): the V product (with its bias, in the product's epilogue)
    and the dO product write bf16, which the kernels read where it lies, beside the bf16 q and k that prepare_qk
    makes from the QK product; no packed per-head copies. Otherwise the preparation kernel of the mma.sync
    module (``K.prepare``) packs them."""
    return plan.in_place and plan.hopper and plan.precision == Precision.BF16 and plan.cast_operands


def backward(grad_output, hidden_states, qkv_weight, qkv_bias, proj_weight, cos, sin, varlen, nh, scaling, plan,
             s: int, outs, tiles=None, hook=None, on_output=None):
    """Enqueue the whole backward on stream ``s`` (the current stream; validated inputs, T > 0) into ``outs``.
    ``tiles``: the device tile table, or None to upload it here. All work has joined ``s`` on return, also when
    an exception is raised."""
    mark = hook or _none
    emit = on_output or _none
    side = Side(s, plan.concurrent)
    with side.scope():
        _backward(grad_output, hidden_states, qkv_weight, qkv_bias, proj_weight, cos, sin, varlen, nh, scaling,
                  plan, s, outs, tiles, mark, emit, side)


def _backward(grad_output, hidden_states, qkv_weight, qkv_bias, proj_weight, cos, sin, varlen, nh, scaling, plan, s,
              outs, tiles, mark, emit, side):
    import cupy

    f32 = np.float32
    t, h = hidden_states.shape
    d = plan.head_dim
    precision = plan.precision
    g_hidden, g_wqkv, g_bqkv, g_wp, g_bp = outs
    kmajor, nt, nt_qkv = plan.kmajor, plan.nt, plan.nt_qkv
    label = precision.label
    # bf16 without plan.cast_operands (plan.py says when): no bf16 copies of the inputs before the first product.
    # dO and QKV read dY, Wp, X and Wqkv as stored (cuBLAS rounds them to bf16 inside the product). The products
    # that meet a bf16 operand written by the attention kernels, decided one by one:
    # - grad_hidden_states = grad_qkv Wqkv and grad_qkv_weight = grad_qkv^T X: the kernels also write grad_qkv^T in
    #   fp32 (T x 3H x 4 bytes, as the fp32 and tf32 layouts have them do), and both products read that and Wqkv or
    #   X as stored. Casting Wqkv instead, the largest operand, would cost more than today: two fp32 reads (8 bytes
    #   an element) against a cast and two bf16 reads (10), plus an fp32 read for QKV (14).
    # - grad_proj_weight = dY^T O: O stays bf16 and dY ([T, H], small beside the weights) is cast, on the side
    #   stream beside the dK/dV kernel; an fp32 O^T would be written by the forward kernel, on the critical path,
    #   and the sm_90a kernels write none.
    fast16 = label == "bf16" and not plan.cast_operands
    in_place = reads_in_place(plan)
    bufs, side_bufs = K.Buffers(precision, s), K.Buffers(precision, side.ptr)
    mark("start")
    dO = cupy.empty((t, h), C.BF16 if in_place else f32)  # written on the side stream, read on s after the join

    def side_start(dO):  # side: grad_proj_bias and dO = dY Wp
        side.fork()
        with side.ctx:
            # grad_proj_bias: dY's column sums, in bf16 from the pass that casts dY (one read of dY, not two); with
            # K-major weight gradients from the pass that transposes dY (grad_proj_weight, below)
            if kmajor:
                dy_op, (wp_op,) = grad_output, side_bufs.operands(proj_weight)
            else:
                part_bp = cupy.empty((K.colsum_chunks(t), h), f32)
                if fast16:
                    dy_op, wp_op = grad_output, proj_weight
                    K.colsum_partial(grad_output, part_bp, side.ptr)
                else:
                    dy_op = side_bufs.operand_and_colsum(grad_output, part_bp)
                    (wp_op,) = side_bufs.operands(proj_weight)
                    mark("cast")  # (the marks are events on s: phase timing runs with a serial plan)
                K.colsum_finish(part_bp, g_bp, side.ptr)
                emit("grad_proj_bias", g_bp, side.ptr)
                mark("bias_sums")
            dyt = None
            if nt:
                dyt = K.transpose(grad_output, side.ptr, pad=True)  # released after the join below
                mark("transpose")
                gemm(dyt[:, :t], wp_op, dO, trans_a=True, trans_b=False, precision=label, stream=side.ptr)
            else:
                gemm(dy_op, wp_op, dO, trans_a=False, trans_b=False, precision=label, stream=side.ptr)
            mark("gemm_dO")
        return dy_op, dyt

    def main_casts():  # the QKV product's operands on s (plan.casts_first: before the side stream starts)
        if fast16:
            return hidden_states, qkv_weight, None
        if in_place:  # with V's bias for its product's epilogue, all in one launch
            ops = bufs.operands(hidden_states, qkv_weight, qkv_bias[2 * h:])
        else:
            ops = bufs.operands(hidden_states, qkv_weight) + (None,)
        mark("cast")
        return ops

    if plan.casts_first:
        x_op, wqkv_op, bv = main_casts()
        dy_op, dyt = side_start(dO)
    else:
        dy_op, dyt = side_start(dO)
        x_op, wqkv_op, bv = main_casts()
    # The QKV product on s, while the host builds and uploads the tile table.
    if in_place:  # q and k (fp32, for the preparation), v in bf16 with its bias (rounded to bf16, cuBLASLt's bias
        # type here) added to the fp32 sum in the product's epilogue, before its one rounding
        qk, v = cupy.empty((t, 2 * h), f32), cupy.empty((t, h), C.BF16)
        gemm(x_op, wqkv_op[:2 * h], qk, trans_a=False, trans_b=True, precision=label, stream=s)
        gemm(x_op, wqkv_op[2 * h:], v, trans_a=False, trans_b=True, precision=label, stream=s, bias=bv)
        del bv
    elif nt_qkv:
        qkv = cupy.empty((t, 3 * h), f32)
        xt, wqkvt = K.transpose(hidden_states, s, pad=True), K.transpose(qkv_weight, s)
        mark("transpose")
        gemm(xt[:, :t], wqkvt, qkv, trans_a=True, trans_b=False, precision=label, stream=s)
        del xt, wqkvt
    else:
        qkv = cupy.empty((t, 3 * h), f32)
        gemm(x_op, wqkv_op, qkv, trans_a=False, trans_b=True, precision=label, stream=s)
    mark("gemm_qkv")
    if tiles is None and not plan.dense:  # the dense form reads no tile table
        tiles = varlen.device_table(s)
    side.join()
    if nt:
        del dyt
    if in_place:
        qk16 = cupy.empty((t, 2 * h), C.BF16)
        hopper.prepare_qk(qk, qkv_bias, cos, sin, qk16, t, h, d, s)
        P = (qk16, v, dO)
        del qk, v, qk16
    else:
        rows = varlen.device_dense_rows(nh, s) if plan.dense else None
        dense_in_place = None  # plan.dense_in_place: V and dO read where their products leave them
        if plan.dense and plan.dense_in_place and capturable():
            # K-major, every sequence aligned: the O product writes O^T [H, o_ld] itself (dense.py; 0: it does not)
            o_ld = dense.o_t_width(t) if kmajor and varlen.starts_aligned(dense.O_T_ALIGN) else 0
            dense_in_place = (qkv, dO, varlen.device_dense_pointer_offsets(nh, d, s, o_ld=o_ld), o_ld)
        P = K.prepare(qkv, qkv_bias, cos, sin, None if dense_in_place else dO, t, h, nh, d, precision, s,
                      dense_map=rows, qk_only=dense_in_place is not None)
        del qkv  # (in place: held by dense_in_place until the products that read it are enqueued)
    mark("attn_prep")

    def over_tokens(a, b, out, stream):  # out = a^T b, contracting over the tokens (kmajor: a, b given transposed)
        gemm(a, b, out, trans_a=not kmajor, trans_b=kmajor, precision=label, stream=stream)

    def grad_proj_weight(o, bias_column=False):  # dY^T O on the side stream, beside the dK/dV kernel
        # bias_column (K-major): O^T without V's bias b, which its column T holds instead (dense.py); dY^T's
        # column T then holds dY's column sums, and the product over the pad columns adds colsum(dY) b^T
        side.fork()
        with side.ctx:
            a = dy_op
            if fast16:  # O is bf16: dY too (see above)
                a = side_bufs.operand(grad_output)
                mark("cast")
            elif kmajor:  # dY^T as wide as O^T, and grad_proj_bias from the same pass
                part_bp = cupy.empty((K.transpose_rows(o.shape[1]), h), f32)
                a = K.transpose_colsum(grad_output, part_bp, side.ptr, o.shape[1])
                K.colsum_finish(part_bp, g_bp, side.ptr, column=(a, t) if bias_column else None)
                emit("grad_proj_bias", g_bp, side.ptr)
                mark("transpose")
            over_tokens(a, o, g_wp, side.ptr)
            emit("grad_proj_weight", g_wp, side.ptr)
        mark("gemm_grad_proj_weight")

    if plan.dense:
        o, (gqkv, gqkvt), part = dense.attention_core(P, cos, sin, varlen.runs, rows, t, h, nh, d, scaling, plan,
                                                      bufs, s, mark, o_t=kmajor, gqkv_t=kmajor or nt or fast16,
                                                      after_fwd=grad_proj_weight, in_place=dense_in_place,
                                                      v_bias=qkv_bias[2 * h:])
        del dense_in_place
    else:
        o, (gqkv, gqkvt), part = attention_core(P, cos, sin, dO, tiles, varlen.ntiles, t, h, nh, d, scaling, plan,
                                                bufs, s, mark, o_t=kmajor, gqkv_t=kmajor or nt or fast16,
                                                after_fwd=grad_proj_weight,
                                                dq_stores=hopper.first_tile_stores(varlen, plan),
                                                fwd_tail=hopper.forward_tail(varlen.table, nh, plan))
    del P, dO

    def grad_qkv_bias():  # from the attention kernels' per-tile partials
        K.colsum_finish(part, g_bqkv, s)
        emit("grad_qkv_bias", g_bqkv, s)
        mark("bias_sums")

    side.fork()  # grad_qkv is complete: grad_qkv_weight on the side stream, grad_hidden on s

    def grad_hidden():
        if nt or fast16:  # from grad_qkv^T (fp32)
            gemm(gqkvt[:, :t], wqkv_op, g_hidden, trans_a=True, trans_b=False, precision=label, stream=s)
        else:
            gemm(gqkv, wqkv_op, g_hidden, trans_a=False, trans_b=False, precision=label, stream=s)
        emit("grad_hidden_states", g_hidden, s)
        mark("gemm_grad_hidden")

    def grad_qkv_weight(a, b, blocks=1):  # a: grad_qkv, or (kmajor, fast16) grad_qkv^T
        def product(rows):
            if fast16:  # grad_qkv^T X: both fp32 as stored
                gemm(a[rows, :t], b, g_wqkv[rows], trans_a=False, trans_b=False, precision=label, stream=side.ptr)
            else:
                over_tokens(a[rows] if kmajor else a[:, rows], b, g_wqkv[rows], side.ptr)

        with side.ctx:
            if b is None:  # kmajor: X^T
                b = K.transpose(hidden_states, side.ptr, pad=True)
                mark("transpose")
            if blocks == 1:
                product(slice(None))
                emit("grad_qkv_weight", g_wqkv, side.ptr)
            else:  # the q, k and v row blocks one after another, each reported as soon as it is enqueued
                for i in range(blocks):
                    rows = slice(i * h, (i + 1) * h)
                    product(rows)
                    emit(f"grad_qkv_weight[{i}]", g_wqkv[rows], side.ptr)
        mark("gemm_grad_qkv_weight")

    transposed = kmajor or fast16  # grad_qkv_weight from grad_qkv^T
    if emit is _none:
        grad_hidden()
        grad_qkv_bias()  # after grad_hidden's product, not in front of it: off the path to the call's end
        if nt:
            del gqkvt  # read on s only
        a = gqkvt if transposed else gqkv
        if transposed:
            del gqkv  # kmajor: read only by grad_hidden on s (queued); on one stream its memory serves X^T
        grad_qkv_weight(a, None if kmajor else x_op)
    else:
        # A caller that sends the gradients away as they are done (data parallel): grad_qkv_weight, the largest,
        # first and in its three row blocks (reported as "grad_qkv_weight[0]" .. "[2]"), so that each block's
        # transfer runs beside the next block's product and grad_hidden_states instead of after them;
        # grad_qkv_bias before them all (the order the buckets are issued in).
        grad_qkv_bias()
        grad_qkv_weight(gqkvt if transposed else gqkv, None if kmajor else x_op, blocks=3)
        grad_hidden()
    side.join()
    # Arrays read on the side stream (o, x_op, gqkv, ...) are released only here, after the join: memory freed
    # earlier could be handed to a later allocation on s while the side stream still reads it.


def attention_core(P, cos, sin, dO, tiles, ntiles, t, h, nh, d, scaling, plan, bufs, stream, mark,
                   o_t=False, gqkv_t=False, after_fwd=None, dq_stores=False, fwd_tail=(0, 1), stats=None):
    """Run the attention kernels. Returns (O, (grad_qkv, grad_qkv^T or None), bias partials) with O and grad_qkv as
    GEMM operands in the mode's operand type; with ``o_t``, O as fp32 O^T [H, padded(T)] instead; with ``gqkv_t``,
    grad_qkv^T [3H, padded(T)] (fp32, pad zeroed) as well. ``after_fwd(O)`` is called once O is enqueued, before
    the dK/dV kernel. With ``plan.dq_partials`` (``plan.dq_ordered``), dQ comes from the dK/dV kernel's partials
    (its shares added in key-tile order) and their reduction.
    ``dq_stores``: the sm_90a tf32 backward's first key tiles store their dQ shares (hopper.first_tile_stores),
    so its accumulator is not zeroed. ``fwd_tail``: the sm_90a tf32 forward's last-wave split
    (hopper.forward_tail). ``stats``: the forward's ``(o, lse)`` as given ([T, H] fp32 or bf16, and the natural
    log-sum-exp [NH, T]; the varlen API's backward on the mma.sync kernels): the kernels' lse2 and delta come from
    them (``attn_delta``), the forward pass is not run again, and no O is returned (None)."""
    import cupy

    if plan.hopper and stats is not None:
        raise ValueError("attention_core: stats are for the mma.sync kernels; the sm_90a ones read o and lse "
                         "through their own delta pass")
    if plan.hopper:
        return _attention_core_sm90(P, cos, sin, dO, tiles, ntiles, t, h, nh, d, scaling, plan, bufs, stream, mark,
                                    o_t, gqkv_t, after_fwd, dq_stores, fwd_tail)
    precision = plan.precision
    dq_parts = plan.dq_partials or int(plan.dq_ordered)  # dQ slots of the dK/dV kernel (ordered: one sum)
    tp = K.padded(t)
    o = None if o_t or stats is not None else bufs.empty((t, h))
    ot = cupy.empty((h, tp), np.float32) if o_t and stats is None else None
    gqkv = bufs.empty((t, 3 * h))
    gqkvt = cupy.empty((3 * h, tp), np.float32) if gqkv_t else None
    lse = cupy.empty((nh, t), dtype=np.float32)
    delta = cupy.empty((nh, t), dtype=np.float32)
    part = cupy.empty((ntiles, 3 * h), dtype=np.float32)
    ptr = lambda a: 0 if a is None else a.data.ptr  # noqa: E731
    tail = (t, tp, h, float(scaling * K.LOG2E), float(scaling))
    grid = (ntiles, nh, 1)
    # the ordered adds' counts: zeroed by the delta pass where there is one (the varlen API's), else by a memset
    sem = None
    if plan.dq_ordered:
        sem = cupy.empty((nh, t), np.int32) if stats is not None else cupy.zeros((nh, t), np.int32)
    if stats is not None:
        o_given, lse_given = stats
        K.delta(o_given, P[3], t * P.shape[-1], delta, lse_given, lse, t, nh, d, precision, stream, sem=sem)
        if not dq_parts:
            K.launch("dq", precision, d, grid, (P.data.ptr, cos.data.ptr, sin.data.ptr, tiles.data.ptr,
                                                lse.data.ptr, delta.data.ptr, gqkv.data.ptr, ptr(gqkvt),
                                                part.data.ptr) + tail, stream)
    else:
        K.launch("fwd_stats" if dq_parts else "fwd_dq", precision, d, grid,
                 (P.data.ptr, cos.data.ptr, sin.data.ptr, dO.data.ptr, tiles.data.ptr, ptr(o), ptr(ot),
                  lse.data.ptr, delta.data.ptr, gqkv.data.ptr, ptr(gqkvt), part.data.ptr) + tail, stream)
    mark("attn_fwd_dq")
    if after_fwd is not None:
        after_fwd(ot if o_t else o)
    common = (P.data.ptr, cos.data.ptr, sin.data.ptr, tiles.data.ptr, lse.data.ptr, delta.data.ptr, gqkv.data.ptr,
              ptr(gqkvt), part.data.ptr)
    if dq_parts:
        dqp = cupy.empty((dq_parts, t, h), np.float32)
        K.launch("dkdv_dqp", precision, d, grid, common + (dqp.data.ptr, ptr(sem)) + tail, stream)
        mark("attn_dkdv")
        K.launch("dq_reduce", precision, d, grid, (dqp.data.ptr, cos.data.ptr, sin.data.ptr, tiles.data.ptr,
                                                   gqkv.data.ptr, ptr(gqkvt), part.data.ptr, t, tp, h, dq_parts),
                 stream)
        mark("attn_dq_reduce")
    else:
        K.launch("dkdv", precision, d, grid, common + tail, stream)
        mark("attn_dkdv")
    return (ot if o_t else o), (gqkv, gqkvt), part


def _attention_core_sm90(P, cos, sin, dO, tiles, ntiles, t, h, nh, d, scaling, plan, bufs, stream, mark, o_t,
                         gqkv_t, after_fwd, dq_stores, fwd_tail):
    """attention_core on the sm_90a kernels: O and grad_qkv as GEMM operands (bf16, or fp32 in tf32, where
    ``o_t`` gives O^T by a transpose of O; the tf32 backward writes two bias partial rows per tile). ``P``: the
    packed operands, or (bf16, ``plan.in_place``) the bf16 triple (q and k [T, 2H], v [T, H], dO [T, H])."""
    import cupy

    tf32 = plan.precision == Precision.TF32
    in_place = isinstance(P, tuple)
    tp = K.padded(t)
    o = bufs.empty((t, h))
    gqkv = bufs.empty((t, 3 * h))
    gqkvt = cupy.empty((3 * h, tp), np.float32) if gqkv_t else None
    lse = cupy.empty((nh, t), dtype=np.float32)
    delta = cupy.empty((nh, t), dtype=np.float32)
    part = cupy.empty(((2 if tf32 else 1) * ntiles, 3 * h), dtype=np.float32)
    sem = cupy.empty((nh, t), np.int32)  # the ordered dQ sum's counts, zeroed with delta
    if tf32:
        hopper.forward_tf32(P, tiles, ntiles, o, h, lse, t, nh, d, scaling * K.LOG2E, stream,
                            specialised=plan.fwd_specialised, tail=fwd_tail)
    else:
        fwd_maps = (hopper.in_place_maps(P[0], P[1], None, t, nh, d, "fwd", keys=plan.fwd_keys) if in_place
                    else hopper.packed_maps(P, t, nh, d, "fwd", keys=plan.fwd_keys)[:3])
        # delta from the bf16 dO, the values dP = dO V^T is made of (as the mma.sync forward does): in place
        # ([T, H]) or packed ([NH][T][D']); in the forward's epilogue (plan.fwd_delta) or a pass after it
        dk = d if in_place else P.shape[-1]
        dlt = (P[2], h, d, delta, sem) if in_place else (P[3], dk, t * dk, delta, sem)
        hopper.forward(fwd_maps, tiles, ntiles, o, h, lse, t, nh, d, scaling * K.LOG2E, stream,
                       specialised=plan.fwd_specialised, keys=plan.fwd_keys, persistent=plan.fwd_persistent,
                       delta=dlt if plan.fwd_delta else None, o_bulk=plan.fwd_o_bulk)
    mark("attn_fwd")
    ot = K.transpose(o, stream, pad=True) if o_t else None
    if after_fwd is not None:
        after_fwd(ot if o_t else o)
    if tf32:
        hopper.delta(o, h, dO, h, delta, t, nh, d, stream, sem=sem)
    elif not plan.fwd_delta:
        do, ldg, hs = dlt[:3]
        hopper.delta(o, h, do, ldg, delta, t, nh, d, stream, head_stride=hs, sem=sem)
    if o_t:
        del o  # read only by delta (stream order): its memory serves the backward's buffers
    dqacc = hopper.dq_accumulator_tf32(t, nh, d, not dq_stores) if tf32 else cupy.empty((nh, t, d), np.float32)
    g, es = gqkv.data.ptr, gqkv.itemsize
    args = (tiles, ntiles, lse, delta, dqacc, sem, g, g + h * es, g + 2 * h * es, 3 * h, cos, sin, part, gqkvt, tp,
            t, nh, d, scaling, stream)
    if tf32:
        hopper.backward_tf32(P, *args, block=True, specialised=plan.specialised, order=plan.head_group,
                             stages=plan.stages, first_stores=dq_stores)
    else:
        bwd_maps = (hopper.in_place_maps(*P, t, nh, d, "bwd", plan.query_rows) if in_place
                    else hopper.packed_maps(P, t, nh, d, "bwd", plan.query_rows))
        hopper.backward(bwd_maps, *args, block=True,
                        order=plan.head_group, specialised=plan.specialised, tail_parts=plan.tail_parts,
                        query_rows=plan.query_rows)
    mark("attn_dkdv")
    return (ot if o_t else o), (gqkv, gqkvt), part


def forward(hidden_states, qkv_weight, qkv_bias, proj_weight, proj_bias, cos, sin, varlen, nh, scaling, plan,
            s: int, out) -> None:
    """Enqueue the block's forward on stream ``s`` into ``out`` [T, H] (fp32; T > 0)."""
    import cupy

    t, h = hidden_states.shape
    d, precision = plan.head_dim, plan.precision
    bufs = K.Buffers(precision, s)
    tiles = varlen.device_table(s)
    # bf16 without plan.cast_operands: the QKV product reads X and Wqkv as stored (no casts before it). The
    # projection meets the kernel's bf16 O, so Wp is cast in both cases (just before its product).
    if precision.label == "bf16" and not plan.cast_operands:
        x_op, wqkv_op = hidden_states, qkv_weight
    else:
        x_op, wqkv_op = bufs.operands(hidden_states, qkv_weight)
    qkv = cupy.empty((t, 3 * h), np.float32)
    gemm(x_op, wqkv_op, qkv, trans_a=False, trans_b=True, precision=precision.label, stream=s)
    del x_op, wqkv_op
    P = K.prepare(qkv, qkv_bias, cos, sin, None, t, h, nh, d, precision, s)
    del qkv
    o = bufs.empty((t, h))
    K.launch("fwd", precision, d, (varlen.ntiles, nh, 1),
             (P.data.ptr, tiles.data.ptr, o.data.ptr, 0, t, h, float(scaling * K.LOG2E)), s)
    del P
    wp_op = bufs.operand(proj_weight)
    gemm(o, wp_op, out, trans_a=False, trans_b=True, precision=precision.label, stream=s, bias=proj_bias)
