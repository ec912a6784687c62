"""Did a source change alter the machine code? Compiles every kernel module with NVRTC alone (no GPU) for sm_80
and sm_90a (the sm_90a-only module for sm_90a alone), the attention modules once per supported head dim, in
the parts the library builds (a precision, a part of the sm_90a module), and
either saves the cubins or compares them with saved ones: the ``.text.<kernel>`` sections (each kernel's machine
code) must be byte-identical; the rest of the ELF (symbol tables, notes, constant banks) is reported separately,
since a refactor may move it without changing what runs.

    python dev/cubin_diff.py save DIR       # before the change
    python dev/cubin_diff.py compare DIR    # after it; exit status 1 if any kernel's .text differs
"""
from __future__ import annotations

import argparse
import struct
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from cupy_rope import _kernels as K
from cupy_rope.attention import hopper
from cupy_rope.attention.kernels import HEAD_DIMS, build_options
from cupy_rope.attention.plan import HOPPER_HEAD_DIMS as SM90_HEAD_DIMS  # the sm_90a module's
from cupy_rope.precision import Precision

ARCHS = ("sm_80", "sm_90a")


def builds() -> list[tuple[str, str, tuple]]:
    """(file name, module, arch, NVRTC options) of every cubin the comparison covers."""
    out = []
    for arch in ARCHS:
        for m in K.MODULES:
            if K.ARCH_MODULES.get(m, arch) != arch:  # a module built for one architecture only (sm_90a)
                continue
            if m == "attention":
                out += [(f"{m}_{arch}_d{d}_{p.label}.cubin", m, arch, build_options(p, d))
                        for d in HEAD_DIMS for p in Precision]
            elif m == "attention_sm90":
                out += [(f"{m}_{arch}_d{d}_{p.lower()}.cubin", m, arch, hopper.part_options(p, d))
                        for d in SM90_HEAD_DIMS for p in hopper.PARTS]
            else:
                out.append((f"{m}_{arch}.cubin", m, arch, K.OPTIONS))
    return out


def compile_all() -> dict[str, bytes]:
    def one(b):
        name, module, arch, options = b
        return name, K.compile_for_arch(module, arch, options)

    with ThreadPoolExecutor(4) as ex:  # NVRTC releases the GIL while it compiles
        return dict(ex.map(one, builds()))


def sections(elf: bytes) -> dict[str, bytes]:
    """Section name -> contents of a little-endian ELF64 file (NOBITS sections give their size only)."""
    assert elf[:4] == b"\x7fELF" and elf[4] == 2 and elf[5] == 1, "not a little-endian ELF64 file"
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    heads = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    stroff = heads[shstrndx][4]
    out = {}
    for name, typ, _flags, _addr, off, size, *_ in heads:
        end = elf.index(b"\0", stroff + name)
        key = elf[stroff + name:end].decode()
        out[key] = str(size).encode() if typ == 8 else elf[off:off + size]  # SHT_NOBITS: no bytes in the file
    return out


def compare(old: bytes, new: bytes) -> tuple[list[str], list[str], int]:
    """(.text sections that differ or exist on one side only, other sections that differ, .text count)."""
    a, b = sections(old), sections(new)
    texts = sorted(n for n in set(a) | set(b) if n.startswith(".text"))
    bad_text = [n for n in texts if a.get(n) != b.get(n)]
    other = sorted(n for n in set(a) | set(b) if not n.startswith(".text") and a.get(n) != b.get(n))
    return bad_text, other, len(texts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=("save", "compare"))
    ap.add_argument("dir", type=Path)
    args = ap.parse_args()
    cubins = compile_all()
    if args.action == "save":
        args.dir.mkdir(parents=True, exist_ok=True)
        for name, data in cubins.items():
            (args.dir / name).write_bytes(data)
        print(f"saved {len(cubins)} cubins to {args.dir}")
        return 0
    failed = 0
    for name, new in cubins.items():
        path = args.dir / name
        if not path.is_file():
            print(f"MISSING  {name}: not saved in {args.dir}")
            failed += 1
            continue
        old = path.read_bytes()
        bad_text, other, ntext = compare(old, new)
        whole = "whole cubin identical" if old == new else f"other sections differ: {', '.join(other) or 'none'}"
        if bad_text:
            failed += 1
            print(f"DIFFER   {name}: .text differs in {', '.join(bad_text)}")
        else:
            print(f"same     {name}: {ntext} .text sections byte-identical; {whole}")
    print(f"{len(cubins) - failed} of {len(cubins)} cubins have byte-identical kernel code")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
