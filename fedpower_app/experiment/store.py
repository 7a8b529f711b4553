"""A grid's output directory: each cell's results and status, the manifest, the locks that let workers share a grid, and the metrics of one cell's results."""

from __future__ import annotations

import collections
import json
import os
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ..runs import is_inside
from ..runs.atomic import write_json_atomic
from ..config import PROJECT_ROOT, ConfigError, parse_config

from .spec import Cell, FINISHED, FORMAT, GridError, GridSpec, cell_overrides


def results_path(out: Path, cell: Cell) -> Path:
    return out / "cells" / cell.cell_id / "results.json"


#: A grid's finished cells packed into one file (``--report-only --compact --pack``): the committed
#: form. A cell's own ``cells/<id>/results.json``, when there is one, wins over its packed copy.
PACK_FILE = "cells.json"


def read_results(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        pass
    path = Path(path)
    if path.name == "results.json" and path.parent.parent.name == "cells":
        return packed_cells(path.parent.parent.parent).get(path.parent.name)
    return None


def packed_cells(out: Path) -> dict[str, dict[str, Any]]:
    """The cells packed in ``<out>/cells.json`` (cell id -> compact results.json), or {}."""
    pack = Path(out) / PACK_FILE
    try:
        data = json.loads(pack.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    cells = data.get("cells") if isinstance(data, dict) else None
    return cells if isinstance(cells, dict) else {}


def has_cells(out: Path) -> bool:
    return (Path(out) / "cells").is_dir() or bool(packed_cells(out))


def pack_cells(out: Path, cells: Sequence[Cell]) -> int:
    """Pack every finished, compact cell into ``<out>/cells.json`` and remove its own results.json
    (the rest of the cell's directory, logs and adapters, stays); the number packed."""
    packed = packed_cells(out)
    moved = []
    for cell in cells:
        path = results_path(out, cell)
        if not path.exists():
            continue
        data = read_results(path)
        if data and data.get("status") in FINISHED and COMPACT_MARK in data:
            packed[cell.cell_id] = data
            moved.append(path)
    if moved:
        write_json_atomic(Path(out) / PACK_FILE, {"format": "fedpower-cells/1", "cells": packed}, indent=None)
        for path in moved:
            path.unlink()
            try:
                path.parent.rmdir()  # only if nothing else is left in it
            except OSError:
                pass
    return len(moved)


def unpack_cells(out: Path) -> int:
    """The inverse of :func:`pack_cells`: every packed cell back into its own results.json."""
    packed = packed_cells(out)
    for cell_id, data in packed.items():
        write_json_atomic(Path(out) / "cells" / cell_id / "results.json", data, indent=None)
    if packed:
        (Path(out) / PACK_FILE).unlink()
    return len(packed)


def cell_record(cell_dir: Path) -> dict[str, Any] | None:
    """A cell's record (``cell.json``: overrides, status, attempts), or the copy a compacted
    ``results.json`` keeps under ``"cell"`` (``--report-only --compact`` folds it in)."""
    record = read_results(cell_dir / "cell.json")
    if record is None:
        record = (read_results(cell_dir / "results.json") or {}).get("cell")
    return record if isinstance(record, dict) else None


def cell_status(out: Path, cell: Cell) -> str:
    """``completed``/``stopped-budget`` (finished), ``failed``, ``running`` (interrupted) or ``missing``."""
    data = read_results(results_path(out, cell))
    if data is None:
        return "missing"
    return str(data.get("status", "unknown"))


def is_finished(out: Path, cell: Cell) -> bool:
    return cell_status(out, cell) in FINISHED


@dataclass(frozen=True)
class CellProgress:
    """Where one cell stands, for ``--dry-run``: ``state`` is ``finished``, ``stale`` (finished with
    other settings: runs again), ``running`` (another process holds it now), ``interrupted`` (resumes
    from its checkpoint), ``restart`` (an attempt without a usable checkpoint, or a failed one: runs
    again from round 0) or ``missing``."""

    state: str
    text: str
    rounds_done: int
    rounds_total: int  # the grid's num-server-rounds for this cell
    wall_seconds: float | None = None


def cell_progress(spec: GridSpec, cell: Cell, out: Path) -> CellProgress:
    overrides = cell_overrides(spec, cell, out)
    total = parse_config(overrides)["num-server-rounds"]
    data = read_results(results_path(out, cell))
    # probe only a lock that exists: a dry run creates nothing in the output directory
    held = (out / "locks" / f"{cell.cell_id}.lock").exists() and _held(out, cell)
    if data is None:
        return CellProgress("running" if held else "missing",
                            "running now: no round finished yet" if held else "missing", 0, total)
    rounds = data.get("rounds") or []
    done = int(rounds[-1]["server_round"]) if rounds else 0
    wall = (data.get("totals") or {}).get("wall_seconds")
    status = str(data.get("status", "unknown"))
    if status in FINISHED:
        changes = config_changes(spec, cell, out)
        if changes:
            return CellProgress("stale", f"{status} but STALE, runs again ({', '.join(changes)})", 0, total)
        m = cell_metrics(data)
        acc = f"accuracy {m['final_accuracy']:.3f}" if m["final_accuracy"] is not None else "no evaluation"
        eps = f", eps {m['epsilon']:.2f}" if m["epsilon"] is not None else ""
        took = f", {_fmt_seconds(wall)}" if wall else ""
        return CellProgress("finished", f"{status}: {acc}{eps}, {done} rounds{took}", done, total, wall)
    if held:
        return CellProgress("running", f"running now: round {done}/{total} done"
                            + (f", {_fmt_seconds(wall)} so far" if wall else ""), done, total, wall)
    if status == "running" and resumable_round(out / "cells" / cell.cell_id, overrides) is not None:
        return CellProgress("interrupted", f"interrupted after round {done}/{total}: resumes from its checkpoint",
                            done, total, wall)
    # results.json says "running" here only because its process died without a usable checkpoint
    how = "interrupted" if status == "running" else status
    return CellProgress("restart", f"{how} after round {done}/{total}, no checkpoint to resume: runs again "
                        "from the start", 0, total)


def grid_status(spec: GridSpec, cells: Sequence[Cell], out: Path) -> str:
    """The ``--dry-run`` report: one line per cell, then the counts and an estimate of the cell time
    left at one worker (the median time per round of the finished cells, times the rounds left)."""
    lines = [f"{len(cells)} cells -> {out}"]
    progress = [cell_progress(spec, c, out) for c in cells]
    for i, (c, p) in enumerate(zip(cells, progress), 1):
        lines.append(f"  {i:3d}. {c.cell_id:45s} {p.text}")
    counts = collections.Counter(p.state for p in progress)
    order = ("finished", "running", "interrupted", "stale", "restart", "missing")
    names = {"finished": "finished", "running": "running now", "interrupted": "interrupted (resume)",
             "stale": "stale (run again)", "restart": "to restart", "missing": "not started"}
    summary = ", ".join(f"{counts[k]} {names[k]}" for k in order if counts.get(k))
    per_round = [p.wall_seconds / p.rounds_done for p in progress
                 if p.state == "finished" and p.wall_seconds and p.rounds_done]
    if per_round:
        left = sum(p.rounds_total - p.rounds_done for p in progress if p.state != "finished")
        secs = statistics.median(per_round) * left
        summary += (f"; about {_fmt_seconds(secs)} of cell time left at one worker ({left} rounds at the "
                    f"finished cells' median {_fmt_seconds(statistics.median(per_round))} per round)")
    lines.append(summary)
    return "\n".join(lines)


# Keys that say where a cell runs, not what it computes: a change in them does not make a result stale.
_LOCATION_KEYS = frozenset({"task.data-dir", "output-dir", "run-name", "resume"})


_UNSET = "(unset)"


def config_changes(spec: GridSpec, cell: Cell, out: Path) -> list[str]:
    """How the settings a finished cell's results were made with differ from what the grid asks for
    now, as ``key: old -> new``. Only the keys that either side sets explicitly (its ``cell.json``
    overrides, the grid's) are compared, by resolved value: pinning a key to the default the old run
    used is not a change. A key the old run's code did not know yet (absent from its resolved config)
    cannot be compared and is skipped. Empty for a cell without a record (nothing to compare)."""
    cell_dir = out / "cells" / cell.cell_id
    old = (cell_record(cell_dir) or {}).get("overrides")
    if not isinstance(old, dict):
        return []
    old_resolved = (read_results(cell_dir / "results.json") or {}).get("config") or {}
    new = cell_overrides(spec, cell, out)
    try:
        new_resolved = parse_config(new).to_dict()
    except ConfigError:  # validate() reports it; here it only means "not the same run"
        new_resolved = new
    changes = []
    for k in sorted((set(old) | set(new)) - _LOCATION_KEYS):
        before = old_resolved.get(k, old.get(k, _UNSET))
        after = new_resolved.get(k, new.get(k, _UNSET))
        if before is _UNSET and k in new:  # a key the old run's code did not have yet: cannot compare
            continue
        if before != after:
            changes.append(f"{k}: {before!r} -> {after!r}")
    return changes


def is_done(spec: GridSpec, cell: Cell, out: Path) -> bool:
    """Finished with the settings the grid asks for now (a finished but stale cell runs again)."""
    return is_finished(out, cell) and not config_changes(spec, cell, out)


def supersede(cell_dir: Path, out: Path) -> Path:
    """Move a stale finished cell's directory to ``<out>/superseded/<cell-id>__<time>/``: results are
    never deleted, and RESULTS.md may still cite the old run."""
    dest_root = out / "superseded"
    dest_root.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%S")
    dest = dest_root / f"{cell_dir.name}__{stamp}"
    n = 1
    while dest.exists():
        n += 1
        dest = dest_root / f"{cell_dir.name}__{stamp}-{n}"
    shutil.move(str(cell_dir), str(dest))
    return dest


# A grid's Flower home and port: one home for every command that runs configurations (fedpower_app.runs).
_inside = is_inside


def _fmt_seconds(s: float) -> str:
    s = int(round(s))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m{sec:02d}s" if h else f"{m}m{sec:02d}s"


# The code a cell ran: the ServerApp runs from a FAB (no .git inside), so the launcher records it.
CODE_PATHS = ("fedpower_app", "strategies", "client_app", "server_app", "conf", "pyproject.toml")


def code_version(root: Path = PROJECT_ROOT) -> dict[str, Any]:
    """``{"git_commit": sha, "code_modified": bool}`` of a git checkout (the code paths only, so a
    grid's own result files do not count); ``None`` values outside git."""
    import subprocess

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no", "--", *CODE_PATHS) if commit else None
    return {"git_commit": commit, "code_modified": None if status is None else bool(status)}


def _write_json(path: Path, payload: Any) -> None:
    write_json_atomic(path, payload, indent=2)


class Manifest:
    """``<out>/manifest.json``: grid, cells (status, overrides, seconds, attempts), invocations.

    Several in-process workers may share one grid (``--backend inprocess``, e.g. two at 1 thread
    on 2 cores). So ``save`` merges under a file lock: this process's own cell entries (``dirty``) and
    its invocation, the other processes' entries as they are on disk, every status fresh from the
    cells' results.json. Only entries written since the last save count as this process's: a cell
    another worker re-ran later keeps that worker's entry."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.path = out / "manifest.json"
        self.data: dict[str, Any] = read_results(self.path) or {"format": FORMAT, "cells": {}, "invocations": []}
        self.data.setdefault("cells", {})
        self.data.setdefault("invocations", [])
        self.dirty: set[str] = set()  # cell ids whose whole entry this process wrote since its last save
        self.invocation_id = f"{os.getpid()}-{time.time():.6f}"

    def save(self, cells: Sequence["Cell"] = ()) -> None:
        import fcntl

        with open(self.out / ".manifest.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            disk = read_results(self.path) or {}
            merged_cells = dict(disk.get("cells") or {})
            for cid, entry in self.data["cells"].items():
                if cid in self.dirty or cid not in merged_cells:
                    merged_cells[cid] = entry
            for c in cells:
                merged_cells.setdefault(c.cell_id, {})["status"] = cell_status(self.out, c)
            mine = [inv for inv in self.data["invocations"] if inv.get("id") == self.invocation_id]
            invocations = [inv for inv in (disk.get("invocations") or []) if inv.get("id") != self.invocation_id]
            self.data = {**disk, **{k: v for k, v in self.data.items() if k not in ("cells", "invocations")},
                         "cells": merged_cells, "invocations": invocations + mine}
            _write_json(self.path, self.data)
            self.dirty.clear()


class GridBusy(GridError):
    """The grid (or a cell) is held by another fedpower-experiment process."""


# flock cannot test a lock without taking it, so a probe (``_held``) holds a cell's lock for a few
# microseconds. Another worker trying the lock in that instant must not take the probe for a
# running cell: lock attempts retry for this long before they give up.
PROBE_PATIENCE_S = 0.3


def _held(out: Path, cell: "Cell") -> bool:
    """Whether another fedpower-experiment process is running ``cell`` now (it holds its lock)."""
    lock = _try_lock(out / "locks" / f"{cell.cell_id}.lock", patience=PROBE_PATIENCE_S)
    if lock is None:
        return True
    lock.close()
    return False


def _try_lock(path: Path, *, shared: bool = False, patience: float = 0.0):
    """An open file holding a non-blocking flock on ``path`` (released when the process exits or the
    file is closed), or None when another process holds it. ``patience``: seconds to keep retrying
    (a probe's momentary hold is not a running cell)."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + patience
    fh = open(path, "a+")
    while True:
        try:
            fcntl.flock(fh, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
            return fh
        except BlockingIOError:
            if time.monotonic() >= deadline:
                fh.close()
                return None
        time.sleep(0.02)


def resumable_round(cell_dir: Path, overrides: dict[str, Any]) -> int | None:
    """The last checkpointed round of an interrupted attempt of this cell with the same run
    config, or None (no attempt, no checkpoint, a failed or finished attempt, or other overrides)."""
    from ..runs.checkpoint import CHECKPOINT_FILE

    if not (cell_dir / CHECKPOINT_FILE).exists():
        return None
    try:
        earlier = json.loads((cell_dir / "cell.json").read_text())
    except (OSError, ValueError):
        return None
    data = read_results(cell_dir / "results.json") or {}
    if earlier.get("overrides") != overrides or data.get("status") != "running" or not data.get("rounds"):
        return None
    return int(data["rounds"][-1]["server_round"])


def eval_splits_of(data: dict[str, Any]) -> list[str]:
    """Evaluation split names of a run, in the order they were reported (first = primary)."""
    rows = [r for r in data.get("rounds", []) if r.get("accuracy") is not None]
    source = rows[-1] if rows else (data.get("initial_evaluation") or {})
    # a split reports ``{name}-accuracy`` and ``{name}-loss``; ``balanced-accuracy`` and
    # ``majority-accuracy`` (fedpower_app.training.metrics) are metrics of the first split, not splits
    return [k[: -len("-accuracy")] for k in source
            if k.endswith("-accuracy") and f"{k[: -len('-accuracy')]}-loss" in source]


def cell_metrics(data: dict[str, Any]) -> dict[str, Any]:
    """Scalar metrics of one finished run: final (last evaluated round) and best accuracy per split,
    epsilon spent, bytes, server time per round, wall time."""
    rounds = data.get("rounds", [])
    evals = [r for r in rounds if r.get("accuracy") is not None]
    splits = eval_splits_of(data)
    last = evals[-1] if evals else (data.get("initial_evaluation") or {})
    out: dict[str, Any] = {"splits": splits, "final": {}, "best": {}}
    for s in splits:
        key = f"{s}-accuracy"
        out["final"][s] = last.get(key)
        vals = [r[key] for r in evals if r.get(key) is not None]
        out["best"][s] = max(vals) if vals else last.get(key)
    out["final_accuracy"] = last.get("accuracy")
    out["best_accuracy"] = max((r["accuracy"] for r in evals), default=last.get("accuracy"))
    eps = [r.get("epsilon") for r in rounds if r.get("epsilon") is not None]
    out["epsilon"] = eps[-1] if eps else None
    agg = [r.get("aggregation_seconds") for r in rounds if r.get("aggregation_seconds") is not None]
    out["aggregation_seconds"] = statistics.mean(agg) if agg else None
    out["rounds"] = len(rounds)
    out["bytes"] = sum(int(r.get("bytes_up", 0)) + int(r.get("bytes_down", 0)) for r in rounds)
    tot = data.get("totals") or {}
    out["wall_seconds"] = tot.get("wall_seconds")
    walls = [r.get("wall_seconds") for r in rounds if r.get("wall_seconds") is not None]
    out["train_seconds"] = walls[-1] if walls else None
    privacy = data.get("privacy") or {}
    # server-side mechanisms: the effective multiplier z; DP-SGD on the silos: its sigma
    out["z"] = (privacy.get("calibration") or {}).get("z", privacy.get("noise_multiplier"))
    return out


COMPACT_MARK = "compacted"


def compact_results(data: dict[str, Any], *, max_sizes: int = 20) -> dict[str, Any]:
    """A finished run's results.json as committed to ``results/``: everything the tables, figures and
    ``--report-only`` read (config, privacy summary, rounds, totals, guarantee), without the bulk
    they do not (each silo's accounting ledger history, the per-client size list of a cross-device
    run, the adapter's path). The ε every ledger gives is kept."""
    out = {k: v for k, v in data.items() if k != "adapter_dir"}
    final = dict(out.get("privacy_final") or {})
    dropped = [k for k in ("ledger", "ledgers") if k in final]
    for k in dropped:
        final.pop(k)
    if final:
        out["privacy_final"] = final
    clients = dict(out.get("clients") or {})
    sizes = clients.get("dataset_sizes")
    if isinstance(sizes, list) and len(sizes) > max_sizes:
        s = sorted(sizes)
        clients["dataset_sizes"] = {"count": len(s), "min": s[0], "median": s[len(s) // 2], "max": s[-1],
                                    "total": sum(s)}
        dropped.append("clients.dataset_sizes")
        out["clients"] = clients
    out[COMPACT_MARK] = ("left out: " + ", ".join(dropped)) if dropped else "nothing to leave out"
    return out


def compact_cells(out: Path, cells: Sequence[Cell]) -> int:
    """Rewrite every finished cell's results.json in compact form, minified, with its cell.json
    folded in under ``"cell"`` (one file per cell); the number rewritten."""
    n = 0
    for cell in cells:
        path = results_path(out, cell)
        data = read_results(path)
        record = path.parent / "cell.json"
        if not data or data.get("status") not in FINISHED:
            continue
        if COMPACT_MARK in data and "cell" in data and not record.exists():
            continue  # already compact
        compact = compact_results(data) if COMPACT_MARK not in data else dict(data)
        cell_data = read_results(record)
        if cell_data is not None:
            compact["cell"] = cell_data
        write_json_atomic(path, compact, indent=None)
        if cell_data is not None:
            record.unlink()
        n += 1
    return n
