"""Which orderings does compute-sanitizer's racecheck follow? One small kernel in seven modes, each ordered correctly
by the mechanism it names, run under the tool; a hazard it reports for one of them is the tool's, not the ordering's.

    compute-sanitizer --tool racecheck --show-backtrace no python3 dev/racecheck_probe.py

* ``aligned``: 384 threads; threads 0-127 store a tile, all meet on ``bar.sync 0``, all read it, all meet again,
  threads 128-255 store over it (the control: every thread meets every barrier from the same instruction).
* ``loop``: the same, but threads 256-383 (a "producer" warpgroup) meet the two barriers from a loop of their own,
  in the unaligned form (``barrier.sync 0``), as the specialised backwards' epilogues do.
* ``maxnreg``: ``loop`` with the register split of the specialised kernels first (``setmaxnreg``: the producer
  warpgroup down to 40 registers, the others up to 232).
* ``diverged``: ``maxnreg`` with one lane of the producer warpgroup busy alone before the loop (the copy-issuing
  lane of the specialised kernels), the producer returning after its barriers.
* ``epilogue``: the tf32 backwards' epilogue (``hop32_ws_epilogue``) at D = 64: after ``setmaxnreg``, the producer
  warpgroup (one lane busy first) meets seven unaligned block-wide barriers in a loop and returns; the consumers
  pass one barrier, then per pass one warpgroup stores rows 0-63 of a [128][D + 4] staging tile in an m64nD
  accumulator's layout, all meet, read the 64 valid rows and write the tile back (zeros past them), meet, sum its
  columns, meet.
* ``named``: threads 0-127 store, meet threads 128-255 on named barrier 1 (``bar.arrive`` / ``bar.sync``), which
  read; then threads 128-255 arrive on named barrier 2, which threads 0-127 wait on before storing again.
* ``mbarrier``: threads 0-127 store, one of them arrives on an mbarrier (count 1) after a named barrier of the 128;
  threads 128-255 wait on its phase and read; then the same back (a second mbarrier) before threads 0-127 store
  again: the hand-over of the tf32 backward's P^T and the bf16 backward's dQ staging.
Each mode also checks its reads (a wrong value counts into ``bad``), so an ordering that failed would show.
"""
from __future__ import annotations

import sys

# The library's own barrier, mbarrier and register-split helpers (common.cuh, attention/sm90/async.cuh), so that
# the probe asks about the very instructions the kernels use.
SOURCE = r"""
#include "attention/sm90/async.cuh"

extern "C" __global__ void __launch_bounds__(384, 1) probe(int mode, int rounds, int* bad) {
    __shared__ float tile[128];
    __shared__ u64 mb[2];
    __shared__ float stg[128 * (64 + 4)];  // the epilogue mode's staging tile, [128][D + 4] at D = 64
    const int t = threadIdx.x, wg = t >> 7, l = t & 127;
    mbar_setup<2>(mb);
    if (mode >= 4) {  // maxnreg, diverged, epilogue: the register split first
        if (wg == 2) setmaxnreg_dec<40>();
        else setmaxnreg_inc<232>();
        if (wg == 2 && mode >= 5) {
            if (t == 256) {  // one lane busy while the others go on to the barriers
                float x = (float)rounds;
                for (int i = 0; i < 20000; ++i) x = __sinf(x) + 1.f;
                if (x == 12345.f) atomicAdd(bad, 1);
            }
#pragma unroll 1
            for (int i = 0; i < (mode == 5 ? 3 * rounds : 7); ++i) block_sync<true>();
            return;
        }
        if (mode == 6) {  // the tf32 backwards' epilogue (hop32_ws_epilogue): two passes through one staging tile
            constexpr int D = 64, LDST = D + 4, H2 = D / 2, G = H2 / 4, NV = 64;
            const int lane = t & 31, wq = (t >> 5) & 3, g = lane >> 2, q = lane & 3;
            int wrong = 0;
            block_sync<true>();  // every consumer is out of its loop
#pragma unroll
            for (int pass = 0; pass < 2; ++pass) {
                if (wg == 1 - pass)  // hop32_stage_rows: rows 0-63 from an m64nD accumulator's layout
                    for (int j = 0; j < D / 8; ++j)
                        for (int h = 0; h < 2; ++h) {
                            const int r = wq * 16 + g + 8 * h, c = 8 * j + 2 * q;
                            stg[r * LDST + c] = (float)(pass * 100000 + r * 100 + c);
                            stg[r * LDST + c + 1] = (float)(pass * 100000 + r * 100 + c + 1);
                        }
                block_sync<true>();  // write_grad_tile: read the valid rows, write them back
                for (int u = t; u < 128 * G; u += 256) {
                    const int r = u / G, d = (u - r * G) * 4;
                    float* p = stg + r * LDST + d;
                    if (r < NV) {
                        for (int e = 0; e < 4; ++e) {
                            if (p[e] != (float)(pass * 100000 + r * 100 + d + e)) ++wrong;
                            if (p[H2 + e] != (float)(pass * 100000 + r * 100 + d + H2 + e)) ++wrong;
                        }
                    }
                    for (int e = 0; e < 4; ++e) { p[e] = r < NV ? p[e] : 0.f; p[H2 + e] = r < NV ? p[H2 + e] : 0.f; }
                }
                block_sync<true>();  // then its column sums
                float sum = 0.f;
                for (int c = t; c < D; c += 256)
                    for (int r = 0; r < 128; ++r) sum += stg[r * LDST + c];
                if (sum == -1.f) ++wrong;
                block_sync<true>();
            }
            if (wrong) atomicAdd(bad, wrong);
            return;
        }
        mode = 1;
    }
    int wrong = 0;
    for (int r = 0; r < rounds; ++r) {
        const float want = (float)(r * 1000 + l);
        if (mode == 0 || mode == 1) {  // aligned / loop
            if (mode == 1 && wg == 2) { for (int i = 0; i < 3; ++i) block_sync<true>(); continue; }
            if (wg == 0) tile[l] = want;
            if (mode == 0) __syncthreads(); else block_sync<true>();
            if (tile[l] != want) ++wrong;
            if (mode == 0) __syncthreads(); else block_sync<true>();
            if (wg == 1) tile[l] = -want;
            if (mode == 0) __syncthreads(); else block_sync<true>();
        } else if (mode == 2) {  // named barriers between warpgroups 0 and 1
            if (wg == 2) continue;
            if (wg == 0) {
                if (r > 0) named_barrier(2, 256);  // the readers are done with the round before
                tile[l] = want;
                named_arrive(1, 256);
            } else {
                named_barrier(1, 256);
                if (tile[l] != want) ++wrong;
                if (r + 1 < rounds) named_arrive(2, 256);
            }
        } else {  // mbarriers between warpgroups 0 and 1
            if (wg == 2) continue;
            if (wg == 0) {
                if (r > 0) mbar_wait(&mb[1], (r - 1) & 1);
                tile[l] = want;
                named_barrier(3, 128);
                if (l == 0) mbar_arrive(&mb[0]);
            } else {
                mbar_wait(&mb[0], r & 1);
                if (tile[l] != want) ++wrong;
                named_barrier(4, 128);
                if (l == 0) mbar_arrive(&mb[1]);
            }
        }
    }
    if (wrong) atomicAdd(bad, wrong);
}
"""

MODES = ("aligned", "loop", "named", "mbarrier", "maxnreg", "diverged", "epilogue")


def cubin() -> bytes:
    """The probe kernel for sm_90a (setmaxnreg exists only there), by NVRTC alone: no GPU needed."""
    from cupy_backends.cuda.libs import nvrtc

    from cupy_rope import _kernels as K

    prog = nvrtc.createProgram(SOURCE, "probe.cu", [], [])
    try:
        nvrtc.compileProgram(prog, ["--gpu-architecture=sm_90a", "-std=c++17", f"--include-path={K.kernels_dir()}"])
        return nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)


def main(argv: list[str]) -> None:
    import cupy

    unknown = set(argv) - set(MODES)
    if unknown:
        raise SystemExit(f"racecheck_probe: unknown mode(s) {sorted(unknown)}; modes: {', '.join(MODES)}")
    module = cupy.cuda.function.Module()
    module.load(cubin())
    kern = module.get_function("probe")
    modes = argv or list(MODES)
    for name in modes:
        bad = cupy.zeros(1, dtype=cupy.int32)
        kern((4,), (384,), (cupy.int32(MODES.index(name)), cupy.int32(8), bad))
        cupy.cuda.runtime.deviceSynchronize()
        print(f"racecheck_probe: {name} done, wrong reads {int(bad.get()[0])}", flush=True)


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(__doc__.rstrip() + f"\n\nusage: python3 dev/racecheck_probe.py [MODE ...]; modes: {', '.join(MODES)}")
        raise SystemExit(0)
    main(sys.argv[1:])
