"""The GEMM layer (cupy_rope._cublas) on the GPU: every candidate the first call times (cuBLAS's kernels, and the
split into whole 128-row tiles plus the remaining rows) computes the product, overwriting or adding to its output
(relative Frobenius error vs float64 within the mode's bound); the timed choice is kept and gives bit-identical
results afterwards, and set_gemm_autotune(False) keeps cublasGemmEx's choice. A GemmConfig is part of the plan.

Threads and lifetimes: threads on their own streams, and threads sharing one stream pointer (per-thread default
streams, in a child process), get the single-thread bits; a thread's workspaces stay bounded while streams come
and go; tuning a new product never invalidates another thread's stream capture; validation raises before any
GEMM (the per-thread counter ``calls()``)."""
from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from cupy_rope import _checks as C
from cupy_rope import _cublas
from tests.helpers import assert_no_launch, same_bits

gpu = pytest.mark.gpu
# Bounds for a product of standard-normal operands with K up to a few thousand.
TOL = {"fp32": 1e-6, "tf32": 2e-3, "bf16": 1e-5}  # bf16: the reference uses the same rounded operands
# (m, n, k, trans_a, trans_b): the layouts the attention backward uses, at skinny and square sizes.
SHAPES = [(131, 1536, 512, False, True), (96, 512, 768, False, False), (512, 512, 131, True, False),
          (384, 1024, 384, False, True), (300, 640, 256, True, False)]
ROWS = _cublas.DEFAULT_CONFIG.split_rows


def _operands(cupy, rng, m, n, k, trans_a, trans_b, precision):
    a = rng.standard_normal((k, m) if trans_a else (m, k), dtype=np.float32)
    b = rng.standard_normal((n, k) if trans_b else (k, n), dtype=np.float32)
    if precision == "bf16":  # the reference multiplies the same rounded values
        a, b = a.astype(C.BF16), b.astype(C.BF16)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    ref = (a64.T if trans_a else a64) @ (b64.T if trans_b else b64)
    return a, b, ref


def _rel(cupy, c, ref) -> float:
    return float(cupy.linalg.norm(c.astype(np.float64) - ref) / cupy.linalg.norm(ref))


def _lt_or_skip():
    if not _cublas.capturable() or _cublas._lt_library() is None:
        pytest.skip(f"cuBLAS is reached through CuPy's bindings here: {_cublas._lt_problem()}")


@gpu
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{m}x{n}x{k}{'T' * ta}{'T' * tb}" for m, n, k, ta, tb in SHAPES])
def test_every_candidate_and_the_choice(shape, precision, rng):
    import cupy

    m, n, k, trans_a, trans_b = shape
    a, b, ref = _operands(cupy, rng, m, n, k, trans_a, trans_b, precision)
    s = cupy.cuda.get_current_stream().ptr
    was = _cublas.gemm_autotune()
    _cublas.set_gemm_autotune(True)
    try:
        c = cupy.full((m, n), np.nan, dtype=np.float32)
        _cublas.gemm(a, b, c, trans_a=trans_a, trans_b=trans_b, precision=precision, stream=s)
    finally:
        _cublas.set_gemm_autotune(was)
    assert _rel(cupy, c, ref) <= TOL[precision]
    _lt_or_skip()
    plan = _cublas.plan_for(a, b, c, trans_a=trans_a, trans_b=trans_b, precision=precision)
    assert plan.chosen is not None and plan.chosen in plan.times_us, "the first call did not time the candidates"
    assert -1 in plan.times_us and len(plan.times_us) >= 2
    assert (_cublas.SPLIT in plan.times_us) == (m > ROWS and m % ROWS != 0)
    base = rng.standard_normal((m, n), dtype=np.float32)
    for i in plan.candidates():
        c = cupy.full((m, n), np.nan, dtype=np.float32)
        plan.run(i, a, b, c, s, False)
        assert _rel(cupy, c, ref) <= TOL[precision], f"candidate {i}"
        c = base.copy()  # the same candidate adding to its output
        plan.run(i, a, b, c, s, True)
        assert _rel(cupy, c, ref + base.astype(np.float64)) <= TOL[precision], f"candidate {i}, accumulating"
    outs = []
    for _ in range(2):  # later calls use the kept choice: bit-identical
        c = cupy.full((m, n), np.nan, dtype=np.float32)
        _cublas.gemm(a, b, c, trans_a=trans_a, trans_b=trans_b, precision=precision, stream=s)
        outs.append(c)
    assert bool(cupy.array_equal(outs[0], outs[1]))
    c = cupy.full((m, n), np.nan, dtype=np.float32)
    plan.run(plan.chosen, a, b, c, s, False)
    assert bool(cupy.array_equal(outs[0], c))


@gpu
def test_autotune_off_uses_gemmex_and_accumulate(rng):
    import cupy

    m, n, k = 200, 640, 320
    a, b, ref = _operands(cupy, rng, m, n, k, False, True, "fp32")
    s = cupy.cuda.get_current_stream().ptr
    was = _cublas.gemm_autotune()
    try:
        _cublas.set_gemm_autotune(False)
        c = cupy.full((m, n), np.nan, dtype=np.float32)
        _cublas.gemm(a, b, c, trans_a=False, trans_b=True, precision="fp32", stream=s)
        assert _rel(cupy, c, ref) <= TOL["fp32"]
        if _cublas.capturable() and _cublas._lt_library() is not None:
            plan = _cublas.plan_for(a, b, c, trans_a=False, trans_b=True, precision="fp32")
            assert plan.chosen is None  # nothing timed: cublasGemmEx ran
    finally:
        _cublas.set_gemm_autotune(was)
    base = rng.standard_normal((m, n), dtype=np.float32)
    c = base.copy()
    _cublas.gemm(a, b, c, trans_a=False, trans_b=True, precision="fp32", stream=s, accumulate=True)
    assert _rel(cupy, c, ref + base.astype(np.float64)) <= TOL["fp32"]


@gpu
@pytest.mark.parametrize("precision", ["fp32", "tf32"])
@pytest.mark.parametrize("trans_a", [True, False])
def test_row_padded_operands(trans_a, precision, rng):
    """Operands given as the first columns of wider arrays (a transposed copy whose rows are padded, as the
    attention backward passes them): the product of the used columns only, whatever the padding holds."""
    import cupy

    m, n, k = 261, 384, 200
    a, b, ref = _operands(cupy, rng, m, n, k, trans_a, False, precision)
    pad = 27
    wide = cupy.full((a.shape[0], a.shape[1] + pad), np.nan, dtype=np.float32)
    wide[:, :a.shape[1]] = a
    view = wide[:, :a.shape[1]]
    assert not view.flags.c_contiguous
    s = cupy.cuda.get_current_stream().ptr
    c = cupy.full((m, n), np.nan, dtype=np.float32)
    _cublas.gemm(view, b, c, trans_a=trans_a, trans_b=False, precision=precision, stream=s)
    assert _rel(cupy, c, ref) <= TOL[precision]
    with pytest.raises(ValueError, match="contiguous rows"):
        _cublas.gemm(cupy.asfortranarray(a), b, c, trans_a=trans_a, trans_b=False, precision=precision, stream=s)


@gpu
def test_config_is_part_of_the_plan(rng):
    """Plans are kept per config: no split candidate with split_rows=0, a split at 64-row tiles with 64; each
    config's own choice computes the product; the default plan is untouched."""
    import cupy

    _lt_or_skip()
    m, n, k = 227, 384, 256  # 227 = 128 + 99 = 3 * 64 + 35
    a, b, ref = _operands(cupy, rng, m, n, k, False, True, "tf32")
    s = cupy.cuda.get_current_stream().ptr
    plans = {}
    for rows in (0, 64, ROWS):
        cfg = _cublas.GemmConfig(split_rows=rows)
        c = cupy.full((m, n), np.nan, dtype=np.float32)
        _cublas.gemm(a, b, c, trans_a=False, trans_b=True, precision="tf32", stream=s, config=cfg)
        assert _rel(cupy, c, ref) <= TOL["tf32"], f"split_rows={rows}"
        plan = plans[rows] = _cublas.plan_for(a, b, c, trans_a=False, trans_b=True, precision="tf32", config=cfg)
        assert plan.config == cfg
        if _cublas.gemm_autotune():
            assert plan.chosen is not None
    assert plans[0].split == 0 and _cublas.SPLIT not in plans[0].candidates()
    assert plans[64].split == 192 and plans[ROWS].split == 128
    assert len({id(p) for p in plans.values()}) == 3
    assert plans[ROWS] is _cublas.plan_for(a, b, c, trans_a=False, trans_b=True, precision="tf32")


@gpu
def test_validation_raises_before_any_gemm(rng):
    import cupy

    m, n, k = 64, 48, 32
    a, b, ref = _operands(cupy, rng, m, n, k, False, False, "fp32")
    s = cupy.cuda.get_current_stream().ptr
    good = dict(a=a, b=b, c=cupy.empty((m, n), np.float32), trans_a=False, trans_b=False, precision="fp32",
                stream=s)
    bad = [
        (ValueError, "do not agree", dict(c=cupy.empty((m, n - 1), np.float32))),
        (ValueError, "do not agree", dict(trans_b=True)),
        (TypeError, "both be bfloat16 or both float32", dict(precision="bf16", b=b.astype(C.BF16))),
        (TypeError, "c must be float32", dict(c=cupy.empty((m, n), np.float64))),
        (ValueError, "precision must be one of", dict(precision="fp16")),
        (TypeError, "GemmConfig", dict(config={"split_rows": 64})),
        (TypeError, "raw stream pointer", dict(stream=cupy.cuda.get_current_stream())),
        (ValueError, "C-contiguous", dict(c=cupy.empty((n, m), np.float32).T)),
        (ValueError, "contiguous rows", dict(a=cupy.asfortranarray(a))),
        (ValueError, "without overlapping", dict(a=a[::-1])),
        (TypeError, r"cupy\.ndarray", dict(a=cupy.asnumpy(a))),
    ]
    for exc, match, change in bad:
        with assert_no_launch(), pytest.raises(exc, match=match):
            _cublas.gemm(**{**good, **change})
    empty_k = cupy.full((m, n), np.nan, dtype=np.float32)  # an empty sum: zeros, and no GEMM
    with assert_no_launch():
        _cublas.gemm(a[:, :0], b[:0], empty_k, trans_a=False, trans_b=False, precision="fp32", stream=s)
        _cublas.gemm(a[:0], b, cupy.empty((0, n), np.float32), trans_a=False, trans_b=False, precision="fp32",
                     stream=s)
    assert not bool(cupy.any(empty_k))
    before = _cublas.calls()
    _cublas.gemm(**good)
    assert _cublas.calls() > before
    assert _rel(cupy, good["c"], ref) <= TOL["fp32"]


# ---- threads, streams, captures -----------------------------------------------------------------------------------
THREADS, PER_THREAD = 4, 50
# Smaller products than SHAPES (the split candidate included: 131 and 300 rows), cycled with the precisions.
THREAD_SHAPES = [(131, 512, 256, False, True), (96, 384, 200, False, False), (300, 256, 131, True, False),
                 (64, 320, 96, False, True)]


def _cases(cupy, rng, count):
    cases = []
    for i in range(count):
        m, n, k, ta, tb = THREAD_SHAPES[i % len(THREAD_SHAPES)]
        precision = ("fp32", "tf32", "bf16")[i % 3]
        a, b, _ = _operands(cupy, rng, m, n, k, ta, tb, precision)
        cases.append((a, b, m, n, ta, tb, precision))
    return cases


@gpu
def test_threads_on_their_own_streams(rng):
    """4 threads, each on its own stream, 50 products each (all distinct inputs, products tuned concurrently where
    new): the bits of the same products computed afterwards by one thread. Each thread's counter is its own, and
    each ended thread's cuBLAS handle goes back to the pool."""
    import cupy

    cases = _cases(cupy, rng, THREADS * PER_THREAD)
    cupy.cuda.Device().synchronize()  # the inputs are complete before streams that do not wait for this one read them
    outs = [None] * len(cases)
    counted, handles, errors = [0] * THREADS, [0] * THREADS, []
    start = threading.Barrier(THREADS)
    main_calls = _cublas.calls()

    def work(t):
        try:
            s = cupy.cuda.Stream(non_blocking=True)
            with s:
                start.wait()
                for j in range(t, len(cases), THREADS):
                    a, b, m, n, ta, tb, precision = cases[j]
                    c = cupy.empty((m, n), np.float32)
                    _cublas.gemm(a, b, c, trans_a=ta, trans_b=tb, precision=precision, stream=s.ptr)
                    outs[j] = c
                s.synchronize()
            counted[t] = _cublas.calls()
            handles[t] = len(_cublas._state().handles)  # made on the thread's first cublasGemmEx call, if any
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)
            start.abort()

    threads = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    if errors:
        raise errors[0]
    assert _cublas.calls() == main_calls, "another thread's GEMMs were counted in this thread"
    assert all(n >= PER_THREAD for n in counted), counted
    if _cublas.capturable():  # an ended thread's state is collected with its thread (allow a moment for it)
        key = ("direct", cupy.cuda.runtime.getDevice())
        deadline = time.monotonic() + 10
        while len(_cublas._idle_handles.get(key, ())) < sum(handles) and time.monotonic() < deadline:
            gc.collect()
            time.sleep(0.01)
        assert len(_cublas._idle_handles.get(key, ())) >= sum(handles), "ended threads kept their cuBLAS handles"
    s = cupy.cuda.get_current_stream().ptr
    differ = []
    for j, (a, b, m, n, ta, tb, precision) in enumerate(cases):
        c = cupy.empty((m, n), np.float32)
        _cublas.gemm(a, b, c, trans_a=ta, trans_b=tb, precision=precision, stream=s)
        if not same_bits(c, outs[j]):
            differ.append(j)
    assert not differ, f"{len(differ)} of {len(cases)} products differ from the single-thread bits: {differ[:10]}"


PTDS_CODE = """
import os, threading
import ml_dtypes
import numpy as np
import cupy
from cupy_rope import _cublas

THREADS, PER_THREAD = {threads}, {per_thread}
SHAPES = {shapes!r}
BF16 = np.dtype(ml_dtypes.bfloat16)
PTDS = cupy.cuda.runtime.streamPerThread
assert os.environ["CUPY_CUDA_PER_THREAD_DEFAULT_STREAM"] == "1"
assert cupy.cuda.get_current_stream().ptr == PTDS, cupy.cuda.get_current_stream().ptr
rng = cupy.random.default_rng(11)
cases = []
for i in range(THREADS * PER_THREAD):
    m, n, k, ta, tb = SHAPES[i % len(SHAPES)]
    precision = ("fp32", "tf32", "bf16")[i % 3]
    a = rng.standard_normal((k, m) if ta else (m, k), dtype=np.float32)
    b = rng.standard_normal((n, k) if tb else (k, n), dtype=np.float32)
    if precision == "bf16":
        a, b = a.astype(BF16), b.astype(BF16)
    cases.append((a, b, m, n, ta, tb, precision))
cupy.cuda.Device().synchronize()  # every thread's default stream is its own: none waits for this one
outs, errors, ptrs = [None] * len(cases), [], set()
start = threading.Barrier(THREADS)


def work(t):
    try:
        s = cupy.cuda.get_current_stream()
        ptrs.add(s.ptr)
        start.wait()
        for j in range(t, len(cases), THREADS):  # no array is freed here: the pool is shared by pointer
            a, b, m, n, ta, tb, precision = cases[j]
            c = cupy.empty((m, n), np.float32)
            _cublas.gemm(a, b, c, trans_a=ta, trans_b=tb, precision=precision, stream=s.ptr)
            outs[j] = c
        s.synchronize()
    except BaseException as e:
        errors.append(repr(e))
        start.abort()


threads = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
[t.start() for t in threads]
[t.join() for t in threads]
assert not errors, errors[:3]
assert ptrs == {{PTDS}}, ptrs
differ = 0
for j, (a, b, m, n, ta, tb, precision) in enumerate(cases):
    c = cupy.empty((m, n), np.float32)
    _cublas.gemm(a, b, c, trans_a=ta, trans_b=tb, precision=precision, stream=PTDS)
    differ += not bool(cupy.array_equal(c.view(np.uint32), outs[j].view(np.uint32)))
print("RESULT", differ, len(cases), _cublas.capturable())
"""


@gpu
def test_threads_on_per_thread_default_streams():
    """The same with CuPy's per-thread default streams: every thread's stream has the same pointer, and still no
    two threads share a cuBLAS handle or a workspace. CuPy reads the switch when it is imported: a child process."""
    code = textwrap.dedent(PTDS_CODE.format(threads=THREADS, per_thread=PER_THREAD, shapes=THREAD_SHAPES))
    env = dict(os.environ, CUPY_CUDA_PER_THREAD_DEFAULT_STREAM="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT")][-1]
    assert line.split()[1:3] == ["0", str(THREADS * PER_THREAD)], f"products differing, of all: {line}"


@gpu
def test_streams_come_and_go(rng):
    """A GEMM on a stream that is then destroyed (with its work possibly still queued), 20 times over: the
    results are right, the thread keeps a bounded number of workspaces, and a GEMM on a new stream works."""
    import cupy

    m, n, k = 200, 384, 256
    a, b, _ = _operands(cupy, rng, m, n, k, False, True, "tf32")
    s0 = cupy.cuda.get_current_stream().ptr
    ref = cupy.empty((m, n), np.float32)
    _cublas.gemm(a, b, ref, trans_a=False, trans_b=True, precision="tf32", stream=s0)  # tunes the product
    cupy.cuda.Device().synchronize()
    outs = []
    for _ in range(20):
        s = cupy.cuda.Stream(non_blocking=True)
        with s:
            c = cupy.empty((m, n), np.float32)
            _cublas.gemm(a, b, c, trans_a=False, trans_b=True, precision="tf32", stream=s.ptr)
        outs.append(c)
        del s
        gc.collect()
        assert len(_cublas._workspace_keys()) <= _cublas._WORKSPACES_PER_THREAD
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        c = cupy.empty((m, n), np.float32)
        _cublas.gemm(a, b, c, trans_a=False, trans_b=True, precision="tf32", stream=s.ptr)
        s.synchronize()
    outs.append(c)
    assert len(_cublas._workspace_keys()) <= _cublas._WORKSPACES_PER_THREAD
    cupy.cuda.Device().synchronize()
    assert all(same_bits(o, ref) for o in outs)


@gpu
@pytest.mark.parametrize("mode", ["relaxed", "thread_local"])
def test_tuning_beside_another_threads_capture(mode, rng):
    """While one thread records a stream capture (with a GEMM in it, in relaxed mode), another tunes a product
    it has never met: the timing runs on that thread's private stream and synchronizes only its events, so the
    capture ends with a valid graph, which replays the recorded work exactly."""
    import cupy

    _lt_or_skip()
    runtime = cupy.cuda.runtime
    capture_mode = {"relaxed": runtime.streamCaptureModeRelaxed,
                    "thread_local": runtime.streamCaptureModeThreadLocal}[mode]
    x = rng.standard_normal(1 << 16, dtype=np.float32)
    y = cupy.empty_like(x)
    a1, b1, _ = _operands(cupy, rng, 192, 256, 128, False, True, "tf32")  # recorded (tuned before the capture)
    c_eager = cupy.empty((192, 256), np.float32)
    c_graph = cupy.full((192, 256), np.nan, dtype=np.float32)
    m2 = {"relaxed": 157, "thread_local": 158}[mode]  # never met before: its first call times the candidates
    a2, b2, ref2 = _operands(cupy, rng, m2, 333, 129, False, False, "fp32")
    cupy.cuda.Device().synchronize()
    capturing, tuned = threading.Event(), threading.Event()
    result = {}

    def capture():
        try:
            s = cupy.cuda.Stream(non_blocking=True)
            with s:
                cupy.multiply(x, 2, out=y)  # kernels compiled and loaded before the capture
                cupy.add(y, 1, out=y)
                _cublas.gemm(a1, b1, c_eager, trans_a=False, trans_b=True, precision="tf32", stream=s.ptr)
                s.synchronize()
                s.begin_capture(mode=capture_mode)
                try:
                    cupy.multiply(x, 2, out=y)
                    if mode == "relaxed":  # a first captured GEMM allocates its workspace: not in thread-local mode
                        _cublas.gemm(a1, b1, c_graph, trans_a=False, trans_b=True, precision="tf32", stream=s.ptr)
                    capturing.set()
                    if not tuned.wait(300):
                        raise TimeoutError("the other thread did not finish tuning")
                    cupy.add(y, 1, out=y)
                finally:
                    graph = s.end_capture()  # raises when the capture was invalidated
                if mode == "relaxed":
                    result["captured"] = len(_cublas.captured_workspaces())
                y.fill(0)
                graph.launch(stream=s)
                s.synchronize()
                result["replayed"] = True
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            result["error"] = e
            capturing.set()

    t = threading.Thread(target=capture)
    t.start()
    try:
        assert capturing.wait(300)
        if "error" not in result:
            main = cupy.cuda.Stream(non_blocking=True)
            with main:
                c2 = cupy.full((m2, 333), np.nan, dtype=np.float32)
                was = _cublas.gemm_autotune()
                _cublas.set_gemm_autotune(True)
                try:
                    _cublas.gemm(a2, b2, c2, trans_a=False, trans_b=False, precision="fp32", stream=main.ptr)
                finally:
                    _cublas.set_gemm_autotune(was)
                main.synchronize()
            plan = _cublas.plan_for(a2, b2, c2, trans_a=False, trans_b=False, precision="fp32")
            assert plan.chosen is not None, "the new product was not timed"
            assert _rel(cupy, c2, ref2) <= TOL["fp32"]
    finally:
        tuned.set()
        t.join()
    if "error" in result:
        raise result["error"]
    assert result.get("replayed"), result
    assert bool(cupy.array_equal(y, x * 2 + 1)), "the replayed graph did not redo the recorded work"
    if mode == "relaxed":
        assert result["captured"] >= 1
        assert same_bits(c_graph, c_eager), "the recorded GEMM differs from the same GEMM run directly"
