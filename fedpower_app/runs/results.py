"""results.json: resolved config, calibration, per-round metrics and totals.

Written atomically after every round, so a crash or a budget stop never loses finished rounds.
"""

from __future__ import annotations

import json
import math
import platform
import time
from pathlib import Path
from typing import Any

from .atomic import write_atomic


def _clean(value: Any) -> Any:
    """JSON-safe: NaN/inf become None; tuples become lists."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def write_json_atomic(path: Path, payload: dict) -> None:
    """results.json: strict JSON (NaN/inf as null), written atomically (fedpower_app.runs.atomic)."""
    write_atomic(path, json.dumps(_clean(payload), indent=2, sort_keys=False) + "\n")


class ResultsWriter:
    """Accumulates a run's results and rewrites ``<run_dir>/results.json`` after each change."""

    #: a total a private run does not show (``Disclosure.withheld_totals``)
    WITHHELD = "withheld"

    def __init__(self, run_dir: Path, config: dict[str, Any]) -> None:
        self.withheld: tuple[str, ...] = ()
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "results.json"
        self.started = time.time()
        self.data: dict[str, Any] = {
            "format": "fedpower-results/1",
            "status": "running",
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started)),
            "config": dict(config),
            "environment": {"python": platform.python_version(), "platform": platform.platform()},
            "privacy": None,
            "clients": None,
            "initial_evaluation": None,
            "rounds": [],
            "totals": {},
        }
        self.flush()

    @classmethod
    def restore(cls, run_dir: Path, data: dict[str, Any], *, elapsed: float) -> "ResultsWriter":
        """Continue a checkpointed run: its results as of the checkpoint (later rounds of the killed
        attempt, if results.json holds any, are discarded: they are re-run)."""
        self = cls.__new__(cls)
        self.withheld = ()
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "results.json"
        self.started = time.time() - elapsed
        self.data = dict(data)
        self.data["status"] = "running"
        self.flush()
        return self

    def set(self, key: str, value: Any) -> None:
        self.data[key] = value
        self.flush()

    def add_round(self, row: dict[str, Any]) -> None:
        self.data["rounds"].append(row)
        self._update_totals()
        self.flush()

    def _update_totals(self) -> None:
        rounds = self.data["rounds"]
        evals = [r for r in rounds if r.get("accuracy") is not None]
        self.data["totals"] = {
            "rounds_completed": len(rounds),
            "bytes_up": sum(r.get("bytes_up", 0) for r in rounds),
            "bytes_down": sum(r.get("bytes_down", 0) for r in rounds),
            "server_aggregation_seconds": sum(r.get("aggregation_seconds", 0.0) for r in rounds),
            "dropped_replies": sum(len(r.get("dropped", [])) for r in rounds),
            "missing_replies": sum(len(r.get("missing", [])) for r in rounds),
            "final_accuracy": evals[-1]["accuracy"] if evals else None,
            "best_accuracy": max((r["accuracy"] for r in evals), default=None),
            "final_epsilon": self._final_epsilon(rounds),
            "wall_seconds": time.time() - self.started,
        }
        last = evals[-1] if evals else {}
        for key in ("macro-f1", "balanced-accuracy", "majority-accuracy", "majority-macro-f1"):
            if key in last:  # the metrics beside accuracy (fedpower_app.training.metrics)
                self.data["totals"]["final_" + key.replace("-", "_")] = last[key]
        lead = (self.data.get("config") or {}).get("task.metric", "accuracy")
        if lead in last:  # what task.metric leads with
            self.data["totals"]["lead_metric"] = lead
            self.data["totals"]["final_lead_metric"] = last[lead]
        for key in self.withheld:
            self.data["totals"][key] = self.WITHHELD

    def _final_epsilon(self, rounds: list) -> float | None:
        """The ledger's ε once the run has finished (``privacy_final``): it also counts a release
        charged before an interruption whose round was run again, which no row shows; before that,
        the last row's."""
        final = self.data.get("privacy_final") or {}
        if final.get("epsilon_spent") is not None:
            return final["epsilon_spent"]
        return rounds[-1].get("epsilon") if rounds else None

    def finish(self, status: str, **extra: Any) -> None:
        self.data["status"] = status
        self.data.update(extra)
        self._update_totals()
        self.flush()

    def flush(self) -> None:
        write_json_atomic(self.path, self.data)


def no_round_aggregated(rows: list[dict[str, Any]]) -> str | None:
    """When rounds ran and not one aggregated a silo's reply (every ClientApp failed: out of
    memory, a crash, a timeout), why, in one line: the model is then the initial one, and a run
    that says "completed" would hide it. None otherwise. ``rows``: the rounds' full reports (the
    server's, before ``dp.diagnostics`` withholds the reply counts from results.json)."""
    if not rows or any(int(r.get("aggregated", 0)) > 0 for r in rows):
        return None
    reasons = sorted({d.get("reason", "?") for r in rows for d in r.get("dropped", [])})
    missing = sum(len(r.get("missing", [])) for r in rows)
    parts = [f"{len(rows)} round(s) ran and none aggregated a silo's reply"]
    if missing:
        parts.append(f"{missing} repl(ies) never came (a ClientApp crashed, was killed, e.g. out of memory, or timed out)")
    if reasons:
        parts.append("dropped: " + "; ".join(reasons[:3]) + (" ..." if len(reasons) > 3 else ""))
    return "; ".join(parts)
