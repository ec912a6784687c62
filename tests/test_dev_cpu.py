"""The measuring lab's shared helpers (dev/common.py) that need no GPU: settings with build switches, and the
build swap restoring the library's kernel lookup however the block ends."""
import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dev"))
import common  # noqa: E402


def test_build_setting_splits_plan_fields_and_switches():
    name, (fields, defines) = common.build_setting("soft:fwd_specialised=False,-DCUPY_ROPE_SOFT_BF16=1,-DFLAG")
    assert name == "soft"
    assert fields == {"fwd_specialised": False}
    assert defines == ("-DCUPY_ROPE_SOFT_BF16=1", "-DFLAG")
    assert common.build_setting("base:") == ("base", ({}, ()))


@pytest.mark.parametrize("text", ["nocolon", ":x=1", "bad:-D1X", "bad:-D", "bad:no_such_field=1"])
def test_build_setting_refuses(text):
    with pytest.raises(argparse.ArgumentTypeError):
        common.build_setting(text)


def test_sm90_build_restores_the_kernel_lookup():
    from cupy_rope.attention import hopper

    original = hopper._kernel
    with common.sm90_build(()):
        assert hopper._kernel is original
    with pytest.raises(RuntimeError):
        with common.sm90_build(("-DX=1",)):
            assert hopper._kernel is not original
            raise RuntimeError("a failing call")
    assert hopper._kernel is original


def test_sm90_build_reaches_the_kernel_build(monkeypatch):
    from cupy_rope.attention import hopper

    seen = []

    class Fake:
        max_smem = 1 << 30

    def fake_launcher(module, name, signature, options):
        seen.append((module, name, options))
        return Fake()

    monkeypatch.setattr(hopper, "launcher", fake_launcher)
    with common.sm90_build(("-DCUPY_ROPE_SOFT_BF16=1",)):
        hopper._kernel("hop_fwd_bf16_ws", 128)
    hopper._kernel("hop_fwd_bf16_ws", 128)
    assert seen[0][:2] == ("attention_sm90", "hop_fwd_bf16_ws")
    assert "-DATTN_HEAD_DIM=128" in seen[0][2] and "-DCUPY_ROPE_SOFT_BF16=1" in seen[0][2]
    assert "-DCUPY_ROPE_SOFT_BF16=1" not in seen[1][2]


def test_racecheck_probe_builds_for_sm90a():
    """dev/racecheck_probe.py's kernel (setmaxnreg, mbarriers, named and unaligned barriers) assembles for
    sm_90a with NVRTC alone, and every mode it names has a branch in the kernel."""
    import racecheck_probe

    image = racecheck_probe.cubin()
    assert image[:4] == b"\x7fELF" and b"probe" in image
    src = racecheck_probe.SOURCE
    assert '#include "attention/sm90/async.cuh"' in src  # the library's own barrier helpers, not copies
    assert "mode == 0" in src and "mode == 1" in src and "mode == 2" in src and "mode >= 4" in src
    assert "mode >= 5" in src and "mode == 6" in src and len(racecheck_probe.MODES) == 7

