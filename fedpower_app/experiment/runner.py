"""Running a whole grid: the cells still to do, in order, shared with other workers by locks, with progress and ETA."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Sequence

from ..runs import default_flwr_home, default_port
from ..config import PROJECT_ROOT

from .spec import FINISHED, FORMAT, GridError, GridSpec, cell_overrides, check_gpu_placement, validate
from .store import GridBusy, Manifest, PROBE_PATIENCE_S, _fmt_seconds, _held, _inside, _try_lock, cell_status, config_changes, is_done, is_finished, read_results, results_path, resumable_round
from .backends import run_cell


def run_grid(spec: GridSpec, out: Path, *, flwr_home: Path | None = None, port: int | None = None,
             echo: bool = False, timeout: float | None = None, keep_adapters: bool = False,
             argv: Sequence[str] | None = None, max_cells: int | None = None,
             max_consecutive_failures: int | None = 3, log=None) -> dict[str, Any]:
    """Run every unfinished cell of the grid; return a summary (ran, skipped, failed cell ids)."""
    from ..launcher import stop_local_superlink

    if log is None:
        def log(msg: str) -> None:
            print(msg, flush=True)
    out.mkdir(parents=True, exist_ok=True)
    cells = validate(spec, out)
    flwr_home = Path(flwr_home).expanduser().resolve() if flwr_home else default_flwr_home(out)
    if spec.backend == "flwr" and _inside(flwr_home, PROJECT_ROOT):
        raise GridError(f"the Flower home {flwr_home} is inside the app directory {PROJECT_ROOT}: `flwr run` would "
                        "package the installed apps into every FAB; choose a directory outside it")
    check_gpu_placement(spec)
    port = port or default_port(out)
    # Flower cells share one local SuperLink, which an invocation stops when it ends: one
    # invocation per grid. In-process cells are independent child processes: several invocations
    # may share the grid, each taking the next cell no other one holds.
    grid_lock = _try_lock(out / ".grid.lock", shared=spec.backend == "inprocess")
    if grid_lock is None:
        raise GridBusy(f"another fedpower-experiment is running the grid in {out}"
                       + (" (only --backend inprocess invocations can share a grid)" if spec.backend == "flwr" else
                          " with --backend flwr; wait for it to finish"))
    try:  # the lock must not outlive a failure before the loop (its finally releases it after)
        gitignore = out / ".gitignore"
        if not gitignore.exists():
            gitignore.write_text("# written by fedpower-experiment: Flower state and model adapters are not results\n"
                                 "flwr-home/\n*/*/adapter/\n*/*/checkpoint.pt\n*/*/inflight.json\n"
                                 "*/*/final-eval-logits.pt\n*.tmp*\nlocks/\n.*.lock\n")  # cells/ and superseded/
        manifest_home = str(flwr_home)
        manifest = Manifest(out)
        manifest.data["format"] = FORMAT
        manifest.data["grid"] = spec.to_dict()
        manifest.data["project_root"] = str(PROJECT_ROOT)
        manifest.data["flwr_home"] = manifest_home
        manifest.data["superlink_port"] = port
        invocation = {"id": manifest.invocation_id, "argv": list(argv) if argv is not None else None,
                      "started_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "ran": [], "skipped": 0, "failed": []}
        manifest.data["invocations"].append(invocation)
        todo = [c for c in cells if not is_done(spec, c, out)]
        stale = {c.cell_id: config_changes(spec, c, out) for c in todo if is_finished(out, c)}
        for c in cells:
            entry = manifest.data["cells"].setdefault(c.cell_id, {})
            entry.setdefault("task", c.task)
            entry.setdefault("method", c.method)
            entry.setdefault("epsilon", "none" if c.epsilon is None else c.epsilon)
            entry.setdefault("seed", c.seed)
        invocation["skipped"] = len(cells) - len(todo)
        manifest.save(cells)
        if max_cells is not None and spec.backend == "flwr":
            todo = todo[:max_cells]
        # In-process invocations may share the grid: --max-cells counts the cells this one runs, not the
        # ones another invocation holds, so it walks the whole list.
        log(f"fedpower-experiment: {len(cells)} cells in the grid, {invocation['skipped']} already finished, "
            f"{len(todo)} to run{'' if max_cells is None else f' (at most {max_cells} in this invocation)'} -> {out}")
        if stale:
            log(f"fedpower-experiment: {len(stale)} finished cell(s) were made with other settings and run again "
                f"(the old results move to {out / 'superseded'}/): "
                + "; ".join(f"{cid} ({', '.join(ch)})" for cid, ch in stale.items()))
        previously_failed = [c.cell_id for c in todo if cell_status(out, c) not in ("missing",)
                             and c.cell_id not in stale and not _held(out, c)]
        if previously_failed:
            log(f"fedpower-experiment: re-running {len(previously_failed)} unfinished/failed cell(s): {', '.join(previously_failed)}")
    except BaseException:
        grid_lock.close()
        raise
    t_grid = time.time()
    durations: list[float] = []
    try:
        for i, cell in enumerate(todo, 1):
            if max_cells is not None and len(invocation["ran"]) >= max_cells:
                break
            cell_lock = _try_lock(out / "locks" / f"{cell.cell_id}.lock", patience=PROBE_PATIENCE_S)
            if cell_lock is None or is_done(spec, cell, out):  # another invocation runs it, or has run it
                log(f"[cell {i}/{len(todo)}] {cell.cell_id}: "
                    f"{'taken by another fedpower-experiment process' if cell_lock is None else 'finished meanwhile'}; skipped")
                if cell_lock is not None:
                    cell_lock.close()
                continue
            resume_from = resumable_round(out / "cells" / cell.cell_id, cell_overrides(spec, cell, out))
            how = f", resuming after round {resume_from} from its checkpoint" if resume_from is not None else ""
            log(f"[cell {i}/{len(todo)}] {cell.cell_id}: running ({cell.describe()}{how})")
            t0 = time.time()
            try:
                entry = run_cell(spec, cell, out, flwr_home=flwr_home, port=port, echo=echo, timeout=timeout,
                                 keep_adapters=keep_adapters, cell_lock=cell_lock)
            finally:
                cell_lock.close()
            durations.append(time.time() - t0)
            attempts = int(manifest.data["cells"].get(cell.cell_id, {}).get("attempts", 0)) + 1
            entry["attempts"] = attempts
            manifest.data["cells"][cell.cell_id] = entry
            manifest.dirty.add(cell.cell_id)
            invocation["ran"].append(cell.cell_id)
            # this invocation's remaining work: not the cells other workers run or have finished, and
            # no more than --max-cells allows
            remaining = sum(1 for c in todo[i:] if not is_done(spec, c, out) and not _held(out, c))
            if max_cells is not None:
                remaining = min(remaining, max_cells - len(invocation["ran"]))
            eta = statistics.mean(durations) * remaining
            if entry["status"] in FINISHED:
                data = read_results(results_path(out, cell)) or {}
                tot = data.get("totals") or {}
                acc, best, eps = tot.get("final_accuracy"), tot.get("best_accuracy"), tot.get("final_epsilon")
                log(f"[cell {i}/{len(todo)}] {cell.cell_id}: {entry['status']} in {_fmt_seconds(durations[-1])} | "
                    f"final acc {_f4(acc)} (best {_f4(best)}) | eps {'n/a' if eps is None else f'{eps:.3f}'} | "
                    f"ETA {_fmt_seconds(eta)} for {remaining} more")
            else:
                invocation["failed"].append(cell.cell_id)
                log(f"[cell {i}/{len(todo)}] {cell.cell_id}: FAILED ({entry['status']}): {entry.get('error')} | "
                    f"log {out / 'cells' / cell.cell_id / ('run.log' if spec.backend == 'inprocess' else 'flwr.log')} | "
                    f"ETA {_fmt_seconds(eta)} for {remaining} more")
            manifest.save(cells)
            streak = len(invocation["failed"]) and all(
                c in invocation["failed"] for c in invocation["ran"][-(max_consecutive_failures or 0):])
            if max_consecutive_failures and len(invocation["ran"]) >= max_consecutive_failures and streak:
                log(f"fedpower-experiment: {max_consecutive_failures} cells failed in a row; stopping (the problem "
                    "is probably not cell specific). Fix it and run the same command again to resume.")
                break
    finally:
        invocation["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        invocation["seconds"] = round(time.time() - t_grid, 1)
        manifest.save(cells)
        if todo and spec.backend == "flwr":
            stop_local_superlink(flwr_home)
        grid_lock.close()
    unfinished = [c.cell_id for c in cells if not is_done(spec, c, out)]
    # cells another in-process worker is running now: not this invocation's failures
    running_elsewhere = [c.cell_id for c in cells if c.cell_id in unfinished and _held(out, c)]
    return {"cells": len(cells), "ran": invocation["ran"], "skipped": invocation["skipped"],
            "failed": invocation["failed"], "unfinished": unfinished, "running_elsewhere": running_elsewhere,
            "seconds": invocation["seconds"]}


def _f4(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"
