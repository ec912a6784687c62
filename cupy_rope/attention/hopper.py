"""The Hopper (sm_90a) attention path, bf16 and tf32: tensor maps for TMA and the launches of
``kernels_cu/attention_sm90.cu``.

Forward (``hop_fwd``): per 128-query tile and head, one pass over K and V (O and the log2-domain log-sum-exp,
times a factor: ln 2 gives the natural one), in tiles of 128 keys, or 192 at head dim 128 on long sequences
(``hop_fwd_bf16_ws_k192``, ``Plan.fwd_keys``); on short ones one block per SM walks those units
(``hop_fwd_bf16_ws_persist``, ``Plan.fwd_persistent``).
Backward: ``delta = rowsum(dO * O)`` (``hop_delta_*``, or the bf16 forward's epilogue in the block:
``Plan.fwd_delta``, or in the varlen API's tf32 backward the kernel that writes dO's transposed copy:
:func:`transposed_delta`); per 128-key tile and head, one pass over the queries
(``hop_bwd_*``: dK, dV through the block epilogue, dQ added in key-tile order into an fp32 accumulator);
``hop_dq_*`` writes dQ through the same epilogue. The backward's blocks run in the plan's order
(``Plan.head_group``: key-tile-fastest over groups of heads, or head-fastest), which always schedules a key
tile's predecessor first, so the ordered dQ sum never waits on a block that has not started; the bf16
specialised backward may split its first units over their query steps (:func:`tail_split`), and at head dim
128 walks query steps of 80 rows instead of 64 (the ``_q80`` kernels, ``Plan.query_rows``).

The operands are bf16 3-D views ``(D, NH, T)`` with any head and token strides (multiples of 16 bytes): the
varlen API's ``[T, NH, D]`` arrays as they are, the block's packed ``P[which][NH][T][DK]`` too. A tensor map is
built on the host (``cuTensorMapEncodeTiled``, driver API, through ctypes) and passed by value.

tf32 reads fp32 operands as (D, NH, T) views too (:class:`Rows`): the block's packed ones (tf32-rounded by the
preparation kernel), the varlen API's rounded copies of its arrays (``hop_round32``, or the row copy the
transposing kernel writes from its own reads), or an array as given where a kernel loads the operand into
registers and rounds it there (the specialised forward's Q; the two-stage backward's K and V). Because wgmma
reads tf32 operands K-major only, it also reads transposed copies ``[NH][D][Tp]`` of K, V, Q and dO (``hop_t32``;
V, Q and dO in the permuted token order of ``kernels_cu/attention/sm90/tf32.cuh``). Its backward blocks own 64
keys (two per tile).
"""
from __future__ import annotations

import ctypes
import functools
from typing import NamedTuple

import numpy as np

from .. import _kernels
from .._kernels import OPTIONS, launcher
from ..precision import Precision
from .kernels import LOG2E, attn_kernel, delta_grid, sm_count, stride_blocks

THREADS = 256
WS_THREADS = 384  # the warp-specialised kernels: two consumer warpgroups and a producer
BM = 128  # query rows of a forward block; key rows of a backward block (the tile table's TILE)
BN = 128  # key rows streamed by the forward
FWD_STAGES = 3  # K/V stages of the specialised bf16 forward (HopFwdWsStages in forward_ws.cuh)
BQ = 64  # query rows streamed by the backward
BQ80 = 80  # ... by the q80 kernels (Plan.query_rows)
BN192 = 192  # key rows streamed by the k192 forward (Plan.fwd_keys)
Q80_HEAD_DIMS = (128,)  # the head dims the q80 kernels and the k192 forward are built for (#if HD == 128)
GRID_Y_MAX = 65535  # blocks along a grid's second dimension (CUDA); the backward kernels put key units there
_BF16_TMA = 9  # CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
_F32_TMA = 7  # CU_TENSOR_MAP_DATA_TYPE_FLOAT32
_SWIZZLE_128B = 3
_L2_256B = 3

SIGNATURES = {  # one letter per parameter, as _kernels.Launcher reads them (M: a tensor map)
    "hop_fwd_bf16": "MMMppqpiffpqqpp",
    "hop_fwd_bf16_ws": "MMMppqpiffpqqpp",
    "hop_fwd_bf16_ws_k192": "MMMppqpiffpqqpp",
    "hop_fwd_bf16_ws_persist": "MMMppqpiffiipqqpp",
    "hop_fwd_bf16_ws_persist_bulk": "MMMppqpiffiipqqppM",
    "hop_bwd_bf16": "MMMMpppppppqppppiiffi",
    "hop_bwd_bf16_plain": "MMMMpppppppqppppiiffi",
    "hop_bwd_bf16_ws": "MMMMpppppppqppppiiffiM",
    "hop_bwd_bf16_ws_plain": "MMMMpppppppqppppiiffiM",
    "hop_bwd_bf16_ws_plain_dq": "MMMMpppppppqppppiiffip",
    "hop_bwd_bf16_ws_q80": "MMMMpppppppqppppiiffiM",
    "hop_bwd_bf16_ws_plain_q80": "MMMMpppppppqppppiiffiM",
    "hop_bwd_bf16_ws_split": "MMMMpppppppqppppiiffiiiipppM",
    "hop_bwd_bf16_ws_plain_split": "MMMMpppppppqppppiiffiiiipppM",
    "hop_bwd_bf16_ws_plain_dq_split": "MMMMpppppppqppppiiffiiiipppM",
    "hop_dq_bf16": "pppqppppii",
    "hop_dq_bf16_plain": "pppqppppii",
    "hop_prep_bf16": "pppppii",
    "hop_delta_bb": "pqpqqpiippfp",
    "hop_delta_bf": "pqpqqpiippfp",
    "hop_delta_fb": "pqpqqpiippfp",
    "hop_delta_ff": "pqpqqpiippfp",
    "hop_fwd_tf32": "MMMppqpiff",
    "hop_fwd_tf32_ws": "MMMppqpiff",
    "hop_fwd_tf32_ws_tail": "MMMppqpiffiiipp",
    "hop_fwd_tf32_combine": "ppqpifiipp",
    "hop_bwd_tf32": "MMMMMMMMppppipppqppppiiffii",
    "hop_bwd_tf32_plain": "MMMMMMMMppppipppqppppiiffii",
    "hop_bwd_tf32_ws": "MMMMMMMMppppipppqppppiiffii",
    "hop_bwd_tf32_ws_plain": "MMMMMMMMppppipppqppppiiffii",
    "hop_bwd_tf32_ws2": "MMMMMMMMppppipppqppppiiffii",
    "hop_bwd_tf32_ws2_plain": "MMMMMMMMppppipppqppppiiffii",
    "hop_bwd_tf32_ws2_plain_split": "MMMMMMMMppppipppqppppiiffiiiiipp",
    "hop_dq_tf32": "pippqppppii",
    "hop_dq_tf32_plain": "pippqppppii",
    "hop_t32": "pqqpiipp",
    "hop_t32_perm": "pqqpiipp",
    "hop_t32_perm_delta": "pqqpiippqqpppfp",
    "hop_round32": "ppq",
}


# The module is compiled in parts, a cubin each (attention_sm90.cu, HOP_PART), so that a call compiles the kernels
# of what it runs and no more (compile_ahead builds a call's parts side by side). Measured (NVRTC on one CPU, head
# dim 128, s): the whole module 15.1; its parts bf16 forward 2.9, bf16 backward 4.4, tf32 forward 1.0, tf32
# backward 1.8, the passes 0.6, and the kernels no plan of the library chooses 3.5 (REFERENCE: the forms the tests
# hold the specialised kernels to, bit for bit), which a call compiles only where its plan names one of them.
PARTS = {
    "BF16_FWD": ("hop_fwd_bf16_ws", "hop_fwd_bf16_ws_k192", "hop_fwd_bf16_ws_persist", "hop_fwd_bf16_ws_persist_bulk"),
    "BF16_BWD": ("hop_bwd_bf16_ws", "hop_bwd_bf16_ws_plain", "hop_bwd_bf16_ws_plain_dq", "hop_bwd_bf16_ws_q80",
                 "hop_bwd_bf16_ws_plain_q80", "hop_bwd_bf16_ws_split", "hop_bwd_bf16_ws_plain_split",
                 "hop_bwd_bf16_ws_plain_dq_split"),
    "TF32_FWD": ("hop_fwd_tf32", "hop_fwd_tf32_ws", "hop_fwd_tf32_ws_tail", "hop_fwd_tf32_combine"),
    "TF32_BWD": ("hop_bwd_tf32_ws2", "hop_bwd_tf32_ws2_plain", "hop_bwd_tf32_ws2_plain_split"),
    "PASSES": ("hop_prep_bf16", "hop_delta_bb", "hop_delta_bf", "hop_delta_fb", "hop_delta_ff", "hop_dq_bf16",
               "hop_dq_bf16_plain", "hop_dq_tf32", "hop_dq_tf32_plain", "hop_t32", "hop_t32_perm",
               "hop_t32_perm_delta", "hop_round32"),
    "REFERENCE": ("hop_fwd_bf16", "hop_bwd_bf16", "hop_bwd_bf16_plain", "hop_bwd_tf32", "hop_bwd_tf32_plain",
                  "hop_bwd_tf32_ws", "hop_bwd_tf32_ws_plain"),
}
PART = {name: part for part, names in PARTS.items() for name in names}  # kernel -> its part
LIBRARY_PARTS = tuple(p for p in PARTS if p != "REFERENCE")  # what `python -m cupy_rope compile` builds


def part_options(part: str, d: int, defines: tuple = ()) -> tuple:
    """The NVRTC options of one part of the sm_90a module at head dim ``d`` (``defines``: extra, for the lab)."""
    if part not in PARTS:
        raise ValueError(f"unknown part {part!r} of the sm_90a module; known: {tuple(PARTS)}")
    return OPTIONS + (f"-DATTN_HEAD_DIM={d}", f"-DHOP_PART=HOP_PART_{part}") + tuple(defines)


_AHEAD: set = set()  # (part, head dim) of what compile_ahead has built in this process (TAG_PREPARE: the mma.sync
# module's build that packs the block's operands)


def compile_ahead(plan, forward: bool = True, prepare: bool = False) -> None:
    """Before a call on the sm_90a kernels: the parts of a training step on them (the passes, its precision's
    backward and, with ``forward``, its forward) compiled side by side (:func:`_kernels.compile_ahead`), so that
    the first such call waits for the longest part, not for all of them in turn. A forward builds its backward's
    part too, as the backward mostly follows it; a backward given the forward's outputs (``forward`` False)
    runs no forward kernel. With ``prepare`` (a block backward that packs its operands with the preparation
    kernel of the mma.sync module), that module's build of the plan's precision is compiled beside the parts.
    Each once per process and head dim; the REFERENCE kernels, which only a caller's plan names, compile at
    their first launch."""
    tag = "BF16" if plan.precision == Precision.BF16 else "TF32"
    parts = ("PASSES",) + ((f"{tag}_FWD",) if forward else ()) + (f"{tag}_BWD",)
    todo = [p for p in parts if (p, plan.head_dim) not in _AHEAD]
    prep = [f"{tag}_PREPARE"] if prepare and (f"{tag}_PREPARE", plan.head_dim) not in _AHEAD else []
    if not todo and not prep:
        return
    beside = [functools.partial(attn_kernel, "prep", plan.precision, plan.head_dim)] if prep else []
    _kernels.compile_ahead([("attention_sm90", "sm_90a", part_options(p, plan.head_dim)) for p in todo], beside)
    _AHEAD.update((p, plan.head_dim) for p in todo + prep)


def _blocks(d: int) -> int:
    return (d + 63) // 64


def smem_bytes(kernel: str, d: int) -> int:
    """Dynamic shared memory of one block (the carve-up of kernels_cu/attention/sm90/*.cuh)."""
    nb = _blocks(d)
    if kernel == "hop_fwd_tf32_combine":
        return 0
    if kernel in ("hop_fwd_tf32", "hop_fwd_tf32_ws", "hop_fwd_tf32_ws_tail"):
        # Q [128][D], K [2][64][D], V^T [2][D][64] (fp32); in _ws Q's region is the third K/V stage once read
        nb32 = (d + 31) // 32
        return (BM * 32 * nb32 + 2 * 64 * 32 * nb32 + 2 * 2 * d * 32) * 4 + 64
    if kernel.startswith("hop_bwd_tf32"):  # K, V [64][D], K^T [2][64 MB][32], Q, dO [64][D], Q^T, dO^T [2][D][32]
        nb32, mb = (d + 31) // 32, (d + 63) // 64
        kv = (2 * 64 * 32 * nb32 + 2 * 64 * mb * 32) * 4
        main = kv + (2 * 64 * 32 * nb32 + 2 * 2 * d * 32) * 4
        return max(main, kv + BM * (d + 4) * 4) + 512 + 64
    if kernel == "hop_fwd_bf16_ws_k192":  # Q [NB][128][64], K and V in 2 stages of [NB][192][64]; ten barriers
        return (BM + 2 * 2 * BN192) * 64 * nb * 2 + 128
    if kernel.startswith("hop_fwd"):  # Q, then K and V in S stages, 128 x 64 each column block; barriers (HopFwdSmem)
        stages = FWD_STAGES if kernel.startswith("hop_fwd_bf16_ws") else 2
        return (1 + 2 * stages) * BN * 64 * nb * 2 + 64
    if kernel.startswith("hop_bwd_bf16_ws"):
        # K, V, Q[2], dO[2], dS^T[2] (bf16); dQ staging [BQ][D + 4] (the swizzled boxes of the kernels that add
        # through tensor reductions take BQ x D of it), lse2/delta [2][2][BQ] (fp32); barriers; the kernels that
        # write dQ from the last key tile: the earlier tiles' rows of a step read ahead, [BQ][D] fp32
        bq = BQ80 if kernel.endswith("_q80") else BQ
        kt, qt, ds = BM * 64 * nb, bq * 64 * nb, BM * bq
        pre = bq * d * 4 if kernel.startswith("hop_bwd_bf16_ws_plain_dq") else 0
        return (2 * kt + 4 * qt + 2 * ds) * 2 + bq * (d + 4) * 4 + 4 * bq * 4 + 128 + pre
    if kernel.startswith("hop_bwd"):
        kt, qt, ds = BM * 64 * nb, BQ * 64 * nb, BM * 64
        main = 2 * kt * 2 + (4 * qt + ds) * 2
        stage = 2 * kt * 2 + BM * (d + 4) * 4
        return max(main, stage) + 64
    if kernel.startswith("hop_dq"):
        return BM * (d + 4) * 4
    return 0


def supported() -> bool:
    """True when the current GPU runs sm_90a code (compute capability 9.0) and the driver encodes tensor maps."""
    import cupy

    return _supported(cupy.cuda.runtime.getDevice())


def require_supported(wanted: bool, sm90: bool) -> None:
    """A plan that asks for the sm_90a kernels (``wanted``) on a GPU that cannot run them (``sm90`` False: a
    caller's plan) is refused before anything is compiled or launched."""
    if wanted and not sm90:
        raise ValueError("plan.hopper: the sm_90a kernels need a Hopper GPU (compute capability 9.0) whose driver "
                         "encodes tensor maps; this one takes the mma.sync kernels (hopper=False)")


@functools.lru_cache(maxsize=None)
def _supported(dev: int) -> bool:
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(dev)
    if (props["major"], props["minor"]) != (9, 0):
        return False
    return _encode_fn() is not None


@functools.lru_cache(maxsize=1)
def _encode_fn():
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuTensorMapEncodeTiled
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64),
                   ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return fn


def _encode(dtype: int, ptr: int, dims, strides, box, what: str) -> bytes:
    if ptr % 16 or any(x % 16 for x in strides):
        raise ValueError("the Hopper attention kernels need 16-byte aligned operands and strides")
    return _encode_cached(dtype, ptr, tuple(dims), tuple(strides), tuple(box), what)


# A tensor map is a pure function of its arguments (the driver reads no memory and keeps no state for it), and a
# training step passes the same pointers and shapes call after call: the last maps are kept.
@functools.lru_cache(maxsize=1024)
def _encode_cached(dtype: int, ptr: int, dims: tuple, strides: tuple, box: tuple, what: str) -> bytes:
    fn = _encode_fn()
    if fn is None:
        raise RuntimeError("the CUDA driver does not provide cuTensorMapEncodeTiled (a driver for CUDA 12 or newer "
                           "is needed for the Hopper attention kernels)")
    out = ctypes.create_string_buffer(128 + 64)
    addr = (ctypes.addressof(out) + 63) // 64 * 64  # CUtensorMap is 64-byte aligned
    rc = fn(ctypes.c_void_p(addr), dtype, 3, ctypes.c_void_p(ptr), (ctypes.c_uint64 * 3)(*dims),
            (ctypes.c_uint64 * 2)(*strides), (ctypes.c_uint32 * 3)(*box), (ctypes.c_uint32 * 3)(1, 1, 1), 0,
            _SWIZZLE_128B, _L2_256B, 0)
    if rc != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed (CUresult {rc}) for {what}")
    return ctypes.string_at(addr, 128)


def tensor_map(ptr: int, d: int, nh: int, t: int, head_stride: int, token_stride: int, rows: int,
               f32: bool = False) -> bytes:
    """The 128-byte tensor map of a bf16 (or fp32) view (D, NH, T) at ``ptr`` (strides in bytes), boxes of
    128 bytes x 1 x rows, 128-byte swizzle, elements past D or T read as zero."""
    return _encode(_F32_TMA if f32 else _BF16_TMA, ptr, (d, nh, max(t, 1)), (head_stride, token_stride),
                   (32 if f32 else 64, 1, rows),
                   f"a ({d}, {nh}, {t}) view with strides ({head_stride}, {token_stride})")


def transposed_map(x) -> bytes:
    """Tensor map of a transposed fp32 copy [NH][D][Tp] as (Tp, D, NH), boxes of 32 tokens x D rows."""
    nh, d, tp = x.shape
    return _encode(_F32_TMA, x.data.ptr, (tp, d, nh), (tp * 4, d * tp * 4), (32, d, 1), f"a [{nh}][{d}][{tp}] copy")


def packed_maps(P, t: int, nh: int, d: int, which: int, query_rows: int = BQ, keys: int = BN):
    """Tensor maps of the block's packed bf16 operands P[which][NH][T][DK], each for its streamed rows
    (``query_rows``: the backward's query step, Plan.query_rows; ``keys``: the forward's K/V tile, Plan.fwd_keys).
    tf32's fp32 operands: :class:`Rows`."""
    dk = P.shape[-1]
    base, per = P.data.ptr, nh * t * dk * 2
    return tuple(tensor_map(base + i * per, d, nh, t, t * dk * 2, dk * 2, r)
                 for i, r in enumerate(_bf16_rows(which, query_rows, keys)))


def _bf16_rows(which: str, query_rows: int, keys: int) -> tuple:
    """Rows of the boxes the bf16 kernels stream, per operand (q, k, v, dO) of the forward or the backward."""
    return (BM, keys, keys, BQ) if which == "fwd" else (query_rows, BM, BM, query_rows)


def prepare_qk(qk, bqk, cos, sin, out, t: int, h: int, d: int, s: int) -> None:
    """The block's bf16 q and k where its kernels read them (``Plan.in_place``): ``out`` [T, 2H] bf16 from the QK
    product's fp32 ``qk`` [T, 2H] (without its bias), with the bias (``bqk``: the first 2H of the QKV bias, fp32)
    and RoPE (``cos``, ``sin`` [T, D] fp32) applied before the one rounding (``hop_prep_bf16``)."""
    units = 2 * t * (h // d) * (d // 8)
    _kernel("hop_prep_bf16", d)((stride_blocks(units, THREADS), 1, 1), (THREADS, 1, 1),
                                (qk.data.ptr, bqk.data.ptr, cos.data.ptr, sin.data.ptr, out.data.ptr, t, h), s)


def in_place_maps(qk, v, do, t: int, nh: int, d: int, which: str, query_rows: int = BQ, keys: int = BN):
    """packed_maps for the operands where the products leave them: q and k as the columns of the bf16 ``qk``
    [T, 2H], v the bf16 [T, H] of the V product, and (``do`` not None) dO the bf16 [T, H] of the dO product."""
    h = nh * d
    views = [(qk.data.ptr, 2 * h * 2), (qk.data.ptr + h * 2, 2 * h * 2), (v.data.ptr, h * 2)]
    if do is not None:
        views.append((do.data.ptr, h * 2))
    rows = _bf16_rows(which, query_rows, keys)
    return tuple(tensor_map(p, d, nh, t, d * 2, ts, r) for (p, ts), r in zip(views, rows))


class Rows(NamedTuple):
    """An fp32 operand as the tf32 kernels stream its rows: the (D, NH, T) view at ``ptr`` with head and token
    strides in elements."""
    ptr: int
    head_stride: int
    token_stride: int

    def map(self, d: int, nh: int, t: int, rows: int) -> bytes:
        """Its tensor map, boxes of 32 columns x 1 head x ``rows`` tokens."""
        return tensor_map(self.ptr, d, nh, t, self.head_stride * 4, self.token_stride * 4, rows, f32=True)


def packed_rows(P, which: int) -> Rows:
    """Operand ``which`` of the block's packed fp32 P[which][NH][T][DK]."""
    _, nh, t, dk = P.shape
    return Rows(P.data.ptr + which * nh * t * dk * 4, t * dk, dk)


def token_rows(x) -> Rows:
    """A C-contiguous fp32 [T, NH, D] array (16-byte aligned) as it is."""
    _, nh, d = x.shape
    return Rows(x.data.ptr, d, nh * d)


def round32(x, s: int):
    """The tf32-rounded copy (to nearest) of a C-contiguous fp32 [T, NH, D] array (16-byte aligned), in its own
    layout."""
    import cupy

    out = cupy.empty_like(x)
    n4 = x.size // 4
    if n4:
        # the same kernel in every head dim's module: the one of D, which the call's other kernels load anyway
        k = _kernel("hop_round32", x.shape[-1])
        k((stride_blocks(n4, THREADS), 1, 1), (THREADS, 1, 1), (x.data.ptr, out.data.ptr, n4), s)
    return out


def transposed(src: Rows, t: int, nh: int, d: int, perm: bool, s: int, tiles=None, ntiles: int = 0, rows=None):
    """The tf32 copy [NH][D][Tp] of the operand ``src`` (Tp = T rounded up to 32, zero past T), in the permuted
    token order if ``perm`` (the copies that are the B operand of a product with P as A); with ``tiles``,
    [NH][D][128 ntiles] laid out by tile instead (tile i's tokens from column 128 i). ``rows``: an array laid out
    as ``src`` (its strides) that also receives ``src`` rounded, from the same reads."""
    import cupy

    from .kernels import padded

    ld = 128 * ntiles if tiles is not None else padded(t)
    out = cupy.empty((nh, d, ld), np.float32)
    _kernel("hop_t32_perm" if perm else "hop_t32", d)(((ld + 63) // 64, (d + 63) // 64, nh), (256, 1, 1),
                                                      (src.ptr, src.token_stride, src.head_stride, out.data.ptr, ld,
                                                       t, 0 if tiles is None else tiles.data.ptr,
                                                       0 if rows is None else rows.data.ptr), s)
    return out


def transposed_delta(src: Rows, o: Rows, t: int, nh: int, d: int, s: int, rows, delta, lse, lse2, lse_k: float,
                     sem):
    """:func:`transposed` of dO (``src``) in the permuted order with its rounded ``rows``, and from the same reads
    the delta pass of :func:`delta`: ``delta`` [NH, T] = rowsum(dO * O) with ``o`` as given (fp32), ``lse2`` =
    ``lse`` * ``lse_k`` (rounded once) and ``sem`` [NH, T] zeroed (``hop_t32_perm_delta``: a block takes 64 tokens
    over every column of a head, so each sum is whole in one block, in a fixed order)."""
    import cupy

    from .kernels import padded

    ld = padded(t)
    out = cupy.empty((nh, d, ld), np.float32)
    _kernel("hop_t32_perm_delta", d)(((ld + 63) // 64, 1, nh), (256, 1, 1),
                                     (src.ptr, src.token_stride, src.head_stride, out.data.ptr, ld, t,
                                      rows.data.ptr, o.ptr, o.token_stride, o.head_stride, delta.data.ptr,
                                      lse.data.ptr, lse2.data.ptr, float(lse_k), sem.data.ptr), s)
    return out


def token_major_map(x, rows: int) -> bytes:
    """Tensor map of a C-contiguous bf16 [T, NH, D] array."""
    t, nh, d = x.shape
    return tensor_map(x.data.ptr, d, nh, t, d * 2, nh * d * 2, rows)


def _kernel(name: str, d: int, defines: tuple = ()):
    """Launcher of sm_90a kernel ``name`` at head dim ``d`` (``defines``: extra build options, for the lab), from
    the cubin of its part."""
    lau = launcher("attention_sm90", name, SIGNATURES[name], options=part_options(PART[name], d, defines))
    need = smem_bytes(name, d)
    if need > lau.max_smem:
        lau.set_max_dynamic_smem(need)
    return lau


def forward(maps, tiles, ntiles: int, o, ldo: int, lse2, t: int, nh: int, d: int, scale_log2: float, s: int, *,
            specialised: bool, keys: int = BN, persistent: bool = False, lse_scale: float = 1.0, delta=None,
            o_bulk: bool = False):
    """O (bf16, row stride ``ldo`` elements, head h at column h*D) and lse2 [NH, T] (log2 domain), times
    ``lse_scale`` (LN2: the natural log-sum-exp, rounded once).
    ``specialised``: the warp-specialised kernel (forward_ws.cuh: the next tile's scores beside the softmax), the
    same results. ``keys`` BN192 (the specialised kernel at Q80_HEAD_DIMS; the Plan checks it): K/V tiles of 192
    keys (``maps`` with boxes of as many rows for K and V), the online softmax over other tiles (other bits).
    ``persistent`` (with ``specialised`` and 128 keys; no effect otherwise): one block per SM walks the (head,
    query tile) units, the next unit's copies beside the current one's last products and epilogue; the same
    bits. ``o_bulk`` (persistent only): O through shared memory and the copy engine where O and its rows are
    16-byte aligned (``hop_fwd_bf16_ws_persist_bulk``, Plan.fwd_o_bulk), the same bits. ``delta``: None, or (do,
    ldg, head_stride, out, sem) as :func:`delta` takes them (dO bf16, 4-byte aligned rows): the epilogue also
    writes out [NH, T] = rowsum(dO * O), O as stored, and zeroes sem [NH, T] (forward.cuh's HopDelta), in place of
    a delta pass after it (the sum in another order: other bits)."""
    if delta is None:
        dargs = (0, 0, 0, 0, 0)
    else:
        do, ldg, hs, out, sem = delta
        if do.dtype == np.float32 or do.data.ptr % 4 or ldg % 2 or hs % 2:
            raise ValueError("the forward's delta takes a bf16 dO with 4-byte aligned rows")
        dargs = (do.data.ptr, ldg, hs, out.data.ptr, sem.data.ptr)
    if persistent and specialised and keys == BN:
        import cupy

        # O through the copy engine needs O's own map (64-row boxes, one per warpgroup): 16-byte aligned O and rows
        bulk = o_bulk and o.data.ptr % 16 == 0 and ldo % 8 == 0
        k = _kernel("hop_fwd_bf16_ws_persist" + ("_bulk" if bulk else ""), d)
        units = ntiles * nh
        extra = (tensor_map(o.data.ptr, d, nh, t, d * 2, ldo * 2, 64),) if bulk else ()
        k((max(1, min(units, sm_count(cupy.cuda.runtime.getDevice()))), 1, 1), (WS_THREADS, 1, 1),
          (*maps, tiles.data.ptr, o.data.ptr, ldo, lse2.data.ptr, t, float(scale_log2), float(lse_scale), ntiles,
           units) + dargs + extra, s, k.max_smem)
        return
    k = _kernel("hop_fwd_bf16" + ("_ws" if specialised else "") + ("_k192" if keys == BN192 else ""), d)
    k((ntiles, nh, 1), (WS_THREADS if specialised else THREADS, 1, 1),
      (*maps, tiles.data.ptr, o.data.ptr, ldo, lse2.data.ptr, t, float(scale_log2), float(lse_scale)) + dargs, s,
      k.max_smem)


def delta(o, ldo: int, do, ldg: int, out, t: int, nh: int, d: int, s: int, head_stride: int | None = None, *,
          lse=None, lse2=None, lse_k: float = 1.0, sem=None) -> None:
    """out [NH, T] = rowsum(dO * O) per head; o and do bf16 or fp32, 16-byte aligned, row strides in elements;
    ``head_stride``: elements from one head of dO to the next (default ``d``: heads side by side in a row; the
    packed operands' [NH][T][D] give T D). Each block takes DELTA_TOKENS tokens of DELTA_HEADS heads
    (attention/delta.cuh), and writes each head's sums as one run of tokens. With ``lse`` and ``lse2`` ([NH, T] fp32) it
    also writes ``lse2 = lse * lse_k`` (rounded once), and with ``sem`` ([NH, T] int32) zeroes it, in the same
    pass."""
    name = "hop_delta_" + ("b" if o.dtype != np.float32 else "f") + ("b" if do.dtype != np.float32 else "f")
    hs = d if head_stride is None else head_stride
    ptr = lambda a: 0 if a is None else a.data.ptr  # noqa: E731
    _kernel(name, d)(delta_grid(t, nh), (THREADS, 1, 1), (o.data.ptr, ldo, do.data.ptr, ldg, hs, out.data.ptr, t,
                                                          nh, ptr(lse), ptr(lse2), float(lse_k), ptr(sem)), s)


def tail_split(units: int, sms: int, max_parts: int) -> tuple[int, int]:
    """(R, P): the specialised bf16 backward (and the two-stage tf32 one, over 64-key units) runs its first R units
    (head, key tile) as P blocks each, every part walking a P-th of the tile's query steps; (0, 1): none split.

    A backward block holds an SM alone (384 threads of 168 registers), and its units take about the same time W
    on a long sequence, so ``units`` = k ``sms`` + R ends in a wave of R blocks with the other SMs idle: (k + 1) W
    for (k + R / sms) W of work (1 x 16384 tokens, 28 heads: 3584 = 27 x 132 + 20, the last wave 20 blocks).
    Split first, the R P parts of W / P fill ceil(R P / sms) layers of W / P before the units that are not
    split, which then end together: (k + ceil(R P / sms) / P) W. P is the one of 2 .. ``max_parts`` with the
    least of that (the fewest parts among equals), if it beats the unsplit tail."""
    if max_parts < 2 or units <= sms or units % sms == 0:
        return 0, 1
    r = units % sms
    best, cost = 1, 1.0
    for p in range(2, max_parts + 1):
        c = -(-r * p // sms) / p
        if c < cost - 1e-9:
            best, cost = p, c
    return (r, best) if best > 1 else (0, 1)


def split_buffers(r: int, p: int, nh: int, units: int, width: int):
    """What a tail-split backward (:func:`tail_split`'s R units in P parts, ``units`` per head) needs besides the
    unsplit kernel's arguments: each consumer thread's ``width`` partial sums per part [R P][256][width] fp32, the
    R units' arrival counts (zeroed), and the grid's rows over NH heads (R (P - 1) more blocks)."""
    import cupy

    buf = cupy.empty((r * p, WS_THREADS - 128, width), np.float32)
    cnt = cupy.zeros((r,), np.int32)
    return buf, cnt, -(-(nh * units + r * (p - 1)) // nh)


def backward(maps, tiles, ntiles: int, lse2, dlt, dqacc, sem, dq_out, dk_out, dv_out, out_ld: int, cos, sin,
             part, outT, ldt: int, t: int, nh: int, d: int, scaling: float, s: int, block: bool, *,
             order: int, specialised: bool, fused_dq: bool = False, tail_parts: int = 1,
             query_rows: int = BQ) -> None:
    """dK, dV (then dQ) of one call. ``block``: bf16 outputs with the RoPE backward of dQ and dK (the vision
    block's operands); else fp32 outputs as given. Output arguments are device pointers (ints). ``order``: the
    blocks run key-tile-fastest over groups of this many heads, or head-fastest if 0 (``Plan.head_group``).
    ``specialised``: the warp-specialised kernel (backward_ws.cuh: the ordered dQ sum on writer warps), the same
    results.
    ``fused_dq`` (plain outputs of the specialised kernel only): each sequence's last key tile writes dQ, and
    the dQ write kernel is not launched; the same bits.
    ``tail_parts`` (specialised kernel only): split the last wave's worth of units into at most this many parts
    each (:func:`tail_split`); their dK and dV are the parts' sums in part order (deterministic, other bits than
    unsplit).
    ``query_rows`` BQ80 (the specialised kernel at Q80_HEAD_DIMS, not fused: the Plan checks it; never split):
    the q80 kernels, whose query steps are 80 rows (``maps`` with boxes of as many rows for Q and dO); the same
    bits."""
    import cupy

    fused = fused_dq and specialised and not block
    q80 = query_rows == BQ80
    r, p = tail_split(nh * ntiles, sm_count(cupy.cuda.runtime.getDevice()), tail_parts) \
        if specialised and not q80 else (0, 1)
    suffix = ("_ws" if specialised else "") + ("" if block else "_plain") + ("_dq" if fused else "") + \
        ("_split" if r else "") + ("_q80" if q80 else "")
    ptr = lambda a: 0 if a is None else a.data.ptr  # noqa: E731
    k = _kernel("hop_bwd_bf16" + suffix, d)
    args = (*maps, tiles.data.ptr, lse2.data.ptr, dlt.data.ptr, dqacc.data.ptr, sem.data.ptr, dk_out, dv_out, out_ld,
            ptr(cos), ptr(sin), part.data.ptr, ptr(outT), ldt, t, float(scaling * LOG2E), float(scaling), int(order))
    rows = ntiles
    if r:  # the split kernel: R more rows' worth of blocks, each consumer thread's partial dK and dV per part
        buf, cnt, rows = split_buffers(r, p, nh, ntiles, d)
        args += (r, p, ntiles, buf.data.ptr, cnt.data.ptr, dq_out if fused else 0)
    elif fused:
        args += (dq_out,)
    if specialised and not fused and (q80 or d == 64):  # their full steps add dQ through the copy engine
        args += (dq_accumulator_map(dqacc, query_rows),)
    elif specialised and (not fused or r):  # the other specialised kernels take a map they do not read
        args += (bytes(128),)
    k((nh, rows, 1), (WS_THREADS if specialised else THREADS, 1, 1), args, s, k.max_smem)
    if fused:
        return
    q = _kernel("hop_dq_bf16" + ("" if block else "_plain"), d)
    q((ntiles, nh, 1), (THREADS, 1, 1), (dqacc.data.ptr, tiles.data.ptr, dq_out, out_ld, ptr(cos), ptr(sin),
                                          part.data.ptr, ptr(outT), ldt, t), s, q.max_smem)


def forward_tf32(P, tiles, ntiles: int, o, ldo: int, lse2, t: int, nh: int, d: int, scale_log2: float, s: int,
                 lse_scale: float = 1.0, specialised: bool = False, tail: tuple[int, int] = (0, 1)):
    """tf32 forward from the packed fp32 operands P[3 or 4][NH][T][D] (:func:`forward_tf32_rows`)."""
    vt = transposed(packed_rows(P, 2), t, nh, d, True, s)
    forward_tf32_rows(packed_rows(P, 0), packed_rows(P, 1), vt, tiles, ntiles, o, ldo, lse2, t, nh, d, scale_log2,
                      s, lse_scale=lse_scale, specialised=specialised, tail=tail)


# Key steps of the tf32 forward (HOP32_BN): a unit walks its sequence's keys from its start rounded down to 8.
TF32_FWD_STEP_KEYS = 64


def forward_tail(table, nh: int, plan, sms: int | None = None) -> tuple[int, int]:
    """(R, P): the specialised tf32 forward (``hop_fwd_tf32_ws_tail``) runs its first R units (query tile u % NT,
    head u / NT of the host tile ``table`` [NT][3]) as P parts each, over their key steps, before the others, so
    that the units left end in whole waves (:func:`tail_split`'s model with ``plan.fwd_tail_parts`` parts at
    most, P no more than the fewest key steps of those units); (0, 1): the unsplit kernel. ``sms``: the current
    device's SM count if None."""
    if plan.precision != Precision.TF32 or not plan.fwd_specialised or plan.fwd_tail_parts < 2 or not len(table):
        return 0, 1
    if sms is None:
        import cupy

        sms = sm_count(cupy.cuda.runtime.getDevice())
    nt = len(table)
    r, p = tail_split(nt * nh, sms, plan.fwd_tail_parts)
    if r:
        rows = table[np.arange(r) % nt]
        starts = rows[:, 1] & ~7
        p = min(p, int(((rows[:, 2] - starts + TF32_FWD_STEP_KEYS - 1) // TF32_FWD_STEP_KEYS).min()))
    return (r, p) if r and p > 1 else (0, 1)


def forward_tf32_rows(q: Rows, k: Rows, vt, tiles, ntiles: int, o, ldo: int, lse2, t: int, nh: int, d: int,
                      scale_log2: float, s: int, lse_scale: float = 1.0, specialised: bool = False,
                      tail: tuple[int, int] = (0, 1)):
    """tf32 forward: O (fp32, row stride ``ldo``) and lse2 (times ``lse_scale``, as :func:`forward`) of q, k
    (tf32-rounded; q may be as given with ``specialised``, which rounds it in registers) and ``vt`` (V's permuted
    transposed copy, :func:`transposed`). ``specialised``: the warp-specialised kernel (Q in registers, three K/V
    stages, forward_tf32.cuh) rather than the two-stage one; the same bits. ``tail`` (R, P) from
    :func:`forward_tail` (specialised only): its first R units in P parts each, then those units' parts combined
    (``hop_fwd_tf32_combine``; their rows in other bits, the others' the same)."""
    import cupy

    maps = (q.map(d, nh, t, BM), k.map(d, nh, t, 64), transposed_map(vt))
    r, p = tail
    args = (*maps, tiles.data.ptr, o.data.ptr, ldo, lse2.data.ptr, t, float(scale_log2), float(lse_scale))
    if r and specialised:
        opart = cupy.empty((r * p, BM, d), np.float32)  # each part's O rows, normalised by its own sum
        lpart = cupy.empty((r * p, BM), np.float32)  # and their lse2
        kern = _kernel("hop_fwd_tf32_ws_tail", d)
        kern((ntiles * nh + r * (p - 1), 1, 1), (WS_THREADS, 1, 1),
             args + (r, p, ntiles, opart.data.ptr, lpart.data.ptr), s, kern.max_smem)
        _kernel("hop_fwd_tf32_combine", d)((r, 1, 1), (THREADS, 1, 1),
                                           (tiles.data.ptr, o.data.ptr, ldo, lse2.data.ptr, t, float(lse_scale), p,
                                            ntiles, opart.data.ptr, lpart.data.ptr), s)
        return
    kern = _kernel("hop_fwd_tf32_ws" if specialised else "hop_fwd_tf32", d)
    kern((ntiles, nh, 1), (WS_THREADS if specialised else THREADS, 1, 1), args, s, kern.max_smem)


def dq_accumulator_map(dqacc, rows: int) -> bytes:
    """Tensor map of the bf16 specialised backward's fp32 dQ accumulator [NH][T][D] for its full steps'
    reductions: boxes of 32 columns x 1 head x ``rows`` (the query step) in the 128-byte swizzle."""
    nh, t, d = dqacc.shape
    return tensor_map(dqacc.data.ptr, d, nh, t, t * d * 4, d * 4, rows, f32=True)


# The tf32 backward's query steps hold 64 tokens (HOP32_BQ), from the sequence's first (s0 & ~7 in
# backward_tf32_ws2.cuh: the same token where sequences start at multiples of 64).
TF32_STEP_ROWS = 64


def dq_accumulator_tf32(t: int, nh: int, d: int, zeroed: bool = True):
    """The tf32 backward's dQ accumulator, transposed: [NH][D][ldq] (ldq: T rounded up to 32, + 64 for the last
    query step's reach); zeroed, unless ``zeroed`` is False: only where the backward's first key tiles store
    every step's share (:func:`first_tile_stores`)."""
    import cupy

    from .kernels import padded

    return (cupy.zeros if zeroed else cupy.empty)((nh, d, padded(t) + 64), np.float32)


def first_tile_stores(vl, plan) -> bool:
    """Whether each sequence's first key tile in the tf32 backward stores its dQ^T share of every step instead
    of adding it, so that the accumulator needs no zeroing: the plan's choice (``Plan.tf32_first_stores``), the
    sm_90a two-stage kernel, and sequences of whole 64-token steps (:meth:`Varlen.whole_steps`)."""
    return (plan.tf32_first_stores and plan.hopper and plan.specialised and plan.stages == 2
            and vl.whole_steps(TF32_STEP_ROWS))


def backward_tf32(P, tiles, ntiles: int, lse2, dlt, dqacc, sem, dq_out, dk_out, dv_out, out_ld: int, cos, sin,
                  part, outT, ldt: int, t: int, nh: int, d: int, scaling: float, s: int, block: bool, *,
                  specialised: bool, order: int, stages: int, first_stores: bool = False) -> None:
    """tf32 backward from the packed fp32 operands P[4][NH][T][D] (q, k, v, dO): :func:`backward_tf32_rows`."""
    kt = transposed(packed_rows(P, 1), t, nh, d, False, s, tiles, ntiles)
    qt = transposed(packed_rows(P, 0), t, nh, d, True, s)
    dot = transposed(packed_rows(P, 3), t, nh, d, True, s)
    backward_tf32_rows(tuple(packed_rows(P, i) for i in range(4)), (kt, qt, dot), tiles, ntiles, lse2, dlt, dqacc,
                       sem, dq_out, dk_out, dv_out, out_ld, cos, sin, part, outT, ldt, t, nh, d, scaling, s, block,
                       specialised=specialised, order=order, stages=stages, first_stores=first_stores)


def registers_round(specialised: bool, stages: int = 2, forward: bool = False) -> bool:
    """Whether the tf32 kernel rounds the operands it loads into registers itself (hop32_rows_to_a), so that they
    may be passed as given: the specialised forward's Q; the specialised two-stage backward's K and V. Every
    other operand is read by wgmma from shared memory, which truncates: it needs its rounded copy."""
    return specialised and (forward or stages == 2)


def backward_tf32_rows(ops, transposes, tiles, ntiles: int, lse2, dlt, dqacc, sem, dq_out, dk_out, dv_out,
                       out_ld: int, cos, sin, part, outT, ldt: int, t: int, nh: int, d: int, scaling: float, s: int,
                       block: bool, *, specialised: bool, order: int, stages: int, tail_parts: int = 1,
                       first_stores: bool = False) -> None:
    """tf32 backward from the operands ``ops`` (q, k, v, dO as :class:`Rows`; tf32-rounded, K and V may be as
    given where :func:`registers_round`) and ``transposes`` (K^T by tile, Q^T and dO^T permuted:
    :func:`transposed`), as :func:`backward`; ``dqacc`` from :func:`dq_accumulator_tf32`; ``part`` has two rows
    per tile. ``specialised``: the warp-specialised kernel (two consumer warpgroups and a producer,
    backward_tf32_ws.cuh) rather than the one-consumer one; with ``stages`` 2, its variant holding K and V in
    registers for a second Q/dO stage (backward_tf32_ws2.cuh). ``tail_parts`` (that variant with plain outputs
    only): split the last wave's worth of units (head, 64-key block) into at most this many parts each
    (:func:`tail_split`); their dK and dV are the parts' sums in part order (deterministic, other bits than
    unsplit). ``first_stores`` (the two-stage kernel only; :func:`first_tile_stores`): each sequence's first key
    tile stores its dQ^T shares, so ``dqacc`` may come unzeroed."""
    import cupy

    maps = tuple(x.map(d, nh, t, 64) for x in ops) + tuple(transposed_map(x) for x in (*transposes, dqacc))
    suffix = "" if block else "_plain"
    ptr = lambda a: 0 if a is None else a.data.ptr  # noqa: E731
    ldq = dqacc.shape[-1]
    variant = ("_ws2" if stages == 2 else "_ws") if specialised else ""
    if first_stores and variant != "_ws2":
        raise ValueError("first_stores is a choice of the two-stage tf32 backward (specialised, stages = 2)")
    units = 2 * ntiles  # per head: the 64-key halves of the 128-token tiles
    r, p = tail_split(nh * units, sm_count(cupy.cuda.runtime.getDevice()), tail_parts) \
        if variant == "_ws2" and not block else (0, 1)
    k = _kernel("hop_bwd_tf32" + variant + suffix + ("_split" if r else ""), d)
    args = (*maps, tiles.data.ptr, lse2.data.ptr, dlt.data.ptr, dqacc.data.ptr, ldq, sem.data.ptr, dk_out, dv_out,
            out_ld, ptr(cos), ptr(sin), part.data.ptr, ptr(outT), ldt, t, float(scaling * LOG2E), float(scaling),
            int(order), int(first_stores))
    rows = units
    if r:  # R more units' worth of blocks; each consumer thread's partial dK or dV per part
        buf, cnt, rows = split_buffers(r, p, nh, units, d // 2)
        args += (r, p, units, buf.data.ptr, cnt.data.ptr)
    k((nh, rows, 1), (WS_THREADS if specialised else THREADS, 1, 1), args, s, k.max_smem)
    q = _kernel("hop_dq_tf32" + suffix, d)
    q((ntiles, nh, 1), (THREADS, 1, 1), (dqacc.data.ptr, ldq, tiles.data.ptr, dq_out, out_ld, ptr(cos), ptr(sin),
                                          part.data.ptr, ptr(outT), ldt, t), s, q.max_smem)
