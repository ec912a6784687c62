"""The attention kernels' contract, stated once, and their launch helpers.

Each kernel of ``kernels_cu/attention.cu`` is exported as ``attn_{name}_{precision}``; :data:`KERNELS` gives its
parameter list (one letter per C parameter: ``p`` pointer, ``i`` int32, ``q`` int64, ``f`` float32; the CPU compile
test parses the CUDA source and checks it against this table), its dynamic shared memory (:func:`smem_bytes`, the
carve-up of ``kernels_cu/attention/config.cuh``), and whether it exists only in fp32. The module is compiled once
per head dim (``-DATTN_HEAD_DIM``) with the precision modes' names defined by :mod:`cupy_rope.precision`.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

from .. import _checks as C
from .._kernels import OPTIONS, launcher
from ..precision import Precision
from .varlen import TILE

INNER = 32  # rows streamed per inner step (BN)
NWARP = 8  # warps per block (16 rows each)
THREADS = 32 * NWARP
HEAD_DIMS = (64, 72, 80, 96, 128)
LOG2E = C.LOG2E
LN2 = 0.6931471805599453
DELTA_TOKENS, DELTA_HEADS = 8, 32  # tokens and heads per block of the delta pass (attention/delta.cuh)


@functools.lru_cache(maxsize=None)
def sm_count(dev: int) -> int:
    """Streaming multiprocessors of device ``dev``."""
    import cupy

    return cupy.cuda.runtime.getDeviceProperties(dev)["multiProcessorCount"]


def stride_blocks(items: int, threads: int) -> int:
    """Blocks of ``threads`` for a grid-stride kernel over ``items``: one item a thread, at most 16 blocks an SM of
    the current device."""
    import cupy

    return max(1, min((items + threads - 1) // threads, 16 * sm_count(cupy.cuda.runtime.getDevice())))


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    name: str
    params: str
    smem: str  # "none", "tiles" (resident + streamed tiles), "tiles+stats" (and lse/delta), "staging"
    fp32_only: bool = False  # attn_{name}_fp32 only, for head dims that are a multiple of 16


KERNELS = {k.name: k for k in (
    KernelSpec("prep", "pppipppppiiip", "none"),
    KernelSpec("fwd_dq", "ppppppppppppiiiff", "tiles"),
    KernelSpec("fwd", "ppppiif", "tiles"),
    KernelSpec("dq", "pppppppppiiiff", "tiles"),
    KernelSpec("delta", "piqpqqpiippfp", "none"),
    KernelSpec("dkdv", "pppppppppiiiff", "tiles+stats"),
    KernelSpec("fwd_stats", "ppppppppppppiiiff", "tiles", fp32_only=True),
    KernelSpec("dkdv_dqp", "pppppppppppiiiff", "tiles+stats", fp32_only=True),
    KernelSpec("dq_reduce", "pppppppiiii", "staging", fp32_only=True),
    # the dense form's kernels between its batched products (attention/dense.py; static shared memory only)
    KernelSpec("dense_softmax", "ppqifpfiii", "none"),
    KernelSpec("dense_softmax_dscores", "ppqiff", "none"),
    KernelSpec("dense_scatter", "pppppipipipii", "none"),
    KernelSpec("dense_pointers", "pqppppppppiiip", "none"),
)}


def smem_bytes(spec: KernelSpec, precision: Precision, d: int) -> int:
    """Dynamic shared memory of one block of ``spec`` (must match the carve-up in the CUDA source)."""
    if spec.smem == "none":
        return 0
    staging = TILE * (d + 4) * 4  # fp32 gradient tile of the epilogue (reuses the same memory)
    if spec.smem == "staging":
        return staging
    dk = (d + 15) // 16 * 16
    ld, es = (dk + 8, 2) if precision == Precision.BF16 else (dk + 4, 4)
    tiles = (2 * TILE + 4 * INNER) * ld * es  # two resident tiles + two double-buffered streamed tiles
    extra = 4 * INNER * 4 if spec.smem == "tiles+stats" else 0  # lse / delta, double-buffered
    scratch = NWARP * max(16 * (INNER + 4), 20 * INNER) * 4 if precision == Precision.FP32 else 0  # RsScratch
    return max(tiles + extra + scratch, staging)


def build_options(precision, d: int, options: tuple = ()) -> tuple:
    """The NVRTC options of the attention module's build for one precision at head dim ``d`` (attention.cu,
    ATTN_MODES: that mode's entry points alone; ``options``: extra, for lab variants), so that a call compiles
    the kernels of its precision. Measured (NVRTC, one CPU, head dim 128, s): every mode in one build 7.8 on
    sm_90 (6.6 on sm_80); fp32 alone 3.5 (3.1), tf32 2.2 (2.0), bf16 1.6 (1.5)."""
    p = Precision.parse(precision)
    return OPTIONS + (f"-DATTN_HEAD_DIM={d}", f"-DATTN_MODES={1 << int(p)}") + tuple(options)


def attn_kernel(name: str, precision, d: int, options: tuple = ()):
    """Launcher of kernel ``name`` compiled for head dim ``d`` in its precision's build (extra compile
    ``options`` for lab variants), with its shared-memory limit raised to what it needs."""
    spec = KERNELS[name]
    p = Precision.parse(precision)
    if spec.fp32_only and (p != Precision.FP32 or d % 16):
        raise ValueError(f"attn_{name} exists in fp32 for head dims that are a multiple of 16 only")
    lau = launcher("attention", f"attn_{name}_{p.label}", spec.params, options=build_options(p, d, options))
    need = smem_bytes(spec, p, d)
    if need > lau.max_smem:
        have = _smem_optin()
        if need > have:
            raise RuntimeError(f"vision attention ({p.label}, head_dim {d}) needs {need} bytes of shared memory "
                               f"per block; this GPU allows {have} (Hopper-class GPUs allow 232448)")
        lau.set_max_dynamic_smem(need)
    return lau


def _smem_optin() -> int:
    import cupy

    dev = cupy.cuda.runtime.getDevice()
    return int(cupy.cuda.runtime.getDeviceProperties(dev)["sharedMemPerBlockOptin"])


def launch(name: str, precision, d: int, grid, args, stream: int) -> None:
    """Launch attention kernel ``name`` (blocks of THREADS threads, its shared memory)."""
    k = attn_kernel(name, precision, d)
    k(grid, (THREADS, 1, 1), args, stream, k.max_smem)


def delta_grid(t: int, nh: int) -> tuple:
    """The grid of the delta pass (attention/delta.cuh, both modules): blocks of DELTA_TOKENS tokens of
    DELTA_HEADS heads."""
    return (max(1, -(-t // DELTA_TOKENS)), -(-nh // DELTA_HEADS), 1)


def delta(o, do, head_stride: int, out, lse, lse2, t: int, nh: int, d: int, precision, s: int, sem=None) -> None:
    """The varlen API's row statistics on these kernels: ``out`` [NH, T] = rowsum(dO * o) and ``lse2`` = ``lse``
    / ln 2 (the kernels' log2 domain), from ``o`` [T, NH * D] (fp32 or bf16) as given and ``do``, the packed dO
    (rows of ``do.shape[-1]`` elements, ``head_stride`` from one head to the next), the values dP is made of.
    ``sem``: None, or the ordered dQ sum's counts [NH, T] int32, zeroed in the same pass (no memset of its own)."""
    args = (o.data.ptr, int(o.dtype == C.BF16), o.shape[-1], do.data.ptr, do.shape[-1], head_stride, out.data.ptr,
            t, nh, lse.data.ptr, lse2.data.ptr, float(1.0 / LN2), 0 if sem is None else sem.data.ptr)
    attn_kernel("delta", precision, d)(delta_grid(t, nh), (256, 1, 1), args, s)


def operand_dtype(precision: Precision):
    return C.BF16 if precision == Precision.BF16 else np.float32


def prepare(qkv, bqkv, cos, sin, dO, t, h, nh, d, precision: Precision, s: int, dense_map=None, qk_only=False):
    """Attention operands P[which][NH][T][DK] (q', k', v[, dO]) in the mode's element type. ``qkv``: the fp32
    [T, 3H] product, or a tuple of three fp32 [T, H] arrays (q, k, v). ``dense_map``: the dense form's row map
    (int32 [T, 2], attention/dense.py), whose rows then order each operand's NH * T rows. ``qk_only``: q' and k'
    alone (``dO`` None)."""
    import cupy

    if isinstance(qkv, tuple):
        (q, k, v), ld = (x.data.ptr for x in qkv), h
    else:
        base, ld = qkv.data.ptr, 3 * h
        q, k, v = base, base + 4 * h, base + 8 * h

    if qk_only and dO is not None:
        raise ValueError("prepare: qk_only packs q' and k' alone, dO must be None")
    nwhich = 2 if qk_only else 3 if dO is None else 4
    dk = (d + 15) // 16 * 16
    P = cupy.empty((nwhich, nh, t, dk), dtype=operand_dtype(precision))
    units = nwhich * t * nh * (d // 8)
    attn_kernel("prep", precision, d)((stride_blocks(units, 256), 1, 1), (256, 1, 1),
                                      (q, k, v, ld, bqkv.data.ptr, cos.data.ptr, sin.data.ptr,
                                       0 if dO is None else dO.data.ptr, P.data.ptr, t, h, nwhich,
                                       0 if dense_map is None else dense_map.data.ptr), s)
    return P


class Buffers:
    """Operands of the GEMMs in the mode's storage type (bf16 copies in ``bf16`` mode)."""

    def __init__(self, precision: Precision, stream: int):
        self.precision, self.stream = precision, stream

    def operand(self, x):
        return self.operands(x)[0]

    def operands(self, *xs) -> tuple:
        """The GEMM operands of up to three C-contiguous fp32 arrays (16-byte aligned): in bf16 mode their bf16
        copies, made in one launch; else the arrays themselves."""
        if self.precision != Precision.BF16:
            return xs
        return cast_bf16(self.stream, *xs)

    def operand_and_colsum(self, x, part):
        """:meth:`operand` of ``x`` [rows, cols] and its column sums' partials into ``part`` [chunks, cols]
        (:func:`colsum_chunks`; finished by :func:`colsum_finish`): in bf16 mode from one pass over ``x``
        (the same bits as :func:`colsum`), else the partials alone."""
        if self.precision != Precision.BF16:
            colsum_partial(x, part, self.stream)
            return x
        import cupy

        rows, cols = x.shape
        out = cupy.empty(x.shape, dtype=C.BF16)
        v4 = cols % 4 == 0 and x.data.ptr % 16 == 0  # four columns a lane, 128 a block
        k = launcher("util", "cast_colsum_bf16_v4", "pppiii") if v4 else launcher("util", "cast_colsum_bf16", "pppiii")
        lanes = 128 if v4 else 32
        k(((cols + lanes - 1) // lanes, min(part.shape[0], GRID_Y_MAX), 1), (256, 1, 1),
          (x.data.ptr, out.data.ptr, part.data.ptr, rows, cols, COLSUM_CHUNK), self.stream)
        return out

    def empty(self, shape):
        import cupy

        return cupy.empty(shape, dtype=operand_dtype(self.precision))


def padded(t: int) -> int:
    """Row length of the K-major (transposed) operands: tokens rounded up to 32, pad zero-filled."""
    return (t + 31) // 32 * 32


COLSUM_CHUNK = 256  # rows per partial column sum
GRID_Y_MAX = 65535  # the hardware's limit on grid y: the column-sum and transpose kernels loop over grid rows


def cast_bf16(stream: int, *xs) -> tuple:
    """bf16 copies of up to three C-contiguous fp32 arrays (16-byte aligned), made in one launch."""
    import cupy

    if not 1 <= len(xs) <= 3:
        raise ValueError(f"cast_bf16 takes one to three arrays, got {len(xs)}")
    for x in xs:  # the kernel's 16-byte accesses: a misaligned one would end the CUDA context
        if x.dtype != np.float32 or not x.flags.c_contiguous or x.data.ptr % 16:
            raise ValueError(f"cast_bf16 takes C-contiguous, 16-byte aligned float32 arrays, got {x.dtype} "
                             f"{'contiguous' if x.flags.c_contiguous else 'strided'} at address {x.data.ptr:#x}")
    outs = tuple(cupy.empty(x.shape, dtype=C.BF16) for x in xs)
    args, blocks = [], 0
    for x, o in zip(xs, outs):
        args += [x.data.ptr, o.data.ptr, x.size]
        blocks += (x.size + 2047) // 2048
    args += [0, 0, 0] * (3 - len(xs))
    if blocks:
        launcher("util", "cast_f32_bf16_x3", "ppqppqppq")((blocks, 1, 1), (256, 1, 1), tuple(args), stream)
    return outs


def colsum_chunks(rows: int) -> int:
    """Partial rows of the column sums of ``rows`` rows (COLSUM_CHUNK rows each, at least one)."""
    return max(1, (rows + COLSUM_CHUNK - 1) // COLSUM_CHUNK)


def colsum_partial(x, part, stream: int) -> None:
    """``part`` [colsum_chunks(rows), cols] = the column sums of each chunk of rows of the fp32 ``x``."""
    rows, cols = x.shape
    launcher("util", "colsum_partial", "ppiiqi")(((cols + 31) // 32, min(part.shape[0], GRID_Y_MAX), 1), (256, 1, 1),
                                                 (x.data.ptr, part.data.ptr, rows, cols, cols, COLSUM_CHUNK), stream)


def colsum(x, stream: int, out=None):
    """Column sums of a C-contiguous fp32 [rows, cols] matrix in a fixed order (deterministic)."""
    import cupy

    rows, cols = x.shape
    if out is None:
        out = cupy.empty((cols,), dtype=np.float32)
    part = cupy.empty((colsum_chunks(rows), cols), dtype=np.float32)
    colsum_partial(x, part, stream)
    colsum_finish(part, out, stream)
    return out


def colsum_finish(part, out, stream: int, column=None) -> None:
    """``out`` = the sum of the rows of ``part`` [n, cols], in row order; with ``column`` = (a, j), also into
    column j of the fp32 [cols, ld] array ``a`` (the first pad column of :func:`transpose_colsum`'s output)."""
    n, cols = part.shape
    out2, ld2 = 0, 0
    if column is not None:
        a, j = column
        if a.dtype != np.float32 or a.ndim != 2 or a.shape[0] != cols or not 0 <= j < a.shape[1]:
            raise ValueError(f"colsum_finish: column {j} of a {a.dtype} {a.shape} array for {cols} sums")
        out2, ld2 = a.data.ptr + 4 * j, a.shape[1]
    launcher("util", "colsum_finish", "ppiipq")(((cols + 31) // 32, 1, 1), (256, 1, 1),
                                                (part.data.ptr, out.data.ptr, n, cols, out2, ld2), stream)


def transpose_rows(width: int) -> int:
    """Partial rows of :func:`transpose_colsum`'s column sums for an output row length ``width``."""
    return (width + 63) // 64


def transpose_colsum(x, part, stream: int, width: int):
    """:func:`transpose` of a C-contiguous fp32 [r, c] matrix (c a multiple of 4, 16-byte aligned) into [c, width]
    (width >= r, a multiple of 4, columns from r zero) and, from the same reads, its column sums' partials into
    ``part`` [transpose_rows(width), c] (finished by :func:`colsum_finish`)."""
    import cupy

    r, c = x.shape
    if (x.dtype != np.float32 or part.dtype != np.float32 or c % 4 or width % 4 or width < r or x.data.ptr % 16
            or part.shape != (transpose_rows(width), c)):
        raise ValueError(f"transpose_colsum: [{r}, {c}] into width {width}, partials {part.shape}")
    out = cupy.empty((c, width), np.float32)
    grid = ((c + 63) // 64, min(transpose_rows(width), GRID_Y_MAX), 1)
    launcher("util", "transpose_colsum_f32_v4", "pppiii")(grid, (256, 1, 1), (x.data.ptr, out.data.ptr, part.data.ptr,
                                                                             r, c, width), stream)
    return out


def transpose(x, stream: int, pad: bool = False):
    """Transposed copy of a C-contiguous fp32 [r, c] matrix: [c, r], or [c, padded(r)] zero-padded."""
    import cupy

    r, c = x.shape
    ld = padded(r) if pad else r
    out = cupy.empty((c, ld), np.float32)
    if c % 4 == 0 and ld % 4 == 0:  # 16-byte rows both ways (hidden sizes are multiples of 8)
        grid = ((c + 63) // 64, min((ld + 63) // 64, GRID_Y_MAX), 1)
        launcher("util", "transpose_f32_v4", "ppiii")(grid, (256, 1, 1), (x.data.ptr, out.data.ptr, r, c, ld), stream)
    else:
        grid = ((c + 31) // 32, min((ld + 31) // 32, GRID_Y_MAX), 1)
        launcher("util", "transpose_f32", "ppiii")(grid, (32, 8, 1), (x.data.ptr, out.data.ptr, r, c, ld), stream)
    return out


def scale(x, k: float, stream: int, out=None):
    """``x * k`` rounded to fp32 (``x`` fp32, contiguous; into ``out``, which may be ``x``), as one launch of the
    library's own (the same bits as CuPy's elementwise multiply by ``numpy.float32(k)``)."""
    import cupy

    out = cupy.empty_like(x) if out is None else out
    n = x.size
    launcher("util", "scale_f32", "ppfq")((max(1, min(1024, (n + 255) // 256)), 1, 1), (256, 1, 1),
                                          (x.data.ptr, out.data.ptr, float(np.float32(k)), n), stream)
    return out
