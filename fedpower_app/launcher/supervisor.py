"""The run's supervisor: one small process between ``fedpower-run`` and the SuperLink, so that every
process of a run dies with it, however the launcher dies (SIGKILL included).

    python supervisor.py --parent PID --grace SECONDS -- flower-superlink ...

Flower starts the run's processes in sessions of their own (``flower-superexec``), and Ray starts
more below ``flwr-simulation`` (GCS, raylet, agents, ``ClientAppActor`` workers), so neither a
process group nor a parent-death signal on the SuperLink reaches them all; a killed launcher used
to leave ``flwr-simulation`` and the actors running for minutes. The supervisor is what Linux
gives for that:

* it is a **child subreaper** (``PR_SET_CHILD_SUBREAPER``): whatever the SuperLink starts stays
  below it, however deep and in whatever session, also after an intermediate parent exits;
* it watches the **launcher process** through a pidfd (``pidfd_open``: the kernel wakes it when that
  process ends, whichever thread started the supervisor; no polling), and gets SIGTERM, SIGINT or
  SIGHUP from a normal stop;
* it runs in a session of its own, so a SIGKILL to the launcher's process group does not reach it;
* the SuperLink gets ``PR_SET_PDEATHSIG`` (SIGTERM) from it, for the case that the supervisor
  itself is killed.

When the launcher ends, a stop signal comes or the SuperLink exits, it sends SIGTERM to every
descendant, waits ``--grace`` seconds, SIGKILLs what is left (again, until none is left, up to 10 s
more) and exits with the SuperLink's exit code (1 if the launcher died, 128 + N on signal N). Descendants are found from
``/proc`` parent links, by PID; nothing is matched by name.

It holds the file descriptors the launcher passes to it (``pass_fds``): the run directory's lock
(``fedpower_app.runs.owner``) stays held until the last process of the run is gone.

Pure standard library, run as a script: it imports nothing of the project.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import select
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
KILL_RETRY_SECONDS = 10.0  # after SIGKILL, how long to keep killing what appears (e.g. a D-state exit)


def _prctl(option: int, value: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _ppid_map() -> dict[int, tuple[int, str]]:
    """{pid: (parent pid, state)} of every process visible in /proc."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                stat = fh.read().decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()  # the name in parentheses may hold spaces
        if len(fields) >= 2:
            out[int(name)] = (int(fields[1]), fields[0])
    return out


def descendants(root: int | None = None) -> list[int]:
    """PIDs of the living (not zombie) descendants of ``root`` (default: this process)."""
    root = os.getpid() if root is None else root
    table = _ppid_map()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            todo.append(child)
            if table[child][1] != "Z":
                out.append(child)
    return out


def _reap(keep: int | None = None) -> None:
    """Reap exited children (orphans re-parented here), except ``keep`` (left for ``Popen.poll``)."""
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if info is None or info.si_pid == keep:
            return
        try:
            os.waitpid(info.si_pid, os.WNOHANG)
        except ChildProcessError:
            return


def stop_descendants(grace: float) -> None:
    """SIGTERM to every descendant, SIGKILL after ``grace`` s to what is left; returns once none is left
    (or :data:`KILL_RETRY_SECONDS` after the SIGKILL)."""
    deadline = time.monotonic() + grace
    termed: set[int] = set()
    while True:
        _reap()
        alive = descendants()
        if not alive:
            return
        killing = time.monotonic() >= deadline
        for pid in alive:
            if killing or pid not in termed:
                termed.add(pid)
                try:
                    os.kill(pid, signal.SIGKILL if killing else signal.SIGTERM)
                except OSError:
                    pass
        if time.monotonic() > deadline + KILL_RETRY_SECONDS:
            return
        time.sleep(0.05)


def _open_parent(parent: int) -> int | None:
    """A pidfd of the launcher, checked to be this process's parent (it may have died before this line:
    then this process has been re-parented). None when pidfd_open is missing (Linux < 5.3)."""
    try:
        fd = os.pidfd_open(parent)
    except ProcessLookupError:
        sys.exit(1)
    except (AttributeError, OSError):
        fd = None
    if os.getppid() != parent:
        sys.exit(1)
    return fd


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--")
    p = argparse.ArgumentParser(prog="supervisor.py")
    p.add_argument("--parent", type=int, required=True, help="the launcher's PID")
    p.add_argument("--grace", type=float, default=3.0, help="seconds from SIGTERM to SIGKILL")
    args = p.parse_args(argv[:split])
    cmd = argv[split + 1:]

    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    parent_fd = _open_parent(args.parent)
    if parent_fd is None:  # no pidfd: the parent-death signal (it follows the thread that forked this)
        _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != args.parent:
            return 1

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    stop_signal: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: stop_signal.append(signum))
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # wakes the select: reap orphans

    # The supervisor is single-threaded, so a preexec_fn is safe here.
    child = subprocess.Popen(cmd, preexec_fn=lambda: _prctl(PR_SET_PDEATHSIG, signal.SIGTERM))
    watched = [fd for fd in (parent_fd, wake_r) if fd is not None]
    code = 1
    while not stop_signal:
        ready, _, _ = select.select(watched, [], [])  # woken by the launcher's end or by a signal (SIGCHLD)
        if wake_r in ready:
            try:
                os.read(wake_r, 512)
            except BlockingIOError:
                pass
        if child.poll() is not None:
            code = child.returncode
            break
        _reap(keep=child.pid)  # orphans re-parented here that have exited
        if parent_fd is not None and parent_fd in ready:
            print(f"fedpower-run supervisor: the launcher (pid {args.parent}) is gone; stopping every process "
                  "of its run", file=sys.stderr, flush=True)
            break
    if stop_signal:
        code = 128 + stop_signal[0]
    stop_descendants(args.grace)
    return code


if __name__ == "__main__":
    sys.exit(main())
