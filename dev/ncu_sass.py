"""Where do a kernel's warps wait, instruction by instruction? Summarises Nsight Compute's source page of one
profiled kernel, exported per SASS instruction:

    ncu --kernel-name K --launch-count 1 --section SourceCounters --section WarpStateStats -o /tmp/k python ...
    ncu -i /tmp/k.ncu-rep --page source --csv --print-source sass > k.csv
    python dev/ncu_sass.py k.csv [--top 25] [--from ADDR --to ADDR]

Prints the warp-state samples by stall reason and by opcode, and the instructions with the most samples, each
with its three largest stall reasons. --from/--to (hex address suffixes, as printed) restrict the summary to one
stretch of the code, such as a loop body.
"""
from __future__ import annotations

import argparse
import collections
import csv


def read(path: str) -> tuple[list[str], list[list[str]]]:
    """The header and the instruction rows of an ncu source-page CSV (the first line names the kernel)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    start = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    hdr = rows[start]
    return hdr, [r for r in rows[start + 1:] if len(r) >= len(hdr)]


def number(text: str) -> int:
    return int(text) if text not in ("", "-") else 0


def opcode(source: str) -> str:
    words = source.split()
    if not words:
        return "?"
    op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
    return op.split(".")[0]


def summarise(hdr, rows, top: int, lo: int | None = None, hi: int | None = None) -> str:
    ix = {h: i for i, h in enumerate(hdr)}
    stalls = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    samples = "Warp Stall Sampling (All Samples)"
    by_reason, by_op, lines, total = collections.Counter(), collections.Counter(), [], 0
    for r in rows:
        addr = int(r[ix["Address"]], 16)
        if (lo is not None and addr & 0xFFFFF < lo) or (hi is not None and addr & 0xFFFFF > hi):
            continue
        n = number(r[ix[samples]])
        total += n
        src = r[ix["Source"]].strip()
        by_op[opcode(src)] += n
        reasons = {s[len("stall_"):]: number(r[ix[s]]) for s in stalls if number(r[ix[s]])}
        by_reason.update(reasons)
        lines.append((n, r[ix["Address"]][-5:], src, reasons))
    out = [f"warp-state samples: {total}"]
    pct = lambda v: 100 * v / max(total, 1)  # noqa: E731
    out += [f"  {s:28s} {v:9d} {pct(v):5.1f}%" for s, v in by_reason.most_common()]
    out.append("by opcode:")
    out += [f"  {s:16s} {v:9d} {pct(v):5.1f}%" for s, v in by_op.most_common(18)]
    out.append("instructions with the most samples:")
    for n, a, src, reasons in sorted(lines, key=lambda x: -x[0])[:top]:
        three = ", ".join(f"{k} {v}" for k, v in sorted(reasons.items(), key=lambda x: -x[1])[:3])
        out.append(f"{n:8d} {a} {src[:80]:80s} {three}")
    return "\n".join(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--from", dest="lo", type=lambda s: int(s, 16), default=None, metavar="ADDR")
    ap.add_argument("--to", dest="hi", type=lambda s: int(s, 16), default=None, metavar="ADDR")
    a = ap.parse_args(argv)
    hdr, rows = read(a.csv)
    print(summarise(hdr, rows, a.top, a.lo, a.hi))


if __name__ == "__main__":
    main()
