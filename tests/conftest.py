"""Shared test configuration.

* Marker ``gpu``: the test needs a usable CUDA GPU. Without one it is skipped with the reason
  ``no usable CUDA GPU: <reason>`` (what ``cupy.cuda.runtime.getDeviceCount()`` raised, or that it returned 0).
* Fixture ``gpu``: the ``cupy`` module, or the same skip.
* Fixture ``rng``: a ``cupy.random.Generator`` seeded from the test's id, so every test gets its own fresh
  random inputs (never zeros) and a failure reproduces exactly.
* Fixture ``np_rng``: the NumPy counterpart for the CPU tests.
* Fixture ``no_launch``: the whole test must launch no cupy_rope kernel and make no GEMM call (counted per
  thread, nothing patched; see ``tests.helpers.assert_no_launch`` for the same check around one call).

Shared helpers (bounds, error measures, input builders) live in ``tests/helpers.py``; ``tests`` is a package,
so test modules import them as ``from tests.helpers import ...`` (pytest puts the repository root on sys.path).
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from tests.helpers import assert_no_launch, gpu_problem


def skip_reason() -> str | None:
    p = gpu_problem()
    return None if p is None else f"no usable CUDA GPU: {p}"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a usable CUDA GPU (skipped with the reason when there is none)")
    config.addinivalue_line("markers", "stress: threads, faults and many layers (tests/test_stress_gpu.py); "
                            "select with -m stress")


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


@pytest.fixture
def no_launch():
    """The test launches no cupy_rope kernel and makes no GEMM call: every error must come from validation,
    before anything runs. Checked by the per-thread counters at setup and teardown; nothing is patched."""
    with assert_no_launch():
        yield
