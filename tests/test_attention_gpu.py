"""vision_attention_backward / vision_attention_forward on the GPU against float64 references.

Bounds, relative Frobenius error of every output vs float64: tf32 <= 5e-3, bf16 <= 2e-2, fp32 <= 1e-5.
The op allocates its outputs itself: the accuracy tests make them (and every scratch buffer) in NaN-poisoned
memory (``poisoned_allocations``), and NaN or inf anywhere counts as an infinite error. The long-sequence test
measures the default pool's peak, so its calls run on that pool, unpoisoned.

The float64 reference of cupy_rope.reference materialises [NH, L, L] per sequence; for the single 16384-token
sequence that would be 16 * 16384^2 * 8 bytes = 34 GB per temporary, so that case is checked against
``chunked_reference_backward`` below: the same float64 math, streamed over blocks of query rows (itself
checked against cupy_rope.reference on small cases, on the CPU and on the GPU).
"""
from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest

import cupy_rope as cr
from cupy_rope import reference as R
from cupy_rope import workloads as W

from tests.helpers import (BLOCK_ARGS, FWD_ARGS, OUTPUTS, PRECISIONS, TOL, assert_no_launch, block_args,
                           block_heads, make_block_inputs, poison, poisoned_allocations, reference_block_backward,
                           rel_err, same_bits, xp_of)

gpu = pytest.mark.gpu
ARGS = BLOCK_ARGS
make_inputs = make_block_inputs
args = block_args
heads = block_heads
reference_backward = reference_block_backward


def check_outputs(x, outs, precision, ref, what=""):
    t, h = x["hidden_states"].shape
    shapes = [(t, h), (3 * h, h), (3 * h,), (h, h), (h,)]
    assert len(outs) == 5
    for name, o, shape in zip(OUTPUTS, outs, shapes):
        assert o.shape == shape and o.dtype == np.float32 and o.flags.c_contiguous, (name, o.shape, o.dtype)
    errs = {name: rel_err(o, r) for name, o, r in zip(OUTPUTS, outs, ref)}
    bad = {k: v for k, v in errs.items() if not v <= TOL[precision]}
    pretty = ", ".join(f"{k} {v:.2e}" for k, v in errs.items())
    assert not bad, f"{what} [{precision}] over the {TOL[precision]:.0e} bound: {pretty}"
    return errs


def chunked_reference_backward(x, num_heads, scaling=None, chunk=1024):
    """The five gradients in float64 (NumPy or CuPy), never holding more than [NH, chunk, L] of the L x L
    matrices: pass 1 gives O and the log-sum-exp per block of query rows, pass 2 recomputes P per block and
    accumulates dK and dV over the blocks."""
    xp = xp_of(x["hidden_states"])

    def f(a):
        return xp.asarray(a, dtype=np.float64)

    dy, xs = f(x["grad_output"]), f(x["hidden_states"])
    wqkv, bqkv, wp = f(x["qkv_weight"]), f(x["qkv_bias"]), f(x["proj_weight"])
    c, s = f(x["cos"])[:, None, :], f(x["sin"])[:, None, :]
    cu = x["cu_seqlens"]
    cu = [int(v) for v in (cu.get() if hasattr(cu, "get") else np.asarray(cu))]
    t, hid = xs.shape
    nh = num_heads
    d = hid // nh
    h2 = d // 2
    scaling = d ** -0.5 if scaling is None else scaling

    def rot(z):
        return xp.concatenate([-z[..., h2:], z[..., :h2]], axis=-1)

    def rot_inv(z):
        return xp.concatenate([z[..., h2:], -z[..., :h2]], axis=-1)

    qkv = (xs @ wqkv.T + bqkv).reshape(t, 3, nh, d)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    qr, kr = q * c + rot(q) * s, k * c + rot(k) * s
    do = (dy @ wp).reshape(t, nh, d)
    o = xp.zeros((t, nh, d))
    dq, dk, dv = xp.zeros((t, nh, d)), xp.zeros((t, nh, d)), xp.zeros((t, nh, d))
    for a, b in zip(cu[:-1], cu[1:]):
        if b == a:
            continue
        kk, vv = kr[a:b].transpose(1, 0, 2), v[a:b].transpose(1, 0, 2)  # [NH, L, D]
        lse = xp.empty((nh, b - a, 1))
        blocks = [(c0, min(b, c0 + chunk)) for c0 in range(a, b, chunk)]
        for c0, c1 in blocks:
            sc = scaling * (qr[c0:c1].transpose(1, 0, 2) @ kk.transpose(0, 2, 1))  # [NH, C, L]
            m = sc.max(axis=-1, keepdims=True)
            e = xp.exp(sc - m)
            tot = e.sum(axis=-1, keepdims=True)
            o[c0:c1] = ((e @ vv) / tot).transpose(1, 0, 2)
            lse[:, c0 - a:c1 - a] = m + xp.log(tot)
            del sc, e
        dks, dvs = xp.zeros_like(kk), xp.zeros_like(vv)
        for c0, c1 in blocks:
            qq = qr[c0:c1].transpose(1, 0, 2)
            dob = do[c0:c1].transpose(1, 0, 2)
            ob = o[c0:c1].transpose(1, 0, 2)
            p = xp.exp(scaling * (qq @ kk.transpose(0, 2, 1)) - lse[:, c0 - a:c1 - a])
            dvs += p.transpose(0, 2, 1) @ dob
            dp = dob @ vv.transpose(0, 2, 1)
            ds = scaling * p * (dp - (dob * ob).sum(axis=-1, keepdims=True))
            del p, dp
            dq[c0:c1] = (ds @ kk).transpose(1, 0, 2)
            dks += ds.transpose(0, 2, 1) @ qq
            del ds
        dk[a:b] = dks.transpose(1, 0, 2)
        dv[a:b] = dvs.transpose(1, 0, 2)
    dq = dq * c + rot_inv(dq * s)
    dk = dk * c + rot_inv(dk * s)
    gqkv = xp.stack([dq, dk, dv], axis=1).reshape(t, 3 * hid)
    return gqkv @ wqkv, gqkv.T @ xs, gqkv.sum(axis=0), dy.T @ o.reshape(t, hid), dy.sum(axis=0)


def peak_extra_bytes(fn):
    """(fn(), the high-water mark of CuPy's pool during the call minus what was in use before it)."""
    import cupy

    pool = cupy.get_default_memory_pool()
    cupy.cuda.runtime.deviceSynchronize()
    base = pool.used_bytes()
    peak = [base]

    def tracking(size):
        mem = pool.malloc(size)
        peak[0] = max(peak[0], pool.used_bytes())
        return mem

    with cupy.cuda.using_allocator(tracking):
        out = fn()
        cupy.cuda.runtime.deviceSynchronize()
    return out, peak[0] - base


@pytest.fixture
def launch_counter():
    """Counts kernel launches and cuBLAS calls of this thread: errors must come from validation, before anything
    runs. ``no_launch()`` is the number made since the fixture was set up (or since the last reset)."""
    from cupy_rope import _cublas, _kernels

    class Counter:
        def __init__(self):
            self.reset()

        def reset(self):
            self.base = (_kernels.launches(), _cublas.calls())

        def __call__(self):
            return _kernels.launches() - self.base[0] + _cublas.calls() - self.base[1]

    return Counter()


# ---- the chunked float64 reference is the reference -------------------------------------------------

def test_chunked_reference_matches_reference_cpu():
    """CPU: the streamed float64 reference equals cupy_rope.reference (blocks of 2 query rows)."""
    rng = np.random.default_rng(11)
    t, hidden, d = 12, 16, 8
    x = dict(grad_output=rng.standard_normal((t, hidden)), hidden_states=rng.standard_normal((t, hidden)),
             qkv_weight=rng.standard_normal((3 * hidden, hidden)) * 0.3, qkv_bias=rng.standard_normal(3 * hidden),
             proj_weight=rng.standard_normal((hidden, hidden)) * 0.3, proj_bias=rng.standard_normal(hidden),
             cos=rng.standard_normal((t, d)), sin=rng.standard_normal((t, d)),
             cu_seqlens=np.array([0, 5, 5, 6, 12], np.int32))
    for scaling, chunk in ((None, 2), (0.4, 3), (0.4, 100)):
        got = chunked_reference_backward(x, 2, scaling, chunk=chunk)
        ref = R.vision_attention_backward(*args(x), scaling, num_heads=2)
        for name, g, r in zip(OUTPUTS, got, ref):
            assert rel_err(g, r) < 1e-13, name


@gpu
def test_chunked_reference_matches_reference_gpu(rng):
    cu = [0, 0, 1, 130, 300, 301]
    x = make_inputs(rng, cu, 1280, 80)
    got = chunked_reference_backward(x, 16, chunk=64)
    ref = reference_backward(x)
    for name, g, r in zip(OUTPUTS, got, ref):
        assert rel_err(g, r) < 1e-12, name


# ---- the 16 benchmark workloads ------------------------------------------------------------------------

SEED_CASES = [("tf32", i) for i in range(len(W.ATTN_CASES))] + \
             [(p, i) for p in ("fp32", "bf16") for i in (0, 3, 9, 12)]


@gpu
@pytest.mark.parametrize("precision,case", SEED_CASES,
                         ids=[f"{p}-T{W.ATTN_CASES[i][0]}-N{W.ATTN_CASES[i][1]}" for p, i in SEED_CASES])
def test_seed_workloads(precision, case, rng):
    t, n = W.ATTN_CASES[case]
    x = make_inputs(rng, W.even_cu_seqlens(t, n), W.ATTN_HIDDEN, W.ATTN_HEAD_DIM)
    with poisoned_allocations():
        outs = cr.vision_attention_backward(*args(x), precision=precision)
    check_outputs(x, outs, precision, reference_backward(x), f"T={t} N={n}")


# ---- special sequence layouts and head dims ----------------------------------------------------------

CONFIGS = [(1280, 80), (448, 64), (576, 72), (768, 96)]  # (hidden, head_dim): 16, 7, 8, 8 heads


def special_cu(kind, np_rng):
    if kind == "mixed":
        lens = [0, 1, 5, 0, 64, 65, 127]
    else:  # 120 tiny sequences of 0..4 tokens
        lens = np_rng.integers(0, 5, 120).tolist()
        lens[0] = 0
        lens[-1] = 3
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


@gpu
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("kind", ["mixed", "tiny"])
@pytest.mark.parametrize("hidden,head_dim", CONFIGS, ids=[f"H{h}-D{d}" for h, d in CONFIGS])
def test_special_sequences(hidden, head_dim, kind, precision, rng, np_rng):
    cu = special_cu(kind, np_rng)
    x = make_inputs(rng, cu, hidden, head_dim)
    with poisoned_allocations():
        outs = cr.vision_attention_backward(*args(x), precision=precision)
    check_outputs(x, outs, precision, reference_backward(x), f"{kind} sequences, H={hidden} D={head_dim}")
    again = cr.vision_attention_backward(*args(x), precision=precision)
    assert all(same_bits(a, b) for a, b in zip(outs, again)), "two runs differ"
    with poisoned_allocations():
        fo = cr.vision_attention_forward(*args(x, FWD_ARGS), precision=precision)
    fr = R.vision_attention_forward(*args(x, FWD_ARGS), num_heads=heads(x))
    err = rel_err(fo, fr)
    assert err <= TOL[precision], f"forward error {err:.2e}"


@gpu
@pytest.mark.parametrize("precision", PRECISIONS)
def test_scaling_num_heads_and_cu_seqlens_forms(precision, rng):
    """Explicit scaling and num_heads; cu_seqlens as cupy int32/int64 or numpy: same answer, bit for bit."""
    import cupy

    with poisoned_allocations():
        cu = [0, 70, 71, 200, 200, 333]
        x = make_inputs(rng, cu, 448, 64)
        scaling = 0.05
        outs = cr.vision_attention_backward(*args(x), 0.0, scaling, num_heads=7, precision=precision)
        check_outputs(x, outs, precision, reference_backward(x, scaling), "scaling=0.05")
        default = cr.vision_attention_backward(*args(x), precision=precision)
        # dq is proportional to the scale (dS = scaling * ...), so the q rows of grad_qkv_weight move by ~60%
        assert rel_err(default[1][:448], outs[1][:448]) > 0.1, "the scaling argument had no effect"
        for form in (cupy.asarray(cu, dtype=np.int64), np.asarray(cu, dtype=np.int32), np.asarray(cu, dtype=np.int64)):
            y = dict(x, cu_seqlens=form)
            other = cr.vision_attention_backward(*args(y), 0.0, scaling, num_heads=7, precision=precision)
            assert all(same_bits(a, b) for a, b in zip(outs, other)), type(form)
        fo = cr.vision_attention_forward(*args(x, FWD_ARGS), scaling, num_heads=7, precision=precision)
        fr = R.vision_attention_forward(*args(x, FWD_ARGS), scaling, num_heads=7)
        assert rel_err(fo, fr) <= TOL[precision]


# ---- determinism, streams, forward ----------------------------------------------------------------------

@gpu
@pytest.mark.parametrize("precision", PRECISIONS)
def test_two_runs_bit_identical(precision, rng):
    with poisoned_allocations():
        t, n = W.ATTN_CASES[5]
        x = make_inputs(rng, W.even_cu_seqlens(t, n), W.ATTN_HIDDEN, W.ATTN_HEAD_DIM)
        a = cr.vision_attention_backward(*args(x), precision=precision)
        b = cr.vision_attention_backward(*args(x), precision=precision)
        for name, u, v in zip(OUTPUTS, a, b):
            assert same_bits(u, v), f"{name} differs between two runs"
        check_outputs(x, a, precision, reference_backward(x))


@gpu
@pytest.mark.parametrize("stream", ["default", "side"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_handle_replay_is_the_same_computation(precision, stream, rng):
    """A per-layer handle runs its first call directly, records the second with the same buffers and replays it
    after: every replay gives the bits of the direct call, follows new contents of the same buffers, and other
    buffers are run directly (then recorded on their own repeat)."""
    import contextlib

    import cupy

    cu = np.asarray([0, 100, 100, 229], np.int32)  # three sequences, one of them empty
    x = make_inputs(rng, cu, 256, 64)
    ctx = cupy.cuda.Stream(non_blocking=True) if stream == "side" else contextlib.nullcontext()
    handle = cr.VisionAttentionBackward(cu, hidden_size=256, head_dim=64, precision=precision)
    block = args(x)[:-1]

    def run(arrays=block):
        with ctx:
            outs = handle(*arrays)
            return [o.get() for o in outs], tuple(o.data.ptr for o in outs)

    def direct():
        with ctx:
            return [o.get() for o in cr.vision_attention_backward(*args(x), precision=precision)]

    cupy.cuda.runtime.deviceSynchronize()  # inputs were made on the default stream
    expect = direct()
    runs = [run() for _ in range(4)]
    assert len({p for _, p in runs}) == 1, "the handle's outputs moved"
    assert handle.records == 1 and handle.replays == 3, repr(handle)
    for host, _ in runs:
        for name, u, v in zip(OUTPUTS, host, expect):
            assert np.array_equal(u.view(np.uint32), v.view(np.uint32)), f"{name}: handle differs from direct"
    # new contents in the same buffers: the replay reads them
    x["grad_output"][...] = rng.standard_normal(x["grad_output"].shape, dtype=np.float32)
    x["qkv_weight"] *= np.float32(1.5)
    cupy.cuda.runtime.deviceSynchronize()
    got, _ = run()
    assert handle.records == 1 and handle.replays == 4, "same buffers must replay, not record again"
    expect2 = direct()
    for name, u, v in zip(OUTPUTS, got, expect2):
        assert np.array_equal(u.view(np.uint32), v.view(np.uint32)), f"{name}: replay missed new contents"
    check_outputs(x, [cupy.asarray(a) for a in got], precision, reference_backward(x), "replayed")
    # other input buffers: run directly first, then recorded on their repeat
    other = [cupy.array(a, copy=True) for a in block]
    cupy.cuda.runtime.deviceSynchronize()
    got3, _ = run(other)
    assert handle.records == 1 and handle.replays == 4
    got4, _ = run(other)
    assert handle.records == 2 and handle.replays == 5
    for name, u, v in zip(OUTPUTS, got4, expect2):
        assert np.array_equal(u.view(np.uint32), v.view(np.uint32)), f"{name}: second recording differs"
    assert handle.graph_bytes > 0
    handle.close()
    assert handle.graph_bytes == 0
    with pytest.raises(ValueError, match="handle is for"):
        handle(*make_inputs_block(rng, [0, 10], 256, 64))
    with pytest.raises(TypeError, match="NumPy"):
        cr.VisionAttentionBackward(cupy.asarray(cu), hidden_size=256, head_dim=64)


def make_inputs_block(rng, cu, hidden, head_dim):
    return args(make_inputs(rng, cu, hidden, head_dim))[:-1]


@gpu
def test_non_default_stream(rng):
    import cupy

    x = make_inputs(rng, W.even_cu_seqlens(613, 4), W.ATTN_HIDDEN, W.ATTN_HEAD_DIM)
    cupy.cuda.runtime.deviceSynchronize()
    s = cupy.cuda.Stream(non_blocking=True)
    outs = cr.vision_attention_backward(*args(x), stream=s)
    fo = cr.vision_attention_forward(*args(x, FWD_ARGS), stream=s)
    s.synchronize()
    assert cupy.cuda.get_current_stream() != s
    check_outputs(x, outs, "tf32", reference_backward(x), "on a non-default stream")
    assert rel_err(fo, R.vision_attention_forward(*args(x, FWD_ARGS), num_heads=heads(x))) <= TOL["tf32"]


@gpu
@pytest.mark.parametrize("precision", PRECISIONS)
def test_side_stream_joins_the_callers_stream(precision, rng):
    """The products the backward runs on a second stream are joined back into the caller's stream: copies
    enqueued on that stream right after the call see every output complete, bit for bit the outputs of the
    same sequence issued on one stream; the same with the side stream started after the caller's casts
    (Plan.casts_first, bf16)."""
    import cupy

    x = make_inputs(rng, W.even_cu_seqlens(2048, 8), W.ATTN_HIDDEN, W.ATTN_HEAD_DIM)
    cupy.cuda.runtime.deviceSynchronize()
    s = cupy.cuda.Stream(non_blocking=True)
    got = {}
    forms = ((False, False), (True, False), (True, True))  # (two streams, casts first)
    for form in forms:
        plan = lambda p, f=form: dataclasses.replace(p, concurrent=f[0], casts_first=f[1])  # noqa: E731
        with s:
            outs = cr.vision_attention_backward(*args(x), precision=precision, plan=plan)
            got[form] = [o.copy() for o in outs]  # enqueued on s, behind the call
            del outs  # the next call's outputs must not reuse these buffers while the copies are pending
        s.synchronize()
    for name, one, two, first in zip(OUTPUTS, *(got[f] for f in forms)):
        assert same_bits(two, one), f"{name}: the two-stream call differs from the one-stream call"
        assert same_bits(first, one), f"{name}: the two-stream call with the casts first differs"
    check_outputs(x, got[(True, True)], precision, reference_backward(x), "two streams, casts first")


@gpu
@pytest.mark.parametrize("layout", ["plain", "nt", "nt+qkv"])
def test_fp32_operand_layouts(layout, rng, np_rng):
    """The fp32 backward's GEMM operand layouts (Plan.nt, Plan.nt_qkv) forced on and off at a token count that is
    not a multiple of the transposed copies' row padding: each is within the fp32 bound, twice the same bits."""
    with poisoned_allocations():
        def plan(p):
            return dataclasses.replace(p, nt=layout != "plain", nt_qkv=layout == "nt+qkv")

        x = make_inputs(rng, special_cu("mixed", np_rng), 448, 64)
        outs = cr.vision_attention_backward(*args(x), precision="fp32", plan=plan)
        again = cr.vision_attention_backward(*args(x), precision="fp32", plan=plan)
        check_outputs(x, outs, "fp32", reference_backward(x), f"fp32 layout {layout}")
        assert all(same_bits(a, b) for a, b in zip(outs, again)), "two runs differ"


@gpu
@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("rows,cols", [(131, 3584), (64, 64), (1, 8), (200, 72), (33, 6), (70, 130)])
def test_transpose(rows, cols, pad, rng):
    """kernels.transpose (the 16-byte kernel when both row lengths are multiples of 4, else the scalar one):
    exact, with the row padding zero-filled even where the pool held NaN before."""
    import cupy

    from cupy_rope.attention import kernels as K

    x = rng.standard_normal((rows, cols), dtype=np.float32)
    ld = K.padded(rows) if pad else rows
    junk = cupy.full((cols, ld), np.nan, np.float32)  # freed: the output is likely handed this memory
    del junk
    out = K.transpose(x, cupy.cuda.get_current_stream().ptr, pad=pad)
    assert out.shape == (cols, ld)
    assert bool(cupy.array_equal(out[:, :rows], x.T)), "transposed values differ"
    assert not bool(cupy.any(out[:, rows:])), "row padding not zero"


@gpu
@pytest.mark.parametrize("max_tiles,lens", [(0, [1, 129, 0, 300, 256, 77]), (2, [1, 129, 0, 256, 200, 77]),
                                            (3, [1, 129, 0, 300, 256, 77])])
def test_fp32_dq_partials(max_tiles, lens, rng):
    """fp32 dQ from the dK/dV kernel's per-key-tile partials (Plan.dq_partials), with sequences of 1, 2 and 3
    tiles and an empty one, against dQ from the forward kernel's second pass: both within the fp32 bound, twice
    the same bits."""
    from cupy_rope.attention import plan as P
    from cupy_rope.attention.varlen import Varlen

    with poisoned_allocations():
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        vl = Varlen(cu, int(cu[-1]))
        chosen = P.make_plan("fp32", head_dim=64, tokens=vl.tokens, max_tiles=vl.max_tiles)
        assert chosen.dq_partials == (vl.max_tiles if vl.max_tiles <= P.DQ_PARTIAL_MAX_TILES else 0)
        if max_tiles:
            assert vl.max_tiles == max_tiles  # the longest sequence has max_tiles tiles
        plan = dataclasses.replace(chosen, dq_partials=vl.max_tiles if max_tiles else 0, dq_ordered=False)
        x = make_inputs(rng, cu, 448, 64)
        outs = cr.vision_attention_backward(*args(x), precision="fp32", plan=plan)
        again = cr.vision_attention_backward(*args(x), precision="fp32", plan=plan)
        check_outputs(x, outs, "fp32", reference_backward(x), f"fp32 dQ partials up to {max_tiles} tiles")
        assert all(same_bits(a, b) for a, b in zip(outs, again)), "two runs differ"


@gpu
@pytest.mark.parametrize("hidden,head_dim,lens", [(448, 64, [1, 129, 0, 300, 640, 77]), (512, 128, [700, 3, 385]),
                                                  (448, 64, [1, 129, 0, 256, 200, 77])])
def test_fp32_dq_ordered(hidden, head_dim, lens, rng):
    """fp32 dQ added by the dK/dV kernel into one sum in key-tile order (Plan.dq_ordered; sequences of up to six
    tiles): within the fp32 bound, twice the same bits, and where every sequence fits the partials (two tiles) the
    same bits as their reduction, whose sums and order it keeps."""
    from cupy_rope.attention import plan as P
    from cupy_rope.attention.varlen import Varlen

    with poisoned_allocations():
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        vl = Varlen(cu, int(cu[-1]))
        chosen = P.make_plan("fp32", head_dim=head_dim, tokens=vl.tokens, max_tiles=vl.max_tiles)
        assert chosen.dq_ordered == (vl.max_tiles > P.DQ_PARTIAL_MAX_TILES)
        plan = dataclasses.replace(chosen, dq_partials=0, dq_ordered=True)
        x = make_inputs(rng, cu, hidden, head_dim)
        outs = cr.vision_attention_backward(*args(x), precision="fp32", plan=plan)
        again = cr.vision_attention_backward(*args(x), precision="fp32", plan=plan)
        check_outputs(x, outs, "fp32", reference_backward(x), f"fp32 dQ ordered, {vl.max_tiles} tiles")
        assert all(same_bits(a, b) for a, b in zip(outs, again)), "two runs differ"
        if vl.max_tiles <= P.DQ_PARTIAL_MAX_TILES:
            parts = dataclasses.replace(chosen, dq_partials=vl.max_tiles, dq_ordered=False)
            ref = cr.vision_attention_backward(*args(x), precision="fp32", plan=parts)
            assert all(same_bits(a, b) for a, b in zip(outs, ref)), "the ordered sum differs from the partials'"


# ---- the dense form (fp32 / tf32, sequences of at most 256 tokens) ---------------------------------------------

DENSE_CASES = [  # (hidden, head_dim, sequence lengths): one or two runs of a length, empty and one-token sequences
    (3584, 128, [131]),
    (448, 64, [256, 256, 256, 256]),
    (1280, 80, [0, 105, 105, 0, 104, 104, 104]),
    (576, 72, [1, 1, 256, 0]),
    (768, 96, [33, 33, 33, 33, 33, 7]),
]


@gpu
@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "packed"])
@pytest.mark.parametrize("precision", ["fp32", "tf32"])
@pytest.mark.parametrize("hidden,head_dim,lens", DENSE_CASES,
                         ids=[f"D{d}-{len(n)}seq" for _, d, n in DENSE_CASES])
def test_dense_form(hidden, head_dim, lens, precision, in_place, rng):
    """The dense form (forced where the library's plan does not take it), with V and dO read in place or packed:
    outputs within the bound, the same bits twice, and in agreement with the flash kernels' (the plan without it)
    to the mode's bound."""
    from cupy_rope.attention import api
    from cupy_rope.attention import plan as P
    from cupy_rope.attention.varlen import Varlen
    from cupy_rope.precision import Precision

    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    vl = Varlen(cu, int(cu[-1]))
    p = Precision.parse(precision)
    lib = api.choose_plan(p, head_dim, vl)
    assert lib.dense == (len(vl.runs) <= P.DENSE_MAX_RUNS[p] and vl.tokens >= P.DENSE_MIN_TOKENS[p])
    if in_place:  # the pointer-array products need cuBLAS itself; without it the block would pack V and dO
        from cupy_rope._cublas import capturable

        assert capturable(), "cuBLAS did not load directly: the in-place dense form would not run"
    x = make_inputs(rng, cu, hidden, head_dim)
    dense = lambda q: dataclasses.replace(q, dense=True, dense_in_place=in_place)  # noqa: E731
    with poisoned_allocations():  # every buffer NaN until written (O^T's pad columns, which the product reads)
        outs = cr.vision_attention_backward(*args(x), precision=precision, plan=dense)
    check_outputs(x, outs, precision, reference_backward(x), f"dense form, lengths {lens}")
    again = cr.vision_attention_backward(*args(x), precision=precision, plan=dense)
    assert all(same_bits(a, b) for a, b in zip(outs, again)), "two runs differ"
    flash = cr.vision_attention_backward(*args(x), precision=precision,
                                         plan=lambda q: dataclasses.replace(q, dense=False, dense_in_place=False))
    for name, a, b in zip(OUTPUTS, outs, flash):
        assert rel_err(a, b) <= TOL[precision], f"{name}: the dense form and the flash kernels disagree"


@gpu
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("case", [2, 10])
def test_forward_seed_workloads(case, precision, rng):
    t, n = W.ATTN_CASES[case]
    x = make_inputs(rng, W.even_cu_seqlens(t, n), W.ATTN_HIDDEN, W.ATTN_HEAD_DIM)
    with poisoned_allocations():
        fo = cr.vision_attention_forward(*args(x, FWD_ARGS), precision=precision)
    assert fo.shape == x["hidden_states"].shape and fo.dtype == np.float32
    err = rel_err(fo, R.vision_attention_forward(*args(x, FWD_ARGS), num_heads=W.ATTN_HEADS))
    assert err <= TOL[precision], f"forward [{precision}] error {err:.2e}"
    again = cr.vision_attention_forward(*args(x, FWD_ARGS), precision=precision)
    assert same_bits(fo, again)


@gpu
def test_no_tokens(rng):
    import cupy

    with poisoned_allocations():
        x = make_inputs(rng, [0, 0], 448, 64)
        outs = cr.vision_attention_backward(*args(x))
        assert outs[0].shape == (0, 448)
        for o in outs[1:]:
            assert o.size > 0 and not bool(cupy.any(o)), "gradients over no tokens must be zero"
        assert cr.vision_attention_forward(*args(x, FWD_ARGS)).shape == (0, 448)


# ---- long single sequence: memory O(T*H), never O(L^2) -------------------------------------------------

LONG_T, LONG_H, LONG_D = 16384, 1280, 80


def memory_bound(t, h, nh):
    """Allowed peak extra pool bytes of one backward, outputs included: 4 bytes x (18 T H + 8 H^2 + 4 NH T)
    + 64 MiB, i.e. O(T H + H^2). The op's own buffers (qkv, dO, the attention operands, O, grad_qkv and the
    transposed GEMM operands of the tf32 and fp32 paths; on sm_90a in tf32 also the transposed K, Q and dO tiles
    and the dQ accumulator) are a small multiple of T H floats, the weight gradients and transposed weights a few
    H^2. For T = 16384, H = 1280 the bound is 1.6 GB, while [NH, L, L] fp32 scores would be 16 * 16384^2 * 4 =
    17 GB; the doubling test below also catches a single head's L x L buffer."""
    return 4 * (18 * t * h + 8 * h * h + 4 * nh * t) + (64 << 20)


@gpu
def test_long_sequence_memory_and_accuracy(rng):
    nh = LONG_H // LONG_D
    peaks = {}
    for t in (LONG_T // 2, LONG_T):
        x = make_inputs(rng, [0, t], LONG_H, LONG_D)
        outs, peaks[t] = peak_extra_bytes(lambda: cr.vision_attention_backward(*args(x), precision="tf32"))
        bound = memory_bound(t, LONG_H, nh)
        assert peaks[t] <= bound, f"T={t}: peak extra memory {peaks[t] / 2**20:.0f} MiB > {bound / 2**20:.0f} MiB"
        if t != LONG_T:
            del x, outs
    # linear in T: doubling T at most about doubles the peak (an L x L buffer would make it ~4x)
    ratio = peaks[LONG_T] / peaks[LONG_T // 2]
    assert ratio <= 2.1, f"peak memory grew {ratio:.2f}x when T doubled: not O(T*H)"
    ref = chunked_reference_backward(x, nh, chunk=1024)
    check_outputs(x, outs, "tf32", ref, f"one sequence of {LONG_T} tokens")
    fp32, peak32 = peak_extra_bytes(lambda: cr.vision_attention_backward(*args(x), precision="fp32"))
    bound = memory_bound(LONG_T, LONG_H, nh)
    assert peak32 <= bound, f"fp32: peak extra memory {peak32 / 2**20:.0f} MiB > {bound / 2**20:.0f} MiB"
    for name, a, b in zip(OUTPUTS, outs, fp32):
        assert rel_err(a, b) <= TOL["tf32"], f"{name}: tf32 and fp32 disagree"
    check_outputs(x, fp32, "fp32", ref, f"one sequence of {LONG_T} tokens")


# ---- bad inputs: refused before any launch ------------------------------------------------------------

def _small(rng):
    return make_inputs(rng, [0, 30, 70], 448, 64)


def _bad_cases(x):
    import cupy

    t, h = x["hidden_states"].shape

    def f_order(a):
        return cupy.asfortranarray(a)  # same shape and values, not C-contiguous

    def offset(a):
        flat = cupy.empty(a.size + 1, np.float32)
        flat[1:] = a.ravel()
        return flat[1:].reshape(a.shape)  # C-contiguous, 4 bytes off 16-byte alignment

    return [
        (dict(cu_seqlens=cupy.asarray([1, 30, 70], np.int32)), {}, ValueError, "must start at 0"),
        (dict(cu_seqlens=cupy.asarray([0, 40, 30, 70], np.int32)), {}, ValueError, "non-decreasing"),
        (dict(cu_seqlens=cupy.asarray([0, 30, 69], np.int32)), {}, ValueError, "must end at the number of tokens 70"),
        (dict(cu_seqlens=cupy.asarray([0, 30, 71], np.int32)), {}, ValueError, "must end at the number of tokens 70"),
        (dict(cu_seqlens=cupy.asarray([0.0, 30.0, 70.0], np.float32)), {}, TypeError, "integer"),
        (dict(cu_seqlens=np.asarray([0.0, 30.0, 70.0])), {}, TypeError, "integer"),
        (dict(cu_seqlens=[0, 30, 70]), {}, TypeError, "cu_seqlens must be a cupy or numpy"),
        (dict(cu_seqlens=cupy.asarray([[0, 30, 70]], np.int32)), {}, ValueError, "1-D"),
        (dict(grad_output=x["grad_output"][:-1]), {}, ValueError, r"grad_output must have shape \(70, 448\)"),
        (dict(qkv_weight=x["qkv_weight"][:, :-1]), {}, ValueError, "qkv_weight must have shape"),
        (dict(qkv_weight=x["qkv_weight"][: 2 * h]), {}, ValueError, "qkv_weight must have shape"),
        (dict(qkv_bias=x["qkv_bias"][:-4]), {}, ValueError, "qkv_bias must have shape"),
        (dict(proj_weight=x["qkv_weight"][:h, :]), {}, None, None),  # right shape: a control, must pass
        ({}, dict(num_heads=2.9), TypeError, "num_heads"),
        ({}, dict(num_heads=True), TypeError, "num_heads"),
        (dict(proj_weight=x["qkv_weight"][: 2 * h, :]), {}, ValueError, "proj_weight must have shape"),
        (dict(proj_bias=x["proj_bias"][:-1]), {}, ValueError, "proj_bias must have shape"),
        (dict(cos=x["cos"][:-1]), {}, ValueError, "cos must have shape"),
        (dict(sin=x["sin"][:, :32]), {}, ValueError, "sin must have shape"),
        (dict(hidden_states=x["hidden_states"][None]), {}, ValueError, "hidden_states must be 2-D"),
        (dict(cos=x["cos"][:, :48], sin=x["sin"][:, :48]), {}, ValueError, "head_dim"),
        (dict(cos=x["cos"][:, 0]), {}, ValueError, "cos must be 2-D"),
        ({}, dict(num_heads=5), ValueError, "must equal num_heads"),
        (dict(hidden_states=f_order(x["hidden_states"])), {}, ValueError, "hidden_states must be C-contiguous"),
        (dict(qkv_weight=f_order(x["qkv_weight"])), {}, ValueError, "qkv_weight must be C-contiguous"),
        (dict(proj_weight=f_order(x["proj_weight"])), {}, ValueError, "proj_weight must be C-contiguous"),
        (dict(grad_output=f_order(x["grad_output"])), {}, ValueError, "grad_output must be C-contiguous"),
        (dict(cos=f_order(x["cos"])), {}, ValueError, "cos must be C-contiguous"),
        (dict(hidden_states=offset(x["hidden_states"])), {}, ValueError, "16-byte aligned"),
        (dict(qkv_bias=offset(x["qkv_bias"])), {}, ValueError, "16-byte aligned"),
        (dict(hidden_states=x["hidden_states"].astype(np.float64)), {}, TypeError, "float32"),
        (dict(qkv_weight=x["qkv_weight"].astype(np.float16)), {}, TypeError, "float32"),
        ({}, dict(precision="fp16"), ValueError, "precision must be one of"),
        ({}, dict(precision="TF32"), ValueError, "precision must be one of"),
        ({}, dict(attention_dropout=0.1), NotImplementedError, "attention_dropout"),
        ({}, dict(stream=1), TypeError, "stream must be a cupy.cuda.Stream"),
        ({}, dict(on_output="grads"), TypeError, "on_output must be a function"),  # the backward's only
        (dict(grad_output=None), {}, TypeError, r"grad_output must be a cupy\.ndarray"),  # the backward's only
        ({}, dict(scaling=float("nan")), ValueError, "scaling must be finite"),
        ({}, dict(scaling="0.125"), TypeError, "scaling must be a real number"),
        (dict(hidden_states=x["hidden_states"][:, :0]), {}, ValueError, "hidden size 0 must be a positive multiple"),
    ] + [(dict([(k, x[k].get())]), {}, TypeError, rf"cupy\.asarray\({k}\)") for k in ARGS[:-1]]


@gpu
def test_bad_inputs_backward(rng, launch_counter):
    no_launch = launch_counter
    x = _small(rng)
    checked = 0
    for change, kw, exc, match in _bad_cases(x):
        y = dict(x, **change)
        no_launch.reset()
        if exc is None:  # the control case: validation passes, so launches happen (the counter can count)
            cr.vision_attention_backward(*args(y), **kw)
            assert no_launch() > 0
            continue
        with pytest.raises(exc, match=match):
            cr.vision_attention_backward(*args(y), **kw)
        assert no_launch() == 0, f"{match}: launched before raising"
        checked += 1
    assert checked >= 40


@gpu
def test_bad_inputs_forward(rng, launch_counter):
    no_launch = launch_counter
    x = _small(rng)
    checked = 0
    for change, kw, exc, match in _bad_cases(x):
        if "grad_output" in change or "attention_dropout" in kw or "on_output" in kw or exc is None:
            continue
        y = dict(x, **change)
        no_launch.reset()
        pattern = (match.replace("hidden_states must be", "(hidden_states|grad_output) must be")
                   .replace(r"cupy\.asarray\(hidden_states\)", r"cupy\.asarray\((hidden_states|grad_output)\)"))
        with pytest.raises(exc, match=pattern):
            cr.vision_attention_forward(*args(y, FWD_ARGS), **kw)
        assert no_launch() == 0, f"{match}: launched before raising"
        checked += 1
    assert checked >= 35


@gpu
def test_inputs_not_modified(rng):
    import cupy

    x = make_inputs(rng, [0, 5, 100, 101], 576, 72)
    before = {k: cupy.array(v, copy=True) for k, v in x.items()}
    cr.vision_attention_backward(*args(x), precision="bf16")
    cr.vision_attention_forward(*args(x, FWD_ARGS), precision="bf16")
    for k in x:
        assert bool(cupy.array_equal(x[k], before[k])), f"{k} was modified"


@gpu
@pytest.mark.parametrize("gy", [1, 2, 3])
def test_util_kernels_grid_y_loop(gy, rng):
    """The transposes and column sums loop over grid rows (grid y is capped at 65535): any grid height gives
    the bits of one block row per tile."""
    import cupy

    from cupy_rope._kernels import launcher
    from cupy_rope.attention import kernels as K

    s = cupy.cuda.get_current_stream().ptr
    x = rng.standard_normal((1000, 96), dtype=np.float32)
    full = K.transpose(x, s, pad=True)  # ld 1024: 16 tiles of 64
    out = poison(full.shape)
    launcher("util", "transpose_f32_v4", "ppiii")(((96 + 63) // 64, gy, 1), (256, 1, 1),
                                                  (x.data.ptr, out.data.ptr, 1000, 96, 1024), s)
    assert same_bits(out, full)
    y = rng.standard_normal((1000, 70), dtype=np.float32)  # cols % 4 != 0: the scalar kernel
    full = K.transpose(y, s)
    out = poison(full.shape)
    launcher("util", "transpose_f32", "ppiii")(((70 + 31) // 32, gy, 1), (32, 8, 1),
                                               (y.data.ptr, out.data.ptr, 1000, 70, 1000), s)
    assert same_bits(out, full)
    part, ref = poison((4, 96)), poison((4, 96))  # 1000 rows: 4 chunks of 256
    lau = launcher("util", "colsum_partial", "ppiiqi")
    lau((3, 4, 1), (256, 1, 1), (x.data.ptr, ref.data.ptr, 1000, 96, 96, 256), s)
    lau((3, gy, 1), (256, 1, 1), (x.data.ptr, part.data.ptr, 1000, 96, 96, 256), s)
    assert same_bits(part, ref)
    # the transpose that also sums each 64-row tile's columns: the transpose's bits, partials within rounding of
    # float64 tile sums (zero for the pad tiles), the same bits for any grid height
    tcs = launcher("util", "transpose_colsum_f32_v4", "pppiii")
    width = 1028  # 17 tiles of 64, the last one pad only
    outs = []
    for g in (17, gy):
        out, parts = poison((96, width)), poison((17, 96))
        tcs(((96 + 63) // 64, g, 1), (256, 1, 1), (x.data.ptr, out.data.ptr, parts.data.ptr, 1000, 96, width), s)
        outs.append((out, parts))
    assert same_bits(outs[0][0], outs[1][0]) and same_bits(outs[0][1], outs[1][1])
    out, parts = outs[1]
    xh = x.get().astype(np.float64)
    assert same_bits(out[:, :1000], K.transpose(x, s)) and not bool(out[:, 1000:].any())
    want = np.stack([xh[64 * i:64 * i + 64].sum(axis=0) for i in range(16)] + [np.zeros(96)])
    assert np.abs(parts.get() - want).max() <= 1e-5 * np.abs(xh).sum(axis=0).max()
    # colsum_finish: the partial rows in order, also into a column of a K-major operand
    sums = poison((96,))
    K.colsum_finish(parts, sums, s, column=(out, 1000))
    assert same_bits(out[:, 1000], sums) and not bool(out[:, 1001:].any())
    assert np.abs(sums.get() - xh.sum(axis=0)).max() <= 1e-5 * np.abs(xh).sum(axis=0).max()
    with pytest.raises(ValueError, match="colsum_finish"):
        K.colsum_finish(parts, sums, s, column=(out, width))


def _bf16_bits(x) -> np.ndarray:
    """The bf16 bit patterns of fp32 ``x`` rounded to nearest even (ml_dtypes' cast, on the host)."""
    return x.get().astype(ml_dtypes.bfloat16).view(np.uint16)


@gpu
@pytest.mark.parametrize("gy", [1, 2, 3])
def test_cast_kernels(gy, rng):
    """The one-launch casts give each array's bf16 rounding; the cast that also sums the columns gives
    colsum_partial's bits for the partials (any grid height, both lane widths) and the same bf16 copy."""
    import cupy

    from cupy_rope._kernels import launcher
    from cupy_rope.attention import kernels as K
    from cupy_rope.precision import Precision

    s = cupy.cuda.get_current_stream().ptr
    xs = [rng.standard_normal(shape, dtype=np.float32) for shape in ((37, 9), (1000, 96), (5,))]
    for n in (1, 2, 3):  # sizes with and without a tail of fewer than 8 elements
        outs = K.cast_bf16(s, *xs[:n])
        assert len(outs) == n
        for x, o in zip(xs, outs):
            assert o.shape == x.shape and o.dtype == ml_dtypes.bfloat16
            assert np.array_equal(o.view(np.uint16).get(), _bf16_bits(x))
    with pytest.raises(ValueError, match="one to three"):
        K.cast_bf16(s, *xs, xs[0])
    for bad in (xs[0][1:3], xs[1][:, :8], xs[1].astype(np.float64)):  # misaligned, strided, not float32
        with assert_no_launch(), pytest.raises(ValueError, match="16-byte aligned float32"):
            K.cast_bf16(s, xs[0], bad)
    bufs = K.Buffers(Precision.BF16, s)
    for cols, name in ((96, "cast_colsum_bf16_v4"), (70, "cast_colsum_bf16")):  # cols % 4 != 0: one column a lane
        x = rng.standard_normal((1000, cols), dtype=np.float32)  # 4 chunks of 256 rows
        ref = poison((K.colsum_chunks(1000), cols))
        K.colsum_partial(x, ref, s)
        part = poison(ref.shape)
        out = bufs.operand_and_colsum(x, part)
        assert same_bits(part, ref) and np.array_equal(out.view(np.uint16).get(), _bf16_bits(x))
        part = poison(ref.shape)
        out = cupy.full(x.shape, 0x7FC0, cupy.uint16).view(ml_dtypes.bfloat16)  # NaN in every element
        lanes = 128 if name.endswith("v4") else 32
        launcher("util", name, "pppiii")(((cols + lanes - 1) // lanes, gy, 1), (256, 1, 1),
                                         (x.data.ptr, out.data.ptr, part.data.ptr, 1000, cols, K.COLSUM_CHUNK), s)
        assert same_bits(part, ref) and np.array_equal(out.view(np.uint16).get(), _bf16_bits(x))
    y = rng.standard_normal((3, 8), dtype=np.float32)  # tf32 / fp32: the operand as is, the partials alone
    part = poison((1, 8))
    assert K.Buffers(Precision.TF32, s).operand_and_colsum(y, part) is y
    assert np.allclose(part.get()[0], y.get().sum(0), rtol=1e-6, atol=1e-6)
