"""The data-parallel layer's host-side parts, without a GPU: the sharding (against a brute-force optimum), the
bucket order, argument checks, and the launcher's process handling (GPU-free ``selftest`` workers that sleep,
fail, ignore SIGTERM or leave a grandchild behind)."""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
import signal
import subprocess
import sys
import time
import types

import numpy as np
import pytest

from cupy_rope.distributed import DataParallelBackward, plan_buckets, sequence_costs, shard_sequences
from cupy_rope.distributed import __main__ as launcher
from cupy_rope.distributed.data_parallel import REDUCED, _Step
from cupy_rope.distributed.group import DistributedError

H, D = 3584, 128
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cu_of(lengths):
    return np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)


def check_tiling(shards, cu, world):
    """Shards in rank order tile [0, T) with whole sequences; local cu_seqlens are the global ones shifted."""
    assert [s.rank for s in shards] == list(range(world))
    assert shards[0].token_start == 0 and shards[-1].token_end == cu[-1]
    pos, i = 0, 0  # token and sequence where the next shard starts
    for s in shards:
        assert s.token_start == pos <= s.token_end
        assert s.cu_seqlens.dtype == np.int32 and s.cu_seqlens[0] == 0 and s.cu_seqlens[-1] == s.tokens
        assert np.array_equal(cu[i:i + s.num_sequences + 1] - s.token_start, s.cu_seqlens)
        pos, i = s.token_end, i + s.num_sequences
    assert i == len(cu) - 1


def brute_force_bottleneck(costs, world):
    n = len(costs)
    prefix = np.concatenate(([0], np.cumsum(costs)))
    best = None
    for cuts in itertools.combinations_with_replacement(range(n + 1), world - 1):
        bounds = (0, *cuts, n)
        worst = max(prefix[b] - prefix[a] for a, b in zip(bounds[:-1], bounds[1:]))
        best = worst if best is None else min(best, worst)
    return best


# ---- cost model -----------------------------------------------------------------------------------------

def test_cost_model_matches_the_spec_gemm_flop_per_token():
    (s,) = shard_sequences([0, 1000], 1, hidden=H, head_dim=D)
    assert s.cost == 22 * 1000 * H * H + 14 * 1000**2 * H
    assert sequence_costs([0, 3, 3, 10], hidden=8).tolist() == [22 * 3 * 8 + 14 * 9, 0, 22 * 7 * 8 + 14 * 49]


# ---- sharding -------------------------------------------------------------------------------------------

def test_many_tiny_sequences_balance_within_one_sequence(np_rng):
    lengths = np_rng.integers(1, 6, 20000)
    cu = cu_of(lengths)
    world = 8
    shards = shard_sequences(cu, world, hidden=H, head_dim=D)
    check_tiling(shards, cu, world)
    costs = sequence_costs(cu, hidden=H) * H
    worst = max(s.cost for s in shards)
    assert worst <= costs.sum() / world + costs.max()  # no worse than the ideal share plus one sequence
    assert all(s.num_sequences > 0 for s in shards)


def test_one_huge_sequence_gets_a_rank_of_its_own():
    cu = cu_of([10, 100_000, 10, 10])
    shards = shard_sequences(cu, 3, hidden=H, head_dim=D)
    check_tiling(shards, cu, 3)
    assert [(s.token_start, s.token_end) for s in shards] == [(0, 10), (10, 100_010), (100_010, 100_030)]


def test_huge_sequence_first_leaves_trailing_ranks_empty():
    cu = cu_of([100_000, 5, 5])
    shards = shard_sequences(cu, 4, hidden=H, head_dim=D)
    check_tiling(shards, cu, 4)
    assert [s.tokens for s in shards] == [100_000, 5, 5, 0]
    s = shards[3]
    assert s.token_start == s.token_end == 100_010 and s.cu_seqlens.tolist() == [0] and s.cost == 0.0


def test_more_ranks_than_sequences_gives_empty_shards():
    cu = cu_of([7, 7, 7])
    shards = shard_sequences(cu, 8, hidden=64, head_dim=64)
    check_tiling(shards, cu, 8)
    assert [s.tokens for s in shards] == [7, 7, 7, 0, 0, 0, 0, 0]
    assert all(s.cu_seqlens.tolist() == [0] for s in shards[3:])


def test_no_sequences_and_only_empty_sequences():
    for cu in ([0], [0, 0, 0]):
        shards = shard_sequences(cu, 3, hidden=64, head_dim=64)
        assert [s.tokens for s in shards] == [0, 0, 0]
        assert all(s.cost == 0.0 for s in shards)
        check_tiling(shards, np.asarray(cu), 3)


def test_empty_sequences_in_between_are_kept():
    cu = cu_of([5, 0, 0, 5, 0])
    shards = shard_sequences(cu, 2, hidden=64, head_dim=64)
    check_tiling(shards, cu, 2)
    assert shards[0].tokens == 5 and shards[1].tokens == 5


def test_deterministic_and_input_type_independent(np_rng):
    cu = cu_of(np_rng.integers(0, 300, 200))
    a = shard_sequences(cu, 5, hidden=H, head_dim=D)
    for other in (cu.astype(np.int64), cu.tolist(), tuple(cu.tolist())):
        assert shard_sequences(other, 5, hidden=H, head_dim=D) == a


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_optimal_against_brute_force(np_rng, world):
    for _ in range(40):
        n = int(np_rng.integers(0, 8))
        lengths = np_rng.integers(0, 400, n)
        if n and np_rng.random() < 0.3:
            lengths[np_rng.integers(0, n)] = 3000  # a long one
        cu = cu_of(lengths)
        hidden = int(np_rng.choice([64, 448, 3584]))
        shards = shard_sequences(cu, world, hidden=hidden, head_dim=64)
        check_tiling(shards, cu, world)
        costs = sequence_costs(cu, hidden=hidden)
        best = brute_force_bottleneck(costs, world) if n else 0
        assert max(s.cost for s in shards) == best * hidden


def test_among_optimal_splits_each_rank_takes_its_share_of_what_is_left():
    shards = shard_sequences(cu_of([10, 10, 10, 10]), 3, hidden=64, head_dim=64)
    assert [s.tokens for s in shards] == [20, 10, 10]  # not [20, 20, 0]: same bottleneck, better spread
    shards = shard_sequences(cu_of([10] * 7), 2, hidden=64, head_dim=64)
    assert [s.tokens for s in shards] == [40, 30]  # ties go to the lower rank


def test_large_batch_is_fast():
    cu = cu_of(np.full(100_000, 97))
    t0 = time.perf_counter()
    shards = shard_sequences(cu, 64, hidden=H, head_dim=D)
    assert time.perf_counter() - t0 < 2.0
    check_tiling(shards, cu, 64)
    counts = [s.num_sequences for s in shards]
    assert counts == [1563] * 32 + [1562] * 32  # the optimum (1563), spread evenly, lower ranks first


def test_seed_batches_split_evenly():
    from cupy_rope.distributed._batch import cu_from_lengths, short_lengths

    cu = cu_from_lengths(short_lengths())
    assert len(cu) == 65 and 11_000 < cu[-1] < 12_200
    a, b = shard_sequences(cu, 2, hidden=H, head_dim=D)
    assert abs(a.cost - b.cost) / (a.cost + b.cost) < 0.02
    a, b = shard_sequences(cu_from_lengths([1024] * 16), 2, hidden=H, head_dim=D)
    assert a.tokens == b.tokens == 8192


def test_shard_is_frozen_and_its_cu_seqlens_read_only():
    (s,) = shard_sequences([0, 4], 1, hidden=64, head_dim=64)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.rank = 3
    with pytest.raises(ValueError):
        s.cu_seqlens[0] = 1
    assert s.rows() == slice(0, 4)


@pytest.mark.parametrize("cu, err, match", [
    (np.zeros((2, 2), np.int32), ValueError, "1-D"),
    (np.array([], np.int32), ValueError, "at least one"),
    (np.array([1, 4], np.int32), ValueError, "start at 0"),
    (np.array([0, 5, 3], np.int32), ValueError, r"non-decreasing.*cu_seqlens\[2\] = 3"),
    (np.array([0.0, 4.0]), TypeError, "integers"),
    (np.array([0, 2**31], np.int64), ValueError, "int32"),
    (np.array([0, 2**31 - 1], np.int64), ValueError, "int64 sums would overflow"),  # 14 L^2 alone passes 2^63
])
def test_bad_cu_seqlens(cu, err, match):
    with pytest.raises(err, match=match):
        shard_sequences(cu, 2, hidden=64, head_dim=64)


@pytest.mark.parametrize("kw, err, match", [
    (dict(world_size=0), ValueError, "world_size must be a positive int"),
    (dict(world_size=-2), ValueError, "world_size"),
    (dict(world_size=2.0), TypeError, "world_size"),
    (dict(world_size=True), TypeError, "world_size"),
    (dict(hidden=0), ValueError, "hidden"),
    (dict(head_dim=None), TypeError, "head_dim"),
    (dict(hidden=100, head_dim=64), ValueError, "multiple of head_dim"),
])
def test_bad_sizes(kw, err, match):
    args = dict(world_size=2, hidden=128, head_dim=64) | kw
    with pytest.raises(err, match=match):
        shard_sequences([0, 3], args.pop("world_size"), **args)


# ---- buckets --------------------------------------------------------------------------------------------

def test_buckets_projection_first_then_qkv():
    q, k, v = (f"grad_qkv_weight[{i}]" for i in range(3))
    # H = 3584: a q/k/v block is 51.4 MB, so each gets its own 64 MiB bucket (the bias joins the first)
    assert plan_buckets(H) == (("grad_proj_weight", "grad_proj_bias"), ("grad_qkv_bias", q), (k,), (v,))
    assert plan_buckets(448) == (("grad_proj_weight", "grad_proj_bias"), ("grad_qkv_bias", q, k, v))
    assert plan_buckets(H, bucket_bytes=1 << 30)[1] == ("grad_qkv_bias", q, k, v)


@pytest.mark.parametrize("hidden", [448, H])
def test_buckets_issue_in_one_order_whatever_order_outputs_arrive(hidden):
    buckets = plan_buckets(hidden)
    for order in itertools.permutations(REDUCED):
        step, issued = _Step(buckets), []
        for name in order:
            issued += [tuple(arrays) for arrays in step.mark(name, name)]
        assert issued == [tuple(b) for b in buckets] and step.done


def test_data_parallel_backward_checks_its_arguments():
    with pytest.raises(ValueError, match="precision"):
        DataParallelBackward(object(), hidden=128, head_dim=64, precision="fp16")
    with pytest.raises(TypeError, match="precision must be a Precision"):
        DataParallelBackward(object(), hidden=128, head_dim=64, precision=1)
    with pytest.raises(TypeError, match="head_dim must be an integer"):
        DataParallelBackward(object(), hidden=128, head_dim=64.0)
    with pytest.raises(ValueError, match="hidden must be at least 1"):
        DataParallelBackward(object(), hidden=0, head_dim=64)
    with pytest.raises(ValueError, match="multiple of head_dim"):
        DataParallelBackward(object(), hidden=100, head_dim=64)
    with pytest.raises(ValueError, match="num_heads"):
        DataParallelBackward(object(), hidden=128, head_dim=64, num_heads=3)
    with pytest.raises(TypeError, match="num_heads must be an integer"):  # not truncated to 2
        DataParallelBackward(object(), hidden=128, head_dim=64, num_heads=2.9)
    with pytest.raises(ValueError, match="scaling must be finite"):
        DataParallelBackward(object(), hidden=128, head_dim=64, scaling=float("nan"))
    with pytest.raises(TypeError, match="scaling must be a real number"):
        DataParallelBackward(object(), hidden=128, head_dim=64, scaling="0.125")
    with pytest.raises(TypeError, match="ProcessGroup"):
        DataParallelBackward(object(), hidden=128, head_dim=64)


def test_data_parallel_backward_takes_a_precision_member(host_only):
    """A Precision, as the single-GPU calls take, given to the backward as its label."""
    from cupy_rope import Precision

    for given, label in ((Precision.BF16, "bf16"), (Precision.TF32, "tf32"), ("fp32", "fp32")):
        dp = DataParallelBackward(_recording_group([0]), hidden=8, head_dim=4, precision=given,
                                  backward=lambda *a, **k: None)
        assert dp.precision == label


def test_init_without_nccl_names_the_extra():
    pytest.importorskip("cupy")
    from cupy.cuda import nccl

    from cupy_rope.distributed import NCCLUnavailableError, init

    if nccl.available:
        pytest.skip("NCCL is available here: the missing-NCCL message cannot be shown")
    with pytest.raises(NCCLUnavailableError, match=r'pip install "cupy-rope\[distributed-cuda12\]"') as e:
        init(world_size=1, rank=0)
    assert isinstance(e.value, ImportError) and isinstance(e.value, RuntimeError)


# ---- a failing rank keeps the peers' order of collectives (host side, CuPy stubbed) ---------------------

class _HostStream:
    ptr = 1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def wait_event(self, event):
        pass


class _HostEvent:
    ptr = 2

    def __init__(self, **kwargs):
        pass

    def record(self, stream=None):
        pass


@pytest.fixture
def host_only(monkeypatch):
    """Just enough of CuPy for the data-parallel layer's control flow on the host: streams, events and the
    runtime calls do nothing, arrays are NumPy."""
    import contextlib
    import types

    cuda = types.SimpleNamespace(Device=lambda device: contextlib.nullcontext(), Event=_HostEvent,
                                 get_current_stream=_HostStream, Stream=_HostStream)
    cupy = types.SimpleNamespace(cuda=cuda, zeros=np.zeros, ndarray=np.ndarray)
    runtime = types.SimpleNamespace(eventRecord=lambda *a: None, streamWaitEvent=lambda *a: None)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy_backends.cuda.api", types.SimpleNamespace(runtime=runtime))
    from cupy_rope import _checks

    monkeypatch.setattr(_checks, "_cupy", None)  # the stand-in is cached there for this test only


def _recording_group(peer_codes, fail_bucket=None):
    """A one-rank stand-in for ProcessGroup that logs the collectives it is asked for, in order: the status
    exchange answers with ``peer_codes[call]`` or'ed in, a failing ``all_reduce_`` on bucket ``fail_bucket``."""
    from cupy_rope.distributed.group import ProcessGroup

    class Group(ProcessGroup):
        def __init__(self):
            self.rank, self.world_size, self.device = 0, 2, 0
            self.closed = self.failed = False
            self.stream = _HostStream()
            self.log, self.pending, self.calls, self.buckets = [], 0, 0, 0

        def host_all_reduce_start(self, values, op="sum"):
            assert self.pending == 0, "a status exchange was posted while the last one was still unread"
            self.pending += 1
            self.log.append(("status", int(values[0])))
            codes = np.array(values, copy=True)
            codes[1] = peer_codes[self.calls]
            self.calls += 1
            return codes

        def host_all_reduce_finish(self, pending):
            self.pending -= 1
            self.log.append(("status read",))
            return pending

        def host_all_reduce(self, values, op="sum"):
            self.log.append(("messages",))
            return values

        def all_reduce_(self, arrays, op="sum"):
            self.log.append(("bucket", len(arrays)))  # every attempt, before the open check refuses it
            self._require_open()
            self.buckets += 1
            if self.buckets == fail_bucket:
                raise RuntimeError("NCCL error (stand-in)")

        def abort(self):
            self.closed = True
            self.log.append(("abort",))

    return Group()


def _outputs(t, hidden):
    return tuple(np.ones(s, np.float32) for s in [(t, hidden), (3 * hidden, hidden), (3 * hidden,),
                                                  (hidden, hidden), (hidden,)])


def test_one_group_per_backend(host_only, monkeypatch):
    """Layers built from one caller's NCCLBackend share one ProcessGroup (one stream, so one order of the
    communicator's collectives); another backend, or a closed group, gets a new one."""
    from cupy_rope.distributed import data_parallel

    monkeypatch.setattr(sys.modules["cupy"].cuda, "runtime", types.SimpleNamespace(getDevice=lambda: 0),
                        raising=False)

    class Group:
        def __init__(self, backend, rank, world_size, device):
            self.closed = False

    monkeypatch.setattr(data_parallel, "ProcessGroup", Group)

    def backend():
        return types.SimpleNamespace(_comm=object(), rank=0, _n_devices=2)

    one, two = backend(), backend()
    first = data_parallel._wrap_backend(one)
    assert data_parallel._wrap_backend(one) is first
    assert data_parallel._wrap_backend(two) is not first
    first.closed = True
    assert data_parallel._wrap_backend(one) is not first


def test_all_reduce_gradients_checks_every_array_before_a_bucket(host_only, monkeypatch):
    """A gradient refused in a later bucket (a float64 bias, a layer of another width, a short tuple) is refused
    before the first bucket goes out: the peers never pair collectives this rank does not send. Good gradients
    send every bucket."""
    from cupy_rope import _checks

    monkeypatch.setattr(_checks, "require_cupy", lambda x, name, dev=None: 0)  # NumPy arrays stand in
    group = _recording_group([0])
    dp = DataParallelBackward(group, hidden=8, head_dim=4, bucket_bytes=64, backward=lambda *a, **k: None)
    assert len(dp.buckets) > 2
    good = _outputs(4, 8)
    bad_bias = good[:2] + (np.ones(24, np.float64),) + good[3:]
    other_layer = good[:3] + (np.ones((16, 16), np.float32),) + good[4:]
    for grads, err, match in ((bad_bias, TypeError, "grad_qkv_bias must have dtype float32"),
                              (other_layer, ValueError, r"grad_proj_weight must have shape \(8, 8\)"),
                              (good[:4], TypeError, "grads must be the backward's 5 gradients")):
        with pytest.raises(err, match=match):
            dp.all_reduce_gradients(grads)
        assert group.log == [], group.log
    assert dp.all_reduce_gradients(good) is good
    assert group.log == [("bucket", len(b)) for b in dp.buckets]


@pytest.mark.parametrize("peer_code", [0, 1])
def test_failed_backward_reads_its_status_and_reports_next_call(host_only, peer_code):
    """A backward that raises after the status exchange was posted: this rank still sends every bucket (zeros),
    then reads its status exchange before raising (a peer's refused inputs start the message exchange, which it
    joins after the buckets, as the peers do), and the next call's status word says the previous call failed."""
    group = _recording_group([peer_code, 0])
    calls = []

    def backward(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise MemoryError("out of memory (stand-in)")
        return _outputs(4, 8)

    dp = DataParallelBackward(group, hidden=8, head_dim=4, backward=backward)
    dp._check_inputs = lambda *args: args[8]  # the inputs pass; cu_seqlens comes back as given
    buckets = [("bucket", len(b)) for b in plan_buckets(8)]
    with pytest.raises(MemoryError, match="stand-in"):
        dp(*([None] * 9))
    assert group.log == [("status", 0), *buckets, ("status read",), *([("messages",)] if peer_code else [])]
    del group.log[:]
    with pytest.raises(DistributedError, match=r"previous call failed during the backward \(MemoryError"):
        dp(*([None] * 9))
    assert group.log[0] == ("status", 2), "the next call did not report the failed one"


def test_a_bad_stream_is_refused_with_the_inputs(host_only):
    """A ``stream=`` that is not a stream fails on that rank alone: it is refused before the collectives, through
    the status exchange (the peers hear of it in the same call), with the TypeError naming it; the backward is
    not called."""
    group = _recording_group([0])
    calls = []
    dp = DataParallelBackward(group, hidden=8, head_dim=4, backward=lambda *a, **k: calls.append(1))
    with pytest.raises(TypeError, match="stream must be a cupy.cuda.Stream"):
        dp(*([None] * 9), stream=123)
    assert not calls and group.log[0] == ("status", 1) and ("status read",) in group.log


def test_the_backward_gets_the_host_cu_seqlens_the_check_read(host_only):
    """With the check on, a device cu_seqlens is read back once, by the check, and the backward gets that host
    copy rather than reading the device array again."""
    got = []
    dp = DataParallelBackward(_recording_group([0]), hidden=8, head_dim=4,
                              backward=lambda *a, **k: got.append(a[8]) or _outputs(4, 8))
    host = np.array([0, 4], np.int32)
    dp._check_inputs = lambda *args: host
    dp(*([None] * 8), "device cu_seqlens")
    assert got == [host]


def test_without_the_check_the_backward_gets_the_stream_as_given(host_only):
    """check=False: no status exchange, so the backward itself sees (and refuses) the caller's stream."""
    got = []
    dp = DataParallelBackward(_recording_group([0]), hidden=8, head_dim=4, check=False,
                              backward=lambda *a, **k: got.append(k["stream"]) or _outputs(4, 8))
    dp(*([None] * 9), stream=123)
    assert got == [123]


def test_failed_collective_aborts_instead_of_pairing_the_wrong_ones(host_only):
    """An all-reduce that fails on this rank leaves its bucket counted as issued: the communicator is aborted
    (the peers then stop at their timeout) rather than the next bucket sent in its place."""
    group = _recording_group([0], fail_bucket=1)
    dp = DataParallelBackward(group, hidden=8, head_dim=4, backward=lambda *a, **k: _outputs(4, 8))
    dp._check_inputs = lambda *args: args[8]  # the inputs pass; cu_seqlens comes back as given
    with pytest.raises(RuntimeError, match="NCCL error"):
        dp(*([None] * 9))
    assert group.failed and group.closed and group.buckets == 1
    after = group.log[group.log.index(("abort",)):]
    assert not any(entry[0] == "bucket" for entry in after), "a later bucket was sent after the failure"


# ---- launcher: arguments and environment ----------------------------------------------------------------

def test_launcher_arguments():
    a = launcher.parse_args(["--nproc", "2", "bench", "--precision", "bf16", "--out", "x.json"])
    assert (a.nproc, a.subcommand, a.args, a.port, a.grace) == (2, "bench", ["--precision", "bf16", "--out",
                                                                             "x.json"], None, 10.0)
    a = launcher.parse_args(["--nproc", "4", "--port", "29500", "--timeout", "30", "run", "train.py", "--lr", "1"])
    assert (a.port, a.timeout, a.args) == (29500, 30.0, ["train.py", "--lr", "1"])
    for bad in (["bench"], ["--nproc", "0", "bench"], ["--nproc", "2", "run"], ["--nproc", "2", "nope"],
                ["--nproc", "2", "--port", "70000", "bench"], ["--nproc", "2", "--grace", "-1", "bench"],
                ["--nproc", "2", "--grace", "nan", "bench"], ["--nproc", "2", "--grace", "inf", "bench"],
                ["--nproc", "2", "--timeout", "0", "bench"], ["--nproc", "2", "--timeout", "-1", "bench"],
                ["--nproc", "2", "--timeout", "nan", "bench"]):
        with pytest.raises(SystemExit):
            launcher.parse_args(bad)


def test_child_environment_forces_nvls_off_and_keeps_a_chosen_algorithm():
    env = launcher.child_env(1, 4, "127.0.0.1", 29500, base={"NCCL_NVLS_ENABLE": "1", "PATH": "/bin"})
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["NCCL_ALGO"] == "Ring" and env["PATH"] == "/bin"
    assert (env["CUPY_ROPE_RANK"], env["CUPY_ROPE_WORLD_SIZE"], env["CUPY_ROPE_LOCAL_RANK"]) == ("1", "4", "1")
    assert (env["CUPY_ROPE_MASTER_PORT"], env["CUPYX_DISTRIBUTED_PORT"], env["RANK"]) == ("29500", "29500", "1")
    assert launcher.child_env(0, 1, "h", 1, base={"NCCL_ALGO": "Tree"})["NCCL_ALGO"] == "Tree"
    assert 0 < launcher.free_port() < 65536


# ---- launcher: processes (GPU-free workers) -------------------------------------------------------------

def launch(*args, env=None, timeout=60):
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "cupy_rope.distributed", *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=timeout, env=env)
    return p, time.monotonic() - t0


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_launcher_success_every_rank_gets_its_environment(tmp_path):
    env = dict(os.environ, NCCL_NVLS_ENABLE="1")
    p, dt = launch("--nproc", "3", "selftest", "--env-out", str(tmp_path), "--sleep", "0.2", env=env)
    assert p.returncode == 0, p.stderr
    for r in range(3):
        e = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert (e["CUPY_ROPE_RANK"], e["CUPY_ROPE_WORLD_SIZE"], e["NCCL_NVLS_ENABLE"]) == (str(r), "3", "0")
        assert e["pgid"] == e["pid"]  # each rank leads its own process group
    assert dt < 20


def test_launcher_stops_siblings_when_a_rank_fails():
    p, dt = launch("--nproc", "3", "--grace", "2", "selftest", "--fail-rank", "1", "--sleep", "300")
    assert p.returncode == 3
    assert "rank 1 failed (exit status 3)" in p.stderr and "stopping rank(s) 0, 2" in p.stderr
    assert dt < 20


def test_launcher_kills_ranks_that_ignore_sigterm():
    p, dt = launch("--nproc", "2", "--grace", "1", "selftest", "--fail-rank", "0", "--sleep", "300",
                   "--ignore-term")
    assert p.returncode == 3 and "rank 0 failed" in p.stderr
    assert dt < 20


def test_launcher_kills_processes_a_rank_left_behind(tmp_path):
    p, dt = launch("--nproc", "2", "--grace", "1", "selftest", "--straggler", "--env-out", str(tmp_path))
    assert p.returncode == 0, p.stderr
    assert "left processes running" in p.stderr
    for r in range(2):
        pid = int((tmp_path / f"straggler{r}.pid").read_text())
        deadline = time.monotonic() + 5
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid)
    assert dt < 20


def test_launcher_timeout():
    p, dt = launch("--nproc", "2", "--grace", "1", "--timeout", "1", "selftest", "--sleep", "300")
    assert p.returncode == 124 and "timed out after 1 s" in p.stderr
    assert dt < 20


def test_launcher_terminated_takes_its_ranks_down(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "cupy_rope.distributed", "--nproc", "2", "--grace", "1",
                             "selftest", "--sleep", "300", "--env-out", str(tmp_path)], cwd=ROOT,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while len(list(tmp_path.glob("rank*.json"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = [json.loads((tmp_path / f"rank{r}.json").read_text())["pid"] for r in range(2)]
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 128 + signal.SIGTERM and "received SIGTERM" in err
    assert not any(_alive(pid) for pid in pids)


def test_launcher_run_reports_the_failing_rank_of_a_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import os, sys, time\n"
                      "rank = int(os.environ['CUPY_ROPE_RANK'])\n"
                      "sys.stdout.write(f'hello from {rank} {sys.argv[1:]}\\n')  # one write: lines never mix\n"
                      "sys.stdout.flush()\n"
                      "if rank == 1:\n"
                      "    time.sleep(1)  # rank 0 has printed before rank 1 fails\n"
                      "    raise ValueError('bad batch on purpose')\n"
                      "time.sleep(300)\n")
    p, dt = launch("--nproc", "2", "--grace", "1", "run", str(script), "--flag", "x")
    assert p.returncode == 1
    assert "hello from 0 ['--flag', 'x']" in p.stdout
    assert "rank 1: failed" in p.stderr and "ValueError: bad batch on purpose" in p.stderr
    assert "failed: rank 1 (exit status 1)" in p.stderr
    assert dt < 30


def test_launcher_run_script_success_and_exit_code(tmp_path):
    script = tmp_path / "ok.py"
    script.write_text("import sys\nsys.exit(0)\n")
    p, _ = launch("--nproc", "2", "run", str(script))
    assert p.returncode == 0, p.stderr
    script.write_text("import os, sys\nsys.exit(5 if os.environ['CUPY_ROPE_RANK'] == '0' else 0)\n")
    p, _ = launch("--nproc", "2", "--grace", "1", "run", str(script))
    assert p.returncode == 5 and "rank 0" in p.stderr


# ---- cupyx's rendezvous store is stopped (no GPU needed: it is a plain TCP server process) ---------------

STORE_SCRIPT = """
import sys, types
from cupyx.distributed import _store
from cupy_rope.distributed import group
port = int(sys.argv[1])
store = _store.TCPStore(1)
store.run('127.0.0.1', port)
proxy = _store.TCPStoreProxy('127.0.0.1', port)
proxy['k'] = 7
assert proxy['k'] == 7
proxy.barrier()
if sys.argv[2] == 'stop':
    group._stop_store(types.SimpleNamespace(_store=store))
    assert store._process is None
print('done', flush=True)
"""


def test_rendezvous_store_is_stopped_so_the_process_exits():
    pytest.importorskip("cupyx")
    p = subprocess.run([sys.executable, "-W", "ignore", "-c", STORE_SCRIPT, str(launcher.free_port()), "stop"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "done" in p.stdout, p.stderr


def test_rendezvous_store_left_running_keeps_the_process_alive():
    """The problem the stop solves: cupyx's store outlives the script and the interpreter never exits."""
    pytest.importorskip("cupyx")
    proc = subprocess.Popen([sys.executable, "-W", "ignore", "-c", STORE_SCRIPT, str(launcher.free_port()), "keep"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "done"  # the script itself has finished ...
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=4)  # ... but the interpreter does not exit
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


def test_init_again_returns_the_group_or_refuses_other_arguments(monkeypatch):
    from cupy_rope.distributed import group as G

    joined = types.SimpleNamespace(world_size=2, rank=0, device=0, closed=False)
    monkeypatch.setattr(G, "_group", joined)
    assert G.init() is joined and G.init(world_size=2, rank=0, device=0) is joined
    for kw in (dict(world_size=4), dict(rank=1), dict(device=1)):
        with pytest.raises(ValueError, match="already joined a group with world_size 2, rank 0, device 0"):
            G.init(**kw)
