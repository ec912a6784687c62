"""Phase timing of one backward: CUDA events recorded at the schedule's phase boundaries (its ``hook``), on one
stream (a serial plan), so each phase's time is its own."""
from __future__ import annotations

import dataclasses
import statistics

from .. import _checks as C
from . import api
from . import varlen as _varlen


def profile_split(timer, grad_output, hidden_states, qkv_weight, qkv_bias, proj_weight, proj_bias, cos, sin,
                  cu_seqlens, attention_dropout=0.0, scaling=None, *, num_heads=None, precision="tf32", reps=5,
                  plan=None):
    """GPU µs of each phase of one backward (dict phase -> µs, plus totals "cublas" and "kernels"), median over
    ``reps`` calls; ``plan`` as for :func:`cupy_rope.vision_attention_backward` (made serial here). ``timer`` is
    accepted for symmetry with the bench's other measurements and not used: the events time the phases."""
    import cupy

    p, t, h, nh, d = api.validate(grad_output, hidden_states, qkv_weight, qkv_bias, proj_weight, proj_bias, cos,
                                  sin, cu_seqlens, attention_dropout, num_heads, precision)
    scaling = C.attention_scaling(scaling, d)
    s = cupy.cuda.get_current_stream()
    vl = _varlen.resolve(_varlen.read_async(cu_seqlens, s.ptr), t)
    serial = dataclasses.replace(api.choose_plan(p, d, vl, plan), concurrent=False)
    runs = []
    for _ in range(reps):
        events = []

        def probe(label):
            ev = cupy.cuda.Event()
            ev.record(s)
            events.append((label, ev))

        api.run_backward(grad_output, hidden_states, qkv_weight, qkv_bias, proj_weight, cos, sin, vl.cu, t, h, nh,
                         d, scaling, p, s.ptr, plan=serial, hook=probe)
        if not events:
            return {"cublas": 0.0, "kernels": 0.0}
        events[-1][1].synchronize()
        phases: dict = {}
        for (_, e0), (label, e1) in zip(events[:-1], events[1:]):
            phases[label] = phases.get(label, 0.0) + cupy.cuda.get_elapsed_time(e0, e1) * 1e3
        runs.append(phases)
    out = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    out["cublas"] = sum(v for k, v in out.items() if k.startswith("gemm"))
    out["kernels"] = sum(v for k, v in out.items() if not k.startswith("gemm") and k != "cublas")
    return out

