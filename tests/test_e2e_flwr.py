"""End-to-end: the real app through `flwr run` (managed local SuperLink, Ray), one run per strategy.

Slow (about a minute per run on 2 CPUs): marked ``slow``; CI runs it with ``pytest -m slow``.
Completion is asserted through ``flwr ls --format json`` (``flwr run`` exits 0 on failure).
"""

import json
import math
import subprocess

import pytest

from fedpower_app.config import PROJECT_ROOT
from fedpower_app.launcher import flwr_env, run_flwr, stop_local_superlink

pytestmark = pytest.mark.slow
PORT = 39391  # private managed SuperLink for the tests


@pytest.fixture(scope="module")
def flwr_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("flwr-home")
    yield home
    stop_local_superlink(home)


@pytest.mark.parametrize("strategy", ["fedpower", "fedlora", "ffa-lora"])
def test_flwr_run_completes_and_writes_results(strategy, flwr_home, tmp_path):
    out = tmp_path / "outputs"
    outcome = run_flwr(PROJECT_ROOT, {"strategy.name": strategy, "output-dir": str(out), "run-name": strategy},
                       preset=PROJECT_ROOT / "conf" / "tiny.toml", num_supernodes=3, flwr_home=flwr_home,
                       superlink_port=PORT, echo=False, timeout=900)
    assert outcome.run_id, outcome.output[-3000:]
    # Independent check of the status through the CLI, as a user would do it.
    ls = subprocess.run(["flwr", "ls", "--run-id", outcome.run_id, "--format", "json"],
                        env=flwr_env(flwr_home, PORT), capture_output=True, text=True, timeout=120)
    status = json.loads(ls.stdout)["runs"][0]["status"]
    assert status == "finished:completed", outcome.output[-3000:]

    results = json.loads((out / strategy / "results.json").read_text())
    assert results["status"] == "completed"
    assert results["config"]["strategy.name"] == strategy
    assert len(results["rounds"]) == 2
    for row in results["rounds"]:
        assert 0.0 <= row["accuracy"] <= 1.0
        assert row["epsilon"] is not None and row["epsilon"] > 0
        assert 1 <= row["sampled"] <= 3  # silos sent the round: client-sampling coins only
        assert "aggregated" not in row and "train_loss" not in row  # a private run withholds its diagnostics
    assert results["clients"]["count"] == 3
    # The default: sample-level DP by DP-SGD on the silos, accounted per silo.
    assert results["privacy"]["noise_at"] == "silo" and results["privacy"]["is_valid_guarantee"] is True
    final = results["privacy_final"]
    assert len(final["silos"]) == 3 and all(row["rounds_trained"] >= 1 for row in final["silos"])
    assert final["epsilon_spent"] == max(row["epsilon"] for row in final["silos"])
    assert all(row["noise_stds"] == [0.0, 0.0] for row in results["rounds"])  # no server noise
    eps = [row["epsilon"] for row in results["rounds"]]
    assert eps == sorted(eps) and eps[-1] <= results["config"]["dp.epsilon"] * (1 + 1e-6)

    # The released model loads in one call, head included (tests/test_released.py checks the logits).
    from fedpower_app.released import load_released

    adapter_dir = out / strategy / "adapter"
    loaded, _tokenizer = load_released(adapter_dir)
    names = [n for n, _ in loaded.named_parameters() if "lora_B" in n]
    assert names and any(p.abs().sum() > 0 for n, p in loaded.named_parameters() if "lora_B" in n)
    assert (out / strategy / "final-eval-logits.pt").exists()


def test_distributed_dp_with_secure_aggregation_on_the_ray_engine(flwr_home, tmp_path):
    """Secure aggregation in the Ray simulation, at client level with distributed DP (FedPower's
    PowerDP-L through secure sums): each silo keeps its secrets in its Context.state between the
    stages, every round is released, and the run's epsilon is the distributed ledger's."""
    out = tmp_path / "outputs"
    outcome = run_flwr(PROJECT_ROOT, {"output-dir": str(out), "run-name": "secagg", "secagg.enabled": True,
                                      "dp.level": "client", "dp.clip": 0.5, "strategy.client-rate": 1.0},
                       preset=PROJECT_ROOT / "conf" / "tiny.toml", num_supernodes=3, flwr_home=flwr_home,
                       superlink_port=PORT, echo=False, timeout=900)
    assert outcome.run_id, outcome.output[-3000:]
    results = json.loads((out / "secagg" / "results.json").read_text())
    assert results["status"] == "completed", outcome.output[-3000:]
    assert results["privacy"]["calibration"]["is_valid_guarantee"] and results["privacy"]["min_contributors"] == 2
    rows = results["rounds"]
    assert [r["released"] for r in rows] == [True, True] and all(r["message_rounds"] > 4 for r in rows)
    assert 0 < rows[-1]["epsilon"] <= results["config"]["dp.epsilon"] * (1 + 1e-6)


def test_flwr_run_rejects_bad_config(flwr_home, tmp_path):
    outcome = run_flwr(PROJECT_ROOT, {"lora.rank": 0, "output-dir": str(tmp_path)}, preset=PROJECT_ROOT / "conf" / "tiny.toml",
                       num_supernodes=2, flwr_home=flwr_home, superlink_port=PORT, echo=False, timeout=600)
    assert not outcome.ok
    assert "lora.rank" in outcome.output


def test_cross_device_simulation_with_many_clients(flwr_home, tmp_path):
    """Client-level DP on round deltas through `flwr run` with 60 simulated clients and a cohort of
    about 6 (q_c = 0.1): every round trains only the sampled clients and releases noise; the
    accountant composes Poisson-subsampled Gaussians at rate q_c."""
    out = tmp_path / "outputs"
    overrides = {"output-dir": str(out), "run-name": "xdev", "dp.level": "client", "strategy.client-rate": 0.1,
                 "task.synthetic-train-size": 60 * 20, "train.batch-size": 8, "num-server-rounds": 2, "dp.clip": 0.5,
                 "dp.diagnostics": "released"}  # the cohort sizes per round are diagnostics at client level
    outcome = run_flwr(PROJECT_ROOT, overrides, preset=PROJECT_ROOT / "conf" / "tiny.toml", num_supernodes=60,
                       flwr_home=flwr_home, superlink_port=PORT, echo=False, timeout=1200)
    assert outcome.ok, outcome.output[-3000:]
    results = json.loads((out / "xdev" / "results.json").read_text())
    assert results["status"] == "completed" and results["clients"]["count"] == 60
    cal = results["privacy"]["calibration"]
    assert cal["level"] == "client" and cal["client_rate"] == 0.1 and cal["is_valid_guarantee"]
    # PowerDP-L with 2 power iterations: 4 blocks, each at sqrt(2 * 2) z C / (q_c N), m = 6 whatever k
    want = math.sqrt(4) * cal["z"] * 0.5 / (0.1 * 60)
    for row in results["rounds"]:
        assert row["round_type"] == "powerdp-l" and row["sampled"] < 30  # a cohort, not the population
        assert row["aggregated"] == row["sampled"] and row["noise_stds"] == pytest.approx([want] * 4, rel=1e-9)
    assert results["rounds"][-1]["epsilon"] <= 8.0 * (1 + 1e-6)
