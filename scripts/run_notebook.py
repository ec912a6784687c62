#!/usr/bin/env python3
"""Execute a Jupyter notebook without Jupyter: ``python scripts/run_notebook.py IN.ipynb [OUT.ipynb]``.

For machines that have numpy / cupy / matplotlib but no jupyter, nbformat or nbclient. The notebook is read
with ``json``; its code cells run top to bottom in one namespace, in the notebook's folder (as Jupyter does).
Per cell: stdout and stderr are captured as stream outputs; every open matplotlib figure (Agg backend) is
saved as a PNG display_data output and closed; the value of a trailing expression is shown as an
execute_result (``text/plain``, its repr), as IPython does; ``execution_count`` is set. ``display(obj)`` is
available in the namespace. The executed notebook (nbformat 4) is written to OUT (default: IN, overwritten).

On the first exception the traceback is recorded as an error output, the notebook is written, and the
script exits with status 1. Cells after it keep no outputs.
"""
from __future__ import annotations

import argparse
import ast
import base64
import contextlib
import io
import json
import linecache
import os
import sys
import time
import traceback

os.environ.setdefault("MPLBACKEND", "Agg")


def _lines(text: str) -> list:
    """Text as nbformat's multiline-string list (each line keeps its newline)."""
    return text.splitlines(keepends=True)


def _source(cell) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def _strip_magics(src: str) -> str:
    """``%matplotlib ...`` lines are meaningless here (Agg is forced); any other magic or shell escape is an
    error, since this runner is plain Python."""
    out = []
    for line in src.splitlines():
        s = line.lstrip()
        if s.startswith("%matplotlib"):
            out.append("pass  # " + s)
        elif s.startswith(("%", "!")):
            raise SyntaxError(f"IPython magic / shell escape not supported by run_notebook.py: {s!r}")
        else:
            out.append(line)
    return "\n".join(out) + ("\n" if src.endswith("\n") else "")


class _Display:
    """``display(obj)`` for the cells: figures become PNGs, anything else its repr."""

    def __init__(self):
        self.outputs: list = []

    def __call__(self, *objs):
        for obj in objs:
            fig = _as_figure(obj)
            if fig is not None:
                self.outputs.append(_png_output(fig))
            else:
                self.outputs.append({"output_type": "display_data", "metadata": {},
                                     "data": {"text/plain": _lines(repr(obj))}})


def _as_figure(obj):
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    return obj if isinstance(obj, Figure) else None


def _png_output(fig) -> dict:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    w, h = fig.get_size_inches() * fig.dpi
    return {"output_type": "display_data", "metadata": {},
            "data": {"image/png": base64.b64encode(buf.getvalue()).decode("ascii"),
                     "text/plain": [f"<Figure size {w:g}x{h:g} with {len(fig.axes)} Axes>"]}}


def _flush_figures(outputs: list) -> None:
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None:
        return
    for num in plt.get_fignums():
        outputs.append(_png_output(plt.figure(num)))
    plt.close("all")


def _compile_cell(src: str, filename: str):
    """(code for all statements but a trailing expression, code evaluating that expression or None)."""
    tree = ast.parse(src, filename=filename, mode="exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(body=tree.body.pop().value)
    body = compile(tree, filename, "exec")
    return body, (compile(last, filename, "eval") if last is not None else None)


def run(nb: dict, workdir: str, log=sys.__stderr__) -> bool:
    """Execute ``nb`` in place; True when every cell ran."""
    if nb.get("nbformat") != 4:
        raise ValueError(f"only nbformat 4 notebooks are supported, got {nb.get('nbformat')}")
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
    except ImportError:
        pass
    display = _Display()
    ns = {"__name__": "__main__", "__builtins__": __builtins__, "display": display}
    count = 0
    ok = True
    old_cwd = os.getcwd()
    os.chdir(workdir)
    sys.path.insert(0, workdir)
    try:
        for idx, cell in enumerate(nb.get("cells", [])):
            if cell.get("cell_type") != "code":
                continue
            if not ok:  # after a failure: leave the rest unexecuted
                cell["outputs"], cell["execution_count"] = [], None
                continue
            count += 1
            cell["execution_count"] = count
            outputs: list = []
            display.outputs = outputs
            filename = f"<cell {count}>"
            src = _source(cell)
            out_buf, err_buf = io.StringIO(), io.StringIO()
            t0 = time.perf_counter()
            value, error = None, None
            try:
                body, last = _compile_cell(_strip_magics(src), filename)
                linecache.cache[filename] = (len(src), None, src.splitlines(keepends=True), filename)
                with contextlib.redirect_stdout(out_buf), contextlib.redirect_stderr(err_buf):
                    exec(body, ns)
                    if last is not None:
                        value = eval(last, ns)
                        if value is not None:
                            ns["_"] = value
            except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt / SystemExit are cell errors too
                error = e
            # streams first, then figures and displays, then the result or the error (as Jupyter orders them)
            cell_outputs = []
            for name, buf in (("stdout", out_buf), ("stderr", err_buf)):
                if buf.getvalue():
                    cell_outputs.append({"output_type": "stream", "name": name, "text": _lines(buf.getvalue())})
            cell_outputs += outputs
            try:
                _flush_figures(cell_outputs)
            except Exception as e:  # noqa: BLE001
                error = error or e
            if error is None and value is not None:
                fig = _as_figure(value)
                data = {"text/plain": _lines(repr(value))}
                if fig is not None and not any(o.get("data", {}).get("image/png") for o in cell_outputs):
                    data = _png_output(fig)["data"]
                cell_outputs.append({"output_type": "execute_result", "execution_count": count, "metadata": {},
                                     "data": data})
            if error is not None:
                tb = traceback.format_exception(type(error), error, error.__traceback__)
                # drop this runner's own frames: the traceback starts at the cell
                tb = [tb[0]] + [f for f in tb[1:] if "run_notebook.py" not in f]
                cell_outputs.append({"output_type": "error", "ename": type(error).__name__,
                                     "evalue": str(error), "traceback": [line.rstrip("\n") for line in tb]})
                ok = False
            cell["outputs"] = cell_outputs
            dt = time.perf_counter() - t0
            print(f"[run_notebook] cell {count} (#{idx}) {'ok' if error is None else 'FAILED'} in {dt:.1f} s",
                  file=log, flush=True)
            if error is not None:
                print("".join(tb), file=log, flush=True)
    finally:
        os.chdir(old_cwd)
        if sys.path and sys.path[0] == workdir:
            sys.path.pop(0)
    return ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("notebook", help="the .ipynb to execute")
    p.add_argument("output", nargs="?", help="where to write the executed notebook (default: overwrite the input)")
    p.add_argument("--cwd", help="folder the cells run in (default: the notebook's folder)")
    a = p.parse_args(argv)
    with open(a.notebook, encoding="utf-8") as f:
        nb = json.load(f)
    workdir = os.path.abspath(a.cwd or os.path.dirname(os.path.abspath(a.notebook)))
    t0 = time.perf_counter()
    ok = run(nb, workdir)
    out = a.output or a.notebook
    nb.setdefault("metadata", {})
    with open(out, "w", encoding="utf-8") as f:
        json.dump(nb, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(f"[run_notebook] {'executed' if ok else 'FAILED'} {a.notebook} -> {out} in "
          f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
