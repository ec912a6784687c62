"""bf16 on fp32 operands on the GPU: the COMPUTE_32F_FAST_16BF product (every candidate the first call times, and
the timed choice) against float64, and the vision attention block in bf16 with its operand casts on and off
(``Plan.cast_operands`` forced both ways): backward and forward into NaN-poisoned outputs, the emitting
(data-parallel) order, the sm_90a kernels where the GPU has them, and a graph handle's replay. Bounds: the
README's, bf16 (relative Frobenius error of every output vs float64 <= 2e-2)."""
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


@pytest.mark.parametrize("shape", SHAPES[:2] + SHAPES[4:],
                         ids=[f"{m}x{n}x{k}{'T' * ta}{'T' * tb}" for m, n, k, ta, tb in SHAPES[:2] + SHAPES[4:]])
def test_bf16_output_of_bf16_operands(shape, rng):
    """c in bf16 (the fp32 sum rounded once, as the block's QKV and dO products on the sm_90a path write it):
    every candidate against float64 within the bf16 bound and at most a few bf16 roundings off; repeat calls
    bit-identical."""
    import cupy

    m, n, k, trans_a, trans_b = shape
    a = rng.standard_normal((k, m) if trans_a else (m, k), dtype=np.float32).astype(C.BF16)
    b = rng.standard_normal((n, k) if trans_b else (k, n), dtype=np.float32).astype(C.BF16)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    ref = (a64.T if trans_a else a64) @ (b64.T if trans_b else b64)
    s = cupy.cuda.get_current_stream().ptr
    c = poison((m, n), C.BF16)
    _cublas.gemm(cupy.asarray(a), cupy.asarray(b), c, trans_a=trans_a, trans_b=trans_b, precision="bf16", stream=s)
    err = rel_err(c, ref)
    assert err <= 2 ** -8, f"{err:.2e}"  # one rounding to 8 significant bits: about 2^-9 relative
    if not _cublas.capturable() or _cublas._lt_library() is None:
        pytest.skip(f"cuBLAS is reached through CuPy's bindings here: {_cublas._lt_problem()}")
    da, db = cupy.asarray(a), cupy.asarray(b)
    plan = _cublas.plan_for(da, db, c, trans_a=trans_a, trans_b=trans_b, precision="bf16")
    assert plan.ex[-1] == _cublas.CUDA_R_16BF
    for i in plan.candidates():
        c = poison((m, n), C.BF16)
        plan.run(i, da, db, c, s, False)
        err = rel_err(c, ref)
        assert err <= 2 ** -8, f"candidate {i}: {err:.2e}"
    first, again = poison((m, n), C.BF16), poison((m, n), C.BF16)
    for out in (first, again):
        _cublas.gemm(da, db, out, trans_a=trans_a, trans_b=trans_b, precision="bf16", stream=s)
    assert same_bits(first, again)


@pytest.mark.parametrize("out_dtype", [np.float32, C.BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES[:1] + SHAPES[4:], ids=["131x1536x512T", "384x1024x384T"])
def test_bias_epilogue(shape, out_dtype, rng, monkeypatch):
    """c = op(a) op(b) + bias (every row, added to the fp32 sum before c's one rounding): every candidate of the
    epilogue's plan against float64, repeat calls bit-identical, and the path without cuBLASLt (bias rows filled
    first, the product added) within the same bound."""
    import cupy

    m, n, k, trans_a, trans_b = shape
    a = cupy.asarray(rng.standard_normal((k, m) if trans_a else (m, k), dtype=np.float32).astype(C.BF16))
    b = cupy.asarray(rng.standard_normal((n, k) if trans_b else (k, n), dtype=np.float32).astype(C.BF16))
    bias = cupy.asarray((rng.standard_normal(n, dtype=np.float32) * np.float32(3)).astype(out_dtype))  # ~ a·b
    a64, b64 = a.get().astype(np.float64), b.get().astype(np.float64)
    ref = (a64.T if trans_a else a64) @ (b64.T if trans_b else b64) + bias.get().astype(np.float64)
    s = cupy.cuda.get_current_stream().ptr
    bound = 2 ** -8 if out_dtype == C.BF16 else 1e-5
    c = poison((m, n), out_dtype)
    _cublas.gemm(a, b, c, trans_a=trans_a, trans_b=trans_b, precision="bf16", stream=s, bias=bias)
    assert rel_err(c, ref) <= bound, f"{rel_err(c, ref):.2e}"
    if not _cublas.capturable() or _cublas._lt_library() is None:
        pytest.skip(f"cuBLAS is reached through CuPy's bindings here: {_cublas._lt_problem()}")
    plan = _cublas.plan_for(a, b, c, trans_a=trans_a, trans_b=trans_b, precision="bf16", bias=bias)
    assert plan.bias and -1 not in plan.candidates()
    for i in plan.candidates():
        c = poison((m, n), out_dtype)
        plan.run(i, a, b, c, s, False, bias=bias)
        assert rel_err(c, ref) <= bound, f"candidate {i}: {rel_err(c, ref):.2e}"
    with pytest.raises(ValueError, match="adds a bias: pass one"):
        plan.run(0, a, b, c, s, False)
    first, again = poison((m, n), out_dtype), poison((m, n), out_dtype)
    for out in (first, again):
        _cublas.gemm(a, b, out, trans_a=trans_a, trans_b=trans_b, precision="bf16", stream=s, bias=bias)
    assert same_bits(first, again)
    monkeypatch.setattr(_cublas, "_lt_library", lambda: None)  # cublasGemmEx: no epilogue
    c = poison((m, n), out_dtype)
    _cublas.gemm(a, b, c, trans_a=trans_a, trans_b=trans_b, precision="bf16", stream=s, bias=bias)
    assert rel_err(c, ref) <= 2 * bound, f"without cuBLASLt: {rel_err(c, ref):.2e}"


@pytest.mark.parametrize("out_dtype", [np.float32, C.BF16], ids=["f32", "bf16"])
def test_bias_of_an_empty_sum(out_dtype, rng):
    """k = 0: every row of c is the bias (an empty product added to it), on every path."""
    import cupy

    a, b = cupy.empty((5, 0), C.BF16), cupy.empty((0, 7), C.BF16)
    bias = cupy.asarray(rng.standard_normal(7, dtype=np.float32).astype(out_dtype))
    c = poison((5, 7), out_dtype)
    _cublas.gemm(a, b, c, trans_a=False, trans_b=False, precision="bf16", stream=cupy.cuda.get_current_stream().ptr,
                 bias=bias)
    assert same_bits(c, cupy.ascontiguousarray(cupy.broadcast_to(bias, (5, 7))))


def test_bias_is_checked_before_any_gemm(rng):
    import cupy

    a = cupy.asarray(rng.standard_normal((64, 32), dtype=np.float32))
    b = cupy.asarray(rng.standard_normal((32, 48), dtype=np.float32))
    c = poison((64, 48))
    s = cupy.cuda.get_current_stream().ptr
    good = cupy.zeros(48, np.float32)
    for bias, exc, match in ((good.get(), TypeError, "bias must be a cupy.ndarray"),
                             (cupy.zeros(47, np.float32), ValueError, "type\\) of its 48 columns"),
                             (good.astype(C.BF16), ValueError, "contiguous float32 vector"),
                             (cupy.zeros(96, np.float32)[::2], ValueError, "contiguous float32 vector"),
                             (cupy.zeros(49, np.float32)[1:], ValueError, "16-byte aligned")):
        with assert_no_launch(), pytest.raises(exc, match=match):
            _cublas.gemm(a, b, c, trans_a=False, trans_b=False, precision="tf32", stream=s, bias=bias)
    with assert_no_launch(), pytest.raises(ValueError, match="a bias or accumulate, not both"):
        _cublas.gemm(a, b, c, trans_a=False, trans_b=False, precision="tf32", stream=s, bias=good, accumulate=True)
    assert bool(cupy.isnan(c).all())


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
    p, t, h, nh, d = api.validate(None, *fwd, 0.0, None, "bf16", forward=True)
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
