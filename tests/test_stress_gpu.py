"""Safety under threads, faults and many layers (GPU): each test reproduces a way a training program can misuse or
stress the library, and checks the result is still exact or the error clear.

1. an exception after the second stream has been forked leaves no work writing into memory handed back to the pool;
2. per-thread default streams: threads sharing one stream pointer get the single-thread bits;
3. recording a graph while another thread synchronises the device and tunes new GEMM shapes;
4. a 32-layer loop with one graph handle per layer replays every layer;
5. handles and per-stream state outlive the caller's streams without crashing;
6. a call captured into the caller's own graph (NumPy cu_seqlens) replays exactly and leaks nothing after;
7. a misaligned float32 view is refused before a launch, and the CUDA context stays usable;
8. self-overlapping outputs, non-integer num_heads and oversized problems are refused before a launch;
9. a tile table kept on the device is read on a second stream only once its upload on the first has run;
10. a graph handle first called inside the caller's capture, then on two streams: each call's outputs are its own,
    and its own outputs given back as inputs are refused.
Plus the threads stress: 4 threads x 2 streams x 3 precisions x 200 calls, with and without handles.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import cupy_rope as cr
from cupy_rope import workloads as W
from cupy_rope._cublas import gemm
from tests.helpers import BLOCK_ARGS, OUTPUTS, PRECISIONS, TOL, make_block_inputs, poisoned_allocations

pytestmark = [pytest.mark.gpu, pytest.mark.stress]

ARGS = BLOCK_ARGS[:-1]


def make_inputs(rng, cu, hidden, head_dim):
    """The block's eight arrays (the benchmark's input generation) and cu_seqlens as a NumPy array."""
    import cupy

    x = make_block_inputs(rng, cu, hidden, head_dim)
    cupy.cuda.runtime.deviceSynchronize()
    return [x[k] for k in ARGS], np.asarray(cu, np.int32)


def bits(outs):
    return [o.get().view(np.uint32) for o in outs]


def same(a, b) -> bool:
    return all(np.array_equal(u, v) for u, v in zip(a, b))


def run_python(code: str, env=None, timeout=300) -> subprocess.CompletedProcess:
    e = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=e,
                          timeout=timeout, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---- 1. exceptions after the fork --------------------------------------------------------------------------------

class Injected(RuntimeError):
    pass


@pytest.mark.parametrize("label", ["gemm_qkv", "attn_prep", "attn_fwd_dq", "gemm_grad_hidden"])
def test_exception_after_fork_leaves_no_writer(label, rng):
    """A failure raised inside the backward after work was forked to the second stream: the side stream is
    joined on the way out, so memory the call frees can be reused at once by the caller without being
    overwritten by the side stream's products."""
    import cupy

    from cupy_rope.attention import api

    t, n = 4096, 16
    block, cu = make_inputs(rng, W.even_cu_seqlens(t, n), W.ATTN_HIDDEN, W.ATTN_HEAD_DIM)
    g, x, wq, bq, wp, _, cos, sin = block
    h, d = W.ATTN_HIDDEN, W.ATTN_HEAD_DIM
    s = cupy.cuda.get_current_stream()

    def hook(at):
        if at == label:
            raise Injected(at)

    plan = lambda p: dataclasses.replace(p, concurrent=True)  # noqa: E731
    for _ in range(3):
        with pytest.raises(Injected):
            api.run_backward(g, x, wq, bq, wp, cos, sin, cu, t, h, h // d, d, d ** -0.5, cr.Precision.TF32, s.ptr,
                             plan=plan, hook=hook)
        # the caller allocates at once: it gets the memory the call just freed, and fills it behind the call
        mine = [cupy.full((t, 3 * h), 7.0, np.float32) for _ in range(6)]
        s.synchronize()
        for a in mine:
            assert bool((a == 7.0).all()), "memory the caller owns was overwritten after the exception"
        del mine
    outs = cr.vision_attention_backward(*block, cu)  # and the library still works on this stream
    s.synchronize()
    assert all(bool(cupy.isfinite(o).all()) for o in outs)


# ---- 2. per-thread default streams -------------------------------------------------------------------------------

PTDS_CODE = """
import threading, numpy as np, cupy, cupy_rope as cr
cu = np.asarray([0, 100, 233, 300], np.int32)
rng = np.random.default_rng(5)
f = np.float32
h, d = 448, 64
def inputs():
    return [cupy.asarray(a) for a in (rng.standard_normal((300, h), dtype=f), rng.standard_normal((300, h), dtype=f),
            rng.standard_normal((3 * h, h), dtype=f) * f(0.02), rng.standard_normal((3 * h,), dtype=f) * f(0.01),
            rng.standard_normal((h, h), dtype=f) * f(0.02), rng.standard_normal((h,), dtype=f) * f(0.01),
            rng.standard_normal((300, d), dtype=f), rng.standard_normal((300, d), dtype=f))]
sets = [inputs() for _ in range(4)]
cupy.cuda.runtime.deviceSynchronize()
expect = {}
for p in ("fp32", "tf32", "bf16"):
    for i, x in enumerate(sets):
        expect[p, i] = [o.get().view(np.uint32) for o in cr.vision_attention_backward(*x, cu, precision=p)]
bad, errors = [], []
def work(i):
    try:
        assert cupy.cuda.get_current_stream().ptr == 2, "not the per-thread default stream"
        handles = {p: cr.VisionAttentionBackward(cu, hidden_size=h, head_dim=d, precision=p) for p in expect_p}
        for k in range(30):
            for p in expect_p:
                outs = handles[p](*sets[i]) if k % 2 else cr.vision_attention_backward(*sets[i], cu, precision=p)
                got = [o.get().view(np.uint32) for o in outs]
                if not all(np.array_equal(a, b) for a, b in zip(got, expect[p, i])):
                    bad.append((i, p, k))
    except Exception as e:
        errors.append(repr(e))
expect_p = ("fp32", "tf32", "bf16")
ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
[t.start() for t in ts]
[t.join() for t in ts]
print("RESULT", len(bad), len(errors), errors[:3])
"""


def test_per_thread_default_streams():
    r = run_python(PTDS_CODE, env={"CUPY_CUDA_PER_THREAD_DEFAULT_STREAM": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT")][-1]
    assert line.startswith("RESULT 0 0"), f"threads on per-thread default streams: {line}"


# ---- 3. recording while another thread synchronises the device ----------------------------------------------------

CAPTURE_UNSUPPORTED = 900  # cudaErrorStreamCaptureUnsupported

def test_recording_beside_device_synchronize(rng):
    import cupy

    block, cu = make_inputs(rng, [0, 300, 613], 448, 64)
    expect = bits(cr.vision_attention_backward(*block, cu))
    stop = threading.Event()
    errors = []

    refused = [0]

    def disturb():
        try:
            k = 0
            while not stop.is_set():
                try:
                    cupy.cuda.runtime.deviceSynchronize()
                except cupy.cuda.runtime.CUDARuntimeError as e:
                    # CUDA refuses a device-wide synchronisation while any stream records (the handle's
                    # capture); that refusal is the driver's rule for this thread, not a broken recording
                    if e.status != CAPTURE_UNSUPPORTED:
                        raise
                    refused[0] += 1
                a = cupy.ones((64 + k % 7, 96), np.float32)  # a new GEMM shape now and then: autotuned
                c = cupy.empty((64 + k % 7, 64), np.float32)
                gemm(a, cupy.ones((64, 96), np.float32), c, trans_a=False, trans_b=True, precision="tf32",
                     stream=cupy.cuda.get_current_stream().ptr)
                k += 1
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    th = threading.Thread(target=disturb)
    th.start()
    try:
        s = cupy.cuda.Stream(non_blocking=True)
        for _ in range(5):
            handle = cr.VisionAttentionBackward(cu, hidden_size=448, head_dim=64)
            with s:
                for _ in range(6):
                    got = bits(handle(*block))
                    assert same(got, expect), "a call beside device synchronisation differs"
            handle.close()
    finally:
        stop.set()
        th.join()
    assert not errors, errors[:3]


# ---- 4. many layers ---------------------------------------------------------------------------------------------

def test_32_layer_loop_replays_every_layer(rng):
    import cupy

    t, n = 1024, 4
    cu = np.asarray(W.even_cu_seqlens(t, n), np.int32)
    h, d = 448, 64
    layers = [make_inputs(rng, cu, h, d)[0] for _ in range(32)]
    handles = [cr.VisionAttentionBackward(cu, hidden_size=h, head_dim=d) for _ in layers]
    expect = [bits(cr.vision_attention_backward(*x, cu)) for x in layers]
    for _ in range(3):
        outs = [hd(*x) for hd, x in zip(handles, layers)]
        cupy.cuda.get_current_stream().synchronize()
    for hd, o, e in zip(handles, outs, expect):
        assert hd.records == 1 and hd.replays == 2, repr(hd)  # direct, recorded + replayed, replayed
        assert same(bits(o), e)
    held = sum(hd.graph_bytes for hd in handles)
    for hd in handles:
        hd.close()
    assert held > 0 and sum(hd.graph_bytes for hd in handles) == 0


# ---- 5. caller's streams destroyed first ---------------------------------------------------------------------------

def test_streams_destroyed_before_handles():
    code = """
    import gc, numpy as np, cupy, cupy_rope as cr
    cu = np.asarray([0, 50, 120], np.int32)
    f = np.float32
    r = np.random.default_rng(1)
    x = [cupy.asarray(a) for a in (r.standard_normal((120, 256), dtype=f), r.standard_normal((120, 256), dtype=f),
         r.standard_normal((768, 256), dtype=f) * f(.02), r.standard_normal(768, dtype=f) * f(.01),
         r.standard_normal((256, 256), dtype=f) * f(.02), r.standard_normal(256, dtype=f) * f(.01),
         r.standard_normal((120, 64), dtype=f), r.standard_normal((120, 64), dtype=f))]
    handles = []
    for i in range(40):
        s = cupy.cuda.Stream(non_blocking=True)
        h = cr.VisionAttentionBackward(cu, hidden_size=256, head_dim=64)
        with s:
            for _ in range(3):
                h(*x)
            cr.vision_attention_backward(*x, cu)
        handles.append(h)
        del s
        gc.collect()
    for h in handles:
        h.close()
    del handles
    gc.collect()
    cupy.cuda.runtime.deviceSynchronize()
    print("OK")
    """
    r = run_python(code)
    assert r.returncode == 0 and "OK" in r.stdout, (r.returncode, r.stderr[-3000:])


# ---- 6. the caller's own capture ------------------------------------------------------------------------------------

def test_call_captured_by_the_caller(rng):
    import cupy
    from cupy_rope.attention import varlen

    block, cu = make_inputs(rng, [0, 100, 100, 333], 448, 64)
    expect = bits(cr.vision_attention_backward(*block, cu))
    s = cupy.cuda.Stream(non_blocking=True)
    memory = cr.GraphMemory()
    with s, memory:
        s.begin_capture()
        outs = cr.vision_attention_backward(*block, cu)
        graph = s.end_capture()
    for _ in range(3):
        for o in outs:
            o.fill(np.nan)
        graph.launch(s)
        s.synchronize()
        assert same(bits(outs), expect), "the caller's captured graph differs from a direct call"
    # device cu_seqlens inside a capture: a clear error
    cu_dev = cupy.asarray(cu)
    cupy.cuda.runtime.deviceSynchronize()
    with s:
        s.begin_capture()
        try:
            with pytest.raises(RuntimeError, match="NumPy array"):
                cr.vision_attention_backward(*block, cu_dev)
        finally:
            s.end_capture()
    # nothing keeps accumulating after the capture
    for _ in range(200):
        cr.vision_attention_backward(*block, cu)
    cupy.cuda.runtime.deviceSynchronize()
    cr.vision_attention_backward(*block, cu)
    assert len(varlen._inflight) <= 2, f"{len(varlen._inflight)} uploads still held"


# ---- 9. kept tile tables across streams ------------------------------------------------------------------------

def test_kept_tile_table_waits_for_its_upload(rng):
    import cupy
    from cupy_rope.attention import varlen

    lens = [int(x) for x in rng.integers(1, 400, 6)] + [1 + len(varlen._device_tables)]  # values no call kept yet
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    t = int(cu[-1])
    q, k, v = (cupy.asarray(rng.standard_normal((t, 4, 64), dtype=np.float32)) for _ in range(3))
    expect = bits(cr.varlen_attention_forward(q, k, v, cu.astype(np.int64), precision="bf16"))
    busy = cupy.asarray(rng.standard_normal((4096, 4096), dtype=np.float32))
    s1, s2 = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.runtime.deviceSynchronize()
    with s1:
        for _ in range(20):  # the upload below waits behind these on s1
            busy = busy @ busy * np.float32(1e-2)
        first = cr.varlen_attention_forward(q, k, v, cu, precision="bf16")
    with s2:
        second = cr.varlen_attention_forward(q, k, v, cu, precision="bf16")
    cupy.cuda.runtime.deviceSynchronize()
    assert len(varlen._device_tables) < varlen.DEVICE_TABLES_MAX and any(
        key[1] == (cu.dtype.str, cu.tobytes()) for key in varlen._device_tables), "the tile table was not kept"
    assert same(bits(first), expect) and same(bits(second), expect), "a call read the kept table before it arrived"


# ---- 10. one handle inside the caller's capture, on two streams, and fed its own outputs ------------------------

def test_handle_across_a_capture_and_two_streams(rng):
    import cupy

    cu = [0, 100, 100, 333]
    (first, cu_np), (second, _) = make_inputs(rng, cu, 448, 64), make_inputs(rng, cu, 448, 64)
    expect = [bits(cr.vision_attention_backward(*x, cu_np)) for x in (first, second)]
    s1, s2 = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    handle = cr.VisionAttentionBackward(cu_np, hidden_size=448, head_dim=64)
    # its first call inside the caller's capture: the tile table that capture copies is the graph's, not the handle's
    memory = cr.GraphMemory()
    with s1, memory:
        s1.begin_capture()
        outs = handle(*first)
        graph = s1.end_capture()
    with s2:
        outs = handle(*second)
    s2.synchronize()
    assert same(bits(outs), expect[1]), "an eager call after the capture read the captured tile table"
    graph.launch(s1)
    s1.synchronize()
    assert same(bits(outs), expect[0])
    # calls alternating between a busy stream and an idle one: the outputs are the last call's
    busy = cupy.asarray(rng.standard_normal((4096, 4096), dtype=np.float32))
    cupy.cuda.runtime.deviceSynchronize()
    for _ in range(3):  # each input set twice in a row: recorded, then replayed
        with s1:
            for _ in range(20):
                busy = busy @ busy * np.float32(1e-2)
            handle(*first)
            handle(*first)
        with s2:
            handle(*second)
            outs = handle(*second)
        cupy.cuda.runtime.deviceSynchronize()
        assert same(bits(outs), expect[1]), "a call on another stream wrote the outputs before the last call"
    assert handle.replays > 0, repr(handle)
    # its own outputs as inputs: refused before any launch
    fed = list(second)
    fed[0] = outs[0]
    with pytest.raises(ValueError, match="overlaps"):
        handle(*fed)
    handle.close()


# ---- 11. a handle closed, moved to another GPU, or without capturable cuBLAS ----------------------------------------

def test_handle_closed_before_the_callers_graph_replays(rng):
    """A handle whose kept tile table is complete, called inside the caller's capture and then closed: the
    caller's graph reads a table of its own (or one kept for the process), not the handle's, whose block goes back
    to the pool and is written by later allocations. The graph's outputs stay those of a direct call."""
    import cupy

    cu = [0, 100, 100, 333]
    block, cu_np = make_inputs(rng, cu, 448, 64)
    expect = bits(cr.vision_attention_backward(*block, cu_np))
    handle = cr.VisionAttentionBackward(cu_np, hidden_size=448, head_dim=64)
    handle(*block)
    cupy.cuda.runtime.deviceSynchronize()
    handle(*block)  # the kept table is seen complete from here
    table_bytes = handle.varlen.table.nbytes
    s = cupy.cuda.Stream(non_blocking=True)
    memory = cr.GraphMemory()
    with s, memory:
        s.begin_capture()
        outs = handle(*block)
        graph = s.end_capture()
    handle.close()
    # the pool's free blocks of the table's size class, the freed one among them, taken and zeroed
    junk = [cupy.zeros(max(1, table_bytes // 4), np.int32) for _ in range(4096)]
    cupy.cuda.runtime.deviceSynchronize()
    for o in outs:
        o.fill(np.nan)
    graph.launch(s)
    s.synchronize()
    assert same(bits(outs), expect), "the caller's graph read a table the closed handle gave back"
    del junk


def test_handle_without_capturable_cublas(rng, monkeypatch):
    """Where cuBLAS is reached only through CuPy's bindings (which refuse stream captures), a handle runs every
    call directly: no recording is tried, and every call gives the bits of a direct call."""
    from cupy_rope import _cublas

    block, cu_np = make_inputs(rng, [0, 100, 100, 333], 448, 64)
    monkeypatch.setattr(_cublas, "capturable", lambda: False)
    expect = bits(cr.vision_attention_backward(*block, cu_np))
    handle = cr.VisionAttentionBackward(cu_np, hidden_size=448, head_dim=64)
    for _ in range(3):
        assert same(bits(handle(*block)), expect)
    assert (handle.records, handle.replays) == (0, 0), repr(handle)
    handle.close()


def test_handle_moves_between_gpus(rng):
    """One handle called on GPU 0, then GPU 1, then GPU 0 again: each call gives the bits of a direct call on its
    GPU (new outputs, a plan and an end event of that GPU)."""
    import cupy

    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    block, cu_np = make_inputs(rng, [0, 100, 100, 333], 448, 64)
    with cupy.cuda.Device(1):
        other = [cupy.asarray(a.get()) for a in block]
        expect1 = bits(cr.vision_attention_backward(*other, cu_np))
    expect0 = bits(cr.vision_attention_backward(*block, cu_np))
    handle = cr.VisionAttentionBackward(cu_np, hidden_size=448, head_dim=64)
    for _ in range(2):
        assert same(bits(handle(*block)), expect0)
        with cupy.cuda.Device(1):
            for _ in range(3):  # direct, recorded, replayed
                got = handle(*other)
                assert got[0].data.device_id == 1 and same(bits(got), expect1)
    handle.close()


# ---- 7, 8. refused before a launch ---------------------------------------------------------------------------------

def test_misaligned_rope_view_is_refused(rng):
    import cupy

    from cupy_rope import _kernels

    n = 4 * 128
    buf = cupy.zeros(n * 4 + 1, cupy.uint8)
    theta = buf[1:].view(cupy.float32).reshape(4, 128)
    g = rng.standard_normal((4, 128), dtype=np.float32)
    before = _kernels.launches()
    with pytest.raises(ValueError, match="align"):
        cr.rope_2d_backward(g, g, theta)
    assert _kernels.launches() == before
    out = cr.rope_2d_backward(g, g, rng.standard_normal((4, 128), dtype=np.float32))  # context still usable
    cupy.cuda.runtime.deviceSynchronize()
    assert bool(cupy.isfinite(out).all())


def test_bad_out_num_heads_and_sizes_are_refused(rng, monkeypatch):
    import cupy

    from cupy_rope import _checks, _cublas, _kernels

    g = rng.standard_normal((4, 128), dtype=np.float32)
    th = rng.standard_normal((4, 128), dtype=np.float32)
    before = (_kernels.launches(), _cublas.calls())
    overlapping = cupy.lib.stride_tricks.as_strided(cupy.empty(128, np.float32), shape=(4, 128),
                                                    strides=(0, 4))
    with pytest.raises(ValueError, match="overlap"):
        cr.rope_2d_backward(g, g, th, out=overlapping)
    block, cu = make_inputs(rng, [0, 40, 70], 448, 64)
    with pytest.raises(TypeError, match="num_heads"):
        cr.vision_attention_backward(*block, cu, num_heads=2.9)
    with pytest.raises(TypeError, match="num_heads"):
        cr.vision_attention_forward(*block[1:], cu, num_heads=7.0)
    # oversized: the token limit lowered below this 70-token block and a 70-token varlen call (read at each call)
    monkeypatch.setattr(_checks, "MAX_TOKENS", 64)
    q = rng.standard_normal((70, 7, 64), dtype=np.float32)
    for call in (lambda: cr.vision_attention_backward(*block, cu),
                 lambda: cr.vision_attention_forward(*block[1:], cu),
                 lambda: cr.varlen_attention_forward(q, q, q, cu)):
        with pytest.raises(ValueError, match="70 tokens is more than this library supports"):
            call()
    assert (_kernels.launches(), _cublas.calls()) == before


@pytest.mark.parametrize("precision", ["tf32", "fp32"])
def test_more_tokens_than_one_grid_row(precision, rng):
    """5 M tokens (hidden 64): the transposes' and column sums' grids exceed 65535 blocks in y unless the kernels
    loop; every token's gradient must still be right. The call runs into allocations poisoned with NaN; the float64
    reference runs a chunk of sequences at a time: grad_hidden_states over all tokens within the mode's bound, and
    the weight and bias gradients (sums over all tokens, added up chunk by chunk) within ``weight_tol``. A row of
    blocks the kernels skip leaves NaN, and a row of tokens left out of a sum moves it by ~1% or more."""
    import cupy

    from cupy_rope import reference as R

    t, h, d, L = 5_000_192, 64, 64, 256
    cu = np.arange(0, t + 1, L, dtype=np.int64).astype(np.int32)
    assert cu[-1] == t
    block, _ = make_inputs(rng, cu, h, d)
    with poisoned_allocations():
        outs = cr.vision_attention_backward(*block, cu, precision=precision)
    # A weight gradient is a dot product over 5 M tokens: in fp32 its rounding grows like eps * sqrt(T) (~1e-4
    # here), past the fp32 bound set for the workloads' lengths; a grid row left out costs more than 1e-2.
    weight_tol = {"fp32": 1e-3, "tf32": TOL["tf32"]}[precision]
    chunk = 512 * L
    sums = [0.0] * 4
    err2 = ref2 = 0.0
    for lo in range(0, t, chunk):
        hi = min(lo + chunk, t)
        sub = [a[lo:hi] if a.shape[0] == t else a for a in block]
        ref = R.vision_attention_backward(*sub, cupy.arange(0, hi - lo + 1, L, dtype=np.int32), num_heads=1)
        err2 += float(cupy.square(outs[0][lo:hi].astype(np.float64) - ref[0]).sum())
        ref2 += float(cupy.square(ref[0]).sum())
        sums = [a + b for a, b in zip(sums, ref[1:])]
    err = (err2 / ref2) ** 0.5
    assert err <= TOL[precision], f"grad_hidden_states {err:.2e}"
    for name, got, want in zip(OUTPUTS[1:], outs[1:], sums):
        err = float(cupy.linalg.norm(got.astype(np.float64) - want) / cupy.linalg.norm(want))
        assert err <= weight_tol, f"{name} {err:.2e}"


# ---- threads stress ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("with_handles", [False, True])
def test_threads_streams_precisions(with_handles, rng):
    """4 threads x 2 streams x 3 precisions x 200 calls: every result bit-identical to the single-thread one, no
    exception."""
    import cupy

    cu = np.asarray([0, 97, 97, 256, 300], np.int32)
    h, d = 448, 64
    sets = [make_inputs(rng, cu, h, d)[0] for _ in range(4)]
    expect = {(p, i): bits(cr.vision_attention_backward(*x, cu, precision=p))
              for p in PRECISIONS for i, x in enumerate(sets)}
    bad, errors = [], []

    def work(i):
        try:
            streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]
            handles = {(p, j): cr.VisionAttentionBackward(cu, hidden_size=h, head_dim=d, precision=p)
                       for p in PRECISIONS for j in range(2)}
            for k in range(200):
                for p in PRECISIONS:
                    for j in range(2):
                        with streams[j]:
                            outs = (handles[p, j](*sets[i]) if with_handles
                                    else cr.vision_attention_backward(*sets[i], cu, precision=p))
                            got = bits(outs)
                        if not same(got, expect[p, i]):
                            bad.append((i, p, j, k))
            for hd in handles.values():
                hd.close()
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert not bad, f"{len(bad)} results differ from single-thread, e.g. {bad[:5]}"
