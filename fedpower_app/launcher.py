"""``fedpower-run``: run the app through ``flwr run`` on a SuperLink this process owns, and report
the run's real status.

    fedpower-run                                   # default config, 6 simulated silos
    fedpower-run --preset conf/tiny.toml --set num-server-rounds=3 --set strategy.name='"fedlora"'
    fedpower-run --verbose ...                     # everything Flower, Ray and transformers print

What it does, in order:

1. **Validates the configuration before anything starts.** pyproject defaults + ``--preset`` +
   ``--set`` go through :func:`fedpower_app.config.validate_overrides` (the ServerApp's own
   ``parse_config``), plus the checks that involve the simulation flags or the file system
   (``--supernodes`` against ``strategy.min-nodes``, ``device = "cuda"`` without
   ``--gpus-per-client``, a ``task.data-dir`` that does not exist). A bad value exits 2 with one
   line naming the key, in well under a second, without starting any process.
2. **Starts its own SuperLink** as a child process: ``flower-superlink --insecure --simulation
   --isolation subprocess --host 127.0.0.1 --port <port> --database :flwr-in-memory:
   --disable-runtime-dependency-installation``, in a new session (``start_new_session=True``), and
   waits until its HTTP API (Control, Fleet and Runtime APIs share one port in Flower 1.41)
   answers ``/health``. The port: free, and stable per ``--flwr-home`` when that port is free; a
   busy requested port is replaced by a free one (never share a SuperLink someone else started). Its
   output goes to ``$FLWR_HOME/fedpower-run/<pid>-<port>/superlink.log``, kept only if it fails
   to start.
3. **Runs** ``flwr run <app> fedpower-run --stream`` against it. The connection
   ``fedpower-run`` (explicit address ``127.0.0.1:<port>``, ``insecure = true``) lives in the
   ``config.toml`` of a private CLI home (``$FLWR_HOME/fedpower-run/<pid>-<port>/``), given to the
   ``flwr`` CLI processes only as their ``FLWR_HOME``; the user's ``$FLWR_HOME/config.toml`` is
   never touched. The SuperLink and the simulation keep the real ``FLWR_HOME`` (installed apps).
   ``--federation-config "num-supernodes=..."`` works as with ``:local:`` (it is a per-run
   ``SimulationConfig`` that any ``--simulation`` SuperLink accepts).
4. **Checks the status** with ``flwr ls --run-id <id> --format json`` while the SuperLink is still
   up (``flwr run`` exits 0 when a run fails), stops a run that is still going (``flwr stop``).
5. **Stops everything it started, by PID**, in a ``finally`` (success, failure, Ctrl-C, SIGTERM,
   SIGHUP): :func:`terminate_tree` snapshots the SuperLink's descendants (``flower-superexec``
   runs in a session of its own, ``flwr-simulation`` and Ray below it), sends SIGTERM to the
   process groups they lead and to each PID, waits :data:`STOP_GRACE_SECONDS`, then SIGKILLs what
   is left. ``fedpower-run`` is also a child subreaper (``PR_SET_CHILD_SUBREAPER``), so processes
   orphaned on the way (e.g. ``flwr-simulation`` once its SuperExec exited) come back to it and
   are stopped and reaped rather than left as zombies. A second Ctrl-C during this cleanup is
   deferred, not allowed to interrupt it. Nothing is ever matched by name or pattern.

Why not ``flwr run`` with the ``:local:`` connection: it spawns a *detached, persistent*
``flower-superlink`` (``flwr/cli/local_superlink.py``) whose PID nobody records, shared by every
user of the same port, which leaves the SuperLink, a SuperExec and a zombie ``flwr-simulation``
behind and could only be stopped by pattern (``pkill -f``). An explicit-address connection also
means a dead SuperLink gives a connection error instead of silently spawning a new detached one.

Library use (:func:`run_flwr`, e.g. ``fedpower-experiment``): by default the SuperLink is kept for
the next call with the same ``flwr_home`` (a grid of cells reuses it; ``flwr ls``/``flwr stop``
with ``flwr_env(flwr_home, port)`` reach it between calls) and stopped by
:func:`stop_local_superlink`, at interpreter exit, or - when started from the main thread - by the
kernel if this process dies (``PR_SET_PDEATHSIG``). ``keep_superlink=False`` stops it before
returning; ``fedpower-run`` always does.

Console: unless ``--verbose``, known-harmless noise is switched off in the environment of the
processes started (:data:`QUIET_ENV`: Ray's and transformers' FutureWarnings, torch's warning under
Opacus' hooks, model-loading progress bars) and hidden from the streamed output
(:data:`NOISE_PATTERNS`, :class:`ConsoleFilter`: Flower notices, Flower records repeated by the
root logger, a traceback repeated verbatim); the full output is still returned in
:class:`RunOutcome`. A failed run ends with one ``fedpower-run: error`` line naming the run's
status and the exception that caused it. ``--verbose`` shows everything, with Flower's DEBUG log.

Exit codes: 0 run completed, 1 run failed (or stopped), 2 bad arguments or configuration, or the
SuperLink could not be started, 130 interrupted (Ctrl-C, SIGTERM, SIGHUP).
"""

from __future__ import annotations

import argparse
import atexit
import collections
import hashlib
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from .config import PROJECT_ROOT, ConfigError, RunConfig, SCHEMA, load_preset, validate_overrides, with_method_preset

OFFLINE_ENV = {
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",  # no `uv sync` of torch per run (offline, fast)
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "RAY_DEDUP_LOGS": "0",
    "TOKENIZERS_PARALLELISM": "false",
}

# Environment of the SuperLink (hence the simulation and Ray) unless --verbose: silence known-harmless
# output at its source. Python warning filters name the module that issues the warning.
QUIET_ENV = {
    # "FutureWarning: Tip: In future versions of Ray, Ray will no longer override accelerator visible
    # devices ..." (every Ray init) and transformers' "`is_gradient_checkpointing` is deprecated" (PEFT).
    # Opacus' per-example gradient hooks on LoRA layers whose inputs (frozen base) need no gradient:
    # torch's "Full backward hook is firing when gradients are computed with respect to module
    # outputs since no inputs require gradients" (harmless: Opacus uses the output gradients).
    "PYTHONWARNINGS": ",".join([
        "ignore::FutureWarning:ray._private.worker",
        "ignore::FutureWarning:transformers.modeling_utils",
        "ignore:Full backward hook is firing when gradients are computed with respect to module outputs:UserWarning",
    ]),
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # "Loading weights: 100%|####| 103/103" per process
}
# (Not RAY_BACKEND_LOG_LEVEL: Ray's C++ logs go to files anyway, and setting it makes every raylet
# print "Set ray log level from environment variable RAY_BACKEND_LOG_LEVEL" on the console.)
# --verbose: everything back, plus Flower's DEBUG log (with timestamps) and fedpower's DEBUG lines.
VERBOSE_ENV = {"FLWR_LOG_LEVEL": "DEBUG", "FEDPOWER_VERBOSE": "1"}

CONNECTION = "fedpower-run"  # name of the connection in the private CLI home
SUPERLINK_START_TIMEOUT = 60.0
# run_flwr(timeout=T) interrupts `flwr run` at T + this: a caller's own watchdog on the same T
# (fedpower-experiment's) acts first and can tell that it did.
TIMEOUT_GRACE_SECONDS = 1.0
STOP_GRACE_SECONDS = 3.0  # flwr-simulation and Ray can take longer than this on SIGTERM; they get SIGKILL


class LauncherError(RuntimeError):
    """The launcher could not start or talk to its SuperLink."""


@dataclass
class RunOutcome:
    run_id: str | None
    status: str
    returncode: int
    seconds: float
    output: str
    timed_out: bool = False  # run_flwr(timeout=...) had to stop `flwr run`

    @property
    def ok(self) -> bool:
        return self.status == "finished:completed"

    def error_summary(self) -> str | None:
        """The exception that ended a failed run, as one line (``ConfigError: config key ...``)."""
        return last_exception_line(self.output)


def toml_value(value: Any) -> str:
    """A run-config value as TOML (strings quoted), for ``--run-config``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))


def run_config_arg(overrides: dict[str, Any]) -> str:
    unknown = sorted(set(overrides) - set(SCHEMA))
    if unknown:
        raise ConfigError(f"unknown config key(s): {', '.join(unknown)}")
    return " ".join(f"{k}={toml_value(v)}" for k, v in overrides.items())


def flwr_env(flwr_home: str | Path | None, superlink_port: int | None = None) -> dict[str, str]:
    """Environment for ``flwr``: offline settings, FLWR_HOME and, optionally, private SuperLink ports
    (``FLWR_LOCAL_*``: a ``:local:`` connection then reaches the SuperLink :func:`run_flwr` keeps on
    that port)."""
    env = dict(os.environ)
    env.update({k: env.get(k, v) for k, v in OFFLINE_ENV.items()})
    # flwr spawns flower-superlink / flwr-simulation by name: make this interpreter's scripts findable
    # even when the venv is not activated.
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in env.get("PATH", "").split(os.pathsep):
        env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    if superlink_port is None and flwr_home:
        superlink_port = default_superlink_port(flwr_home)
    if superlink_port:
        env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"] = str(superlink_port)
        env["FLWR_LOCAL_CONTROL_API_PORT"] = str(superlink_port + 2)
    if flwr_home:
        env["FLWR_HOME"] = str(Path(flwr_home).expanduser().resolve())
        Path(env["FLWR_HOME"]).mkdir(parents=True, exist_ok=True)
    return env


def output_env(env: dict[str, str], verbose: bool) -> dict[str, str]:
    """``env`` plus the console settings: :data:`QUIET_ENV` by default, :data:`VERBOSE_ENV` with --verbose."""
    env = dict(env)
    if verbose:
        env.update(VERBOSE_ENV)
        return env
    for key, value in QUIET_ENV.items():
        if key == "PYTHONWARNINGS" and env.get(key):
            env[key] = f"{env[key]},{value}"  # keep the user's filters
        else:
            env.setdefault(key, value)
    return env


def default_superlink_port(flwr_home: str | Path) -> int:
    """A stable port per FLWR_HOME (what :func:`flwr_env` exports when no port is given)."""
    digest = hashlib.sha256(str(Path(flwr_home).expanduser().resolve()).encode()).digest()
    return 40000 + int.from_bytes(digest[:2], "little") % 20000 // 4 * 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_is_free(port: int | None) -> bool:
    if not port:
        return False
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _num(value: float) -> str:
    """Flower rejects `num-cpus=2.0`: whole numbers as ints."""
    return str(int(value)) if float(value).is_integer() else str(value)


def _flwr() -> str:
    exe = shutil.which("flwr") or str(Path(sys.executable).with_name("flwr"))
    if not Path(exe).exists() and not shutil.which("flwr"):
        raise RuntimeError("the `flwr` command was not found; install the project (pip install -e .)")
    return exe


def _superlink_exe() -> str:
    exe = Path(sys.executable).with_name("flower-superlink")
    found = str(exe) if exe.exists() else shutil.which("flower-superlink")
    if not found:
        raise LauncherError("the `flower-superlink` command was not found; install flwr[simulation]")
    return found


def _home(flwr_home: str | Path | None) -> Path:
    return Path(flwr_home or os.environ.get("FLWR_HOME") or Path.home() / ".flwr").expanduser().resolve()


# ------------------------------------------------------------------------------------------------
# Processes: started in a session of their own, stopped by PID
# ------------------------------------------------------------------------------------------------

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


_PDEATHSIG = ("import ctypes, os, sys\n"
              "parent = int(sys.argv[1])\n"
              "ctypes.CDLL(None, use_errno=True).prctl(1, 15)  # PR_SET_PDEATHSIG = SIGTERM\n"
              "if os.getppid() != parent:\n    sys.exit(1)  # the launcher died before prctl\n"
              "os.execv(sys.argv[2], sys.argv[2:])\n")


def _die_with_parent(cmd: list[str]) -> list[str]:
    """``cmd`` behind a tiny trampoline that sets PR_SET_PDEATHSIG (Linux, main thread only: the
    signal follows the *thread* that forked), so the SuperLink gets SIGTERM if this process is killed
    without running its cleanup. No ``preexec_fn`` (not safe with threads)."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return cmd
    exe = cmd[0] if os.path.isabs(cmd[0]) else (shutil.which(cmd[0]) or cmd[0])
    return [sys.executable, "-c", _PDEATHSIG, str(os.getpid()), exe, *cmd[1:]]


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

    def __init__(self, flwr_home: str | Path | None, port: int | None = None, *, verbose: bool = False) -> None:
        self.home = _home(flwr_home)
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
        return self.proc.pid if self.proc else None

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
        self.env = output_env(flwr_env(self.home, self.port), self.verbose)
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
        cmd = _die_with_parent(_superlink_command(self.port, self.env))
        # The cwd is inherited: the ServerApp resolves a relative output-dir against it.
        self.proc = subprocess.Popen(cmd, env=self.env, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        _STARTED.append(self)
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


def _kept_superlink(home: Path, port: int | None) -> LocalSuperLink | None:
    for link in _STARTED:
        if link.home == home and (port is None or port in (link.port, link.requested_port)) and link.alive():
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


# ------------------------------------------------------------------------------------------------
# Console: known-harmless noise, duplicate log records
# ------------------------------------------------------------------------------------------------

ANSI_RE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
LEVELS = "DEBUG|INFO|WARNING|ERROR|CRITICAL"
# Flower's console handler (also used by the fedpower logger): "INFO :      message", optionally
# prefixed by Ray's "(ClientAppActor pid=123) " and with a timestamp in DEBUG mode.
CONSOLE_RE = re.compile(rf"^(?P<actor>\(\w+ pid=\d+\)\s?)?(?P<level>{LEVELS})"
                        rf"(?: \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d,\d+)? ?:\s?(?P<msg>.*)$")
# The same Flower records a second time through the root logger, which `opacus` configures with
# logging.basicConfig at import ("11/23/2026 14:27:35:ERROR:Simulation raised an exception").
ROOT_RE = re.compile(rf"^(?P<actor>\(\w+ pid=\d+\)\s?)?\d\d/\d\d/\d{{4}} \d\d:\d\d:\d\d:(?P<level>{LEVELS}):(?P<msg>.*)$")

# Known-harmless lines hidden unless --verbose: (pattern searched in the line without colours, why).
# Never add a pattern that could match an ERROR line, a fedpower warning or a traceback.
NOISE_PATTERNS: list[tuple[re.Pattern, str]] = [(re.compile(p), why) for p, why in [
    (r"Since flwr 1\.32, default simulated SuperNodes changed from 10 to 2",
     "Flower notice printed by every run; fedpower-run always passes num-supernodes"),
    (r"To change federation size, use the following command", "Flower hint; use --supernodes"),
    (r"\bflwr federation simulation-config \S+ <superlink> --num-supernodes <N>", "second line of that hint"),
    (r"^Successfully installed \S+ to \S+", "the FAB unpacked into $FLWR_HOME/apps for every run"),
    (r"WARNING :\s+Manually terminating ClientAppActor", "Ray actors stopped at the end of every run"),
    (r"FutureWarning: `is_gradient_checkpointing` is deprecated",
     "transformers deprecation triggered inside PEFT (not our code)"),
    (r"FutureWarning: Tip: In future versions of Ray, Ray will no longer override accelerator",
     "Ray notice printed by every Ray start (fedpower sets the GPU fraction explicitly)"),
    (r"UserWarning: Full backward hook is firing when gradients are computed with respect to module outputs "
     r"since no inputs require gradients", "torch, under Opacus' per-example gradient hooks (see QUIET_ENV)"),
    (r"^(\(\w+ pid=\d+\)\s?)?Loading weights:\s+\d+%\|", "transformers progress bar (one per process)"),
]]
# The source line Python prints under a warning ("  warnings.warn(", "  loss.backward()"): hidden
# only right after a hidden warning.
_WARN_CONTINUATION = re.compile(r"^(\(\w+ pid=\d+\)\s?)?  \S")


TRACEBACK_START = "Traceback (most recent call last):"
_ACTOR = re.compile(r"^\(\w+ pid=\d+\)\s?")


class ConsoleFilter:
    """Decides what of ``flwr run --stream``'s output reaches the console: :meth:`feed` takes one
    line and returns the lines to print now (usually it or nothing; a traceback is held until its
    last line), :meth:`flush` returns what is still held at the end.

    Hidden:

    * lines matching :data:`NOISE_PATTERNS`, and the source line Python prints under a hidden warning;
    * Flower records repeated by the root logger (``opacus`` calls ``logging.basicConfig``): their
      DEBUG records, and repeats of a record already shown together with its continuation lines (the
      repeated traceback) - only lines equal to the ones already shown are dropped;
    * a traceback identical to one already shown (Flower logs a failing ClientApp load twice): it is
      replaced by one line naming its exception, keeping the ERROR record it belongs to;
    * empty log records.

    ERROR and CRITICAL records, the first copy of every traceback and anything unknown always pass.
    """

    MAX_REMEMBERED = 500
    MAX_TRACEBACK = 2000

    def __init__(self) -> None:
        self._blocks: collections.OrderedDict[str, list[str]] = collections.OrderedDict()
        self._current: list[str] | None = None
        self._expect: collections.deque[str] | None = None
        self._hid_warning = False
        self._tb: list[tuple[str, str]] | None = None  # held traceback: (raw line, structure text)
        self._tracebacks: set[tuple[str, ...]] = set()

    def feed(self, line: str) -> list[str]:
        plain = ANSI_RE.sub("", line.rstrip("\r\n"))
        hid_warning, self._hid_warning = self._hid_warning, False
        # 1. root-logger repeats of Flower records
        if self._expect is not None:  # inside a repeated block: drop what was already shown
            if self._expect and plain == self._expect[0]:
                self._expect.popleft()
                return []
            self._expect = None
        record = None
        if m := ROOT_RE.match(plain):
            self._current = None
            msg = m["msg"].strip()
            if m["level"] == "DEBUG":
                return []
            if msg in self._blocks:
                self._expect = collections.deque(self._blocks[msg])
                return []
            record = (m["level"], msg)
        elif m := CONSOLE_RE.match(plain):
            record = (m["level"], m["msg"].strip())
            self._current = self._remember(record[1])
        elif self._current is not None and len(self._current) < 200:
            self._current.append(plain)
        # 2. tracebacks: held until complete, shown once
        text = record[1] if record else _ACTOR.sub("", plain)
        out: list[str] = []
        if self._tb is not None:
            if text != TRACEBACK_START:
                self._tb.append((line, text))
                if (text[:1] not in (" ", "\t") or not text) or len(self._tb) > self.MAX_TRACEBACK:
                    return self._close_traceback()  # the exception line (or the block broke off)
                return []
            out = self._close_traceback()
        if text == TRACEBACK_START:
            self._tb = [(line, text)]
            return out
        # 3. noise
        if record is not None:
            level, msg = record
            if level in ("ERROR", "CRITICAL"):
                return out + [line]
            return out + ([line] if msg and not self._noise(plain) else [])
        if hid_warning and _WARN_CONTINUATION.match(plain):
            return out
        if self._noise(plain):
            self._hid_warning = "Warning:" in plain
            return out
        if re.fullmatch(r"\(\w+ pid=\d+\)\s*", plain):  # Ray's prefix before a progress bar
            return out
        return out + [line]

    def flush(self) -> list[str]:
        return self._close_traceback() if self._tb is not None else []

    def _close_traceback(self) -> list[str]:
        block, self._tb = self._tb or [], None
        key = tuple(text for _, text in block)
        if key not in self._tracebacks:
            self._tracebacks.add(key)
            return [raw for raw, _ in block]
        first = block[0][0]
        exc = block[-1][1].strip() if len(block) > 1 else ""
        note = f"(the same traceback as above{': ' + exc if exc else ''})"
        return [first.replace(TRACEBACK_START, note, 1)]

    def _remember(self, msg: str) -> list[str]:
        block: list[str] = []
        self._blocks[msg] = block
        self._blocks.move_to_end(msg)
        while len(self._blocks) > self.MAX_REMEMBERED:
            self._blocks.popitem(last=False)
        return block

    @staticmethod
    def _noise(plain: str) -> bool:
        return any(p.search(plain) for p, _ in NOISE_PATTERNS)


def filter_lines(lines: Iterable[str]) -> list[str]:
    """The lines :class:`ConsoleFilter` lets through, in order (for tests and post-processing)."""
    f = ConsoleFilter()
    out = [kept for line in lines for kept in f.feed(line)]
    return out + f.flush()


_EXC_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?(?P<name>[A-Z]\w*(?:Error|Exception|Exhausted|Interrupt|Exit))"
                       r"(?::\s*(?P<msg>.*))?$")
_CHAINED = ("The above exception was the direct cause of the following exception:",
            "During handling of the above exception, another exception occurred:")


def last_exception_line(output: str) -> str | None:
    """The exception that ended the last traceback in ``output``, as ``SomeError: message`` (module
    path removed). For chained exceptions, the first of the chain (the cause, not Flower's wrapper)."""
    found = None
    chained = False
    for line in output.splitlines():
        plain = _ACTOR.sub("", ANSI_RE.sub("", line).strip()).strip()
        if plain in _CHAINED:
            chained = True
        elif (m := _EXC_LINE.match(plain)) and m["msg"] is not None:
            if not chained:
                found = f"{m['name']}: {m['msg']}"
            chained = False
    return found


# ------------------------------------------------------------------------------------------------
# flwr run
# ------------------------------------------------------------------------------------------------

def run_status(run_id: str, env: dict[str, str], connection: str | None = None) -> str:
    """Status of a run from ``flwr ls --run-id ... --format json`` (e.g. finished:completed)."""
    cmd = [_flwr(), "ls", *([connection] if connection else []), "--run-id", str(run_id), "--format", "json"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    try:
        runs = json.loads(out.stdout).get("runs", [])
    except json.JSONDecodeError:
        return f"unknown ({out.stdout.strip()[:200]} {out.stderr.strip()[:200]})"
    for run in runs:
        if str(run.get("run-id")) == str(run_id):
            return str(run.get("status"))
    return "unknown (run not listed)"


def _stop_run(run_id: str, env: dict[str, str]) -> None:
    try:
        subprocess.run([_flwr(), "stop", str(run_id), CONNECTION], env=env, capture_output=True, text=True,
                       timeout=60, check=False)
    except (OSError, subprocess.SubprocessError):
        pass


def run_flwr(
    app_dir: str | Path = PROJECT_ROOT,
    overrides: dict[str, Any] | None = None,
    *,
    preset: str | Path | None = None,
    num_supernodes: int = 6,
    cpus_per_client: float = 1,
    gpus_per_client: float = 0.0,
    flwr_home: str | Path | None = None,
    superlink_port: int | None = None,
    echo: bool = True,
    timeout: float | None = None,
    verbose: bool = False,
    keep_superlink: bool = True,
) -> RunOutcome:
    """Run the app with ``flwr run --stream`` on a SuperLink this process owns; return its real status.

    The SuperLink listens on ``superlink_port`` (default: :func:`default_superlink_port` of an explicit
    ``flwr_home`` if free, else a free port) with ``FLWR_HOME = flwr_home``.
    With ``keep_superlink`` (default) it is reused by the next call for the same home and stopped by
    :func:`stop_local_superlink` or at exit; otherwise it is stopped (by PID, with everything it
    started) before returning - also when this raises or is interrupted. ``echo`` prints the output
    through :class:`ConsoleFilter` (everything with ``verbose``); ``RunOutcome.output`` is unfiltered.
    """
    cmd = [_flwr(), "run", str(app_dir), CONNECTION, "--stream",
           "--federation-config",
           f"num-supernodes={num_supernodes} client-resources-num-cpus={_num(cpus_per_client)} "
           f"client-resources-num-gpus={_num(gpus_per_client)}"]
    # flwr refuses a TOML file together with key=value pairs, so a preset is merged into the pairs.
    merged = {**(load_preset(preset) if preset else {}), **(overrides or {})}
    if merged:
        cmd += ["--run-config", run_config_arg(merged)]
    t0 = time.time()
    link = _kept_superlink(_home(flwr_home), superlink_port) if keep_superlink else None
    started_here = link is None
    try:
        if link is None:
            link = LocalSuperLink(flwr_home, superlink_port, verbose=verbose).start()
            if echo and verbose:
                print(f"fedpower-run: SuperLink pid {link.pid} on {link.address} (log {link.log_path})", flush=True)
        run_id, returncode, output, timed_out = _stream(cmd, link.cli_env, echo=echo, verbose=verbose,
                                                        timeout=timeout, t0=t0)
        status = run_status(run_id, link.cli_env, CONNECTION) if run_id else "not-started"
        if run_id and not status.startswith("finished"):  # timed out or interrupted: do not leave it running
            _stop_run(run_id, link.cli_env)
            status = run_status(run_id, link.cli_env, CONNECTION)
        return RunOutcome(run_id, status, returncode, time.time() - t0, output, timed_out)
    finally:
        if link is not None and (started_here and not keep_superlink or not link.alive()):
            pids = link.stop()
            if echo and verbose:
                print(f"fedpower-run: stopped SuperLink pid {link.pid} and {len(pids) - 1} process(es) it started",
                      flush=True)


def _stream(cmd: list[str], env: dict[str, str], *, echo: bool, verbose: bool, timeout: float | None,
            t0: float) -> tuple[str | None, int, str, bool]:
    """Run ``flwr run --stream``, echo its (filtered) output; (run id, exit code, full output,
    whether the timeout stopped it).

    ``timeout`` counts from ``t0`` (SuperLink start included) and is enforced by a timer, also when
    ``flwr run`` prints nothing: SIGINT (after :data:`TIMEOUT_GRACE_SECONDS` more), then SIGTERM
    5 s later if it is still there.
    """
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1, errors="replace")
    timers: list[threading.Timer] = []

    expired: list[int] = []

    def expire(sig: int) -> None:
        if proc.poll() is None:
            expired.append(sig)
            proc.send_signal(sig)
            if sig == signal.SIGINT:
                later = threading.Timer(5.0, expire, (signal.SIGTERM,))
                later.daemon = True
                timers.append(later)
                later.start()

    if timeout is not None:
        delay = max(0.0, t0 + timeout + TIMEOUT_GRACE_SECONDS - time.time())
        timers.append(threading.Timer(delay, expire, (signal.SIGINT,)))
        timers[0].daemon = True
        timers[0].start()
    console = ConsoleFilter()
    lines: list[str] = []
    run_id = None

    def show(out: list[str]) -> None:
        if echo and out:
            sys.stdout.write("".join(out))
            sys.stdout.flush()

    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            show([line] if verbose else console.feed(line))
            if run_id is None and (m := re.search(r"started run (\d+)", line)):
                run_id = m.group(1)
        proc.wait(timeout=60)
    finally:
        show(console.flush())
        for timer in list(timers):
            timer.cancel()
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return run_id, proc.returncode or 0, "".join(lines), bool(expired)


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------

def _shown_path(path: Path) -> str:
    """A project file relative to the project (as the README names it), any other path in full."""
    try:
        return str(Path(path).resolve().relative_to(PROJECT_ROOT))
    except ValueError:
        return str(path)


def parse_set(items) -> dict[str, Any]:
    """``--set key=value`` items as a dict; values are TOML, a bare word is taken as a string."""
    import tomllib

    out = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        key, raw = item.split("=", 1)
        try:
            out[key.strip()] = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            out[key.strip()] = raw  # bare word: treat as a string
    return out


def resume_overrides(run_dir: str | Path) -> dict[str, Any]:
    """The run config of a run to resume: its resolved config (results.json), with ``resume`` set,
    checked against its checkpoint now, so a refused checkpoint fails before anything starts."""
    from .checkpoint import CheckpointError, load_checkpoint

    run_dir = Path(run_dir).expanduser().resolve()
    try:
        config = json.loads((run_dir / "results.json").read_text())["config"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"--resume {run_dir}: no readable results.json with the run's config ({exc})") from None
    config = {**config, "resume": True, "output-dir": str(run_dir.parent), "run-name": run_dir.name}
    try:
        load_checkpoint(run_dir, config=config, strategy=str(config.get("strategy.name")))
    except CheckpointError as exc:
        raise ConfigError(f"--resume: {exc}") from None
    return config


def resumed_supernodes(run_dir: str | Path, requested: int | None) -> int:
    """The number of simulated silos of the run being resumed (results.json ``clients.count``): a
    resume with another number would be another population, which the server refuses. A
    ``--supernodes`` that disagrees fails here, before anything starts."""
    run_dir = Path(run_dir).expanduser().resolve()
    try:
        count = int(json.loads((run_dir / "results.json").read_text())["clients"]["count"])
    except (OSError, ValueError, KeyError, TypeError):
        count = None  # killed before its silos answered: nothing recorded, nothing to contradict
    if count is None:
        return 6 if requested is None else requested
    if requested is not None and requested != count:
        raise ConfigError(f"--resume {run_dir}: the run had {count} silos; --supernodes {requested} would be "
                          "another population (leave --supernodes out to resume with the run's own)")
    return count


def check_launch(overrides: dict[str, Any], *, app_dir: str | Path = PROJECT_ROOT, num_supernodes: int = 6,
                 cpus_per_client: float = 1, gpus_per_client: float = 0.0,
                 flwr_home: str | Path | None = None) -> RunConfig:
    """Every check that needs no data, before anything starts: the merged run config as the ServerApp
    will validate it, and its consistency with the simulation flags. Raises ConfigError."""
    pyproject = Path(app_dir) / "pyproject.toml"
    cfg = validate_overrides(overrides, pyproject=pyproject if pyproject.exists() else None)
    if num_supernodes < 1:
        raise ConfigError(f"--supernodes must be >= 1, got {num_supernodes}")
    if num_supernodes < cfg["strategy.min-nodes"]:
        raise ConfigError(f"config key 'strategy.min-nodes' = {cfg['strategy.min-nodes']} exceeds --supernodes "
                          f"{num_supernodes}: the run would wait strategy.round-timeout for nodes that never come")
    if cpus_per_client <= 0:
        raise ConfigError(f"--cpus-per-client must be > 0, got {cpus_per_client:g}")
    if gpus_per_client < 0:
        raise ConfigError(f"--gpus-per-client must be >= 0, got {gpus_per_client:g}")
    data_dir = cfg["task.data-dir"].strip()
    if data_dir and not Path(data_dir).expanduser().exists():
        raise ConfigError(f"config key 'task.data-dir' = {data_dir!r} does not exist (relative paths are resolved "
                          f"against the current directory {Path.cwd()})")
    if cfg["device"] == "cuda" and gpus_per_client == 0:
        raise ConfigError("config key 'device' = 'cuda' needs --gpus-per-client > 0 (Ray hides the GPUs from "
                          "ClientApps that reserve none)")
    home, app = _home(flwr_home), Path(app_dir).expanduser().resolve()
    if home == app or app in home.parents:
        raise ConfigError(f"the Flower home {home} is inside the app directory {app}: `flwr run` would package the "
                          "installed apps into the FAB; use --flwr-home outside it")
    check_data(cfg, num_supernodes)
    return cfg


def check_data(cfg: RunConfig, num_supernodes: int) -> None:
    """Read the task's data as the silos will (local files, or the generated task) and check that
    every silo's shard can hold a batch; raises ConfigError naming the file, line or sizes. GLUE
    from the hub is left to the run (no download before it starts)."""
    from .data import load_task, shard_size_problem

    if cfg["task.train-rows"]:
        n = None  # the listed rows decide; read them
    elif cfg["task.name"] == "synthetic":
        n = cfg["task.synthetic-train-size"]  # known without generating it
    elif not cfg["task.data-dir"].strip():
        return
    else:
        n = None
    if n is None:
        try:
            n = len(load_task(cfg).train)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"task data: {exc}") from None
    problem = shard_size_problem(n, num_supernodes, cfg["train.batch-size"])
    if problem:
        raise ConfigError(problem)


def _become_subreaper() -> bool:
    """Linux: orphaned descendants (e.g. ``flwr-simulation`` once its SuperExec is gone) are
    re-parented to this process instead of PID 1, so :func:`_stop_orphans` can stop and reap them.
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fedpower-run", description=__doc__.split("\n\n")[0],
                                epilog="Exit codes: 0 run completed, 1 run failed, 2 bad arguments/config or "
                                       "launcher error, 130 interrupted. The SuperLink this starts, and every "
                                       "process below it, is stopped before it exits.")
    p.add_argument("--app", default=str(PROJECT_ROOT), help="app directory (default: this project)")
    p.add_argument("--preset", help="a conf/*.toml preset")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a run-config key (TOML value)")
    p.add_argument("--supernodes", type=int, default=None,
                   help="number of simulated silos (default 6; with --resume, the run's own number)")
    p.add_argument("--cpus-per-client", type=float, default=1)
    p.add_argument("--gpus-per-client", type=float, default=0.0, help="fraction of a GPU per ClientApp (e.g. 0.25)")
    p.add_argument("--flwr-home", default=os.environ.get("FLWR_HOME"), help="Flower home (default ~/.flwr)")
    p.add_argument("--verbose", action="store_true",
                   help="show all output (Flower DEBUG log, Ray and library warnings, progress bars)")
    p.add_argument("--resume", metavar="RUN_DIR",
                   help="continue a stopped or killed run from its last checkpoint (outputs/<run>); its "
                        "configuration is read from RUN_DIR/results.json")
    args = p.parse_args(argv)

    # 1. Everything that needs no data, before any process starts.
    try:
        overrides = {**(load_preset(args.preset) if args.preset else {}), **parse_set(args.set)}
        if args.resume:
            overrides = {**resume_overrides(args.resume), **overrides}
            args.supernodes = resumed_supernodes(args.resume, args.supernodes)
        else:  # the method's tuned settings, where neither the preset nor --set chose (issue #32)
            overrides, from_method, method_path = with_method_preset(overrides)
            if from_method:
                print(f"fedpower-run: {overrides.get('strategy.name')} runs at its method preset "
                      f"{_shown_path(method_path)}: "
                      + ", ".join(f"{k}={v!r}" for k, v in from_method.items()) + " (a --set of a key wins)",
                      flush=True)
        if args.supernodes is None:
            args.supernodes = 6
        check_launch(overrides, app_dir=args.app, num_supernodes=args.supernodes,
                     cpus_per_client=args.cpus_per_client, gpus_per_client=args.gpus_per_client,
                     flwr_home=args.flwr_home)
    except ConfigError as exc:
        print(f"fedpower-run: error: {exc}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as exc:  # unreadable or malformed preset
        print(f"fedpower-run: error: preset {args.preset}: {exc}", file=sys.stderr)
        return 2

    # 2. The run, on a SuperLink stopped (by PID) whatever happens.
    subreaper = _become_subreaper()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            previous[sig] = signal.signal(sig, _on_signal)
    try:
        outcome = run_flwr(args.app, overrides, num_supernodes=args.supernodes,
                           cpus_per_client=args.cpus_per_client, gpus_per_client=args.gpus_per_client,
                           flwr_home=args.flwr_home, verbose=args.verbose, keep_superlink=False)
    except KeyboardInterrupt as exc:
        what = "terminated" if isinstance(exc, _Terminated) else "interrupted"
        print(f"\nfedpower-run: {what}; the SuperLink and every process it started were stopped", file=sys.stderr)
        return 130
    except (ConfigError, RuntimeError, OSError) as exc:
        print(f"fedpower-run: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if subreaper:
            with _DeferSignals(reraise=False):  # main is ending anyway
                _stop_orphans()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if outcome.ok:
        print(f"\nfedpower-run: run {outcome.run_id} completed in {outcome.seconds:.0f} s")
        return 0
    error = outcome.error_summary()
    print(f"\nfedpower-run: error: run {outcome.run_id} {outcome.status} after {outcome.seconds:.0f} s"
          + (f": {error}" if error else ""), file=sys.stderr)
    return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
