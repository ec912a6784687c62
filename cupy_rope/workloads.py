"""The built-in benchmark workloads: the 16 shapes of each op's original benchmark, the long-sequence shapes of
the attention block, and the shapes of varlen attention alone. Written out here (not read from a file at run
time) so the package carries its own benchmark."""
from __future__ import annotations

from typing import NamedTuple

ROPE_HEAD_DIM = 128
# (batch, seq)
ROPE_CASES = [(2, 256), (8, 373), (16, 449), (32, 541), (64, 613), (1, 691), (2, 773), (4, 853), (8, 1024),
              (1, 1249), (2, 1321), (8, 1489), (32, 1657), (1, 1801), (2, 1879), (64, 8192)]

ATTN_HIDDEN = 3584
ATTN_HEADS = 28
ATTN_HEAD_DIM = 128
# (total tokens, number of sequences)
ATTN_CASES = [(131, 1), (196, 1), (211, 2), (373, 3), (392, 2), (613, 4), (773, 5), (919, 6), (1024, 4),
              (1176, 6), (2048, 8), (2940, 15), (4096, 16), (4704, 24), (5880, 30), (8192, 32)]




class VarlenCase(NamedTuple):
    """Varlen attention alone: q, k, v ``[sum(seq_lens), num_heads, head_dim]``."""

    name: str
    num_heads: int
    head_dim: int
    seq_lens: tuple


class LongCase(NamedTuple):
    """The attention block on long sequences: the seed workloads' inputs with these sizes."""

    name: str
    hidden: int
    num_heads: int
    seq_lens: tuple

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads


# Real images give one sequence of thousands of patches (1344 x 1344 pixels at patch 14: 9,216); the mixed case has
# an empty and a one-token sequence among long ones.
VARLEN_CASES = [
    VarlenCase("1x16384_h28_d128", 28, 128, (16384,)),
    VarlenCase("4x4096_h28_d128", 28, 128, (4096,) * 4),
    VarlenCase("32x256_h28_d128", 28, 128, (256,) * 32),
    VarlenCase("1x9216_h16_d80", 16, 80, (9216,)),
    VarlenCase("mixed_h16_d64", 16, 64, (1, 64, 3000, 0, 700, 5000, 17)),
]

# The seed model's sizes (hidden 3584, 28 heads) at long sequences, and the Qwen2-VL vision tower's (1280, 16 heads).
LONG_CASES = [
    LongCase("seed_dims_1x16384", ATTN_HIDDEN, ATTN_HEADS, (16384,)),
    LongCase("seed_dims_2x8192", ATTN_HIDDEN, ATTN_HEADS, (8192,) * 2),
    LongCase("seed_dims_8x1024", ATTN_HIDDEN, ATTN_HEADS, (1024,) * 8),
    LongCase("seed_dims_1x4096", ATTN_HIDDEN, ATTN_HEADS, (4096,)),
    LongCase("qwen2vl_vision_1x9216", 1280, 16, (9216,)),
]


def cu_seqlens_of(seq_lens) -> list:
    """``[0, l0, l0 + l1, ...]``: the cu_seqlens of these sequence lengths."""
    cu = [0]
    for n in seq_lens:
        cu.append(cu[-1] + int(n))
    return cu


def select_cases(cases: list, spec: str | None) -> list:
    """The named workloads of a command line: None or "" for all of ``cases``, else comma-separated case names or
    indices into ``cases`` (in the order given)."""
    if not spec:
        return list(cases)
    by_name = {c.name: c for c in cases}
    chosen = []
    for token in (s.strip() for s in spec.split(",")):
        if token.isdigit() and int(token) < len(cases):
            chosen.append(cases[int(token)])
        elif token in by_name:
            chosen.append(by_name[token])
        else:
            raise ValueError(f"unknown case {token!r}: give names among {', '.join(by_name)} "
                             f"or indices 0-{len(cases) - 1}")
    return chosen


def attn_cases(spec: str) -> list:
    """Attention workloads named on a command line: "all" (ATTN_CASES) or "TxN,TxN,..." (T tokens in N sequences)."""
    if spec == "all":
        return list(ATTN_CASES)
    try:
        return [(int(t), int(n)) for t, n in (c.split("x") for c in spec.split(","))]
    except ValueError:
        raise ValueError(f"workloads must be 'all' or TxN[,TxN...], got {spec!r}") from None


def even_cu_seqlens(total: int, n: int) -> list:
    """Split ``total`` tokens into ``n`` nearly equal sequences, the first ``total % n`` one longer."""
    base, extra = divmod(total, n)
    cu = [0]
    for i in range(n):
        cu.append(cu[-1] + base + (1 if i < extra else 0))
    return cu


def rope_theta(batch: int, seq: int, head_dim: int = ROPE_HEAD_DIM):
    """Real RoPE angles: theta[b, s, i] = s * 10000^(-2 (i mod head_dim/2) / head_dim), float32 NumPy."""
    import numpy as np

    half = head_dim // 2
    inv = 10000.0 ** (-2.0 * (np.arange(head_dim) % half) / head_dim)
    th = np.arange(seq, dtype=np.float64)[:, None] * inv[None, :]
    return np.broadcast_to(th, (batch, seq, head_dim)).astype(np.float32)
