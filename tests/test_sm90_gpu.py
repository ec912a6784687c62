"""The Hopper (sm_90a) attention kernels on an sm_90 GPU: varlen attention and the vision block's backward
(bf16 and tf32) against float64, with multi-tile sequences (the ordered dQ sum over several key tiles), tiny and empty
sequences, every head dim of the path; bit-identical repeats; the mma.sync fallback forced on the same GPU and
checked too. Skipped where the GPU is not sm_90."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import cupy_rope as cr
from cupy_rope.attention.plan import HOPPER_TF32_MIN_TILES
from cupy_rope.attention.varlen import TILE
from cupy_rope import reference as R
from tests.helpers import (BF16, FWD_ARGS, TOL, block_args, block_heads, make_block_inputs, poisoned_allocations,
                           reference_block_backward, rel_err, same_bits)

pytestmark = pytest.mark.gpu

HOPPER_PRECISIONS = ("bf16", "tf32")
SEQS = {
    "long": [700],  # 6 key tiles, 11 query steps: the ordered dQ sum runs over several key tiles
    "mixed": [1, 64, 0, 300, 17, 129],
    "tiny": [1, 2, 3, 5, 8, 13, 0, 1],
    "two": [256, 385],
}


@pytest.fixture
def sm90(gpu):
    from cupy_rope.attention import hopper

    if not hopper.supported():
        pytest.skip("the GPU is not sm_90 (Hopper): the sm_90a kernels do not run here")
    return hopper


def _on(flag):
    return lambda p: dataclasses.replace(p, hopper=flag)


def _inputs(rng, lens, nh, d, n=4):
    """cu_seqlens of sequences ``lens``, ``n`` fresh standard-normal fp32 arrays [T, nh, d], and the tests'
    softmax scaling for head dim ``d``."""
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    return cu, [rng.standard_normal((int(cu[-1]), nh, d), dtype=np.float32) for _ in range(n)], 0.8 * d ** -0.5


def _varlen(q, k, v, g, cu, flag, scaling, precision="bf16"):
    """Forward and backward, every allocation of the calls poisoned with NaN (an element never written shows)."""
    with poisoned_allocations():
        o, lse = cr.varlen_attention_forward(q, k, v, cu, scaling=scaling, precision=precision, plan=_on(flag))
        return (o, lse) + cr.varlen_attention_backward(g, q, k, v, o, lse, cu, scaling=scaling,
                                                       precision=precision, plan=_on(flag))


@pytest.mark.parametrize("precision", HOPPER_PRECISIONS)
@pytest.mark.parametrize("d", [64, 80, 96, 128])
@pytest.mark.parametrize("kind", sorted(SEQS))
def test_backward_kernels_agree(sm90, rng, kind, d, precision):
    """Each precision's warp-specialised backward against its other kernels (bf16: dQ summed by writer warps vs
    the two-warpgroup kernel, and dQ written by each sequence's last key tile; tf32: two consumer warpgroups vs
    one, and with K and V held in registers for a second Q/dO stage), every call into allocations poisoned with
    NaN: the same products, rounded alike, and the same ordered dQ sum, so bit-identical gradients, each within
    the precision's bound of float64, and repeat runs bit-identical."""
    cu, (q, k, v, g), scaling = _inputs(rng, SEQS[kind], 3, d)
    o, lse = cr.varlen_attention_forward(q, k, v, cu, scaling=scaling, precision=precision, plan=_on(True))
    ref = R.varlen_attention_backward(g, q, k, v, cu, scaling=scaling)

    def backward(ws, stages=1, fused=False):
        plan = lambda p: dataclasses.replace(p, hopper=True, specialised=ws, stages=stages,  # noqa: E731
                                             fused_dq=fused, query_rows=64)
        with poisoned_allocations():
            return cr.varlen_attention_backward(g, q, k, v, o, lse, cu, scaling=scaling, precision=precision,
                                                plan=plan)

    kernels = [(True, 1), (False, 1)] + ([(True, 2)] if precision == "tf32" else [(True, 1, True)])
    got = {key: backward(*key) for key in kernels}
    for key, out in got.items():
        for name, a, b in zip(("dq", "dk", "dv"), out, ref):
            assert rel_err(a, b) <= TOL[precision], f"{name} (specialised, stages = {key}) {rel_err(a, b):.2e}"
    for key in kernels[1:]:
        for name, a, b in zip(("dq", "dk", "dv"), got[True, 1], got[key]):
            assert same_bits(a, b), f"{name}: the {precision} backward kernels (True, 1) and {key} differ"
    for name, a, c in zip(("dq", "dk", "dv"), got[True, 1], backward(True)):
        assert same_bits(a, c), f"{name}: two runs of the specialised kernel differ"
    if precision == "bf16":
        for name, a, c in zip(("dq", "dk", "dv"), got[True, 1], backward(True, 1, True)):
            assert same_bits(a, c), f"{name}: two runs of the specialised kernel writing dQ itself differ"


def _rna_tf32(x: np.ndarray) -> np.ndarray:
    """fp32 values rounded to tf32 (10 mantissa bits) to nearest, ties away from zero, as fp32 (finite inputs):
    half a tf32 unit added to the magnitude's bits, then the 13 low bits cleared."""
    u = x.view(np.uint32)
    return ((u + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


@pytest.mark.parametrize("t, d", [(100, 64), (257, 80), (64, 128)])
def test_tf32_operand_copies(sm90, np_rng, t, d):
    """The tf32 operands the varlen API makes from its arrays, into allocations poisoned with NaN, bit for bit
    against NumPy: the rounded copy (hop_round32); the transposed copy [NH][D][Tp] with zeros past T and the
    rounded row copy written from the same reads (hop_t32), in token order and in the permuted order (each
    group of 8 tokens as 0, 2, 4, 6, 1, 3, 5, 7). Values with low bits set on both sides of every tie."""
    import cupy

    nh = 3
    x = (np_rng.standard_normal((t, nh, d)) * 3).astype(np.float32)
    u = x.view(np.uint32)
    u[..., ::7] |= np.uint32(0x1000)  # above a tie
    u[..., 3::7] = (u[..., 3::7] & np.uint32(0xFFFFE000)) | np.uint32(0x1000)  # exact ties: away from zero
    want = _rna_tf32(x)
    assert not np.array_equal(want, x)
    xd = cupy.asarray(x)
    s = cupy.cuda.get_current_stream().ptr
    with poisoned_allocations():
        r = sm90.round32(xd, s)
        rows, rows_p = cupy.empty_like(xd), cupy.empty_like(xd)
        plain = sm90.transposed(sm90.token_rows(xd), t, nh, d, False, s, rows=rows)
        perm = sm90.transposed(sm90.token_rows(xd), t, nh, d, True, s, rows=rows_p)
    for name, a in (("round32", r), ("rows", rows), ("rows (permuted)", rows_p)):
        assert same_bits(a.get(), want), f"{name}: not the tf32 rounding of the input"
    tp = plain.shape[-1]
    assert tp % 32 == 0 and tp >= t and plain.shape == perm.shape == (nh, d, tp)
    plain, perm = plain.get(), perm.get()
    assert same_bits(plain[:, :, :t], np.ascontiguousarray(want.transpose(1, 2, 0)))
    assert not plain[:, :, t:].any(), "the columns past T are not zero"
    order = np.arange(tp).reshape(-1, 8)[:, [0, 2, 4, 6, 1, 3, 5, 7]].reshape(-1)
    assert same_bits(perm, np.ascontiguousarray(plain[:, :, order])), "the permuted copy"


@pytest.mark.parametrize("t, nh, d", [(100, 3, 64), (257, 3, 80), (64, 2, 128), (1, 5, 96), (1000, 28, 128)])
def test_tf32_dot_copy_with_delta(sm90, np_rng, t, nh, d):
    """The varlen API's tf32 copy of dO with the delta pass from the same reads (hop_t32_perm_delta), into
    allocations poisoned with NaN (the dQ counts with -1): the permuted transposed copy and the rounded rows bit
    for bit as hop_t32 writes them, delta = rowsum(dO * O) within a few fp32 roundings of float64 for every token
    and head, lse2 = lse * k rounded once, every count zeroed, repeat runs bit-identical. Token counts that end
    mid-block, one token, head dims of one and two column tiles."""
    import cupy

    do = cupy.asarray((np_rng.standard_normal((t, nh, d)) * 2).astype(np.float32))
    o = cupy.asarray(np_rng.standard_normal((t, nh, d)).astype(np.float32))
    lse = cupy.asarray(np_rng.standard_normal((nh, t)).astype(np.float32))
    ref = (o.get().astype(np.float64) * do.get().astype(np.float64)).sum(-1).T  # [NH, T]
    k2 = 1.4426950408889634
    s = cupy.cuda.get_current_stream().ptr
    want_rows = cupy.empty_like(do)
    want = sm90.transposed(sm90.token_rows(do), t, nh, d, True, s, rows=want_rows)
    runs = []
    for _ in range(2):
        sem = cupy.full((nh, t), -1, np.int32)
        with poisoned_allocations():
            rows = cupy.empty_like(do)
            delta, lse2 = cupy.empty((nh, t), np.float32), cupy.empty((nh, t), np.float32)
            got = sm90.transposed_delta(sm90.token_rows(do), sm90.token_rows(o), t, nh, d, s, rows, delta, lse,
                                        lse2, k2, sem)
        assert int((sem != 0).sum()) == 0, "a dQ count was not zeroed"
        runs.append((got, rows, delta, lse2))
    got, rows, delta, lse2 = runs[0]
    assert got.shape == want.shape and same_bits(got, want), "the permuted transposed copy"
    assert same_bits(rows, want_rows), "the rounded row copy"
    assert not bool(cupy.isnan(delta).any()), "a delta was not written"
    assert rel_err(delta, ref) <= 1e-6, rel_err(delta, ref)
    assert same_bits(lse2, lse * np.float32(k2)), "lse2 is not lse * k rounded once"
    for a, b in zip(runs[0], runs[1]):
        assert same_bits(a, b), "repeat runs differ"


@pytest.mark.parametrize("precision", HOPPER_PRECISIONS)
@pytest.mark.parametrize("d", [64, 80, 96, 128])
@pytest.mark.parametrize("kind", sorted(SEQS))
def test_forward_kernels_agree(sm90, rng, kind, d, precision):
    """The warp-specialised forwards (bf16: the next tile's scores beside the softmax; tf32: that, with Q in
    registers and three K/V stages) and the two-warpgroup kernels: the same products and the same online-softmax
    order, so bit-identical O and lse, within the mode's bound; outputs poisoned with NaN before each call."""
    cu, (q, k, v), scaling = _inputs(rng, SEQS[kind], 3, d, n=3)
    ro, rlse = R.varlen_attention_forward(q, k, v, cu, scaling=scaling)

    def forward(ws):
        plan = lambda p: dataclasses.replace(p, hopper=True, fwd_specialised=ws)  # noqa: E731
        with poisoned_allocations():
            return cr.varlen_attention_forward(q, k, v, cu, scaling=scaling, precision=precision, plan=plan)

    got = {ws: forward(ws) for ws in (True, False)}
    for ws, (o, lse) in got.items():
        assert rel_err(o.get().astype(np.float32), ro) <= TOL[precision], f"o (fwd_specialised={ws})"
        assert rel_err(lse, rlse) <= TOL[precision], f"lse (fwd_specialised={ws})"
    for name, a, b, c in zip(("o", "lse"), got[True], got[False], forward(True)):
        assert same_bits(a, b), f"{name}: the two {precision} forward kernels differ"
        assert same_bits(a, c), f"{name}: two runs of the specialised forward differ"


def _tail_heads(sm90, lens, parts):
    """A head count for which the tf32 forward splits its last wave on this GPU (``lens``' tile table), and the
    split (R, P)."""
    from cupy_rope.attention import api, plan as _plan

    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    table = api._varlen.resolve(api._varlen.read_async(cu, 0), int(cu[-1])).table
    tf32 = _plan.Plan(precision=api.Precision.TF32, head_dim=128, tokens=int(cu[-1]), kmajor=True, nt=False,
                      nt_qkv=False, concurrent=False, dq_partials=0, graph=False, hopper=True,
                      fwd_specialised=True, fwd_tail_parts=parts)
    for nh in range(2, 40):
        r, p = sm90.forward_tail(table, nh, tf32)
        if r and p > 1:
            return nh, (r, p), table
    pytest.skip("no head count below 40 leaves this GPU a partial last wave to split")


@pytest.mark.parametrize("d", [80, 128])
@pytest.mark.parametrize("lens", [[2100, 385], [1100, 1, 1199, 70]])
def test_tf32_forward_tail_split(sm90, rng, monkeypatch, lens, d):
    """The specialised tf32 forward with its last wave's units split over their key steps, then combined
    (hop_fwd_tf32_ws_tail, hop_fwd_tf32_combine), into allocations poisoned with NaN: O and lse within tf32's
    bound of float64, the split units' rows too; every other row bit-identical to the unsplit kernel's; repeat
    runs bit-identical."""
    nh, (r, p), table = _tail_heads(sm90, lens, 8)
    cu, (q, k, v), scaling = _inputs(rng, lens, nh, d, n=3)
    ro, rlse = R.varlen_attention_forward(q, k, v, cu, scaling=scaling)
    names = _kernels_named(sm90, monkeypatch)

    def forward(parts):
        plan = lambda p: dataclasses.replace(p, hopper=True, fwd_specialised=True, fwd_tail_parts=parts)  # noqa
        with poisoned_allocations():
            o, lse = cr.varlen_attention_forward(q, k, v, cu, scaling=scaling, precision="tf32", plan=plan)
        return o.get(), lse.get()

    (o, lse), (wo, wlse), (ao, alse) = forward(8), forward(1), forward(8)
    assert names.count("hop_fwd_tf32_ws_tail") == 2 and names.count("hop_fwd_tf32_combine") == 2, names
    split = np.zeros((len(ro), nh), bool)  # [token, head]: rows of the split units
    for u in range(r):
        row0, _, s1 = table[u % len(table)]
        split[row0:min(row0 + 128, s1), u // len(table)] = True
    assert split.any() and not split.all()
    assert rel_err(o, ro) <= TOL["tf32"] and rel_err(lse, rlse) <= TOL["tf32"]
    assert rel_err(o[split], ro[split]) <= TOL["tf32"], f"split rows {rel_err(o[split], ro[split]):.2e}"
    assert rel_err(lse.T[split], rlse.T[split]) <= TOL["tf32"]
    assert same_bits(o[~split], wo[~split]) and same_bits(lse.T[~split], wlse.T[~split]), "unsplit rows differ"
    assert same_bits(o, ao) and same_bits(lse, alse), "two runs of the split forward differ"


def test_block_tf32_forward_tail_split(sm90, rng, monkeypatch):
    """The block's tf32 backward with its forward's last wave split (the library's plan from 16 query tiles):
    the split kernels launched (and not without the split), every output within tf32's bound of float64, close to
    the unsplit forward's, repeat runs bit-identical."""
    from cupy_rope.attention import api

    lens = [2100, 385]
    nh, _, _ = _tail_heads(sm90, lens, 8)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    x = make_block_inputs(rng, cu, hidden=nh * 128, head_dim=128)
    args = block_args(x)
    vl = api._varlen.resolve(api._varlen.read_async(cu, 0), int(cu[-1]))
    plan = api.choose_plan(api.Precision.TF32, 128, vl)
    assert plan.hopper and plan.fwd_tail_parts > 1 and sm90.forward_tail(vl.table, nh, plan)[0]
    ref = reference_block_backward(x)

    def run(parts):
        with poisoned_allocations():
            return cr.vision_attention_backward(*args, num_heads=nh, precision="tf32",
                                                plan=dataclasses.replace(plan, fwd_tail_parts=parts))

    names = _kernels_named(sm90, monkeypatch)
    split = run(plan.fwd_tail_parts)
    assert "hop_fwd_tf32_ws_tail" in names and "hop_fwd_tf32_combine" in names, names
    names.clear()
    whole = run(1)
    assert "hop_fwd_tf32_ws" in names and "hop_fwd_tf32_ws_tail" not in names, names
    again = run(plan.fwd_tail_parts)
    for i, (a, b, w, c) in enumerate(zip(split, ref, whole, again)):
        assert rel_err(a, b) <= TOL["tf32"], f"output {i} {rel_err(a, b):.2e}"
        assert rel_err(a, w) <= 1e-4, f"output {i}: split and unsplit differ by {rel_err(a, w):.2e}"
        assert same_bits(a, c), f"output {i}: two runs differ"


def _bf16_forward(q, k, v, cu, scaling, **fields):
    """The Hopper bf16 forward with these plan fields replaced, into allocations poisoned with NaN."""
    plan = lambda p: dataclasses.replace(p, hopper=True, **fields)  # noqa: E731
    with poisoned_allocations():
        return cr.varlen_attention_forward(q, k, v, cu, scaling=scaling, precision="bf16", plan=plan)


@pytest.mark.parametrize("lens", [[1, 191, 0, 192, 193, 2100, 385], [2, 3000]])
def test_bf16_forward_keys_192(sm90, rng, monkeypatch, lens):
    """The k192 forward (D = 128: K/V tiles of 192 keys, K and V released apart) into an output poisoned with NaN:
    O and lse within the bf16 bound of float64 and close to the 128-key kernel (the online softmax over other
    tiles), repeat runs bit-identical; sequences of 0-3 tokens and ending before, on and after a tile's edge."""
    cu, (q, k, v), scaling = _inputs(rng, lens, 3, 128, n=3)
    ro, rlse = R.varlen_attention_forward(q, k, v, cu, scaling=scaling)
    names = _kernels_named(sm90, monkeypatch)
    forward = lambda keys: _bf16_forward(q, k, v, cu, scaling, fwd_keys=keys)  # noqa: E731
    k192 = forward(192)
    assert names == ["hop_fwd_bf16_ws_k192"]
    k128, again = forward(128), forward(192)
    assert names[1] == "hop_fwd_bf16_ws"
    f32 = lambda x: x.get().astype(np.float32) if x.dtype != np.float32 else x  # noqa: E731 - bf16 O
    for name, a, b, w, c in zip(("o", "lse"), k192, (ro, rlse), k128, again):
        assert rel_err(f32(a), b) <= TOL["bf16"], f"{name} {rel_err(f32(a), b):.2e}"
        assert rel_err(f32(a), f32(w)) <= TOL["bf16"], f"{name}: 192 and 128 keys differ"
        assert same_bits(a, c), f"{name}: two runs of the k192 forward differ"


@pytest.mark.parametrize("d", [64, 80, 96, 128])
def test_bf16_forward_persistent(sm90, rng, monkeypatch, d):
    """The persistent bf16 forward (one block per SM walks the (head, query tile) units: the next unit's Q and
    K/V copied beside the current one's last products, one ring of K/V stages over all of a block's tiles) into
    outputs poisoned with NaN: within the bf16 bound of float64, bit-identical to the kernel launched per unit
    and across runs; with O stored from registers and through the copy engine (fwd_o_bulk: partial tiles' rows
    past their sequence from registers). 60 sequences of 0-512 tokens and 3 heads make about three units per
    block, so Q is refilled and the ring wraps across units of 1-4 tiles."""
    lens = [int(x) for x in rng.integers(0, 513, 60)]
    lens[:4] = [0, 1, 512, 129]
    cu, (q, k, v), scaling = _inputs(rng, lens, 3, d, n=3)
    ro, rlse = R.varlen_attention_forward(q, k, v, cu, scaling=scaling)
    names = _kernels_named(sm90, monkeypatch)
    forward = lambda persistent, bulk=False: _bf16_forward(  # noqa: E731
        q, k, v, cu, scaling, fwd_persistent=persistent, fwd_o_bulk=bulk)
    got, bulk, per_unit, again = forward(True), forward(True, True), forward(False), forward(True, True)
    assert names == ["hop_fwd_bf16_ws_persist", "hop_fwd_bf16_ws_persist_bulk", "hop_fwd_bf16_ws",
                     "hop_fwd_bf16_ws_persist_bulk"]
    for name, a, b, x, w, c in zip(("o", "lse"), got, (ro, rlse), bulk, per_unit, again):
        f32 = a.get().astype(np.float32) if name == "o" else a
        assert rel_err(f32, b) <= TOL["bf16"], f"{name} {rel_err(f32, b):.2e}"
        assert same_bits(a, w), f"{name}: the persistent and per-unit forwards differ"
        assert same_bits(a, x), f"{name}: O through the copy engine and from registers differ"
        assert same_bits(x, c), f"{name}: two runs of the persistent forward differ"


@pytest.mark.parametrize("precision,fused", [("bf16", False), ("bf16", True), ("tf32", False)])
@pytest.mark.parametrize("d", [64, 128])
def test_backward_block_orders_agree(sm90, rng, d, precision, fused):
    """The sm_90a backward in every block order: head-fastest, key-tile-fastest over one head, over groups of 2 and
    3 of 5 heads (the last group short), and over a group of more heads than there are. Each key tile still adds
    its dQ share after the tile before it, so the gradients are bit-identical, within the bound of float64. Unsplit
    (the tail split's parts are the first units of the launch order, so their dK and dV sums follow the order)."""
    cu, (q, k, v, g), scaling = _inputs(rng, [700, 0, 300, 1100, 1], 5, d)
    o, lse = cr.varlen_attention_forward(q, k, v, cu, scaling=scaling, precision=precision, plan=_on(True))
    ref = R.varlen_attention_backward(g, q, k, v, cu, scaling=scaling)

    def backward(group):
        plan = lambda p: dataclasses.replace(p, hopper=True, fused_dq=fused, head_group=group,  # noqa: E731
                                             query_rows=64 if fused else p.query_rows, tail_parts=1)
        with poisoned_allocations():
            return cr.varlen_attention_backward(g, q, k, v, o, lse, cu, scaling=scaling, precision=precision,
                                                plan=plan)

    got = {group: backward(group) for group in (0, 1, 2, 3, 8)}
    for name, a, b in zip(("dq", "dk", "dv"), got[1], ref):
        assert rel_err(a, b) <= TOL[precision], f"{name} {rel_err(a, b):.2e}"
    for group, out in got.items():
        for name, a, b in zip(("dq", "dk", "dv"), got[1], out):
            assert same_bits(a, b), f"{name}: head_group {group} differs from key-tile-fastest over one head"


@pytest.mark.parametrize("d", [64, 80, 128])
@pytest.mark.parametrize("lens, split", [([1536, 0, 640, 64, 1], True), ([128, 448, 0, 2], False)])
def test_tf32_first_tile_stores(sm90, rng, d, lens, split):
    """Sequences of whole 64-token steps but the last (which ends at T): each sequence's first key tile in the
    two-stage tf32 backward stores its dQ^T share of every step instead of adding it, and the accumulator is not
    zeroed (Plan.tf32_first_stores, hopper.first_tile_stores). Into allocations poisoned with NaN: bit-identical
    to the same kernel adding into a zeroed accumulator and to the one-stage kernel, also with the tail split
    (dQ: the same ordered sum; dK, dV within float rounding), within tf32's bound of float64, repeat runs
    bit-identical."""
    from cupy_rope.attention import flash

    cu, (q, k, v, g), scaling = _inputs(rng, lens, 8, d)
    vl = flash._varlen.resolve(flash._varlen.read_async(cu, 0), int(cu[-1]))
    chosen = flash._choose_plan(flash.Precision.TF32, d, vl, None)
    two = lambda **f: dataclasses.replace(chosen, **{"hopper": True, "specialised": True, "stages": 2,  # noqa: E731
                                                     "tail_parts": 1, **f})
    assert sm90.first_tile_stores(vl, two(tf32_first_stores=True)), "the case has whole steps"
    assert not sm90.first_tile_stores(vl, two(tf32_first_stores=False))
    assert not sm90.first_tile_stores(vl, two(tf32_first_stores=True, stages=1))
    o, lse = cr.varlen_attention_forward(q, k, v, cu, scaling=scaling, precision="tf32", plan=_on(True))
    ref = R.varlen_attention_backward(g, q, k, v, cu, scaling=scaling)

    def backward(**fields):
        with poisoned_allocations():
            return cr.varlen_attention_backward(g, q, k, v, o, lse, cu, scaling=scaling, precision="tf32",
                                                plan=two(**fields))

    stores, again = backward(tf32_first_stores=True), backward(tf32_first_stores=True)
    adds, one = backward(tf32_first_stores=False), backward(tf32_first_stores=False, stages=1)
    for name, a, b, c, w, u in zip(("dq", "dk", "dv"), stores, ref, again, adds, one):
        assert rel_err(a, b) <= TOL["tf32"], f"{name} {rel_err(a, b):.2e}"
        assert same_bits(a, c), f"{name}: two runs differ"
        assert same_bits(a, w), f"{name}: stores into the unzeroed accumulator and adds into zeros differ"
        assert same_bits(a, u), f"{name}: the two-stage and one-stage kernels differ"
    units = 8 * 2 * sum(-(-n // 128) for n in lens)
    assert (_tail(sm90, units, 3)[1] > 1) == split
    if split:
        parts = backward(tf32_first_stores=True, tail_parts=3)
        for name, a, b, w in zip(("dq", "dk", "dv"), parts, ref, stores):
            assert rel_err(a, b) <= TOL["tf32"], f"{name} (split) {rel_err(a, b):.2e}"
            assert rel_err(a, w) <= 1e-6, f"{name}: split and unsplit differ by {rel_err(a, w):.2e}"
        assert same_bits(parts[0], stores[0]), "dq: the split changed the ordered dQ sum"


def test_block_tf32_first_tile_stores(sm90, rng):
    """The block's tf32 backward on sequences of whole steps, its dQ accumulator not zeroed (the library's plan
    at this size), into allocations poisoned with NaN: every output within tf32's bound of float64 and
    bit-identical to the run that adds into a zeroed accumulator."""
    from cupy_rope.attention import api

    cu = np.array([0, 1024, 1024, 1536, 1601], np.int32)
    x = make_block_inputs(rng, cu, hidden=256, head_dim=128)
    nh = block_heads(x)
    args = block_args(x)
    vl = api._varlen.resolve(api._varlen.read_async(cu, 0), int(cu[-1]))
    plan = api.choose_plan(api.Precision.TF32, 128, vl)
    assert plan.hopper and sm90.first_tile_stores(vl, plan)
    ref = R.vision_attention_backward(*[a.get() if hasattr(a, "get") else a for a in args], num_heads=nh)

    def run(stores):
        with poisoned_allocations():
            return cr.vision_attention_backward(*args, num_heads=nh, precision="tf32",
                                                plan=dataclasses.replace(plan, tf32_first_stores=stores))

    stored = run(True)
    for i, (a, b) in enumerate(zip(stored, ref)):
        assert rel_err(a, b) <= TOL["tf32"], f"output {i} {rel_err(a, b):.2e}"
    assert all(same_bits(a, b) for a, b in zip(stored, run(False))), "stores and adds into zeros differ"


def _tail(sm90, units, max_parts):
    """The tail split the backward takes for ``units`` on this GPU (a test that means to split checks it does)."""
    import cupy

    return sm90.tail_split(units, sm90.sm_count(cupy.cuda.runtime.getDevice()), max_parts)


@pytest.mark.parametrize("precision,fused,d", [("bf16", f, d) for f in (False, True) for d in (64, 80, 96, 128)]
                         + [("tf32", False, d) for d in (64, 80, 128)])
def test_backward_tail_split(sm90, rng, precision, fused, d):
    """The specialised backward with its first units split over their query steps (8 heads; bf16: 20 units of 128
    keys, tf32's two-stage kernel: 40 of 64; among them a 2-token sequence's, whose parts but one have no steps,
    and in tf32 a block past its sequence's end): dQ is the same sum in the same order (bit-identical to
    unsplit), dK and dV the parts' sums in part order (within float rounding of unsplit), all within the mode's
    bound of float64, repeat runs bit-identical; outputs poisoned with NaN."""
    lens = [2, 1500, 0, 700, 1]
    cu, (q, k, v, g), scaling = _inputs(rng, lens, 8, d)
    units = 8 * sum(-(-n // 128) for n in lens) * (2 if precision == "tf32" else 1)
    r, p = _tail(sm90, units, 3)
    assert p > 1, f"{units} units on this GPU: no split to test"
    o, lse = cr.varlen_attention_forward(q, k, v, cu, scaling=scaling, precision=precision, plan=_on(True))
    ref = R.varlen_attention_backward(g, q, k, v, cu, scaling=scaling)
    fields = dict(fused_dq=fused, query_rows=64) if precision == "bf16" else dict(specialised=True, stages=2)

    def backward(parts):
        plan = lambda p: dataclasses.replace(p, hopper=True, tail_parts=parts, **fields)  # noqa: E731
        with poisoned_allocations():
            return cr.varlen_attention_backward(g, q, k, v, o, lse, cu, scaling=scaling, precision=precision,
                                                plan=plan)

    split, whole, again = backward(3), backward(1), backward(3)
    for name, a, b, w, c in zip(("dq", "dk", "dv"), split, ref, whole, again):
        assert rel_err(a, b) <= TOL[precision], f"{name} {rel_err(a, b):.2e}"
        assert rel_err(a, w) <= 1e-6, f"{name}: split and unsplit differ by {rel_err(a, w):.2e}"
        assert same_bits(a, c), f"{name}: two runs of the split backward differ"
    assert same_bits(split[0], whole[0]), "dq: the split changed the ordered dQ sum"
    assert not all(same_bits(a, w) for a, w in zip(split[1:], whole[1:])), "no dK/dV bits changed: nothing split?"


def _block_bf16(rng, lens, hidden, d):
    """The block's inputs for sequences ``lens`` (hidden size, head dim ``d``): (heads, float64 reference, run),
    where ``run(**fields)`` is the bf16 backward on the sm_90a kernels with those plan fields replaced, into
    allocations poisoned with NaN."""
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    x = make_block_inputs(rng, cu, hidden=hidden, head_dim=d)
    nh = block_heads(x)
    args = block_args(x)

    def run(**fields):
        plan = lambda p: dataclasses.replace(p, hopper=True, **fields)  # noqa: E731
        with poisoned_allocations():
            return cr.vision_attention_backward(*args, num_heads=nh, precision="bf16", plan=plan)

    return nh, reference_block_backward(x, num_heads=nh), run


def test_block_bf16_tail_split(sm90, rng):
    """The block's bf16 backward (RoPE, bf16 gradients, bias partial sums, the epilogue's barriers) with the tail
    split: within the bf16 bound of float64, close to unsplit, repeat runs bit-identical."""  # 8 heads x 19 tiles
    lens = [2, 1500, 700]
    nh, ref, run = _block_bf16(rng, lens, 1024, 128)
    r, p = _tail(sm90, nh * sum(-(-n // 128) for n in lens), 3)
    assert p > 1, "no split to test"
    split, whole, again = (run(tail_parts=parts, query_rows=64) for parts in (3, 1, 3))
    for i, (a, b, w, c) in enumerate(zip(split, ref, whole, again)):
        assert rel_err(a, b) <= TOL["bf16"], f"output {i}: {rel_err(a, b):.2e}"
        # dK's other rounding reaches the bf16 grad_qkv operand: an element here and there one bf16 step apart
        assert rel_err(a, w) <= 1e-3, f"output {i}: split and unsplit differ by {rel_err(a, w):.2e}"
        assert same_bits(a, c), f"output {i}: two runs of the split backward differ"


def _kernels_named(sm90, monkeypatch) -> list:
    """The names of the sm_90a kernels the calls after this ask for, in order."""
    names, kernel = [], sm90._kernel

    def recording(name, *a, **kw):
        names.append(name)
        return kernel(name, *a, **kw)

    monkeypatch.setattr(sm90, "_kernel", recording)
    return names


@pytest.mark.parametrize("lens", [[700, 0, 1, 2100, 81], [80, 79, 160, 2, 241, 1]])
def test_backward_query_rows_80(sm90, rng, monkeypatch, lens):
    """The q80 kernels (D = 128: query steps of 80 rows, dQ made transposed), into allocations poisoned with NaN:
    within the bf16 bound of float64 and bit-identical to the 64-row kernel (dK and dV accumulate the same k16
    products in the same order across steps, dQ^T is the same dot products over the same key chunks), repeat
    runs bit-identical; sequences ending on, before and after a step's edge, of 0, 1 and 2 tokens."""
    cu, (q, k, v, g), scaling = _inputs(rng, lens, 3, 128)
    names = _kernels_named(sm90, monkeypatch)
    o, lse = cr.varlen_attention_forward(q, k, v, cu, scaling=scaling, precision="bf16", plan=_on(True))
    ref = R.varlen_attention_backward(g, q, k, v, cu, scaling=scaling)

    def backward(rows):
        plan = lambda p: dataclasses.replace(p, hopper=True, fused_dq=False, tail_parts=1,  # noqa: E731
                                             query_rows=rows)
        with poisoned_allocations():
            return cr.varlen_attention_backward(g, q, k, v, o, lse, cu, scaling=scaling, precision="bf16",
                                                plan=plan)

    q80 = backward(80)
    assert "hop_bwd_bf16_ws_plain_q80" in names and "hop_bwd_bf16_ws_plain" not in names
    q64, again = backward(64), backward(80)
    assert "hop_bwd_bf16_ws_plain" in names
    for name, a, b, w, c in zip(("dq", "dk", "dv"), q80, ref, q64, again):
        assert rel_err(a, b) <= TOL["bf16"], f"{name} {rel_err(a, b):.2e}"
        assert same_bits(a, w), f"{name}: 80 and 64 query rows differ by {rel_err(a, w):.2e}"
        assert same_bits(a, c), f"{name}: two runs of the q80 backward differ"


def test_block_bf16_query_rows_80(sm90, rng, monkeypatch):
    """The block's bf16 backward (RoPE, bf16 gradients, bias partial sums, the epilogue over the 80-row layout)
    on the q80 kernel: within the bf16 bound of float64, bit-identical to 64 rows and from run to run."""
    lens = [2, 1500, 700, 81]
    names = _kernels_named(sm90, monkeypatch)
    _, ref, run = _block_bf16(rng, lens, 1024, 128)
    q80 = run(fused_dq=False, query_rows=80)
    assert "hop_bwd_bf16_ws_q80" in names and "hop_bwd_bf16_ws" not in names
    q64, again = run(fused_dq=False, query_rows=64), run(fused_dq=False, query_rows=80)
    assert "hop_bwd_bf16_ws" in names
    for i, (a, b, w, c) in enumerate(zip(q80, ref, q64, again)):
        assert rel_err(a, b) <= TOL["bf16"], f"output {i}: {rel_err(a, b):.2e}"
        assert same_bits(a, w), f"output {i}: 80 and 64 query rows differ by {rel_err(a, w):.2e}"
        assert same_bits(a, c), f"output {i}: two runs of the q80 backward differ"


def _compare_forms(outs, ref, other, again, factor, what):
    """Every output of ``outs`` and of ``other`` (another form of the same call) within the bf16 bound of the
    float64 ``ref``, ``outs``' error at most ``factor`` times ``other``'s, and ``again`` (a repeat of ``outs``)
    bit-identical to it. ``what``: (this form, the other) for the messages."""
    for i, (a, b, w, c) in enumerate(zip(outs, ref, other, again)):
        err, err_other = rel_err(a, b), rel_err(w, b)
        assert err <= TOL["bf16"], f"output {i} ({what[0]}): {err:.2e}"
        assert err_other <= TOL["bf16"], f"output {i} ({what[1]}): {err_other:.2e}"
        assert err <= factor * err_other + 1e-6, f"output {i}: {what[0]} {err:.2e} against {what[1]} {err_other:.2e}"
        assert same_bits(a, c), f"output {i}: two runs ({what[0]}) differ"


@pytest.mark.parametrize("d, hidden", [(128, 1024), (80, 640)])
def test_block_bf16_in_place(sm90, rng, monkeypatch, d, hidden):
    """The block's bf16 backward with its operands in place (the QKV and dO products' bf16 outputs, bias and RoPE
    applied where they lie: hop_prep_bf16) against the packed operands of the preparation kernel, into
    allocations poisoned with NaN: both within the bf16 bound of float64, the in-place error no more than a
    quarter above the packed one (one bf16 rounding more on q, k and v), repeat runs bit-identical; sequences of
    0-2 tokens and across tile edges."""
    lens = [2, 1100, 0, 1, 300]
    names = _kernels_named(sm90, monkeypatch)
    _, ref, run = _block_bf16(rng, lens, hidden, d)
    placed = run(in_place=True)
    assert "hop_prep_bf16" in names
    del names[:]
    packed, again = run(in_place=False), run(in_place=True)
    assert names.count("hop_prep_bf16") == 1, "the packed call ran the in-place preparation"
    _compare_forms(placed, ref, packed, again, 1.25, ("in place", "packed"))


@pytest.mark.parametrize("types", ["bb", "bf", "fb", "ff"])
@pytest.mark.parametrize("t, nh, d, packed", [(1, 3, 64, False), (131, 28, 128, False), (1000, 40, 80, True),
                                              (8, 33, 96, True), (45, 64, 128, False)])
def test_delta_pass(sm90, rng, t, nh, d, packed, types):
    """The delta pass (rowsum(dO * O) per token and head, with lse2 = lse * k and the dQ counts zeroed) against
    float64, for O and dO in bf16 or fp32, dO token-major or packed [NH][T][D], token counts that end mid-block
    and head counts over one block's: outputs poisoned, every element written and within a few fp32 roundings,
    the counts zero, repeat runs bit-identical."""
    import cupy

    def operand(kind, shape):  # (device array, its values in float64 on the host)
        a = rng.standard_normal(shape, dtype=cupy.float32).get()
        a = a.astype(BF16) if kind == "b" else a
        return cupy.asarray(a), a.astype(np.float64)

    o, o64 = operand(types[0], (t, nh * d))
    do, do64 = operand(types[1], (nh, t, d) if packed else (t, nh * d))
    ldg, hs = (d, t * d) if packed else (nh * d, d)
    lse = rng.standard_normal((nh, t), dtype=cupy.float32)
    do64 = do64.transpose(1, 0, 2) if packed else do64.reshape(t, nh, d)
    ref = (o64.reshape(t, nh, d) * do64).sum(-1).T  # [NH, T]
    outs = []
    for _ in range(2):
        delta, lse2 = cupy.full((nh, t), np.nan, np.float32), cupy.full((nh, t), np.nan, np.float32)
        sem = cupy.full((nh, t), -1, np.int32)
        sm90.delta(o, nh * d, do, ldg, delta, t, nh, d, cupy.cuda.get_current_stream().ptr, head_stride=hs,
                   lse=lse, lse2=lse2, lse_k=1.4426950408889634, sem=sem)
        outs.append((delta, lse2))
        assert int((sem != 0).sum()) == 0, "a dQ count was not zeroed"
    delta, lse2 = outs[0]
    assert rel_err(delta, ref) <= 1e-6, rel_err(delta, ref)
    assert same_bits(lse2, lse * np.float32(1.4426950408889634)), "lse2 is not lse * k rounded once"
    assert same_bits(outs[0][0], outs[1][0]) and same_bits(outs[0][1], outs[1][1]), "repeat runs differ"


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("lens, d", [([2, 300, 0, 1, 129], 128), ([2100, 5], 128), ([2100, 64], 80)])
def test_block_bf16_delta_in_forward(sm90, rng, monkeypatch, in_place, lens, d):
    """The block's bf16 backward with delta and the dQ counts from the forward's epilogue (the persistent forward
    on short sequences; 192-key tiles at D = 128 and 128-key ones at D = 80 on long ones) against the delta pass,
    into allocations poisoned with NaN (a row the forward missed would leave NaN in delta, or a count the ordered
    dQ sum would misread): both within the bf16 bound of float64 and within a few percent of each other's error,
    repeat runs bit-identical, and no delta pass launched."""
    names = _kernels_named(sm90, monkeypatch)
    _, ref, run = _block_bf16(rng, lens, 2 * d, d)
    fused = run(in_place=in_place, fwd_delta=True)
    assert not any(n.startswith("hop_delta") for n in names), names
    passed = run(in_place=in_place, fwd_delta=False)
    assert any(n.startswith("hop_delta") for n in names), "the plan without fwd_delta ran no delta pass"
    again = run(in_place=in_place, fwd_delta=True)
    _compare_forms(fused, ref, passed, again, 1.05, ("delta in the forward", "delta pass"))


@pytest.mark.parametrize("seqs", [[1100], [600, 0, 1, 500]])
def test_block_bf16_specialised_backward(sm90, rng, seqs):
    """The block's bf16 backward (RoPE on dQ and dK, bf16 gradients, bias partial sums) on the warp-specialised
    forward and backward kernels, outputs made in NaN-poisoned memory: within the bound of float64, and
    bit-identical to the two-warpgroup kernels."""
    cu = np.concatenate([[0], np.cumsum(seqs)]).astype(np.int32)
    x = make_block_inputs(rng, cu, hidden=256, head_dim=128)
    nh = block_heads(x)
    args = block_args(x)
    outs = {}
    for ws in (True, False):
        plan = lambda p, ws=ws: dataclasses.replace(p, hopper=True, specialised=ws, fwd_specialised=ws,  # noqa: E731
                                                    query_rows=p.query_rows if ws else 64, fwd_keys=128)
        with poisoned_allocations():
            outs[ws] = cr.vision_attention_backward(*args, num_heads=nh, precision="bf16", plan=plan)
    for i, (a, b) in enumerate(zip(outs[True], reference_block_backward(x, num_heads=nh))):
        assert rel_err(a, b) <= TOL["bf16"], f"output {i}: {rel_err(a, b):.2e}"
    for i, (a, b) in enumerate(zip(outs[True], outs[False])):
        assert same_bits(a, b), f"output {i}: the bf16 kernels (specialised forward and backward or not) differ"
    for group in (0, 1, 3):  # block orders (head-fastest, key-tile-fastest over 1 and over 3 heads): same bits
        plan = lambda p, g=group: dataclasses.replace(p, hopper=True, head_group=g, fwd_keys=128)  # noqa: E731
        out = cr.vision_attention_backward(*args, num_heads=nh, precision="bf16", plan=plan)
        for i, (a, b) in enumerate(zip(outs[True], out)):
            assert same_bits(a, b), f"output {i}: head_group {group} differs"


@pytest.mark.parametrize("precision", HOPPER_PRECISIONS)
@pytest.mark.parametrize("d", [64, 80, 96, 128])
@pytest.mark.parametrize("kind", sorted(SEQS))
def test_varlen_sm90_and_fallback_match_float64(sm90, rng, kind, d, precision):
    cu, (q, k, v, g), scaling = _inputs(rng, SEQS[kind], 2, d)
    ro, rlse = R.varlen_attention_forward(q, k, v, cu, scaling=scaling)
    rq, rk, rv = R.varlen_attention_backward(g, q, k, v, cu, scaling=scaling)
    got, tol = {}, TOL[precision]
    for flag in (True, False):
        out = _varlen(q, k, v, g, cu, flag, scaling, precision)
        for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), out, (ro, rlse, rq, rk, rv)):
            err = rel_err(a.get().astype(np.float32) if name == "o" else a, b)
            assert err <= tol, f"{name} ({precision}, hopper={flag}) {err:.2e}"
        got[flag] = out
    again = _varlen(q, k, v, g, cu, True, scaling, precision)
    assert all(same_bits(a, b) for a, b in zip(got[True], again)), "two sm_90a runs differ"
    # the fallback is another computation (another summation order): it really ran
    assert not all(same_bits(a, b) for a, b in zip(got[True][2:], got[False][2:]))


@pytest.mark.parametrize("precision", HOPPER_PRECISIONS)
@pytest.mark.parametrize("scaling", [-0.09, 0.0])
def test_varlen_sm90_nonpositive_scaling(sm90, rng, scaling, precision):
    """The forward keeps the running max of the raw scores only for a positive scale (one FFMA per value before
    its exp2); a zero or negative scale takes the scaled path. Both against float64, forward and backward."""
    cu = np.array([0, 300, 301, 460], np.int32)
    q, k, v, g = (rng.standard_normal((460, 2, 80), dtype=np.float32) for _ in range(4))
    ro, rlse = R.varlen_attention_forward(q, k, v, cu, scaling=scaling)
    ref = (ro, rlse) + tuple(R.varlen_attention_backward(g, q, k, v, cu, scaling=scaling))
    out = _varlen(q, k, v, g, cu, True, scaling, precision)
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), out, ref):
        if name in ("dq", "dk") and scaling == 0.0:  # scaling times the score gradient: exactly 0
            assert float(abs(a).max()) == 0.0, f"{name} at scaling 0 ({precision})"
            continue
        err = rel_err(a.get().astype(np.float32) if name == "o" else a, b)
        assert err <= TOL[precision], f"{name} ({precision}, scaling {scaling}) {err:.2e}"


def test_varlen_sm90_is_the_default_for_bf16_and_tf32(sm90, rng):
    from cupy_rope.attention import flash

    cu = np.array([0, 5, 200], np.int32)
    q, k, v = (rng.standard_normal((200, 2, 64), dtype=np.float32) for _ in range(3))
    default = cr.varlen_attention_forward(q, k, v, cu, precision="bf16")
    forced = cr.varlen_attention_forward(q, k, v, cu, precision="bf16", plan=_on(True))
    assert same_bits(default[0], forced[0]) and same_bits(default[1], forced[1])
    vl = flash._varlen.resolve(flash._varlen.read_async(cu, 0), 200)
    assert flash._choose_plan(flash.Precision.BF16, 64, vl, None).hopper
    assert flash._choose_plan(flash.Precision.TF32, 64, vl, None).hopper
    assert not flash._choose_plan(flash.Precision.FP32, 64, vl, None).hopper


@pytest.mark.parametrize("precision", HOPPER_PRECISIONS)
@pytest.mark.parametrize("seqs", [[1100], [600, 0, 1, 500]])
def test_block_sm90_and_fallback_match_float64(sm90, rng, seqs, precision):
    """The block's backward on the sm_90a kernels and forced back to the mma.sync kernels: both within the mode's
    bound of every output, repeats bit-identical."""
    from cupy_rope.attention import api

    cu = np.concatenate([[0], np.cumsum(seqs)]).astype(np.int32)
    x = make_block_inputs(rng, cu, hidden=256, head_dim=128)
    nh = block_heads(x)
    args = block_args(x)
    vl = api._varlen.resolve(api._varlen.read_async(cu, 0), int(cu[-1]))
    # the library's choice: bf16 always, tf32 from a sequence of HOPPER_TF32_MIN_TILES tiles (forced below either way)
    want = precision == "bf16" or -(-max(seqs) // TILE) >= HOPPER_TF32_MIN_TILES
    assert api.choose_plan(api.Precision.parse(precision), 128, vl).hopper == want
    ref = R.vision_attention_backward(*[a.get() if hasattr(a, "get") else a for a in args], num_heads=nh)
    outs = {}
    for flag in (True, False):
        out = cr.vision_attention_backward(*args, num_heads=nh, precision=precision, plan=_on(flag))
        for i, (a, b) in enumerate(zip(out, ref)):
            err = rel_err(a, b)
            assert err <= TOL[precision], f"output {i} ({precision}, hopper={flag}) {err:.2e}"
        outs[flag] = out
    again = cr.vision_attention_backward(*args, num_heads=nh, precision=precision, plan=_on(True))
    assert all(same_bits(a, b) for a, b in zip(outs[True], again))
    assert not same_bits(outs[True][0], outs[False][0])


@pytest.mark.parametrize("precision", HOPPER_PRECISIONS)
def test_programmatic_launches(sm90, rng, monkeypatch, precision):
    """The sm_90a kernels built with -DCUPY_ROPE_PDL=1 and started with programmatic stream serialisation (each
    waits at its entry for the kernels ahead of it): the varlen forward and backward and the block's backward,
    into allocations poisoned with NaN, within the mode's bound of float64 and bit-identical to the default
    build; the launchers used really were programmatic, and the default build's not."""
    from cupy_rope import _kernels as K

    if K._launch_ex() is None:
        pytest.skip(f"the driver is older than {K.PDL_MIN_DRIVER}: no programmatic launches")
    lens = [1, 700, 0, 130, 1100]
    cu, (q, k, v, g), scaling = _inputs(rng, lens, 3, 128)
    x = make_block_inputs(rng, cu, hidden=256, head_dim=128)
    nh, args = block_heads(x), block_args(x)
    ro, rlse = R.varlen_attention_forward(q, k, v, cu, scaling=scaling)
    ref = (ro, rlse) + tuple(R.varlen_attention_backward(g, q, k, v, cu, scaling=scaling))
    ref_block = reference_block_backward(x, num_heads=nh)
    used, switch = [], []
    kernel = sm90._kernel

    def recording(name, d, defines=()):
        lau = kernel(name, d, defines + tuple(switch))
        used.append(lau)
        return lau

    monkeypatch.setattr(sm90, "_kernel", recording)

    def run():
        with poisoned_allocations():
            out = _varlen(q, k, v, g, cu, True, scaling, precision)
            return out + cr.vision_attention_backward(*args, num_heads=nh, precision=precision, plan=_on(True))

    default = run()
    assert used and not any(lau.programmatic for lau in used)
    del used[:]
    switch.append(K.PDL_SWITCH)
    waiting = run()
    assert used and all(lau.programmatic for lau in used)
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), waiting, ref):
        err = rel_err(a.get().astype(np.float32) if name == "o" else a, b)
        assert err <= TOL[precision], f"{name} {err:.2e}"
    for i, (a, b) in enumerate(zip(waiting[5:], ref_block)):
        assert rel_err(a, b) <= TOL[precision], f"block output {i}: {rel_err(a, b):.2e}"
    for i, (a, b) in enumerate(zip(waiting, default)):
        assert same_bits(a, b), f"output {i}: the programmatic launches give other bits"


@pytest.mark.parametrize("precision", HOPPER_PRECISIONS)
def test_calls_compile_their_parts_ahead(sm90, rng, monkeypatch, precision):
    """Every sm_90a kernel a call launches (varlen forward, varlen backward, block forward, block backward) comes
    from a part of the module that compile_ahead built before that launch, in that call or an earlier one of the
    process, and no part is built twice; the first varlen forward at a head dim builds the passes, the forward
    and the backward of its precision; the block's forward (mma.sync kernels) launches none and asks for none;
    no library plan launches a REFERENCE kernel. On the library's plans at several lengths (so several kernels
    of a part)."""
    asked, real = [], sm90._kernels.compile_ahead
    monkeypatch.setattr(sm90, "_AHEAD", set())

    def part(opts) -> tuple:
        got = dict(o.removeprefix("-D").split("=", 1) for o in opts if o.startswith(("-DHOP_PART=", "-DATTN_HEAD")))
        return got["HOP_PART"].removeprefix("HOP_PART_"), int(got["ATTN_HEAD_DIM"])

    def recording(jobs, beside=()):
        jobs = list(jobs)
        asked.extend(part(opts) for _, _, opts in jobs)
        return real(jobs, beside)

    monkeypatch.setattr(sm90._kernels, "compile_ahead", recording)
    launched, kernel = [], sm90._kernel

    def launching(name, d, *a, **kw):  # the part of each kernel looked up, and whether it was built by then
        launched.append(((sm90.PART[name], d), (sm90.PART[name], d) in asked, name))
        return kernel(name, d, *a, **kw)

    monkeypatch.setattr(sm90, "_kernel", launching)
    tag = precision.upper()
    for d, lens in ((128, [700]), (128, [2100, 385]), (128, [130, 1, 256]), (64, [700]), (64, [1, 64, 300])):
        cu, (q, k, v, g), scaling = _inputs(rng, lens, 2, d)
        x = make_block_inputs(rng, cu, hidden=2 * d, head_dim=d)
        calls = {
            "varlen forward": lambda: cr.varlen_attention_forward(q, k, v, cu, scaling=scaling, precision=precision),
            "varlen backward": lambda: cr.varlen_attention_backward(
                g, q, k, v, *cr.varlen_attention_forward(q, k, v, cu, scaling=scaling, precision=precision), cu,
                scaling=scaling, precision=precision),
            "block forward": lambda: cr.vision_attention_forward(*block_args(x, FWD_ARGS), num_heads=2,
                                                                 precision=precision),
            "block backward": lambda: cr.vision_attention_backward(*block_args(x), num_heads=2, precision=precision),
        }
        for kind, call in calls.items():
            n_asked = len(asked)
            launched.clear()
            call()
            if kind == "varlen forward" and d not in {pd for _, pd in asked[:n_asked]}:
                assert asked[n_asked:] == [("PASSES", d), (f"{tag}_FWD", d), (f"{tag}_BWD", d)], (d, lens)
            if not launched:  # the block's tf32 takes the sm_90a kernels from a sequence of 8 tiles (897 tokens)
                assert kind == "block forward" or (precision == "tf32" and kind.startswith("block")
                                                   and -(-max(lens) // TILE) < HOPPER_TF32_MIN_TILES), (kind, d, lens)
                assert len(asked) == n_asked, f"{kind} at D {d} {lens}: compiled ahead, launched none"
                continue
            late = sorted({name for _, built, name in launched if not built})
            assert not late, f"{kind} at D {d} {lens}: launched before their part was built: {late}"
            assert all(p != "REFERENCE" for (p, _), _, _ in launched), (kind, d, lens, launched)
    assert len(asked) == len(set(asked)), f"a part built twice: {asked}"
    assert {(f"{tag}_BWD", 128), (f"{tag}_BWD", 64)} <= set(asked)


def test_block_backward_builds_its_preparation_beside_the_parts(sm90, rng, monkeypatch):
    """The tf32 block backward on the sm_90a kernels, in a process that has loaded no module yet: the mma.sync
    build whose kernel packs its operands is compiled and loaded by compile_ahead, on a thread of its pool with
    the caller's device current, before the call looks any of its kernels up."""
    import threading

    import cupy

    from cupy_rope import _kernels
    from cupy_rope.attention import kernels as K

    monkeypatch.setattr(sm90, "_AHEAD", set())
    monkeypatch.setattr(_kernels, "_modules", {})
    monkeypatch.setattr(_kernels, "_launchers", {})
    built, looked_up, plans = [], [], []
    building, looking_up = sm90.attn_kernel, K.attn_kernel

    def build(name, precision, d, *a, **kw):
        built.append((name, threading.current_thread().name, cupy.cuda.runtime.getDevice()))
        return building(name, precision, d, *a, **kw)

    def look_up(name, precision, d, *a, **kw):  # was the kernel's module loaded before this lookup?
        key = (cupy.cuda.runtime.getDevice(), "attention", K.build_options(precision, d))
        looked_up.append((name, key in _kernels._modules))
        return looking_up(name, precision, d, *a, **kw)

    monkeypatch.setattr(sm90, "attn_kernel", build)
    monkeypatch.setattr(K, "attn_kernel", look_up)
    cu, _, _ = _inputs(rng, [1100, 300], 2, 64, n=0)
    x = make_block_inputs(rng, cu, hidden=128, head_dim=64)
    out = cr.vision_attention_backward(*block_args(x), num_heads=2, precision="tf32",
                                       plan=lambda p: plans.append(p) or p)
    assert plans[0].hopper and all(bool(cupy.isfinite(o).all()) for o in out)
    device = cupy.cuda.runtime.getDevice()
    assert [(n, t.startswith("cupy_rope-nvrtc"), dev) for n, t, dev in built] == [("prep", True, device)], built
    assert ("prep", True) in looked_up and all(loaded for _, loaded in looked_up), looked_up
