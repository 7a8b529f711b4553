"""Issue #34: a white-box audit of the product's DP-SGD step that can fail. Dirac gradient canaries
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


@pytest.mark.parametrize("control", ["no-noise", "tenth-noise", "no-clip"])
def test_every_positive_control_is_refuted(tiny_setup, control):
    report = _audit(tiny_setup, control)
    assert not report.passed and report.epsilon_lower_bound > EPS, report.line()


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
            "--set", "task.synthetic-train-size=64", "--set", "train.batch-size=32", "--set", "train.local-steps=5",
            "--set", "num-server-rounds=4", "--set", "dp.epsilon=2.0", "--set", "dp.clip=1.0",
            "--set", "lora.dropout=0.0"]
    assert main(["white-box", *sets, "--control", "no-clip"]) == 0
    assert "no-clip" in capsys.readouterr().out
