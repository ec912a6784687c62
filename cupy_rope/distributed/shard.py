"""Split a varlen batch across data-parallel ranks: whole sequences, contiguous token ranges, balanced cost.

Each rank gets a contiguous run of sequences, so its inputs (``grad_output``, ``hidden_states``, ``cos``,
``sin``) are one row slice of the batch's arrays and no copy is needed. The split minimises the largest
modelled cost of any rank (the data-parallel step ends when the slowest rank's all-reduce can finish).

Cost model, in FLOP at one rate (the GEMMs and the attention kernels both run at tensor-core speed):

* GEMMs, per token: QKV forward 2·H·3H, dO 2·H·H, grad_proj_weight 2·H·H, grad_hidden 2·3H·H and
  grad_qkv_weight 2·3H·H, i.e. 22·H² FLOP (282.6 MFLOP at H = 3584);
* attention, per sequence of length L: 14·L²·D per head (forward recomputed, backward), i.e. 14·L²·H.

Pure NumPy and deterministic: the same arguments give the same shards on every rank, with no communication.
"""
from __future__ import annotations

import dataclasses
import numbers

import numpy as np

__all__ = ["Shard", "shard_sequences", "sequence_costs"]

_INT32_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class Shard:
    """One rank's part of the batch: tokens ``[token_start, token_end)`` of the global arrays.

    ``cu_seqlens`` holds the local boundaries (int32, starting at 0, ending at ``token_end - token_start``);
    an empty shard has ``token_start == token_end`` and ``cu_seqlens == [0]``. ``cost`` is the modelled FLOP.
    """

    rank: int
    token_start: int
    token_end: int
    cu_seqlens: np.ndarray
    cost: float

    @property
    def tokens(self) -> int:
        return self.token_end - self.token_start

    @property
    def num_sequences(self) -> int:
        return int(self.cu_seqlens.shape[0]) - 1

    def rows(self) -> slice:
        """The slice of the batch's token rows this rank owns: ``hidden_states[shard.rows()]``."""
        return slice(self.token_start, self.token_end)

    def __eq__(self, other):  # the array field needs an element-wise comparison
        if not isinstance(other, Shard):
            return NotImplemented
        return ((self.rank, self.token_start, self.token_end, self.cost)
                == (other.rank, other.token_start, other.token_end, other.cost)
                and np.array_equal(self.cu_seqlens, other.cu_seqlens))

    __hash__ = None


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a positive int, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value}")
    return int(value)


def _host_cu_seqlens(cu_seqlens) -> np.ndarray:
    """``cu_seqlens`` as a checked int64 NumPy array (a CuPy array is read back once)."""
    if hasattr(cu_seqlens, "__cuda_array_interface__") and hasattr(cu_seqlens, "get"):
        cu_seqlens = cu_seqlens.get()
    cu = np.asarray(cu_seqlens)
    if cu.ndim != 1:
        raise ValueError(f"cu_seqlens must be 1-D [num_sequences + 1], got shape {cu.shape}")
    if cu.shape[0] == 0:
        raise ValueError("cu_seqlens must hold at least one value (0)")
    if cu.dtype == bool or not np.issubdtype(cu.dtype, np.integer):
        raise TypeError(f"cu_seqlens must hold integers, got dtype {cu.dtype}")
    cu = cu.astype(np.int64)
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {cu[0]}")
    steps = np.diff(cu)
    if steps.size and steps.min() < 0:
        i = int(np.argmax(steps < 0))
        raise ValueError(f"cu_seqlens must be non-decreasing, but cu_seqlens[{i + 1}] = {cu[i + 1]} "
                         f"< cu_seqlens[{i}] = {cu[i]}")
    if cu[-1] > _INT32_MAX:
        raise ValueError(f"too many tokens for int32 cu_seqlens: {cu[-1]}")
    return cu


def sequence_costs(cu_seqlens, *, hidden: int) -> np.ndarray:
    """Modelled cost of each sequence in units of ``hidden`` FLOP (int64, exact): 22·L·H + 14·L².

    Dividing by H keeps the integers exact well past 10⁷ tokens (the FLOP count itself would not fit int64); a
    batch whose total would pass int64 (some 8·10⁸ tokens in one sequence at H = 3584, terabytes of activations)
    is refused rather than wrapped."""
    lengths = np.diff(_host_cu_seqlens(cu_seqlens))
    if lengths.size:
        tokens, longest = int(lengths.sum()), int(lengths.max())
        if 22 * tokens * int(hidden) + 14 * longest * tokens > np.iinfo(np.int64).max:  # bounds the sum
            raise ValueError(f"{tokens} tokens (the longest sequence {longest}) at hidden {hidden}: the cost "
                             "model's int64 sums would overflow")
    return 22 * lengths * int(hidden) + 14 * lengths * lengths


def _forward_end(prefix: np.ndarray, start: int, bound: int) -> int:
    """The furthest end such that sequences ``[start, end)`` cost at most ``bound``."""
    return int(np.searchsorted(prefix, prefix[start] + bound, side="right")) - 1


def _feasible(prefix: np.ndarray, bound: int, world_size: int) -> bool:
    """Whether ``world_size`` contiguous parts of cost <= ``bound`` can cover every sequence: taking the longest
    run each time is optimal for this question."""
    pos, n = 0, prefix.shape[0] - 1
    for _ in range(world_size):
        if pos == n:
            return True
        pos = _forward_end(prefix, pos, bound)
    return pos == n


def _optimal_bound(prefix: np.ndarray, costs: np.ndarray, world_size: int) -> int:
    """The smallest largest-shard cost of any contiguous split into ``world_size`` parts: binary search on the
    integer bound, each test a pass of ``world_size`` binary searches."""
    total = int(prefix[-1])
    lo = max(int(costs.max()) if costs.size else 0, -(-total // world_size))
    hi = total
    while lo < hi:
        mid = (lo + hi) // 2
        if _feasible(prefix, mid, world_size):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _suffix_starts(prefix: np.ndarray, bound: int, world_size: int) -> np.ndarray:
    """``starts[j]``: the smallest index from which the remaining sequences fit in ``j`` parts of cost <=
    ``bound`` (filling parts from the end)."""
    starts = np.empty(world_size + 1, dtype=np.int64)
    starts[0] = end = prefix.shape[0] - 1
    for j in range(1, world_size + 1):
        end = int(np.searchsorted(prefix, prefix[end] - bound, side="left"))
        starts[j] = end
    return starts


def _boundaries(prefix: np.ndarray, bound: int, world_size: int) -> list:
    """Sequence index where each rank's part ends. Rank k takes sequences until its cost reaches at least an
    equal share of what is left, clipped to the range that keeps every part within ``bound``: at least up
    to where the rest still fits in the remaining ranks, at most as far as its own cost allows."""
    n, total = prefix.shape[0] - 1, int(prefix[-1])
    starts = _suffix_starts(prefix, bound, world_size)
    ends, b = [], 0
    for k in range(world_size - 1):
        left = world_size - k
        share = -(-(total - int(prefix[b])) // left)  # ceil: ties go to the lower rank
        want = int(np.searchsorted(prefix, int(prefix[b]) + share, side="left"))
        b = min(max(want, int(starts[left - 1]), b), _forward_end(prefix, b, bound), n)
        ends.append(b)
    ends.append(n)
    return ends


def shard_sequences(cu_seqlens, world_size: int, *, hidden: int, head_dim: int) -> list:
    """Split the batch described by ``cu_seqlens`` into ``world_size`` :class:`Shard` s, one per rank in order.

    Args:
        cu_seqlens: int ``[N+1]`` (NumPy, a list, or a CuPy array that is read back): 0 first, non-decreasing;
            empty sequences are allowed.
        world_size: number of ranks (positive int).
        hidden, head_dim: the model's sizes (positive ints, ``hidden % head_dim == 0``), for the cost model.

    Returns:
        ``world_size`` shards, rank ``r`` at index ``r``; their token ranges tile ``[0, T)`` in order.

    The split minimises the largest shard cost (optimal over all contiguous splits). Among optimal splits,
    each rank in turn takes sequences until its cost reaches an equal share of what is left (rounded up to
    the next sequence boundary, so ties favour the lower rank), within the range that keeps the split
    optimal. Shards without tokens come last: more ranks than sequences, or a sequence that outweighs the
    rest. O(R · log N · log(total cost)).
    """
    world_size = _positive_int(world_size, "world_size")
    hidden = _positive_int(hidden, "hidden")
    head_dim = _positive_int(head_dim, "head_dim")
    if hidden % head_dim:
        raise ValueError(f"hidden ({hidden}) must be a multiple of head_dim ({head_dim})")
    cu = _host_cu_seqlens(cu_seqlens)
    costs = sequence_costs(cu, hidden=hidden)
    prefix = np.concatenate(([0], np.cumsum(costs)))
    bound = _optimal_bound(prefix, costs, world_size)
    shards, start = [], 0
    for r, end in enumerate(_boundaries(prefix, bound, world_size)):
        local = (cu[start:end + 1] - cu[start]).astype(np.int32)
        local.setflags(write=False)
        shards.append(Shard(rank=r, token_start=int(cu[start]), token_end=int(cu[end]), cu_seqlens=local,
                            cost=float(prefix[end] - prefix[start]) * hidden))
        start = end
    return shards
