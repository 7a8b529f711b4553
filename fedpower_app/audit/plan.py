"""The membership audit's plan and its directory: what an audit trains (the disjoint pool,
population, canaries and background of one draw, R runs of one configuration), validated and
written once to ``plan.json``, and where each run lives (``runs/runNNN``)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..runs.atomic import write_json_atomic
from ..config import ConfigError, parse_config

FORMAT = "fedpower-audit/1"
CANARY_SCORE = "calibration"  # fixed in advance (one-run audits must not pick it after looking)
GUESS_FRACTION = 0.1
CONFIDENCE = 0.95
DELTA_GRID = tuple(float(d) for d in np.logspace(-12, -0.5, 47))
PER_RUN_KEYS = ("seed", "run-name", "output-dir", "task.train-rows")


class AuditError(ValueError):
    """A bad audit request (exit code 2)."""


# ------------------------------------------------------------------------------------------------
# The plan: which rows are pool, population, canaries, background; per-run coins
# ------------------------------------------------------------------------------------------------

@dataclass
class AuditPlan:
    overrides: dict[str, Any]  # the run config of every run (preset + --set), without per-run keys
    runs: int
    seed: int
    num_labels: int
    pool: list[int]
    pool_labels: list[int]
    population: list[int]
    population_labels: list[int]
    canaries: list[int]
    canary_labels: list[int]  # flipped
    background: list[int] = field(default_factory=list)
    background_labels: list[int] = field(default_factory=list)
    supernodes: int = 6
    format: str = FORMAT
    # audit.json does not list the background (60,000 rows made it ~0.9 MB): make_plan draws it again
    # from the audit seed on every training invocation, and these two identify it.
    background_count: int | None = None
    background_sha256: str | None = None

    def background_summary(self) -> tuple[int, str]:
        """(count, sha256) of the background rows and labels, from the lists when held."""
        if self.background or self.background_count is None:
            digest = hashlib.sha256(json.dumps([self.background, self.background_labels]).encode()).hexdigest()
            return len(self.background), digest
        return int(self.background_count), str(self.background_sha256)

    def to_json(self) -> dict[str, Any]:
        """What audit.json holds: the plan without the background lists (their count and digest)."""
        data = asdict(self)
        data["background_count"], data["background_sha256"] = self.background_summary()
        del data["background"], data["background_labels"]
        return data

    def coins(self, run: int) -> tuple[np.ndarray, np.ndarray]:
        """(pool membership, canary inclusion) of one run: independent fair coins, fixed by the
        audit seed and the run index (never balanced: the theorem needs i.i.d. coins)."""
        rng = np.random.default_rng([self.seed, run, 0xA0D17])
        return rng.random(len(self.pool)) < 0.5, rng.random(len(self.canaries)) < 0.5

    def silo_of_candidates(self) -> np.ndarray:
        """The silo of every candidate row (background, then pool, then canaries), fixed by the
        audit seed alone: never by a run's coins. A row that is in goes to its silo, whatever
        else is in, so "canary in" and "canary out" differ by exactly that canary in exactly one
        silo (neighbouring datasets for the silo's accountant); an IID split of the members would
        re-permute every silo's shard whenever one coin flips."""
        total = len(self.background) + len(self.pool) + len(self.canaries)
        rng = np.random.default_rng([self.seed, 0x5110])
        return rng.permutation(total) % self.supernodes

    def train_rows(self, run: int) -> dict[str, list]:
        keep, inc = self.coins(run)
        return self.rows_for(keep, inc)

    def rows_for(self, keep: np.ndarray, inc: np.ndarray) -> dict[str, list]:
        """The ``task.train-rows`` spec of one run: its member rows, their labels, each row's silo
        (``partitions``) and every silo's declared size (``declared_sizes``: its candidates, all
        of them in). A silo samples at q = b / declared size, the same rate in and out, so its
        DP-SGD is the subsampled Gaussian of its accountant for either world."""
        if self.background_count and len(self.background) != self.background_count:
            # a plan read from audit.json names its background without listing it: training needs
            # the plan make_plan draws again from the audit seed
            raise AuditError("this audit plan does not hold its background rows; make it with make_plan")
        member = np.concatenate([np.ones(len(self.background), bool), np.asarray(keep, bool), np.asarray(inc, bool)])
        rows = np.asarray(list(self.background) + list(self.pool) + list(self.canaries), dtype=np.int64)
        labels = np.asarray(list(self.background_labels) + list(self.pool_labels) + list(self.canary_labels),
                            dtype=np.int64)
        silo = self.silo_of_candidates()
        return {"rows": rows[member].tolist(), "labels": labels[member].tolist(),
                "partitions": silo[member].tolist(),
                "declared_sizes": np.bincount(silo, minlength=self.supernodes).tolist()}

    def comparable(self, other: "AuditPlan") -> list[str]:
        """Fields that differ (a resumed audit must be the same audit)."""
        a, b = self.to_json(), other.to_json()
        return [k for k in a if a[k] != b.get(k) and k != "runs"]


def make_plan(overrides: dict[str, Any], *, runs: int, pool: int, population: int, canaries: int,
              background: int, seed: int, supernodes: int) -> AuditPlan:
    from ..data import load_task

    if runs < 2:
        raise AuditError("--runs must be >= 2 (every run is attacked with the others as references)")
    for name, value in (("--pool", pool), ("--population", population)):
        if value < 2:
            raise AuditError(f"{name} must be >= 2, got {value}")
    if canaries < 0 or background < 0:
        raise AuditError("--canaries and --background must be >= 0")
    try:
        cfg = parse_config(overrides)
    except ConfigError as exc:
        raise AuditError(str(exc)) from None
    if cfg["task.train-rows"]:
        raise AuditError("task.train-rows is set by the audit itself; remove it from the preset/--set")
    try:
        task = load_task(cfg)
    except (OSError, ValueError) as exc:
        raise AuditError(f"task data: {exc}") from None
    n = len(task.train)
    need = pool + population + canaries + background
    if need > n:
        raise AuditError(f"the audit needs {need} distinct train examples (pool {pool} + population {population} + "
                         f"canaries {canaries} + background {background}) but the {task.name} train split has {n}")
    rng = np.random.default_rng([seed, 0xC0FFEE])
    perm = rng.permutation(n)
    cut = np.cumsum([pool, population, canaries, background])
    p_rows, z_rows, c_rows, b_rows = (perm[a:b].tolist() for a, b in zip([0, *cut[:-1]], cut))
    labels = np.asarray(task.train.labels)
    c_true = labels[c_rows]
    # A flipped label: any other class, uniformly (binary tasks: the other one).
    shift = rng.integers(1, task.num_labels, size=len(c_rows)) if task.num_labels > 2 else np.ones(len(c_rows), int)
    c_flipped = ((c_true + shift) % task.num_labels).tolist()
    return AuditPlan(overrides=dict(overrides), runs=runs, seed=seed, num_labels=task.num_labels,
                     pool=p_rows, pool_labels=labels[p_rows].tolist(), population=z_rows,
                     population_labels=labels[z_rows].tolist(), canaries=c_rows, canary_labels=c_flipped,
                     background=b_rows, background_labels=labels[b_rows].tolist(), supernodes=supernodes)


def _write_json(path: Path, payload: Any) -> None:
    write_json_atomic(path, payload, indent=1)


def load_plan(out: Path) -> AuditPlan | None:
    path = out / "audit.json"
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise AuditError(f"{path} is not valid JSON ({exc}); move it away to start a new audit") from None
    if data.get("format") != FORMAT:
        raise AuditError(f"{path} has format {data.get('format')!r}, expected {FORMAT!r}")
    return AuditPlan(**data)


# ------------------------------------------------------------------------------------------------

def run_dir(out: Path, run: int) -> Path:
    return out / "runs" / f"run{run:03d}"


def run_finished(out: Path, run: int) -> bool:
    d = run_dir(out, run)
    if not (d / "audit.npz").exists():
        return False
    try:
        return json.loads((d / "results.json").read_text()).get("status") in ("completed", "stopped-budget")
    except (OSError, json.JSONDecodeError):
        return False


