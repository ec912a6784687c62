"""Inputs for the distributed benchmark and self-check: a whole batch made identically on every rank (seeded
on the GPU), and each rank's row slices of it."""
from __future__ import annotations

import hashlib

import numpy as np

TOL = {"fp32": 1e-5, "tf32": 5e-3, "bf16": 2e-2}  # the README's bounds: relative Frobenius error, every output


def cu_from_lengths(lengths) -> np.ndarray:
    return np.concatenate(([0], np.cumsum(np.asarray(lengths, dtype=np.int64)))).astype(np.int32)


def short_lengths(n: int = 64, lo: int = 105, hi: int = 256, seed: int = 0) -> np.ndarray:
    """``n`` sequence lengths drawn uniformly from [lo, hi] by a seeded NumPy generator (the same everywhere)."""
    return np.random.default_rng(seed).integers(lo, hi + 1, n)


def make_batch(cu: np.ndarray, hidden: int, head_dim: int, seed: int = 0) -> dict:
    """The benchmark's inputs for the whole batch, as in the one-GPU benchmark: activations and cos/sin standard
    normal, weights × 0.02, biases × 0.01, fp32, from a seeded CuPy generator, so every rank holds the same batch."""
    import cupy

    rng = cupy.random.default_rng(seed)
    t, f = int(cu[-1]), np.float32
    normal = lambda *shape: rng.standard_normal(shape, dtype=f)  # noqa: E731
    return dict(grad_output=normal(t, hidden), hidden_states=normal(t, hidden),
                qkv_weight=normal(3 * hidden, hidden) * f(0.02), qkv_bias=normal(3 * hidden) * f(0.01),
                proj_weight=normal(hidden, hidden) * f(0.02), proj_bias=normal(hidden) * f(0.01),
                cos=normal(t, head_dim), sin=normal(t, head_dim))


def args_of(batch: dict, rows: slice = slice(None)) -> tuple:
    """The eight array arguments of the backward, token-indexed ones restricted to ``rows`` (views, no copy)."""
    b = batch
    return (b["grad_output"][rows], b["hidden_states"][rows], b["qkv_weight"], b["qkv_bias"], b["proj_weight"],
            b["proj_bias"], b["cos"][rows], b["sin"][rows])


def rel_err(out, ref) -> float:
    """||out - ref||_F / ||ref||_F in float64 on the GPU (0 for two empty arrays, inf for a non-finite out)."""
    import cupy

    if ref.size == 0:
        return 0.0
    o, r = out.astype(np.float64), ref.astype(np.float64)
    if not bool(cupy.isfinite(o).all()):
        return float("inf")
    den = float(cupy.linalg.norm(r))
    num = float(cupy.linalg.norm(o - r))
    return num / den if den > 0 else num


def digest(arrays) -> str:
    """SHA-256 of the arrays' bytes, for bit-identity checks across runs."""
    h = hashlib.sha256()
    for a in arrays:
        h.update(a.get().tobytes())
    return h.hexdigest()
