"""The server's privacy hook on the real accountant: calibrated noise per block, budget, paper mode."""

import math

import pytest
from flwr.app import ArrayRecord

from fedpower_app.privacy import accounting as A
from fedpower_app.config import parse_config
from fedpower_app.privacy import AccountedPrivacy, NonPrivate, build_privacy, guarantee
from strategies.flower import FedPowerStrategy
from strategies.noise import NoiseSource
from fedpower_app.runs.inprocess_grid import InProcessGrid
from tests.test_strategies import fake_client, initial_state, r

SIZES = [500] * 6


def hook(**overrides):
    # the paper's server-side mechanisms (DP-SGD on the silos is tested in tests/test_dp_sgd.py)
    cfg = parse_config({"num-server-rounds": 20, "dp.noise-at": "server", "dp.clip": 2.0, **overrides})
    return build_privacy(cfg, client_sizes=SIZES, num_modules=24)


@pytest.mark.parametrize("method", ["fedpower", "fedlora", "ffa-lora", "input-perturbation", "output-perturbation"])
@pytest.mark.parametrize("level", ["sample", "client"])
def test_noise_per_block_gives_calibrated_z(method, level):
    p = hook(**{"strategy.name": method, "dp.level": level})
    z = p.calibration.z
    rt = A.round_schedule(method, 20)[0]
    for k in (0, 1, 3, 6):
        stds = p.noise_stds(rt, k)  # the same for any number of replies
        # sample level: the average (and its sensitivity) is over the fixed m = q_c N, not over k
        sens = A.block_sensitivities(rt, level, 2.0, k=p.fixed_denominator if level == "sample" else k,
                                     rank=8, num_modules=24)
        assert A.effective_z(sens, stds) == pytest.approx(z, rel=1e-9)
    assert p.calibration.epsilon == pytest.approx(8.0, rel=1e-3)


def test_powerdp_noise_is_diameter_scaled_and_k_independent():
    p = hook()
    z = p.calibration.z
    assert p.noise_stds("powerdp", 1) == p.noise_stds("powerdp", 5)
    assert p.noise_stds("powerdp", 1)[0] == pytest.approx(math.sqrt(2) * z * 2 * 2.0)  # sqrt(2) z 2C per block


def test_extending_a_run_past_the_plan_stops_before_crossing():
    p = hook(**{"num-server-rounds": 3, "strategy.name": "fedpower"})
    s = FedPowerStrategy(initial_state=initial_state(), rank=r, client_rate=0.5, noise=NoiseSource(0), privacy=p)
    grid = InProcessGrid(fake_client(), 6)
    s.start(grid=grid, initial_arrays=ArrayRecord(s.global_state), num_rounds=6)  # plan was T = 3
    assert len(s.reports) == 3
    assert s.stopped_reason and "round 4" in s.stopped_reason and "budget" in s.stopped_reason
    assert p.epsilon() <= 8.0 * (1 + 1e-6)
    assert p.ledger.rounds_recorded == 3


def test_rounds_with_dropped_clients_are_still_recorded():
    p = hook(**{"num-server-rounds": 2})

    def broken(msg, ctx):
        raise RuntimeError("offline")

    s = FedPowerStrategy(initial_state=initial_state(), rank=r, client_rate=1.0, noise=NoiseSource(0), privacy=p)
    grid = InProcessGrid(fake_client(), 2, handlers={100: broken, 101: broken})
    s.start(grid=grid, initial_arrays=ArrayRecord(s.global_state), num_rounds=2)
    assert [rep.aggregated for rep in s.reports] == [0, 0]
    assert p.ledger.rounds_recorded == 2 and p.epsilon() > 0


def test_paper_mode_is_labelled_and_reports_true_epsilon():
    p = hook(**{"dp.calibration": "paper", "num-server-rounds": 200, "train.batch-size": 128})
    assert isinstance(p, AccountedPrivacy) and p.source == "paper"
    assert p.calibration.is_valid_guarantee is False
    assert "NOT a valid" in p.calibration.label
    assert p.calibration.epsilon > 8.0  # the true epsilon of the paper's noise exceeds the claim
    assert any("PAPER" in line for line in p.summary_lines())


def test_fixed_noise_multiplier_reports_epsilon():
    p = hook(**{"dp.noise-multiplier": 1.5})
    ref = A.epsilon_for_noise_multiplier(p.plan, 1.5)
    assert p.calibration.z == 1.5 and p.calibration.epsilon == pytest.approx(ref.epsilon)


def test_non_private():
    p = hook(**{"dp.level": "none"})
    assert isinstance(p, NonPrivate) and not p.enabled and p.epsilon() is None


def test_a_seeded_private_run_is_told_that_its_seed_reveals_the_noise():
    # The seed is in the run config every silo receives: with seeded noise they can subtract it.
    claim = guarantee(parse_config({"seed": 7, "dp.level": "client", "dp.noise": "seeded"}))
    assert claim["mode"] == "reproducible" and claim["valid"] is False
    assert "seed=7" in claim["statement"] and "not a guarantee against whoever holds the seed" in claim["statement"]
    assert guarantee(parse_config({"dp.level": "client", "dp.noise": "hardened"}))["valid"] is True
    assert guarantee(parse_config({"dp.level": "none"}))["valid"] is False
