"""bf16 on fp32 operands on the GPU: the COMPUTE_32F_FAST_16BF product (every candidate the first call times, and
the timed choice) against float64, and the vision attention block in bf16 with its operand casts on and off
(``Plan.cast_operands`` forced both ways): backward and forward into NaN-poisoned outputs, the emitting
(data-parallel) order, the sm_90a kernels where the GPU has them, and a graph handle's replay. Bounds: SPEC
section 3, bf16 (relative Frobenius error of every output vs float64 <= 2e-2)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cupy_rope import _checks as C
from cupy_rope import _cublas, _kernels
from cupy_rope import workloads as W
from tests.helpers import (
    FWD_ARGS,
    OUTPUTS,
    TOL,
    assert_no_launch,
    block_args,
    block_heads,
    make_block_inputs,
    poison,
    reference_block_backward,
    rel_err,
    same_bits,
)

pytestmark = pytest.mark.gpu
BOUND = TOL["bf16"]
# (m, n, k, trans_a, trans_b): the layouts the block's products use (QKV, dO, grad_hidden from grad_qkv^T,
# grad_qkv_weight from grad_qkv^T, and a square one), with row counts off the 128-row split.
SHAPES = [(131, 1536, 512, False, True), (131, 512, 512, False, False), (300, 512, 1536, True, False),
          (1536, 512, 300, False, False), (384, 1024, 384, False, True)]


def _cast(flag, **more):
    """A plan= override: the library's plan with cast_operands (and any ``more`` fields) replaced."""
    return lambda p: dataclasses.replace(p, cast_operands=flag, **more)


# ---- the product ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", SHAPES, ids=[f"{m}x{n}x{k}{'T' * ta}{'T' * tb}" for m, n, k, ta, tb in SHAPES])
def test_fast16_product_on_fp32_operands(shape, rng):
    import cupy

    m, n, k, trans_a, trans_b = shape
    pad = 32  # operands given as the first columns of wider arrays, as the schedule passes grad_qkv^T
    a = rng.standard_normal((k, m + pad) if trans_a else (m, k + pad), dtype=np.float32)
    a = a[:, :m] if trans_a else a[:, :k]
    b = rng.standard_normal((n, k) if trans_b else (k, n), dtype=np.float32)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    ref = (a64.T if trans_a else a64) @ (b64.T if trans_b else b64)
    s = cupy.cuda.get_current_stream().ptr
    c = poison((m, n))
    _cublas.gemm(a, b, c, trans_a=trans_a, trans_b=trans_b, precision="bf16", stream=s)
    err = rel_err(c, ref)
    assert err <= BOUND, f"{err:.2e}"
    if not _cublas.capturable() or _cublas._lt_library() is None:
        pytest.skip(f"cuBLAS is reached through CuPy's bindings here: {_cublas._lt_problem()}")
    plan = _cublas.plan_for(a, b, c, trans_a=trans_a, trans_b=trans_b, precision="bf16")
    assert plan.ex[5:7] == (_cublas.CUDA_R_32F, _cublas.COMPUTE_32F_FAST_16BF)
    for i in plan.candidates():  # cublasGemmEx's kernel, the row split, every cublasLt candidate
        c = poison((m, n))
        plan.run(i, a, b, c, s, False)
        err = rel_err(c, ref)
        assert err <= BOUND, f"candidate {i}: {err:.2e}"
    first, again = poison((m, n)), poison((m, n))
    for out in (first, again):
        _cublas.gemm(a, b, out, trans_a=trans_a, trans_b=trans_b, precision="bf16", stream=s)
    assert same_bits(first, again)


def test_mixed_operands_refused_before_any_gemm(rng):
    import cupy

    a = rng.standard_normal((64, 32), dtype=np.float32)
    b = rng.standard_normal((32, 48), dtype=np.float32)
    c = poison((64, 48))
    s = cupy.cuda.get_current_stream().ptr
    for x, y in ((a, b.astype(C.BF16)), (a.astype(C.BF16), b)):
        with assert_no_launch(), pytest.raises(TypeError, match="both be bfloat16 or both float32"):
            _cublas.gemm(x, y, c, trans_a=False, trans_b=False, precision="bf16", stream=s)


# ---- the block ---------------------------------------------------------------------------------------------

CASES = {"varied": ([1, 64, 0, 130, 17], 256, 64), "seed131": ([131], W.ATTN_HIDDEN, W.ATTN_HEAD_DIM)}


def _hopper_or_skip(flag: bool) -> None:
    from cupy_rope.attention import hopper

    if flag and not hopper.supported():
        pytest.skip("the GPU is not sm_90 (Hopper): the sm_90a kernels do not run here")


def _backward(x, plan, on_output=None):
    """The five gradients written into NaN-poisoned outputs, and the kernel launches the call made."""
    import cupy

    from cupy_rope.attention import api
    from cupy_rope.attention import varlen as V

    p, t, h, nh, d = api.validate(*block_args(x), 0.0, None, "bf16")
    outs = tuple(poison(shape) for shape in ((t, h), (3 * h, h), (3 * h,), (h, h), (h,)))
    s = cupy.cuda.get_current_stream().ptr
    k0 = _kernels.launches()
    api.run_backward(*block_args(x, ("grad_output", "hidden_states", "qkv_weight", "qkv_bias", "proj_weight",
                                     "cos", "sin")), V.read_async(x["cu_seqlens"], s), t, h, nh, d, d ** -0.5, p,
                     s, plan=plan, outs=outs, on_output=on_output)
    return outs, _kernels.launches() - k0


def _check(outs, ref, what):
    errs = {name: rel_err(o, r) for name, o, r in zip(OUTPUTS, outs, ref)}
    assert all(e <= BOUND for e in errs.values()), f"{what}: " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items())


@pytest.mark.parametrize("hopper", [False, True], ids=["mma", "sm90"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_block_backward_with_and_without_casts(case, hopper, rng):
    _hopper_or_skip(hopper)
    lens, hidden, head_dim = CASES[case]
    x = make_block_inputs(rng, W.cu_seqlens_of(lens), hidden, head_dim)
    ref = reference_block_backward(x)
    launches = {}
    for cast in (True, False):
        plan = _cast(cast, hopper=hopper)
        outs, launches[cast] = _backward(x, plan)
        _check(outs, ref, f"{case}, cast_operands={cast}, hopper={hopper}")
        again, _ = _backward(x, plan)
        assert all(same_bits(a, b) for a, b in zip(outs, again)), f"cast_operands={cast}: two runs differ"
    assert launches[True] > launches[False], f"the casts did not go away: {launches}"  # the plan was followed


@pytest.mark.parametrize("cast", [True, False], ids=["cast", "fp32"])
def test_block_backward_emitting_order(cast, rng):
    """The data-parallel order (grad_qkv_weight first, in three row blocks: other products, so other bits) is
    within the bound too, and reports every output."""
    x = make_block_inputs(rng, W.cu_seqlens_of(CASES["varied"][0]), 256, 64)
    seen = []
    outs, _ = _backward(x, _cast(cast), on_output=lambda name, arr, stream: seen.append(name))
    _check(outs, reference_block_backward(x), f"emitting, cast_operands={cast}")
    assert sorted(seen) == sorted(["grad_proj_bias", "grad_proj_weight", "grad_qkv_bias", "grad_hidden_states",
                                   "grad_qkv_weight[0]", "grad_qkv_weight[1]", "grad_qkv_weight[2]"])


@pytest.mark.parametrize("case", sorted(CASES))
def test_block_forward_with_and_without_casts(case, rng):
    import cupy

    from cupy_rope import reference as R
    from cupy_rope.attention import api, schedule
    from cupy_rope.attention import varlen as V

    lens, hidden, head_dim = CASES[case]
    x = make_block_inputs(rng, W.cu_seqlens_of(lens), hidden, head_dim)
    fwd = block_args(x, FWD_ARGS)
    ref = R.vision_attention_forward(*fwd, num_heads=block_heads(x))
    p, t, h, nh, d = api.validate(None, *fwd, 0.0, None, "bf16")
    s = cupy.cuda.get_current_stream().ptr
    vl = V.resolve(V.read_async(x["cu_seqlens"], s), t)
    launches = {}
    for cast in (True, False):
        out = poison((t, h))
        k0 = _kernels.launches()
        schedule.forward(*fwd[:-1], vl, nh, d ** -0.5, api.choose_plan(p, d, vl, _cast(cast)), s, out)
        launches[cast] = _kernels.launches() - k0
        err = rel_err(out, ref)
        assert err <= BOUND, f"forward, cast_operands={cast}: {err:.2e}"
    assert launches[True] > launches[False], f"the casts did not go away: {launches}"


@pytest.mark.parametrize("cast", [True, False], ids=["cast", "fp32"])
def test_graph_handle_replays_without_casts(cast, rng):
    """The per-layer handle records the FAST_16BF products into its graph: the replay, into outputs poisoned in
    between, is within the bound and repeats its bits."""
    import cupy

    import cupy_rope as cr

    lens = CASES["varied"][0]
    x = make_block_inputs(rng, W.cu_seqlens_of(lens), 256, 64)
    ref = reference_block_backward(x)
    handle = cr.VisionAttentionBackward(np.asarray(W.cu_seqlens_of(lens), np.int32), hidden_size=256, head_dim=64,
                                        precision="bf16", plan=_cast(cast))
    assert handle.plan.cast_operands == cast and handle.plan.graph
    block = block_args(x)[:-1]
    for _ in range(2):  # direct, then recorded
        handle(*block)
    replays = []
    for _ in range(2):
        outs = handle(*block)
        for o in outs:
            o.fill(np.nan)
        outs = handle(*block)
        cupy.cuda.get_current_stream().synchronize()
        _check(outs, ref, f"graph replay, cast_operands={cast}")
        replays.append([o.copy() for o in outs])
    assert handle.replays >= 3
    assert all(same_bits(a, b) for a, b in zip(*replays))
