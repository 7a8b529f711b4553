"""Process trees this process started: stopping them by PID (SIGTERM, grace, SIGKILL), dying with the launcher (the run's supervisor, ``supervisor.py``), and reaping orphans as a child subreaper. Nothing is matched by name."""


from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path




STOP_GRACE_SECONDS = 3.0  # flwr-simulation and Ray can take longer than this on SIGTERM; they get SIGKILL


def _descendants(pid: int) -> list:
    """psutil.Process objects of every descendant of ``pid`` (empty if psutil is missing)."""
    try:
        import psutil

        return psutil.Process(pid).children(recursive=True)
    except Exception:  # psutil missing, or the process is gone
        return []


def terminate_tree(proc: subprocess.Popen, grace: float | None = None) -> list[int]:
    """Stop ``proc`` (started with ``start_new_session=True``) and everything it started, by PID.

    The descendants are recorded first (they may live in sessions of their own, like
    ``flower-superexec``); then SIGTERM goes to every process group led by one of these processes
    (which also reaches children whose parent already exited) and to every other recorded PID;
    after ``grace`` seconds (default :data:`STOP_GRACE_SECONDS`) whatever is left gets SIGKILL.
    Returns the PIDs that were signalled.
    """
    grace = STOP_GRACE_SECONDS if grace is None else grace
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil ships with ray; fall back to the group only
        psutil = None
    procs = _descendants(proc.pid)
    if psutil is not None:
        try:
            procs.insert(0, psutil.Process(proc.pid))
        except psutil.Error:
            pass
    pids = {proc.pid} | {p.pid for p in procs}

    groups: set[int] = set()  # process groups led by a process we started

    def signal_all(sig: int) -> None:
        for p in procs:
            try:
                pgid = os.getpgid(p.pid)
            except OSError:
                continue
            if pgid in pids and _alive(p):
                groups.add(pgid)
        if psutil is None and proc.poll() is None:
            groups.add(proc.pid)
        for pgid in groups:
            try:
                os.killpg(pgid, sig)
            except OSError:
                pass
        for p in procs:
            try:
                if os.getpgid(p.pid) not in groups:
                    p.send_signal(sig)  # psutil checks that the PID was not reused
            except Exception:
                pass

    def track(new) -> None:
        for p in new:
            if p.pid not in pids:
                pids.add(p.pid)
                procs.append(p)
                try:
                    p.terminate()
                except Exception:
                    pass

    signal_all(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while True:
        proc.poll()  # reap our direct child
        alive = [p for p in procs if _alive(p)]
        for p in alive:  # processes spawned while shutting down are stopped too
            track(_children(p))
        track(_group_members(groups))  # e.g. a Ray worker whose parent is already gone
        alive = [p for p in procs if _alive(p)]
        if proc.poll() is not None and not alive:
            break
        if time.monotonic() > deadline:
            signal_all(signal.SIGKILL)
            break
        time.sleep(0.05)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:  # pragma: no cover
        pass
    end = time.monotonic() + 5  # SIGKILL is not instant
    while any(_alive(p) for p in procs) and time.monotonic() < end:
        time.sleep(0.05)
    return sorted(pids)


def _group_members(groups: set[int]) -> list:
    """Living processes in the given process groups (groups are looked up by ID, never by name)."""
    if not groups:
        return []
    try:
        import psutil
    except ImportError:  # pragma: no cover
        return []
    out = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) in groups and _alive(p):
                out.append(p)
        except (OSError, psutil.Error):
            continue
    return out


def _alive(p) -> bool:
    try:
        import psutil

        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except Exception:
        return False


def _children(p) -> list:
    try:
        return p.children(recursive=True)
    except Exception:
        return []


class _DeferSignals:
    """Within the block, Ctrl-C / SIGTERM / SIGHUP are recorded instead of interrupting the cleanup;
    the first one is raised (as KeyboardInterrupt) when the block ends, unless ``reraise=False``.
    Main thread only."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self, reraise: bool = True) -> None:
        self.reraise = reraise

    def __enter__(self):
        self.received: list[int] = []
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self.previous[sig] = signal.signal(sig, lambda signum, frame: self.received.append(signum))
        return self

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        if self.received and exc[0] is None and self.reraise:
            raise _Terminated(self.received[0]) if self.received[0] != signal.SIGINT else KeyboardInterrupt()


SUPERVISOR = Path(__file__).with_name("supervisor.py")


def supervised(cmd: list[str], grace: float | None = None) -> list[str]:
    """``cmd`` (the SuperLink) under the run's supervisor (``supervisor.py``, Linux): a subreaper in a
    session of its own that stops every process of the run when this process ends, however it ends
    (SIGKILL included), and holds the run directory's lock until the last of them is gone."""
    if not sys.platform.startswith("linux"):
        return cmd
    grace = STOP_GRACE_SECONDS if grace is None else grace
    exe = cmd[0] if os.path.isabs(cmd[0]) else (shutil.which(cmd[0]) or cmd[0])
    return [sys.executable, str(SUPERVISOR), "--parent", str(os.getpid()), "--grace", f"{grace:g}", "--",
            exe, *cmd[1:]]


def _become_subreaper() -> bool:
    """Linux: orphaned descendants are re-parented to this process instead of PID 1, so
    :func:`_stop_orphans` can stop and reap them (the SuperLink's descendants stay below the run's
    supervisor, itself a subreaper).
    Only for the ``fedpower-run`` process itself, not when used as a library."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def _stop_orphans(grace: float | None = None) -> None:
    """Stop and reap what is left among this process's own children (descendants re-parented to it as
    subreaper), by PID: SIGTERM, SIGKILL after ``grace`` seconds; returns once none is left."""
    grace = STOP_GRACE_SECONDS if grace is None else grace
    try:
        import psutil
    except ImportError:  # pragma: no cover
        psutil = None
    deadline = time.monotonic() + grace
    signalled: set[int] = set()
    while True:
        _reap()
        kids = psutil.Process().children(recursive=True) if psutil is not None else []
        if not kids:
            return
        killing = time.monotonic() > deadline
        for p in kids:
            if _alive(p) and (killing or p.pid not in signalled):
                signalled.add(p.pid)
                try:
                    p.kill() if killing else p.terminate()
                except Exception:
                    pass
        if time.monotonic() > deadline + 5:  # pragma: no cover - unkillable (D state)
            return
        time.sleep(0.05)


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


class _Terminated(KeyboardInterrupt):
    """SIGTERM / SIGHUP, handled like Ctrl-C so the ``finally`` blocks stop the SuperLink."""


def _on_signal(signum, frame):  # noqa: ARG001
    raise _Terminated(signum)
