"""Running one cell: a `flwr run` of the app (managed local SuperLink) or the in-process grid in a child process, with its watchdog, log excerpt and stop."""

from __future__ import annotations

import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from ..config import PROJECT_ROOT

from .spec import Cell, FINISHED, GridSpec, cell_overrides
from .store import _write_json, cell_status, code_version, read_results, results_path, resumable_round, supersede


def _flwr_log_excerpt(output: str, ok: bool) -> str:
    lines = output.splitlines()
    return "\n".join(lines if not ok else lines[-60:]) + "\n"


def _resolved(spec: GridSpec, cell: Cell, overrides: dict[str, Any]) -> dict[str, Any]:
    """A cell's overrides with ``train.auto`` resolved for its silos (fedpower_app/runs/auto.py): the
    grid's own keys, as set by hand, are kept; the preset's give way to the plan, as in fedpower-run."""
    from ..runs.auto import resolve_train_auto

    explicit = set(spec.overrides) | set(spec.overrides_of(cell.method, cell.epsilon))
    if cell.epsilon is None:
        explicit |= set(spec.nonprivate_overrides) | ({"train.lr"} if spec.nonprivate_lr is not None else set())
    resolved, lines = resolve_train_auto(overrides, explicit, spec.supernodes)
    for line in lines:
        print(f"  {cell.cell_id}: {line}", flush=True)
    return resolved


def run_cell(spec: GridSpec, cell: Cell, out: Path, *, flwr_home: Path, port: int, echo: bool,
             timeout: float | None, keep_adapters: bool, cell_lock=None) -> dict[str, Any]:
    """Run one cell (through ``flwr run``, or on the in-process grid) and return its manifest entry.
    ``cell_lock``: the open file holding the cell's lock (an in-process cell's child inherits it)."""
    from ..launcher import run_flwr

    cell_dir = out / "cells" / cell.cell_id
    overrides = _resolved(spec, cell, cell_overrides(spec, cell, out))
    resume_from = resumable_round(cell_dir, overrides)
    if resume_from is None and cell_dir.exists():
        if cell_status(out, cell) in FINISHED:  # stale: made with other settings; keep it aside
            moved = supersede(cell_dir, out)
            print(f"  {cell.cell_id}: its earlier results (other settings) moved to {moved}", flush=True)
        else:  # a failed attempt, or one without a usable checkpoint
            shutil.rmtree(cell_dir)
    cell_dir.mkdir(parents=True, exist_ok=True)
    entry: dict[str, Any] = {"task": cell.task, "method": cell.method,
                             "epsilon": "none" if cell.epsilon is None else cell.epsilon, "seed": cell.seed,
                             "overrides": overrides, "started_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                             "code": code_version()}
    if resume_from is not None:
        # An interrupted attempt of this very cell left a per-round checkpoint: continue it (the
        # ServerApp checks the checkpoint against the config and refuses a damaged or foreign one).
        entry["resumed_after_round"] = resume_from
        overrides = {**overrides, "resume": True}
    _write_json(cell_dir / "cell.json", entry)
    if spec.backend == "inprocess":
        return _finish_inprocess_cell(spec, cell, out, cell_dir, overrides, entry, resume_from, timeout=timeout,
                                      echo=echo, keep_adapters=keep_adapters, cell_lock=cell_lock)
    watchdog = _Watchdog(timeout) if timeout else None
    try:
        outcome = run_flwr(PROJECT_ROOT, overrides, num_supernodes=spec.supernodes, flwr_home=flwr_home,
                           superlink_port=port, echo=echo, timeout=timeout, cpus_per_client=spec.cpus_per_client,
                           gpus_per_client=spec.gpus_per_client)
        entry.update(run_id=outcome.run_id, flwr_status=outcome.status, seconds=round(outcome.seconds, 1))
        output = outcome.output
    except Exception as exc:  # launcher problem (flwr missing, ...): the cell failed, the grid goes on
        entry.update(run_id=None, flwr_status=f"launcher error: {type(exc).__name__}: {exc}", seconds=None)
        output = str(exc)
    finally:
        if watchdog:
            watchdog.cancel()
    if watchdog and watchdog.fired:
        entry["flwr_status"] = f"{entry.get('flwr_status')} (timed out after {timeout:.0f} s)"
    status = cell_status(out, cell)
    if resume_from is not None and status not in FINISHED and "CheckpointError" in output:
        # The checkpoint could not be used after all: run the cell again from round 1, once.
        shutil.rmtree(cell_dir, ignore_errors=True)
        return run_cell(spec, cell, out, flwr_home=flwr_home, port=port, echo=echo, timeout=timeout,
                        keep_adapters=keep_adapters)
    if status not in FINISHED and entry.get("run_id") and not str(entry["flwr_status"]).startswith("finished"):
        _stop_run(entry["run_id"], flwr_home, port)  # e.g. after --cell-timeout: do not leave it running
    entry["status"] = status
    entry["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    (cell_dir / "flwr.log").write_text(_flwr_log_excerpt(output, status in FINISHED))
    if status not in FINISHED:
        data = read_results(results_path(out, cell)) or {}
        entry["error"] = data.get("error") or _last_error_line(output)
    if not keep_adapters:
        shutil.rmtree(cell_dir / "adapter", ignore_errors=True)
        if status in FINISHED:  # a finished cell is never resumed; its checkpoint holds only adapters
            (cell_dir / "checkpoint.pt").unlink(missing_ok=True)
    _write_json(cell_dir / "cell.json", entry)
    return entry


def _finish_inprocess_cell(spec: GridSpec, cell: Cell, out: Path, cell_dir: Path, overrides: dict[str, Any],
                           entry: dict[str, Any], resume_from: int | None, *, timeout: float | None, echo: bool,
                           keep_adapters: bool, cell_lock=None) -> dict[str, Any]:
    """Run one cell on the in-process grid (``fedpower_app.runs.inprocess``) in a child process:
    ``spec.supernodes`` virtual clients, one model. The child process keeps a crash or a timeout
    from taking the grid down, and frees the model's memory between cells."""
    import subprocess

    from ..launcher import terminate_tree

    config_file = cell_dir / "run-config.json"
    _write_json(config_file, overrides)
    cmd = [sys.executable, "-m", "fedpower_app.runs.inprocess", "--config-json", str(config_file),
           "--clients", str(spec.supernodes)]
    if spec.threads:
        cmd += ["--threads", str(spec.threads)]
    log_path = cell_dir / "run.log"
    t0 = time.time()
    with open(log_path, "w", buffering=1) as log_fh:  # line-buffered: `tail -f run.log` follows the cell
        # The child inherits the cell's lock (same open file): if this process is killed, the cell
        # stays locked until the child ends too, so no other worker starts it in the same directory.
        proc = subprocess.Popen(cmd, cwd=PROJECT_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                encoding="utf-8", errors="replace", bufsize=1, start_new_session=True,
                                pass_fds=(cell_lock.fileno(),) if cell_lock is not None else ())
        try:
            for line in _lines_until(proc, t0 + timeout if timeout else None):
                log_fh.write(line)
                if echo:
                    print(line, end="", flush=True)
                elif progress := _round_line(line):  # a cell takes up to an hour: show its rounds
                    print(f"  {cell.cell_id}: {progress}", flush=True)
        finally:  # the deadline passed, or Ctrl-C / SIGTERM reached the grid: stop the cell's process
            timed_out = proc.poll() is None
            if timed_out:
                terminate_tree(proc, grace=30)
                proc.wait()
    entry.update(backend="inprocess", exit_code=proc.returncode, seconds=round(time.time() - t0, 1))
    if timed_out:
        entry["process_status"] = f"timed out after {timeout:.0f} s"
    status = cell_status(out, cell)
    output = log_path.read_text()
    if resume_from is not None and status not in FINISHED and "CheckpointError" in output:
        shutil.rmtree(cell_dir, ignore_errors=True)  # the checkpoint was unusable: from round 1, once
        return run_cell(spec, cell, out, flwr_home=Path(), port=0, echo=echo, timeout=timeout,
                        keep_adapters=keep_adapters, cell_lock=cell_lock)
    entry["status"] = status
    entry["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    if status not in FINISHED:
        data = read_results(results_path(out, cell)) or {}
        entry["error"] = data.get("error") or entry.get("process_status") or _last_error_line(output)
    if not keep_adapters:
        shutil.rmtree(cell_dir / "adapter", ignore_errors=True)
        if status in FINISHED:
            (cell_dir / "checkpoint.pt").unlink(missing_ok=True)
    _write_json(cell_dir / "cell.json", entry)
    return entry


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _round_line(line: str) -> str | None:
    """The round summary of a run's log line ("[round 3/10 ...] acc ..."), without colour codes and
    the log level; None for any other line."""
    plain = _ANSI.sub("", line).strip()
    i = plain.find("[round ")
    return plain[i:] if i >= 0 else None


def _lines_until(proc, deadline: float | None):
    """The child's output lines; stops reading at ``deadline`` (the caller then terminates it). A
    reader thread, so that a child that prints nothing cannot hold the grid past its deadline."""
    import queue
    import threading

    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        try:
            for line in proc.stdout:
                lines.put(line)
        finally:  # always the end marker, or the reader would wait for ever
            lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    while True:
        wait = None if deadline is None else max(deadline - time.time(), 0.0)
        try:
            line = lines.get(timeout=wait)
        except queue.Empty:
            return
        if line is None:
            proc.wait()
            return
        yield line


class _Watchdog:
    """After ``timeout`` seconds, terminate this process's own ``flwr run`` child (by pid), so that a
    run that hangs without printing anything cannot block the grid; the run itself is then stopped
    on the SuperLink with ``flwr stop``. (``run_flwr``'s own timeout is only checked when a line of
    output arrives.)"""

    def __init__(self, timeout: float) -> None:
        import threading

        self.fired = False
        self._timer = threading.Timer(timeout, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        import psutil

        self.fired = True
        for child in psutil.Process().children(recursive=False):
            try:
                cmd = child.cmdline()
            except psutil.Error:
                continue
            if any(Path(c).name == "flwr" for c in cmd[:2]) and "run" in cmd:
                child.terminate()

    def cancel(self) -> None:
        self._timer.cancel()


def _stop_run(run_id: str, flwr_home: Path, port: int) -> None:
    """Best effort ``flwr stop <run-id>`` (``flwr run`` returning does not stop a run on the
    SuperLink): the launcher's, on this grid's Flower home and port."""
    from ..launcher import flwr_env
    from ..launcher.flwr_run import _stop_run as stop_on

    stop_on(run_id, flwr_env(flwr_home, port))


def _last_error_line(output: str) -> str:
    """The gist of a failed run's output: Flower's boxed error message, or the last error-like line."""
    lines = output.splitlines()
    for i, line in enumerate(lines):
        if "╭─ Error" in line:
            body = []
            for inner in lines[i + 1:]:
                if inner.startswith("╰"):
                    break
                body.append(inner.strip("│ ").strip())
            return " ".join(b for b in body if b)[:500]
    for line in reversed(lines):
        if re.search(r"error|exception|traceback", line, re.I):
            return line.strip()[:500]
    return "no results.json written (see flwr.log)"
