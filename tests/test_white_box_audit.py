"""A white-box audit of the product's DP-SGD step that can fail. Dirac gradient canaries
go through the product's clipping and noise; the correct step passes with eps_hat well above 0, and
each positive control (no noise, a tenth of the noise, no clipping) is refuted."""

import numpy as np
import pytest
import torch

from fedpower_app import data as D
from fedpower_app import model as M
from fedpower_app.audit import white_box as WB

from .test_dp_sgd import tiny_cfg, tiny_model_dir  # noqa: F401 (fixture)

EPS = 2.0


@pytest.fixture(scope="module")
def tiny_setup(tiny_model_dir):  # noqa: F811
    cfg = tiny_cfg(tiny_model_dir, **{"lora.rank": 8})
    return cfg, M.load_tokenizer(tiny_model_dir)


def _audit(tiny_setup, control):
    cfg, tok = tiny_setup
    torch.manual_seed(0)
    model = M.build_model(cfg, 2)
    shard = D.client_shard(cfg, tok, 0, 1)
    return WB.run_white_box_audit(model, shard, epsilon=EPS, delta=1e-5, clip=1.0, batch_size=32, local_steps=5,
                                  rounds=4, canaries=4000, control=control)


def test_the_correct_step_passes_with_power(tiny_setup):
    report = _audit(tiny_setup, "none")
    assert report.passed and report.steps == 20
    assert 0.2 * EPS < report.epsilon_lower_bound <= EPS  # not 0: the audit sees the canaries
    assert report.ceiling > 2 * EPS  # enough canaries to refute a claim of EPS
    assert not report.claim_refuted and 0 < report.mu_lower_bound <= report.claimed_mu


@pytest.mark.parametrize("control", ["no-noise", "tenth-noise", "no-clip", "non-private"])
def test_every_positive_control_is_refuted(tiny_setup, control):
    report = _audit(tiny_setup, control)
    assert not report.passed and report.epsilon_lower_bound > EPS, report.line()
    assert report.claim_refuted and report.mu_lower_bound > report.claimed_mu


def test_dirac_coordinates_are_distinct_and_in_range():
    params = [torch.zeros(3, 4), torch.zeros(5)]
    coords = WB.dirac_coordinates(params, 17, np.random.default_rng(0))
    assert len(set(coords)) == 17 and all(0 <= i < params[t].numel() for t, i in coords)
    with pytest.raises(ValueError, match="need 18 coordinates"):
        WB.dirac_coordinates(params, 18, np.random.default_rng(0))


@pytest.mark.parametrize("mu", [0.5, 1.0, 2.0, 4.0])
def test_the_gaussian_dp_bound_is_sound_on_gaussians_of_known_mu(mu):
    """Scores of included canaries ~ N(mu, 1), excluded ~ N(0, 1): a mu-GDP test. mu_hat must never
    exceed mu, and must see a real signal (> 0) from mu = 1 at 20,000 canaries."""
    from fedpower_app.audit.bounds import steinke_gdp_lower_bound

    for seed in range(2):
        rng = np.random.default_rng(seed)
        m = 20000
        inc = rng.random(m) < 0.5
        order = np.argsort(rng.normal(size=m) + mu * inc)
        k = m // 10
        correct = int(inc[order[m - k:]].sum() + (~inc[order[:k]]).sum())
        mu_hat = steinke_gdp_lower_bound(2 * k, correct, m)
        assert mu_hat <= mu
        assert mu < 1 or mu_hat > 0.25 * mu


def test_fedpower_audit_runs_the_white_box_audit(tiny_model_dir, capsys):  # noqa: F811
    from fedpower_app.audit.membership import main

    sets = ["--set", f'model.name="{tiny_model_dir}"', "--set", "lora.rank=8", "--set", "task.max-length=16",
            "--set", "task.synthetic-train-size=128", "--set", "train.batch-size=32", "--set", "train.local-steps=5",
            "--set", "num-server-rounds=4", "--set", "dp.epsilon=2.0", "--set", "dp.clip=1.0",
            "--set", "lora.dropout=0.0"]
    assert main(["white-box", *sets, "--silos", "2", "--control", "no-clip"]) == 0
    assert "no-clip" in capsys.readouterr().out


@pytest.mark.parametrize("method", ["fedpower", "ffa-lora"])
def test_the_audit_inside_a_federated_run_refutes_a_broken_step_at_eps_8(tiny_setup, method):
    """Canaries in every silo's DP-SGD of a federated run (the product's engine and silo round):
    at a claim of 8 the correct step passes with power and no-noise is refuted by the f-DP test of
    the accountant's profile (Steinke's (eps, delta) bound cannot pass 8.2 at delta = 1e-5)."""
    from fedpower_app.config import parse_config

    cfg, _ = tiny_setup
    cfg = parse_config({**cfg.to_dict(), "strategy.name": method, "dp.epsilon": 8.0, "dp.clip": 1.0,
                        "task.synthetic-train-size": 192, "train.batch-size": 32, "train.local-steps": 5,
                        "num-server-rounds": 4, "dp.noise": "seeded"})
    correct = WB.run_federated_white_box_audit(cfg, silos=3, canaries=3000)
    assert correct.passed and 0 < correct.mu_lower_bound <= correct.claimed_mu, correct.line()
    assert correct.steps == 20 and correct.sample_rate == 0.5
    broken = WB.run_federated_white_box_audit(cfg, silos=3, canaries=3000, control="no-noise")
    assert broken.claim_refuted and broken.mu_lower_bound > broken.claimed_mu, broken.line()
    assert broken.epsilon_lower_bound < 8.0  # the (eps, delta) form alone could not have refuted it
