"""Shared test configuration.

* Marker ``gpu``: the test needs a usable CUDA GPU. Without one it is skipped with the reason
  ``no usable CUDA GPU: <reason>`` (what ``cupy.cuda.runtime.getDeviceCount()`` raised, or that it returned 0).
* Fixture ``gpu``: the ``cupy`` module, or the same skip.
* Fixture ``rng``: a ``cupy.random.Generator`` seeded from the test's id, so every test gets its own fresh
  random inputs (never zeros) and a failure reproduces exactly.
* Fixture ``np_rng``: the NumPy counterpart for the CPU tests.
"""
from __future__ import annotations

import functools
import zlib

import numpy as np
import pytest


@functools.lru_cache(maxsize=None)
def gpu_problem() -> str | None:
    """None when a CUDA GPU is usable, else a one-line reason."""
    try:
        import cupy
    except Exception as e:  # noqa: BLE001 - any import failure means "no usable GPU"
        return f"cupy cannot be imported ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - e.g. CUDARuntimeError cudaErrorNoDevice / InsufficientDriver
        msg = str(e).splitlines()[0] if str(e) else ""
        return f"cupy.cuda.runtime.getDeviceCount() raised {type(e).__name__}: {msg}"
    if n == 0:
        return "cupy.cuda.runtime.getDeviceCount() returned 0"
    return None


def skip_reason() -> str | None:
    p = gpu_problem()
    return None if p is None else f"no usable CUDA GPU: {p}"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a usable CUDA GPU (skipped with the reason when there is none)")


def pytest_collection_modifyitems(config, items):
    reason = None
    for item in items:
        if item.get_closest_marker("gpu") is None:
            continue
        if reason is None:
            reason = skip_reason() or ""
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


def pytest_report_header(config):
    reason = skip_reason()
    return "cupy_rope GPU tests: " + ("enabled" if reason is None else f"skipped ({reason})")


@pytest.fixture
def gpu():
    """The ``cupy`` module when a GPU is usable; skips the test otherwise."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    import cupy

    return cupy


def _seed(request) -> int:
    return zlib.crc32(request.node.nodeid.encode())


@pytest.fixture
def rng(gpu, request):
    """``cupy.random.Generator`` seeded per test (from the test id)."""
    return gpu.random.default_rng(_seed(request))


@pytest.fixture
def np_rng(request):
    """``numpy.random.Generator`` seeded per test (from the test id)."""
    return np.random.default_rng(_seed(request))


@pytest.fixture(autouse=True)
def _release_gpu_memory(request):
    """After each GPU test, hand the memory pool's cached blocks back so large cases do not pile up."""
    yield
    if request.node.get_closest_marker("gpu") is not None and gpu_problem() is None:
        import cupy

        cupy.cuda.runtime.deviceSynchronize()
        cupy.get_default_memory_pool().free_all_blocks()
        cupy.get_default_pinned_memory_pool().free_all_blocks()
