"""The measuring lab's shared helpers (dev/common.py) that need no GPU: settings with build switches, and the
build swap restoring the library's kernel lookup however the block ends; and the arithmetic of
dev/bwd_timeline.py's summary."""
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



def test_bwd_timeline_sums_the_stamps():
    """dev/bwd_timeline.py's summary of the probe's stamps, on a made-up buffer: two SMs at 2 GHz, three units of
    two kinds; unit, K/V, steps, epilogue and waits come out in µs, the SM gap from one unit's end to the next
    start on the same SM, unstamped rows ignored."""
    import numpy as np

    import bwd_timeline

    rec = np.zeros((8, 16), np.uint64)

    def unit(i, sm, gt0, kind, kvi, cyc):  # cyc: K/V in, steps done, end (cycles after the start, 2 per ns)
        c0 = 10_000 * (i + 1)
        rec[i, :10] = [gt0, c0, c0 + cyc[0], c0 + cyc[1], c0 + cyc[2], 400, 600, gt0 + cyc[2] // 2, sm, 4]
        rec[i, 10:14] = [800, 1000, c0 + cyc[1] + 200, kind + 16 * kvi]

    unit(0, 0, 1_000, 1, 0, (2_000, 20_000, 24_000))
    unit(1, 0, 14_000, 1, 0, (2_000, 20_000, 24_000))   # 1 µs after unit 0 ends (1000 + 12000 ns)
    unit(2, 1, 1_000, 1, 1, (4_000, 30_000, 36_000))
    out = bwd_timeline.summarise(rec)
    assert out["units"] == 3 and abs(out["ghz"] - 2.0) < 1e-9
    assert out["span_us"] == (14_000 + 12_000 - 1_000) / 1e3
    assert abs(out["sm_gap_us"] - 1.0) < 1e-9
    g0, g1 = out["groups"]["fused dQ, key tile 0"], out["groups"]["fused dQ, key tile 1"]
    assert g0["units"] == 2 and g1["units"] == 1
    assert (g0["unit_us"], g0["kv_wait_us"], g0["steps_us"], g0["store_us"]) == pytest.approx((12, 1, 9, 2))
    assert (g1["unit_us"], g1["kv_wait_us"], g1["steps_us"], g1["store_us"]) == pytest.approx((18, 2, 13, 3))
    assert (g0["qdo_wait_us"], g0["staging_wait_us"], g0["writer_full_wait_us"], g0["writer_count_wait_us"]) == \
        pytest.approx((0.2, 0.3, 0.4, 0.5))
    assert g0["writer_end_after_steps_us"] == pytest.approx(0.1)


def test_generated_wgmma_header_is_up_to_date():
    """kernels_cu/attention/sm90/wgmma_ops.cuh is what dev/gen_wgmma.py writes (the file is committed, generated)."""
    import gen_wgmma

    assert gen_wgmma.OUT.read_text() == gen_wgmma.text(), "run python dev/gen_wgmma.py"
    assert gen_wgmma.main(["--check"]) == 0


def test_power_run_settings_take_turns_and_are_checked():
    """dev/power_run.py: settings parse as varlen_ab's (plan fields and build switches); the loop must give each
    setting two calls, and names must differ; none given is the library's plan alone."""
    import power_run

    a = power_run.parse_args(["--calls", "6", "split:", "whole:tail_parts=1,-DX=1"])
    assert a.settings == [("split", ({}, ())), ("whole", ({"tail_parts": 1}, ("-DX=1",)))]
    assert power_run.parse_args([]).settings == []
    for argv in (["--calls", "3", "a:", "b:"], ["a:", "a:tail_parts=1"]):
        with pytest.raises(SystemExit):
            power_run.parse_args(argv)
