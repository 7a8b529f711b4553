"""What a grid is: its methods, epsilons, tasks and seeds, the cells they make, and each cell's run-config overrides."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import PROJECT_ROOT, STRATEGIES, TASKS, ConfigError, load_preset, parse_config, preset_method_tables



FINISHED = ("completed", "stopped-budget")


FORMAT = "fedpower-experiment/1"


# How a cell runs: a `flwr run` Ray simulation, or the in-process grid (fedpower_app.runs.inprocess).
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
    # Ray resources of each ClientApp in a flwr cell (fedpower-run's --cpus-per-client, --gpus-per-client):
    # a ClientApp that reserves no GPU does not see one
    cpus_per_client: float = 1.0
    gpus_per_client: float = 0.0
    # run-config overrides of one method's cells (e.g. FFA-LoRA's own learning rate); applied last
    method_overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    # the same for the method's private cells only, applied after method_overrides
    private_method_overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    # run-config keys of every non-private cell (a schedule of its own: a ceiling trains with many
    # small steps, a DP-SGD run with few large ones); applied after the preset's method tables
    nonprivate_overrides: dict[str, Any] = field(default_factory=dict)
    # the same for one method's non-private cells, applied after method_overrides
    nonprivate_method_overrides: dict[str, dict[str, Any]] = field(default_factory=dict)

    def overrides_of(self, method: str, eps: float | None) -> dict[str, Any]:
        """The per-method run-config overrides of ``method``'s cells at ``eps``."""
        ov = dict(self.method_overrides.get(method, {}))
        ov.update((self.private_method_overrides if eps is not None else self.nonprivate_method_overrides).get(method, {}))
        return ov

    def blocks(self) -> list[tuple[str, list[str], list[float | None]]]:
        out = [(t, m, e) for t, (m, e) in sorted(self.tables.items())]
        if self.custom:
            out.append(("custom", *self.custom))
        return out

    def base_overrides(self, task: str) -> dict[str, Any]:
        """The preset's run-config keys for ``task``, then the grid's overrides (every cell's base)."""
        ov = self._preset(task)[0]
        ov.update(self.overrides)
        return ov

    def preset_method_settings(self, task: str, strategy: str) -> dict[str, Any]:
        """The preset's ``[methods.<strategy>]`` table: settings tuned for this recipe, which the
        grid's own overrides still beat."""
        return {k: v for k, v in self._preset(task)[1].get(strategy, {}).items() if k not in self.overrides}

    def _preset(self, task: str) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
        if not self.preset:
            return {}, {}
        preset = Path(self.preset.replace("{task}", task))
        if not preset.exists():
            raise GridError(f"preset {preset} not found")
        try:
            return preset_method_tables(load_preset(str(preset)))
        except ConfigError as exc:
            raise GridError(f"preset {preset}: {exc}") from None

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
            "cpus_per_client": self.cpus_per_client,
            "gpus_per_client": self.gpus_per_client,
            "method_overrides": self.method_overrides,
            "private_method_overrides": self.private_method_overrides,
            "nonprivate_overrides": self.nonprivate_overrides,
            "nonprivate_method_overrides": self.nonprivate_method_overrides,
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
                   cpus_per_client=float(d.get("cpus_per_client", 1.0)),
                   gpus_per_client=float(d.get("gpus_per_client", 0.0)),
                   method_overrides={str(m): dict(v) for m, v in (d.get("method_overrides") or {}).items()},
                   private_method_overrides={str(m): dict(v)
                                             for m, v in (d.get("private_method_overrides") or {}).items()},
                   nonprivate_overrides=dict(d.get("nonprivate_overrides") or {}),
                   nonprivate_method_overrides={str(m): dict(v)
                                                for m, v in (d.get("nonprivate_method_overrides") or {}).items()})


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
    ov.update(spec.preset_method_settings(cell.task, ov.get("strategy.name", "")))
    if cell.epsilon is None:
        ov["dp.level"] = "none"
        if spec.nonprivate_lr is not None:
            ov["train.lr"] = float(spec.nonprivate_lr)
        ov.update(spec.nonprivate_overrides)
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


def check_gpu_placement(spec: GridSpec) -> None:
    """Before a flwr cell runs: refuse ClientApps that reserve GPUs on a machine without any, and
    warn when a visible GPU would sit idle (``runs.spec.gpu_placement``). A dry run plans a GPU
    grid on any machine, so this is the runner's check, not ``validate``'s."""
    if spec.backend != "flwr":
        return
    from ..runs.spec import gpu_placement

    refusal, warning = gpu_placement(str(spec.overrides.get("device", "auto")), spec.gpus_per_client,
                                     server_device=str(spec.overrides.get("server-device", "auto")))
    if refusal:
        raise GridError(refusal)
    if warning:
        print(f"fedpower-experiment: warning: {warning}", flush=True)


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
    if spec.nonprivate_overrides:
        if not isinstance(spec.nonprivate_overrides, dict):
            raise GridError("nonprivate-overrides: a table of run-config keys expected, e.g. \"train.lr\" = 0.001")
        fixed = sorted(set(spec.nonprivate_overrides) & _CELL_KEYS)
        if fixed:
            raise GridError(f"nonprivate-overrides: {', '.join(fixed)} define(s) the cell (method, epsilon, seed, "
                            "task, where it runs) and cannot be overridden")
        if spec.nonprivate_lr is not None and "train.lr" in spec.nonprivate_overrides:
            raise GridError("nonprivate-lr and nonprivate-overrides both set train.lr: keep one")
    for table, per_method in (("method-overrides", spec.method_overrides),
                              ("private-method-overrides", spec.private_method_overrides),
                              ("nonprivate-method-overrides", spec.nonprivate_method_overrides)):
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
    if spec.cpus_per_client <= 0 or spec.gpus_per_client < 0:
        raise GridError("--cpus-per-client must be > 0 and --gpus-per-client >= 0")

    cells = spec.cells()
    for cell in cells:
        try:
            parse_config(cell_overrides(spec, cell, out))
        except ConfigError as exc:
            raise GridError(f"cell {cell.cell_id}: {exc}") from None
    return cells
