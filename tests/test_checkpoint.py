"""Checkpoint and resume: atomic checkpoints, refusal of damaged or mismatched ones, and runs killed
with SIGKILL at fault points that resume to the same final adapters, rounds and epsilon."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fedpower_app.runs import checkpoint as CK
from fedpower_app.config import PROJECT_ROOT, parse_config

TINY = {"task.synthetic-train-size": 240, "task.synthetic-eval-size": 80, "task.max-length": 32,
        "train.local-steps": 2, "train.batch-size": 16, "strategy.client-rate": 1.0,
        "train.lr": 0.003, "train.lr-schedule": "constant", "num-server-rounds": 3, "run-name": "run",
        "dp.noise": "seeded"}  # the reproducible mode: a resumed run must repeat the uninterrupted one


def payload(round_=2, **kw):
    cfg = parse_config({**TINY, **kw.pop("cfg", {})}).to_dict()
    return cfg, {"round": round_, "strategy": cfg["strategy.name"], "fingerprint": CK.config_fingerprint(cfg),
                 "config_json": json.dumps(cfg), "global_state": {"w": torch.arange(6.0).reshape(2, 3)},
                 "privacy": {"kind": "none"}, "results": {"rounds": [{"accuracy": 0.5}]}, **kw}


def test_checkpoint_round_trip_is_exact(tmp_path):
    cfg, p = payload()
    CK.save_checkpoint(tmp_path, p)
    got = CK.load_checkpoint(tmp_path, config=cfg, strategy=cfg["strategy.name"])
    assert got["round"] == 2 and torch.equal(got["global_state"]["w"], p["global_state"]["w"])
    assert got["results"] == p["results"]
    assert not list(tmp_path.glob("*.tmp*"))  # the temporary file was renamed
    assert CK.load_checkpoint(tmp_path / "none", config=cfg, strategy="fedpower") is None
    # a key that does not change the math may differ
    assert CK.load_checkpoint(tmp_path, config={**cfg, "strategy.round-timeout": 5.0, "resume": True},
                              strategy=cfg["strategy.name"])


@pytest.mark.parametrize("damage, message", [
    (lambda b: b[: len(b) // 2], "truncated or damaged"),
    (lambda b: b[:-10] + bytes(10), "truncated or damaged"),
    (lambda b: b"garbage" + b, "not a fedpower checkpoint"),
    (lambda b: b"", "not a fedpower checkpoint"),
])
def test_damaged_checkpoint_is_refused(tmp_path, damage, message):
    cfg, p = payload()
    path = CK.save_checkpoint(tmp_path, p)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(CK.CheckpointError, match=message):
        CK.load_checkpoint(tmp_path, config=cfg, strategy=cfg["strategy.name"])


def test_mismatched_checkpoint_is_refused_with_the_reason(tmp_path):
    cfg, p = payload()
    CK.save_checkpoint(tmp_path, p)
    with pytest.raises(CK.CheckpointError, match="written by strategy 'fedpower'; this run is 'fedlora'"):
        CK.load_checkpoint(tmp_path, config=cfg, strategy="fedlora")
    other = {**cfg, "dp.epsilon": 3.0, "lora.rank": 4}
    with pytest.raises(CK.CheckpointError, match=r"differs in: dp.epsilon, lora.rank"):
        CK.load_checkpoint(tmp_path, config=other, strategy=cfg["strategy.name"])


def test_a_checkpoint_of_another_release_mechanism_is_refused():
    """A checkpoint whose rounds released other round types than this code would (an older
    version's client-level paper's PowerDP released whole adapters as "powerdp") is not resumed."""
    from server_app.app import check_released_rounds
    from strategies import mechanisms as MECH

    def now(t):
        return MECH.round_type("fedpower", t, level="client", refactorization="powerdp")

    check_released_rounds([{"server_round": 1, "round_type": "powerdp-delta"}, {"server_round": 2}], now)
    with pytest.raises(CK.CheckpointError, match="round 1: powerdp -> powerdp-delta"):
        check_released_rounds([{"server_round": 1, "round_type": "powerdp"}], now)


def test_a_run_directory_with_a_checkpoint_is_not_silently_restarted(tmp_path):
    from server_app.app import open_checkpoint, run_directory

    cfg = parse_config({**TINY, "output-dir": str(tmp_path)})
    run_dir = run_directory(cfg)
    _, p = payload()
    CK.save_checkpoint(run_dir, p)
    with pytest.raises(CK.CheckpointError, match="holds a checkpoint of an earlier run"):
        open_checkpoint(cfg, run_dir)


def test_inflight_journal(tmp_path):
    assert CK.read_inflight(tmp_path) is None
    CK.write_inflight(tmp_path, 3, [0, 2])
    assert CK.read_inflight(tmp_path) == {"round": 3, "silos": [0, 2]}
    (tmp_path / CK.INFLIGHT_FILE).write_text("{")
    assert CK.read_inflight(tmp_path) is None


def test_silo_ledgers_checkpoint_by_population_index():
    from fedpower_app.privacy import SiloDPSGD

    cfg = parse_config({**TINY, "dp.noise-at": "silo"})
    a = SiloDPSGD(cfg, {11: 120, 12: 120})
    a.record_sent([11, 12], 1)
    a.record_sent([11], 2)
    state = json.loads(json.dumps(a.state_dict()))
    b = SiloDPSGD(cfg, {901: 120, 77: 120})  # a restarted run: new node ids, same silos in order
    b.load_state_dict(state)
    assert [led.rounds for led in b.ledgers.values()] == [2, 1] and b.epsilon() == pytest.approx(a.epsilon())
    c = SiloDPSGD(cfg, {1: 100, 2: 140})
    with pytest.raises(ValueError, match="another population"):
        c.load_state_dict(state)
    b.charge_lost_release([1])
    assert [led.rounds for led in b.ledgers.values()] == [2, 2]


# ------------------------------------------------------------------------------------------------
# Kill with SIGKILL, resume, compare with an uninterrupted run (in-process ServerApp + ClientApp)
# ------------------------------------------------------------------------------------------------

WORKER = str(Path(__file__).with_name("_resume_worker.py"))


def run_worker(cfg: dict, fault: str | None = None, node_config: dict | None = None) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(PROJECT_ROOT)}
    env.pop("FEDPOWER_FAULT", None)
    if fault:
        env["FEDPOWER_FAULT"] = fault
    args = [json.dumps(cfg), "2", json.dumps(node_config)] if node_config else [json.dumps(cfg)]
    proc = subprocess.run([sys.executable, WORKER, *args], env=env, cwd=PROJECT_ROOT,
                          capture_output=True, text=True, timeout=900)
    if proc.returncode not in (0, -signal.SIGKILL):
        raise AssertionError(proc.stderr[-3000:])
    return proc.returncode


def final(run_dir: Path) -> tuple[bytes, dict]:
    return (run_dir / "adapter" / "adapter_model.safetensors").read_bytes(), json.loads((run_dir / "results.json").read_text())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("base")
    cfg = {**TINY, "output-dir": str(out), "dp.noise-at": "silo"}
    assert run_worker(cfg) == 0
    return final(out / "run")


def _kill_and_resume(tmp_path, fault: str, **extra):
    cfg = {**TINY, "output-dir": str(tmp_path), "dp.noise-at": "silo", **extra}
    assert run_worker(cfg, fault) == -signal.SIGKILL  # killed where the fault says
    killed = json.loads((tmp_path / "run" / "results.json").read_text())
    assert killed["status"] == "running"  # a SIGKILL leaves no chance to write anything else
    assert run_worker({**cfg, "resume": True}) == 0
    return final(tmp_path / "run")


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["after-journal:2", "checkpoint-tmp-written:2", "after-checkpoint:2",
                                   "after-journal:1", "after-checkpoint:3"])
def test_killed_run_resumes_to_the_uninterrupted_result(tmp_path, uninterrupted, fault):
    adapters, results = _kill_and_resume(tmp_path, fault)
    base_adapters, base = uninterrupted
    assert adapters == base_adapters  # bit-identical final adapters (seeded mode)
    assert [r["server_round"] for r in results["rounds"]] == [1, 2, 3]  # no round lost or repeated
    assert [r["accuracy"] for r in results["rounds"]] == [r["accuracy"] for r in base["rounds"]]
    assert results["totals"]["final_epsilon"] == pytest.approx(base["totals"]["final_epsilon"], rel=1e-12)
    ledgers = [s["entries"] for s in results["privacy_final"]["ledgers"].values()]
    assert ledgers == [s["entries"] for s in base["privacy_final"]["ledgers"].values()]  # no eps twice or dropped
    note = results["resumed"][-1]
    point, rnd = fault.split(":")
    done = int(rnd) - 1 if point != "after-checkpoint" else int(rnd)
    assert note["after_round"] == done
    assert note["inflight_round"] == (None if point == "after-checkpoint" else int(rnd))
    assert results["status"] == "completed"


@pytest.mark.slow
def test_hardened_inflight_round_is_charged_as_a_lost_release(tmp_path):
    cfg = {**TINY, "output-dir": str(tmp_path), "dp.noise-at": "silo", "dp.noise": "hardened", "dp.epsilon": 50.0}
    assert run_worker(cfg, "after-journal:2") == -signal.SIGKILL
    assert run_worker({**cfg, "resume": True}) == 0
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    assert res["resumed"][-1]["inflight_round"] == 2 and "lost release" in res["resumed"][-1]["inflight_counted_as"]
    # sigma is calibrated so that 3 charges use the whole budget: the lost release of round 2 is the
    # third charge, so round 3 is never sent (the budget holds; nothing is counted twice or dropped)
    assert [s["entries"][0][3] for s in res["privacy_final"]["ledgers"].values()] == [3, 3]
    assert [r["server_round"] for r in res["rounds"]] == [1, 2] and res["status"] == "stopped-budget"
    assert res["privacy_final"]["epsilon_spent"] <= 50.0 * (1 + 1e-9)


@pytest.mark.slow
def test_a_run_killed_in_its_last_round_reports_the_ledgers_epsilon(tmp_path):
    """Killed after the last round was sent (hardened noise: the silos trained, so the round is a
    lost release): the resumed run charges it and its final_epsilon is the ledger's, not the last
    row's."""
    cfg = {**TINY, "output-dir": str(tmp_path), "dp.noise-at": "silo", "dp.noise": "hardened", "dp.epsilon": 50.0,
           "num-server-rounds": 2}
    assert run_worker(cfg, "after-journal:2") == -signal.SIGKILL
    assert run_worker({**cfg, "resume": True}) == 0
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    assert res["resumed"][-1]["inflight_round"] == 2
    assert res["totals"]["final_epsilon"] == res["privacy_final"]["epsilon_spent"]
    assert res["totals"]["final_epsilon"] > res["rounds"][-1]["epsilon"]  # the lost release is counted


def test_fedpower_run_resume_reads_the_run_and_refuses_a_bad_checkpoint(tmp_path, capsys):
    from fedpower_app import launcher as L

    run_dir = tmp_path / "outputs" / "myrun"
    cfg = parse_config({**TINY, "output-dir": str(run_dir.parent), "run-name": "myrun"}).to_dict()
    run_dir.mkdir(parents=True)
    (run_dir / "results.json").write_text(json.dumps({"config": cfg}))
    got = L.resume_overrides(run_dir)
    assert got["resume"] is True and got["run-name"] == "myrun" and got["output-dir"] == str(run_dir.parent)
    assert got["lora.rank"] == cfg["lora.rank"]
    _, p = payload(cfg={"output-dir": str(run_dir.parent), "run-name": "myrun"})
    path = CK.save_checkpoint(run_dir, p)
    path.write_bytes(path.read_bytes()[:100])  # truncated: refused before anything starts
    rc = L.main(["--resume", str(run_dir), "--flwr-home", str(tmp_path / "home")])
    err = capsys.readouterr().err
    assert rc == 2 and "truncated or damaged" in err and not (tmp_path / "home").exists()
    rc = L.main(["--resume", str(tmp_path / "nope"), "--flwr-home", str(tmp_path / "home")])
    assert rc == 2 and "no readable results.json" in capsys.readouterr().err


@pytest.mark.slow
def test_silo_ledger_file_survives_a_server_restart_and_a_seeded_rerun_is_not_paid_twice(tmp_path):
    """Each silo keeps its ledger in node-config ``ledger-file`` with its budget ``dp-max-epsilon``
    equal to the run's: the server dies while writing round 2's checkpoint (the silos had trained
    and paid round 2); the resumed run re-runs round 2 with the same seeded draws (the same
    release: not paid again) and round 3, which the silos admit within their own budget."""
    cfg = {**TINY, "output-dir": str(tmp_path), "dp.noise-at": "silo", "dp.diagnostics": "released"}
    nodes = {str(i): {"ledger-file": str(tmp_path / f"silo{i}" / "ledger.json"), "dp-max-epsilon": 8.0,
                      "dp-noise": "seeded", "send-shard-size": "true"}  # reproducible mode and n: their choice
             for i in range(2)}
    assert run_worker(cfg, "checkpoint-tmp-written:2", nodes) == -signal.SIGKILL
    paid = json.loads((tmp_path / "silo0" / "ledger.json").read_text())
    assert paid["ledger"]["entries"][0][3] == 2 and len(paid["paid"]) == 2
    assert run_worker({**cfg, "resume": True}, None, nodes) == 0
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    assert res["status"] == "completed" and [r["aggregated"] for r in res["rounds"]] == [2, 2, 2]
    for i in range(2):
        saved = json.loads((tmp_path / f"silo{i}" / "ledger.json").read_text())
        assert saved["ledger"]["entries"][0][3] == 3 and len(saved["paid"]) == 3  # rounds 1, 2, 3 once each


def test_no_release_leaves_before_it_is_charged_durably(tmp_path):
    """Server-side noise drawn from secrets, and silos that evaluate every new global model: the
    run is killed after round 2's evaluate messages left (before the central evaluation). The
    checkpoint on disk must already hold round 2's release and its charge; results.json may not be
    ahead of it. The resumed run writes round 2's row from the checkpoint and charges nothing twice."""
    cfg = {**TINY, "output-dir": str(tmp_path), "dp.noise-at": "server", "dp.noise": "hardened",
           "eval.fraction-clients": 1.0, "dp.epsilon": 50.0}
    assert run_worker(cfg, "before-central-eval:2") == -signal.SIGKILL
    resolved = parse_config(cfg).to_dict()
    ck = CK.load_checkpoint(tmp_path / "run", config=resolved, strategy=resolved["strategy.name"])
    assert ck["round"] == 2 and len(ck["privacy"]["ledger"]["history"]) == 2  # released => charged, on disk
    assert ck["pending_row"]["server_round"] == 2
    written = json.loads((tmp_path / "run" / "results.json").read_text())
    assert [r["server_round"] for r in written["rounds"]] == [1]
    assert run_worker({**cfg, "resume": True}) == 0
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    assert res["status"] == "completed" and [r["server_round"] for r in res["rounds"]] == [1, 2, 3]
    assert res["rounds"][1]["accuracy"] is not None
    assert len(res["privacy_final"]["ledger"]["history"]) == 3  # each release charged once


def test_fedpower_run_resume_restores_the_runs_number_of_silos(tmp_path):
    """A run made with --supernodes 3 resumes with 3 SuperNodes, not the default 6 (which the
    server would refuse as another population); a contradicting --supernodes fails before anything."""
    from fedpower_app import launcher as L
    from fedpower_app.config import ConfigError

    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "results.json").write_text(json.dumps({"config": {}, "clients": {"count": 3}}))
    assert L.resumed_supernodes(run_dir, None) == 3 and L.resumed_supernodes(run_dir, 3) == 3
    with pytest.raises(ConfigError, match="the run had 3 silos"):
        L.resumed_supernodes(run_dir, 6)
    (run_dir / "results.json").write_text(json.dumps({"config": {}, "clients": None}))  # killed before the size query
    assert L.resumed_supernodes(run_dir, None) == 6
