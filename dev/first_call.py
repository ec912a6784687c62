"""How long does a first call wait for its kernels? Each kind of call runs in a process of its own with empty
kernel caches (CUPY_ROPE_CACHE_DIR, CuPy's CUPY_CACHE_DIR and the driver's CUDA_CACHE_PATH, which NVRTC reads and
writes too, each in a fresh folder), so everything it launches is compiled there: the wall time of its first
call, then of a second (the kernels built), the difference, how many sm_90a cubins the process compiled for how
many sm_90a kernels, and its NVRTC compiles (each part of the sm_90a module, and what CuPy compiled, by
options; seconds). With --module (and --path), the same for another tree's library (e.g. the previous code kept
under .old/base as package cupy_rope_base by dev/snapshot.sh), each kind in turn.

    python dev/first_call.py [--kinds varlen-bf16,varlen-tf32,block-bf16,block-tf32] [--path .old/base
                             --module cupy_rope_base] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import common

KINDS = ("varlen-bf16", "varlen-tf32", "block-bf16", "block-tf32")

# The child: one kind of call, timed on the host around a device synchronisation (compiles are host work).
CHILD = r"""
import json, sys, time
sys.path[:0] = [p for p in {paths!r} if p]
import importlib
import cupy
cr = importlib.import_module({module!r})
kind = {kind!r}
hop = importlib.import_module({module!r} + ".attention.hopper")
asked, kernel = set(), hop._kernel
hop._kernel = lambda name, *a, **kw: asked.add(name) or kernel(name, *a, **kw)
kmod = importlib.import_module({module!r} + "._kernels")
compiles, compile_for_arch = [], kmod.compile_for_arch


def timed_compile(module, arch, options=kmod.OPTIONS):
    t0 = time.perf_counter()
    try:
        return compile_for_arch(module, arch, options)
    finally:
        part = [o for o in options if o.startswith("-DHOP_PART=")]
        compiles.append([module, part[0].split("_PART_")[-1] if part else "whole", time.perf_counter() - t0])


kmod.compile_for_arch = timed_compile
# CuPy's own NVRTC compiles (the mma.sync attention, RoPE and utility modules, CuPy's elementwise kernels)
import cupy.cuda.compiler as cc
cupy_compile = cc._compile_using_nvrtc_no_warning


def timed_cupy_compile(source, options=(), *a, **kw):
    t0 = time.perf_counter()
    try:
        return cupy_compile(source, options, *a, **kw)
    finally:
        tags = [o for o in options if o.startswith(("-DATTN_MODES=", "-DATTN_HEAD_DIM="))]
        label = ("library " + " ".join(tags)) if any(o.startswith("-DMODE_") for o in options) else "cupy"
        compiles.append(["cupy nvrtc", label, time.perf_counter() - t0])


cc._compile_using_nvrtc_no_warning = timed_cupy_compile
rng = cupy.random.default_rng(0)
if kind.startswith("varlen"):
    p = kind.split("-")[1]
    t, nh, d = 2048, 8, 128
    cu = __import__("numpy").array([0, 1024, 2048], "int32")
    q, k, v, g = (rng.standard_normal((t, nh, d), dtype="float32") for _ in range(4))

    def call():
        o, lse = cr.varlen_attention_forward(q, k, v, cu, precision=p)
        return cr.varlen_attention_backward(g, q, k, v, o, lse, cu, precision=p)
else:
    from cupy_rope.workloads import ATTN_HIDDEN, ATTN_HEAD_DIM
    p = kind.split("-")[1]
    t, h, d = 2048, ATTN_HIDDEN, ATTN_HEAD_DIM
    cu = __import__("numpy").array([0, 1024, 2048], "int32")
    x, dy = (rng.standard_normal((t, h), dtype="float32") for _ in range(2))
    wqkv, bqkv = 0.02 * rng.standard_normal((3 * h, h), dtype="float32"), rng.standard_normal(3 * h, dtype="float32")
    wp, bp = 0.02 * rng.standard_normal((h, h), dtype="float32"), rng.standard_normal(h, dtype="float32")
    cos, sin = rng.standard_normal((t, d), dtype="float32"), rng.standard_normal((t, d), dtype="float32")

    def call():
        return cr.vision_attention_backward(dy, x, wqkv, bqkv, wp, bp, cos, sin, cu, precision=p)
out = []
for _ in range(2):
    t0 = time.perf_counter()
    call()
    cupy.cuda.runtime.deviceSynchronize()
    out.append(time.perf_counter() - t0)
import os
cache = os.environ["CUPY_ROPE_CACHE_DIR"]
print(json.dumps({{"times": out, "cubins": len(os.listdir(cache)) if os.path.isdir(cache) else 0,
                  "sm90_kernels": sorted(asked), "compiles": compiles}}))
"""


def run(kind: str, module: str, path: str | None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        # NVRTC (CUDA 12.9 and later) keeps what it compiles in the driver's compute cache where a driver is
        # loaded (CUDA_CACHE_PATH, ~/.nv/ComputeCache by default), shared by every process: the child gets one
        # of its own too, else a module another process compiled before reads as compiled in no time.
        env = dict(os.environ, CUPY_ROPE_CACHE_DIR=os.path.join(tmp, "cupy_rope"),
                   CUPY_CACHE_DIR=os.path.join(tmp, "cupy"), CUDA_CACHE_PATH=os.path.join(tmp, "nv"))
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        paths = [os.path.abspath(path) if path else None, here]
        code = CHILD.format(paths=paths, module=module, kind=kind)
        res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
        if res.returncode:
            raise SystemExit(f"{module} {kind}: the child failed\n{res.stderr[-3000:]}")
        return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--json", default=None, help="write the times as JSON")
    common.add_library_args(ap, "another tree's library, timed as well")
    a = ap.parse_args(argv)
    kinds = a.kinds.split(",")
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise SystemExit(f"--kinds: unknown {bad}; known {KINDS}")
    libs = [("cupy_rope", None)] + ([(a.module, a.path)] if a.module else [])
    rows = []
    for kind in kinds:
        for module, path in libs:
            got = run(kind, module, path)
            first, second = got["times"]
            rows.append({"kind": kind, "library": module, "first_s": first, "second_s": second,
                         "cubins": got["cubins"], "sm90_kernels": got["sm90_kernels"],
                         "compiles": got["compiles"]})
            print(f"{kind:12s} {module:15s} first call {first:6.2f} s, second {second:6.3f} s, "
                  f"waiting for kernels ~{first - second:6.2f} s; sm_90a cubins compiled {got['cubins']}, "
                  f"kernels {len(got['sm90_kernels'])}", flush=True)
            grouped: dict = {}
            for module_name, part, sec in got["compiles"]:
                n, total = grouped.get((module_name, part), (0, 0.0))
                grouped[(module_name, part)] = (n + 1, total + sec)
            for (module_name, part), (n, total) in grouped.items():
                print(f"    compiled {module_name} {part}: {n} x, {total:6.2f} s", flush=True)
    common.write_json(a.json, rows)


if __name__ == "__main__":
    main()
