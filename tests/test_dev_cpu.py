"""The measuring lab's shared helpers (dev/common.py) that need no GPU: settings with build switches, and the
build swap restoring the library's kernel lookup however the block ends."""
import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dev"))
import common  # noqa: E402


def test_build_setting_splits_plan_fields_and_switches():
    name, (fields, defines) = common.build_setting("pp:fwd_specialised=False,-DHOP_FWD_PINGPONG=1,-DFLAG")
    assert name == "pp"
    assert fields == {"fwd_specialised": False}
    assert defines == ("-DHOP_FWD_PINGPONG=1", "-DFLAG")
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
