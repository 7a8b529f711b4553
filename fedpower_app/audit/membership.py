"""``fedpower-audit``: does the privacy hold? Membership-inference attacks and a canary audit of
the models a configuration releases.

It trains R runs of one federated configuration (``flwr run`` of this app, as ``fedpower-run`` and
``fedpower-experiment`` do), seeds 0..R-1. From the task's train split it draws, once per audit,
four disjoint sets:

  pool        n examples; each run includes each one independently with probability 1/2
  population  examples no run trains on (RMIA's reference population)
  canaries    m examples with a flipped label; each run includes each one with probability 1/2
  background  optional examples every run trains on

Each run stores its logits on the pool, the population and the canaries, its membership coins and
its privacy ledger (``runs/runNNN/audit.npz``, ``results.json``); re-scoring never retrains and an
interrupted audit resumes (finished runs are kept, an unfinished one is run again).

The report (``report.md``, ``report.json``, ``roc.png``, ``attack_accuracy.png``) attacks every
run with the other runs as references (leave-one-out): the paper's shadow-model, loss and
calibration attacks, LiRA online/offline (fixed variance) and RMIA online/offline. Per attack:
AUC and TPR at 1 % and 0.1 % FPR pooled over targets with bootstrap CIs over targets, and the
balanced accuracy (the paper's "success rate"). The log-log ROC shows the DP ceiling of the runs'
own accountant, TPR <= min over delta of e^eps(delta) FPR + delta. The canary audit is Steinke,
Nasr & Jagielski's one-run bound at 95 % confidence, with its guesses fixed in advance: the 10 %
highest-scoring (run, canary) pairs are guessed IN and the 10 % lowest OUT, scored by the
calibration attack (the target's phi minus the mean phi of the runs that left the canary out).
If the bound exceeds the claimed epsilon, the audit FAILS (exit code 1): the claim, its analysis
or its code is wrong.

Examples:

  fedpower-audit --preset conf/audit-sst2.toml --data-dir /work/shared/glue/SST-2 --runs 16 \\
      --out results/audit/sst2-fedpower-eps8 --set dp.epsilon=8
  fedpower-audit --out results/audit/sst2-fedpower-eps8 --report-only
  fedpower-audit compare results/audit/sst2-fedpower-* --out results/audit/fedpower.md
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..atomic import write_json_atomic
from ..config import PROJECT_ROOT, ConfigError, load_preset, parse_config

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
# Running
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


def _examples(task, rows: list[int], labels: list[int]):
    from ..data.types import TextExamples

    picked = task.train.select(rows)
    return TextExamples(text_a=picked.text_a, labels=list(labels), text_b=picked.text_b)


def released_logits(plan: AuditPlan, adapter_dir: Path, *, batch_size: int = 128) -> dict[str, np.ndarray]:
    """Logits of the released model on the pool, the population and the canaries (flipped labels)."""
    import torch

    from ..data import load_task, tokenize
    from ..released import load_released
    from ..training import evaluate

    cfg = parse_config(plan.overrides)
    task = load_task(cfg)
    model, tokenizer = load_released(adapter_dir)
    out = {}
    for name, rows, labels in (("pool", plan.pool, plan.pool_labels),
                               ("population", plan.population, plan.population_labels),
                               ("canaries", plan.canaries, plan.canary_labels)):
        if not rows:
            out[name] = np.zeros((0, plan.num_labels), dtype=np.float32)
            continue
        split = tokenize(_examples(task, rows, labels), tokenizer, cfg["task.max-length"])
        chunks: list = []
        with torch.no_grad():
            evaluate(model, split, batch_size=batch_size, device=torch.device("cpu"), logits_out=chunks)
        out[name] = torch.cat(chunks).numpy().astype(np.float32)
    return out


def privacy_curve(results: dict[str, Any]) -> dict[str, Any]:
    """The run's (delta, eps(delta)) curve from its own ledgers, for the DP ceiling.

    DP-SGD on the silos: every silo's ledger, eps(delta) = max over silos, on a delta grid. Other
    mechanisms: the one (delta, eps) the run reports. Non-private: no curve."""
    from ..privacy.accounting.silo import SiloLedger, dp_sgd_epsilon

    final = results.get("privacy_final") or {}
    cfg = results.get("config") or {}
    if cfg.get("dp.level", "none") == "none" or not final:
        return {"private": False, "points": []}
    if final.get("noise_at") == "silo" and final.get("ledgers"):
        ledgers = [SiloLedger.from_state_dict(s) for s in final["ledgers"].values()]
        points = []
        for delta in DELTA_GRID:
            eps = max(dp_sgd_epsilon(led.events(), delta, led.accountant) for led in ledgers)
            points.append((delta, eps))
        return {"private": True, "points": points, "delta": final["delta"], "epsilon": final["epsilon_spent"],
                "source": "per-silo DP-SGD ledgers, max over silos"}
    eps = final.get("epsilon_spent")
    delta = final.get("delta", cfg.get("dp.delta"))
    return {"private": True, "points": [(delta, eps)] if eps is not None else [], "delta": delta, "epsilon": eps,
            "source": "the run's final (eps, delta)"}


def run_one(plan: AuditPlan, out: Path, run: int, *, flwr_home: Path, port: int, echo: bool,
            timeout: float | None) -> dict[str, Any]:
    from ..launcher import run_flwr

    d = run_dir(out, run)
    if d.exists():
        shutil.rmtree(d)  # an interrupted attempt: start clean
    d.mkdir(parents=True)
    rows_file = d / "train-rows.json"
    _write_json(rows_file, plan.train_rows(run))
    overrides = {**plan.overrides, "seed": run, "run-name": d.name, "output-dir": str(d.parent.resolve()),
                 "task.train-rows": str(rows_file.resolve())}
    t0 = time.time()
    outcome = run_flwr(PROJECT_ROOT, overrides, num_supernodes=plan.supernodes, flwr_home=flwr_home,
                       superlink_port=port, echo=echo, timeout=timeout)
    (d / "flwr.log").write_text("\n".join(outcome.output.splitlines()[-80:]) + "\n")
    try:
        results = json.loads((d / "results.json").read_text())
    except (OSError, json.JSONDecodeError):
        results = {}
    status = results.get("status", "missing")
    if status not in ("completed", "stopped-budget"):
        return {"run": run, "status": status, "error": results.get("error") or outcome.status,
                "seconds": round(time.time() - t0, 1)}
    logits = released_logits(plan, d / "adapter")
    keep, inc = plan.coins(run)
    curve = privacy_curve(results)
    tmp = d / "audit.tmp.npz"
    np.savez_compressed(tmp, logits_pool=logits["pool"], logits_population=logits["population"],
                        logits_canaries=logits["canaries"], keep=keep, canary_in=inc,
                        privacy=np.array(json.dumps(curve)))
    os.replace(tmp, d / "audit.npz")
    shutil.rmtree(d / "adapter", ignore_errors=True)  # the logits are what the audit needs
    (d / "checkpoint.pt").unlink(missing_ok=True)
    totals = results.get("totals") or {}
    return {"run": run, "status": status, "seconds": round(time.time() - t0, 1),
            "accuracy": totals.get("final_accuracy"), "epsilon": curve.get("epsilon")}


def run_audit(plan: AuditPlan, out: Path, *, echo: bool = False, timeout: float | None = None,
              max_runs: int | None = None, port: int | None = None, log=print) -> list[dict[str, Any]]:
    from ..runs import default_flwr_home, default_port, is_inside as _inside
    from ..launcher import stop_local_superlink

    flwr_home = default_flwr_home(out)
    if _inside(flwr_home, PROJECT_ROOT):
        raise AuditError(f"the Flower home {flwr_home} would be inside the app directory")
    port = port or default_port(out)
    gitignore = out / ".gitignore"
    if not gitignore.exists():
        gitignore.write_text("# written by fedpower-audit: Flower state, adapters and row lists are not results\n"
                             "flwr-home/\nruns/*/adapter/\nruns/*/train-rows.json\nruns/*/checkpoint.pt\n"
                             "runs/*/inflight.json\n*.tmp*\n")
    unfinished = [r for r in range(plan.runs) if not run_finished(out, r)]
    todo = unfinished[:max_runs] if max_runs is not None else unfinished
    log(f"fedpower-audit: {plan.runs} runs, {plan.runs - len(unfinished)} already finished, {len(todo)} to run now -> {out}")
    done: list[dict[str, Any]] = []
    t_start = time.time()
    try:
        for i, r in enumerate(todo, 1):
            log(f"[run {i}/{len(todo)}] run{r:03d}: training (seed {r}, {len(plan.train_rows(r)['rows'])} examples)")
            entry = run_one(plan, out, r, flwr_home=flwr_home, port=port, echo=echo, timeout=timeout)
            done.append(entry)
            per = (time.time() - t_start) / i
            eps = entry.get("epsilon")
            if entry["status"] in ("completed", "stopped-budget"):
                log(f"[run {i}/{len(todo)}] run{r:03d}: done in {entry['seconds']:.0f} s | accuracy "
                    f"{entry.get('accuracy') if entry.get('accuracy') is None else round(entry['accuracy'], 4)} | "
                    f"eps {'n/a' if eps is None else f'{eps:.3f}'} | ETA {per * (len(todo) - i) / 60:.1f} min")
            else:
                log(f"[run {i}/{len(todo)}] run{r:03d}: FAILED ({entry['status']}): {entry.get('error')} | "
                    f"log {run_dir(out, r) / 'flwr.log'}")
                if len(done) >= 2 and all(e["status"] not in ("completed", "stopped-budget") for e in done[-2:]):
                    log("fedpower-audit: two runs failed in a row; stopping. Fix it and run the same command to resume.")
                    break
    finally:
        if todo:
            stop_local_superlink(flwr_home)
    return done


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------

@dataclass
class AuditData:
    plan: AuditPlan
    runs: list[int]
    logits_pool: np.ndarray        # (R, n, C)
    logits_population: np.ndarray  # (R, nz, C)
    logits_canaries: np.ndarray    # (R, m, C)
    keep: np.ndarray               # (R, n)
    canary_in: np.ndarray          # (R, m)
    privacy: list[dict[str, Any]]
    accuracy: list[float | None]


def load_audit(out: Path) -> AuditData:
    plan = load_plan(out)
    if plan is None:
        raise AuditError(f"{out / 'audit.json'} not found: not an audit directory")
    runs = [r for r in range(plan.runs) if run_finished(out, r)]
    if len(runs) < 2:
        raise AuditError(f"{len(runs)} finished run(s) in {out}; the attacks need at least 2")
    arrays: dict[str, list] = {k: [] for k in ("logits_pool", "logits_population", "logits_canaries", "keep", "canary_in")}
    privacy, accuracy = [], []
    for r in runs:
        with np.load(run_dir(out, r) / "audit.npz") as z:
            for k in arrays:
                arrays[k].append(z[k])
            privacy.append(json.loads(str(z["privacy"])))
        keep, inc = plan.coins(r)
        if not (np.array_equal(arrays["keep"][-1], keep) and np.array_equal(arrays["canary_in"][-1], inc)):
            raise AuditError(f"run{r:03d}: stored membership coins differ from the plan's; the run belongs to another audit")
        res = json.loads((run_dir(out, r) / "results.json").read_text())
        accuracy.append((res.get("totals") or {}).get("final_accuracy"))
    return AuditData(plan, runs, *(np.stack(arrays[k]) for k in arrays), privacy=privacy, accuracy=accuracy)


def merged_curve(privacy: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """The worst run's eps at every delta (runs of one audit share a configuration)."""
    if not privacy or not all(p.get("private") for p in privacy):
        return []
    best: dict[float, float] = {}
    for p in privacy:
        for delta, eps in p["points"]:
            best[float(delta)] = max(best.get(float(delta), 0.0), float(eps))
    return sorted(best.items())


def canary_scores(data: AuditData) -> tuple[np.ndarray, np.ndarray]:
    """The pre-registered canary score of every (run, canary) pair, and its inclusion coin."""
    from .attacks import calibration_scores, signals

    if data.logits_canaries.shape[1] == 0:
        return np.zeros(0), np.zeros(0, dtype=bool)
    sig = signals(data.logits_canaries, np.asarray(data.plan.canary_labels)[None, :])
    scores = []
    for t in range(len(data.runs)):
        refs = [j for j in range(len(data.runs)) if j != t]
        scores.append(calibration_scores(sig.phi[t], sig.phi[refs], data.canary_in[refs]))
    return np.concatenate(scores), data.canary_in.reshape(-1)


def build_report(out: Path, *, bootstrap: int = 200, attacks: Sequence[str] | None = None) -> dict[str, Any]:
    from . import bounds as A
    from . import attacks as mia

    data = load_audit(out)
    plan = data.plan
    scores = mia.leave_one_out_scores(data.logits_pool, np.asarray(plan.pool_labels), data.keep,
                                      data.logits_population, np.asarray(plan.population_labels),
                                      attacks=attacks or mia.ATTACKS, seed=plan.seed)
    metrics = {a: mia.attack_metrics(a, s, list(data.keep), bootstrap=bootstrap, seed=plan.seed) for a, s in scores.items()}
    curve = merged_curve(data.privacy)
    claimed = max(p["epsilon"] for p in data.privacy) if curve else None
    delta = float(data.privacy[0].get("delta") or plan.overrides.get("dp.delta", 1e-5)) if curve else 1e-5
    ceiling_violations = []
    for a, m in metrics.items():
        for alpha, (lo, _) in ((0.01, m.tpr_at_1pct_ci), (0.001, m.tpr_at_01pct_ci)):
            if curve and not math.isnan(lo):
                ceiling = float(mia.dp_tpr_ceiling(np.array([alpha]), curve)[0])
                if lo > ceiling:
                    ceiling_violations.append({"attack": a, "fpr": alpha, "tpr_ci_low": lo, "ceiling": ceiling})
    c_scores, c_in = canary_scores(data)
    canary = A.canary_audit(c_scores, c_in, delta=delta, guess_fraction=GUESS_FRACTION, beta=1 - CONFIDENCE,
                            claimed_epsilon=claimed) if c_scores.size else None
    acc = [a for a in data.accuracy if a is not None]
    report = {
        "format": FORMAT,
        "out": str(out),
        "config": plan.overrides,
        "runs_finished": len(data.runs),
        "runs_planned": plan.runs,
        "pool": len(plan.pool), "population": len(plan.population), "canaries": len(plan.canaries),
        "background": plan.background_summary()[0],
        "accuracy_mean": float(np.mean(acc)) if acc else None,
        "accuracy_std": float(np.std(acc)) if acc else None,
        "claimed_epsilon": claimed, "delta": delta if curve else None,
        "privacy_source": data.privacy[0].get("source") if curve else "non-private",
        "attacks": {a: m.as_dict() for a, m in metrics.items()},
        "dp_ceiling": None if not curve else {
            "tpr_at_1pct": float(mia.dp_tpr_ceiling(np.array([0.01]), curve)[0]),
            "tpr_at_01pct": float(mia.dp_tpr_ceiling(np.array([0.001]), curve)[0])},
        "ceiling_violations": ceiling_violations,
        "canary_audit": None if canary is None else {**canary.as_dict(), "score": CANARY_SCORE,
                                                     "pooled_over_runs": len(data.runs)},
        "resolution": resolution_note(metrics, len(data.runs)),
    }
    _write_json(out / "report.json", report)
    (out / "report.md").write_text(report_markdown(report))
    plot_roc(metrics, curve, out / "roc.png", title=_title(plan, claimed))
    plot_bars({_title(plan, claimed): report}, out / "attack_accuracy.png")
    return report


def resolution_note(metrics: dict, runs: int) -> str:
    m = next(iter(metrics.values()))
    n_out = m.nonmembers
    parts = [f"{runs} runs pooled: {m.members} member and {n_out} non-member (run, example) pairs",
             f"TPR@1% rests on ~{n_out * 0.01:.0f} false positives"]
    parts.append(f"TPR@0.1% on ~{n_out * 0.001:.0f} (LOW COUNT: read it as noise)" if m.tpr_at_01pct_low_count
                 else f"TPR@0.1% on ~{n_out * 0.001:.0f}")
    if runs < 8:
        parts.append("with fewer than 8 runs the per-example attacks (LiRA, calibration) have few references "
                     "per example and lose power")
    return "; ".join(parts)


def _title(plan: AuditPlan, claimed: float | None) -> str:
    method = plan.overrides.get("strategy.name", "fedpower")
    return f"{method}, " + ("non-private" if claimed is None else f"eps {claimed:.2f}")


def _pct(x: float) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.2f}"


def report_markdown(r: dict[str, Any]) -> str:
    lines = [f"# Membership-inference audit: {r['config'].get('strategy.name', 'fedpower')}, "
             + ("non-private" if r["claimed_epsilon"] is None else f"ε = {r['claimed_epsilon']:.3f}, δ = {r['delta']:g}"),
             "",
             f"{r['runs_finished']} runs (of {r['runs_planned']} planned); audit pool {r['pool']}, population "
             f"{r['population']}, canaries {r['canaries']}, background {r['background']}; released-model accuracy "
             f"{_pct(r['accuracy_mean'])} ± {_pct(r['accuracy_std'])} %.",
             f"Resolution: {r['resolution']}.", "",
             "| attack | AUC (95 % CI) | TPR@1% FPR (CI) | TPR@0.1% FPR (CI) | balanced accuracy |",
             "|---|---|---|---|---|"]
    for a, m in r["attacks"].items():
        low = " (low count)" if m["tpr_at_01pct_low_count"] else ""
        lines.append(f"| {a} | {m['auc']:.4f} ({m['auc_ci'][0]:.4f}–{m['auc_ci'][1]:.4f}) | "
                     f"{_pct(m['tpr_at_1pct'])} % ({_pct(m['tpr_at_1pct_ci'][0])}–{_pct(m['tpr_at_1pct_ci'][1])}) | "
                     f"{_pct(m['tpr_at_01pct'])} %{low} | {_pct(m['balanced_accuracy'])} % |")
    if r["dp_ceiling"]:
        lines += ["", f"DP ceiling from the runs' own accountant ({r['privacy_source']}): TPR@1% ≤ "
                  f"{_pct(r['dp_ceiling']['tpr_at_1pct'])} %, TPR@0.1% ≤ {_pct(r['dp_ceiling']['tpr_at_01pct'])} %."]
        if r["ceiling_violations"]:
            lines.append("**CEILING VIOLATED** (an attack's CI lies above what the claimed DP allows): "
                         + "; ".join(f"{v['attack']} at FPR {v['fpr']:g}" for v in r["ceiling_violations"]))
    c = r["canary_audit"]
    if c:
        verdict = ("**FAILED: the lower bound exceeds the claimed ε**" if c["violated"] else
                   ("passed (ε̂ ≤ claimed ε)" if c["claimed_epsilon"] is not None else "no claim to check (non-private)"))
        lines += ["", f"Canary audit (Steinke, Nasr & Jagielski 2023, one run): {c['canaries']} (run, canary) pairs "
                  f"(label-flipped, each included with probability ½), score `{c['score']}`, "
                  f"{c['guesses_in']} IN + {c['guesses_out']} OUT guesses fixed in advance, {c['correct']} correct: "
                  f"**ε̂ = {c['epsilon_lower_bound']:.3f}** at {100 * c['confidence']:.0f} % confidence "
                  f"(the most this audit could ever certify: {c['ceiling']:.3f}); {verdict}.",
                  "A small ε̂ is not evidence of privacy: it is a lower bound, capped by the ceiling."]
    return "\n".join(lines) + "\n"


def plot_roc(metrics: dict, curve: list, path: Path, *, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .attacks import dp_tpr_ceiling

    fig, ax = plt.subplots(figsize=(5.5, 5))
    x = np.logspace(-5, 0, 300)
    ax.plot(x, x, "k:", lw=1, label="chance")
    if curve:
        ax.plot(x, dp_tpr_ceiling(x, curve), "r--", lw=1.5, label="DP ceiling (accountant)")
    for a, m in metrics.items():
        fpr, tpr = np.maximum(m.fpr, 1e-5), np.maximum(m.tpr, 1e-5)
        ax.plot(fpr, tpr, lw=1.2, label=f"{a} (AUC {m.auc:.3f})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(1e-4, 1)
    ax.set_ylim(1e-4, 1)
    ax.set_xlabel("false positive rate")
    ax.set_ylabel("true positive rate")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_bars(reports: dict[str, dict], path: Path) -> None:
    """Attack accuracy (balanced) per attack and setting: the paper's Figure 4."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(reports)
    attacks = list(next(iter(reports.values()))["attacks"])
    width = 0.8 / max(1, len(settings))
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(attacks)), 4))
    for i, s in enumerate(settings):
        vals = [100 * reports[s]["attacks"][a]["balanced_accuracy"] for a in attacks]
        ax.bar(np.arange(len(attacks)) + i * width, vals, width, label=s)
    ax.axhline(50, color="k", lw=0.8, ls=":")
    ax.set_xticks(np.arange(len(attacks)) + width * (len(settings) - 1) / 2)
    ax.set_xticklabels(attacks, rotation=20, fontsize=8)
    ax.set_ylabel("attack accuracy (balanced, %)")
    ax.set_ylim(45, max(60, 5 + max(100 * r["attacks"][a]["balanced_accuracy"] for r in reports.values() for a in attacks)))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def compare(dirs: Sequence[Path], out_md: Path) -> str:
    """One table (and bar chart) over several audit directories' reports."""
    reports = {}
    for d in dirs:
        path = Path(d) / "report.json"
        if not path.exists():
            raise AuditError(f"{path} not found: run `fedpower-audit --out {d} --report-only` first")
        r = json.loads(path.read_text())
        name = f"{r['config'].get('strategy.name', 'fedpower')}, " + \
            ("non-private" if r["claimed_epsilon"] is None else f"ε={r['claimed_epsilon']:.2f}")
        if name in reports:  # two audits of the same setting (e.g. other data): keep both, by directory
            name = f"{name} ({Path(d).name})"
        reports[name] = r
    lines = ["| setting | runs | accuracy % | best attack | AUC | TPR@1% FPR % | balanced acc. % | DP ceiling TPR@1% | canary ε̂ (ceiling) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in reports.items():
        best = max(r["attacks"], key=lambda a: r["attacks"][a]["tpr_at_1pct"])
        m = r["attacks"][best]
        c = r.get("canary_audit") or {}
        ceil = "—" if not r.get("dp_ceiling") else f"{_pct(r['dp_ceiling']['tpr_at_1pct'])} %"
        lines.append(f"| {name} | {r['runs_finished']} | {_pct(r['accuracy_mean'])} | {best} | {m['auc']:.3f} | "
                     f"{_pct(m['tpr_at_1pct'])} ({_pct(m['tpr_at_1pct_ci'][0])}–{_pct(m['tpr_at_1pct_ci'][1])}) | "
                     f"{_pct(m['balanced_accuracy'])} | {ceil} | "
                     f"{c.get('epsilon_lower_bound', float('nan')):.3f} ({c.get('ceiling', float('nan')):.2f}) |")
    text = "\n".join(lines) + "\n"
    out_md.parent.mkdir(parents=True, exist_ok=True)
    out_md.write_text(text)
    plot_bars(reports, out_md.with_suffix(".png"))
    return text


# ------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------

def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fedpower-audit", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="audit directory (created; an existing one is resumed)")
    p.add_argument("--preset", help="run-config preset (conf/*.toml) every run uses")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="run-config override (TOML value)")
    p.add_argument("--data-dir", help="task.data-dir for every run")
    p.add_argument("--runs", type=int, default=16, help="R: runs with seeds 0..R-1 (default 16)")
    p.add_argument("--pool", type=int, default=2000, help="audit pool size (default 2000)")
    p.add_argument("--population", type=int, default=1000, help="population set size (default 1000)")
    p.add_argument("--canaries", type=int, default=500, help="label-flipped canaries (default 500)")
    p.add_argument("--background", type=int, default=0, help="examples every run trains on (default 0)")
    p.add_argument("--audit-seed", type=int, default=0, help="seed of the split and of the membership coins")
    p.add_argument("--supernodes", type=int, default=6)
    p.add_argument("--run-timeout", type=float, default=3600.0, help="seconds before a hung run is stopped")
    p.add_argument("--port", type=int, help="managed SuperLink port (default: derived from --out)")
    p.add_argument("--max-runs", type=int, help="run at most this many runs now (resume later)")
    p.add_argument("--report-only", action="store_true", help="only re-score the finished runs")
    p.add_argument("--bootstrap", type=int, default=200, help="bootstrap resamples of the targets for the CIs")
    p.add_argument("--verbose", action="store_true", help="stream every run's output")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["compare"]:
        cp = argparse.ArgumentParser(prog="fedpower-audit compare")
        cp.add_argument("dirs", nargs="+")
        cp.add_argument("--out", required=True, help="markdown file (a .png bar chart is written beside it)")
        a = cp.parse_args(argv[1:])
        try:
            print(compare([Path(d) for d in a.dirs], Path(a.out)), end="")
        except AuditError as exc:
            print(f"fedpower-audit: {exc}", file=sys.stderr)
            return 2
        return 0
    args = make_parser().parse_args(argv)
    out = Path(args.out).expanduser().resolve()
    try:
        if not args.report_only:
            from ..launcher import parse_set

            overrides = load_preset(args.preset) if args.preset else {}
            overrides.update(parse_set(args.set))
            if args.data_dir:
                overrides["task.data-dir"] = str(Path(args.data_dir).expanduser().resolve())
            bad = [k for k in PER_RUN_KEYS if k in overrides]
            if bad:
                raise AuditError(f"{', '.join(bad)} are set per run by the audit; remove them")
            plan = make_plan(overrides, runs=args.runs, pool=args.pool, population=args.population,
                             canaries=args.canaries, background=args.background, seed=args.audit_seed,
                             supernodes=args.supernodes)
            old = load_plan(out)
            if old is not None:
                diff = old.comparable(plan)
                if diff:
                    raise AuditError(f"{out} holds another audit (differs in: {', '.join(diff)}); "
                                     "use another --out or the same settings")
                if plan.runs != old.runs:
                    print(f"fedpower-audit: runs {old.runs} -> {plan.runs}", flush=True)
            out.mkdir(parents=True, exist_ok=True)
            _write_json(out / "audit.json", plan.to_json())
            run_audit(plan, out, echo=args.verbose, timeout=args.run_timeout, max_runs=args.max_runs,
                      port=args.port)
        report = build_report(out, bootstrap=args.bootstrap)
    except (AuditError, ConfigError) as exc:
        print(f"fedpower-audit: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fedpower-audit: interrupted; run the same command to resume", file=sys.stderr)
        return 130
    print((out / "report.md").read_text(), end="")
    print(f"fedpower-audit: report in {out / 'report.md'}, figures {out / 'roc.png'}, {out / 'attack_accuracy.png'}")
    c = report.get("canary_audit")
    if (c and c["violated"]) or report["ceiling_violations"]:
        print("fedpower-audit: AUDIT FAILED: the observed leakage exceeds what the claimed epsilon allows. "
              "The claim, its analysis or its code is wrong.", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
