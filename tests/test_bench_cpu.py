"""The benchmarks' host-side pieces, without a GPU: the command line of the varlen-attention and attention-long
benchmarks, their workloads, FLOP counts, the chunked float64 references (run with NumPy against the plain
formulas of cupy_rope.reference), the JSON rows (ratios and None peers) and the fail-soft peer timing."""
from __future__ import annotations

import json
import math

import ml_dtypes
import numpy as np
import pytest

from cupy_rope import _torch_peers as TP
from cupy_rope import bench_attention as BA
from cupy_rope import bench_long as BL
from cupy_rope import bench_varlen as BV
from cupy_rope import reference as R
from cupy_rope import workloads as W
from cupy_rope.__main__ import out_paths, parse

# ---- command line ----------------------------------------------------------------------------------------------


def test_parse_defaults():
    a = parse(["bench", "varlen-attention"])
    assert a.runs == [("tf32", None)] and a.selected == W.VARLEN_CASES and not a.no_peers and a.reps is None
    a = parse(["bench", "attention-long", "--precision", "bf16", "--out", "x.json", "--reps", "3", "--no-peers"])
    assert a.runs == [("bf16", "x.json")] and a.selected == W.LONG_CASES and a.no_peers and a.reps == 3
    assert a.hold_host and not parse(["bench", "rope", "--no-hold-host"]).hold_host
    assert parse(["bench", "rope", "--hold-host"]).hold_host


def test_parse_all_precisions():
    a = parse(["bench", "varlen-attention", "--precision", "all", "--out", "res"])
    assert a.runs == [("bf16", "res/varlen_attention_bf16.json"), ("tf32", "res/varlen_attention_tf32.json"),
                      ("fp32", "res/varlen_attention_fp32.json")]
    a = parse(["bench", "attention-long", "--precision", "all", "--out", "r/long_{precision}.json"])
    assert a.runs == [("bf16", "r/long_bf16.json"), ("tf32", "r/long_tf32.json")]
    a = parse(["bench", "attention-long", "--precision", "all"])
    assert a.runs == [("bf16", None), ("tf32", None)]


def test_out_paths():
    assert out_paths(None, "attention-long", ("bf16", "tf32")) == [None, None]
    assert out_paths("a.json", "varlen-attention", ("fp32",)) == ["a.json"]
    assert out_paths("a_{precision}.json", "varlen-attention", ("fp32",)) == ["a_fp32.json"]
    assert out_paths("d", "attention-long", ("bf16", "tf32")) == ["d/vision_attention_long_bf16.json",
                                                                   "d/vision_attention_long_tf32.json"]


def test_out_folder_with_one_precision(tmp_path):
    """A folder given for one precision gets the file named as in bench/results, not a write onto the folder
    after the whole run; a path that does not exist yet is still the file itself."""
    d = str(tmp_path)
    assert out_paths(d, "varlen-attention", ("fp32",)) == [f"{d}/varlen_attention_fp32.json"]
    assert out_paths("new/", "attention-long", ("tf32",)) == ["new/vision_attention_long_tf32.json"]
    assert out_paths("new.json", "attention", ("bf16",)) == ["new.json"]
    assert out_paths("r/{precision}/", "varlen-attention", ("bf16", "fp32")) == ["r/bf16/varlen_attention_bf16.json",
                                                                             "r/fp32/varlen_attention_fp32.json"]
    for argv, name in ((["bench", "attention", "--precision", "bf16"], "vision_attention_backward_bf16.json"),
                       (["bench", "rope"], "rope_2d_backward.json"),
                       (["bench", "varlen-attention", "--precision", "tf32"], "varlen_attention_tf32.json")):
        assert parse(argv + ["--out", d]).runs[0][1] == f"{d}/{name}"


def test_parse_cases_by_name_or_index():
    a = parse(["bench", "varlen-attention", "--cases", "mixed_h16_d64,0"])
    assert [c.name for c in a.selected] == ["mixed_h16_d64", "1x16384_h28_d128"]
    a = parse(["bench", "attention-long", "--cases", "qwen2vl_vision_1x9216"])
    assert a.selected == [W.LONG_CASES[4]]


@pytest.mark.parametrize("argv", [
    ["bench", "attention-long", "--precision", "fp32"],  # strict fp32 is not a long-sequence mode
    ["bench", "attention", "--precision", "all"],  # 'all' is for the two named-case benchmarks
    ["bench", "rope", "--precision", "all"],
    ["bench", "varlen-attention", "--cases", "no_such_case"],
    ["bench", "varlen-attention", "--cases", "5"],
    ["bench", "attention-long", "--precision", "fp64"],
    ["bench", "flash"],
])
def test_parse_refuses(argv, capsys):
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err


def test_new_commands_without_gpu(capsys):
    if BA.B.torch_or_none() is not None or _gpu_ok():
        pytest.skip("a GPU is present: the CLI would run the benchmark instead of refusing")
    from cupy_rope.__main__ import main

    for op in ("varlen-attention", "attention-long"):
        assert main(["bench", op, "--precision", "all", "--no-peers"]) == 1
        assert "no NVIDIA GPU" in capsys.readouterr().err


def _gpu_ok() -> bool:
    from cupy_rope._gpu import gpu_problem

    return gpu_problem() is None


def test_parse_seed_commands_unchanged():
    a = parse(["bench", "attention", "--precision", "bf16", "--cases", "0,3", "--out", "o_{precision}.json"])
    assert a.runs[0][0] == "bf16" and a.cases == "0,3" and a.out == "o_{precision}.json" and a.selected is None
    a = parse(["bench", "rope"])
    assert a.op == "rope" and a.selected is None


# ---- workloads -------------------------------------------------------------------------------------------------

def test_varlen_cases():
    assert [tuple(c) for c in W.VARLEN_CASES] == [
        ("1x16384_h28_d128", 28, 128, (16384,)),
        ("4x4096_h28_d128", 28, 128, (4096, 4096, 4096, 4096)),
        ("32x256_h28_d128", 28, 128, (256,) * 32),
        ("1x9216_h16_d80", 16, 80, (9216,)),
        ("mixed_h16_d64", 16, 64, (1, 64, 3000, 0, 700, 5000, 17)),
    ]


def test_long_cases():
    assert [tuple(c) for c in W.LONG_CASES] == [
        ("seed_dims_1x16384", 3584, 28, (16384,)),
        ("seed_dims_2x8192", 3584, 28, (8192, 8192)),
        ("seed_dims_8x1024", 3584, 28, (1024,) * 8),
        ("seed_dims_1x4096", 3584, 28, (4096,)),
        ("qwen2vl_vision_1x9216", 1280, 16, (9216,)),
    ]
    assert [c.head_dim for c in W.LONG_CASES] == [128, 128, 128, 128, 80]


def test_cu_seqlens_and_selection():
    assert W.cu_seqlens_of((1, 64, 3000, 0, 700)) == [0, 1, 65, 3065, 3065, 3765]
    assert W.cu_seqlens_of(()) == [0]
    assert W.select_cases(W.LONG_CASES, None) == W.LONG_CASES
    assert W.select_cases(W.LONG_CASES, "") == W.LONG_CASES
    assert W.select_cases(W.LONG_CASES, "3, 1") == [W.LONG_CASES[3], W.LONG_CASES[1]]
    with pytest.raises(ValueError, match="seed_dims_1x16384"):
        W.select_cases(W.LONG_CASES, "seed_dims_1x1")


# ---- FLOP counts -----------------------------------------------------------------------------------------------

def test_attention_flops():
    c = W.VARLEN_CASES[0]
    assert BV.attention_flops(c.seq_lens, c.num_heads, c.head_dim) == 14 * 16384**2 * 128 * 28 == 13469017440256
    c = W.VARLEN_CASES[4]
    assert BV.attention_flops(c.seq_lens, c.num_heads, c.head_dim) == 494511517696  # empty sequence: nothing
    assert BV.default_reps(13469.0) == 10 and BV.default_reps(99.0) == 20


def test_block_flops():
    # GEMMs 2 T H (9H + 2H) plus 14 L^2 D per head: 1x4096 at hidden 3584 (28 heads of 128), 1x9216 at 1280 (16 x 80)
    assert BL.block_flops(W.LONG_CASES[3]) == 1999307276288
    assert BL.block_flops(W.LONG_CASES[4]) == 1854217912320
    # the seed benchmark's count is unchanged: GEMMs plus 12 L^2 D per head
    cu = W.even_cu_seqlens(211, 2)
    assert BA.flops(cu) == 2.0 * 211 * 3584 * 11 * 3584 + 28 * 12.0 * (106**2 + 105**2) * 128


# ---- float64 references, chunked -------------------------------------------------------------------------------

CU = [0, 1, 8, 8, 21]  # a one-token sequence, an empty one and two longer ones


@pytest.mark.parametrize("budget", [1 << 26, 2 * 3 * 13, 1])  # one chunk per sequence, a few rows, one row
def test_attention_reference_matches_plain_formula(np_rng, budget):
    t, nh, d = CU[-1], 3, 16
    q, k, v, g = (np_rng.standard_normal((t, nh, d)) for _ in range(4))
    scaling = 0.7 * d ** -0.5
    o, lse, dq, dk, dv = BV.attention_reference(q, k, v, g, np.asarray(CU, np.int32), scaling, budget=budget)
    ro, rlse = R.varlen_attention_forward(q, k, v, CU, scaling)
    rdq, rdk, rdv = R.varlen_attention_backward(g, q, k, v, CU, scaling)
    for a, b in ((o, ro), (lse, rlse), (dq, rdq), (dk, rdk), (dv, rdv)):
        assert a.shape == b.shape and a.dtype == np.float64
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    # and the textbook formula for one head of the last sequence
    a0, b0, h = 8, 21, 2
    s = scaling * q[a0:b0, h] @ k[a0:b0, h].T
    p = np.exp(s - s.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    np.testing.assert_allclose(o[a0:b0, h], p @ v[a0:b0, h], rtol=1e-11, atol=1e-13)
    np.testing.assert_allclose(lse[h, a0:b0], np.log(np.exp(s).sum(1)), rtol=1e-11, atol=1e-13)
    np.testing.assert_allclose(dv[a0:b0, h], p.T @ g[a0:b0, h], rtol=1e-11, atol=1e-13)
    # the one-token sequence attends to itself alone: o = v, dv = grad_o exactly, dq = dk = 0 (delta from o)
    assert np.array_equal(o[0], v[0]) and np.array_equal(dv[0], g[0])
    assert np.abs(dq[0]).max() < 1e-12 and np.abs(dk[0]).max() < 1e-12 < np.abs(dq[1]).max()


def test_to_f64_widens_bf16():
    x = np.asarray([1.5, -2.0, 3.140625, 1e-3], np.float32).astype(ml_dtypes.bfloat16)
    y = BV.to_f64(x)
    assert y.dtype == np.float64
    np.testing.assert_array_equal(y, x.astype(np.float64))


def test_varlen_errors_cover_every_output(np_rng):
    """o, lse, dq, dk and dv each get their error against the reference (lse too, among the outputs of the
    forward), and a NaN in any of them shows."""
    cu = np.asarray([0, 5, 12], np.int32)
    q, k, v, g = (np_rng.standard_normal((12, 2, 64)) for _ in range(4))
    ref = BV.attention_reference(q, k, v, g, cu)
    outs = [r.astype(np.float32) for r in ref]
    errs = BV.output_errors(outs, ref)
    assert list(errs) == ["o", "lse", "dq", "dk", "dv"] and max(errs.values()) < 1e-6
    outs[1] = outs[1].copy()
    outs[1][0, 3] = np.nan
    assert BV.output_errors(outs, ref)["lse"] == math.inf


def test_rope_floor_is_a_copy_of_the_same_bytes():
    """The floor: the bytes at the copy rate, or a device copy of the same bytes where the op is too small
    to reach that rate; never the empty kernel."""
    from cupy_rope.bench_rope import floor_us

    assert floor_us(12 * 2 * 256 * 128, 4.25, 7.5) == 7.5  # small: the same-bytes copy
    big = 12 * 64 * 8192 * 128
    assert floor_us(big, 4.25, 100.0) == pytest.approx(big / 4.25e6)  # large: the copy rate


def test_block_reference_matches_plain_formula(np_rng):
    t, hidden, d = 13, 128, 64
    cu = np.asarray([0, 5, 5, 13], np.int32)
    f = np.float32
    x = dict(grad_output=np_rng.standard_normal((t, hidden)).astype(f),
             hidden_states=np_rng.standard_normal((t, hidden)).astype(f),
             qkv_weight=(np_rng.standard_normal((3 * hidden, hidden)) * 0.02).astype(f),
             qkv_bias=(np_rng.standard_normal(3 * hidden) * 0.01).astype(f),
             proj_weight=(np_rng.standard_normal((hidden, hidden)) * 0.02).astype(f),
             proj_bias=(np_rng.standard_normal(hidden) * 0.01).astype(f),
             cos=np_rng.standard_normal((t, d)).astype(f), sin=np_rng.standard_normal((t, d)).astype(f),
             cu_seqlens=cu)
    got = BL.block_reference(x, 2, budget=2 * 3 * 8)
    want = R.vision_attention_backward(*(x[k] for k in BL.ARG_KEYS), cu, num_heads=2)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-13)


# ---- JSON rows ---------------------------------------------------------------------------------------------------

def test_varlen_row_ratios_and_none():
    c = W.VARLEN_CASES[3]
    errs = {"o": 1e-3, "dq": 4e-3, "dk": 2e-3, "dv": 1e-3}
    row = BV.make_row(c, "tf32", gpu_us=1000.0, host_us=12.34, gemm_tflops=400.0,
                      peers_us={"sdpa_math_tf32": None, "sdpa_mem_efficient_fp32": 2500.0},
                      peer_errors={"sdpa_math_tf32": "O(L^2) memory above 60 GB"}, rel_errors=errs,
                      deterministic=True)
    flop = 14 * 9216**2 * 80 * 16
    assert row["name"] == c.name and row["seq_lens"] == [9216] and row["tokens"] == 9216
    assert row["tflops"] == round(flop / 1000.0 / 1e6, 2)
    assert row["fraction_of_gemm_ceiling"] == round(flop / 1000.0 / 1e6 / 400.0, 4)
    assert row["ratio_to_best_peer"] == 2.5
    assert row["peers_tflops"] == {"sdpa_math_tf32": None, "sdpa_mem_efficient_fp32": round(flop / 2500 / 1e6, 2)}
    assert row["peer_errors"] == {"sdpa_math_tf32": "O(L^2) memory above 60 GB"}
    assert row["max_rel_error"] == 4e-3 and row["correct"] and row["deterministic"]
    assert not BV.make_row(c, "fp32", gpu_us=1000.0, host_us=None, gemm_tflops=50.0, peers_us={}, peer_errors={},
                           rel_errors=errs, deterministic=False)["correct"]  # 4e-3 > 1e-5
    none = BV.make_row(c, "bf16", gpu_us=800.0, host_us=None, gemm_tflops=700.0,
                       peers_us={"varlen_attn": None, "cudnn_sdpa": None}, peer_errors={}, rel_errors=errs,
                       deterministic=True)
    assert none["ratio_to_best_peer"] is None and none["correct"]
    best = BV.make_row(c, "bf16", gpu_us=800.0, host_us=None, gemm_tflops=700.0,
                       peers_us={"varlen_attn": 600.0, "cudnn_sdpa": 400.0}, peer_errors={}, rel_errors=errs,
                       deterministic=True)
    assert best["ratio_to_best_peer"] == 0.5  # the fastest peer counts
    assert row["sm_mhz"] is None  # no clock probe: none recorded
    assert BV.make_row(c, "bf16", gpu_us=800.0, host_us=None, gemm_tflops=700.0, peers_us={}, peer_errors={},
                       rel_errors=errs, deterministic=True, sm_mhz=1830.5)["sm_mhz"] == 1830.5


def test_varlen_row_summarises_many_sequences():
    assert BV.seq_lens_json((256,) * 32) == {"count": 32, "min": 256, "max": 256, "total": 8192}
    assert BV.seq_lens_json((1, 0, 5)) == [1, 0, 5]


def test_long_row_ratio_per_peer():
    c = W.LONG_CASES[3]
    errs = dict.fromkeys(("grad_hidden_states", "grad_qkv_weight", "grad_qkv_bias", "grad_proj_weight",
                          "grad_proj_bias"), 1e-2)
    row = BL.make_row(c, "bf16", gpu_us=4000.0, host_us=30.0, gemm_tflops=770.0,
                      peers_us={"torch_bf16_block": 6000.0}, peer_errors={}, rel_errors=errs, deterministic=True)
    assert row["ratio_to_peer"] == {"torch_bf16_block": 1.5} and row["correct"]
    assert row["tflops"] == round(1999307276288 / 4000.0 / 1e6, 2)
    row = BL.make_row(c, "tf32", gpu_us=4000.0, host_us=None, gemm_tflops=400.0,
                      peers_us={"torch_bf16_block": None, "torch_tf32_block": 8000.0},
                      peer_errors={"torch_bf16_block": "ImportError: no varlen"}, rel_errors=errs,
                      deterministic=True)
    assert row["ratio_to_peer"] == {"torch_bf16_block": None, "torch_tf32_block": 2.0}
    assert row["peers_tflops"]["torch_bf16_block"] is None and not row["correct"]  # 1e-2 > 5e-3
    assert row["sm_mhz"] is None
    assert BL.make_row(c, "tf32", gpu_us=4000.0, host_us=None, gemm_tflops=400.0, peers_us={}, peer_errors={},
                       rel_errors=errs, deterministic=True, sm_mhz=1799.0)["sm_mhz"] == 1799.0


def test_long_peer_geomeans():
    rows = [{"ratio_to_peer": {"a": 2.0, "b": None}}, {"ratio_to_peer": {"a": 8.0, "b": None}}, {"error": "x"}]
    assert BL.peer_geomeans(rows) == {"a": pytest.approx(4.0), "b": None}


def test_summary():
    rows = [{"gpu_us": 100.0, "ratio_to_best_peer": 2.0}, {"gpu_us": 400.0, "ratio_to_best_peer": None},
            {"name": "x", "error": "boom"}]
    s = BV.summary(rows)
    assert s["mean_gpu_us"] == 250.0 and s["geomean_gpu_us"] == pytest.approx(200.0)
    assert s["geomean_ratio_to_best_peer"] == pytest.approx(2.0)
    assert BV.summary([{"name": "x", "error": "boom"}])["mean_gpu_us"] is None


def test_math_layout():
    assert BV.math_layout((256,) * 32, 28) == "dense"
    assert BV.math_layout((4096,) * 4, 28) == "dense"  # 4 x 7.5 GB
    assert BV.math_layout((16384,), 28) is None  # 120 GB
    assert BV.math_layout((9216,), 16) == "dense"
    assert BV.math_layout((1, 64, 3000, 0, 700, 5000, 17), 16) == "per_sequence"
    assert BV.math_layout((8192,) * 4, 28) == "per_sequence"  # one fits (30 GB), four at once do not
    assert BV.math_layout((0,), 4) is None


# ---- peers: signature adaptation and fail-soft timing ------------------------------------------------------------

def test_adapt_varlen_signatures():
    calls = []

    def old(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
        calls.append(("old", max_q, max_k, is_causal))
        return "o"

    def new(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
            window_size=(-1, -1)):
        calls.append(("new", max_q, scale))
        return ("o", "lse")

    assert TP.adapt_varlen(old, 64, 64 ** -0.5)(1, 2, 3, "cu", np.int64(7)) == "o"
    assert TP.adapt_varlen(new, 64, 0.1)(1, 2, 3, "cu", 7) == "o"
    assert calls == [("old", 7, 7, False), ("new", 7, 0.1)]
    with pytest.raises(TP.NotApplicable, match="scale"):
        TP.adapt_varlen(old, 64, 0.1)


class _FakeTimer:
    def gpu_us(self, fn, reps):
        return fn()


def test_time_peers_fail_soft():
    def oom():
        raise MemoryError("out of memory\nsecond line")

    def not_here():
        raise TP.NotApplicable("needs equal lengths")

    cleaned = []
    makers = {"ok": lambda: (lambda: 123.456), "skip": "O(L^2) memory above 60 GB", "na": not_here, "oom": oom}
    us, errors = TP.time_peers(_FakeTimer(), makers, 5, cleanup=lambda: cleaned.append(1))
    assert us == {"ok": 123.5, "skip": None, "na": None, "oom": None}
    assert errors == {"skip": "O(L^2) memory above 60 GB", "na": "needs equal lengths",
                      "oom": "MemoryError: out of memory"}
    assert len(cleaned) == 3  # after every peer that ran


def test_time_peers_cleanup_failure_is_not_a_peer_error(capsys):
    def broken():
        raise RuntimeError("sticky")

    us, errors = TP.time_peers(_FakeTimer(), {"ok": lambda: (lambda: 10.0)}, 5, cleanup=broken)
    assert us == {"ok": 10.0} and errors == {}
    assert "sticky" in capsys.readouterr().err


def test_error_text_and_peer_summary(capsys):
    assert TP.error_text(ValueError("x" * 500)).endswith("...") and len(TP.error_text(ValueError("x" * 500))) == 300
    assert TP.error_text(KeyError()) == "KeyError: "
    TP.print_summary([{"peers_us": {"a": 100.0, "b": None}}, {"peers_us": {"a": 400.0, "b": None}}, {}])
    out = capsys.readouterr().out
    assert "peer a: mean 250.00 us, geomean 200.00 us over 2 cases" in out and "peer b: no timing" in out


def test_block_peer_refuses_unknown_attention():
    with pytest.raises(ValueError, match="softmax"):
        TP.block_peer({}, "flash2")


def test_seed_peers_need_torch():
    if BA.B.torch_or_none() is not None:
        pytest.skip("PyTorch with CUDA is present")
    assert BA._torch_peers({}, "bf16") == {}


def test_nothing_reads_shared_files():
    """The package carries its workloads: no module opens the workloads file of the specification."""
    import inspect

    for mod in (W, BV, BL, BA):
        assert "workloads.json" not in inspect.getsource(mod)
    assert math.isfinite(BV.MATH_MEMORY_LIMIT)


def test_run_cases_keeps_going_and_reports(tmp_path, capsys, monkeypatch):
    """The varlen and long benches' shared driver: a case that raises becomes an error row (the others still run),
    wrong or non-deterministic rows count as failures, and the JSON holds every row and the means."""
    import json
    from types import SimpleNamespace

    def row(name, correct=True, deterministic=True, gpu_us=100.0):
        return {"name": name, "precision": "tf32", "tokens": 8, "gpu_us": gpu_us, "tflops": 1.0,
                "fraction_of_gemm_ceiling": 0.5, "max_rel_error": 1e-4, "peers_us": {}, "correct": correct,
                "deterministic": deterministic}

    def one(case):
        if case.name == "boom":
            raise RuntimeError("no luck")
        return row(case.name, correct=case.name != "wrong", gpu_us=case.gpu_us)

    cases = [SimpleNamespace(name=n, gpu_us=u) for n, u in (("a", 100.0), ("boom", 0.0), ("wrong", 300.0))]
    monkeypatch.setattr(BV, "_release_between", lambda: None)
    rows, failed = BV.run_cases(cases, one, "tf32", 18)
    assert failed == 2 and [r["name"] for r in rows] == ["a", "boom", "wrong"]
    assert rows[1]["error"].startswith("RuntimeError") and "no luck" in rows[1]["error"]
    out = tmp_path / "sub" / "x.json"
    BV.report("op_x", "tf32", {"device": "dev"}, {"copy_TBps": 1.0}, "timing; m", rows, BV.summary(rows), str(out))
    got = json.loads(out.read_text())
    assert got["op"] == "op_x" and got["method"].endswith("m") and len(got["cases"]) == 3
    assert got["mean_gpu_us"] == pytest.approx(200.0)  # the error row has no time
    assert "mean 200.0 us" in capsys.readouterr().out


def test_drive_seeds_by_name_and_writes_the_payload(tmp_path, monkeypatch):
    """The driver of both long benches: ceilings measured once and passed to each case, seeds fixed by the case's
    place in the full list (so a subset sees the same inputs), means from the given function, 1 on a failure."""
    import json
    from types import SimpleNamespace

    from cupy_rope import _bench as B

    timer = SimpleNamespace(method=lambda: "timing")
    holds = []
    monkeypatch.setattr(B, "Timer", lambda hold=False: holds.append(hold) or timer)
    monkeypatch.setattr(B, "device_info", lambda: {"device": "dev"})
    monkeypatch.setattr(B, "copy_TBps", lambda timer: 2.0)
    monkeypatch.setattr(B, "gemm_TFLOPs", lambda timer, precision: 300.0)
    monkeypatch.setattr(BV, "_release_between", lambda: None)
    seen = []

    def one(timer, case, rate, seed):
        seen.append((timer, case.name, rate, seed))
        return {"name": case.name, "precision": "bf16", "tokens": 8, "gpu_us": 50.0, "tflops": 1.0,
                "fraction_of_gemm_ceiling": 0.1, "max_rel_error": 1e-3, "peers_us": {},
                "correct": case.name != "bad", "deterministic": True}

    all_cases = [SimpleNamespace(name=n) for n in ("x", "y", "bad")]
    out = tmp_path / "r.json"
    rc = BV.drive("t", "op_y", "m", all_cases, all_cases[1:2], one, "bf16", 8, 100, str(out))
    assert rc == 0 and seen == [(timer, "y", 300.0, 101)] and holds == [True]
    got = json.loads(out.read_text())
    assert got["op"] == "op_y" and got["ceilings"] == {"copy_TBps": 2.0, "gemm_TFLOPs": 300.0}
    assert got["method"] == "timing; m" and got["mean_gpu_us"] == pytest.approx(50.0)
    rc = BV.drive("t", "op_y", "m", all_cases, None, one, "bf16", 8, 100, None,
                  means=lambda rows: dict(BV.summary(rows), extra=len(rows)), hold_host=False)
    assert holds == [True, False]
    assert rc == 1 and [s[3] for s in seen[1:]] == [100, 101, 102]


def test_timer_hold_covers_the_host_issue_time(monkeypatch):
    """The hold after each flush: the slowest of the call's probe issues on an idle GPU, with margin, capped; and
    the JSON's method says whether it was used."""
    from types import SimpleNamespace

    from cupy_rope import _bench as B

    synced = []
    t = B.Timer.__new__(B.Timer)
    t.cupy = SimpleNamespace(cuda=SimpleNamespace(runtime=SimpleNamespace(deviceSynchronize=lambda: synced.append(1))))
    issue = iter([0.001, 0.003, 0.002])
    clock = {"t": 0.0}

    def fn():
        clock["t"] += next(issue)

    def perf():
        return clock["t"]

    monkeypatch.setattr(B.time, "perf_counter", perf)
    ns = t._hold_ns(fn)
    assert ns == int((0.003 * B.HOLD_FACTOR + B.HOLD_SLACK_S) * 1e9) and len(synced) == B.HOLD_PROBES + 1
    slow = iter([1.0] * B.HOLD_PROBES)
    assert t._hold_ns(lambda: clock.__setitem__("t", clock["t"] + next(slow))) == int(B.HOLD_MAX_S * 1e9)
    t.hold_host = True
    assert "held busy" in t.method()
    t.hold_host = False
    assert "held" not in t.method() and t.method().startswith("median GPU time over flushed repetitions")


def test_benchmark_writes_into_a_folder_it_creates(tmp_path, capsys):
    """The JSON's folder is created when missing (a --out of new/ for any benchmark), and the line says where."""
    from cupy_rope import _bench

    path = tmp_path / "new" / "deeper" / "run.json"
    _bench.write_json(str(path), {"op": "x", "cases": [1]})
    assert json.loads(path.read_text()) == {"op": "x", "cases": [1]}
    assert f"wrote {path}" in capsys.readouterr().out


@pytest.mark.parametrize("op, module, precision", [("rope", "bench_rope", "tf32"),
                                                    ("attention", "bench_attention", "bf16"),
                                                    ("varlen-attention", "bench_varlen", "fp32"),
                                                    ("attention-long", "bench_long", "tf32")])
def test_file_names_follow_the_benchmarks_op(op, module, precision):
    """The file a folder gets is named after the "op" that benchmark writes into its JSON."""
    import importlib

    from cupy_rope.__main__ import json_name

    bench = importlib.import_module(f"cupy_rope.{module}")
    name = json_name(op, precision)
    assert name == (f"{bench.OP}.json" if op == "rope" else f"{bench.OP}_{precision}.json")
