"""Do the register A fragments that a kernel keeps across its loop stay untouched inside it? (no GPU needed)

backward_tf32_ws2.cuh loads K (warpgroup 0) or V (warpgroup 1) once into wgmma A-fragment registers and reads
them in every query step (the S^T / dP^T products, register A operand). The compiler must not place anything
else in those registers inside the loop; at head dim 64 it once placed the dV / dK products' A operand there
(same m64n64k8 shape), and every step after the first read P^T of the step before. This script compiles the
sm_90a module for each head dim with the library's NVRTC build (or, with `--ptxas PATH`, NVRTC's PTX through that
ptxas, when `cuobjdump` is newer than NVRTC and does not read its cubins), disassembles the kernels with
`cuobjdump` (CUDA toolkit, or the `nvidia-cuda-cuobjdump` wheel), takes the A registers of the loop's first
register-A wgmma group, and lists every instruction inside the loop (from the back edge's target to the back
edge) that writes one of them. Exit status 1 if any does.

    python dev/sass_fragments.py [--cuobjdump PATH] [--ptxas PATH] [--dims 64,80,96,128]
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from cupy_rope import _kernels as K

KERNELS = ("hop_bwd_tf32_ws2", "hop_bwd_tf32_ws2_plain")
INS = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Za-z0-9._]*)\s*(.*?);")
NO_DEST = ("HGMMA", "ST", "RED", "ATOM", "BRA", "BAR", "SYNCS", "WARPGROUP", "ISETP", "FSETP", "PLOP3", "EXIT",
           "WARPSYNC", "BSSY", "BSYNC", "NOP", "MEMBAR", "FENCE", "UTMA", "ARRIVES", "CCTL", "DEPBAR", "ERRBAR")


def ptx_of(module: str, options: tuple) -> bytes:
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(K.source(module), module + ".cu", [], [])
    try:
        nvrtc.compileProgram(prog, ["--gpu-architecture=compute_90a", *K.module_options(module, options)])
        return nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)


def instructions(sass: str) -> list[tuple[int, str, str]]:
    out = []
    for line in sass.splitlines():
        m = INS.match(line)
        if m:
            out.append((int(m.group(1), 16), m.group(3), m.group(4)))
    return out


def check(ins: list[tuple[int, str, str]]) -> tuple[list[int], list[tuple[int, str, str]]]:
    """(fragment registers, writes to them inside the loop) of one kernel's instructions."""
    rs = [(a, int(m.group(1))) for a, op, args in ins if op.startswith("HGMMA")
          for m in [re.match(r"R\d+, R(\d+),", args)] if m]
    if not rs:
        return [], []
    first = rs[0][0]
    group = []
    for a, r in rs:  # the first group: consecutive register-A wgmmas from the first one
        if group and a - group[-1][0] > 0x100:
            break
        group.append((a, r))
    regs = sorted({r + k for _, r in group for k in range(4)})
    back = [(a, int(args.split()[0], 16)) for a, op, args in ins
            if op == "BRA" and re.match(r"0x[0-9a-f]+", args) and int(args.split()[0], 16) <= first < a]
    latch, head = min(back)  # the loop's own back edge: the nearest one after the products
    writes = [(a, op, args) for a, op, args in ins if head <= a <= latch and not op.startswith(NO_DEST)
              for m in [re.match(r"R(\d+)", args)] if m and int(m.group(1)) in regs]
    return regs, writes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cuobjdump", default=shutil.which("cuobjdump") or "cuobjdump")
    ap.add_argument("--ptxas", default=None, help="assemble NVRTC's PTX with this ptxas instead")
    ap.add_argument("--dims", default="64,80,96,128")
    a = ap.parse_args()
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        for d in (int(x) for x in a.dims.split(",")):
            path = Path(tmp) / f"sm90_d{d}.cubin"
            options = K.OPTIONS + (f"-DATTN_HEAD_DIM={d}",)
            if a.ptxas:
                ptx = Path(tmp) / f"sm90_d{d}.ptx"
                ptx.write_bytes(ptx_of("attention_sm90", options))
                subprocess.run([a.ptxas, "-arch=sm_90a", str(ptx), "-o", str(path)], check=True)
            else:
                path.write_bytes(K.compile_for_arch("attention_sm90", "sm_90a", options))
            for name in KERNELS:
                sass = subprocess.run([a.cuobjdump, "-sass", "-fun", name, str(path)], capture_output=True,
                                      text=True, check=True).stdout
                regs, writes = check(instructions(sass))
                if not regs:
                    print(f"d={d:3d} {name}: no register-A wgmma found")
                    bad += 1
                    continue
                state = "ok" if not writes else f"{len(writes)} writes inside the loop"
                print(f"d={d:3d} {name}: fragments R{regs[0]}-R{regs[-1]}, {state}")
                for w in writes[:4]:
                    print(f"    {w[0]:#06x} {w[1]} {w[2]}")
                bad += bool(writes)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
