"""Benchmark of rope_2d_backward over the built-in workloads (see README, "Benchmark")."""
from __future__ import annotations

import math
import sys

import numpy as np

from . import _bench as B
from . import _checks as C
from . import reference
from .rope import rope_2d_backward
from .workloads import ROPE_CASES, ROPE_HEAD_DIM, rope_theta

OP = "rope_2d_backward"  # the JSON's "op"; the file in bench/results is <OP>.json

TOL = 2e-6


def floor_us(nbytes: int, copy_TBps: float, same_bytes_us: float) -> float:
    """A case's floor: its bytes at the copy rate, or, where the op is too small to reach that
    rate, a device copy of the same bytes timed the same way (never the empty kernel)."""
    return max(nbytes / copy_TBps / 1e6, same_bytes_us)


def _inputs(batch, seq, rng):
    import cupy

    shape = (batch, seq, ROPE_HEAD_DIM)
    gc = rng.standard_normal(shape, dtype=np.float32).astype(C.BF16)
    gs = rng.standard_normal(shape, dtype=np.float32).astype(C.BF16)
    th = cupy.asarray(rope_theta(batch, seq))
    return gc, gs, th


_TORCH_FNS: dict = {}


def _torch_fns(torch):
    """PyTorch eager and torch.compile versions of the formula, built once (one dynamic-shape compile)."""
    if not _TORCH_FNS:
        def eager(a, b, t):
            return -a.float() * torch.sin(t) + b.float() * torch.cos(t)

        _TORCH_FNS["torch_eager"] = eager
        _TORCH_FNS["torch_compile"] = torch.compile(eager, dynamic=True)
    return _TORCH_FNS


def _peers(gc, gs, th):
    import cupy

    peers = {"cupy_composed": lambda: -gc.astype(np.float32) * cupy.sin(th) + gs.astype(np.float32) * cupy.cos(th)}
    torch = B.torch_or_none()
    if torch is not None:
        tgc = torch.from_dlpack(gc.view(np.uint16)).view(torch.bfloat16)
        tgs = torch.from_dlpack(gs.view(np.uint16)).view(torch.bfloat16)
        tth = torch.from_dlpack(th)
        for name, f in _torch_fns(torch).items():
            peers[name] = (lambda f=f: f(tgc, tgs, tth))
    return peers


def run(out_path: str | None = None, reps: int = 100, peers: bool = True, cases=None,
        hold_host: bool = True) -> int:
    import cupy

    timer = B.Timer(hold_host)
    info = B.device_info()
    empty_us = B.empty_kernel_us(timer)
    copy = B.copy_TBps(timer)
    print(f"# rope_2d_backward on {info['device']}: copy {copy:.3f} TB/s, empty kernel {empty_us:.2f} us (GPU)")
    rng = cupy.random.default_rng(1234)
    rows, failed = [], 0
    hdr = (f"{'batch':>5} {'seq':>5} {'gpu_us':>8} {'host_us':>7} {'floor_us':>8} {'copy_us':>7} {'TB/s':>6} "
           f"{'%copy':>6} {'/floor':>6} {'/copy':>6} {'max_rel_err':>11}  peers (us, ratio peer/ours)")
    print(hdr)
    for i, (batch, seq) in enumerate(ROPE_CASES):
        if cases is not None and i not in cases:
            continue
        gc, gs, th = _inputs(batch, seq, rng)
        out = cupy.full(th.shape, np.nan, dtype=np.float32)
        rope_2d_backward(gc, gs, th, out=out)
        err = B.rel_err(out, reference.rope_2d_backward(gc.astype(np.float64), gs.astype(np.float64), th))
        ok = err <= TOL
        failed += not ok
        n = th.size
        nbytes = 12 * n
        gpu = timer.gpu_us(lambda: rope_2d_backward(gc, gs, th, out=out), reps=reps)
        host = timer.host_us(lambda: rope_2d_backward(gc, gs, th, out=out), n=200 if n < 1 << 22 else 20)
        same_bytes = B.copy_us(timer, max(1, nbytes // 2), reps=50)  # the op's bytes: half read, half written
        floor = floor_us(nbytes, copy, same_bytes)
        again = cupy.full(th.shape, np.nan, dtype=np.float32)
        rope_2d_backward(gc, gs, th, out=again)
        deterministic = B.same_bits(again, out)  # out: the last timed call's
        again = None
        peer_us = {}
        if peers:
            for name, fn in _peers(gc, gs, th).items():
                peer_us[name] = round(timer.gpu_us(fn, reps=max(10, reps // 2)), 3)
        row = {"shape": [batch, seq, ROPE_HEAD_DIM], "gpu_us": round(gpu, 3), "host_us": round(host, 3),
               "floor_us": round(floor, 3), "copy_same_bytes_us": round(same_bytes, 3),
               "achieved_TBps": round(nbytes / gpu / 1e6, 4),
               "fraction_of_copy_rate": round(nbytes / gpu / 1e6 / copy, 4), "peers_us": peer_us,
               "max_rel_error": err, "correct": ok, "deterministic": deterministic}
        rows.append(row)
        ptxt = "  ".join(f"{k} {v:.1f} ({v / gpu:.2f}x)" for k, v in peer_us.items())
        print(f"{batch:>5} {seq:>5} {gpu:>8.2f} {host:>7.2f} {floor:>8.2f} {same_bytes:>7.2f} "
              f"{row['achieved_TBps']:>6.3f} {100 * row['fraction_of_copy_rate']:>5.1f}% {gpu / floor:>6.2f} "
              f"{gpu / same_bytes:>6.2f} {err:>11.2e}  {ptxt}"
              + ("" if ok else "  FAILED"))
        sys.stdout.flush()
    mean, geo = B.summarize(rows)
    geo_floor = math.exp(sum(math.log(r["gpu_us"] / r["floor_us"]) for r in rows) / len(rows))
    geo_copy = math.exp(sum(math.log(r["gpu_us"] / r["copy_same_bytes_us"]) for r in rows) / len(rows))
    print(f"mean {mean:.2f} us, geomean {geo:.2f} us, geomean gpu/floor {geo_floor:.3f}, "
          f"geomean gpu/copy of the same bytes {geo_copy:.3f}")
    B.print_peer_summary(rows)
    payload = {"op": OP, "device": info["device"], "env": info,
               "ceilings": {"copy_TBps": copy, "empty_kernel_gpu_us": empty_us},
               "method": timer.method(),
               "cases": rows, "mean_gpu_us": mean, "geomean_gpu_us": geo, "geomean_gpu_over_floor": geo_floor,
               "geomean_gpu_over_copy_same_bytes": geo_copy}
    if out_path:
        B.write_json(out_path, payload)
    return 1 if failed else 0
