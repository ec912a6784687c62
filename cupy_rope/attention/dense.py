"""The dense form of the block's attention core, for short sequences (fp32 and tf32): the six L x L products of
the forward and backward as batched cuBLAS products over stored scores, one batch entry per (sequence, head) of
each run of equal-length sequences, and three kernels between them (kernels_cu/attention/dense.cuh):

    S = Q K^T, dP = dO V^T -> P = softmax(scaling S), dS = scaling P (dP - rowsum(P dP))   (one pass)
    O = P V, dV = P^T dO, dK = dS^T Q, dQ = dS K

then the dense rows go back to token order with the RoPE backward and the bias gradients' column sums
(dense_scatter). The flash kernels (:mod:`.kernels`) do the same work in registers, on FFMA (fp32) or mma.sync
(tf32) tiles; on sequences of a few hundred tokens the batched products (cuBLAS SGEMM, or TF32 tensor cores) run
them faster than those tiles, and the scores of one sequence and head are at most 256 x 256 floats (256 KB).

Memory: the operands are packed as for the flash kernels (the same NH * T rows, another order), plus two score
buffers of NH * sum(L^2) floats and the dense O and gradients (4 T H floats). With every sequence at most
``DENSE_MAX_LEN`` = 256 tokens, a score buffer holds at most 256 NH T floats: twice T * H at D = 128, so the
whole stays O(T H). Deterministic: cuBLAS's batched kernels and these kernels add in a fixed order.
"""
from __future__ import annotations

import numpy as np

from .._cublas import gemm_batched, gemm_strided_batched
from . import kernels as K

DENSE_MAX_LEN = 256  # DENSE_MAX_LEN in kernels_cu/attention/dense.cuh: a score row is at most 8 floats a lane
SCATTER_ROWS = 64  # DENSE_ROWS there: tokens per block of dense_scatter (one row of bias partial sums each)


# The O product writes each entry's block of O^T at its sequence's first token: cuBLAS's TF32 products on pointer
# arrays need each pointer 16-byte aligned (they cannot see the pointers to check them), so that form is taken
# only when every sequence starts at a multiple of 4 tokens (11 of the 16 seed workloads, all from 1024 tokens
# up); else O is scattered into O^T (with V's bias) by dense_scatter.
O_T_ALIGN = 4


def o_t_width(t: int) -> int:
    """Row length of the O^T the dense form's O product writes (in place, K-major weight gradients): the tokens
    and one column for V's bias, rounded up as :func:`.kernels.padded` rounds."""
    return K.padded(t + 1)


def scatter_chunks(t: int) -> int:
    """Rows of the bias partial sums dense_scatter writes for ``t`` tokens."""
    return (t + SCATTER_ROWS - 1) // SCATTER_ROWS


class Dense:
    """One call's dense products and kernels on stream ``stream``. ``P``: the operands packed in the dense order
    (:func:`.kernels.prepare` with ``rows``, the device copy of ``Varlen.dense_rows(nh)``: q', k', v and, for the
    backward, dO); ``runs``: ``Varlen.runs``.

    In place (``in_place``: (qkv, dO, offsets, o_ld), the block's fp32 products [T, 3H] and [T, H], the device copy
    of ``Varlen.dense_pointer_offsets(nh, d, o_ld)`` and the row length of O^T those offsets address, or 0):
    ``P`` holds q' and k' alone, and the three products that read V or dO (dP = dO V^T, O = P V, dV = P^T dO)
    read them where their products left them, through pointer arrays
    (``cublasGemmBatchedEx``; the arrays made by one launch per call). V is then without its bias: rows of P sum
    to one, so O = P (V + b) = P V + b, which the caller adds where O is scattered, and dS = P (dP - rowsum(P dP))
    is the same with or without it (the bias adds dO_i . b to every element of dP's row i, and as much to its
    rowsum).

    In place with ``ot`` (fp32 [H, o_ld], o_ld > T, as the offsets were made): the O product writes O^T
    there itself, in the layout the K-major weight gradient reads, and no dense O is made; ``ot``'s column T
    holds V's bias ``v_bias`` and the columns after it zeros (written by the pointer launch), so that the caller's
    product dY^T O contracting over W columns, with dY's column sums in dY^T's column T, is dY^T (O + 1 b^T)."""

    def __init__(self, P, runs, rows, t, nh, d, scaling, precision, stream, in_place=None, ot=None, v_bias=None):
        import cupy

        self.P, self.runs, self.rows = P, runs, rows
        self.t, self.nh, self.d, self.scaling, self.precision, self.stream = t, nh, d, scaling, precision, stream
        self.dk = P.shape[-1]
        total = sum(n * length * length for _, n, length in runs) * nh
        self.S = cupy.empty((total,), np.float32)  # scores, then (backward) probabilities
        self.Pm = cupy.empty((total,), np.float32)  # probabilities, or (backward) dP, then dS
        self.probabilities = self.Pm
        self.op = [P.data.ptr + i * nh * t * self.dk * 4 for i in range(P.shape[0])]  # q', k'[, v[, dO]]
        self.in_place, self.ptrs, self._sources, self.ot = in_place is not None, None, None, ot
        o_ld = in_place[3] if self.in_place else 0
        if (ot is not None or o_ld) and (ot is None or v_bias is None or ot.shape[1] != o_ld or o_ld <= t):
            raise ValueError(f"Dense: O^T from the product needs offsets made for its row length ({o_ld}), V's "
                             "bias and a pad column")
        # the dense O (made here: the pointer arrays address it), unless O^T is written where the caller wants it
        self.od = cupy.empty((nh * t, d), np.float32) if ot is None else None
        if self.in_place:
            qkv, dO, offsets, _ = in_place
            self._sources = (qkv, dO)  # read by the products enqueued later: kept until release()
            entries = offsets.size // 6
            self.ptrs = cupy.empty((6, entries), np.uint64)  # V, dO, S, Pm, O, dV: see dense_pointers
            self.grads = cupy.empty((3, nh * t, d), np.float32)
            o = self.od if ot is None else ot
            bases = (qkv.data.ptr + 8 * nh * d, dO.data.ptr, self.S.data.ptr, self.Pm.data.ptr, o.data.ptr,
                     self.grads.data.ptr + 2 * nh * t * d * 4)
            pad = (0, 0, t, nh * d, 0) if ot is None else (ot.data.ptr, ot.shape[1], t, nh * d, v_bias.data.ptr)
            work = max(6 * entries, nh * d * (ot.shape[1] - t) if ot is not None else 0)
            if work:
                K.launch("dense_pointers", precision, d, (min((work + 255) // 256, 1024), 1, 1),
                         (offsets.data.ptr, entries, self.ptrs.data.ptr) + bases + pad, stream)
            self.entry0 = []  # each run's first entry
            e = 0
            for _, n, _ in runs:
                self.entry0.append(e)
                e += n * nh
            self.ld_v, self.ld_do = 3 * nh * d, nh * d

    def _arrays(self, kind: int, run: int) -> int:
        """Device address of the pointer array of ``kind`` (0 V, 1 dO, 2 S, 3 Pm, 4 O, 5 dV) for run ``run``."""
        return self.ptrs.data.ptr + (kind * self.ptrs.shape[1] + self.entry0[run]) * 8

    def _batched(self, m, n, k, a, lda, ta, b, ldb, tb, c, ldc, count):
        gemm_batched(m, n, k, a, lda, ta, b, ldb, tb, c, ldc, count, precision=self.precision.label,
                     stream=self.stream)

    def _each_run(self, fn):
        """fn(first dense row, batch entries, length, first score (floats), first token, run index) for every
        run."""
        off = 0
        for i, (t0, n, length) in enumerate(self.runs):
            fn(self.nh * t0, n * self.nh, length, off, t0, i)
            off += n * self.nh * length * length

    def _product(self, m, n, k, a, lda, sa, ta, b, ldb, sb, tb, c, ldc, sc, count):
        gemm_strided_batched(m, n, k, a, lda, sa, ta, b, ldb, sb, tb, c, ldc, sc, count,
                             precision=self.precision.label, stream=self.stream)

    def scores(self, lse=None, lse_scale=1.0):
        """S and P (with ``lse`` [NH, T], the log-sum-exp times ``lse_scale``, if given): the forward's."""
        d, dk, S, Pm = self.d, self.dk, self.S, self.Pm
        q0, k0 = self.op[:2]

        def run(r0, n, length, off, t0, i):
            op, sc = r0 * dk * 4, off * 4
            self._product(length, length, d, q0 + op, dk, length * dk, False, k0 + op, dk, length * dk, True,
                          S.data.ptr + sc, length, length * length, n)
            K.launch("dense_softmax", self.precision, d, ((n * length + 7) // 8, 1, 1),
                     (S.data.ptr + sc, Pm.data.ptr + sc, n * length, length, float(self.scaling * K.LOG2E),
                      0 if lse is None else lse.data.ptr, float(lse_scale), t0, self.nh, self.t), self.stream)

        self._each_run(run)

    def scores_and_gradients(self):
        """S and dP = dO V^T, then one pass making P (in S's place) and dS (in dP's): the backward's, which needs
        no forward before it (dO is at hand)."""
        d, dk, S, dP = self.d, self.dk, self.S, self.Pm
        q0, k0 = self.op[:2]

        def run(r0, n, length, off, t0, i):
            op, sc, ss, sop = r0 * dk * 4, off * 4, length * length, length * dk
            self._product(length, length, d, q0 + op, dk, sop, False, k0 + op, dk, sop, True, S.data.ptr + sc,
                          length, ss, n)
            if self.in_place:
                self._batched(length, length, d, self._arrays(1, i), self.ld_do, False, self._arrays(0, i), self.ld_v,
                              True, self._arrays(3, i), length, n)
            else:
                v0, do0 = self.op[2:]
                self._product(length, length, d, do0 + op, dk, sop, False, v0 + op, dk, sop, True, dP.data.ptr + sc,
                              length, ss, n)
            K.launch("dense_softmax_dscores", self.precision, d, ((n * length + 7) // 8, 1, 1),
                     (S.data.ptr + sc, dP.data.ptr + sc, n * length, length, float(self.scaling * K.LOG2E),
                      float(self.scaling)), self.stream)

        self._each_run(run)
        self.probabilities, self.dscores = S, dP

    def output(self):
        """The dense O [NH T, D] = P V (after :meth:`scores` or :meth:`scores_and_gradients`; in place, without V's
        bias and only after :meth:`scores_and_gradients`, whose S buffer then holds P); with ``ot``, O^T written
        there (returned)."""
        d, dk = self.d, self.dk
        P, od = self.probabilities, self.od
        if self.in_place and P is not self.S:
            raise RuntimeError("Dense.output in place reads P from S's buffer: call scores_and_gradients first")
        self.od = None  # the caller's from here on (its scatter reads it): not held to the end of the call

        def run(r0, n, length, off, t0, i):
            if self.ot is not None:  # O^T = V^T P^T, each entry's D x L block at its rows and tokens
                self._batched(d, length, length, self._arrays(0, i), self.ld_v, True, self._arrays(2, i), length,
                              True, self._arrays(4, i), self.ot.shape[1], n)
            elif self.in_place:
                self._batched(length, d, length, self._arrays(2, i), length, False, self._arrays(0, i), self.ld_v,
                              False, self._arrays(4, i), d, n)
            else:
                self._product(length, d, length, P.data.ptr + off * 4, length, length * length, False,
                              self.op[2] + r0 * dk * 4, dk, length * dk, False, od.data.ptr + r0 * d * 4, d,
                              length * d, n)

        self._each_run(run)
        return od if self.ot is None else self.ot

    def gradients(self):
        """The dense gradients [3, NH T, D] (dq', dk', dv; returned) after :meth:`scores_and_gradients`."""
        import cupy

        d, dk, P, dS = self.d, self.dk, self.probabilities, self.dscores
        q0, k0 = self.op[:2]
        grads = self.grads if self.in_place else cupy.empty((3, self.nh * self.t, d), np.float32)
        gq, gk, gv = (grads.data.ptr + i * self.nh * self.t * d * 4 for i in range(3))

        def run(r0, n, length, off, t0, i):
            op, sc, gr = r0 * dk * 4, off * 4, r0 * d * 4
            ss, sop, sg = length * length, length * dk, length * d
            if self.in_place:  # P is in S's buffer (scores_and_gradients)
                self._batched(length, d, length, self._arrays(2, i), length, True, self._arrays(1, i), self.ld_do,
                              False, self._arrays(5, i), d, n)
            else:
                self._product(length, d, length, P.data.ptr + sc, length, ss, True, self.op[3] + op, dk, sop, False,
                              gv + gr, d, sg, n)
            self._product(length, d, length, dS.data.ptr + sc, length, ss, True, q0 + op, dk, sop, False,
                          gk + gr, d, sg, n)
            self._product(length, d, length, dS.data.ptr + sc, length, ss, False, k0 + op, dk, sop, False,
                          gq + gr, d, sg, n)

        self._each_run(run)
        return grads

    def release(self):
        """Drop the score buffers (stream-ordered: later work on the stream may take their memory)."""
        self.S = self.Pm = self.probabilities = self.dscores = self.od = self.grads = self.ptrs = self.ot = None
        self._sources = None

    def scatter(self, src, slices, rope_slices=0, cos=None, sin=None, out=None, out_ld=0, out_t=None, part=None,
                bias=None):
        """dense_scatter of ``slices`` operands of ``src`` [slices, NH T, D] back to token order (see the kernel)."""
        ptr = lambda a: 0 if a is None else a.data.ptr  # noqa: E731
        K.launch("dense_scatter", self.precision, self.d, (max(1, scatter_chunks(self.t)), slices * self.nh, 1),
                 (src.data.ptr, self.rows.data.ptr, ptr(cos), ptr(sin), ptr(bias), rope_slices, ptr(out), out_ld,
                  ptr(out_t), K.padded(self.t), ptr(part), self.t, self.nh), self.stream)


def attention_core(P, cos, sin, runs, rows, t, h, nh, d, scaling, plan, bufs, stream, mark, o_t=False,
                   gqkv_t=False, after_fwd=None, in_place=None, v_bias=None):
    """:func:`.schedule.attention_core` in the dense form (``P``, ``runs``, ``rows``, ``in_place``: see
    :class:`Dense`; ``v_bias``: V's bias [H], added to O when in place). Returns (O, (grad_qkv, grad_qkv^T or
    None), bias partials) as the flash core does. Where ``in_place``'s o_ld is not 0 (``o_t``, every sequence
    starting at a multiple of O_T_ALIGN tokens: the caller's choice), the O product writes O^T [H, o_ld] itself,
    V's bias in its column T (:class:`Dense`), and ``after_fwd(O^T, bias_column=True)`` is called: the caller's
    dY^T then holds dY's column sums in its column T."""
    import cupy

    f32 = np.float32
    tp = K.padded(t)
    direct = in_place is not None and in_place[3] > 0  # O^T from the product
    if direct and not o_t:
        raise ValueError("dense.attention_core: O^T from the product is the K-major layout's (o_t)")
    ot = cupy.empty((h, in_place[3]), f32) if direct else None
    dn = Dense(P, runs, rows, t, nh, d, scaling, plan.precision, stream, in_place=in_place, ot=ot,
               v_bias=v_bias if direct else None)
    dn.scores_and_gradients()
    od = dn.output()
    if not direct:
        o = None if o_t else bufs.empty((t, h))
        ot = cupy.empty((h, tp), f32) if o_t else None
        dn.scatter(od, 1, out=o, out_ld=h, out_t=ot, bias=v_bias if dn.in_place else None)
    del od
    mark("attn_fwd_dq")
    if after_fwd is not None:
        if direct:
            after_fwd(ot, bias_column=True)
        else:
            after_fwd(ot if o_t else o)
    grads = dn.gradients()
    dn.release()
    gqkv = bufs.empty((t, 3 * h))
    gqkvt = cupy.empty((3 * h, tp), f32) if gqkv_t else None
    part = cupy.empty((max(1, scatter_chunks(t)), 3 * h), f32)
    dn.scatter(grads, 3, rope_slices=2, cos=cos, sin=sin, out=gqkv, out_ld=3 * h, out_t=gqkvt, part=part)
    mark("attn_dkdv")
    return (ot if o_t else o), (gqkv, gqkvt), part
