"""Public functions of the vision attention block, and the validation of their arguments.

Everything a call can get wrong is checked here, on the host, before any launch: types, dtypes, shapes, layouts,
alignment, sizes, ``num_heads``, ``scaling``, ``attention_dropout`` and the values of ``cu_seqlens``.
"""
from __future__ import annotations

import numpy as np

from .. import _checks as C
from ..precision import Precision
from . import hopper, plan as _plan
from . import schedule, varlen as _varlen
from .kernels import HEAD_DIMS

OUTPUTS = ("grad_hidden_states", "grad_qkv_weight", "grad_qkv_bias", "grad_proj_weight", "grad_proj_bias")


def validate(grad_output, hidden_states, qkv_weight, qkv_bias, proj_weight, proj_bias, cos, sin, cu_seqlens,
             attention_dropout, num_heads, precision, *, forward: bool = False):
    """Shape/dtype/layout checks of everything (no ``grad_output`` for the ``forward``, which passes None) and of
    the form of ``cu_seqlens`` (its values are checked by :func:`varlen.resolve`); returns (Precision, T, H, NH,
    D)."""
    p = Precision.parse(precision)
    C.attention_dropout(attention_dropout)
    arrays = dict(grad_output=grad_output, hidden_states=hidden_states, qkv_weight=qkv_weight, qkv_bias=qkv_bias,
                  proj_weight=proj_weight, proj_bias=proj_bias, cos=cos, sin=sin)
    if forward:
        del arrays["grad_output"]
    C.require_one_device({**arrays, "cu_seqlens": cu_seqlens})
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
    nh = h // d if num_heads is None else C.require_int(num_heads, "num_heads", minimum=1)
    if nh == 0:
        raise ValueError(f"hidden size {h} must be a positive multiple of head_dim {d}")
    if nh * d != h:
        raise ValueError(f"hidden size {h} must equal num_heads * head_dim = {nh} * {d}")
    shapes = dict(grad_output=(t, h), qkv_weight=(3 * h, h), qkv_bias=(3 * h,), proj_weight=(h, h),
                  proj_bias=(h,), cos=(t, d), sin=(t, d))
    for name, shape in shapes.items():
        if name in arrays:
            C.require_shape(arrays[name], name, shape, f" (tokens={t}, hidden={h}, head_dim={d})")
    for name, x in arrays.items():
        C.require_kernel_operand(x, name)
    C.check_cu_seqlens_form(cu_seqlens)
    if cu_seqlens.shape[0] - 1 > 2**31 - 1:
        raise ValueError("too many sequences for int32 indexing")
    C.check_token_limits(t, h, nh)
    return p, t, h, nh, d


def choose_plan(p: Precision, d: int, vl, plan=None, backward: bool = True) -> _plan.Plan:
    """The plan of a call: the library's (:func:`plan.make_plan`), or the caller's override. For a ``backward``
    on the sm_90a kernels, the parts of them it runs are compiled ahead, side by side, and so is the mma.sync
    build whose preparation kernel packs its operands, where it runs that (the block's forward runs the
    mma.sync kernels on every GPU)."""
    sm90 = hopper.supported()
    chosen = _plan.make_plan(p, head_dim=d, tokens=vl.tokens, max_tiles=vl.max_tiles, sm90=sm90,
                             runs=len(vl.runs), tiles=vl.ntiles)
    chosen = _plan.resolve(plan, chosen, vl.max_tiles, vl.ntiles, backward=backward)
    hopper.require_supported(chosen.hopper, sm90)
    if backward and chosen.hopper and vl.tokens:
        hopper.compile_ahead(chosen, prepare=not schedule.reads_in_place(chosen))
    return chosen


def vision_attention_backward(grad_output, hidden_states, qkv_weight, qkv_bias, proj_weight, proj_bias, cos, sin,
                              cu_seqlens, attention_dropout=0.0, scaling=None, *, num_heads=None,
                              precision="tf32", stream=None, plan=None, on_output=None):
    """All five gradients of the fused varlen vision attention block with 2D RoPE.

    Args:
        grad_output: fp32 ``[T, H]``, the gradient of the block's output.
        hidden_states: fp32 ``[T, H]``; qkv_weight fp32 ``[3H, H]``; qkv_bias ``[3H]``;
            proj_weight ``[H, H]``; proj_bias ``[H]``; cos, sin fp32 ``[T, D]`` (any values: not assumed
            to be rotary tables). All C-contiguous and 16-byte aligned.
        cu_seqlens: int32 (or int64) ``[N+1]``, cupy or numpy: sequence boundaries, 0 first, T last,
            non-decreasing (empty sequences allowed). A NumPy array needs no read-back from the device, and is
            required when the call is captured into the caller's CUDA graph.
        attention_dropout: must be 0.0 (a dropout backward needs the forward's mask).
        scaling: softmax scale, a finite number (default ``D ** -0.5``).
        num_heads: an int, default ``H // D``.
        precision: ``"tf32"`` (default), ``"fp32"`` or ``"bf16"`` (see the README for error bounds).
        stream: a ``cupy.cuda.Stream``; default the current stream.
        plan: advanced: a :class:`cupy_rope.attention.plan.Plan` for this call, or a function of the library's
            plan returning one (lab and tests).
        on_output: advanced: ``on_output(name, array, stream_ptr)`` is called once the last work producing output
            ``name`` has been enqueued on ``stream_ptr`` (to start communicating it early). With it, the weight
            gradient of the QKV projection comes as three row blocks ``"grad_qkv_weight[i]"`` (q, k, v; views of
            the returned array), computed before ``grad_hidden_states``.

    Returns:
        ``(grad_hidden_states [T, H], grad_qkv_weight [3H, H], grad_qkv_bias [3H], grad_proj_weight [H, H],
        grad_proj_bias [H])``, all fp32.
    """
    p, t, h, nh, d = validate(grad_output, hidden_states, qkv_weight, qkv_bias, proj_weight, proj_bias, cos, sin,
                              cu_seqlens, attention_dropout, num_heads, precision)
    if on_output is not None and not callable(on_output):
        raise TypeError(f"on_output must be a function (name, array, stream_ptr) or None, got "
                        f"{type(on_output).__name__}")
    scaling = C.attention_scaling(scaling, d)
    ctx, s = C.on_stream(stream)
    with ctx:
        return run_backward(grad_output, hidden_states, qkv_weight, qkv_bias, proj_weight, cos, sin,
                            _varlen.read_async(cu_seqlens, s), t, h, nh, d, scaling, p, s, plan=plan,
                            on_output=on_output)


def grad_shapes(t: int, h: int) -> dict:
    """The shapes of a backward's five fp32 outputs, by name in OUTPUTS' order."""
    return dict(zip(OUTPUTS, ((t, h), (3 * h, h), (3 * h,), (h, h), (h,))))


def empty_grads(t: int, h: int):
    """The five fp32 output arrays of a backward (uninitialised)."""
    import cupy

    return tuple(cupy.empty(shape, np.float32) for shape in grad_shapes(t, h).values())


def run_backward(grad_output, hidden_states, qkv_weight, qkv_bias, proj_weight, cos, sin, pending, t, h, nh, d,
                 scaling, p, s, *, plan=None, outs=None, hook=None, on_output=None):
    """The backward of validated arguments on stream ``s`` (current): outputs first, while a device cu_seqlens
    is on its way back; its values are checked before any launch."""
    outs = empty_grads(t, h) if outs is None else outs
    vl = _varlen.resolve(pending, t)
    chosen = choose_plan(p, d, vl, plan)
    if t == 0:
        for z in outs[1:]:
            z.fill(0)
        if on_output is not None:
            for name, z in zip(OUTPUTS, outs):
                if name == "grad_qkv_weight":
                    for i in range(3):
                        on_output(f"grad_qkv_weight[{i}]", z[i * h:(i + 1) * h], s)
                else:
                    on_output(name, z, s)
        return outs
    schedule.backward(grad_output, hidden_states, qkv_weight, qkv_bias, proj_weight, cos, sin, vl, nh, scaling,
                      chosen, s, outs, hook=hook, on_output=on_output)
    return outs


def vision_attention_forward(hidden_states, qkv_weight, qkv_bias, proj_weight, proj_bias, cos, sin, cu_seqlens,
                             scaling=None, *, num_heads=None, precision="tf32", stream=None, plan=None):
    """Output ``[T, H]`` (fp32) of the attention block whose gradients :func:`vision_attention_backward`
    computes, from the same kernels (QKV GEMM, bias + RoPE on load, flash attention, projection GEMM)."""
    import cupy

    p, t, h, nh, d = validate(None, hidden_states, qkv_weight, qkv_bias, proj_weight, proj_bias, cos, sin,
                              cu_seqlens, 0.0, num_heads, precision, forward=True)
    scaling = C.attention_scaling(scaling, d)
    ctx, s = C.on_stream(stream)
    with ctx:
        out = cupy.empty((t, h), np.float32)
        vl = _varlen.resolve(_varlen.read_async(cu_seqlens, s), t)
        chosen = choose_plan(p, d, vl, plan, backward=False)
        if t:
            schedule.forward(hidden_states, qkv_weight, qkv_bias, proj_weight, proj_bias, cos, sin, vl, nh, scaling,
                             chosen, s, out)
    return out
