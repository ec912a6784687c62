"""The README's promises: its Python examples run as written, all of them, in order, and give what they say; its
commands are the ones CI runs; without a usable GPU the library says so plainly."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
TEST_COMMAND = "python -m pytest -q -rs tests"


def _blocks() -> list:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_examples_are_python_and_compile():
    text = README.read_text()
    fences = re.findall(r"^```(\w*)$", text, re.M)
    opening = fences[0::2]
    assert set(opening) <= {"python", "bash"}, f"fences other than python/bash would escape the GPU run: {opening}"
    assert len(_blocks()) == opening.count("python") >= 4
    for i, code in enumerate(_blocks()):
        compile(code, f"README.md python block {i}", "exec")


def test_readme_gives_the_commands_ci_runs():
    text = README.read_text()
    assert TEST_COMMAND in text
    assert f"TEST_CMD=({TEST_COMMAND})" in (ROOT / ".ci" / "run").read_text()


def test_readme_rope_angles_are_the_spec_ones():
    """theta[b, s, i] = s * 10000^(-2 (i mod 64) / 128): the README's inverse frequencies, evaluated by NumPy."""
    line = next(ln for ln in _blocks()[0].splitlines() if ln.startswith("inv_freq ="))
    inv_freq = eval(line.split("=", 1)[1].split("#")[0], {"np": np})  # noqa: S307 - the README's own expression
    i = np.arange(128)
    np.testing.assert_allclose(inv_freq, 10000.0 ** (-2.0 * (i % 64) / 128), rtol=1e-15)


@pytest.mark.gpu
def test_readme_examples_run():
    import cupy

    ns: dict = {}
    for i, code in enumerate(_blocks()):
        exec(compile(code, f"README.md python block {i}", "exec"), ns)
    cupy.cuda.get_current_stream().synchronize()
    t, h = ns["T"], ns["H"]
    theta = ns["theta"]
    s, i = np.meshgrid(np.arange(1024), np.arange(128), indexing="ij")
    np.testing.assert_allclose(theta[3].get(), (s * 10000.0 ** (-2.0 * (i % 64) / 128)).astype(np.float32))
    assert ns["grad_theta"].shape == theta.shape and ns["grad_theta"].dtype == cupy.float32
    assert bool(cupy.isfinite(ns["grad_theta"]).all())
    assert ns["out"].shape == (t, h) and bool(cupy.isfinite(ns["out"]).all())
    shapes = ((t, h), (3 * h, h), (3 * h,), (h, h), (h,))
    direct = [ns[k] for k in ("g_x", "g_wqkv", "g_bqkv", "g_wp", "g_bp")]
    handle = [ns[k] for k in ("lg_x", "lg_wqkv", "lg_bqkv", "lg_wp", "lg_bp")]
    captured = list(ns["grads"])
    for name, ours, shape in zip(("direct", "handle", "captured"), (direct, handle, captured), [shapes] * 3):
        for g, sh in zip(ours, shape):
            assert g.shape == sh and g.dtype == cupy.float32 and bool(cupy.isfinite(g).all()), name
    # the same inputs, the same plan: a replayed handle and a replayed capture give the direct call's bits
    for a, b, c in zip(direct, handle, captured):
        assert bool((a == b).all()) and bool((a == c).all())
    assert ns["layers"][0].replays > 0


def test_bench_without_gpu_says_so_plainly():
    from cupy_rope._gpu import gpu_problem

    if gpu_problem() is None:
        pytest.skip("a GPU is present: the benchmark would run instead of refusing")
    r = subprocess.run([sys.executable, "-m", "cupy_rope", "bench", "rope"], capture_output=True, text=True,
                       cwd=ROOT, timeout=300)
    assert r.returncode == 1
    assert r.stderr.startswith("cupy_rope: ") and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == gpu_problem()


@pytest.mark.parametrize("facts, expected", [
    (dict(status=35, driver=None, smi=False, visible=None),
     "no NVIDIA GPU/driver found (no NVIDIA driver is installed"),
    (dict(status=100, driver=None, smi=False, visible=None), "no NVIDIA GPU/driver found"),
    (dict(status=35, driver=11040, smi=True, visible=None), "the NVIDIA driver is too old (it supports CUDA 11.4"),
    (dict(status=100, driver=12040, smi=True, visible=""), "no NVIDIA GPU/driver found (a driver for CUDA 12.4"),
    (dict(status=999, driver=12040, smi=True, visible=None), "no usable NVIDIA GPU"),
])
def test_no_gpu_messages_tell_the_cases_apart(facts, expected):
    from cupy_rope._gpu import explain

    msg = explain(error="cudaErrorX: text", runtime=12090, **facts)
    assert msg.startswith("cupy_rope: " + expected), msg
    if facts["driver"] is None:
        assert "too old" not in msg and "upgrade" not in msg.split("no driver to upgrade")[0]
