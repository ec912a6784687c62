"""The GEMM layer's host side (cupy_rope._cublas), without a GPU: the config object, the product description and
its errors, the row-stride rule, the argument checks that come before any device work, and the per-thread state
(a thread's counter and state are its own, and its state is collected when the thread ends)."""
from __future__ import annotations

import dataclasses
import gc
import os
import subprocess
import sys
import threading
import time
import weakref

import numpy as np
import pytest

from cupy_rope import _checks as C
from cupy_rope import _cublas
from cupy_rope.precision import Precision

F32 = np.float32


def _arrays(m, n, k, trans_a=False, trans_b=False, dtype=F32):
    a = np.zeros((k, m) if trans_a else (m, k), dtype)
    b = np.zeros((n, k) if trans_b else (k, n), dtype)
    return a, b, np.zeros((m, n), F32)


# ---- GemmConfig ------------------------------------------------------------------------------------------------

def test_config_defaults_and_frozen():
    cfg = _cublas.GemmConfig()
    assert (cfg.split_rows, cfg.lt_candidates, cfg.split_k) == (128, 8, ())
    assert _cublas.DEFAULT_CONFIG == cfg and hash(_cublas.DEFAULT_CONFIG) == hash(cfg)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.split_rows = 64
    other = dataclasses.replace(cfg, split_rows=64)
    assert other != cfg and other.split_rows == 64 and cfg.split_rows == 128
    assert _cublas.GemmConfig(split_rows=0).split_rows == 0  # no split candidate


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(split_rows=-1), ValueError, "split_rows must be at least 0"),
    (dict(lt_candidates=0), ValueError, "lt_candidates must be at least 1"),
    (dict(split_rows=1.5), TypeError, "split_rows must be an integer"),
    (dict(lt_candidates=True), TypeError, "lt_candidates must be an integer"),
    (dict(split_rows=float("inf")), TypeError, "split_rows must be an integer"),
    (dict(split_k=(1, 2)), ValueError, "split_k must be a tuple of integers from 2 to 64"),
    (dict(split_k=(2.0,)), ValueError, "split_k must be a tuple"),
    (dict(split_k=4), ValueError, "split_k must be a tuple"),
    (dict(split_k=(True,)), ValueError, "split_k must be a tuple"),
])
def test_config_rejects(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        _cublas.GemmConfig(**kwargs)


def test_config_split_k_is_a_sorted_set():
    cfg = _cublas.GemmConfig(split_k=[8, np.int64(2), 4, 2])
    assert cfg.split_k == (2, 4, 8) and type(cfg.split_k[0]) is int
    assert cfg == _cublas.GemmConfig(split_k=(2, 4, 8)) and cfg != _cublas.DEFAULT_CONFIG


def test_config_numpy_integers_make_the_same_key():
    cfg = _cublas.GemmConfig(split_rows=np.int64(128), lt_candidates=np.int32(8))
    assert type(cfg.split_rows) is int and type(cfg.lt_candidates) is int
    assert cfg == _cublas.DEFAULT_CONFIG and hash(cfg) == hash(_cublas.DEFAULT_CONFIG)


def test_removed_switches_refuse_assignment():
    """The former tuning globals cannot be reassigned (an assignment would silently change nothing)."""
    for name, hint in (("SPLIT_ROWS", "GemmConfig"), ("_LT_CANDIDATES", "GemmConfig"),
                       ("_lt_autotune", "set_gemm_autotune")):
        with pytest.raises(AttributeError, match=hint):
            setattr(_cublas, name, 1)  # refused: nothing is assigned
        assert not hasattr(_cublas, name)


def test_autotune_switch_from_threads():
    was = _cublas.gemm_autotune()
    try:
        seen = []

        def flip(value):
            _cublas.set_gemm_autotune(value)
            seen.append(_cublas.gemm_autotune())

        for value in (False, True, 0, 1):
            t = threading.Thread(target=flip, args=(value,))
            t.start()
            t.join()
        assert seen == [False, True, False, True]
        assert _cublas.gemm_autotune() is True
    finally:
        _cublas.set_gemm_autotune(was)


# ---- the product description -----------------------------------------------------------------------------------

def test_product_description():
    a, b, c = _arrays(4, 5, 3, trans_b=True)
    assert _cublas._product(a, b, c, False, True, "fp32") == (4, 5, 3, False, True, 0, 68, 3, 3, 0)
    assert _cublas._product(a, b, c, 0, 1, Precision.TF32) == (4, 5, 3, False, True, 0, 77, 3, 3, 0)
    a, b, c = _arrays(4, 5, 3, trans_a=True, dtype=C.BF16)
    assert _cublas._product(a, b, c, True, False, "bf16") == (4, 5, 3, True, False, 14, 68, 4, 5, 0)
    assert _cublas._product(a, b, c.astype(C.BF16), True, False, "bf16") == (4, 5, 3, True, False, 14, 68, 4, 5, 14)


@pytest.mark.parametrize("change, exc, match", [
    (lambda a, b, c: (a, b, np.zeros((4, 6), F32)), ValueError, "shapes do not agree"),
    (lambda a, b, c: (a[:, :2], b, c), ValueError, "shapes do not agree"),
    (lambda a, b, c: (a, b, np.zeros((5, 4), F32).T), ValueError, "output must be C-contiguous"),
    (lambda a, b, c: (a, b, c.astype(np.float64)), TypeError, "c must be float32"),
    (lambda a, b, c: (a.astype(C.BF16), b, c), TypeError, "a must be float32 for precision 'fp32', got bfloat16"),
    (lambda a, b, c: (a, b[None], c), ValueError, "2-D arrays"),
    (lambda a, b, c: (np.asfortranarray(a), b, c), ValueError, "contiguous rows"),
    (lambda a, b, c: (a[::-1], b, c), ValueError, "without overlapping"),
    (lambda a, b, c: (np.broadcast_to(a[:1], a.shape), b, c), ValueError, "without overlapping"),
])
def test_product_errors(change, exc, match):
    a, b, c = change(*_arrays(4, 5, 3))
    with pytest.raises(exc, match=match):
        _cublas._product(a, b, c, False, False, "fp32")


def test_product_precision():
    a, b, c = _arrays(4, 5, 3)
    with pytest.raises(ValueError, match="precision must be one of"):
        _cublas._product(a, b, c, False, False, "fp16")
    with pytest.raises(TypeError, match="a and b must both be bfloat16 or both float32 for precision 'bf16'"):
        _cublas._product(a, b.astype(C.BF16), c, False, False, "bf16")


def test_product_sizes_fit_int():
    big = 2**31
    a = np.lib.stride_tricks.as_strided(np.zeros(1, F32), shape=(1, big), strides=(4 * big, 4))  # no memory read
    b = np.lib.stride_tricks.as_strided(np.zeros(1, F32), shape=(big, 1), strides=(4, 4))
    with pytest.raises(ValueError, match="fit cuBLAS's int"):
        _cublas._product(a, b, np.zeros((1, 1), F32), False, False, "fp32")


def test_row_stride():
    wide = np.zeros((6, 40), F32)
    assert _cublas._ld(wide) == 40
    assert _cublas._ld(wide[:, :33]) == 40  # the first columns of a row-padded array
    assert _cublas._ld(wide[2:4, 5:9]) == 40
    assert _cublas._ld(wide[:1, :7]) == 40
    assert _cublas._ld(np.zeros((3, 0), F32)) == 1  # empty: nothing read, whatever the strides
    assert _cublas._ld(np.zeros((0, 5), F32)) == 5
    with pytest.raises(ValueError, match="contiguous rows"):
        _cublas._ld(wide[:, ::2])
    with pytest.raises(ValueError, match="contiguous rows"):
        _cublas._ld(np.zeros((2, 3, 4), F32))
    with pytest.raises(ValueError, match="without overlapping"):
        _cublas._ld(np.lib.stride_tricks.as_strided(wide, shape=(6, 40), strides=(80, 4)))


# ---- gemm's own checks (before any device work) -----------------------------------------------------------------

def test_gemm_checks_before_any_gemm():
    a, b, c = _arrays(4, 5, 3)
    before = _cublas.calls()
    with pytest.raises(TypeError, match=r"gemm a must be a cupy\.ndarray, got numpy\.ndarray"):
        _cublas.gemm(a, b, c, trans_a=False, trans_b=False, precision="fp32", stream=0)
    with pytest.raises(TypeError, match="raw stream pointer"):
        _cublas.gemm(a, b, c, trans_a=False, trans_b=False, precision="fp32", stream=None)
    with pytest.raises(TypeError, match="raw stream pointer"):
        _cublas.gemm(a, b, c, trans_a=False, trans_b=False, precision="fp32", stream=True)
    with pytest.raises(TypeError, match="config must be a GemmConfig"):
        _cublas.gemm(a, b, c, trans_a=False, trans_b=False, precision="fp32", stream=0, config={"split_rows": 64})
    with pytest.raises(TypeError, match="config must be a GemmConfig"):
        _cublas.plan_for(a, b, c, trans_a=False, trans_b=False, precision="fp32", config=128)
    assert _cublas.calls() == before


# ---- per-thread state ------------------------------------------------------------------------------------------

def test_thread_state_is_per_thread_and_collected():
    """Each thread has its own state and counter; a thread's state is collected when the thread ends (its
    finalizer hands back its handles and memory), with nothing on a GPU needed to show it."""
    main_state = _cublas._state()
    seen = {}

    def work():
        st = _cublas._state()
        seen["same"] = st is main_state
        seen["calls"] = _cublas.calls()
        seen["captured"] = _cublas.captured_workspaces()
        seen["keys"] = _cublas._workspace_keys()
        seen["ref"] = weakref.ref(st)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    deadline = time.monotonic() + 10  # collected with its thread (allow a moment for it)
    while seen["ref"]() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    assert seen["same"] is False and seen["calls"] == 0
    assert seen["captured"] == () and seen["keys"] == []
    assert seen["ref"]() is None, "the ended thread's state is still referenced"
    assert _cublas._state() is main_state


def test_imports_without_loading_cublas():
    """Importing the module loads no CUDA library: that happens on the first GEMM."""
    code = ("import sys; import cupy_rope._cublas as m; "
            "print(any(n.startswith('cupy_backends.cuda.libs') for n in sys.modules), m.calls(), m.DEFAULT_CONFIG)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[:2] == ["False", "0"], out.stdout


def test_strided_batched_splits_past_a_grid_dimension(monkeypatch):
    """gemm_strided_batched runs more than BATCH_MAX entries as several cuBLAS calls, each starting where the last
    ended (byte addresses advance by the fp32 strides) and together covering every entry once."""
    from cupy_rope import _cublas as B

    calls = []
    monkeypatch.setattr(B, "_runtime", lambda: type("R", (), {"getDevice": staticmethod(lambda: 0)}))
    monkeypatch.setattr(B, "_batched_call", lambda args, device, stream: calls.append(args))
    batch, sa, sb, sc = 2 * B.BATCH_MAX + 7, 64, 96, 48
    B.gemm_strided_batched(4, 6, 8, 1000, 8, sa, False, 2000, 6, sb, False, 3000, 6, sc, batch, precision="fp32",
                           stream=1)
    assert [c[19] for c in calls] == [B.BATCH_MAX, B.BATCH_MAX, 7]
    starts = [0, B.BATCH_MAX, 2 * B.BATCH_MAX]
    assert [c[6] for c in calls] == [2000 + 4 * i * sb for i in starts]  # b first: row-major as column-major
    assert [c[10] for c in calls] == [1000 + 4 * i * sa for i in starts]
    assert [c[15] for c in calls] == [3000 + 4 * i * sc for i in starts]
    calls.clear()
    B.gemm_strided_batched(4, 6, 8, 1000, 8, sa, False, 2000, 6, sb, False, 3000, 6, sc, 5, precision="tf32",
                           stream=1)
    assert len(calls) == 1 and calls[0][19] == 5 and calls[0][20] == B.COMPUTE_32F_FAST_TF32


def test_pointer_array_batches_split_past_a_grid_dimension(monkeypatch):
    """gemm_batched runs more than BATCH_MAX entries as several cublasGemmBatchedEx calls, each one's pointer
    arrays starting where the last ended (8 bytes an entry), operands swapped for the row-major layout."""
    from cupy_rope import _cublas as B

    calls = []
    monkeypatch.setattr(B, "_runtime", lambda: type("R", (), {"getDevice": staticmethod(lambda: 0)}))
    monkeypatch.setattr(B, "capturable", lambda: True)
    monkeypatch.setattr(B, "_direct_call", lambda fn, args, device, stream: calls.append((fn, args)))
    batch = B.BATCH_MAX + 3
    B.gemm_batched(4, 6, 8, 1000, 8, False, 2000, 8, True, 3000, 6, batch, precision="tf32", stream=1)
    assert [fn for fn, _ in calls] == ["cublasGemmBatchedEx"] * 2
    args = [a for _, a in calls]
    assert [a[16] for a in args] == [B.BATCH_MAX, 3]
    assert [a[6] for a in args] == [2000, 2000 + 8 * B.BATCH_MAX]  # b first: row-major as column-major
    assert [a[9] for a in args] == [1000, 1000 + 8 * B.BATCH_MAX]
    assert [a[13] for a in args] == [3000, 3000 + 8 * B.BATCH_MAX]
    assert args[0][:5] == (1, 0, 6, 4, 8) and args[0][17] == B.COMPUTE_32F_FAST_TF32
    with pytest.raises(ValueError, match="row strides too short"):
        B.gemm_batched(4, 6, 8, 1000, 7, False, 2000, 8, True, 3000, 6, 1, precision="fp32", stream=1)
    monkeypatch.setattr(B, "capturable", lambda: False)
    with pytest.raises(RuntimeError, match="needs the cuBLAS library itself"):
        B.gemm_batched(4, 6, 8, 1000, 8, False, 2000, 8, True, 3000, 6, 1, precision="fp32", stream=1)


@pytest.mark.parametrize("fn", ["gemm_strided_batched", "gemm_batched"])
def test_batched_products_check_sizes_before_any_call(fn, monkeypatch):
    """Both batched products refuse bad sizes, short row strides, an empty contraction and a stream that is not a
    pointer, naming themselves, before any cuBLAS call; an empty product makes none."""
    from cupy_rope import _cublas as B

    calls = []
    monkeypatch.setattr(B, "_runtime", lambda: type("R", (), {"getDevice": staticmethod(lambda: 0)}))
    monkeypatch.setattr(B, "capturable", lambda: True)
    monkeypatch.setattr(B, "_batched_call", lambda *a: calls.append(a))
    monkeypatch.setattr(B, "_direct_call", lambda *a: calls.append(a))
    strided = fn == "gemm_strided_batched"

    def call(m=4, n=6, k=8, lda=8, ldb=6, ldc=6, batch=2, stream=1):
        if strided:
            B.gemm_strided_batched(m, n, k, 1000, lda, 32, False, 2000, ldb, 48, False, 3000, ldc, 24, batch,
                                   precision="fp32", stream=stream)
        else:
            B.gemm_batched(m, n, k, 1000, lda, False, 2000, ldb, False, 3000, ldc, batch, precision="fp32",
                           stream=stream)

    with pytest.raises(ValueError, match=f"{fn} m must be an int"):
        call(m=-1)
    with pytest.raises(ValueError, match=f"{fn} row strides too short"):
        call(ldb=5)
    with pytest.raises(ValueError, match=f"{fn} needs k > 0"):
        call(k=0)
    with pytest.raises(TypeError, match="raw stream pointer"):
        call(stream=True)
    assert not calls
    call(batch=0)
    assert not calls
    call()
    assert len(calls) == 1
