"""GPU-free worker modes that prove the launcher's process handling (``selftest`` subcommand).

Each rank: optionally writes its environment to ``--env-out DIR/rank{r}.json``; optionally starts a
grandchild that sleeps (``--straggler``: it stays in the rank's process group after the rank exits);
optionally ignores SIGTERM (``--ignore-term``); then rank ``--fail-rank`` exits with status 3 after
``--fail-after`` seconds and every other rank sleeps ``--sleep`` seconds and exits 0.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

KEYS = ("CUPY_ROPE_RANK", "CUPY_ROPE_WORLD_SIZE", "CUPY_ROPE_LOCAL_RANK", "CUPY_ROPE_MASTER_ADDR",
        "CUPY_ROPE_MASTER_PORT", "NCCL_NVLS_ENABLE", "NCCL_ALGO", "RANK", "WORLD_SIZE")


def main(argv) -> int:
    p = argparse.ArgumentParser(prog="selftest")
    p.add_argument("--fail-rank", type=int, default=None)
    p.add_argument("--fail-after", type=float, default=0.5)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--ignore-term", action="store_true")
    p.add_argument("--straggler", action="store_true")
    p.add_argument("--env-out", default=None)
    a = p.parse_args(argv)
    rank = int(os.environ["CUPY_ROPE_RANK"])
    if a.env_out:
        with open(os.path.join(a.env_out, f"rank{rank}.json"), "w") as f:
            json.dump({k: os.environ.get(k) for k in KEYS} | {"pid": os.getpid(), "pgid": os.getpgid(0)}, f)
    if a.straggler:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        if a.env_out:
            with open(os.path.join(a.env_out, f"straggler{rank}.pid"), "w") as f:
                f.write(str(child.pid))
    if a.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if rank == a.fail_rank:
        time.sleep(a.fail_after)
        print(f"rank {rank}: failing on purpose", file=sys.stderr, flush=True)
        return 3
    time.sleep(a.sleep)
    return 0
