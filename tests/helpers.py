"""Helpers shared by the test modules: error measures, bounds, input builders, and the no-launch check.

Bounds are the README's: the relative Frobenius error of every output against float64. Tests parametrised
over the precision modes take ``(precision, tol)`` pairs from :data:`PRECISION_TOLS`, so the bound a case is
held to is in its id and its arguments, not looked up inside the test.

Nothing here needs a GPU to import; functions that build device arrays import CuPy when called.
"""
from __future__ import annotations

import contextlib
import functools
import math

import ml_dtypes
import numpy as np
import pytest

from cupy_rope.precision import PRECISIONS

__all__ = ["TOL", "ROPE_TOL", "PRECISIONS", "PRECISION_TOLS", "BF16", "GRAD_DTYPES", "BIG_ANGLE", "OUTPUTS",
           "BLOCK_ARGS", "FWD_ARGS", "gpu_problem", "xp_of", "rel_err", "same_bits", "poison", "poisoned_allocations",
           "make_block_inputs", "block_args", "block_heads", "reference_block_backward", "rope_grads",
           "rope_angles", "assert_no_launch"]

# ---- bounds (README) ------------------------------------------------------------------------------------
TOL = {"fp32": 1e-5, "tf32": 5e-3, "bf16": 2e-2}  # attention, every output
ROPE_TOL = 2e-6  # RoPE backward: fp32 arithmetic on exact inputs
assert set(TOL) == set(PRECISIONS)
PRECISION_TOLS = [pytest.param(p, TOL[p], id=p) for p in PRECISIONS]  # @parametrize("precision,tol", ...)

BF16 = np.dtype(ml_dtypes.bfloat16)
GRAD_DTYPES = [pytest.param(BF16, id="bf16"), pytest.param(np.dtype(np.float16), id="f16"),
               pytest.param(np.dtype(np.float32), id="f32")]  # storage of the RoPE gradients
BIG_ANGLE = 1e5  # |theta| up to 1e5 (README: accurate at |θ| of 1e5)

# ---- the vision attention block's arguments and outputs, in call order --------------------------------------
OUTPUTS = ("grad_hidden_states", "grad_qkv_weight", "grad_qkv_bias", "grad_proj_weight", "grad_proj_bias")
BLOCK_ARGS = ("grad_output", "hidden_states", "qkv_weight", "qkv_bias", "proj_weight", "proj_bias", "cos", "sin",
              "cu_seqlens")
FWD_ARGS = BLOCK_ARGS[1:]


@functools.lru_cache(maxsize=None)
def gpu_problem() -> str | None:
    """None when a CUDA GPU is usable, else a one-line reason."""
    try:
        import cupy
    except Exception as e:  # noqa: BLE001 - any import failure means "no usable GPU"
        return f"cupy cannot be imported ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - e.g. CUDARuntimeError cudaErrorNoDevice / InsufficientDriver
        from cupy_rope._gpu import gpu_problem as plain  # says "no driver" rather than "driver too old"

        return plain() or "cupy.cuda.runtime.getDeviceCount() failed"
    if n == 0:
        return "cupy.cuda.runtime.getDeviceCount() returned 0"
    return None


# ---- measures --------------------------------------------------------------------------------------------

def xp_of(*arrays):
    """``cupy`` if any argument is a CuPy array, else ``numpy``."""
    for a in arrays:
        if type(a).__module__.split(".")[0] == "cupy":
            import cupy

            return cupy
    return np


def rel_err(out, ref) -> float:
    """``||out - ref|| / ||ref||`` (Frobenius), computed in float64 on the device of either argument (CuPy or
    NumPy, mixed allowed). NaN or inf anywhere in ``out`` gives NaN, so that every comparison with the result
    fails: ``err <= tol`` and ``err > floor`` alike. Shapes must match."""
    assert tuple(out.shape) == tuple(ref.shape), f"shapes differ: {tuple(out.shape)} vs {tuple(ref.shape)}"
    xp = xp_of(out, ref)
    o = xp.asarray(out).astype(np.float64).ravel()
    r = xp.asarray(ref).astype(np.float64).ravel()
    if not bool(xp.isfinite(o).all()):
        return math.nan
    return float(xp.linalg.norm(o - r) / xp.linalg.norm(r))


def same_bits(a, b) -> bool:
    """Bit-for-bit equality (NaN payloads and signed zeros included) of two arrays of one shape and dtype."""
    if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
        return False
    xp = xp_of(a, b)
    u = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.itemsize]
    return bool(xp.array_equal(a.view(u), b.view(u)))


def poison(shape, dtype=np.float32):
    """A device array of ``shape`` full of NaN: an output buffer any unwritten element shows up in."""
    import cupy

    return cupy.full(shape, np.nan, dtype=dtype)


@contextlib.contextmanager
def poisoned_allocations():
    """Within the block, every device allocation (the ops' own outputs and scratch included) starts as 0xFF bytes:
    NaN in fp32 and bf16, so an element an op never writes shows up; a fresh pool, so that no freed block comes
    back holding an earlier call's results. The previous allocator is restored after."""
    import cupy

    pool = cupy.cuda.MemoryPool()

    def alloc(nbytes):
        mem = pool.malloc(nbytes)
        if nbytes:
            cupy.cuda.runtime.memsetAsync(mem.ptr, 0xFF, nbytes, cupy.cuda.get_current_stream().ptr)
        return mem

    previous = cupy.cuda.get_allocator()
    cupy.cuda.set_allocator(alloc)
    try:
        yield
    finally:
        cupy.cuda.set_allocator(previous)
        cupy.cuda.runtime.deviceSynchronize()
        # The blocks still in use (the results) stay, with their pool kept alive for them; blocks of earlier
        # pools whose arrays have died since are handed back to the device now, so the pools hold no more
        # than what is still alive.
        _POISONED_POOLS.append(pool)
        for p in _POISONED_POOLS:
            p.free_all_blocks()
        _POISONED_POOLS[:] = [p for p in _POISONED_POOLS if p.used_bytes()]


_POISONED_POOLS: list = []


# ---- vision attention block inputs ----------------------------------------------------------------------------

def make_block_inputs(rng, cu, hidden: int, head_dim: int) -> dict:
    """The benchmark's input generation on the device (``rng``: a ``cupy.random.Generator``): grad_output, X, cos, sin
    standard normal; weights x 0.02; biases x 0.01; fp32. ``cu``: the sequence boundaries (T = cu[-1]), stored
    as a device int32 ``cu_seqlens``. Returns a dict keyed by :data:`BLOCK_ARGS`."""
    import cupy

    t = int(cu[-1])
    f = np.float32

    def normal(shape, scale=None):
        if math.prod(shape) == 0:
            return cupy.empty(shape, f)
        a = rng.standard_normal(shape, dtype=f)
        return a if scale is None else a * f(scale)

    return dict(grad_output=normal((t, hidden)), hidden_states=normal((t, hidden)),
                qkv_weight=normal((3 * hidden, hidden), 0.02), qkv_bias=normal((3 * hidden,), 0.01),
                proj_weight=normal((hidden, hidden), 0.02), proj_bias=normal((hidden,), 0.01),
                cos=normal((t, head_dim)), sin=normal((t, head_dim)),
                cu_seqlens=cupy.asarray(cu, dtype=np.int32))


def block_args(x: dict, names=BLOCK_ARGS) -> list:
    """The arrays of ``x`` in call order (``names``: :data:`BLOCK_ARGS`, :data:`FWD_ARGS` or a subset)."""
    return [x[k] for k in names]


def block_heads(x: dict) -> int:
    """Number of heads of inputs built by :func:`make_block_inputs`: hidden // head_dim."""
    return x["hidden_states"].shape[1] // x["cos"].shape[1]


def reference_block_backward(x: dict, scaling=None, num_heads=None):
    """The five gradients in float64 from :mod:`cupy_rope.reference` (on the device of the inputs)."""
    from cupy_rope import reference as R

    return R.vision_attention_backward(*block_args(x), scaling,
                                       num_heads=block_heads(x) if num_heads is None else num_heads)


# ---- RoPE inputs --------------------------------------------------------------------------------------------

def rope_grads(rng, shape, dtype):
    """(grad_cos, grad_sin): standard normal on the device, stored as ``dtype`` (bf16 / f16 / f32)."""
    import cupy

    if math.prod(shape) == 0:
        return cupy.empty(shape, dtype), cupy.empty(shape, dtype)
    return (rng.standard_normal(shape, dtype=np.float32).astype(dtype),
            rng.standard_normal(shape, dtype=np.float32).astype(dtype))


def rope_angles(rng, shape, scale=BIG_ANGLE):
    """float32 angles uniform in [-scale, scale] on the device."""
    return rng.uniform(-scale, scale, size=shape).astype(np.float32)


# ---- nothing launched --------------------------------------------------------------------------------------

@contextlib.contextmanager
def assert_no_launch():
    """Assert that the block launches no kernel and makes no GEMM call through cupy_rope.

    Reads the calling thread's counters ``cupy_rope._kernels.launches()`` and ``cupy_rope._cublas.calls()``
    before and after the block (patching nothing), also when the block raises: wrap the call that must fail,
    ``with assert_no_launch(), pytest.raises(ValueError): op(...)``. CuPy's own kernels (making inputs,
    copies) are not counted."""
    from cupy_rope import _cublas, _kernels

    k0, g0 = _kernels.launches(), _cublas.calls()
    try:
        yield
    finally:
        dk, dg = _kernels.launches() - k0, _cublas.calls() - g0
        if dk or dg:
            raise AssertionError(f"{dk} kernel launch(es) and {dg} GEMM call(s) were made, where validation "
                                 "must have refused the call before anything ran")
