"""nvmath-python's Matmul against our cuBLAS path on the attention block's five GEMMs: where is nvmath as fast (so
it can replace ``cupy_rope._cublas``), and where does our own path still win? Also: is it as accurate, what does a
call cost the host, and can its ``execute`` be recorded into a CUDA graph?

    python dev/nvmath_gemm.py --out $OUT/nvmath_gemm.json
    python dev/nvmath_gemm.py --precisions bf16 --tokens 131 --reps 50 --memory-limit 32MiB

Products (H = hidden 3584, T tokens), row-major arrays in their natural layouts: qkv = X Wqkv^T [T, 3H],
dO = dY Wp [T, H], grad_hidden = G Wqkv [T, H], grad_qkv_weight = G^T X [3H, H], grad_proj_weight = dY^T O [H, H].
tf32: fp32 operands, COMPUTE_32F_FAST_TF32; bf16: bf16 operands, COMPUTE_32F; fp32 output always. Three ways:
ours (``cupy_rope._cublas.gemm``, its candidates timed on the first call as in the library), nv (an nvmath Matmul
planned once, its first algorithm) and nv_tuned (a second Matmul after ``autotune()``); nvmath writes into a given
fp32 C (inplace=True, beta=0), so no call allocates. GPU µs: ``cupy_rope._bench.Timer`` (256 MiB L2 flush, events,
median), the three taken in turn over --rounds rounds; host µs: a tight loop of calls. Error: relative Frobenius
error against a float64 product of the same operands (bf16 widened exactly). Capture: nv_tuned's execute() after
one eager call on a side stream, recorded (relaxed and global modes), replayed, compared bitwise to the eager result.

nvmath is not in the GPU image: install it from the carried wheels first (no network there):
    python3 -m pip install --no-index --find-links .whl/nvmath nvmath-python
"""
from __future__ import annotations

import re

import common

INSTALL = "python3 -m pip install --no-index --find-links .whl/nvmath nvmath-python"
H = 3584
PRODUCTS = {  # name -> (a shape, trans_a, b shape, trans_b) of c = op(a) op(b), as functions of T
    "qkv": lambda t: ((t, H), False, (3 * H, H), True),
    "dO": lambda t: ((t, H), False, (H, H), False),
    "grad_hidden": lambda t: ((t, 3 * H), False, (3 * H, H), False),
    "grad_qkv_weight": lambda t: ((t, 3 * H), True, (t, H), False),
    "grad_proj_weight": lambda t: ((t, H), True, (t, H), False),
}
WAYS = ("ours", "nv", "nv_tuned")


def parse_args(argv=None):
    ap = common.gemm_lab_parser(__doc__, precisions="tf32,bf16", tokens="131,1024,8192")
    ap.add_argument("--products", default=",".join(PRODUCTS), help=f"subset of {','.join(PRODUCTS)}")
    ap.add_argument("--reps", type=int, default=20, help="flushed repetitions per timing and round (default 20)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the three ways (default 3)")
    ap.add_argument("--host-calls", type=int, default=100, help="calls per host-time loop (default 100)")
    ap.add_argument("--autotune-iterations", type=int, default=10, help="Matmul.autotune(iterations=) (default 10)")
    ap.add_argument("--memory-limit", default=None, metavar="SIZE",
                    help="MatmulOptions.memory_limit, which caps nvmath's workspace (e.g. 32MiB, ours; default: "
                         "nvmath's 80%% of the device)")
    ap.add_argument("--no-capture", action="store_true", help="skip the graph-capture check")
    ap.add_argument("--out", default=None, metavar="FILE", help="write the results as JSON here")
    a = ap.parse_args(argv)
    a.products = a.products.split(",")
    if any(p not in PRODUCTS for p in a.products):
        ap.error(f"products are a subset of {','.join(PRODUCTS)}")
    return a


def loaded_cublas() -> list:
    """The cuBLAS libraries mapped into this process: ours and nvmath's must be the same files."""
    with open("/proc/self/maps") as f:
        return sorted(set(re.findall(r"(/\S*libcublas(?:Lt)?\.so[.\d]*)\s*$", f.read(), re.M)))


def import_nvmath():
    try:
        import nvmath
        import nvmath.linalg.advanced as nva
    except ImportError as e:
        raise SystemExit(f"nvmath-python is not importable ({e}). Install it from the wheels carried in .whl/nvmath "
                         f"(from the repository root):\n    {INSTALL}") from None
    versions = {"nvmath": nvmath.__version__}
    for name in ("cuda.bindings", "cuda.core", "cuda.pathfinder"):
        try:
            versions[name] = __import__(name, fromlist=["_"]).__version__
        except (ImportError, AttributeError):
            versions[name] = None
    return nva, versions


def algo_info(mm) -> dict:
    """The algorithm a Matmul's execute() runs now (its first)."""
    alg = mm.algorithms[0]
    info = {"id": alg.algorithm_id}
    for field in ("tile", "split_k", "stages"):
        try:
            info[field] = str(getattr(alg, field))
        except Exception:  # noqa: BLE001 - a field this algorithm does not report
            pass
    return info


def our_choice(cublas, a, b, c, ta, tb, precision) -> str:
    try:
        plan = cublas.plan_for(a, b, c, trans_a=ta, trans_b=tb, precision=precision)
    except RuntimeError:  # no cublasLt here: gemm() runs cublasGemmEx
        return "gemmEx"
    i = plan.chosen
    return "untimed" if i is None else "gemmEx" if i == -1 else "split" if i == cublas.SPLIT else f"lt{i}"


def capture_check(mm, c, mode: int) -> str:
    """'yes' when execute() recorded on a side stream replays to the eager result's bits, else what went wrong."""
    import cupy
    from cupy_backends.cuda.api import runtime

    rec = cupy.cuda.Stream(non_blocking=True)
    mm.execute(stream=rec)  # warm-up on this stream, as one would before recording
    rec.synchronize()
    eager = c.copy()
    c.fill(0)
    runtime.deviceSynchronize()
    runtime.streamBeginCapture(rec.ptr, mode)
    try:
        mm.execute(stream=rec)
    except Exception as e:  # noqa: BLE001 - report it; end the broken capture first
        try:
            runtime.graphDestroy(runtime.streamEndCapture(rec.ptr))
        except Exception:  # noqa: BLE001 - the capture was already invalidated
            pass
        return f"no: execute() while capturing: {type(e).__name__}: {e}"
    try:
        graph = runtime.streamEndCapture(rec.ptr)
    except Exception as e:  # noqa: BLE001
        return f"no: end of capture: {type(e).__name__}: {e}"
    try:
        if bool(c.any()):
            return "no: execute() ran while capturing instead of being recorded"
        exe = runtime.graphInstantiate(graph)
        runtime.graphLaunch(exe, rec.ptr)
        rec.synchronize()
        runtime.graphExecDestroy(exe)
    finally:
        runtime.graphDestroy(graph)
    return "yes" if common.same_bits(c, eager) else f"no: replay differs (rel {common.rel_err(c, eager):.1e})"


def run_case(a, nva, timer, cublas, rng, precision, t, name) -> dict:
    import cupy
    import ml_dtypes
    import numpy as np
    from cupy_backends.cuda.api import runtime

    a_shape, ta, b_shape, tb = PRODUCTS[name](t)
    x = rng.standard_normal(a_shape, dtype=np.float32)
    y = rng.standard_normal(b_shape, dtype=np.float32)
    if precision == "bf16":
        x, y = x.astype(ml_dtypes.bfloat16), y.astype(ml_dtypes.bfloat16)
    m, k = a_shape[::-1] if ta else a_shape
    n = b_shape[0] if tb else b_shape[1]
    x64, y64 = common._float64(x), common._float64(y)
    ref = (x64.T if ta else x64) @ (y64.T if tb else y64)
    del x64, y64
    outs = {w: cupy.empty((m, n), np.float32) for w in WAYS}
    stream = timer.stream
    compute = {"fp32": nva.MatmulComputeType.COMPUTE_32F, "tf32": nva.MatmulComputeType.COMPUTE_32F_FAST_TF32,
               "bf16": nva.MatmulComputeType.COMPUTE_32F}[precision]
    options = {"inplace": True, "compute_type": compute}
    if a.memory_limit is not None:
        options["memory_limit"] = a.memory_limit
    mms = {}
    for w in WAYS[1:]:  # the transposes are views: nvmath reads their strides
        mms[w] = nva.Matmul(x.T if ta else x, y.T if tb else y, outs[w], beta=0.0, options=dict(options),
                            stream=stream)
        mms[w].plan(stream=stream)
    default_algo = algo_info(mms["nv_tuned"])
    mms["nv_tuned"].autotune(iterations=a.autotune_iterations, stream=stream)
    fns = {"ours": lambda: cublas.gemm(x, y, outs["ours"], trans_a=ta, trans_b=tb, precision=precision,
                                       stream=stream.ptr),
           "nv": lambda: mms["nv"].execute(stream=stream),
           "nv_tuned": lambda: mms["nv_tuned"].execute(stream=stream)}
    gpu = common.interleaved(fns, lambda fn: timer.gpu_us(fn, reps=a.reps, warmup=2), a.rounds)
    runtime.deviceSynchronize()
    row = {"precision": precision, "tokens": t, "product": name, "m": m, "n": n, "k": k, "flop": 2.0 * m * n * k,
           "gpu_us": {w: common.median(v) for w, v in gpu.items()},
           "gpu_us_rounds": gpu,
           "rel_err": {w: common.rel_err(outs[w], ref) for w in WAYS},
           "host_us": {w: timer.host_us(fn, n=a.host_calls) for w, fn in fns.items()},
           "ours_choice": our_choice(cublas, x, y, outs["ours"], ta, tb, precision),
           "nv_algo": algo_info(mms["nv"]), "nv_tuned_algo": algo_info(mms["nv_tuned"]),
           "nv_tuned_default_algo": default_algo}
    if not a.no_capture:
        row["capture"] = {mode: capture_check(mms["nv_tuned"], outs["nv_tuned"], code)
                          for mode, code in (("relaxed", runtime.streamCaptureModeRelaxed),
                                             ("global", runtime.streamCaptureModeGlobal))}
        # a recorded execute() leaves the Matmul's last event inside the graph; one eager call gives it a real one
        # again, so free() can wait on it
        mms["nv_tuned"].execute(stream=stream)
    stream.synchronize()
    for mm in mms.values():
        mm.free()
    return row  # its arrays go with this frame; the caller then frees the pool


def print_row(r) -> None:
    g, h, e = r["gpu_us"], r["host_us"], r["rel_err"]
    cap = r.get("capture", {})
    cap_text = " ".join(f"{k}={'yes' if v == 'yes' else 'NO'}" for k, v in cap.items())
    print(f"{r['precision']} T={r['tokens']:5d} {r['product']:16s} "
          + "  ".join(f"{w} {g[w]:8.1f}" for w in WAYS)
          + f"  tuned/ours {g['nv_tuned'] / g['ours']:5.2f}  ({r['ours_choice']}, nv#{r['nv_algo']['id']}, "
          f"tuned#{r['nv_tuned_algo']['id']})  host " + "/".join(f"{h[w]:.1f}" for w in WAYS)
          + "  err " + "/".join(f"{e[w]:.1e}" for w in WAYS) + (f"  capture {cap_text}" if cap else ""), flush=True)
    for mode, v in cap.items():
        if v != "yes":
            print(f"    capture {mode}: {v}", flush=True)


def main(argv=None) -> int:
    a = parse_args(argv)
    import cupy

    from cupy_rope import _bench as B
    from cupy_rope import _cublas

    # Our path finds its cuBLAS before nvmath loads anything, as it does in the library.
    ours_problem = _cublas._lt_problem()
    nva, versions = import_nvmath()
    timer = B.Timer()
    rng = cupy.random.default_rng(0)
    print("# GPU us (median): ours / nv (planned, first algorithm) / nv_tuned (after autotune); host us per call "
          "ours/nv/nv_tuned; rel. Frobenius error vs float64 ours/nv/nv_tuned", flush=True)
    if ours_problem:
        print(f"# our path runs without cublasLt here: {ours_problem}", flush=True)
    rows = []
    for precision in a.precisions:
        for t in a.tokens:
            sums = dict.fromkeys(WAYS, 0.0)
            for name in a.products:
                r = run_case(a, nva, timer, _cublas, rng, precision, t, name)
                common.free_gpu()
                rows.append(r)
                print_row(r)
                for w in WAYS:
                    sums[w] += r["gpu_us"][w]
            print(f"{precision} T={t:5d} {'SUM':16s} " + "  ".join(f"{w} {v:8.1f}" for w, v in sums.items())
                  + f"  tuned/ours {sums['nv_tuned'] / sums['ours']:5.2f}", flush=True)
    libs = loaded_cublas()
    if len([p for p in libs if "libcublasLt" in p]) > 1:
        print(f"# WARNING: more than one libcublasLt loaded: {libs}", flush=True)
    result = {"device": B.device_info(), "versions": versions, "cublas_libraries": libs,
              "ours_lt_problem": ours_problem, "args": {k: v for k, v in vars(a).items() if k != "out"},
              "rows": rows}
    common.write_json(a.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
