"""Does this tree compute bit-identical outputs to a reference tree? Runs vision_attention_backward on the 16
seed workloads in each precision and rope_2d_backward on the 16 RoPE workloads (fixed seeds, inputs built as
the benchmarks build them) and compares every output's bits.

    python dev/same_bits.py save FILE [--precisions P,...] [--cases all|TxN,...] [--rope-cases all|BxS,...]
    python dev/same_bits.py compare FILE            # recompute what FILE holds; exit 1 on any mismatch
    python dev/same_bits.py diff --path .old/base --module cupy_rope_base

save writes a SHA-256 digest of every output per workload and precision to FILE (JSON); compare recomputes the
workloads FILE holds (or the subset named) and reports mismatches. diff runs both trees in one process on the
same inputs and also prints each workload's largest relative error (Frobenius, over the outputs) against the
reference tree. --module/--path pick the library that save and compare run (default cupy_rope, as installed).

cuBLAS kernel autotuning is turned off in every library run here (set_gemm_autotune(False)): its timed choices
may differ from process to process, and with them the bits of a GEMM. --autotune keeps it on.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys

import common

OPS = ("attention", "rope")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("action", choices=("save", "compare", "diff"))
    ap.add_argument("file", nargs="?", help="digest file (JSON) for save and compare")
    ap.add_argument("--precisions", type=common.precision_list, default=None, metavar="P[,P...]",
                    help="attention precision modes (default: all three; compare: those in FILE)")
    ap.add_argument("--cases", type=common.attn_case_list, default=None, metavar="all|TxN[,TxN...]",
                    help="attention workloads (default all 16; compare: those in FILE)")
    ap.add_argument("--rope-cases", type=common.rope_case_list, default=None, metavar="all|BxS[,BxS...]",
                    help="RoPE workloads (default all 16; compare: those in FILE)")
    ap.add_argument("--ops", default=",".join(OPS), help="which ops: attention,rope (default both)")
    ap.add_argument("--autotune", action="store_true", help="keep cuBLAS kernel autotuning on")
    common.add_library_args(ap, "the library to run (save, compare) or the reference tree (diff)")
    a = ap.parse_args(argv)
    a.ops = [o for o in a.ops.split(",") if o]
    if any(o not in OPS for o in a.ops):
        ap.error(f"--ops is a subset of {','.join(OPS)}")
    if a.action in ("save", "compare") and not a.file:
        ap.error(f"{a.action} needs FILE")
    if a.action == "diff" and (a.file or not a.module):
        ap.error("diff takes no FILE and needs --module (and usually --path) naming the reference tree")
    if a.path and not a.module:
        ap.error("--path needs --module")
    return a


def entries(a, saved=None) -> list[tuple[str, str, tuple]]:
    """(op, precision or "", workload) to run: the options', or FILE's narrowed by the options given."""
    if saved is not None:
        out = [(e["op"], e["precision"], tuple(e["case"])) for e in saved]
        return [(op, p, c) for op, p, c in out
                if op in a.ops
                and (a.precisions is None or op != "attention" or p in a.precisions)
                and (a.cases is None or op != "attention" or c in a.cases)
                and (a.rope_cases is None or op != "rope" or c in a.rope_cases)]
    out = []
    if "attention" in a.ops:
        cases = a.cases if a.cases is not None else common.attn_case_list("all")
        out += [("attention", p, tuple(c)) for c in cases for p in a.precisions or common.PRECISIONS]
    if "rope" in a.ops:
        cases = a.rope_cases if a.rope_cases is not None else common.rope_case_list("all")
        out += [("rope", "", tuple(c)) for c in cases]
    return out


def seed(case: tuple) -> int:
    """One fixed seed per workload, so that any subset of workloads sees the same inputs."""
    return 1009 * case[0] + case[1]


def inputs(op: str, case: tuple):
    return common.attn_inputs(*case, seed=seed(case)) if op == "attention" else common.rope_inputs(*case, seed(case))


def run(lib, op: str, precision: str, args) -> dict:
    """{output name: array} of one library call."""
    if op == "attention":
        return dict(zip(common.ATTN_OUTPUTS, lib.vision_attention_backward(*args, precision=precision)))
    return {"grad_idx_theta": lib.rope_2d_backward(*args)}


def digest(x) -> str:
    """SHA-256 of an array's dtype, shape and bytes."""
    import cupy

    h = hashlib.sha256(f"{x.dtype.str}{tuple(x.shape)}".encode())
    h.update(cupy.asnumpy(cupy.ascontiguousarray(x)).tobytes())
    return h.hexdigest()


def label(op: str, precision: str, case: tuple) -> str:
    return f"{op:9s} {precision or '-':4s} {common.case_label(*case):>9s}"


def device_name() -> str:
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
    name = props["name"]
    return name.decode() if isinstance(name, bytes) else name


def grouped(todo):
    """The entries grouped by (op, workload), so each workload's inputs are built once for all precisions."""
    groups: dict = {}
    for op, p, case in todo:
        groups.setdefault((op, case), []).append(p)
    return groups.items()


def save_or_compare(a) -> int:
    lib = common.import_library(a.module or "cupy_rope", a.path)
    saved = None
    if a.action == "compare":
        with open(a.file) as f:
            saved = json.load(f)
        a.autotune = saved.get("autotune", False)
    lib.set_gemm_autotune(a.autotune)
    todo = entries(a, saved["results"] if saved else None)
    want = {(e["op"], e["precision"], tuple(e["case"])): e["digests"] for e in saved["results"]} if saved else {}
    results, bad = [], 0
    for (op, case), precisions in grouped(todo):
        args = inputs(op, case)
        for p in precisions:
            outs = run(lib, op, p, args)
            got = {k: digest(v) for k, v in outs.items()}
            del outs
            results.append({"op": op, "precision": p, "case": list(case), "digests": got})
            if saved is None:
                print(f"{label(op, p, case)}  saved", flush=True)
                continue
            differ = [k for k in got if got[k] != want[(op, p, case)].get(k)]
            bad += bool(differ)
            print(f"{label(op, p, case)}  " + (f"DIFFER: {', '.join(differ)}" if differ else "identical"), flush=True)
        del args
        common.free_gpu()
    if saved is None:
        payload = {"library": lib.__name__, "version": getattr(lib, "__version__", None), "device": device_name(),
                   "autotune": a.autotune, "results": results}
        with open(a.file, "w") as f:
            json.dump(payload, f, indent=1)
            f.write("\n")
        print(f"wrote {len(results)} digests of {lib.__name__} to {a.file}")
        return 0
    print(f"{len(results) - bad} of {len(results)} bit-identical to {a.file} ({saved.get('library')} on "
          f"{saved.get('device')})")
    return 1 if bad else 0


def diff(a) -> int:
    import cupy_rope

    ref = common.import_library(a.module, a.path)
    for lib in (cupy_rope, ref):
        lib.set_gemm_autotune(a.autotune)
    bad = total = 0
    worst = 0.0
    for (op, case), precisions in grouped(entries(a)):
        args = inputs(op, case)
        for p in precisions:
            outs = run(cupy_rope, op, p, args)
            refs = run(ref, op, p, args)
            differ = [k for k in outs if not common.same_bits(outs[k], refs[k])]
            err = max(common.rel_err(outs[k], refs[k]) for k in outs)
            worst = max(worst, err)
            total += 1
            bad += bool(differ)
            print(f"{label(op, p, case)}  " + (f"DIFFER: {', '.join(differ)}" if differ else "identical")
                  + f"  max rel err {err:.1e}", flush=True)
            del outs, refs
            common.free_gpu()
        del args
        common.free_gpu()
    print(f"{total - bad} of {total} bit-identical to {ref.__name__} ({ref.__file__}); "
          f"largest relative error {worst:.1e}")
    return 1 if bad else 0


def main(argv=None) -> int:
    a = parse_args(argv)
    return diff(a) if a.action == "diff" else save_or_compare(a)


if __name__ == "__main__":
    sys.exit(main())
