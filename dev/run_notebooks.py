"""Do the notebooks run top to bottom? Executes each notebook in a real IPython kernel (nbclient + ipykernel), in
the notebook's folder, and writes it back in place with its outputs (figures included); stops a notebook at the
first cell that raises or runs past --timeout seconds, keeping the outputs so far, and exits 1 if any failed.

    python dev/run_notebooks.py [--timeout 900] [--out DIR] notebooks/*.ipynb

The kernel is this interpreter (sys.executable, with its environment: PYTHONPATH reaches the kernel), from a
kernel spec written under a temporary folder; Jupyter's and IPython's runtime, data and config folders point
there too, so nothing is written outside the temporary folder, the notebooks and --out.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

KERNEL = "python3"  # the name the notebooks' metadata gives: their metadata stays as it is


def isolate(tmp: Path) -> None:
    """Point Jupyter, IPython and matplotlib at ``tmp`` and write a kernel spec there that runs sys.executable."""
    for var, sub in (("JUPYTER_RUNTIME_DIR", "runtime"), ("JUPYTER_DATA_DIR", "data"),
                     ("JUPYTER_CONFIG_DIR", "config"), ("IPYTHONDIR", "ipython"), ("MPLCONFIGDIR", "mpl")):
        os.environ[var] = str(tmp / sub)
    os.environ["JUPYTER_PATH"] = str(tmp / "data")  # searched first: this spec wins over any installed one
    os.environ["JUPYTER_PLATFORM_DIRS"] = "1"
    os.environ["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"  # figures become PNG outputs
    spec = tmp / "data" / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3", "language": "python"}))


def execute(path: Path, timeout: int, out: Path | None) -> bool:
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    metadata = copy.deepcopy(nb.metadata)  # nbclient fills in the kernel's language_info: keep the notebook's
    # no per-cell timestamps (record_timing): an executed notebook differs from the last only where outputs do
    client = NotebookClient(nb, timeout=timeout, kernel_name=KERNEL, allow_errors=False, record_timing=False,
                            resources={"metadata": {"path": str(path.parent.resolve())}})
    t0 = time.perf_counter()
    ok = True
    try:
        client.execute()
    except Exception as e:  # noqa: BLE001 - a cell error, a timeout or a dead kernel: report it, keep the outputs
        ok = False
        print(f"[run_notebooks] {path}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    nb.metadata = metadata
    nbformat.write(nb, path)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, out / path.name)
    print(f"[run_notebooks] {'executed' if ok else 'FAILED'} {path} in {time.perf_counter() - t0:.1f} s",
          file=sys.stderr, flush=True)
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("notebooks", nargs="+", type=Path)
    ap.add_argument("--timeout", type=int, default=900, help="seconds one cell may run (default 900)")
    ap.add_argument("--out", type=Path, help="also copy each executed notebook into this folder")
    a = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="run_notebooks."))
    try:
        isolate(tmp)
        results = [execute(p, a.timeout, a.out) for p in a.notebooks]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
