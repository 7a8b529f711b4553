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

Audits that can fail (docs/privacy.md §10.1-10.2), each with its positive controls (no noise, a
tenth of the noise, no clipping; exit 1 if the correct step is refuted or a broken one is not):

  fedpower-audit white-box --set model.name=... --set dp.epsilon=2 [--canaries 4000] [--control all]
  fedpower-audit client-canaries --method fedlora --epsilon 2 [--canaries 4000] [--control all]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..config import PROJECT_ROOT, ConfigError, load_preset, parse_config

from .plan import (  # noqa: E402,F401 (re-exported)
    CANARY_SCORE, CONFIDENCE, DELTA_GRID, FORMAT, GUESS_FRACTION, PER_RUN_KEYS, AuditError, AuditPlan, _write_json,
    load_plan, make_plan, run_dir, run_finished)


# ------------------------------------------------------------------------------------------------
# Runs
# ------------------------------------------------------------------------------------------------

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
            evaluate(model, split, batch_size=batch_size, logits_out=chunks)  # on the model's device
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


from .report import (  # noqa: E402,F401 (the report, re-exported: fedpower-audit --report-only)
    AuditData, build_report, canary_scores, compare, load_audit, merged_curve, plot_bars, plot_roc,
    report_markdown, resolution_note)


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
    if argv[:1] == ["white-box"]:  # DP-SGD on a silo, Dirac gradient canaries and positive controls
        from .white_box import main as white_box_main

        return white_box_main(argv[1:])
    if argv[:1] == ["client-canaries"]:  # client-level DP, canary clients and positive controls
        from .client_canaries import main as client_canaries_main

        return client_canaries_main(argv[1:])
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
