"""One owner per run directory: ``<run dir>/owner.lock``.

The launcher that runs or resumes a run takes an exclusive ``flock`` on ``owner.lock`` before it
writes anything there, and keeps it for the whole run; the run's supervisor
(``fedpower_app.launcher.supervisor``) inherits the same open file, so the lock is held until the
launcher *and* the last process of its run are gone. The kernel releases it when they die, SIGKILL
included: a lock is never stale. The file's text says who holds it (launcher PID and start time,
supervisor PID, host, since when); it is only read to explain a refusal.

Every process of a run carries ``FEDPOWER_RUN_DIR=<run dir>`` in its environment (set in the
supervisor's, inherited by the SuperLink, SuperExec, simulation and Ray). :func:`claim_run_dir`
uses it to find leftovers: processes of the run whose launcher is dead (still being stopped by
their supervisor, or left by a supervisor that was killed too). It stops them, by PID, and says so.
A run directory whose launcher is alive is refused, with one line naming its PIDs.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import Callable

from ..config import ConfigError

LOCK_FILE = "owner.lock"
RUN_DIR_ENV = "FEDPOWER_RUN_DIR"
LEFTOVER_WAIT_SECONDS = 20.0  # how long a resume waits for a killed run's processes to stop
LEFTOVER_GRACE_SECONDS = 3.0


class RunDirInUse(ConfigError):
    """The run directory is owned by a live launcher, or its leftovers could not be stopped."""


def _start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot, /proc/<pid>/stat field 22): a PID and its start
    time name one process, also after the PID is reused. None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().decode(errors="replace").rsplit(")", 1)[-1].split()
    except OSError:
        return None
    if fields[0] == "Z":
        return None
    return int(fields[19])


def _is(pid: int | None, start: int | None) -> bool:
    return bool(pid) and start is not None and _start_time(int(pid)) == start


def run_processes(run_dir: Path | str) -> list[int]:
    """PIDs of the living processes whose environment holds ``FEDPOWER_RUN_DIR=<run_dir>`` (this
    process excluded): the processes of that run, whoever started them."""
    marker = f"{RUN_DIR_ENV}={Path(run_dir).resolve()}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as fh:
                environ = fh.read().split(b"\0")
        except OSError:  # gone, or another user's
            continue
        if marker in environ and _start_time(int(name)) is not None:
            found.append(int(name))
    return sorted(found)


def _stop(pids: list[int], grace: float) -> list[int]:
    """SIGTERM, then SIGKILL after ``grace`` s, to each PID (checked by start time); the ones left."""
    procs = {pid: _start_time(pid) for pid in pids}
    for pid, start in procs.items():
        if _is(pid, start):
            try:
                os.kill(pid, signal.SIGTERM)
            except OSError:
                pass
    deadline = time.monotonic() + grace
    while (left := [p for p, s in procs.items() if _is(p, s)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    deadline = time.monotonic() + 5
    while (left := [p for p, s in procs.items() if _is(p, s)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


class RunLock:
    """The held lock of one run directory (see the module docstring). ``fd`` is what the launcher passes
    to the run's supervisor; :meth:`release` (or process exit) gives the directory up."""

    def __init__(self, run_dir: Path, fd: int) -> None:
        self.run_dir = run_dir
        self.path = run_dir / LOCK_FILE
        self.fd = fd
        self.record: dict = {}

    def env(self) -> dict[str, str]:
        """The environment entry that marks every process of this run."""
        return {RUN_DIR_ENV: str(self.run_dir)}

    def note(self, **fields) -> None:
        """Add ``fields`` to the owner record (rewritten in place: the locked file is never replaced)."""
        self.record.update(fields)
        data = (json.dumps(self.record, indent=1) + "\n").encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)

    def release(self) -> None:
        if self.fd >= 0:
            fcntl.flock(self.fd, fcntl.LOCK_UN)  # also for a supervisor that still shares the file
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _try_lock(path: Path) -> int | None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def read_owner(run_dir: Path | str) -> dict:
    """The owner record of a run directory ({} when none was written or it is unreadable)."""
    try:
        return json.loads((Path(run_dir) / LOCK_FILE).read_text() or "{}")
    except (OSError, ValueError):
        return {}


def claim_run_dir(run_dir: Path | str, *, command: str = "fedpower-run",
                  say: Callable[[str], None] = print, wait: float = LEFTOVER_WAIT_SECONDS) -> RunLock:
    """Take ``run_dir``'s lock for this process, or raise :class:`RunDirInUse` (one line, with PIDs).

    * Free lock: the directory is ours. Leftovers of the run (processes marked with its directory whose
      supervisor is gone) are stopped first, and said so.
    * Held by a live launcher: refused, naming the launcher and its run's PIDs.
    * Held after its launcher died (its supervisor is still stopping the run's processes): the
      leftovers are stopped (SIGTERM, then SIGKILL), said so, and the lock is taken once they are
      gone, within ``wait`` seconds; otherwise refused with their PIDs.
    """
    run_dir = Path(run_dir).expanduser().resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    fd = _try_lock(path)
    if fd is None:
        owner = read_owner(run_dir)
        launcher = owner.get("launcher") or {}
        if _is(launcher.get("pid"), launcher.get("start")):
            pids = [p for p in run_processes(run_dir) if p != launcher["pid"]]
            raise RunDirInUse(
                f"{run_dir} is in use by {owner.get('command', 'a launcher')} pid {launcher['pid']} (since "
                f"{owner.get('since', '?')}" + (f"; its run's processes: pids {', '.join(map(str, pids))}" if pids else "")
                + "): stop it first, or give a new run another run-name")
        leftovers = run_processes(run_dir)
        say(f"{command}: the launcher that owned {run_dir} is gone; stopping its run's "
            f"{len(leftovers)} leftover process(es): pids {', '.join(map(str, leftovers)) or 'none found'}")
        _stop(leftovers, LEFTOVER_GRACE_SECONDS)
        deadline = time.monotonic() + wait
        while (fd := _try_lock(path)) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if fd is None:
            left = run_processes(run_dir)
            raise RunDirInUse(f"{run_dir} is still locked {wait:.0f} s after its launcher died"
                              + (f"; its run's processes left: pids {', '.join(map(str, left))}" if left else
                                 f"; the lock's holder: {owner or 'unrecorded'}")
                              + ": stop them, then resume")
    else:
        leftovers = run_processes(run_dir)
        if leftovers:
            say(f"{command}: stopping {len(leftovers)} leftover process(es) of an earlier launcher of {run_dir} "
                f"(its supervisor is gone): pids {', '.join(map(str, leftovers))}")
            left = _stop(leftovers, LEFTOVER_GRACE_SECONDS)
            if left:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
                raise RunDirInUse(f"{run_dir}: leftover processes of an earlier run could not be stopped: pids "
                                  f"{', '.join(map(str, left))}")
    lock = RunLock(run_dir, fd)
    lock.note(command=command, launcher={"pid": os.getpid(), "start": _start_time(os.getpid())},
              host=socket.gethostname(), since=time.strftime("%Y-%m-%d %H:%M:%S %Z"))
    return lock
