"""The attention plan (CPU): make_plan is a pure function of the problem whose fields follow the documented
thresholds, plans are frozen, and a caller's plan is checked to describe the same call."""
from __future__ import annotations

import dataclasses

import pytest

from cupy_rope.attention import plan as P
from cupy_rope.precision import Precision


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("tokens", [1, 131, 2048, 2049, 4096, 4097, 8192, 8193])
@pytest.mark.parametrize("max_tiles", [0, 1, 2, 3, 4, 7, 8, 16, 17, 31, 32, 64])
def test_fields_follow_the_thresholds(precision, tokens, max_tiles):
    p = P.make_plan(precision, head_dim=128, tokens=tokens, max_tiles=max_tiles)
    assert p == P.make_plan(precision, head_dim=128, tokens=tokens, max_tiles=max_tiles)  # pure
    fp32 = precision == "fp32"
    assert p.precision == Precision.parse(precision)
    assert p.kmajor == (precision == "tf32" and P.TF32_KMAJOR)
    assert p.nt == (fp32 and tokens >= P.FP32_NT_MIN_TOKENS)
    assert p.nt_qkv == (fp32 and tokens >= P.FP32_NT_QKV_MIN_TOKENS)
    most = {"fp32": P.FP32_CONCURRENT_MAX_TOKENS, "bf16": P.BF16_CONCURRENT_MAX_TOKENS}.get(precision,
                                                                                         P.CONCURRENT_MAX_TOKENS)
    assert p.concurrent == (tokens <= most)
    assert p.casts_first == (precision == "bf16" and tokens <= P.BF16_CASTS_FIRST_MAX_TOKENS)
    assert not P.make_plan(precision, head_dim=128, tokens=16384, max_tiles=128).concurrent or fp32
    assert p.dq_partials == (max_tiles if fp32 and 0 < max_tiles <= P.DQ_PARTIAL_MAX_TILES else 0)
    assert p.graph == (tokens <= P.GRAPH_MAX_TOKENS)
    key_major = max_tiles >= (P.KEY_MAJOR_MIN_TILES_TF32_128 if precision == "tf32" else P.KEY_MAJOR_MIN_TILES)
    assert (p.head_group > 0) == key_major  # else head-fastest (head_dim 128)
    for d in (64, 80, 96):  # tf32 below head dim 128 as the others
        q = P.make_plan(precision, head_dim=d, tokens=tokens, max_tiles=max_tiles)
        assert (q.head_group > 0) == (max_tiles >= P.KEY_MAJOR_MIN_TILES)
    assert p.specialised == P.HOPPER_SPECIALISED
    assert p.fwd_specialised == (P.HOPPER_FWD_SPECIALISED if precision == "bf16"
                                 else 128 >= P.HOPPER_TF32_FWD_SPECIALISED_MIN_DIM)  # head_dim 128
    for d in (64, 80, 96):
        q = P.make_plan(precision, head_dim=d, tokens=tokens, max_tiles=max_tiles)
        assert q.fwd_specialised == (P.HOPPER_FWD_SPECIALISED if precision == "bf16"
                                     else d >= P.HOPPER_TF32_FWD_SPECIALISED_MIN_DIM)
    assert p.stages == (2 if precision == "tf32" else 1)  # head_dim 128
    assert p.tf32_first_stores == (precision == "tf32")  # measured: never slower (the layout decides where)
    if precision != "tf32":
        with pytest.raises(ValueError, match="tf32_first_stores is a choice of the tf32 backward"):
            dataclasses.replace(p, tf32_first_stores=True)
    q80 = precision == "bf16" and max_tiles >= P.QUERY_ROWS_80_MIN_TILES  # head_dim 128
    assert p.query_rows == (80 if q80 else 64)
    assert p.fwd_keys == (192 if precision == "bf16" and max_tiles >= P.FWD_KEYS_192_MIN_TILES else 128)
    assert p.fused_dq == (precision == "bf16" and 0 < max_tiles <= P.HOPPER_FUSED_DQ_MAX_TILES and not q80)
    dims = {"bf16": P.TAIL_HEAD_DIMS, "tf32": P.TF32_TAIL_HEAD_DIMS, "fp32": ()}[precision]
    for d in (64, 80, 96, 128):
        parts = min(P.TAIL_PARTS_MAX, 2 * max_tiles // P.TAIL_MIN_STEPS) if d in dims else 1
        assert P.make_plan(precision, head_dim=d, tokens=tokens, max_tiles=max_tiles).tail_parts == max(1, parts)
    for d in (64, 80, 96, 128):  # the tf32 specialised forward's last-wave split, from FWD_TAIL_MIN_TILES tiles
        on = precision == "tf32" and d >= P.HOPPER_TF32_FWD_SPECIALISED_MIN_DIM and max_tiles >= P.FWD_TAIL_MIN_TILES
        got = P.make_plan(precision, head_dim=d, tokens=tokens, max_tiles=max_tiles).fwd_tail_parts
        assert got == (P.FWD_TAIL_PARTS_MAX if on and P.FWD_TAIL_MIN_TILES else 1)
    # the persistent forward: bf16 over 128-key tiles, up to FWD_PERSISTENT_MAX_TILES tiles
    assert p.fwd_persistent == (precision == "bf16" and 0 < max_tiles <= P.FWD_PERSISTENT_MAX_TILES
                                and p.fwd_keys == 128)
    assert p.fwd_o_bulk == (p.fwd_persistent and max_tiles <= P.FWD_O_BULK_MAX_TILES[128])
    for d in (64, 80, 96):
        other = P.make_plan(precision, head_dim=d, tokens=tokens, max_tiles=max_tiles)
        assert other.query_rows == 64 and other.fwd_keys == 128
        assert other.fwd_persistent == (precision == "bf16" and 0 < max_tiles <= P.FWD_PERSISTENT_MAX_TILES)
        assert other.fwd_o_bulk == (other.fwd_persistent and max_tiles <= {64: 1, 80: 1, 96: 2}[d])  # as measured
        assert other.fused_dq == (precision == "bf16" and 0 < max_tiles <= P.HOPPER_FUSED_DQ_MAX_TILES)


@pytest.mark.parametrize("units,sms,max_parts,split", [
    (3584, 132, 8, (20, 6)),   # 28 heads x 128 tiles: 27 waves and 20 blocks; 6 parts fill one layer of 120
    (3584, 132, 4, (20, 4)),   # capped by the longest sequence's steps
    (1152, 132, 8, (96, 4)),   # 16 heads x 72 tiles (1 x 9216): 96 left, 4 parts in 3 layers: 0.75 W
    (1792, 132, 2, (0, 1)),    # 76 left, 2 parts in 2 layers of W / 2: no gain
    (1792, 132, 8, (76, 5)),   # 380 parts in 3 layers of W / 5: 0.6 W
    (3696, 132, 8, (0, 1)),    # whole waves
    (100, 132, 8, (0, 1)),     # less than one wave: every block starts at once
    (3584, 132, 1, (0, 1)),    # splitting off
])
def test_tail_split_shortens_the_last_wave(units, sms, max_parts, split):
    """hopper.tail_split: the first R units in P parts each end in ceil(R P / sms) layers of W / P, the fewest
    parts among the best, and only when that beats the unsplit last wave of R blocks."""
    from cupy_rope.attention.hopper import tail_split

    r, p = tail_split(units, sms, max_parts)
    assert (r, p) == split
    if p > 1:
        assert r == units % sms and 2 <= p <= max_parts
        cost = -(-r * p // sms) / p
        assert cost < 1 and all(-(-r * q // sms) / q >= cost for q in range(2, max_parts + 1))


@pytest.mark.parametrize("lens,nh,parts,split", [
    ([16384], 28, 8, (20, 6)),         # 28 heads x 128 query tiles: 27 waves and 20 units, in 6 parts each
    ([4096] * 4, 28, 8, (20, 6)),      # the same units over four sequences
    ([16384], 28, 1, (0, 1)),          # the plan's parts: none
    ([2100, 385], 7, 8, (15, 8)),      # 147 units: the first 15 (the first sequence's tiles, 33 key steps each)
    ([3, 2100, 385], 7, 8, (0, 1)),    # a first unit of one key step: no split
    ([300, 2100, 385], 7, 8, (36, 5)),  # 36 left (two heads' units): 7 parts best, but 300 keys are 5 steps
    ([16384], 33, 8, (0, 1)),          # 4224 units: 32 whole waves
])
def test_forward_tail_splits_the_first_units(lens, nh, parts, split):
    """hopper.forward_tail: the tf32 specialised forward's split of its first R units into P parts over their
    key steps: tail_split's (R, P) on the unit count, P no more than the fewest key steps of those units, and
    nothing for other precisions, the two-stage forward or a plan without parts."""
    import numpy as np

    from cupy_rope.attention import hopper, varlen

    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    table = varlen.tile_table(cu)
    p = dataclasses.replace(P.make_plan("tf32", head_dim=128, tokens=int(cu[-1]), max_tiles=len(table), sm90=True),
                            hopper=True, fwd_specialised=True, fwd_tail_parts=parts)
    assert hopper.forward_tail(table, nh, p, sms=132) == split
    if split[0]:
        assert hopper.forward_tail(table, nh, dataclasses.replace(p, fwd_specialised=False), sms=132) == (0, 1)
        b = P.make_plan("bf16", head_dim=128, tokens=int(cu[-1]), max_tiles=len(table), sm90=True)
        assert hopper.forward_tail(table, nh, dataclasses.replace(b, fwd_tail_parts=parts), sms=132) == (0, 1)
    with pytest.raises(ValueError, match="fwd_tail_parts is a part count"):
        dataclasses.replace(p, fwd_tail_parts=0)


@pytest.mark.parametrize("head_dim,max_tiles,group", [
    (128, 128, 1), (128, 64, 2), (64, 64, 4), (80, 72, 4), (128, 32, 4), (64, 40, 8), (128, 8, 8), (64, 512, 1)])
def test_backward_head_groups_follow_the_l2_budget(head_dim, max_tiles, group):
    """The largest power-of-two group (at most BWD_GROUP_MAX) whose heads' Q and dO of the longest sequence (bf16
    2 bytes a value, tf32 4) fit in BWD_GROUP_BYTES, from KEY_MAJOR_MIN_TILES tiles (the field has no effect off
    the sm_90a kernels)."""
    assert P.bwd_head_group(head_dim, max_tiles) == group
    for value_bytes in (2, 4):
        g, stream = P.bwd_head_group(head_dim, max_tiles, value_bytes), 2 * value_bytes * 128 * max_tiles * head_dim
        assert g & (g - 1) == 0 and 1 <= g <= P.BWD_GROUP_MAX
        assert g == 1 or g * stream <= P.BWD_GROUP_BYTES
        assert g == P.BWD_GROUP_MAX or 2 * g * stream > P.BWD_GROUP_BYTES
    p = P.make_plan("bf16", head_dim=head_dim, tokens=8192, max_tiles=max_tiles, sm90=True)
    assert p.head_group == group
    t = P.make_plan("tf32", head_dim=head_dim, tokens=8192, max_tiles=max_tiles, sm90=True)
    assert t.head_group == P.bwd_head_group(head_dim, max_tiles, 4)
    q = P.make_plan("bf16", head_dim=head_dim, tokens=8192, max_tiles=max_tiles)  # not Hopper: the same field
    assert q.head_group == group
    short = P.make_plan("bf16", head_dim=head_dim, tokens=8192, max_tiles=P.KEY_MAJOR_MIN_TILES - 1, sm90=True)
    assert short.head_group == 0  # head-fastest
    with pytest.raises(ValueError, match="head_group"):
        dataclasses.replace(p, head_group=-1)
    with pytest.raises(ValueError, match="tail_parts"):
        dataclasses.replace(p, tail_parts=0)
    # a caller's plan within what the kernels' 32-bit block order and the grid bound (SPLIT_ROWS_BOUND) hold
    assert dataclasses.replace(p, head_group=P.HEAD_GROUP_LIMIT, tail_parts=P.TAIL_PARTS_MAX).tail_parts == 8
    assert P.HEAD_GROUP_LIMIT * P.GRID_Y_MAX < 2**31
    for field, over in (("head_group", P.HEAD_GROUP_LIMIT + 1), ("tail_parts", P.TAIL_PARTS_MAX + 1),
                        ("fwd_tail_parts", P.FWD_TAIL_PARTS_MAX + 1), ("head_group", 2**20 + 1)):
        with pytest.raises(ValueError, match=f"{field} is a"):
            dataclasses.replace(p, **{field: over})


def test_query_rows_80_only_where_built():
    """80-row query steps: the specialised bf16 backward at head dim 128 without the fused dQ write, as the host
    (hopper.backward) and the kernels (built at hopper.Q80_HEAD_DIMS) have them."""
    from cupy_rope.attention import hopper

    assert P.QUERY_ROWS_80_HEAD_DIMS == hopper.Q80_HEAD_DIMS and hopper.BQ80 == 80
    p = P.make_plan("bf16", head_dim=128, tokens=16384, max_tiles=128, sm90=True)
    assert p.query_rows == 80 and not p.fused_dq
    for bad in (dict(query_rows=72), dict(query_rows=80, fused_dq=True), dict(query_rows=80, specialised=False)):
        with pytest.raises(ValueError, match="query_rows"):
            dataclasses.replace(p, **bad)
    short = P.make_plan("bf16", head_dim=128, tokens=16384, max_tiles=2, sm90=True)
    assert short.query_rows == 64 and dataclasses.replace(short, query_rows=80, fused_dq=False).query_rows == 80
    d80 = P.make_plan("bf16", head_dim=80, tokens=16384, max_tiles=72, sm90=True)
    assert d80.query_rows == 64
    with pytest.raises(ValueError, match="query_rows"):
        dataclasses.replace(d80, query_rows=80)
    with pytest.raises(ValueError, match="query_rows"):
        dataclasses.replace(P.make_plan("tf32", head_dim=128, tokens=16384, max_tiles=128), query_rows=80)
    # and the k192 forward: the specialised bf16 forward at the same head dims
    assert p.fwd_keys == 192 and hopper.BN192 == 192
    for bad in (dict(fwd_keys=160), dict(fwd_keys=192, fwd_specialised=False)):
        with pytest.raises(ValueError, match="fwd_keys"):
            dataclasses.replace(p, **bad)
    with pytest.raises(ValueError, match="fwd_keys"):
        dataclasses.replace(d80, fwd_keys=192)
    assert hopper.smem_bytes("hop_fwd_bf16_ws_k192", 128) <= 227 * 1024
    # the persistent forward is a bf16 kernel's (its shared memory the specialised forward's)
    with pytest.raises(ValueError, match="fwd_persistent"):
        dataclasses.replace(P.make_plan("tf32", head_dim=128, tokens=8192, max_tiles=2), fwd_persistent=True)
    assert hopper.smem_bytes("hop_fwd_bf16_ws_persist", 128) == hopper.smem_bytes("hop_fwd_bf16_ws", 128)
    # the kernels that write dQ from the last key tile hold a step's earlier-tile rows beside the specialised
    # backward's layout ([64][D] fp32), within the 227 KB a block may hold
    for d in (64, 80, 96, 128):
        for k in ("hop_bwd_bf16_ws_plain_dq", "hop_bwd_bf16_ws_plain_dq_split"):
            assert hopper.smem_bytes(k, d) == hopper.smem_bytes("hop_bwd_bf16_ws", d) + 64 * d * 4 <= 227 * 1024
    # the host sizes the q80 layout: Q, dO and dS of 80 rows fill the 227 KB a block may hold
    assert hopper.smem_bytes("hop_bwd_bf16_ws_q80", 128) <= 227 * 1024
    assert hopper.smem_bytes("hop_bwd_bf16_ws_plain_q80", 128) > hopper.smem_bytes("hop_bwd_bf16_ws_plain", 128)


@pytest.mark.parametrize("head_dim,stages", [(64, 2), (80, 2), (96, 2), (128, 2)])
def test_tf32_stages_follow_the_head_dim(head_dim, stages):
    assert P.make_plan("tf32", head_dim=head_dim, tokens=8192, max_tiles=64).stages == stages
    assert P.make_plan("bf16", head_dim=head_dim, tokens=8192, max_tiles=64).stages == 1


def test_dq_partials_need_a_head_dim_multiple_of_16():
    assert P.make_plan("fp32", head_dim=72, tokens=200, max_tiles=2).dq_partials == 0
    with pytest.raises(ValueError, match="multiple of 16"):
        P.Plan(Precision.FP32, 72, 200, False, True, False, True, 2, True)


def test_plans_are_frozen_and_checked():
    p = P.make_plan("tf32", head_dim=64, tokens=300, max_tiles=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.concurrent = False
    with pytest.raises(ValueError, match="kmajor is a tf32 layout"):
        dataclasses.replace(P.make_plan("bf16", head_dim=64, tokens=300, max_tiles=3), kmajor=True)
    with pytest.raises(ValueError, match="fp32 layouts"):
        dataclasses.replace(p, nt=True)
    with pytest.raises(TypeError, match="Precision"):
        dataclasses.replace(p, precision="tf32")


def test_resolve_checks_the_callers_plan():
    chosen = P.make_plan("fp32", head_dim=64, tokens=300, max_tiles=2)
    assert P.resolve(None, chosen, 2) is chosen
    serial = P.resolve(lambda q: dataclasses.replace(q, concurrent=False), chosen, 2)
    assert serial == dataclasses.replace(chosen, concurrent=False)
    with pytest.raises(ValueError, match="tokens"):
        P.resolve(dataclasses.replace(chosen, tokens=301), chosen, 2)
    with pytest.raises(ValueError, match="fewer than the longest sequence"):
        P.resolve(dataclasses.replace(chosen, dq_partials=1), chosen, 2)
    with pytest.raises(TypeError, match="Plan or a function"):
        P.resolve({"concurrent": False}, chosen, 2)


@pytest.mark.parametrize("sm90", [False, True])
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 72, 80, 96, 128])
@pytest.mark.parametrize("tokens", [1, 131, 384, 16384])
@pytest.mark.parametrize("max_tiles", [2, P.HOPPER_TF32_MIN_TILES - 1, P.HOPPER_TF32_MIN_TILES])
def test_hopper_kernels_are_chosen_by_device_precision_head_dim_and_size(sm90, precision, head_dim, tokens,
                                                                          max_tiles):
    p = P.make_plan(precision, head_dim=head_dim, tokens=tokens, max_tiles=max_tiles, sm90=sm90)
    # bf16 at every size, tf32 by the longest sequence
    size = precision == "bf16" or (precision == "tf32" and max_tiles >= P.HOPPER_TF32_MIN_TILES)
    assert p.hopper == (sm90 and head_dim in P.HOPPER_HEAD_DIMS and size)
    assert not P.make_plan(precision, head_dim=head_dim, tokens=tokens, max_tiles=max_tiles).hopper  # no sm_90a


def test_hopper_plans_are_checked():
    p = P.make_plan("fp32", head_dim=128, tokens=4096, max_tiles=2, sm90=True)
    with pytest.raises(ValueError, match="sm_90a kernels run bf16 and tf32"):
        dataclasses.replace(p, hopper=True)
    b = P.make_plan("bf16", head_dim=72, tokens=4096, max_tiles=2, sm90=True)
    assert not b.hopper
    with pytest.raises(ValueError, match="head dims"):
        dataclasses.replace(b, hopper=True)
    fallback = P.resolve(lambda q: dataclasses.replace(q, hopper=False),
                         P.make_plan("bf16", head_dim=128, tokens=4096, max_tiles=2, sm90=True), 2)
    assert not fallback.hopper


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_in_place_operands_are_bf16_only(precision):
    """bf16 reads its products' outputs in place on the sm_90a kernels (HOPPER_IN_PLACE); the field is refused in
    the other modes, and has no effect where the plan does not take the sm_90a kernels."""
    p = P.make_plan(precision, head_dim=128, tokens=8192, max_tiles=2, sm90=True)
    assert p.in_place == (precision == "bf16" and P.HOPPER_IN_PLACE)
    if precision != "bf16":
        with pytest.raises(ValueError, match="in_place is a bf16 choice"):
            dataclasses.replace(p, in_place=True)
    else:
        assert not dataclasses.replace(p, in_place=False).in_place
        assert dataclasses.replace(p, hopper=False).in_place == p.in_place  # the fallback keeps the field, unused


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("tokens", [1, 131, 511, 513, 8192])
@pytest.mark.parametrize("sm90", [False, True])
def test_bf16_operand_casts_are_chosen_by_tokens(precision, tokens, sm90):
    p = P.make_plan(precision, head_dim=128, tokens=tokens, max_tiles=2, sm90=sm90)
    assert p.cast_operands == (precision == "bf16")  # measured: the casts pay at every size on the H200
    assert P.make_plan(precision, head_dim=128, tokens=tokens, max_tiles=2, sm90=sm90) == p  # pure


def test_bf16_operand_casts_are_overridable_and_checked():
    small = P.make_plan("bf16", head_dim=128, tokens=131, max_tiles=1)
    big = P.make_plan("bf16", head_dim=128, tokens=8192, max_tiles=2)
    assert small.cast_operands and big.cast_operands  # measured: the casts pay at every size on the H200
    forced = P.resolve(lambda q: dataclasses.replace(q, cast_operands=False), small, 1)
    assert not forced.cast_operands and forced == dataclasses.replace(small, cast_operands=False)
    assert not P.resolve(dataclasses.replace(big, cast_operands=False), big, 2).cast_operands
    assert forced != small and hash(forced) != hash(small)  # a graph handle keys its recordings by the plan
    for precision in ("fp32", "tf32"):
        with pytest.raises(ValueError, match="cast_operands is a bf16 choice"):
            dataclasses.replace(P.make_plan(precision, head_dim=128, tokens=8192, max_tiles=2), cast_operands=True)
    # positional construction (the fields before it) keeps working: the field defaults to reading fp32 as stored
    assert not P.Plan(Precision.BF16, 128, 131, False, False, False, True, 0, True).cast_operands


def test_stages_are_one_or_two():
    p = P.make_plan("tf32", head_dim=128, tokens=8192, max_tiles=64)
    assert dataclasses.replace(p, stages=1).stages == 1
    with pytest.raises(ValueError, match="stages is 1 or 2"):
        dataclasses.replace(p, stages=3)


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("max_tiles", [0, 1, 2, 3, 8])
@pytest.mark.parametrize("runs", [None, 0, 1, 2, 4, 5])
@pytest.mark.parametrize("tokens", [131, 1023, 1024, 8192])
@pytest.mark.parametrize("sm90", [False, True])
def test_dense_form_follows_length_runs_and_precision(precision, max_tiles, runs, tokens, sm90):
    """The dense form: fp32 and tf32 (never on the sm_90a kernels), every sequence within DENSE_MAX_TILES tiles,
    at most DENSE_MAX_RUNS runs of one length, from DENSE_MIN_TOKENS tokens, and only when the runs are known; it
    takes no dQ partials."""
    p = P.make_plan(precision, head_dim=128, tokens=tokens, max_tiles=max_tiles, sm90=sm90, runs=runs)
    pr = Precision.parse(precision)
    want = (precision != "bf16" and not p.hopper and runs is not None and 0 < runs <= P.DENSE_MAX_RUNS[pr]
            and tokens >= P.DENSE_MIN_TOKENS[pr] and 0 < max_tiles <= P.DENSE_MAX_TILES)
    assert p.dense == want
    if p.dense:
        assert p.dq_partials == 0
    assert p.dense_in_place == (p.dense and P.DENSE_IN_PLACE)
    assert not P.make_plan(precision, head_dim=128, tokens=tokens, max_tiles=max_tiles, sm90=sm90).dense


def test_dense_form_thresholds_as_measured():
    """fp32 takes the dense form on up to four runs at any size, tf32 on one run from 1024 tokens."""
    assert P.make_plan("fp32", head_dim=128, tokens=131, max_tiles=2, runs=4).dense
    assert not P.make_plan("fp32", head_dim=128, tokens=131, max_tiles=2, runs=5).dense
    assert P.make_plan("tf32", head_dim=128, tokens=1024, max_tiles=2, runs=1).dense
    assert not P.make_plan("tf32", head_dim=128, tokens=1024, max_tiles=2, runs=2).dense
    assert not P.make_plan("tf32", head_dim=128, tokens=1023, max_tiles=2, runs=1).dense


@pytest.mark.parametrize("precision", ["fp32", "tf32"])
@pytest.mark.parametrize("runs", [1, 2, 4])
@pytest.mark.parametrize("tokens", [131, 1023, 1024, 8192])
def test_varlen_forward_keeps_the_dense_form_where_measured(precision, runs, tokens):
    """The varlen API's forward alone takes the dense form only where dense_forward says so (fp32: one run of
    fewer than 1024 tokens); its backward follows the block's plan; a caller's plan still forces either form."""
    from cupy_rope.attention import flash

    pr = Precision.parse(precision)
    backward = flash._library_plan(pr, 128, tokens, 2, False, runs, False)
    forward = flash._library_plan(pr, 128, tokens, 2, False, runs, True)
    assert backward == P.make_plan(precision, head_dim=128, tokens=tokens, max_tiles=2, runs=runs)
    keeps = precision == "tf32" or (runs == 1 and tokens < 1024)
    assert P.dense_forward(precision, tokens, runs) == keeps
    assert forward.dense == (backward.dense and keeps)
    assert dataclasses.replace(forward, dense=backward.dense, dense_in_place=backward.dense_in_place) == backward
    assert P.resolve(lambda c: dataclasses.replace(c, dense=True), forward, 2).dense


def test_varlen_forward_dense_rule_as_measured():
    """fp32: the flash forward on two runs and from 1024 tokens, the dense one on one short run."""
    assert P.dense_forward("fp32", 256, 1) and not P.dense_forward("fp32", 211, 2)
    assert not P.dense_forward("fp32", 8192, 1) and not P.dense_forward("fp32", 1024, 1)
    assert P.make_plan("fp32", head_dim=128, tokens=8192, max_tiles=2, runs=1).dense  # the backward's stays


def test_dense_plans_are_checked():
    base = P.make_plan("bf16", head_dim=128, tokens=256, max_tiles=2, sm90=True)
    with pytest.raises(ValueError, match="dense"):
        dataclasses.replace(base, dense=True)
    tf32 = P.make_plan("tf32", head_dim=128, tokens=2048, max_tiles=2, runs=1)
    assert tf32.dense
    with pytest.raises(ValueError, match="dense"):
        dataclasses.replace(tf32, hopper=True)
    flash = dataclasses.replace(tf32, dense=False, dense_in_place=False)
    with pytest.raises(ValueError, match="dense_in_place is a choice of the dense form"):
        dataclasses.replace(flash, dense_in_place=True)


def test_resolve_refuses_the_dense_form_on_long_sequences():
    chosen = P.make_plan("fp32", head_dim=64, tokens=600, max_tiles=3, runs=1)
    assert not chosen.dense
    with pytest.raises(ValueError, match="dense"):
        P.resolve(lambda p: dataclasses.replace(p, dense=True), chosen, 3)
    ok = P.make_plan("fp32", head_dim=64, tokens=512, max_tiles=2, runs=1)
    assert P.resolve(lambda p: dataclasses.replace(p, dense=True), ok, 2).dense


@pytest.mark.parametrize("precision, most", [("bf16", 65535 - 1024), ("tf32", (65535 - 1024) // 2)])
def test_hopper_backward_only_where_its_grid_holds_the_call(precision, most):
    """The sm_90a backward puts the key units (tiles in bf16, 64-key halves in tf32, plus a tail split's rows) on
    the grid's second dimension, at most 65535 blocks: past that the backward takes the mma.sync kernels, in the
    block and in the varlen API (whose forward alone, on a grid of query tiles, keeps the sm_90a kernels), and a
    caller's plan forcing them is refused before any launch."""
    from cupy_rope.attention import flash

    pr = Precision.parse(precision)
    assert P.hopper_backward_fits(pr, most) and not P.hopper_backward_fits(pr, most + 1)
    # the worst tail split: fewer than 144 SMs' worth of units in TAIL_PARTS_MAX parts, over one head
    assert 144 * (P.TAIL_PARTS_MAX - 1) <= P.SPLIT_ROWS_BOUND
    for tiles, fits in ((most, True), (most + 1, False)):
        kw = dict(head_dim=64, tokens=tiles * 100, max_tiles=8, sm90=True, runs=2)
        assert P.make_plan(precision, tiles=tiles, **kw).hopper == fits
        assert P.make_plan(precision, **kw).hopper  # tiles not known: taken to fit
        backward = flash._library_plan(pr, 64, tiles * 100, 8, True, 2, False, tiles)
        forward = flash._library_plan(pr, 64, tiles * 100, 8, True, 2, True, tiles)
        assert backward.hopper == fits and forward.hopper
        force = lambda c: dataclasses.replace(c, hopper=True)  # noqa: E731
        assert P.resolve(force, forward, 8, tiles, backward=False).hopper
        if fits:
            assert P.resolve(force, backward, 8, tiles).hopper
        else:
            with pytest.raises(ValueError, match="grid cannot hold this call's"):
                P.resolve(force, backward, 8, tiles)


def test_tf32_hopper_backward_only_while_k_by_tile_stays_near_k():
    """tf32's sm_90a backward lays K^T out by tile (TILE columns a tile): on sequences far shorter than a tile that is
    many times K, so past TF32_KT_PAD_MAX times K the library takes the mma.sync kernels for the backward, in the
    block and in the varlen API; the forward alone, bf16, and a caller's plan forcing the sm_90a kernels are not
    touched."""
    from cupy_rope.attention import flash

    tiles = P.TF32_KT_PAD_MAX * 1024 // P.TILE  # their columns exactly TF32_KT_PAD_MAX times 1024 tokens
    for tokens, fits in ((1024, True), (1023, False), (tiles, False)):  # the last: one-token sequences
        kw = dict(head_dim=128, tokens=tokens, max_tiles=8, sm90=True, runs=2, tiles=tiles)
        assert P.library_hopper_backward("tf32", tiles, tokens) == fits
        assert P.library_hopper_backward("bf16", tiles, tokens)
        assert P.make_plan("tf32", **kw).hopper == fits
        assert P.make_plan("bf16", **kw).hopper
        tf32 = Precision.TF32
        backward = flash._library_plan(tf32, 128, tokens, 8, True, 2, False, tiles)
        assert backward.hopper == fits
        assert flash._library_plan(tf32, 128, tokens, 8, True, 2, True, tiles).hopper
        forced = P.resolve(lambda c: dataclasses.replace(c, hopper=True), backward, 8, tiles)
        assert forced.hopper  # the grid holds it: a caller may still ask for it
    # one run of equal lengths (16 tokens x 64): off the sm_90a kernels the tf32 backward takes the dense form,
    # as it does on GPUs before Hopper; a caller forcing the sm_90a kernels turns that off
    one_run = flash._library_plan(Precision.TF32, 64, 1024, 1, True, 1, False, 64)
    assert not one_run.hopper and one_run.dense
    assert one_run == flash._library_plan(Precision.TF32, 64, 1024, 1, False, 1, False, 64)
    with pytest.raises(ValueError, match="dense"):
        P.resolve(lambda c: dataclasses.replace(c, hopper=True), one_run, 1, 64)
    forced = P.resolve(lambda c: dataclasses.replace(c, hopper=True, dense=False, dense_in_place=False), one_run, 1,
                       64)
    assert forced.hopper and not forced.dense
