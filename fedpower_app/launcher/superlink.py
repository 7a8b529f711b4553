"""A local ``flower-superlink`` this process starts, owns and stops (``LocalSuperLink``), kept between the calls of a grid. It runs under the run's supervisor (``supervisor.py``), which stops it and everything below it if this process dies."""


from __future__ import annotations

import atexit
import http.client
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


from .flwr_cli import CONNECTION, LauncherError, _home, _port_is_free, _superlink_exe, default_superlink_port, flwr_env, free_port, output_env
from .processes import _DeferSignals, supervised, terminate_tree
from .ray_cluster import ray_env


SUPERLINK_START_TIMEOUT = 60.0


def _superlink_command(port: int, env: dict[str, str]) -> list[str]:
    cmd = [_superlink_exe(), "--insecure", "--simulation", "--isolation", "subprocess",
           "--host", "127.0.0.1", "--port", str(port), "--database", ":flwr-in-memory:"]
    if env.get("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "").lower() in ("1", "true", "yes"):
        cmd.append("--disable-runtime-dependency-installation")
    return cmd


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _health(port: int) -> bool:
    """True once the SuperLink answers 2xx on /health; any other outcome means "not yet".

    The port is in the kernel's ephemeral range, so while nothing listens on it a connect to it
    can pick the same port as its source and connect to itself (a TCP self-connect). The probe
    then reads back its own request and http.client raises BadStatusLine, an HTTPException and
    not an OSError: that was a failed start in CI (2026-11-25). It is just "not listening yet".
    """
    try:
        with _NO_PROXY.open(f"http://127.0.0.1:{port}/health", timeout=1.0) as resp:
            return 200 <= resp.status < 300
    except (OSError, urllib.error.URLError, http.client.HTTPException, ValueError):
        return False


class LocalSuperLink:
    """A simulation SuperLink owned by this process (see the module docstring)."""

    def __init__(self, flwr_home: str | Path | None, port: int | None = None, *, verbose: bool = False,
                 ray_address: str | None = None, run_lock=None) -> None:
        self.home = _home(flwr_home)
        # The run directory's lock (fedpower_app.runs.owner.RunLock) this SuperLink's run is under: its
        # supervisor holds it too, and every process of the run is marked with the run directory.
        self.run_lock = run_lock
        # The Ray cluster the simulation joins (RAY_ADDRESS in the SuperLink's environment, inherited by
        # flwr-simulation); None: a private Ray instance (ray_cluster.ray_env).
        self.ray_address = ray_address
        self.requested_port = port
        # With an explicit home and no port: the port flwr_env(home) exports, when it is free, so
        # `flwr` calls made with flwr_env(home) reach this SuperLink while it runs.
        self.preferred_port = default_superlink_port(flwr_home) if flwr_home and not port else None
        self.port: int = port or 0
        self.verbose = verbose
        self.proc: subprocess.Popen | None = None
        self.run_dir: Path | None = None
        self.log_path: Path | None = None
        self.env: dict[str, str] = {}
        self.cli_env: dict[str, str] = {}
        self._log = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        """The PID of the process this one started: the run's supervisor, the SuperLink's parent."""
        return self.proc.pid if self.proc else None

    @property
    def superlink_pid(self) -> int | None:
        """The PID of ``flower-superlink`` itself (the supervisor's child)."""
        try:
            import psutil

            kids = psutil.Process(self.pid).children() if self.pid else []
        except Exception:
            return None
        return kids[0].pid if kids else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = SUPERLINK_START_TIMEOUT) -> "LocalSuperLink":
        for attempt in range(3):  # a free port can be taken between probe and bind
            self.port = self._pick_port(attempt)
            try:
                self._spawn(timeout)
                return self
            except LauncherError:
                if attempt == 2 or not self._port_was_taken():
                    raise
                shutil.rmtree(self.run_dir, ignore_errors=True)
        return self  # pragma: no cover

    def _pick_port(self, attempt: int) -> int:
        wanted = self.requested_port or self.preferred_port
        if attempt == 0 and wanted and _port_is_free(wanted):
            return wanted
        if attempt == 0 and self.requested_port:  # never share a SuperLink someone else started
            port = free_port()
            print(f"fedpower-run: port {self.requested_port} is in use (by a SuperLink or anything else this "
                  f"process did not start); its own SuperLink takes port {port}", file=sys.stderr, flush=True)
            return port
        return free_port()

    def _port_was_taken(self) -> bool:
        text = self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""
        return "address already in use" in text.lower()

    def _spawn(self, timeout: float) -> None:
        self.env = {**output_env(flwr_env(self.home, self.port), self.verbose), **ray_env(self.ray_address),
                    **(self.run_lock.env() if self.run_lock is not None else {})}
        self.run_dir = self.home / "fedpower-run" / f"{os.getpid()}-{self.port}"
        self.run_dir.mkdir(parents=True, exist_ok=True)
        cli_home = self.run_dir / "cli"
        cli_home.mkdir(exist_ok=True)
        (cli_home / "config.toml").write_text(
            f'# written by fedpower-run for its own SuperLink (pid {os.getpid()}); removed when it stops\n'
            f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
            f'address = "{self.address}"\ninsecure = true\n')
        self.cli_env = {**self.env, "FLWR_HOME": str(cli_home)}
        self.log_path = self.run_dir / "superlink.log"
        self._log = open(self.log_path, "ab")
        cmd = supervised(_superlink_command(self.port, self.env))
        # The cwd is inherited: the ServerApp resolves a relative output-dir against it. The supervisor
        # gets the run directory's lock (pass_fds) and keeps it until the run's last process is gone.
        fds = (self.run_lock.fd,) if self.run_lock is not None else ()
        self.proc = subprocess.Popen(cmd, env=self.env, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True, pass_fds=fds)
        _STARTED.append(self)
        if self.run_lock is not None:
            self.run_lock.note(supervisor={"pid": self.proc.pid}, superlink_port=self.port)
        deadline = time.monotonic() + timeout
        while not _health(self.port):
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.stop(keep_logs=True)
                raise LauncherError(f"flower-superlink exited with code {code} at start; see {self.log_path}")
            if time.monotonic() > deadline:
                self.stop(keep_logs=True)
                raise LauncherError(f"flower-superlink did not answer on {self.address} within {timeout:.0f} s; "
                                    f"see {self.log_path}")
            time.sleep(0.1)

    def stop(self, *, keep_logs: bool = False, grace: float | None = None) -> list[int]:
        """Terminate the SuperLink and every process below it (by PID); remove the private CLI home
        (and the SuperLink log unless ``keep_logs``). Idempotent."""
        pids: list[int] = []
        with _DeferSignals():
            if self.proc is not None:
                pids = terminate_tree(self.proc, grace)
            self._cleanup(keep_logs)
        return pids

    def _cleanup(self, keep_logs: bool) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
        if self in _STARTED:
            _STARTED.remove(self)
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir / "cli", ignore_errors=True)
            if not keep_logs:
                shutil.rmtree(self.run_dir, ignore_errors=True)
                try:
                    self.run_dir.parent.rmdir()  # only if empty
                except OSError:
                    pass

    def __enter__(self) -> "LocalSuperLink":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop(keep_logs=exc[0] is not None)


_STARTED: list[LocalSuperLink] = []  # SuperLinks this process started and has not stopped yet


@atexit.register
def _stop_all_at_exit() -> None:
    for link in list(_STARTED):
        link.stop()


def _kept_superlink(home: Path, port: int | None, ray_address: str | None = None) -> LocalSuperLink | None:
    for link in _STARTED:
        if (link.home == home and (port is None or port in (link.port, link.requested_port))
                and link.ray_address == ray_address and link.alive()):
            return link
    return None


def stop_local_superlink(flwr_home: str | Path | None = None) -> list[int]:
    """Stop the SuperLinks this process started for ``flwr_home`` (default ``$FLWR_HOME`` or
    ``~/.flwr``) and kept for reuse, with all their processes, by PID. Never touches processes
    started by anyone else. Returns the PIDs that were signalled."""
    home = _home(flwr_home)
    pids: list[int] = []
    for link in [link for link in _STARTED if link.home == home]:
        pids += link.stop()
    return pids
