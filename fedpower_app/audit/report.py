"""The membership audit's report: load an audit's runs, attack every run with the others as
references (leave-one-out), the canary bound, ``report.md`` / ``report.json``, the ROC with the DP
ceiling and the bar chart, and ``compare`` across audits. ``fedpower-audit --report-only`` and the
end of every audit call :func:`build_report` (``audit.membership`` trains the runs)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..figures import save_png
from .plan import (CANARY_SCORE, CONFIDENCE, FORMAT, GUESS_FRACTION, AuditError, AuditPlan, _write_json,
                   load_plan, run_dir, run_finished)



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
                  "A small ε̂ is not evidence of privacy: it is a lower bound, capped by the ceiling.",
                  "These label-flipped canaries are the black-box view of the released model, and they are weak at "
                  "this model size: on non-private models they gave ε̂ between 0 and 0.26 (RESULTS.md). The audits "
                  "that can fail, with positive controls that they refute, are `fedpower-audit white-box` (DP-SGD "
                  "on the silos, every step seen) and `fedpower-audit client-canaries` (client level)."]
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
    save_png(fig, path, dpi=120)
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
    save_png(fig, path, dpi=120)
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


