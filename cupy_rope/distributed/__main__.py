"""Launcher: ``python -m cupy_rope.distributed --nproc N [options] SUBCOMMAND [ARGS...]``.

Starts N processes on this machine, rank r on GPU r, each running ``python -m cupy_rope.distributed._worker
SUBCOMMAND ARGS``, with the environment :func:`cupy_rope.distributed.init` reads. Subcommands:

* ``run SCRIPT [ARGS...]``: run a script in every process (like torchrun); it calls ``init()`` itself.
* ``bench [--precision P] [--out FILE]``: the data-parallel benchmark (rank 0 prints and writes the JSON).
* ``selfcheck [...]``: a small correctness case (used by the tests).

Every child gets ``NCCL_NVLS_ENABLE=0`` (NVLink multicast stays off, whatever the caller's environment
says) and, unless set already, ``NCCL_ALGO=Ring`` (a fixed reduction order; see docs/distributed.md).

Failure handling: the parent polls its children. When one exits with a non-zero status (or a signal), the
parent names that rank, lets the others end by themselves for up to 2 s (they usually fail too and are
printing why), then sends SIGTERM to every remaining child's process group, SIGKILL after ``--grace``
seconds, and exits with the failing status. The same happens after ``--timeout`` seconds (status 124) or
when the parent is interrupted. Each child runs in its own session, so the signals reach what it started
too (cupyx's rendezvous store is a child process of rank 0). After a clean exit of a child, anything it
left running in its process group is killed as well, so the launcher never leaves processes behind.
"""
from __future__ import annotations

import argparse
import math
import os
import signal
import socket
import subprocess
import sys
import time

PROG = "python -m cupy_rope.distributed"
SUBCOMMANDS = ("run", "bench", "selfcheck", "selftest")
SETTLE_S = 2.0  # after a failure, how long the other ranks may take to end by themselves before SIGTERM


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it), for the rendezvous store."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def parse_args(argv):
    p = argparse.ArgumentParser(prog=PROG, description="Start one process per GPU and run SUBCOMMAND in each.",
                                epilog=f"subcommands: {', '.join(SUBCOMMANDS[:3])} (see the module docstring)")
    p.add_argument("--nproc", type=int, required=True, help="number of processes (ranks), one per GPU")
    p.add_argument("--port", type=int, default=None, help="rendezvous TCP port (default: a free one)")
    p.add_argument("--master-addr", default="127.0.0.1", help="rendezvous address (default 127.0.0.1)")
    p.add_argument("--grace", type=float, default=10.0,
                   help="seconds between SIGTERM and SIGKILL when stopping the ranks (default 10)")
    p.add_argument("--timeout", type=float, default=None,
                   help="stop every rank after this many seconds and exit with status 124 (default: none)")
    p.add_argument("--python", default=sys.executable, help=argparse.SUPPRESS)
    p.add_argument("subcommand", choices=SUBCOMMANDS, metavar="SUBCOMMAND")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the subcommand")
    a = p.parse_args(argv)
    if a.nproc < 1:
        p.error(f"--nproc must be at least 1, got {a.nproc}")
    if not 0 <= a.grace < math.inf:
        p.error(f"--grace must be a finite number of seconds >= 0, got {a.grace}")
    if a.timeout is not None and not 0 < a.timeout < math.inf:
        p.error(f"--timeout must be a finite number of seconds > 0, got {a.timeout}")
    if a.port is not None and not 0 < a.port < 65536:
        p.error(f"--port must be in 1..65535, got {a.port}")
    if a.subcommand == "run" and not a.args:
        p.error("run needs a SCRIPT")
    return a


def child_env(rank: int, world_size: int, addr: str, port: int, base=None) -> dict:
    """The environment of rank ``rank``: ours, torchrun's names, NVLS off, the Ring algorithm by default."""
    env = dict(os.environ if base is None else base)
    ids = {"RANK": rank, "WORLD_SIZE": world_size, "LOCAL_RANK": rank, "MASTER_ADDR": addr, "MASTER_PORT": port}
    for k, v in ids.items():
        env["CUPY_ROPE_" + k] = str(v)
        env[k] = str(v)
    env["CUPYX_DISTRIBUTED_HOST"], env["CUPYX_DISTRIBUTED_PORT"] = addr, str(port)
    env["NCCL_NVLS_ENABLE"] = "0"  # never NVLink multicast: it can take a shared host's GPUs out of service
    env.setdefault("NCCL_ALGO", "Ring")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _say(msg: str) -> None:
    print(f"{PROG}: {msg}", file=sys.stderr, flush=True)


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs. Zombies do not count: a grandchild killed after its
    parent exited waits for init to reap it, which can take a while in a container."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    if not os.path.isdir("/proc/self"):
        return True  # pragma: no cover - no procfs: assume alive (the grace period bounds the wait)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()  # after "pid (comm) ": state, ppid, pgrp, ...
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            return True
    return False


def _signal_group(pgid: int, sig) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _describe(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit status {rc}"


class Launcher:
    def __init__(self, a):
        self.a = a
        self.procs: list = []

    def start(self) -> None:
        a = self.a
        port = a.port or free_port(a.master_addr)
        cmd = [a.python, "-m", "cupy_rope.distributed._worker", a.subcommand, *a.args]
        for rank in range(a.nproc):
            env = child_env(rank, a.nproc, a.master_addr, port)
            # start_new_session: the child leads its own process group, so one killpg reaches its children too
            self.procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))

    def stop(self, ranks, reason: str) -> None:
        """SIGTERM to the process groups of ``ranks``, SIGKILL to whatever is left after the grace period."""
        live = [r for r in ranks if _group_alive(self.procs[r].pid)]
        if not live:
            return
        _say(f"{reason}; stopping rank(s) {', '.join(map(str, live))} (SIGTERM, SIGKILL after {self.a.grace:g} s)")
        for r in live:
            _signal_group(self.procs[r].pid, signal.SIGTERM)
        deadline = time.monotonic() + self.a.grace
        while time.monotonic() < deadline and any(_group_alive(self.procs[r].pid) for r in live):
            self._reap()
            time.sleep(0.05)
        for r in live:
            if _group_alive(self.procs[r].pid):
                _signal_group(self.procs[r].pid, signal.SIGKILL)
        for r in live:
            self.procs[r].wait()

    def _settle(self, ranks) -> None:
        """A short wait for ``ranks`` to end by themselves: after one rank fails, the others usually fail too
        (the status exchange tells them) and are still printing why."""
        deadline = time.monotonic() + min(SETTLE_S, self.a.grace)
        while time.monotonic() < deadline and any(self.procs[r].poll() is None for r in ranks):
            time.sleep(0.05)

    def _reap(self) -> None:
        for p in self.procs:
            p.poll()

    def wait(self) -> int:
        """Wait for every rank; on the first failure stop the others. Returns the launcher's exit status."""
        deadline = None if self.a.timeout is None else time.monotonic() + self.a.timeout
        finished: set = set()
        while len(finished) < len(self.procs):
            for rank, p in enumerate(self.procs):
                if rank in finished or p.poll() is None:
                    continue
                finished.add(rank)
                if p.returncode != 0:
                    others = [r for r in range(len(self.procs)) if r != rank]
                    self._settle(others)
                    self.stop(others, f"rank {rank} failed ({_describe(p.returncode)})")
                    _say(f"failed: rank {rank} ({_describe(p.returncode)})")
                    return p.returncode if p.returncode > 0 else 128 - p.returncode
                if _group_alive(p.pid):  # exited cleanly but left processes behind in its group
                    self.stop([rank], f"rank {rank} exited but left processes running")
            if deadline is not None and time.monotonic() > deadline:
                self.stop(range(len(self.procs)), f"timed out after {self.a.timeout:g} s")
                _say(f"failed: timed out after {self.a.timeout:g} s")
                return 124
            time.sleep(0.05)
        return 0


def main(argv=None) -> int:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    launcher = Launcher(a)

    def on_signal(signum, frame):  # the launcher itself is told to stop: take every rank down with it
        launcher.stop(range(len(launcher.procs)), f"received {signal.Signals(signum).name}")
        sys.exit(128 + signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        launcher.start()
        return launcher.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        launcher.stop(range(len(launcher.procs)), "launcher exiting")  # no-op when every rank has ended


if __name__ == "__main__":
    sys.exit(main())
