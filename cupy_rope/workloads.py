"""The built-in benchmark workloads (the 16 shapes of each op's original benchmark)."""

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
