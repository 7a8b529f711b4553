"""``run_flwr``: one ``flwr run`` on a SuperLink this process owns, streamed and filtered, with the run's real status (``flwr run`` exits 0 when a run fails) and its stop."""


from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import PROJECT_ROOT, load_preset

from .flwr_cli import CONNECTION, _flwr, _home, _num, run_config_arg
from .superlink import LocalSuperLink, _kept_superlink
from .ray_cluster import check_ray_resources, ray_address_from
from .console import ConsoleFilter, last_exception_line


# run_flwr(timeout=T) interrupts `flwr run` at T + this: a caller's own watchdog on the same T
# (fedpower-experiment's) acts first and can tell that it did.
TIMEOUT_GRACE_SECONDS = 1.0


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
    ray_address: str | None = None,
    ray_cpus: int | None = None,
    ray_gpus: int | None = None,
    run_lock=None,
) -> RunOutcome:
    """Run the app with ``flwr run --stream`` on a SuperLink this process owns; return its real status.

    The SuperLink listens on ``superlink_port`` (default: :func:`default_superlink_port` of an explicit
    ``flwr_home`` if free, else a free port) with ``FLWR_HOME = flwr_home``.
    With ``keep_superlink`` (default) it is reused by the next call for the same home and stopped by
    :func:`stop_local_superlink` or at exit; otherwise it is stopped (by PID, with everything it
    started) before returning - also when this raises or is interrupted. ``echo`` prints the output
    through :class:`ConsoleFilter` (everything with ``verbose``); ``RunOutcome.output`` is unfiltered.

    Ray (``ray_cluster``): ``ray_address`` (default: ``RAY_ADDRESS`` from the environment; ``"local"``:
    none) is an existing cluster the simulation joins; without one it runs on a private Ray instance,
    of ``ray_cpus``/``ray_gpus`` when given (Flower's ``init-args-num-cpus/num-gpus``; refused with
    a cluster address, as Ray refuses them on connect).

    ``run_lock`` (``fedpower_app.runs.owner.RunLock``): the run directory's lock, handed to the
    SuperLink's supervisor (a new SuperLink is started for it, never a kept one).
    """
    ray_address = ray_address_from(ray_address)
    check_ray_resources(ray_address, ray_cpus, ray_gpus)
    federation = (f"num-supernodes={num_supernodes} client-resources-num-cpus={_num(cpus_per_client)} "
                  f"client-resources-num-gpus={_num(gpus_per_client)}")
    if ray_cpus is not None:
        federation += f" init-args-num-cpus={_num(ray_cpus)}"
    if ray_gpus is not None:
        federation += f" init-args-num-gpus={_num(ray_gpus)}"
    cmd = [_flwr(), "run", str(app_dir), CONNECTION, "--stream", "--federation-config", federation]
    # flwr refuses a TOML file together with key=value pairs, so a preset is merged into the pairs.
    merged = {**(load_preset(preset) if preset else {}), **(overrides or {})}
    if merged:
        cmd += ["--run-config", run_config_arg(merged)]
    t0 = time.time()
    link = _kept_superlink(_home(flwr_home), superlink_port, ray_address) if keep_superlink and run_lock is None else None
    started_here = link is None
    try:
        if link is None:
            link = LocalSuperLink(flwr_home, superlink_port, verbose=verbose, ray_address=ray_address,
                                  run_lock=run_lock).start()
            if echo and verbose:
                print(f"fedpower-run: SuperLink pid {link.superlink_pid} (under the run's supervisor, pid {link.pid}) "
                      f"on {link.address} (log {link.log_path})", flush=True)
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
