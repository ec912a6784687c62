"""The plan of one call: every tuning decision of the vision attention block, as a frozen value.

:func:`make_plan` is a pure function of the problem (precision, head dim, tokens, longest sequence in tiles). The
schedule reads only the plan; a graph handle keys its recordings by the plan as a whole; tests and lab scripts
override a field with ``dataclasses.replace`` and pass the plan (or a function of it) as ``plan=``. The thresholds
below are constants, never reassigned; each states the measurement it comes from (bench/NOTES.md has the history).
"""
from __future__ import annotations

import dataclasses
import types

from ..precision import Precision
from .hopper import BN, BN192, BQ, BQ80, GRID_Y_MAX, Q80_HEAD_DIMS
from .varlen import TILE

# tf32 tensor cores read both GEMM operands along the contraction (K-major). The two weight gradients contract over
# tokens, which every operand holds along rows; the tf32 backward feeds cuBLAS K-major operands for them (transposed
# copies of X and dY; O^T and grad_qkv^T written by the attention kernels). Measured faster than the plain layouts
# at every seed size (131 tokens up). The other products run as stored: their best cuBLAS kernels are as fast as
# with transposed weights, whose copies would cost more than they save.
TF32_KMAJOR = True

# FFMA SGEMM (fp32) is fastest when both stored operands hold the contraction along their rows (cuBLAS's "NT"):
# 54.1 TFLOP/s at 8192^3 against 51.6 for the plain layout, 5-7% faster on the backward's large products. From
# FP32_NT_MIN_TOKENS the fp32 backward so feeds dO (from dY^T) and grad_hidden_states (from grad_qkv^T, written by
# the attention kernels); from FP32_NT_QKV_MIN_TOKENS the QKV product too, which needs X^T and Wqkv^T (3 H^2 floats,
# 154 MB at H = 3584, paid back only by a long product). Measured on the whole backward: dO and grad_hidden so fed
# were 0-6% faster at every size; QKV as well was 3-10% slower up to 392 tokens and 0.3-0.9% faster from 4096.
FP32_NT_MIN_TOKENS = 0
FP32_NT_QKV_MIN_TOKENS = 4096

# Independent products on a second stream (dO beside QKV, grad_proj_weight beside the dK/dV kernel,
# grad_qkv_weight beside grad_hidden_states) up to CONCURRENT_MAX_TOKENS: up to 12% faster up to 2048 tokens, from
# 5% faster to 4% slower at 2940-4096; from 4704 tokens, where every product is many waves long, +-3-4%.
# fp32, whose attention kernels are shorter beside its FFMA GEMMs, uses it at every size (0.8-2.3% faster from 4704).
# bf16, since its casts and preparation moved (one pass for dY's cast and column sums, one launch for the X and
# Wqkv casts, the in-place operands), measured again (dev/attn_ab.py, serial / concurrent, us, 4 and 6 rounds):
# 4704 tokens 2289 / 2277 and 2348 / 2324, 5880 2890 / 2823 and 2946 / 2893, 8192 3810 / 3813 and 4125 / 4079:
# -0.5 to -2.3% but once +0.1%, so concurrent up to BF16_CONCURRENT_MAX_TOKENS (the sizes measured).
# tf32 measured again (serial / concurrent, us, 3 then 6 rounds): 4704 tokens 5146 / 5003 and 4912 / 4865, 5880
# 6157 / 6090 and 5718 / 5676, 8192 8189 / 8351 and 7900 / 7939: concurrent up to CONCURRENT_MAX_TOKENS.
CONCURRENT_MAX_TOKENS = 5880
BF16_CONCURRENT_MAX_TOKENS = 8192
FP32_CONCURRENT_MAX_TOKENS = 1 << 62

# fp32 (head dims a multiple of 16) takes dQ from the dK/dV kernel while no sequence has more than this many tiles:
# each key tile's block adds dS K for every query of its sequence into its own partial (at most
# DQ_PARTIAL_MAX_TILES x T x H floats) and a reduction sums them in order (deterministic). That drops the forward
# kernel's second pass over K and V (3 of its 5 L^2-products): about -15% of the fp32 attention kernels. Longer
# sequences keep the second pass (the partials would grow with the sequence).
DQ_PARTIAL_MAX_TILES = 2
# Beyond that (DQ_ORDERED), the dK/dV kernel adds each key tile's dS K into one [T, H] sum instead, in key-tile
# order: a count per (head, 32-query step) says how many of the sequence's key tiles have added their share, and
# tile kt waits for kt before it adds (the same sums in the same order as the partials' reduction). The forward
# kernel's second pass (three L^2-products) goes at every length for one ordered add of 32 x D a step.
DQ_ORDERED = True

# A graph handle records and replays the launch sequence up to GRAPH_MAX_TOKENS tokens: there the GPU work of a
# backward (~0.3-2 ms) is not much longer than issuing its ~20 launches and cuBLAS calls from Python, so the GPU
# would wait on the host. Above it the handle runs the calls directly: the GPU time is the same, and a graph would
# hold its temporaries (~17 T H floats) for nothing.
GRAPH_MAX_TOKENS = 2048

# On Hopper (sm_90a) bf16 attention runs on the wgmma/TMA kernels (attention/hopper.py): one pass over K and V per
# query tile forward, one pass over the queries per key tile backward. Head dims they are built for:
HOPPER_HEAD_DIMS = (64, 80, 96, 128)  # multiples of 16 up to 128: built (one module each) and tested
# The block's bf16 takes them at every size. Measured on the whole bf16 backward (seed dims, sequences of 105-256,
# graph replay), with the packed preparation: 2-9% slower than the mma.sync kernels up to 919 tokens (their three
# extra small launches -- delta, the dQ write, the order counters' reset -- and a pipeline too short to fill on
# 1-2 tiles per sequence), 0-4% faster from 1024; 24-41% faster on sequences of 4096-16384. With the operands read
# where the products leave them (HOPPER_IN_PLACE: a lighter preparation), again (dev/attn_ab.py, 3-5 rounds,
# mma.sync / sm_90a, us): 373 tokens 313.7 / 318.0 (+1.4%), 392 339.9 / 331.4 (-2.5%), 613 429.9 / 426.5 (-0.8%),
# 773 530.1 / 513.8 (-3.1%), 919 597.7 / 567.8 (-5.0%): they then ran from 384 tokens. With delta and the
# counters' reset in the forward's epilogue (Plan.fwd_delta: the delta pass, which also reset them, gone), again
# (3 rounds, two runs on two machines, mma.sync / sm_90a, us): 131 tokens 252.5 / 248.6 and 255.2 / 252.3, 196
# 271.7 / 261.5 and 273.6 / 261.5, 211 262.2 / 260.6, 373 310.1 / 309.4 and 309.3 / 311.9, 392 337.8 / 328.5 and
# 338.9 / 328.9: faster or even everywhere. The varlen API always takes them (its mma.sync path also repacks the
# operands).
# tf32 takes them when the longest sequence has HOPPER_TF32_MIN_TILES tiles (over 896 tokens) or more. Measured on the
# whole tf32 backward (dev/attn_ab.py, graph replay): on the seed dims (sequences of 105-256) they were slower on
# every workload, 1-17% (T = 131 to 8192: their extra launches -- four transposed copies, delta, the dQ write --
# and 64-key blocks that a short sequence cannot keep busy); on sequences of 1024 and longer faster: 8 x 1024
# 10.4 ms against 11.5, 1 x 16384 105 ms against 152. The total token count does not decide, the length does.
HOPPER_TF32_MIN_TILES = 8

# Their tf32 backward is warp-specialised (backward_tf32_ws.cuh): two consumer warpgroups run a step's two chains
# (S^T, P^T, dV and dP^T, dS^T, dK, dQ) side by side while a producer warpgroup issues the copies, where the
# one-consumer kernel (backward_tf32.cuh) runs them one after the other. So is the bf16 backward
# (backward_ws.cuh): the ordered dQ sum runs on writer warps, off the products' path, where the two-warpgroup
# kernel (backward.cuh) waits for it between steps. Both measured faster at every length (bench/NOTES.md).
HOPPER_SPECIALISED = True
# Their bf16 forward is warp-specialised (forward_ws.cuh): a producer warp issues the copies and each consumer
# warpgroup computes the next K/V tile's scores beside the current softmax, where forward.cuh waits for each
# product and meets the other warpgroup at a barrier per tile.
HOPPER_FWD_SPECIALISED = True
# The tf32 forward likewise (hop_fwd_tf32_ws, forward_tf32.cuh) from head dim HOPPER_TF32_FWD_SPECIALISED_MIN_DIM:
# each consumer warpgroup holds its Q rows as wgmma A fragments, so that Q's shared memory becomes a third K/V
# stage, and computes a tile's softmax beside the previous tile's P V product; the same bits as the two-stage
# kernel (hop_fwd_tf32). Measured, forward alone (dev/varlen_ab.py, 3 rounds, ms, specialised / two-stage): 1 x 16384
# (28 heads, D = 128) 11.23 / 13.32, 4 x 4096 3.22 / 3.89, 32 x 256 0.431 / 0.438; 16 heads: 1 x 9216 D = 80 1.53 /
# 1.93, 4 x 2048 D = 96 0.477 / 0.551, 1 x 8192 D = 64 1.127 / 1.100 (slower: a 64-key tile's products are too
# short to hide the softmax beside, as in the tf32 backward's second stage at D = 64).
HOPPER_TF32_FWD_SPECIALISED_MIN_DIM = 80


def tf32_fwd_specialised(head_dim: int) -> bool:
    """Whether the tf32 sm_90a forward is the warp-specialised kernel (see HOPPER_TF32_FWD_SPECIALISED_MIN_DIM)."""
    return head_dim >= HOPPER_TF32_FWD_SPECIALISED_MIN_DIM


# The sm_90a backward kernels run one block per (head, key unit) on a grid of NH x units: the call's TILE-token
# tiles in bf16, their 64-key halves in tf32, and a tail split (TAIL_PARTS_MAX) adds fewer than SMs x
# (TAIL_PARTS_MAX - 1) / NH rows, under SPLIT_ROWS_BOUND on any Hopper part. A grid holds at most GRID_Y_MAX blocks
# along that dimension, so a call with more units than that takes the mma.sync kernels (a grid of tiles x NH)
# wherever it runs a backward (the varlen API's forward alone keeps them: its grid puts query tiles first). Only
# many short sequences get there: 32256 tiles in tf32, for example 32256 sequences of up to 128 tokens.
SPLIT_ROWS_BOUND = 1024


def hopper_backward_fits(precision, tiles: int) -> bool:
    """Whether the sm_90a backward's grid holds a call of ``tiles`` TILE-token tiles (see SPLIT_ROWS_BOUND)."""
    units = tiles * (2 if Precision.parse(precision) == Precision.TF32 else 1)
    return units + SPLIT_ROWS_BOUND <= GRID_Y_MAX


# The tf32 sm_90a backward reads K^T laid out by tile (hopper.transposed with the tile table: TILE columns a tile,
# zero past each sequence's end), NH x D x TILE x tiles floats where K itself holds NH x D x T. On sequences of a
# tile or more that is K's size give or take a padded last tile; on sequences much shorter than a tile it is a
# multiple of K (one-token sequences: TILE = 128 times; 10000 of them at 28 heads x 128 would take 18 GB of K^T for
# a 143 MB K). The mma.sync kernels keep every operand O(T x H) (the dense form, where its rule holds, stores
# scores of at most 256 keys a row). So the library gives a tf32 backward the sm_90a kernels only while K^T by tile
# is at most TF32_KT_PAD_MAX times K: sequences of 32 tokens or more on average. Every measured workload is far
# inside (the seeds' 105-256-token sequences at most 2x, the mixed varlen case 1.06x); the speed of either path
# on such calls is not measured. A caller's plan may still force the sm_90a kernels (their grid permitting; with
# dense=False where the library's plan took the dense form: one run of equal lengths, tf32's dense rule).
TF32_KT_PAD_MAX = 4


def library_hopper_backward(precision, tiles: int, tokens: int) -> bool:
    """Whether the library gives a backward of ``tiles`` TILE-token tiles over ``tokens`` tokens the sm_90a kernels:
    their grid holds it (:func:`hopper_backward_fits`) and, in tf32, K^T by tile stays within TF32_KT_PAD_MAX times K
    (see there)."""
    p = Precision.parse(precision)
    return hopper_backward_fits(p, tiles) and (p != Precision.TF32 or TILE * tiles <= TF32_KT_PAD_MAX * tokens)


# The specialised tf32 forward's last wave. Its block holds an SM alone and the units of a long sequence take about
# the same time, so 28 heads x 128 query tiles (1 x 16384, or 4 x 4096) = 27 x 132 + 20 units end in a wave of 20
# blocks beside 112 idle SMs. Forward alone at one 16384-token sequence, D = 128, per MHz of SM clock (one H100,
# clocks 1667-1861 MHz; bench/NOTES.md): 28 and 32 heads (27.15 and 31.03 waves) 0.198 TFLOP/s per MHz, 33 heads
# (32 whole waves) 0.204: the partial wave costs what the model says (3%). hopper.forward_tail splits the first
# units over their key steps, up to FWD_TAIL_PARTS_MAX parts, from FWD_TAIL_MIN_TILES query tiles in the longest
# sequence (0: never). Measured with it (forward alone, per MHz, same run): 1 x 16384 D 128 +2.1-2.9%, 9216 D 80
# +1.9%, 4 x 4096 even (its parts walk ~11 of 64 key steps each; with 4 parts of 16 steps even too, measured
# again: no floor on a part's steps).
FWD_TAIL_PARTS_MAX = 8
FWD_TAIL_MIN_TILES = 16


def fwd_tail_parts(precision: Precision, head_dim: int, max_tiles: int) -> int:
    """The most parts the specialised tf32 forward may split a unit of its last wave into (see
    FWD_TAIL_MIN_TILES); 1: none."""
    on = (precision == Precision.TF32 and tf32_fwd_specialised(head_dim) and 0 < FWD_TAIL_MIN_TILES <= max_tiles)
    return FWD_TAIL_PARTS_MAX if on else 1


# Q/dO stages of the specialised tf32 backward: 2 holds K and V as wgmma A fragments in registers, so that their
# shared memory takes a second Q/dO stage (backward_tf32_ws2.cuh), from head dim HOPPER_TF32_STAGES_MIN_DIM on.
# Measured, backward alone, the same bits either way: 1 x 8192 D = 128 +9.7% (148 against 135 TFLOP/s), D = 96
# +3.5%, 1 x 9216 D = 80 +1.8%; at D = 64 it was 3.5% slower while warpgroup 1 added its dQ^T rows from registers
# (each of dV and dK is two m64n32k8 halves there, and a step has too little work to hide a copy behind). With
# dQ^T staged in shared memory and added by the copy engine (which only this kernel does) it was 7.3% faster at
# 1 x 8192 D = 64 (5.15 against 5.56 ms) and 6.0% on the mixed D = 64 lengths, so every head dim takes two stages.
HOPPER_TF32_STAGES_MIN_DIM = 64
# The bf16 varlen backward (plain fp32 outputs, specialised kernel) writes dQ from each sequence's last key tile
# when the longest sequence has at most HOPPER_FUSED_DQ_MAX_TILES tiles: its writer warps add the earlier tiles'
# sum (dqacc, read back through L2) to their own share and store the output, so that the dQ write kernel (83 us
# of a 525 us backward at 32 x 256, 28 heads, D = 128, under Nsight Compute) is not launched. The same bits
# either way. Measured, backward alone (28 heads, D = 128 unless named), against the dQ write kernel: 64 x 128
# -25%, 32 x 256 -5%, 16 x 1024 -3%, 8 x 2048 -2.5%; 4 x 4096 -0.4 to -0.6% (a tie); 1 x 16384 +0.8% and
# 1 x 9216 (D = 80) +4% slower (bench/NOTES.md). At D = 128 the 80-row steps (below), which write no dQ of their
# own, take over from QUERY_ROWS_80_MIN_TILES tiles. A persistent form of this kernel (one block per SM walking
# every key tile of one sequence and head in turn, the next unit's tiles loaded beside the last products) was
# measured slower wherever a sequence has two tiles or more (backward alone, per unit / persistent: 32 x 256
# 0.371 / 0.411 ms, 16 x 512 0.540 / 0.746; bench/NOTES.md) and is not built.
HOPPER_FUSED_DQ_MAX_TILES = 16


def tf32_stages(head_dim: int) -> int:
    """Q/dO stages of the specialised tf32 backward for ``head_dim``."""
    return 2 if head_dim >= HOPPER_TF32_STAGES_MIN_DIM else 1

# The two-stage tf32 backward adds each key tile's dQ^T share of a query step into a transposed fp32 accumulator,
# zeroed first (a memset of NH x D x T floats: 117 MB at 32 x 256, 28 heads, D = 128). Where every sequence holds
# whole 64-token steps (Varlen.whole_steps: the last may end anywhere), each sequence's first key tile stores its
# share instead and the memset goes (Plan.tf32_first_stores, hopper.first_tile_stores): the same bits. Measured,
# backward alone (dev/varlen_ab.py, tf32, 5 rounds, one H100, ms, adds / stores / adds again): 32 x 256 1.186 /
# 1.140 / 1.184, 8 x 1024 2.112 / 2.073 / 2.119, 4 x 2048 (16 heads, D 64) 1.343 / 1.327 / 1.342, 4 x 4096 12.367
# / 12.311 / 12.359, 1 x 16384 44.68 / 44.57 (the second adds; the first setting of that case read 46.03), 9216
# (16 heads, D 80) 6.43 / 6.42 / 6.47; the block's long workloads 0.1-1.3% faster. No length where it loses: on
# wherever the layout allows.

# Their backward blocks run key-tile-fastest (over groups of heads, below) when the longest sequence has
# KEY_MAJOR_MIN_TILES tiles or more (tf32 at head dim 128: KEY_MAJOR_MIN_TILES_TF32_128), else head-fastest
# (Plan.head_group = 0; hop_bwd_block says why each).
# Measured: key-tile-fastest, a 1 x 8192 backward read its streamed tiles from L2 instead of DRAM: tf32 +22%
# (115.6 to 140.6 TFLOP/s), bf16 3-5% faster from 4 x 4096 up; on the seed sequences (105-256 tokens, one or two
# tiles) bf16 was slower by up to 7% (neighbouring tiles waiting on each other's dQ shares), so short sequences
# keep head-fastest; groups of heads there were no better (bench/NOTES.md).
KEY_MAJOR_MIN_TILES = 8
# tf32 at head dim 128 from KEY_MAJOR_MIN_TILES_TF32_128 tiles. Measured (backward alone, dev/varlen_ab.py, 5
# rounds, one H100, head-fastest / key-tile-fastest with the rule's G = 8, ms): 28 heads 40 x 200 1.318 / 1.276,
# 32 x 256 1.145 / 1.096, 20 x 384 1.274 / 1.176, 16 x 512 1.553 / 1.405, 12 x 640 1.649 / 1.460, 8 x 768 1.481 /
# 1.293, 8 x 256 (under seven waves) 0.311 / 0.310, and one tile (64 x 128) 0.912 / 0.926; 16 heads within 1.3%
# either way (32 x 256 0.637 / 0.638, 16 x 512 0.812 / 0.815, 64 x 128 0.536 / 0.543). Below 128 head-fastest
# stays: with two tiles it was 2-6% faster (28 heads: D 80 0.769 / 0.813, D 96 0.870 / 0.891; 16 heads: D 64
# 0.375 / 0.390), with four it was mixed (28 heads: D 80 1.094 / 1.076, D 96 1.237 / 1.167; 16 heads: D 64 0.500
# / 0.529, D 80 0.598 / 0.625). bf16 keeps head-fastest below 8 tiles (28 heads, D 128, against G = 4, the best
# of 1, 2 and 4): 32 x 256 0.366 / 0.376, 16 x 512 0.554 / 0.556, 30 x 196 0.295 / 0.307.
KEY_MAJOR_MIN_TILES_TF32_128 = 2


def key_major_min_tiles(precision, head_dim: int) -> int:
    """The tiles of the longest sequence from which the sm_90a backward runs key-tile-fastest (Plan.head_group)."""
    if Precision.parse(precision) == Precision.TF32 and head_dim == 128:
        return KEY_MAJOR_MIN_TILES_TF32_128
    return KEY_MAJOR_MIN_TILES


# ... and key-tile-fastest over groups of heads (hop_bwd_block): the blocks in flight take consecutive
# key tiles of G heads in turn. Two costs pull G apart. The heads in flight stream their sequences' Q and dO
# tiles: G heads' worth must stay in L2 (at 1 x 16384, D = 128, one head's Q and dO are 8 MiB, and G = 2 was
# 1.3% slower, head-fastest 7%). And a key tile adds its dQ share of a query step only after the tile before it
# has (the ordered sum): blocks of one sequence that start together wait on each other in a chain as long as
# the tiles of one head in flight (132 / G), so with one head in flight, many tiles of a sequence start together
# (4 x 4096: 32 at a time; measured without the ordering, that backward was 12% faster). Measured (backward
# alone, bf16, G = 1 / 2 / 4 / 8 / head-fastest, ms; bench/NOTES.md): 1 x 16384 D 128 23.8 / 24.1 / 24.2 / 24.8
# / 25.5; 2 x 8192 12.4 / 12.1 / 12.3 / 12.4 / 13.1; 4 x 4096 6.99 / 6.59 / 6.36 / 6.38 / 7.00; 1 x 9216 D 80
# 3.55 / 3.43 / 3.36 / 3.42 / 3.42; 8192 D 64 2.54 / 2.33 / 2.31 / 2.41 / 2.45; mixed D 64 1.54 / 1.51 / 1.38 /
# 1.32 / 1.31; 8 x 1024 1.12 / 1.07 / 1.02 / 1.00 / 1.10. The rule that picks the best or within 2% of it in
# each: the largest G (a power of two, at most 8) whose heads' Q and dO of the longest sequence fit in
# BWD_GROUP_BYTES (a quarter of the 50 MB L2, with room for the K/V tiles and the dQ sums). The tf32 kernels
# stream fp32 tiles (4 bytes a value), and the same rule picked the best or within 2% of it (G = 1 / 2 / 4 /
# head-fastest, ms): 1 x 16384 60.9 / 60.8 / 60.8 / 100.4 (rule: 1); 4 x 4096 18.4 / 16.5 / 16.7 / 24.5 (2);
# 1 x 9216 D 80 10.9 / 10.8 / 10.7 / 11.8 (2); mixed D 64 4.44 / 4.19 / 4.04 / 3.97 (4).
BWD_GROUP_BYTES = 12 << 20
BWD_GROUP_MAX = 8
# What a caller's plan may ask for: the sm_90a backward kernels order their blocks by head_group x key units in
# 32-bit arithmetic, and their grid rows are bounded for at most TAIL_PARTS_MAX parts of a split (SPLIT_ROWS_BOUND;
# the forward's grid the same for FWD_TAIL_PARTS_MAX). 64 x 65535 units stays under 2^31.
HEAD_GROUP_LIMIT = 64

# The specialised bf16 backward's last wave (hopper.tail_split): a long sequence's units (head, key tile) all take
# about one time W, and 28 heads x 128 tiles (1 x 16384, 4 x 4096, 2 x 8192) are 27 waves of 132 SMs and 20
# blocks, so the last W runs on 20 SMs (~0.85 ms of a 23 ms backward at 1 x 16384). The first units of the launch
# run split instead, each over a P-th of its query steps, their dK and dV summed in part order by the last part.
# A part needs enough steps to hide its prologue (K and V) and epilogue (its partial dK and dV written and read
# back): at most TAIL_PARTS_MAX parts of at least TAIL_MIN_STEPS query steps of the longest sequence.
# Measured (backward alone, bf16, H200, split against unsplit in one process; bench/NOTES.md): 1 x 9216 D 80 (96
# units left, 4 parts) -2.4 / -2.5 / -1.9% (three runs), 8192 D 96 (100 left, 5 parts) -1.8%, and the whole block
# at 1 x 9216 (Qwen2-VL dims) -2.6%. At D 128 within +-2% and no better on the whole (1 x 16384: 20 left, 6
# parts, +0.4 / -0.1%; 4 x 4096 -2.1 / -0.6%; 2 x 8192 -0.9 / -1.2%; 1 x 4096: 104 left, 5 parts, +3.3%): the
# parts of 20 consecutive key tiles wait on each other's dQ shares, and at D 128 the loop is its longest. At D 64
# slower (8192 +1.5 / +4.4%, mixed lengths +2.2 / +5.8%). So at TAIL_HEAD_DIMS only.
TAIL_PARTS_MAX = 8
TAIL_MIN_STEPS = 8
TAIL_HEAD_DIMS = (80, 96)
# The two-stage tf32 backward (varlen API, plain outputs) splits its last wave the same way; its units are 64
# keys, so 1 x 16384 (28 heads) is 7168 units, 54 waves and 40 blocks, and a unit runs ~0.75 ms. Its dQ^T adds
# leave through the copy engine on a warp of their own, so a part's wait on its predecessor's share holds that
# warp, not the consumers.
TF32_TAIL_HEAD_DIMS = (64, 80, 96)


# The query rows of a step of the specialised bf16 backward. Per step each consumer warpgroup waits for its S^T and
# dP^T, makes P^T and dS^T, stages dS^T, meets the other at a barrier and hands its dQ share to the writers: fixed
# costs that a step of 64 queries at D = 128 (1.3 MFLOP per warpgroup) does not hide. The q80 kernels walk steps
# of 80 (25% more products for the same waits; their S^T and dP^T take 16 more registers, which 240 a consumer
# thread holds) with dQ made transposed (dq^T = K^T dS^T), the only form whose m64 fits 80 queries; the same bits
# as 64 rows. A step past the sequence's end computes masked rows, so short sequences lose: 256 queries are 4
# steps either way, but 320 rows of products against 256. Measured (backward alone, 28 heads, D = 128, ms, 64 /
# 80 rows, unfused; bench/NOTES.md): 1 x 16384 23.71 / 21.44 (-10%), 4 x 4096 6.14 / 5.64, 2 x 8192 12.11 /
# 10.96, 1 x 4096 1.68 / 1.51, 4 x 2048 1.82 / 1.63 (the fused dQ write 1.91), 8 x 1024 1.11 / 0.94 (fused
# 0.99), 9 x 896 1.03 / 0.98 (fused 1.05), 10 x 768 0.90 / 0.86 (fused 0.88), 16 x 512 0.74 / 0.72 (fused
# 0.77); 32 x 256 0.427 / 0.450 (fused 0.397). So from QUERY_ROWS_80_MIN_TILES tiles D = 128 takes them, in
# place of the fused dQ write. Re-checked once the q80 step's dQ left through the copy engine (10-15% faster;
# library plan / q80 forced / 64 rows fused, ms): 32 x 256 0.497 / 0.535 / 0.514, 16 x 512 0.615 / 0.641 /
# 0.745, 4 x 2048 1.391 / 1.429 / 1.852: the same thresholds.
QUERY_ROWS_80_MIN_TILES = 4
QUERY_ROWS_80_HEAD_DIMS = Q80_HEAD_DIMS  # where the q80 kernels and the k192 forward are built (hopper.py)


def query_rows(head_dim: int, max_tiles: int) -> int:
    """Query rows per step of the specialised bf16 sm_90a backward (see QUERY_ROWS_80_MIN_TILES)."""
    return BQ80 if head_dim in QUERY_ROWS_80_HEAD_DIMS and max_tiles >= QUERY_ROWS_80_MIN_TILES else BQ


# The keys per K/V tile of the specialised bf16 forward: 128, or 192 at D = 128 (the k192 kernel): per tile each
# consumer warpgroup waits for its scores, takes its turn at the tensor cores, shuffles the row max and sum and
# rescales O, and 192 keys carry 50% more products through those costs (S and P take 96 + 48 registers: the
# consumers hold 240). Two stages of 192-row K and V fill the shared memory, so K and V are released apart
# (forward_ws.cuh). A sequence shorter than a few tiles computes masked keys: 256 keys are two 192-key tiles.
# Measured (forward alone, 28 heads, D = 128, ms; bench/NOTES.md): 128 / 176 keys (FlashAttention-3's tile there,
# the first form) 1 x 16384 6.74 / 6.29 (-6.7%, 571 -> 612 TFLOP/s), 2 x 8192 3.47 / 3.26, 4 x 4096 1.79 / 1.68,
# 1 x 4096 0.455 / 0.436; 8 x 1024 0.279 / 0.274 and 4 x 2048 0.473 / 0.523 (+11%); the whole bf16 block 1 x 16384
# -2.2%, 2 x 8192 -1.6%, 8 x 1024 +1.6%. Then 176 / 192 keys: 1 x 16384 6.43 / 6.27, 2 x 8192 3.27 / 3.20,
# 4 x 4096 1.75 / 1.60. And 128 / 192 keys on shorter sequences: 4 x 2048 0.456 / 0.443, 2 x 3072 0.524 / 0.484,
# 1 x 4096 0.423 / 0.409, but 8 x 1024 0.276 / 0.289 (+4.7%: 1024 keys are 6 tiles of 192, 1152 keys of products).
# FWD_KEYS_192_MIN_TILES: from which longest sequence (in 128-token tiles) D = 128 takes them.
FWD_KEYS_192_MIN_TILES = 16


# The specialised bf16 forward runs persistent (hop_fwd_bf16_ws_persist: one block per SM walks the units) when the
# longest sequence has at most FWD_PERSISTENT_MAX_TILES tiles. A block of the launch-per-unit kernel on a 256-token
# sequence streams two K/V tiles: the latency of its first copies and its O stores are not hidden behind products,
# and the next block on the SM starts only once it has left (32 x 256 tokens, 28 heads, D = 128: 121 us, where
# cuDNN's forward takes 69, kernel timeline). The persistent block copies the next unit's Q and K/V while the
# current one finishes; the same products per unit, the same bits. Measured (forward alone, ms, per unit /
# persistent; bench/NOTES.md): 32 x 256 D 128 0.137 / 0.124, 64 x 128 0.106 / 0.095, 16 x 512 0.218 / 0.197,
# 8 x 1024 0.260 / 0.246, 10 x 1536 0.780 / 0.755, 4 x 2048 D 96 0.232 / 0.224, 32 x 256 D 80 0.101 / 0.089,
# 64 x 256 D 64 0.098 / 0.076; on long sequences even (1 x 9216 D 80 0.912 / 0.918, 2 x 4096 D 64 0.339 /
# 0.338) or slower where one sequence is most of the work (the mixed D 64 case, 5000 of 8782 tokens: 0.376 /
# 0.414: the blocks' fixed shares of units no longer even out). At D = 128 the k192 forward takes over from
# 16 tiles.
FWD_PERSISTENT_MAX_TILES = 16


def fwd_persistent(head_dim: int, max_tiles: int) -> bool:
    """Whether the specialised bf16 sm_90a forward runs persistent (see FWD_PERSISTENT_MAX_TILES)."""
    return 0 < max_tiles <= FWD_PERSISTENT_MAX_TILES and fwd_keys(head_dim, max_tiles) == BN


# The persistent bf16 forward can store O through the copy engine (Plan.fwd_o_bulk, hop_fwd_bf16_ws_persist_bulk:
# each warpgroup's 64 rows staged in the last K/V tile's K buffer, one bulk tensor store per column block, the stage
# released once the engine has read it) instead of from registers. O's stores from registers cost a unit's end:
# without any O stores (a timing probe) the forward at 32 x 256 tokens (28 heads, D 128) took 0.069 ms against
# 0.101. Measured as a build switch of the same code (forward alone, ms, 3 rounds, streaming stores from registers /
# copy engine): 64 x 128 0.082 / 0.075, 32 x 256 0.099 / 0.096, 8 x 1024 0.232 / 0.243, 40 x 200 (16 heads, D 80)
# 0.058 / 0.062: where units are one or two tiles at D = 128 the warps go on to the next unit at once; over longer
# units, and at D = 80, the staging and the stage held back cost more than the stores. As the plan's default, beside
# the streaming stores (forward alone, ms, 3 rounds, registers / copy engine): 64 x 128 0.082 / 0.070, 32 x 256 0.099
# / 0.082 at D = 128; 16 heads, D 64: 64 x 128 0.031 / 0.029, 32 x 256 0.038 / 0.040; D 96: 64 x 128 0.048 /
# 0.044, 32 x 256 0.054 / 0.049; D 80: 64 x 128 0.042 / 0.040, 32 x 256 0.049 / 0.045 (full second tiles; 40 x
# 200 above, whose second tiles end in their first warpgroup's rows, lost). The most query tiles per sequence for
# which it wins, by head dim (other head dims not measured: registers there):
FWD_O_BULK_MAX_TILES = types.MappingProxyType({64: 1, 80: 1, 96: 2, 128: 2})  # read-only


def fwd_o_bulk(head_dim: int, max_tiles: int) -> bool:
    """Whether the persistent bf16 forward stores O through the copy engine (see FWD_O_BULK_MAX_TILES); only
    where it runs persistent."""
    return max_tiles <= FWD_O_BULK_MAX_TILES.get(head_dim, 0)


def fwd_keys(head_dim: int, max_tiles: int) -> int:
    """Keys per K/V tile of the specialised bf16 sm_90a forward (see FWD_KEYS_192_MIN_TILES)."""
    return BN192 if head_dim in QUERY_ROWS_80_HEAD_DIMS and max_tiles >= FWD_KEYS_192_MIN_TILES else BN


def tail_parts(head_dim: int, max_tiles: int, precision: Precision = Precision.BF16) -> int:
    """The most parts the specialised sm_90a backward (bf16; tf32's two-stage one) may split a unit into (see
    TAIL_PARTS_MAX); 1: none."""
    if head_dim not in (TAIL_HEAD_DIMS if precision == Precision.BF16 else TF32_TAIL_HEAD_DIMS):
        return 1
    return max(1, min(TAIL_PARTS_MAX, 2 * max_tiles // TAIL_MIN_STEPS))


def bwd_head_group(head_dim: int, max_tiles: int, value_bytes: int = 2) -> int:
    """Heads per group of the sm_90a backward's key-tile-fastest blocks (see BWD_GROUP_BYTES); ``value_bytes``:
    2 for the bf16 kernels' tiles, 4 for tf32's."""
    stream = 2 * value_bytes * TILE * max_tiles * head_dim  # Q and dO of the longest sequence, one head
    g = 1
    while 2 * g <= BWD_GROUP_MAX and 2 * g * stream <= BWD_GROUP_BYTES:
        g *= 2
    return g


# bf16 GEMM operands. The block's inputs are fp32; a bf16 product reads either bf16 copies made first by a cast
# kernel (read 4 bytes, write 2, then the product reads 2), or the fp32 arrays as stored with cuBLAS's
# COMPUTE_32F_FAST_16BF, which rounds them to bf16 inside the product (reads 4; the same rounding class). Per weight
# element of one backward: Wp 8 bytes with the cast against 4 without, Wqkv (two products) 10 against 8; and the
# casts are launches of their own before the first product (~149 us of a 259 us backward at 131 tokens on the H200,
# 117-185 us at every size). Without them, the products that meet a bf16 operand written by the attention kernels
# read the kernels' fp32 grad_qkv^T instead, or cast dY (backward) and Wp (forward): schedule.py says why.
# Measured on the H200 (dev/bf16_operands.py, bench/NOTES.md), FAST_16BF does not pay at any size: it runs at the
# tf32 rate, and the weight-gradient products then read the fp32 grad_qkv^T. The whole bf16 backward without casts
# took 442 us against 260 with them at 131 tokens, 1017 against 621 at 1024, 8403 against 4463 at 8192; of the
# single products only qkv and dO at 131 tokens were faster on fp32 (by 24 and 4 us), and qkv's Wqkv cast also
# serves grad_hidden. So the library casts at every size (Plan.cast_operands is bf16); reading fp32 as stored stays
# a per-call choice: dataclasses.replace(plan, cast_operands=False).


# bf16 on sm_90a: no packed per-head copies of the operands. The V and dO products write bf16 (their fp32 sums
# rounded once; V's bias added to the sum first, in cuBLASLt's epilogue), the QK product fp32, from which one pass
# (hopper.prepare_qk) makes bf16 q and k with their bias and RoPE, rounded once; the attention kernels read all
# four through tensor maps with those row strides. The preparation kernel otherwise reads the fp32 products (3H +
# H floats a token) and writes packed bf16 copies (4H): 20 H bytes a token against 12 H (q and k read in fp32,
# written in bf16), plus the V and dO products' output writes halved. Two forms measured first (bench/NOTES.md
# "bf16 operands where the products leave them"): q, k and v all from one bf16 product, a pass adding the bias and
# rotating q and k in place, ran 2.3-3.9% faster at 1024-8192 tokens but rounded each column's bias to the grid
# of that column's values, the same error on every token, which the softmax average does not shrink (O's error
# against float64 2.8x, grad_proj_weight's 2x); with the bias in that product's epilogue, 1.2-5.2% faster, every
# output's error 13-20% larger (one rounding more on q and k, before their rotation).
HOPPER_IN_PLACE = True

# bf16 backward on two streams: the caller's stream casts X and Wqkv (and V's bias) before the side stream starts on
# dY and Wp (Plan.casts_first) up to this many tokens. Measured on the seeds (dev/attn_ab.py, 3 rounds, side stream
# first / casts first, us): 131 tokens 252.5 / 249.1, 196 263.8 / 259.4, 211 261.0 / 259.3, 373 311.0 / 308.2, 392
# 332.5 / 331.4, 613 423.0 / 419.2 (every round faster); 773 502.0 / 502.2, 919 553.3 / 556.7, 1024 567.8 / 571.1,
# 1176 660.0 / 666.1, 2048 1044 / 1076, 2940-8192 within -0.5 / +1.3%. Where the QKV product is short the side's
# casts beside it cost it less than they cost beside the caller's casts; where it is long they slow its start.
BF16_CASTS_FIRST_MAX_TOKENS = 700

# fp32 and tf32 on short sequences: the dense form (attention/dense.py), the six L x L products as batched cuBLAS
# products over stored scores per run of equal-length sequences, in place of the flash kernels (FFMA tiles in
# fp32, mma.sync in tf32), while every sequence has at most DENSE_MAX_TILES tiles (256 tokens: a score row then
# fits a warp's registers, and the scores' memory stays at most twice T x H floats at D = 128). Each run of one
# length is one batch of every product, so the launches grow with the runs. Measured first on the products alone
# (28 heads, D = 128, 32 x 256 tokens, batches of 256 x 256 x 128, H200): the six take 2.27 ms in fp32 (46
# TFLOP/s, where the FFMA kernels run the same work at 29) and 0.74 ms in tf32 (141 TFLOP/s, the mma.sync kernels
# 59). Then the whole backward on the seed workloads (dev/attn_ab.py, graph replay, 2 rounds, flash / dense, us):
# fp32 131 tokens 1204 / 1169, 196 1584 / 1511, 1024 6536 / 6408, 4096 24161 / 23385, 8192 47439 / 46213, faster
# on every workload of one run (2.0-4.9%) and on those of two runs (the first T mod N sequences one token longer)
# from 613 tokens (1.0-1.9%; 211 tokens 1537 / 1558, 373 2350 / 2349); mean 12541 / 12168 (-3.0%). tf32 faster
# from 1024 tokens on one run (1024 1087 / 1041, 1176 1393 / 1254, 4704 4748 / 4423, 8192 8342 / 8134: 2.1-11%),
# slower below (131 321 / 338) and on every workload of two runs (211 343 / 392, 919 1024 / 1114: 6.5-12%), where
# the launches of a second batch and the scores' passes cost more than the mma.sync kernels' 40-90 us.
DENSE_MAX_TILES = 2
DENSE_MAX_RUNS = types.MappingProxyType({Precision.FP32: 4, Precision.TF32: 1})  # read-only
DENSE_MIN_TOKENS = types.MappingProxyType({Precision.FP32: 0, Precision.TF32: 1024})
# The varlen API's forward alone (varlen_attention_forward), where the plan has the dense form: fp32 keeps it only
# on one run of one length of fewer than DENSE_FORWARD_MAX_TOKENS tokens (dense_forward below); elsewhere the flash
# forward runs (attn_fwd: one pass over the keys, no stored scores), and the backward keeps the dense form, which
# recomputes the scores and reads neither o nor lse.
DENSE_FORWARD_MAX_TOKENS = 1024


def dense_forward(precision, tokens: int, runs: int) -> bool:
    """Whether the varlen API's forward alone keeps the dense form where the plan has it (``Plan.dense``).

    The flash forward takes a 128-query tile a block, one block an SM (223 KB of shared memory), so below a wave
    a call lasts one block's walk over its keys (~55-90 us at D = 128 for 131-256 keys), where the dense form's
    batched products spread the same work over the whole GPU; each run of one length costs the dense form a
    batch of three launches more. fp32 forward alone, flash / dense, ms (`dev/varlen_ab.py --only forward
    --rounds 3`, one H100): one run, fewer than 1024 tokens: 131 x 1 (4 heads) 0.060 / 0.033, (28 heads) 0.064 /
    0.048, 196 x 1 0.081 / 0.059, 256 x 1 0.091 / 0.069, 131 x 2 0.069 / 0.066, 256 x 2 0.102 / 0.104, 200 x 3
    0.151 / 0.131, 96 x 3 (16 heads, D 64) 0.034 / 0.036; two runs: 105 + 106 (16 heads, D 80) 0.042 / 0.050,
    187 + 186 0.080 / 0.094, 154 + 3 x 153 0.123 / 0.128 (D 64, 16 heads: 0.048 / 0.070); one run from 1024
    tokens: 4 x 256 (16 heads, D 80) 0.075 / 0.093, 8 x 128 (4 heads) 0.056 / 0.045, 32 x 256 1.220 / 1.278,
    64 x 128 0.784 / 0.872, 20 x 200 (16 heads, D 80) 0.264 / 0.301, 128 x 64 (16 heads, D 64) 0.227 / 0.259
    (28 heads, D 128 where not said). The rule picks the faster form on 15 of these 18 cases; the three it
    misses cost 2% (256 x 2), 6% (96 x 3) and 24% (8 x 128 with 4 heads). tf32 takes the dense form only on one
    run from 1024 tokens off Hopper and is not measured apart from the block: it keeps the block's rule."""
    if Precision.parse(precision) != Precision.FP32:
        return True
    return runs == 1 and tokens < DENSE_FORWARD_MAX_TOKENS


# The block's dense form packs q' and k' (bias and RoPE applied) alone; the three products that read V or dO take
# them where the QKV and dO products leave them, through pointer arrays (attention/dense.py), and V's bias is
# added to O where O is scattered. The packing pass then moves half the bytes (at 8192 tokens, D = 128: 470 MB
# fewer). Measured (tf32, H200): the pass 242 -> 129 us at 8192 x 32, the pointer-array products as fast as the
# strided ones; whole backward, in place / packed (3 rounds, us): 8192 x 32 7463 / 7527, 5880 x 30 5286 / 5360,
# 1024 x 4 1018 / 1025, 2940 x 15 2822 / 2819; fp32 8192 x 32 45574 / 45675. The varlen API's dense form packs
# (its q, k, v are separate arrays without a bias), whatever this field says.
DENSE_IN_PLACE = True


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one call of the vision attention block runs (see the constants above for each field's reason)."""

    precision: Precision
    head_dim: int
    tokens: int
    kmajor: bool  # tf32: K-major operands for the two weight gradients
    nt: bool  # fp32: dO and grad_hidden_states from transposed token operands
    nt_qkv: bool  # fp32: the QKV product from X^T and Wqkv^T
    concurrent: bool  # independent products on a second stream
    dq_partials: int  # fp32: dQ from per-key-tile partials (their count), 0: from the forward kernel
    graph: bool  # a graph handle records and replays this call
    hopper: bool = False  # bf16/tf32 attention on the sm_90a kernels (else the mma.sync kernels of every GPU)
    cast_operands: bool = False  # bf16: fp32 GEMM operands cast to bf16 copies first (else read as stored)
    specialised: bool = True  # sm_90a: the warp-specialised backward kernel (no effect elsewhere)
    fwd_specialised: bool = False  # bf16 / tf32 on sm_90a: the warp-specialised forward kernel (no effect elsewhere)
    stages: int = 1  # tf32 specialised backward: Q/dO stages (2: K and V held in registers to make room)
    tf32_first_stores: bool = False  # tf32 two-stage backward: first key tiles store dQ^T where the layout allows
    fused_dq: bool = False  # bf16 varlen API backward on sm_90a: dQ written by each sequence's last key tile
    head_group: int = 1  # sm_90a backward: key-tile-fastest over groups of this many heads, 0 head-fastest
    tail_parts: int = 1  # specialised sm_90a backward (bf16, tf32 two-stage): at most this many parts a unit, 1 none
    query_rows: int = BQ  # bf16 specialised sm_90a backward: query rows per step (80: the q80 kernels, D 128)
    fwd_keys: int = BN  # bf16 specialised sm_90a forward: keys per K/V tile (192: the k192 kernel, D 128)
    fwd_persistent: bool = False  # bf16 sm_90a forward, specialised, 128 keys: one block per SM over the units
    fwd_o_bulk: bool = False  # the persistent forward: O through the copy engine (no effect otherwise)
    fwd_tail_parts: int = 1  # tf32 specialised sm_90a forward: last-wave units in up to this many parts (else none)
    # bf16 block on sm_90a: delta = rowsum(dO * O) and the dQ counts' reset in the forward's epilogue (dO is at hand:
    # its product is joined before), else a pass after the forward that reads O back and dO again. Measured
    # (dev/attn_ab.py, 3 rounds, epilogue / pass, us): 131 tokens 252.3 / 265.5, 196 261.5 / 270.6, 373 311.9 /
    # 316.7, 392 328.9 / 332.0, 1024 567.5 / 578.7, 4096 1977 / 1974, 8192 4192 / 4066 and (another machine,
    # against the code before) 3740 / 3890; long workloads within 0.5% either way (1 x 16384 32.43 / 32.29 ms, 2 x
    # 8192 20.08 / 20.19, 8 x 1024 4.70 / 4.73, 1 x 4096 3.54 / 3.54, 1 x 9216 D 80 4.53 / 4.50).
    fwd_delta: bool = True
    in_place: bool = False  # bf16 block on sm_90a, operands cast: the bf16 products' outputs read in place
    # bf16, operands cast, two streams: the side stream (dY's cast and column sums, Wp's cast, the dO product) is
    # forked only once the caller's stream has enqueued the X and Wqkv casts, so that the side's casts run beside the
    # QKV product rather than beside those casts (all memory-bound: they share the bandwidth, and the QKV product
    # waited for both streams' casts to be done). BF16_CASTS_FIRST_MAX_TOKENS says where; no effect without casts.
    casts_first: bool = False
    # fp32 / tf32: the dense form of the attention core (batched cuBLAS products over stored scores, DENSE_MAX_TILES)
    dense: bool = False
    # the block's dense form reads V and dO where their products leave them (DENSE_IN_PLACE)
    dense_in_place: bool = False
    # fp32, no dq_partials: dQ from the dK/dV kernel's shares added into one sum in key-tile order (DQ_ORDERED)
    dq_ordered: bool = False

    def __post_init__(self):
        if not isinstance(self.precision, Precision):
            raise TypeError(f"Plan.precision must be a Precision, got {type(self.precision).__name__}")
        if self.dq_partials and (self.precision != Precision.FP32 or self.head_dim % 16):
            raise ValueError("dq_partials needs precision fp32 and a head_dim that is a multiple of 16")
        if self.dq_ordered and (self.precision != Precision.FP32 or self.head_dim % 16 or self.dq_partials
                                or self.dense):
            raise ValueError("dq_ordered needs precision fp32, a head_dim that is a multiple of 16, no dq_partials "
                             "and no dense form")
        if self.kmajor and self.precision != Precision.TF32:
            raise ValueError("kmajor is a tf32 layout")
        if self.tf32_first_stores and self.precision != Precision.TF32:
            raise ValueError("tf32_first_stores is a choice of the tf32 backward")
        if (self.nt or self.nt_qkv) and self.precision != Precision.FP32:
            raise ValueError("nt and nt_qkv are fp32 layouts")
        if self.hopper and (self.precision == Precision.FP32 or self.head_dim not in HOPPER_HEAD_DIMS):
            raise ValueError(f"the sm_90a kernels run bf16 and tf32 with head dims {HOPPER_HEAD_DIMS}")
        if not isinstance(self.head_group, int) or not 0 <= self.head_group <= HEAD_GROUP_LIMIT:
            raise ValueError(f"head_group is a head count from 0 to {HEAD_GROUP_LIMIT}, got {self.head_group!r}")
        if not isinstance(self.tail_parts, int) or not 1 <= self.tail_parts <= TAIL_PARTS_MAX:
            raise ValueError(f"tail_parts is a part count from 1 to {TAIL_PARTS_MAX}, got {self.tail_parts!r}")
        if self.query_rows not in (BQ, BQ80):
            raise ValueError(f"query_rows is {BQ} or {BQ80}, got {self.query_rows!r}")
        if self.query_rows == BQ80 and (self.precision != Precision.BF16 or self.head_dim not in QUERY_ROWS_80_HEAD_DIMS
                                      or not self.specialised or self.fused_dq):
            raise ValueError(f"query_rows {BQ80} is the specialised bf16 backward's at head dims "
                             f"{QUERY_ROWS_80_HEAD_DIMS}, without fused_dq")
        if self.fwd_keys not in (BN, BN192):
            raise ValueError(f"fwd_keys is {BN} or {BN192}, got {self.fwd_keys!r}")
        if self.fwd_keys == BN192 and (self.precision != Precision.BF16 or self.head_dim not in QUERY_ROWS_80_HEAD_DIMS
                                     or not self.fwd_specialised):
            raise ValueError(f"fwd_keys {BN192} is the specialised bf16 forward's at head dims "
                             f"{QUERY_ROWS_80_HEAD_DIMS}")
        if not isinstance(self.fwd_tail_parts, int) or not 1 <= self.fwd_tail_parts <= FWD_TAIL_PARTS_MAX:
            raise ValueError(f"fwd_tail_parts is a part count from 1 to {FWD_TAIL_PARTS_MAX}, "
                             f"got {self.fwd_tail_parts!r}")
        if self.fwd_persistent and self.precision != Precision.BF16:
            raise ValueError("fwd_persistent is a bf16 forward's")
        if self.stages not in (1, 2):
            raise ValueError(f"stages is 1 or 2, got {self.stages!r}")
        if self.in_place and self.precision != Precision.BF16:
            raise ValueError("in_place is a bf16 choice")
        if self.dense and (self.precision == Precision.BF16 or self.hopper):
            raise ValueError("dense is a form of the fp32 and tf32 mma.sync / FFMA path (not bf16, not hopper)")
        if self.dense_in_place and not self.dense:
            raise ValueError("dense_in_place is a choice of the dense form (dense=True)")
        if self.cast_operands and self.precision != Precision.BF16:
            raise ValueError("cast_operands is a bf16 choice (fp32 and tf32 products read fp32 as stored)")


def make_plan(precision, *, head_dim: int, tokens: int, max_tiles: int, sm90: bool = False,
              runs: int | None = None, tiles: int | None = None) -> Plan:
    """The plan the library chooses for a call: ``max_tiles`` is the longest sequence in TILE-token tiles;
    ``sm90``: the GPU runs sm_90a code (Hopper); ``runs``: how many runs of equal-length sequences there are
    (``Varlen.runs``; None: not known, so no dense form); ``tiles``: the call's TILE-token tiles in all
    (``Varlen.ntiles``; None: not known, taken to suit the sm_90a backward, :func:`library_hopper_backward`)."""
    p = Precision.parse(precision)
    fp32 = p == Precision.FP32
    concurrent_max = {Precision.FP32: FP32_CONCURRENT_MAX_TOKENS, Precision.BF16: BF16_CONCURRENT_MAX_TOKENS}.get(
        p, CONCURRENT_MAX_TOKENS)
    dq_partials = max_tiles if fp32 and head_dim % 16 == 0 and 0 < max_tiles <= DQ_PARTIAL_MAX_TILES else 0
    rows = query_rows(head_dim, max_tiles) if p == Precision.BF16 and HOPPER_SPECIALISED else BQ
    fused = p == Precision.BF16 and 0 < max_tiles <= HOPPER_FUSED_DQ_MAX_TILES and rows == BQ
    persistent = p == Precision.BF16 and HOPPER_FWD_SPECIALISED and fwd_persistent(head_dim, max_tiles)
    hop = sm90 and head_dim in HOPPER_HEAD_DIMS and (tiles is None or library_hopper_backward(p, tiles, tokens)) and (
        p == Precision.BF16
        or (p == Precision.TF32 and max_tiles >= HOPPER_TF32_MIN_TILES))
    dense = (p != Precision.BF16 and not hop and runs is not None and 0 < runs <= DENSE_MAX_RUNS[p]
             and tokens >= DENSE_MIN_TOKENS[p] and 0 < max_tiles <= DENSE_MAX_TILES)
    if dense:
        dq_partials = 0
    ordered = (DQ_ORDERED and fp32 and head_dim % 16 == 0 and max_tiles > DQ_PARTIAL_MAX_TILES and not dense)
    return Plan(precision=p, head_dim=head_dim, tokens=tokens,
                kmajor=p == Precision.TF32 and TF32_KMAJOR,
                nt=fp32 and tokens >= FP32_NT_MIN_TOKENS,
                nt_qkv=fp32 and tokens >= FP32_NT_QKV_MIN_TOKENS,
                concurrent=tokens <= concurrent_max,
                dq_partials=dq_partials,
                graph=tokens <= GRAPH_MAX_TOKENS,
                hopper=hop,
                cast_operands=p == Precision.BF16,
                specialised=HOPPER_SPECIALISED,
                fwd_specialised=HOPPER_FWD_SPECIALISED if p == Precision.BF16 else tf32_fwd_specialised(head_dim),
                stages=tf32_stages(head_dim) if p == Precision.TF32 else 1,
                tf32_first_stores=p == Precision.TF32,
                head_group=bwd_head_group(head_dim, max_tiles, 2 if p == Precision.BF16 else 4)
                if max_tiles >= key_major_min_tiles(p, head_dim) else 0,
                fused_dq=fused,
                tail_parts=tail_parts(head_dim, max_tiles, p) if p != Precision.FP32 else 1,
                query_rows=rows,
                fwd_keys=fwd_keys(head_dim, max_tiles) if p == Precision.BF16 and HOPPER_FWD_SPECIALISED else BN,
                fwd_persistent=persistent,
                fwd_o_bulk=persistent and fwd_o_bulk(head_dim, max_tiles),
                fwd_tail_parts=fwd_tail_parts(p, head_dim, max_tiles),
                in_place=p == Precision.BF16 and HOPPER_IN_PLACE,
                casts_first=p == Precision.BF16 and tokens <= BF16_CASTS_FIRST_MAX_TOKENS,
                dense=dense,
                dense_in_place=dense and DENSE_IN_PLACE,
                dq_ordered=ordered)


def resolve(plan, chosen: Plan, max_tiles: int, tiles: int | None = None, backward: bool = True) -> Plan:
    """The plan a call runs: ``chosen`` (the library's), or the caller's ``plan`` (a Plan, or a function of the
    library's plan returning one), checked to describe the same call (``tiles``: as for :func:`make_plan`;
    ``backward``: the call runs a backward)."""
    if plan is None:
        return chosen
    if callable(plan) and not isinstance(plan, Plan):
        plan = plan(chosen)
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a Plan or a function Plan -> Plan, got {type(plan).__name__}")
    for field in ("precision", "head_dim", "tokens"):
        if getattr(plan, field) != getattr(chosen, field):
            raise ValueError(f"plan.{field} = {getattr(plan, field)!r} does not match the call "
                             f"({getattr(chosen, field)!r})")
    if plan.dense and max_tiles > DENSE_MAX_TILES:
        raise ValueError(f"plan.dense needs every sequence within {DENSE_MAX_TILES} tiles ({DENSE_MAX_TILES * TILE} "
                         f"tokens); the longest has {max_tiles}")
    if plan.hopper and backward and tiles is not None and not hopper_backward_fits(plan.precision, tiles):
        raise ValueError(f"plan.hopper: the sm_90a backward's grid cannot hold this call's {tiles} tiles of {TILE} "
                         "tokens; it runs on the mma.sync kernels (hopper=False)")
    if plan.dq_partials and plan.dq_partials < max_tiles:
        raise ValueError(f"plan.dq_partials = {plan.dq_partials} is fewer than the longest sequence's "
                         f"{max_tiles} tiles")
    return plan
