"""The README's API examples run as written and give finite results of the documented shapes."""
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def _blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_has_examples():
    assert len(_blocks()) >= 2


@pytest.mark.gpu
def test_readme_examples_run():
    import cupy

    ns: dict = {}
    for code in _blocks():
        exec(compile(code, str(README), "exec"), ns)
    assert ns["grad_theta"].shape == ns["theta"].shape and ns["grad_theta"].dtype == cupy.float32
    assert bool(cupy.isfinite(ns["grad_theta"]).all())
    assert ns["out"].shape == (ns["T"], ns["H"])
    for g, shape in zip((ns["g_x"], ns["g_wqkv"], ns["g_bqkv"], ns["g_wp"], ns["g_bp"]),
                        ((ns["T"], ns["H"]), (3 * ns["H"], ns["H"]), (3 * ns["H"],), (ns["H"], ns["H"]), (ns["H"],))):
        assert g.shape == shape and bool(cupy.isfinite(g).all())
