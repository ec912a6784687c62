"""One rank of the launcher: ``python -m cupy_rope.distributed._worker SUBCOMMAND [ARGS...]``.

Runs the subcommand, and on any exception prints it under the rank's name, aborts the NCCL communicator (a
peer may be waiting in a collective that will never complete) and exits with status 1, so the launcher
stops the other ranks. On success the process group is shut down (store stopped, communicator destroyed)
before the interpreter exits, so the process ends by itself.
"""
from __future__ import annotations

import os
import runpy
import sys
import traceback


def _rank() -> str:
    return os.environ.get("CUPY_ROPE_RANK", "?")


def _run_script(args) -> int:
    script, *rest = args
    sys.argv = [script, *rest]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
    return 0


def _dispatch(cmd: str, args) -> int:
    if cmd == "run":
        return _run_script(args)
    if cmd == "selftest":  # needs no GPU: the launcher's own tests
        from ._selftest import main
    elif cmd == "bench":
        from .bench import main
    elif cmd == "selfcheck":
        from .selfcheck import main
    else:
        print(f"rank {_rank()}: unknown subcommand {cmd!r}", file=sys.stderr)
        return 2
    return main(args) or 0


def _leave(failed: bool) -> None:
    from . import group

    g = group.current()
    if g is not None and failed:
        g.failed = True  # abort instead of destroy: a peer may still wait in a collective
    group.shutdown()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python -m cupy_rope.distributed._worker SUBCOMMAND [ARGS...]", file=sys.stderr)
        return 2
    try:
        rc = _dispatch(argv[0], argv[1:])
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - report any failure under the rank's name, then exit non-zero
        print(f"rank {_rank()}: failed:\n{traceback.format_exc()}", file=sys.stderr, end="", flush=True)
        rc = 1
    try:
        _leave(failed=rc != 0)
    except BaseException:  # noqa: BLE001
        print(f"rank {_rank()}: shutdown failed:\n{traceback.format_exc()}", file=sys.stderr, end="")
        rc = rc or 1
    sys.stdout.flush()
    sys.stderr.flush()
    return rc


if __name__ == "__main__":
    sys.exit(main())
