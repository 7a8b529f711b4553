"""DP-SGD with the head's noise split from the adapters' (``dp.head-noise-ratio``, docs/privacy.md §0.1).

A step releases the adapters' clipped sum + N(0, (σ_a C)² I) and the head's + N(0, (σ_h C_h)² I).
The claim: with 1/σ_a² + 1/σ_h² = 1/σ² this is one Gaussian mechanism of noise multiplier σ, the
one the accountant counts. Tested three ways:

1. the split's algebra (``strategies.mechanisms.dp_sgd_group_multipliers``);
2. the optimizer draws each group's noise at its std (tests/test_dp_sgd.py);
3. a Monte-Carlo audit of one step on the worst-case pair (one example at both clips), with the
   product's optimizer adding the noise: the likelihood-ratio score separates the worlds by exactly
   μ = 1/σ, and the audited ε lower bound stays under ε(μ = 1/σ). Two wrong splits (each group at
   σ; the head's std from the adapters' clip) are caught, so the audit can fail.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedpower_app.audit import bounds as audit
from fedpower_app.config import ConfigError, parse_config
from fedpower_app.privacy.accounting.silo import SiloLedger, SiloRefusal, paid_params, silo_gate
from fedpower_app.training.dp_sgd import DPSGDParams, _group_clipped_optimizer_class, dp_optimizer
from strategies.mechanisms import dp_sgd_group_multipliers, dp_sgd_noise_stds, dp_sgd_sensitivity

DELTA = 1e-5


@pytest.mark.parametrize("ratio", [1.01, 1.5, 4.0, 100.0])
@pytest.mark.parametrize("clip,head_clip", [(0.05, 0.05), (0.05, 1.0), (2.0, 0.3)])
def test_a_split_keeps_one_gaussian_mechanism_of_multiplier_sigma(ratio, clip, head_clip):
    sigma = 0.845
    sig_a, sig_h = dp_sgd_group_multipliers(sigma, clip, head_clip, ratio)
    assert 1 / sig_a**2 + 1 / sig_h**2 == pytest.approx(1 / sigma**2, rel=1e-12)
    assert sig_h == pytest.approx(ratio * sigma) and sig_a > sigma
    std_a, std_h = dp_sgd_noise_stds(sigma, clip, head_clip, ratio)
    # the scaled release (group g divided by its std) has sensitivity sqrt((C/std_a)^2 + (C_h/std_h)^2) = 1/sigma
    assert math.hypot(clip / std_a, head_clip / std_h) == pytest.approx(1 / sigma, rel=1e-12)


def test_ratio_zero_is_the_one_noise_of_the_joint_sensitivity_and_no_head_is_one_group():
    sigma, clip, head_clip = 0.7, 0.05, 0.2
    joint = sigma * dp_sgd_sensitivity(clip, head_clip)
    assert dp_sgd_noise_stds(sigma, clip, head_clip, 0.0) == pytest.approx((joint, joint), rel=1e-12)
    sig_a, sig_h = dp_sgd_group_multipliers(sigma, clip, head_clip, 0.0)
    assert 1 / sig_a**2 + 1 / sig_h**2 == pytest.approx(1 / sigma**2, rel=1e-12)  # the same identity
    assert dp_sgd_noise_stds(sigma, clip) == (sigma * clip, 0.0)
    # ... and at rho = 4 with C_h = C the adapters carry 27 % less noise than the one noise's sqrt(2) sigma
    assert dp_sgd_group_multipliers(1.0, 1.0, 1.0, 4.0)[0] / dp_sgd_group_multipliers(1.0, 1.0, 1.0, 0.0)[0] \
        == pytest.approx(1.0328 / 1.4142, abs=1e-4)


@pytest.mark.parametrize("ratio,head_clip,why", [(0.5, 1.0, "0 or > 1"), (1.0, 1.0, "0 or > 1"),
                                                  (math.nan, 1.0, "0 or > 1"), (math.inf, 1.0, "0 or > 1"),
                                                  (4.0, 0.0, "head clipped apart")])
def test_the_silo_refuses_an_unusable_ratio(ratio, head_clip, why):
    params = DPSGDParams(0.8, 0.05, 100, 2, head_clip=head_clip, head_noise_ratio=ratio)
    assert any(why in p for p in params.problems())
    with pytest.raises(SiloRefusal, match=why):
        silo_gate(SiloLedger(DELTA), [], None, params, 1000, max_epsilon=8.0)
    with pytest.raises(ValueError, match=why):
        dp_sgd_noise_stds(0.8, 0.05, head_clip, ratio)


def test_the_silo_reads_the_ratio_and_a_replay_must_carry_the_same():
    from client_app.app import dp_sgd_params

    config = {"dp-sgd.noise-multiplier": 0.8, "dp-sgd.clip": 0.05, "dp-sgd.batch-size": 100,
              "dp-sgd.local-steps": 2, "dp-sgd.head-clip": 1.0, "dp-sgd.head-noise-ratio": 4.0}
    params = dp_sgd_params(config)
    assert params.head_noise_ratio == 4.0 and not params.problems()
    old = dp_sgd_params({k: v for k, v in config.items() if k != "dp-sgd.head-noise-ratio"})
    assert old.head_noise_ratio == 0.0  # a server that sends no ratio: one noise, as before
    ledger, paid = SiloLedger(DELTA), []
    q, charge = silo_gate(ledger, paid, "run:1", params, 1000, max_epsilon=8.0)
    assert charge
    paid.append({"key": "run:1", "params": paid_params(params, q)})
    assert silo_gate(ledger, paid, "run:1", params, 1000, max_epsilon=8.0) == (q, False)
    with pytest.raises(SiloRefusal, match="replay must carry the same"):
        silo_gate(ledger, paid, "run:1", old, 1000, max_epsilon=8.0)
    # a ledger entry written before the ratio existed still matches a ratio-0 replay
    assert paid_params(old, q) == [0.8, 0.05, 100, 2, 1.0, q]


def test_the_config_rejects_a_ratio_it_cannot_use():
    with pytest.raises(ConfigError, match="must be 0 or > 1"):
        parse_config({"dp.head-noise-ratio": 0.5})
    with pytest.raises(ConfigError, match="head clipped apart"):
        parse_config({"dp.head-noise-ratio": 4.0, "model.train-head": True})  # no dp.head-clip
    with pytest.raises(ConfigError, match="head clipped apart"):
        parse_config({"dp.head-noise-ratio": 4.0, "dp.head-clip": 1.0})  # no trained head
    cfg = parse_config({"dp.head-noise-ratio": 4.0, "dp.head-clip": 1.0, "model.train-head": True})
    assert cfg["dp.head-noise-ratio"] == 4.0


def test_the_hook_sends_the_ratio_and_prints_both_stds():
    from fedpower_app.privacy.hook import build_privacy
    from client_app.app import dp_sgd_params

    cfg = parse_config({"dp.head-noise-ratio": 4.0, "dp.head-clip": 1.0, "model.train-head": True})
    hook = build_privacy(cfg, client_sizes={0: 50_000, 1: 50_000}, num_modules=12)
    params = dp_sgd_params(hook.train_config())
    assert params.head_noise_ratio == 4.0 and params.head_clip == 1.0
    std_a, std_h = params.noise_stds
    assert hook.describe()["silo_noise_stds"] == {"adapters": std_a, "head": std_h}
    line = next(s for s in hook.summary_lines() if "each its own noise" in s)
    assert f"adapters sigma_a*C={std_a:.4g}" in line and f"head sigma_h*C_h={std_h:.4g}" in line


# -- the Monte-Carlo audit of one step -------------------------------------------------------------
TRIALS = 100_000  # per world
D_ADAPTERS, D_HEAD = 12, 4


def _released(make_optimizer, contribution, generator):
    """TRIALS releases of one step's noised clipped sums, each row one trial: the product's
    optimizer adds the noise to ``contribution`` (the clipped sum, per group; zeros = the world without
    the example). Returns (adapters, head), each (TRIALS, d)."""
    adapters = torch.nn.Parameter(torch.zeros(TRIALS, D_ADAPTERS, dtype=torch.float64))
    head = torch.nn.Parameter(torch.zeros(TRIALS, D_HEAD, dtype=torch.float64))
    opt = make_optimizer([("layer.lora_A", adapters), ("classifier.modules_to_save.default.weight", head)], generator)
    for p, v in zip((adapters, head), contribution):
        p.summed_grad = v.expand(TRIALS, -1).clone()
    opt.add_noise()
    return adapters.grad.detach(), head.grad.detach()


def _audit(make_optimizer, stds, clip, head_clip, seed):
    """Worst-case pair: D' = D + one example whose clipped gradient reaches both clips, (C u_a, C_h u_h).
    The Neyman-Pearson score of a release Y is sum_g <Y_g, v_g> / std_g^2 (the attacker knows the
    mechanism): N(0, mu^2) without the example, N(mu^2, mu^2) with it."""
    g = torch.Generator().manual_seed(seed)
    u_a = torch.randn(D_ADAPTERS, generator=g, dtype=torch.float64)
    u_h = torch.randn(D_HEAD, generator=g, dtype=torch.float64)
    v = (clip * u_a / u_a.norm(), head_clip * u_h / u_h.norm())
    scores = []
    for contribution in ((torch.zeros(D_ADAPTERS, dtype=torch.float64), torch.zeros(D_HEAD, dtype=torch.float64)), v):
        y_a, y_h = _released(make_optimizer, contribution, g)
        scores.append(((y_a @ v[0]) / stds[0] ** 2 + (y_h @ v[1]) / stds[1] ** 2).numpy())
    return audit.gdp_mu_estimate(*scores), audit.audit_scores(*scores, delta=DELTA, rng=np.random.default_rng(seed))


def _product_optimizer(params):
    def make(named, generator):
        base = torch.optim.SGD([p for _, p in named], lr=1.0)
        return dp_optimizer(base, named, params, generator=generator)
    return make


def _wrong_optimizer(params, stds):
    def make(named, generator):
        base = torch.optim.SGD([p for _, p in named], lr=1.0)
        return _group_clipped_optimizer_class()(
            base, group_of={id(named[0][1]): 0, id(named[1][1]): 1}, group_clips=[params.clip, params.head_clip],
            group_noise_stds=stds, noise_multiplier=params.noise_multiplier, expected_batch_size=1,
            loss_reduction="mean", generator=generator)
    return make


@pytest.mark.parametrize("ratio", [0.0, 4.0])
def test_audit_one_step_is_the_gaussian_mechanism_of_multiplier_sigma(ratio):
    sigma, clip, head_clip = 1.0, 0.05, 1.0
    params = DPSGDParams(sigma, clip, 1, 1, head_clip=head_clip, head_noise_ratio=ratio)
    claim = audit.gaussian_epsilon(1 / sigma, DELTA)  # 4.377: what the accountant counts for this step
    mu, res = _audit(_product_optimizer(params), params.noise_stds, clip, head_clip, seed=11)
    assert mu == pytest.approx(1 / sigma, abs=0.02), mu
    assert res.epsilon_lb <= claim, res
    assert res.epsilon_lb > 0.4 * claim  # the attack is strong: it reaches most of the claim
    print(f"\n[audit] group noise rho={ratio:g}: mu_hat={mu:.3f} (claim 1/sigma = {1 / sigma:g}), "
          f"eps_LB={res.epsilon_lb:.3f} <= eps={claim:.3f}")


def test_audit_catches_wrong_splits():
    """Negative controls: the same audit on two plausible bugs. (a) Each group at the run's sigma
    (no split): mu = sqrt(2)/sigma, which the fitted mu shows. (b) The head's std from the adapters'
    clip (sigma_h C instead of sigma_h C_h, C_h = 20 C): mu ~ 5/sigma, and the eps lower bound
    itself exceeds the claimed eps."""
    sigma, clip, head_clip = 2.0, 0.05, 1.0
    params = DPSGDParams(sigma, clip, 1, 1, head_clip=head_clip, head_noise_ratio=4.0)
    claim = audit.gaussian_epsilon(1 / sigma, DELTA)  # 1.993
    each_at_sigma = (sigma * clip, sigma * head_clip)
    mu, _ = _audit(_wrong_optimizer(params, each_at_sigma), each_at_sigma, clip, head_clip, seed=12)
    assert mu == pytest.approx(math.sqrt(2) / sigma, abs=0.02) and mu > 1 / sigma + 0.15
    sig_a, sig_h = dp_sgd_group_multipliers(sigma, clip, head_clip, 4.0)
    head_from_adapter_clip = (sig_a * clip, sig_h * clip)
    mu, res = _audit(_wrong_optimizer(params, head_from_adapter_clip), head_from_adapter_clip, clip, head_clip, seed=13)
    assert mu > 2.0 / sigma and res.epsilon_lb > claim, (mu, res)
    print(f"\n[audit] wrong split (head std from C): mu_hat={mu:.3f}, eps_LB={res.epsilon_lb:.3f} > claim {claim:.3f}")
