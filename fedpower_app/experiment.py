"""``fedpower-experiment``: run a grid of methods x epsilon x tasks x seeds and write the paper's tables.

Every cell of the grid is one ``flwr run`` of this app (Flower simulation, managed local SuperLink),
with a deterministic run name and output directory ``<out>/cells/<cell-id>/``. A cell is finished
when its ``results.json`` says ``completed`` (or ``stopped-budget``); re-running the same command
resumes a half-finished grid: finished cells are skipped, an interrupted cell continues from its
last per-round checkpoint (same overrides; its privacy ledger included), failed cells are run again
and reported. After the runs, the results of all finished cells are aggregated (mean +- std over
seeds) into

  table1.md/.csv   accuracy per method and epsilon, per task and averaged over tasks (paper Table 1)
  table2.md/.csv   noise injection scheme: PowerDP vs input vs output perturbation (paper Table 2)
  table3.md/.csv   refactorization every 1/5/10 rounds: server time per round, overhead vs FedLoRA,
                   total wall time, accuracy (paper Table 3)
  fig_*.png        accuracy vs rounds and vs transferred bits (real message bytes), per task and epsilon
  manifest.json    the grid, every cell's status and exact overrides, the invocations (commands, times)
  cells/<id>/      results.json (resolved config, calibration, per-round data), cell.json, flwr.log

Examples:

  # the paper's Table 1 on SST-2 with the CPU preset, 3 seeds
  fedpower-experiment --table 1 --preset conf/cpu-sst2.toml --data-dir /work/shared/glue/SST-2 \\
      --seeds 0 1 2 --out results/cpu-sst2

  # everything a grid file describes (per-table epsilons, seeds, preset, overrides)
  fedpower-experiment --grid conf/grids/cpu-sst2.toml --table all --data-dir /work/shared/glue/SST-2

  # the paper's setup (RoBERTa-large, T = 200, all four tasks); needs a GPU and days of compute
  fedpower-experiment --grid conf/grids/paper.toml --table all --data-dir /path/to/glue

  # a custom grid, then only re-render the tables from what is there
  fedpower-experiment --methods fedpower fedpower-F5 ffa-lora --epsilons 3 none --tasks sst2 qnli \\
      --preset conf/cpu-sst2.toml --data-dir /data/glue --out results/custom
  fedpower-experiment --out results/custom --report-only

  # client-level DP with 1,000 virtual clients on the in-process grid (one model, one child process
  # per cell; a cell's log is cells/<id>/run.log), 2 torch threads
  fedpower-experiment --grid conf/grids/cross-device-sst2.toml --data-dir /work/shared/glue/SST-2

Grid files (conf/grids/*.toml) hold the same settings as the flags, plus:

  overrides = {...}            run-config keys for every cell (like --set)
  [method-overrides.<method>]  run-config keys for one method's cells, applied last (e.g. FFA-LoRA,
                               which trains only B, needs a larger "train.lr"); the keys that make a
                               cell (method, epsilon, seed, task) cannot be set here
  [private-method-overrides.<method>]
                               the same, for the method's private cells only (after the above): for
                               settings that matter only under DP (FedPower's power iterations and
                               clip), so that its non-private cells stay the best run without DP
  [table1] ... [table3]        per-table methods and epsilons; cell-timeout = seconds per cell

A finished cell whose recorded settings (cells/<id>/cell.json) differ from what the grid now asks
for is stale: --dry-run marks it, the tables leave it out, and the next run moves it to
<out>/superseded/ and runs it again.

Methods are strategy names (fedpower, fedlora, ffa-lora, input-perturbation, output-perturbation)
or fedpower-F<n> (FedPower with PowerDP every n-th round, FedLoRA releases otherwise), or
fedpower-powerdp (FedPower refactorizing with the paper's PowerDP at client level, an ablation; at
any other DP level it is FedPower's run, so the grid runs that cell once and marks the shared row
with †). Epsilons are
positive numbers (dp.epsilon at the preset's dp.level, sample by default) or "none" (dp.level = none,
optionally with its own learning rate, --nonprivate-lr; the paper uses 0.05 vs 0.5 private).
"""

from __future__ import annotations

import argparse
import collections
import csv
import json
import math
import os
import re
import shutil
import statistics
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from .runs import default_flwr_home, default_port, is_inside
from .atomic import write_json_atomic
from .config import PROJECT_ROOT, STRATEGIES, TASKS, ConfigError, load_preset, parse_config

FINISHED = ("completed", "stopped-budget")
FORMAT = "fedpower-experiment/1"
# How a cell runs: a `flwr run` Ray simulation, or the in-process grid (fedpower_app.inprocess_run).
BACKENDS = ("flwr", "inprocess")

# The standard grids of the paper's tables (methods; default epsilons).
TABLE_METHODS: dict[str, list[str]] = {
    "1": ["fedlora", "ffa-lora", "fedpower"],
    "2": ["input-perturbation", "output-perturbation", "fedpower"],
    "3": ["fedlora", "fedpower-F10", "fedpower-F5", "fedpower"],
}
TABLE_EPSILONS: dict[str, list[float | None]] = {
    "1": [None, 9.0, 6.0, 3.0],
    "2": [9.0, 6.0, 3.0],
    "3": [3.0],
}
TABLE_TITLES = {
    "1": "Table 1: accuracy per method and privacy budget",
    "2": "Table 2: noise injection scheme (PowerDP vs input vs output perturbation)",
    "3": "Table 3: refactorization frequency (server time per round, overhead vs FedLoRA, accuracy)",
}
METHOD_LABELS = {
    "fedlora": "FedLoRA",
    "ffa-lora": "FFA-LoRA",
    "fedsvd": "FedSVD",
    "fedpower": "FedPower",
    "input-perturbation": "Input perturbation",
    "output-perturbation": "Output perturbation",
    "fedpower-powerdp": "FedPower (paper's PowerDP)",
}
TASK_LABELS = {"sst2": "SST-2", "qnli": "QNLI", "mnli": "MNLI", "qqp": "QQP", "synthetic": "synthetic"}
SPLIT_LABELS = {"validation_matched": "m", "validation_mismatched": "mm"}
_F_RE = re.compile(r"^fedpower-F([1-9][0-9]*)$")


class GridError(ValueError):
    """A bad grid specification (unknown method, bad epsilon, ...): exit code 2."""


# ------------------------------------------------------------------------------------------------
# Grid specification
# ------------------------------------------------------------------------------------------------

def method_overrides(method: str) -> dict[str, Any]:
    """Run-config overrides of a method name (strategy name, fedpower-F<n>, or fedpower-powerdp:
    FedPower refactorizing with the paper's PowerDP at client level instead of PowerDP-L)."""
    if method in STRATEGIES:
        return {"strategy.name": method, "strategy.refactor-every": 1}
    if method == "fedpower-powerdp":
        return {"strategy.name": "fedpower", "strategy.refactor-every": 1,
                "strategy.client-refactorization": "powerdp"}
    m = _F_RE.match(method)
    if m:
        return {"strategy.name": "fedpower", "strategy.refactor-every": int(m.group(1))}
    raise GridError(f"unknown method {method!r}: use one of {', '.join(STRATEGIES)}, fedpower-F<n> (n >= 1) or "
                    "fedpower-powerdp")


# Methods that differ from a base method only in how client-level DP noises the release: at any
# other DP level (sample, none) their cell is the base method's cell, run once and shared.
CLIENT_LEVEL_VARIANTS = {"fedpower-powerdp": "fedpower"}


def canonical_method(method: str) -> str:
    method_overrides(method)
    return "fedpower" if method == "fedpower-F1" else method


def method_label(method: str) -> str:
    m = _F_RE.match(method)
    if m:
        return f"FedPower (F={m.group(1)})"
    return METHOD_LABELS.get(method, method)


def refactor_every(method: str) -> int | None:
    """Refactorization frequency of a method: F for FedPower variants, None (never) for the rest."""
    ov = method_overrides(method)
    return ov["strategy.refactor-every"] if ov["strategy.name"] == "fedpower" else None


def parse_epsilon(value: Any) -> float | None:
    """A grid epsilon: a positive number, or "none" / "inf" / "nonprivate" for dp.level = none."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise GridError(f"bad epsilon {value!r}: use a positive number or 'none'")
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("none", "nonprivate", "non-private", "inf", "np"):
            return None
        try:
            value = float(text)
        except ValueError:
            raise GridError(f"bad epsilon {value!r}: use a positive number or 'none'") from None
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise GridError(f"bad epsilon {value!r}: use a positive number or 'none'")
    return float(value)


def eps_tag(eps: float | None) -> str:
    if eps is None:
        return "nonprivate"
    return "eps" + (f"{eps:g}".replace(".", "p"))


def eps_label(eps: float | None) -> str:
    return "non-private" if eps is None else f"ε = {eps:g}"


def _eps_sort_key(eps: float | None) -> float:
    return -math.inf if eps is None else -eps  # non-private first, then decreasing epsilon (paper order)


@dataclass(frozen=True)
class Cell:
    task: str
    method: str
    epsilon: float | None
    seed: int

    @property
    def cell_id(self) -> str:
        return f"{self.task}__{self.method}__{eps_tag(self.epsilon)}__s{self.seed}"

    def describe(self) -> str:
        eps = "non-private" if self.epsilon is None else f"eps={self.epsilon:g}"
        return f"{self.task} {self.method} {eps} seed={self.seed}"


@dataclass
class GridSpec:
    """What to run. ``tables`` maps a table number to (methods, epsilons); ``custom`` holds an extra
    methods x epsilons block given by --methods/--epsilons without --table."""

    tasks: list[str]
    seeds: list[int]
    tables: dict[str, tuple[list[str], list[float | None]]] = field(default_factory=dict)
    custom: tuple[list[str], list[float | None]] | None = None
    preset: str | None = None  # may contain {task}
    overrides: dict[str, Any] = field(default_factory=dict)
    data_dir: str | None = None
    nonprivate_lr: float | None = None
    supernodes: int = 6
    backend: str = "flwr"  # one of BACKENDS
    threads: int | None = None  # torch threads of an in-process cell (None: torch's default)
    # run-config overrides of one method's cells (e.g. FFA-LoRA's own learning rate); applied last
    method_overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    # the same for the method's private cells only, applied after method_overrides
    private_method_overrides: dict[str, dict[str, Any]] = field(default_factory=dict)

    def overrides_of(self, method: str, eps: float | None) -> dict[str, Any]:
        """The per-method run-config overrides of ``method``'s cells at ``eps``."""
        ov = dict(self.method_overrides.get(method, {}))
        if eps is not None:
            ov.update(self.private_method_overrides.get(method, {}))
        return ov

    def blocks(self) -> list[tuple[str, list[str], list[float | None]]]:
        out = [(t, m, e) for t, (m, e) in sorted(self.tables.items())]
        if self.custom:
            out.append(("custom", *self.custom))
        return out

    def base_overrides(self, task: str) -> dict[str, Any]:
        """The preset's run-config keys for ``task``, then the grid's overrides (every cell's base)."""
        ov: dict[str, Any] = {}
        if self.preset:
            preset = Path(self.preset.replace("{task}", task))
            if not preset.exists():
                raise GridError(f"preset {preset} not found")
            ov.update(load_preset(str(preset)))
        ov.update(self.overrides)
        return ov

    def dp_level(self, task: str, eps: float | None) -> str:
        """The DP level a cell at ``eps`` runs at (cell_overrides sets it from this)."""
        if eps is None:
            return "none"
        level = self.base_overrides(task).get("dp.level", "sample")  # the config's default level
        return "sample" if level == "none" else str(level)  # an epsilon asks for DP

    def cell_for(self, task: str, method: str, eps: float | None, seed: int) -> Cell:
        """The cell that computes (task, method, eps, seed). A client-level variant (the paper's
        PowerDP in FedPower) away from client-level DP is the same run as its base method, so the
        base's cell serves both (unless a per-method override makes the two runs differ)."""
        method = canonical_method(method)
        base = CLIENT_LEVEL_VARIANTS.get(method)
        if (base is not None and self.overrides_of(method, eps) == self.overrides_of(base, eps)
                and self.dp_level(task, eps) != "client"):
            method = base
        return Cell(task, method, eps, seed)

    def cells(self) -> list[Cell]:
        """All cells, deduplicated (a FedPower cell at epsilon 6 serves Tables 1, 2 and 3; FedPower
        with the paper's PowerDP without DP is FedPower without DP), in a stable order: by table
        block, seed, epsilon, task, method, so that early seeds of every method finish first (a
        partial grid already gives comparable numbers)."""
        seen: dict[str, Cell] = {}
        for _, methods, epsilons in self.blocks():
            for seed in self.seeds:
                for eps in epsilons:
                    for task in self.tasks:
                        for method in methods:
                            cell = self.cell_for(task, method, eps, seed)
                            seen.setdefault(cell.cell_id, cell)
        return list(seen.values())

    def shared_rows(self) -> dict[tuple[str, str, float | None], str]:
        """Table rows served by another method's cells: (task, method, eps) -> the method run."""
        out: dict[tuple[str, str, float | None], str] = {}
        for _, methods, epsilons in self.blocks():
            for eps in epsilons:
                for task in self.tasks:
                    for method in methods:
                        run = self.cell_for(task, method, eps, self.seeds[0] if self.seeds else 0).method
                        if run != canonical_method(method):
                            out[(task, canonical_method(method), eps)] = run
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "tasks": self.tasks,
            "seeds": self.seeds,
            "tables": {t: {"methods": m, "epsilons": [("none" if e is None else e) for e in es]}
                       for t, (m, es) in self.tables.items()},
            "custom": None if not self.custom else {"methods": self.custom[0],
                                                    "epsilons": [("none" if e is None else e) for e in self.custom[1]]},
            "preset": self.preset,
            "overrides": self.overrides,
            "data_dir": self.data_dir,
            "nonprivate_lr": self.nonprivate_lr,
            "supernodes": self.supernodes,
            "backend": self.backend,
            "threads": self.threads,
            "method_overrides": self.method_overrides,
            "private_method_overrides": self.private_method_overrides,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GridSpec":
        tables = {str(t): (list(v["methods"]), [parse_epsilon(e) for e in v["epsilons"]])
                  for t, v in (d.get("tables") or {}).items()}
        custom = d.get("custom")
        return cls(tasks=list(d["tasks"]), seeds=[int(s) for s in d["seeds"]], tables=tables,
                   custom=None if not custom else (list(custom["methods"]), [parse_epsilon(e) for e in custom["epsilons"]]),
                   preset=d.get("preset"), overrides=dict(d.get("overrides") or {}), data_dir=d.get("data_dir"),
                   nonprivate_lr=d.get("nonprivate_lr"), supernodes=int(d.get("supernodes", 6)),
                   backend=str(d.get("backend", "flwr")), threads=d.get("threads"),
                   method_overrides={str(m): dict(v) for m, v in (d.get("method_overrides") or {}).items()},
                   private_method_overrides={str(m): dict(v)
                                             for m, v in (d.get("private_method_overrides") or {}).items()})


def _resolve_path(path: str, base: Path) -> str:
    """A relative (preset) path: tried against the cwd, then ``base`` (the grid file's folder), then
    the project root; ``{task}`` templates are checked with the first existing expansion."""
    p = Path(path).expanduser()
    if p.is_absolute():
        return str(p)
    for root in (Path.cwd(), base, PROJECT_ROOT):
        cand = root / p
        probes = [Path(str(cand).replace("{task}", t)) for t in TASKS] if "{task}" in path else [cand]
        if any(q.exists() for q in probes):
            return str(cand.resolve()) if "{task}" not in path else str(root.resolve() / p)
    return str(Path.cwd() / p)


def cell_overrides(spec: GridSpec, cell: Cell, out: Path) -> dict[str, Any]:
    """The exact run-config passed to ``flwr run`` for a cell (preset + grid overrides + cell)."""
    ov = spec.base_overrides(cell.task)
    # A grid is an experiment: its cells repeat bit for bit (reproducible mode, labelled "not a
    # guarantee against whoever holds the seed"), unless the grid or preset says otherwise.
    ov.setdefault("dp.noise", "seeded")
    ov["task.name"] = cell.task
    if spec.data_dir is not None:
        ov["task.data-dir"] = spec.data_dir.replace("{task}", cell.task)
    ov.update(method_overrides(cell.method))
    if cell.epsilon is None:
        ov["dp.level"] = "none"
        if spec.nonprivate_lr is not None:
            ov["train.lr"] = float(spec.nonprivate_lr)
    else:
        if ov.get("dp.level") == "none":
            ov["dp.level"] = spec.dp_level(cell.task, cell.epsilon)
        ov["dp.epsilon"] = float(cell.epsilon)
    ov.update(spec.overrides_of(cell.method, cell.epsilon))
    ov["seed"] = int(cell.seed)
    ov["run-name"] = cell.cell_id
    ov["output-dir"] = str((out / "cells").resolve())
    return ov


# Run-config keys a cell's identity sets (method, epsilon, seed, task, location): a per-method
# override may not change them.
_CELL_KEYS = frozenset({"strategy.name", "strategy.refactor-every", "strategy.client-refactorization", "dp.level",
                        "dp.epsilon", "seed", "run-name", "output-dir", "task.name", "task.data-dir", "resume"})


def validate(spec: GridSpec, out: Path) -> list[Cell]:
    """Check the whole grid before running anything (unknown keys/values fail here, exit 2)."""
    if not spec.tasks:
        raise GridError("no tasks given")
    if not spec.seeds:
        raise GridError("no seeds given")
    for task in spec.tasks:
        if task not in TASKS:
            raise GridError(f"unknown task {task!r}: use one of {', '.join(TASKS)}")
    if not spec.blocks():
        raise GridError("nothing to run: give --table, --methods/--epsilons or a --grid file")
    for _, methods, epsilons in spec.blocks():
        if not methods:
            raise GridError("empty method list")
        if not epsilons:
            raise GridError("empty epsilon list")
        for m in methods:
            method_overrides(m)
    for table, per_method in (("method-overrides", spec.method_overrides),
                              ("private-method-overrides", spec.private_method_overrides)):
        for m, ov in per_method.items():
            # an unknown name fails; a known method that --methods left out of this invocation is fine
            canonical_method(m)
            if not isinstance(ov, dict) or not ov:
                raise GridError(f"{table}.{m}: a table of run-config keys expected, e.g. \"train.lr\" = 0.03")
            fixed = sorted(set(ov) & _CELL_KEYS)
            if fixed:
                raise GridError(f"{table}.{m}: {', '.join(fixed)} define(s) the cell (method, epsilon, seed, "
                                "task, where it runs) and cannot be overridden per method")
    if spec.preset:
        for task in spec.tasks:
            p = Path(spec.preset.replace("{task}", task))
            if not p.exists():
                raise GridError(f"preset {p} not found")
    if spec.supernodes < 1:
        raise GridError("--supernodes must be >= 1")
    if spec.backend not in BACKENDS:
        raise GridError(f"unknown backend {spec.backend!r}: use one of {', '.join(BACKENDS)}")
    if spec.backend == "inprocess" and spec.supernodes < 2:
        raise GridError("the inprocess backend needs --supernodes >= 2 (the number of virtual clients)")
    if spec.threads is not None and spec.threads < 1:
        raise GridError("--threads must be >= 1")
    cells = spec.cells()
    for cell in cells:
        try:
            parse_config(cell_overrides(spec, cell, out))
        except ConfigError as exc:
            raise GridError(f"cell {cell.cell_id}: {exc}") from None
    return cells


# ------------------------------------------------------------------------------------------------
# Running
# ------------------------------------------------------------------------------------------------

def results_path(out: Path, cell: Cell) -> Path:
    return out / "cells" / cell.cell_id / "results.json"


def read_results(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


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
    old = (read_results(cell_dir / "cell.json") or {}).get("overrides")
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


def _flwr_log_excerpt(output: str, ok: bool) -> str:
    lines = output.splitlines()
    return "\n".join(lines if not ok else lines[-60:]) + "\n"


def run_cell(spec: GridSpec, cell: Cell, out: Path, *, flwr_home: Path, port: int, echo: bool,
             timeout: float | None, keep_adapters: bool, cell_lock=None) -> dict[str, Any]:
    """Run one cell (through ``flwr run``, or on the in-process grid) and return its manifest entry.
    ``cell_lock``: the open file holding the cell's lock (an in-process cell's child inherits it)."""
    from .launcher import run_flwr

    cell_dir = out / "cells" / cell.cell_id
    overrides = cell_overrides(spec, cell, out)
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
                           superlink_port=port, echo=echo, timeout=timeout)
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
    """Run one cell on the in-process grid (``fedpower_app.inprocess_run``) in a child process:
    ``spec.supernodes`` virtual clients, one model. The child process keeps a crash or a timeout
    from taking the grid down, and frees the model's memory between cells."""
    import subprocess

    from .launcher import terminate_tree

    config_file = cell_dir / "run-config.json"
    _write_json(config_file, overrides)
    cmd = [sys.executable, "-m", "fedpower_app.inprocess_run", "--config-json", str(config_file),
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


def resumable_round(cell_dir: Path, overrides: dict[str, Any]) -> int | None:
    """The last checkpointed round of an interrupted attempt of this cell with the same run
    config, or None (no attempt, no checkpoint, a failed or finished attempt, or other overrides)."""
    from .checkpoint import CHECKPOINT_FILE

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
    """Best effort ``flwr stop <run-id>`` (``flwr run`` returning does not stop a run on the SuperLink)."""
    import subprocess

    from .launcher import _flwr, flwr_env

    try:
        subprocess.run([_flwr(), "stop", str(run_id)], env=flwr_env(flwr_home, port), capture_output=True,
                       text=True, timeout=120, check=False)
    except (OSError, subprocess.SubprocessError, RuntimeError):
        pass


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


def run_grid(spec: GridSpec, out: Path, *, flwr_home: Path | None = None, port: int | None = None,
             echo: bool = False, timeout: float | None = None, keep_adapters: bool = False,
             argv: Sequence[str] | None = None, max_cells: int | None = None,
             max_consecutive_failures: int | None = 3, log=None) -> dict[str, Any]:
    """Run every unfinished cell of the grid; return a summary (ran, skipped, failed cell ids)."""
    from .launcher import stop_local_superlink

    if log is None:
        def log(msg: str) -> None:
            print(msg, flush=True)
    out.mkdir(parents=True, exist_ok=True)
    cells = validate(spec, out)
    flwr_home = Path(flwr_home).expanduser().resolve() if flwr_home else default_flwr_home(out)
    if spec.backend == "flwr" and _inside(flwr_home, PROJECT_ROOT):
        raise GridError(f"the Flower home {flwr_home} is inside the app directory {PROJECT_ROOT}: `flwr run` would "
                        "package the installed apps into every FAB; choose a directory outside it")
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


# ------------------------------------------------------------------------------------------------
# Aggregation
# ------------------------------------------------------------------------------------------------

def eval_splits_of(data: dict[str, Any]) -> list[str]:
    """Evaluation split names of a run, in the order they were reported (first = primary)."""
    rows = [r for r in data.get("rounds", []) if r.get("accuracy") is not None]
    source = rows[-1] if rows else (data.get("initial_evaluation") or {})
    return [k[: -len("-accuracy")] for k in source if k.endswith("-accuracy")]


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


def curve(data: dict[str, Any]) -> list[tuple[int, float, float]]:
    """(round, cumulative transferred bits, accuracy) for every evaluated round, with round 0 = the
    initial model at 0 bits."""
    pts: list[tuple[int, float, float]] = []
    init = data.get("initial_evaluation") or {}
    if init.get("accuracy") is not None:
        pts.append((0, 0.0, float(init["accuracy"])))
    bits = 0.0
    for r in data.get("rounds", []):
        bits += 8.0 * (int(r.get("bytes_up", 0)) + int(r.get("bytes_down", 0)))
        if r.get("accuracy") is not None:
            pts.append((int(r["server_round"]), bits, float(r["accuracy"])))
    return pts


def mean_std(values: Iterable[float | None]) -> tuple[float | None, float | None, int]:
    """Mean and sample standard deviation (ddof = 1; 0 for a single value) of the non-missing values."""
    vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not vals:
        return None, None, 0
    if len(vals) == 1:
        return vals[0], 0.0, 1
    return statistics.mean(vals), statistics.stdev(vals), len(vals)


@dataclass
class Collected:
    """Finished runs by (task, method, epsilon): seed -> results.json data."""

    runs: dict[tuple[str, str, float | None], dict[int, dict[str, Any]]]
    stale: list[str] = field(default_factory=list)  # finished cells left out: made with other settings
    shared: dict[tuple[str, str, float | None], str] = field(default_factory=dict)  # GridSpec.shared_rows

    def get(self, task: str, method: str, eps: float | None) -> dict[int, dict[str, Any]]:
        method = self.shared.get((task, method, eps), method)
        return self.runs.get((task, method, eps), {})


def collect(out: Path, cells: Sequence[Cell], spec: GridSpec | None = None) -> Collected:
    """The finished cells' results; with ``spec``, without the stale ones (made with other settings)."""
    runs: dict[tuple[str, str, float | None], dict[int, dict[str, Any]]] = {}
    stale: list[str] = []
    for cell in cells:
        data = read_results(results_path(out, cell))
        if data is None or data.get("status") not in FINISHED:
            continue
        if spec is not None and config_changes(spec, cell, out):
            stale.append(cell.cell_id)
            continue
        runs.setdefault((cell.task, cell.method, cell.epsilon), {})[cell.seed] = data
    return Collected(runs, stale, spec.shared_rows() if spec is not None else {})


def task_columns(collected: Collected, tasks: Sequence[str]) -> list[tuple[str, str, str]]:
    """Accuracy columns: (task, split, header). One per evaluation split (MNLI: matched and
    mismatched), in task order."""
    cols: list[tuple[str, str, str]] = []
    for task in tasks:
        splits: list[str] = []
        for (t, _, _), seeds in collected.runs.items():
            if t != task:
                continue
            for data in seeds.values():
                for s in eval_splits_of(data):
                    if s not in splits:
                        splits.append(s)
        if not splits:
            splits = ["validation_matched", "validation_mismatched"] if task == "mnli" else ["validation"]
        label = TASK_LABELS.get(task, task)
        for s in splits:
            header = label if len(splits) == 1 else f"{label}-{SPLIT_LABELS.get(s, s)}"
            cols.append((task, s, header))
    return cols


def _pm(mean: float | None, std: float | None, n: int, scale: float = 100.0, digits: int = 2) -> str:
    if mean is None:
        return "—"
    if n < 2:  # one seed has no spread to show; "± 0.00" would claim one
        return f"{mean * scale:.{digits}f}"
    return f"{mean * scale:.{digits}f} ± {std * scale:.{digits}f}"


@dataclass
class Table:
    title: str
    headers: list[str]
    rows: list[list[str]]
    csv_headers: list[str]
    csv_rows: list[list[Any]]
    notes: list[str] = field(default_factory=list)

    def markdown(self) -> str:
        lines = [f"### {self.title}", ""]
        lines.append("| " + " | ".join(self.headers) + " |")
        lines.append("|" + "|".join("---" for _ in self.headers) + "|")
        for row in self.rows:
            lines.append("| " + " | ".join(row) + " |")
        if self.notes:
            lines.append("")
            lines.extend(self.notes)
        return "\n".join(lines) + "\n"

    def write(self, out: Path, stem: str) -> None:
        (out / f"{stem}.md").write_text(self.markdown())
        with open(out / f"{stem}.csv", "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(self.csv_headers)
            for row in self.csv_rows:
                w.writerow(["" if v is None else (f"{v:.6g}" if isinstance(v, float) else v) for v in row])


def _seed_average_over_columns(cols: list[tuple[str, str, str]], collected: Collected, method: str, eps: float | None, which: str) -> list[float]:
    """Per seed: the average over all task columns (only seeds that finished every task)."""
    per_seed: list[float] = []
    common = None
    for task in {c[0] for c in cols}:
        s = set(collected.get(task, method, eps))
        common = s if common is None else common & s
    for seed in sorted(common or ()):
        vals = []
        for task, split, _ in cols:
            m = cell_metrics(collected.get(task, method, eps)[seed])
            vals.append(m[which].get(split))
        if all(v is not None for v in vals):
            per_seed.append(statistics.mean(vals))
    return per_seed


def accuracy_table(collected: Collected, tasks: Sequence[str], methods: Sequence[str],
                   epsilons: Sequence[float | None], title: str, which: str = "final") -> Table:
    """Accuracy (%) mean ± std over seeds per (epsilon, method) row and task column, plus the
    average over columns (computed per seed, then mean ± std)."""
    cols = task_columns(collected, tasks)
    multi = len(cols) > 1
    headers = ["Privacy budget", "Method"] + [c[2] for c in cols] + (["Average"] if multi else []) + ["n seeds", "ε spent"]
    csv_headers = ["epsilon", "method"]
    for c in cols:
        csv_headers += [f"{c[2]}_mean", f"{c[2]}_std", f"{c[2]}_n"]
    if multi:
        csv_headers += ["average_mean", "average_std", "average_n"]
    csv_headers += ["epsilon_spent_mean", "z_mean", "run_of"]  # run_of: the method whose cells a shared row shows
    rows, csv_rows = [], []
    shared_notes: set[str] = set()
    for eps in sorted(set(epsilons), key=_eps_sort_key):
        for method in methods:
            method = canonical_method(method)
            row = [eps_label(eps), method_label(method)]
            crow: list[Any] = ["none" if eps is None else eps, method]
            ns, spent, zs = [], [], []
            for task, split, _ in cols:
                seeds = collected.get(task, method, eps)
                metrics = [cell_metrics(d) for d in seeds.values()]
                mean, std, n = mean_std(m[which].get(split) for m in metrics)
                row.append(_pm(mean, std, n))
                crow += [mean, std, n]
                ns.append(n)
                spent += [m["epsilon"] for m in metrics if m["epsilon"] is not None]
                zs += [m["z"] for m in metrics if m["z"] is not None]
            if multi:
                per_seed = _seed_average_over_columns(cols, collected, method, eps, which)
                mean, std, n = mean_std(per_seed)
                row.append(_pm(mean, std, n))
                crow += [mean, std, n]
            row.append(str(min(ns)) if ns and min(ns) == max(ns) else f"{min(ns) if ns else 0}–{max(ns) if ns else 0}")
            row.append("—" if not spent else f"{statistics.mean(spent):.3f}")
            crow += [statistics.mean(spent) if spent else None, statistics.mean(zs) if zs else None]
            run_by = {collected.shared[(t, method, eps)] for t in tasks if (t, method, eps) in collected.shared}
            crow.append(",".join(sorted(run_by)))
            if run_by:
                row[1] += " †"
                shared_notes.add(f"† {method_label(method)}, {eps_label(eps)}, is the run of "
                                 f"{', '.join(method_label(m) for m in sorted(run_by))}: the two differ only in "
                                 "the client-level DP release, so one cell serves both rows.")
            rows.append(row)
            csv_rows.append(crow)
    init_parts = []
    for task, split, header in cols:
        per_seed: dict[int, float] = {}
        for (t, _, _), seeds in collected.runs.items():
            if t == task:
                for seed, data in seeds.items():
                    v = (data.get("initial_evaluation") or {}).get(f"{split}-accuracy")
                    if v is not None:
                        per_seed.setdefault(seed, float(v))
        mean, std, n = mean_std(per_seed.values())
        if n:
            init_parts.append(f"{header} {_pm(mean, std, n)} (n={n})")
    notes = [f"Accuracy in %, {'final (last evaluated round)' if which == 'final' else 'best over rounds'}, "
             "mean ± sample std over seeds (n seeds per cell). "
             + ("Average = mean over the task columns per seed (seeds that finished every task), then mean ± std. " if multi else "")
             + "ε spent = accountant's ε after the last round (target in the first column), δ from the config; "
             "— = no finished run."]
    if shared_notes:
        notes.append("")
        notes.extend(sorted(shared_notes))
    if init_parts:
        notes.append("")
        notes.append("Initial model (round 0, LoRA B = 0, untrained frozen head), per seed: " + "; ".join(init_parts) + ".")
    return Table(title, headers, rows, csv_headers, csv_rows, notes)


def refactor_table(collected: Collected, tasks: Sequence[str], methods: Sequence[str],
                   epsilons: Sequence[float | None], title: str) -> Table:
    """Table 3: per method and epsilon, server aggregation time per round (mean over rounds, then
    mean ± std over seeds and tasks), overhead vs FedLoRA at the same epsilon, total wall time of a
    run, accuracy averaged over tasks."""
    cols = task_columns(collected, tasks)
    headers = ["Privacy budget", "Method", "Refactorization frequency", "Server time per round (s)",
               "Overhead vs FedLoRA", "Wall time per run (s)", "Accuracy (avg over tasks)", "n runs"]
    csv_headers = ["epsilon", "method", "refactor_every", "server_seconds_per_round_mean", "server_seconds_per_round_std",
                   "overhead_vs_fedlora", "wall_seconds_mean", "wall_seconds_std", "accuracy_mean", "accuracy_std", "n"]
    rows, csv_rows = [], []
    for eps in sorted(set(epsilons), key=_eps_sort_key):
        base = None
        stats: dict[str, tuple] = {}
        for method in methods:
            method = canonical_method(method)
            metrics = [cell_metrics(d) for task in tasks for d in collected.get(task, method, eps).values()]
            agg = mean_std(m["aggregation_seconds"] for m in metrics)
            wall = mean_std(m["wall_seconds"] for m in metrics)
            acc_per_seed = _seed_average_over_columns(cols, collected, method, eps, "final")
            acc = mean_std(acc_per_seed)
            stats[method] = (agg, wall, acc, len(metrics))
            if method == "fedlora":
                base = agg[0]
        for method in methods:
            method = canonical_method(method)
            agg, wall, acc, n = stats[method]
            f = refactor_every(method)
            freq = "none (FedLoRA release)" if f is None else f"every {f} round{'s' if f > 1 else ''}"
            overhead = None if (base is None or agg[0] is None or base <= 0) else agg[0] / base - 1.0
            rows.append([eps_label(eps), method_label(method), freq,
                         "—" if agg[0] is None else f"{agg[0]:.4f} ± {agg[1]:.4f}",
                         "—" if overhead is None else f"{overhead * 100:+.1f} % (×{overhead + 1:.2f})",
                         "—" if wall[0] is None else f"{wall[0]:.1f} ± {wall[1]:.1f}",
                         _pm(*acc), str(n)])
            csv_rows.append(["none" if eps is None else eps, method, f, agg[0], agg[1], overhead, wall[0], wall[1],
                             acc[0], acc[1], n])
    notes = ["Server time per round = the ServerApp's `aggregation_seconds` (validation, clipping, averaging, "
             "noise and refactorization; not client training), mean over the rounds of a run, then mean ± std over runs "
             "(seeds × tasks). Overhead = ratio to FedLoRA at the same ε minus 1. Wall time = whole run incl. "
             "model loading, client training and evaluation. Accuracy in %, final round, averaged over tasks per seed."]
    return Table(title, headers, rows, csv_headers, csv_rows, notes)


# ------------------------------------------------------------------------------------------------
# Figures
# ------------------------------------------------------------------------------------------------

def mean_curve(seeds: dict[int, dict[str, Any]]) -> tuple[list[int], list[float], list[float], list[float]]:
    """Mean over seeds of (bits, accuracy) at each evaluated round present in every seed."""
    curves = [curve(d) for d in seeds.values()]
    if not curves:
        return [], [], [], []
    common = set.intersection(*({p[0] for p in c} for c in curves))
    rounds = sorted(common)
    bits, acc, std = [], [], []
    for r in rounds:
        b = [p[1] for c in curves for p in c if p[0] == r]
        a = [p[2] for c in curves for p in c if p[0] == r]
        bits.append(statistics.mean(b))
        acc.append(statistics.mean(a))
        std.append(statistics.stdev(a) if len(a) > 1 else 0.0)
    return rounds, bits, acc, std


def plot_curves(collected: Collected, task: str, eps: float | None, methods: Sequence[str], path: Path,
                title_prefix: str = "") -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = []
    canon = [canonical_method(m) for m in methods]
    for method in methods:
        method = canonical_method(method)
        if collected.shared.get((task, method, eps)) in canon:  # the same run as another line of this plot
            continue
        seeds = collected.get(task, method, eps)
        if seeds:
            series.append((method, len(seeds), *mean_curve(seeds)))
    if not series:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for method, n, rounds, bits, acc, std in series:
        lo = [a - s for a, s in zip(acc, std)]
        hi = [a + s for a, s in zip(acc, std)]
        label = f"{method_label(method)} (n={n})"
        line, = ax1.plot(rounds, acc, marker="o", ms=3, label=label)
        ax1.fill_between(rounds, lo, hi, alpha=0.15, color=line.get_color())
        ax2.plot(bits, acc, marker="o", ms=3, label=label, color=line.get_color())
        ax2.fill_between(bits, lo, hi, alpha=0.15, color=line.get_color())
    ax1.set_xlabel("round")
    ax2.set_xlabel("transferred bits (up + down, cumulative)")
    ax2.ticklabel_format(axis="x", style="sci", scilimits=(0, 0))
    for ax in (ax1, ax2):
        ax.set_ylabel("accuracy")
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    fig.suptitle(f"{title_prefix}{TASK_LABELS.get(task, task)}, {'non-private' if eps is None else f'ε = {eps:g}'} "
                 f"(mean ± std over seeds)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------

def write_report(spec: GridSpec, out: Path) -> dict[str, list[str]]:
    """Write the tables and figures of the grid from the finished cells; return what was written."""
    cells = spec.cells()
    collected = collect(out, cells, spec)
    written: dict[str, list[str]] = {"tables": [], "figures": [], "stale": collected.stale}
    for block, methods, epsilons in spec.blocks():
        methods = [canonical_method(m) for m in methods]
        if block == "3":
            table = refactor_table(collected, spec.tasks, methods, epsilons, TABLE_TITLES["3"])
        else:
            title = TABLE_TITLES.get(block, "Accuracy per method and privacy budget (custom grid)")
            table = accuracy_table(collected, spec.tasks, methods, epsilons, title)
            best = accuracy_table(collected, spec.tasks, methods, epsilons, title + " (best round)", which="best")
            table.notes.append("")
            table.notes.append(best.markdown().strip())
        stem = f"table{block}" if block != "custom" else "table_custom"
        table.write(out, stem)
        written["tables"].append(stem)
        for task in spec.tasks:
            for eps in sorted(set(epsilons), key=_eps_sort_key):
                name = f"fig_{'t' + block if block != 'custom' else 'custom'}_{task}_{eps_tag(eps)}.png"
                if plot_curves(collected, task, eps, methods, out / name,
                               title_prefix=f"{'Table ' + block if block != 'custom' else 'custom grid'}: "):
                    written["figures"].append(name)
    return written


def grid_summary_markdown(spec: GridSpec, out: Path) -> str:
    """The tables written by write_report, concatenated (for README/RESULTS)."""
    parts = []
    for block, _, _ in spec.blocks():
        stem = f"table{block}" if block != "custom" else "table_custom"
        p = out / f"{stem}.md"
        if p.exists():
            parts.append(p.read_text())
    return "\n".join(parts)


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------

def _load_grid_file(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except OSError as exc:
        raise GridError(f"cannot read grid file {path}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise GridError(f"grid file {path}: {exc}") from None


_GRID_KEYS = {"out", "cell-timeout", "preset", "tasks", "seeds", "methods", "epsilons", "overrides", "method-overrides",
              "private-method-overrides",
              "data-dir", "nonprivate-lr", "supernodes", "backend", "threads", "table1", "table2", "table3"}


def _parse_set(items: Sequence[str]) -> dict[str, Any]:
    from .launcher import parse_set

    try:
        return parse_set(items)
    except ConfigError as exc:
        raise GridError(str(exc)) from None


def build_spec(args: argparse.Namespace) -> tuple[GridSpec, Path]:
    """Combine a grid file (if any) and the command-line flags (flags win) into a GridSpec."""
    g: dict[str, Any] = {}
    base = Path.cwd()
    if args.grid:
        g = _load_grid_file(args.grid)
        unknown = sorted(set(g) - _GRID_KEYS)
        if unknown:
            raise GridError(f"grid file {args.grid}: unknown key(s) {', '.join(unknown)} (valid: {', '.join(sorted(_GRID_KEYS))})")
        base = Path(args.grid).resolve().parent
    out = args.out or g.get("out")
    if not out:
        raise GridError("no output directory: give --out (or 'out' in the grid file)")
    out_path = Path(out if Path(out).is_absolute() or not args.grid or args.out else _resolve_path(out, base)).expanduser().resolve()

    tasks = args.tasks or g.get("tasks") or ["sst2"]
    seeds = args.seeds if args.seeds is not None else g.get("seeds", [0])
    try:
        seeds = [int(s) for s in seeds]
    except (TypeError, ValueError):
        raise GridError(f"bad seeds {seeds!r}: integers expected") from None
    preset = args.preset or g.get("preset")
    if preset:
        preset = _resolve_path(preset, base if not args.preset else Path.cwd())
    overrides = dict(g.get("overrides") or {})
    overrides.update(_parse_set(args.set))
    data_dir = args.data_dir if args.data_dir is not None else g.get("data-dir")
    if data_dir:
        data_dir = str(Path(data_dir).expanduser().resolve()) if "{task}" not in data_dir else data_dir
    nonprivate_lr = args.nonprivate_lr if args.nonprivate_lr is not None else g.get("nonprivate-lr")
    supernodes = args.supernodes if args.supernodes is not None else int(g.get("supernodes", 6))
    backend = args.backend or g.get("backend", "flwr")
    threads = args.threads if args.threads is not None else g.get("threads")

    cli_eps = [parse_epsilon(e) for e in args.epsilons] if args.epsilons else None
    file_eps = [parse_epsilon(e) for e in g["epsilons"]] if g.get("epsilons") else None
    tables: dict[str, tuple[list[str], list[float | None]]] = {}
    wanted = []
    if args.table:
        wanted = ["1", "2", "3"] if "all" in args.table else sorted(set(args.table))
    for t in wanted:
        section = g.get(f"table{t}") or {}
        methods = args.methods or section.get("methods") or TABLE_METHODS[t]
        eps = cli_eps or ([parse_epsilon(e) for e in section["epsilons"]] if section.get("epsilons") else None) \
            or file_eps or TABLE_EPSILONS[t]
        tables[t] = (list(methods), eps)
    custom = None
    if not wanted:
        methods = args.methods or g.get("methods")
        eps = cli_eps or file_eps
        if methods or eps:
            custom = (list(methods or TABLE_METHODS["1"]), eps or TABLE_EPSILONS["1"])
    per_method = {}
    for table in ("method-overrides", "private-method-overrides"):
        per_method[table] = g.get(table) or {}
        if not isinstance(per_method[table], dict):
            raise GridError(f"{table}: a table of methods expected, e.g. [{table}.ffa-lora]")
    spec = GridSpec(tasks=list(tasks), seeds=seeds, tables=tables, custom=custom, preset=preset,
                    overrides=overrides, data_dir=data_dir or None, nonprivate_lr=nonprivate_lr, supernodes=supernodes,
                    backend=str(backend), threads=None if threads is None else int(threads),
                    method_overrides={canonical_method(str(m)): (dict(v) if isinstance(v, dict) else v)
                                      for m, v in per_method["method-overrides"].items()},
                    private_method_overrides={canonical_method(str(m)): (dict(v) if isinstance(v, dict) else v)
                                              for m, v in per_method["private-method-overrides"].items()})
    return spec, out_path


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fedpower-experiment", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("what to run")
    g.add_argument("--table", nargs="+", choices=["1", "2", "3", "all"],
                   help="standard grid(s) of the paper's tables: 1 = FedLoRA, FFA-LoRA, FedPower at non-private, "
                        "eps 9, 6, 3; 2 = input/output perturbation vs FedPower at eps 9, 6, 3; 3 = FedLoRA and "
                        "FedPower refactoring every 10/5/1 rounds at eps 3; all = 1 2 3 (shared cells run once)")
    g.add_argument("--grid", metavar="FILE", help="TOML grid file (see conf/grids/); command-line flags override it")
    g.add_argument("--methods", nargs="+", metavar="M",
                   help="methods (replace the table's): fedpower, fedlora, ffa-lora, input-perturbation, "
                        "output-perturbation, fedpower-F<n>")
    g.add_argument("--epsilons", nargs="+", metavar="EPS", help="privacy budgets (replace the table's): numbers or 'none'")
    g.add_argument("--tasks", nargs="+", metavar="T", help=f"tasks (default sst2): {', '.join(TASKS)}")
    g.add_argument("--seeds", nargs="+", type=int, metavar="S", help="seeds (default 0)")
    g.add_argument("--preset", metavar="TOML", help="base preset for every cell; '{task}' is replaced by the task "
                                                    "(e.g. conf/paper-{task}.toml)")
    g.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra run-config override for every cell (TOML value; strings need inner quotes)")
    g.add_argument("--data-dir", metavar="DIR", help="local GLUE directory (task folder or its parent) passed as "
                                                     "task.data-dir to every cell; '{task}' is substituted")
    g.add_argument("--nonprivate-lr", type=float, metavar="LR",
                   help="train.lr of the non-private cells (paper: 0.05, vs 0.5 private); default: the preset's")
    g.add_argument("--supernodes", type=int, help="simulated silos per run (default 6); with --backend inprocess, "
                                                  "the number of virtual clients")
    r = p.add_argument_group("how to run")
    r.add_argument("--out", metavar="DIR", help="output directory (tables, figures, manifest.json, cells/)")
    r.add_argument("--backend", choices=BACKENDS,
                   help="flwr (default): each cell is a `flwr run` Ray simulation; inprocess: each cell runs the "
                        "real ServerApp and ClientApp in one child process with one model for all virtual clients "
                        "(client-level DP with 1,000 clients on a CPU; not a deployment path)")
    r.add_argument("--threads", type=int, metavar="N", help="torch threads of an inprocess cell (default: torch's)")
    r.add_argument("--dry-run", action="store_true", help="list the cells, where each stands and the cell time left; run nothing")
    r.add_argument("--report-only", action="store_true", help="only (re)write tables and figures from finished cells")
    r.add_argument("--max-cells", type=int, metavar="N", help="run at most N unfinished cells this time")
    r.add_argument("--max-consecutive-failures", type=int, default=3, metavar="N",
                   help="stop the grid after N failed cells in a row (default 3; 0 = never)")
    r.add_argument("--cell-timeout", type=float, metavar="S",
                   help="give up on a cell after S seconds (stopped, reported as failed, retried on the next "
                        "invocation); default: no limit, or 'cell-timeout' of the grid file")
    r.add_argument("--flwr-home", metavar="DIR", help="Flower home, private to this grid (default <out>/flwr-home, or "
                                                      "~/.cache/fedpower/flwr-home-<hash> when <out> is inside the app "
                                                      "directory); must be outside the app directory")
    r.add_argument("--port", type=int, help="private managed SuperLink port (default derived from --out)")
    r.add_argument("--keep-adapters", action="store_true", help="keep each cell's final adapter/ (deleted by default)")
    r.add_argument("--echo", action="store_true", help="stream every run's Flower output")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    argv_list = list(sys.argv[1:] if argv is None else argv)
    try:
        if args.report_only and not args.grid and not (args.table or args.methods or args.epsilons) and args.out:
            man = read_results(Path(args.out) / "manifest.json")
            if not man or "grid" not in man:
                raise GridError(f"--report-only: no manifest.json with a grid in {args.out}")
            spec, out = GridSpec.from_dict(man["grid"]), Path(args.out).resolve()
        else:
            spec, out = build_spec(args)
        cells = validate(spec, out)
        cell_timeout = args.cell_timeout
        if cell_timeout is None and args.grid:
            cell_timeout = _load_grid_file(args.grid).get("cell-timeout")
    except GridError as exc:
        print(f"fedpower-experiment: error: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(grid_status(spec, cells, out))
        return 0
    summary = None
    if not args.report_only:
        import signal

        def _on_sigterm(signum, frame):  # behave like Ctrl-C: save the manifest, stop the SuperLink
            raise KeyboardInterrupt(f"signal {signum}")

        signal.signal(signal.SIGTERM, _on_sigterm)
        try:
            summary = run_grid(spec, out, flwr_home=Path(args.flwr_home) if args.flwr_home else None, port=args.port,
                               echo=args.echo, timeout=cell_timeout, keep_adapters=args.keep_adapters,
                               argv=argv_list, max_cells=args.max_cells,
                               max_consecutive_failures=args.max_consecutive_failures)
        except KeyboardInterrupt as exc:
            print(f"fedpower-experiment: interrupted ({exc or 'Ctrl-C'}) at {time.strftime('%Y-%m-%dT%H:%M:%S')}; "
                  "run the same command again to resume", file=sys.stderr, flush=True)
            return 130
        except GridError as exc:
            print(f"fedpower-experiment: error: {exc}", file=sys.stderr)
            return 2
    if args.report_only and not (out / "cells").is_dir():
        print(f"fedpower-experiment: error: --report-only: no cells in {out} (run the grid first)", file=sys.stderr)
        return 2
    written = write_report(spec, out)
    print(f"fedpower-experiment: wrote {', '.join(t + '.md/.csv' for t in written['tables'])} and "
          f"{len(written['figures'])} figure(s) in {out}")
    narrowed = [f"--{k}" for k in ("methods", "epsilons", "seeds", "tasks") if getattr(args, k) is not None]
    if args.grid and narrowed:
        # The tables are this invocation's selection: a worker that ran one method must not leave
        # the grid's tables looking as if the others had no results.
        print(f"fedpower-experiment: the tables cover only the cells selected by {', '.join(narrowed)}; for the "
              f"whole grid: fedpower-experiment --grid {args.grid} --report-only", file=sys.stderr)
    if written["stale"]:
        print(f"fedpower-experiment: left out of the tables, made with other settings than the grid's (run the grid "
              f"to redo them): {', '.join(written['stale'])}", file=sys.stderr)
    if summary is not None:
        print(f"fedpower-experiment: ran {len(summary['ran'])} cell(s) in {_fmt_seconds(summary['seconds'])}, "
              f"skipped {summary['skipped']} finished")
        elsewhere = summary.get("running_elsewhere") or []
        if elsewhere:
            print(f"fedpower-experiment: {len(elsewhere)} cell(s) still running in another fedpower-experiment "
                  f"process: {', '.join(elsewhere)}")
        failed = [c for c in summary["unfinished"] if c not in elsewhere]
        if failed:
            print(f"fedpower-experiment: {len(failed)} cell(s) NOT finished (re-run the same command "
                  f"to retry): {', '.join(failed)}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
