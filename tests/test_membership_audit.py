"""fedpower-audit: the audit plan (pool, population, canaries, coins), the train-rows hook, the
privacy curve, the report (on synthetic logits with known leakage) and, slow, a tiny end-to-end
audit through `flwr run`."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

from fedpower_app.audit import membership as MA
from fedpower_app.privacy.accounting.silo import SiloLedger, dp_sgd_epsilon
from fedpower_app.config import PROJECT_ROOT, parse_config
from fedpower_app.data import _load_task_cached, load_task

TINY = str(PROJECT_ROOT / "conf" / "tiny.toml")
SYN = {"task.synthetic-train-size": 300, "task.synthetic-eval-size": 50}


def tiny_plan(train_size: int = 300, **kw):
    args = {"runs": 4, "pool": 60, "population": 30, "canaries": 40, "background": 20, "seed": 3, "supernodes": 3}
    args.update(kw)
    return MA.make_plan({**SYN, "task.synthetic-train-size": train_size}, **args)


def test_plan_sets_are_disjoint_canaries_flipped_and_coins_fixed():
    plan = tiny_plan()
    sets = [plan.pool, plan.population, plan.canaries, plan.background]
    assert [len(s) for s in sets] == [60, 30, 40, 20]
    flat = [r for s in sets for r in s]
    assert len(set(flat)) == len(flat)  # disjoint
    task = load_task(parse_config(SYN))
    assert all(task.train.labels[r] != y for r, y in zip(plan.canaries, plan.canary_labels))
    assert all(task.train.labels[r] == y for r, y in zip(plan.pool, plan.pool_labels))
    k0, c0 = plan.coins(0)
    k0b, _ = plan.coins(0)
    k1, _ = plan.coins(1)
    assert np.array_equal(k0, k0b) and not np.array_equal(k0, k1)
    # i.i.d. fair coins, not balanced: over many runs each example is IN about half the time
    keep = np.stack([plan.coins(r)[0] for r in range(400)])
    assert abs(keep.mean() - 0.5) < 0.01 and len({int(k.sum()) for k in keep}) > 5
    rows = plan.train_rows(0)
    assert len(rows["rows"]) == 20 + int(k0.sum()) + int(c0.sum())
    member_rows = set(rows["rows"])
    assert all((r in member_rows) == bool(k) for r, k in zip(plan.pool, k0))
    assert not member_rows & set(plan.population)
    # the same request gives the same plan; another seed another one
    assert tiny_plan().comparable(plan) == []
    assert "pool" in tiny_plan(seed=4).comparable(plan)


def test_audit_json_identifies_the_background_without_listing_it(tmp_path):
    plan = tiny_plan(background=200, train_size=600)
    saved = plan.to_json()
    assert "background" not in saved and saved["background_count"] == 200 and len(saved["background_sha256"]) == 64
    (tmp_path / "audit.json").write_text(json.dumps(saved))
    loaded = MA.load_plan(tmp_path)
    # a resumed audit draws the background again from the audit seed: the same rows, the same digest
    assert loaded.comparable(tiny_plan(background=200, train_size=600)) == []
    assert loaded.background_summary() == plan.background_summary()
    with pytest.raises(MA.AuditError, match="does not hold its background rows"):
        loaded.train_rows(0)  # never train without the background it names
    # an older audit.json that lists the rows still loads and compares equal
    (tmp_path / "audit.json").write_text(json.dumps(asdict(plan)))
    assert MA.load_plan(tmp_path).comparable(plan) == []
    # other background rows (or labels) are another audit
    other = tiny_plan(background=200, train_size=600)
    other.background_labels = [1 - y for y in other.background_labels]
    assert loaded.comparable(other) == ["background_sha256"]
    assert "background_count" in loaded.comparable(tiny_plan(background=199, train_size=600))


def test_plan_refuses_what_it_cannot_do():
    with pytest.raises(MA.AuditError, match="--runs must be >= 2"):
        tiny_plan(runs=1)
    with pytest.raises(MA.AuditError, match="needs 1300 distinct train examples"):
        tiny_plan(pool=1200, population=50, canaries=50, background=0)
    with pytest.raises(MA.AuditError, match="task.train-rows is set by the audit"):
        MA.make_plan({**SYN, "task.train-rows": "/x.json"}, runs=2, pool=10, population=10, canaries=0,
                     background=0, seed=0, supernodes=2)


def test_train_rows_replaces_the_train_split_only(tmp_path):
    base = load_task(parse_config(SYN))
    spec = {"rows": [5, 1, 7], "labels": [1 - base.train.labels[5], base.train.labels[1], base.train.labels[7]]}
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(spec))
    task = load_task(parse_config({**SYN, "task.train-rows": str(path)}))
    assert task.train.text_a == [base.train.text_a[i] for i in (5, 1, 7)]
    assert task.train.labels == spec["labels"]
    assert task.eval_splits["validation"].labels == base.eval_splits["validation"].labels
    for content, message in (("[1, 2]", "not a JSON object"), ('{"rows": [1], "labels": [0, 1]}', "1 rows but 2 labels"),
                             ('{"rows": [9999], "labels": [0]}', "outside the train split"),
                             ('{"rows": [1], "labels": [7]}', "labels .* must lie in"),
                             ('{"rows": [], "labels": []}', "no rows")):
        bad = tmp_path / "bad.json"
        bad.write_text(content)
        _load_task_cached.cache_clear()
        with pytest.raises(ValueError, match=message):
            load_task(parse_config({**SYN, "task.train-rows": str(bad)}))
    with pytest.raises(ValueError, match="cannot read"):
        load_task(parse_config({**SYN, "task.train-rows": str(tmp_path / "missing.json")}))


def test_privacy_curve_comes_from_the_silo_ledgers():
    led = SiloLedger(1e-5)
    for _ in range(4):
        led.record(0.02, 0.9, 2)
    results = {"config": {"dp.level": "sample", "dp.delta": 1e-5},
               "privacy_final": {"noise_at": "silo", "delta": 1e-5, "epsilon_spent": led.epsilon(),
                                 "ledgers": {"0": led.state_dict(), "1": SiloLedger(1e-5).state_dict()}}}
    curve = MA.privacy_curve(results)
    deltas, eps = zip(*curve["points"])
    assert curve["private"] and all(np.diff(eps) <= 1e-12)  # eps falls as delta grows
    i = int(np.argmin(np.abs(np.log(np.asarray(deltas)) - np.log(1e-5))))
    assert eps[i] == pytest.approx(dp_sgd_epsilon([(0.02, 0.9, 8)], deltas[i]))
    assert MA.privacy_curve({"config": {"dp.level": "none"}, "privacy_final": {}}) == {"private": False, "points": []}


def write_fake_audit(out: Path, plan, *, leak: float, claimed_eps: float | None, seed: int = 0):
    """Finished runs whose logits leak membership by ``leak`` (phi shifted for members/canaries IN)."""
    rng = np.random.default_rng(seed)
    out.mkdir(parents=True, exist_ok=True)
    (out / "audit.json").write_text(json.dumps(asdict(plan)))
    c = rng.normal(0, 1, size=len(plan.pool))
    for r in range(plan.runs):
        keep, inc = plan.coins(r)
        d = MA.run_dir(out, r)
        d.mkdir(parents=True)
        phi = c + leak * keep + rng.normal(size=len(plan.pool))
        y = np.asarray(plan.pool_labels)
        lp = np.zeros((len(plan.pool), 2))
        lp[np.arange(len(y)), y] = phi
        pop = np.zeros((len(plan.population), 2))
        pop[np.arange(len(plan.population)), plan.population_labels] = rng.normal(size=len(plan.population))
        can = np.zeros((len(plan.canaries), 2))
        can[np.arange(len(plan.canaries)), plan.canary_labels] = -2 + 4 * leak * inc + rng.normal(size=len(plan.canaries))
        privacy = {"private": False, "points": []} if claimed_eps is None else {
            "private": True, "points": [(1e-5, claimed_eps), (1e-2, claimed_eps / 2)], "delta": 1e-5,
            "epsilon": claimed_eps, "source": "test"}
        np.savez(d / "audit.npz", logits_pool=lp, logits_population=pop, logits_canaries=can, keep=keep,
                 canary_in=inc, privacy=np.array(json.dumps(privacy)))
        (d / "results.json").write_text(json.dumps({"status": "completed", "totals": {"final_accuracy": 0.8}}))


def test_report_finds_leakage_and_fails_a_false_claim(tmp_path, capsys):
    plan = tiny_plan(2000, runs=8, pool=400, population=200, canaries=200, background=0)
    out = tmp_path / "leaky"
    write_fake_audit(out, plan, leak=2.0, claimed_eps=0.5)
    rc = MA.main(["--out", str(out), "--report-only", "--bootstrap", "30"])
    captured = capsys.readouterr()
    assert rc == 1 and "AUDIT FAILED" in captured.err
    report = json.loads((out / "report.json").read_text())
    from fedpower_app.audit.attacks import ATTACKS

    assert set(report["attacks"]) == set(ATTACKS)
    assert report["attacks"]["lira-online"]["auc"] > 0.8
    assert report["canary_audit"]["violated"] and report["canary_audit"]["epsilon_lower_bound"] > 0.5
    assert report["canary_audit"]["canaries"] == 8 * 200  # pooled over runs
    assert report["ceiling_violations"]  # TPR far above e^0.5 * FPR + delta
    assert "FAILED" in (out / "report.md").read_text()
    for png in ("roc.png", "attack_accuracy.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


def test_report_passes_an_honest_release(tmp_path, capsys):
    plan = tiny_plan(2000, runs=6, pool=300, population=150, canaries=150, background=0)
    out = tmp_path / "quiet"
    write_fake_audit(out, plan, leak=0.0, claimed_eps=1.0)
    assert MA.main(["--out", str(out), "--report-only", "--bootstrap", "30"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert not report["canary_audit"]["violated"] and not report["ceiling_violations"]
    assert all(abs(m["auc"] - 0.5) < 0.06 for m in report["attacks"].values())
    assert report["canary_audit"]["epsilon_lower_bound"] <= report["canary_audit"]["ceiling"]
    text = capsys.readouterr().out
    assert "ε̂ =" in text and "Resolution:" in text
    # compare: one row per audit directory
    write_fake_audit(tmp_path / "np", plan, leak=1.0, claimed_eps=None)
    assert MA.main(["--out", str(tmp_path / "np"), "--report-only", "--bootstrap", "10"]) == 0
    capsys.readouterr()
    assert MA.main(["compare", str(out), str(tmp_path / "np"), "--out", str(tmp_path / "cmp.md")]) == 0
    table = (tmp_path / "cmp.md").read_text()
    assert "non-private" in table and "ε=1.00" in table
    assert (tmp_path / "cmp.png").exists()


def test_resume_refuses_another_audit(tmp_path, capsys):
    out = tmp_path / "a"
    plan = tiny_plan()
    out.mkdir()
    (out / "audit.json").write_text(json.dumps(asdict(plan)))
    rc = MA.main(["--out", str(out), "--set", "task.synthetic-train-size=300", "--set", "task.synthetic-eval-size=50",
                  "--runs", "4", "--pool", "61", "--population", "30", "--canaries", "40", "--background", "20",
                  "--audit-seed", "3", "--supernodes", "3"])
    assert rc == 2 and "holds another audit" in capsys.readouterr().err
    rc = MA.main(["--out", str(tmp_path / "b"), "--set", "seed=4"])
    assert rc == 2 and "set per run by the audit" in capsys.readouterr().err
    assert MA.main(["--out", str(tmp_path / "nothing"), "--report-only"]) == 2
    rc = MA.main(["--out", str(tmp_path / "c"), "--set", 'task.name="sst2"', "--data-dir", str(tmp_path / "no-glue")])
    assert rc == 2 and "task data: GLUE data directory does not exist" in capsys.readouterr().err


@pytest.mark.slow
def test_tiny_audit_end_to_end(tmp_path, capsys):
    """Four tiny DP-SGD runs through `flwr run`, then the report; a second call resumes (no training)."""
    out = tmp_path / "audit"
    argv = ["--out", str(out), "--preset", TINY, "--supernodes", "3", "--runs", "4", "--pool", "60",
            "--population", "30", "--canaries", "30", "--background", "60", "--port", "39571",
            "--bootstrap", "20", "--set", "dp.epsilon=8"]
    rc = MA.main(argv)
    captured = capsys.readouterr()
    assert rc == 0, captured
    assert "[run 4/4] run003: done" in captured.out
    report = json.loads((out / "report.json").read_text())
    assert report["runs_finished"] == 4 and report["claimed_epsilon"] == pytest.approx(8.0, abs=1e-3)
    assert report["canary_audit"]["canaries"] == 4 * 30 and not report["canary_audit"]["violated"]
    with np.load(MA.run_dir(out, 0) / "audit.npz") as z:
        assert z["logits_pool"].shape == (60, 2) and z["logits_canaries"].shape == (30, 2)
    assert not (MA.run_dir(out, 0) / "adapter").exists()
    # resume: nothing to train
    assert MA.main(argv) == 0
    assert "4 already finished, 0 to run now" in capsys.readouterr().out


def test_compare_keeps_two_audits_of_the_same_setting(tmp_path):
    """Two audits of one setting (e.g. the learning and the memorising SST-2 audits) are two rows;
    keyed by setting alone, the second silently replaced the first."""
    attack = {"auc": 0.5, "tpr_at_1pct": 0.01, "tpr_at_1pct_ci": [0.005, 0.02], "balanced_accuracy": 0.5}
    dirs = []
    for name, acc in (("learning", 0.71), ("memorising", 0.73)):
        d = tmp_path / name
        d.mkdir()
        (d / "report.json").write_text(json.dumps({
            "config": {"strategy.name": "fedpower"}, "claimed_epsilon": None, "runs_finished": 3,
            "accuracy_mean": acc, "attacks": {"loss": attack}, "dp_ceiling": None,
            "canary_audit": {"epsilon_lower_bound": 0.0, "ceiling": 4.5}}))
        dirs.append(d)
    text = MA.compare(dirs, tmp_path / "cmp.md")
    rows = [line for line in text.splitlines() if line.startswith("| fedpower")]
    assert len(rows) == 2
    assert "71.00" in rows[0] and "73.00" in rows[1] and "(memorising)" in rows[1]
