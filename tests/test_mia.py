"""Membership-inference attacks, their metrics, the DP ceiling and the Steinke one-run bound, on
synthetic scores whose answer is known in closed form."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from fedpower_app.audit import attacks as mia, bounds as audit


def gaussian_runs(mu: float, *, runs: int = 8, n: int = 1500, pop: int = 1000, difficulty: float = 0.0, seed: int = 0):
    """Binary logits [0, phi] with label 1, so phi is exactly the logit-scaled confidence:
    phi = c_i + mu * keep + N(0, 1), with a per-example offset c_i ~ N(0, difficulty^2) shared by
    every run (hard and easy examples, as real data has)."""
    rng = np.random.default_rng(seed)
    keep = rng.random((runs, n)) < 0.5
    c = rng.normal(0.0, difficulty, size=n) if difficulty else np.zeros(n)
    phi = c[None, :] + mu * keep + rng.normal(size=(runs, n))
    c_pop = rng.normal(0.0, difficulty, size=pop) if difficulty else np.zeros(pop)
    phi_pop = c_pop[None, :] + rng.normal(size=(runs, pop))
    logits = np.stack([np.zeros_like(phi), phi], axis=-1)
    logits_pop = np.stack([np.zeros_like(phi_pop), phi_pop], axis=-1)
    return logits, np.ones(n, dtype=int), keep, logits_pop, np.ones(pop, dtype=int)


def all_metrics(mu, confidence=0.95, **kw):
    """Every attack, leave-one-out. 32 runs: per-example attacks estimate each example's IN/OUT
    means from ~15 references each; with far fewer their estimation noise lowers the AUC (LiRA
    online at mu = 0.5 and 8 runs: 0.565 instead of 0.638), which is real, not a bug."""
    kw = {"runs": 32, "n": 600, "pop": 600, **kw}
    logits, labels, keep, lp, yp = gaussian_runs(mu, **kw)
    scores = mia.leave_one_out_scores(logits, labels, keep, lp, yp)
    return {a: mia.attack_metrics(a, s, list(keep), bootstrap=60, confidence=confidence)
            for a, s in scores.items()}


def test_signals_are_stable_and_consistent():
    z = np.array([[2.0, -1.0, 0.5], [1000.0, -1000.0, 0.0]])
    y = np.array([0, 1])
    s = mia.signals(z, y)
    p = np.exp(z[0] - np.log(np.exp(z[0]).sum()))
    assert s.prob[0] == pytest.approx(p[0])
    assert s.loss[0] == pytest.approx(-math.log(p[0]))
    assert s.phi[0] == pytest.approx(math.log(p[0] / (1 - p[0])))
    # extreme logits: no overflow, phi = -2000 exactly, loss = 2000
    assert s.phi[1] == pytest.approx(-2000.0)
    assert s.loss[1] == pytest.approx(2000.0)
    with pytest.raises(ValueError, match="labels"):
        mia.signals(z, np.array([0, 3]))


@pytest.mark.parametrize("mu", [0.5, 1.0, 2.0])
def test_every_attack_reaches_the_gaussian_auc(mu):
    """IN ~ N(mu, 1), OUT ~ N(0, 1): the best threshold test has AUC Phi(mu / sqrt 2), and every attack
    (they are all monotone in phi here, up to estimation noise) gets there."""
    expected = stats.norm.cdf(mu / math.sqrt(2))
    for name, m in all_metrics(mu).items():
        assert m.auc == pytest.approx(expected, abs=0.025), name
        assert m.auc_ci[0] - 0.02 <= expected <= m.auc_ci[1] + 0.02, name
        assert m.balanced_accuracy > 0.5


def test_every_attack_is_at_chance_without_membership_signal():
    # 7 attacks at 95 % would put one outside its CI about a third of the time; 99 % CIs.
    for name, m in all_metrics(0.0, confidence=0.99).items():
        assert m.auc_ci[0] <= 0.5 <= m.auc_ci[1], (name, m.auc, m.auc_ci)
        assert abs(m.auc - 0.5) < 0.03, name
        assert m.tpr_at_1pct < 0.03, name


def test_reference_attacks_beat_loss_when_examples_differ_in_difficulty():
    """With a per-example offset shared by all runs, a global loss threshold mostly sees difficulty;
    attacks calibrated per example by the reference runs remove it (the point of LiRA and RMIA)."""
    mu, diff = 1.0, 3.0
    ms = all_metrics(mu, difficulty=diff)
    expected = stats.norm.cdf(mu / math.sqrt(2))
    assert ms["loss"].auc < expected - 0.1
    for name in ("calibration", "lira-online", "lira-offline"):
        assert ms[name].auc == pytest.approx(expected, abs=0.03), name
    for name in ("rmia-online", "rmia-offline"):
        assert ms[name].auc > ms["loss"].auc + 0.05, name


def test_lira_online_is_monotone_in_phi_with_a_fixed_variance():
    logits, labels, keep, lp, yp = gaussian_runs(1.0, runs=6, n=200)
    sig = mia.signals(logits, labels[None, :])
    phi_grid = np.linspace(-3, 3, 50)
    mu_in, mu_out, sd_in, sd_out = mia._lira_fit(sig.phi[1:], keep[1:])
    # Same example, larger phi -> larger score, when the IN mean is above the OUT mean.
    i = int(np.argmax(mu_in - mu_out))
    s = [mia.lira_online_scores(np.full(200, x), sig.phi[1:], keep[1:])[i] for x in phi_grid]
    if abs(sd_in - sd_out) < 1e-9:
        assert np.all(np.diff(s) > 0)
    assert s[-1] > s[0]


def test_tpr_at_fpr_takes_the_last_point_within_the_budget():
    fpr = np.array([0.0, 0.005, 0.01, 0.02, 1.0])
    tpr = np.array([0.0, 0.10, 0.20, 0.30, 1.0])
    assert mia.tpr_at_fpr(fpr, tpr, 0.01) == 0.20
    assert mia.tpr_at_fpr(fpr, tpr, 0.001) == 0.0
    assert mia.balanced_accuracy(fpr, tpr) == pytest.approx(max((t + 1 - f) / 2 for f, t in zip(fpr, tpr)))


def test_low_count_flag_follows_the_number_of_nonmembers():
    rng = np.random.default_rng(0)
    small = mia.attack_metrics("x", [rng.normal(size=1000)], [rng.random(1000) < 0.5], bootstrap=0)
    assert small.tpr_at_01pct_low_count  # ~500 non-members: 0.5 false positives at 0.1 %
    big_n = 50_000
    big = mia.attack_metrics("x", [rng.normal(size=big_n)], [rng.random(big_n) < 0.5], bootstrap=0)
    assert not big.tpr_at_01pct_low_count


def test_dp_ceiling_matches_the_closed_form_and_bounds_a_gaussian_mechanism():
    eps, delta = 3.0, 1e-5
    fpr = np.array([0.0, 0.001, 0.01, 0.1, 0.5, 1.0])
    c = mia.dp_tpr_ceiling(fpr, [(delta, eps)])
    assert c[2] == pytest.approx(math.exp(eps) * 0.01 + delta)
    assert c[-1] == 1.0 and np.all(np.diff(c) >= 0) and np.all(c >= fpr)
    # A Gaussian mechanism with mu: its exact ROC never crosses the ceiling of its own eps(delta) curve.
    mu = 1.0
    curve = [(d, audit.gaussian_epsilon(mu, d)) for d in (1e-8, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.1, 0.3)]
    grid = np.logspace(-5, 0, 200)
    tpr_exact = stats.norm.sf(stats.norm.isf(grid) - mu)
    assert np.all(tpr_exact <= mia.dp_tpr_ceiling(grid, curve) + 1e-9)


def test_steinke_bound_known_values_ceiling_and_monotonicity():
    # mia-notes §4.1: all m = 1000 guesses right at delta = 1e-5 -> 5.78 (and the table of ceilings).
    assert audit.steinke_ceiling(1000, 1e-5) == pytest.approx(5.78, abs=0.01)
    assert audit.steinke_ceiling(100, 1e-5) == pytest.approx(3.49, abs=0.01)
    assert audit.steinke_ceiling(5000, 1e-5) == pytest.approx(7.28, abs=0.01)
    m = 1000
    prev = -1.0
    for v in range(0, m + 1, 25):
        e = audit.steinke_epsilon_lower_bound(m, v, m, 1e-5)
        assert e >= prev - 1e-9  # monotone in the number of correct guesses
        assert e <= audit.steinke_ceiling(m, 1e-5) + 1e-9
        prev = e
    assert audit.steinke_epsilon_lower_bound(m, m // 2, m, 1e-5) == 0.0  # coin flipping proves nothing
    # fewer guesses: a lower ceiling
    assert audit.steinke_ceiling(1000, 1e-5, guesses=200) < audit.steinke_ceiling(1000, 1e-5)


def test_steinke_bound_is_valid_for_randomized_response():
    """Each canary an exact eps-randomized response: the 95 % bound exceeds eps in at most ~5 % of audits."""
    eps, m, trials = 1.0, 500, 200
    rng = np.random.default_rng(1)
    q = math.exp(eps) / (1 + math.exp(eps))
    over = 0
    for _ in range(trials):
        inc = rng.random(m) < 0.5
        truthful = rng.random(m) < q
        score = np.where(truthful, inc, ~inc).astype(float) + 1e-3 * rng.random(m)
        res = audit.canary_audit(score, inc, delta=0.0, guess_fraction=0.5, claimed_epsilon=eps)
        over += res.violated
    assert over <= 0.05 * trials + 3 * math.sqrt(0.05 * trials)


def test_canary_audit_detects_a_false_claim_and_passes_a_true_one():
    rng = np.random.default_rng(2)
    m = 2000
    inc = rng.random(m) < 0.5
    leaky = inc + 0.05 * rng.normal(size=m)  # a non-private release: membership is readable
    res = audit.canary_audit(leaky, inc, delta=1e-5, claimed_epsilon=1.0)
    assert res.correct == res.guesses_in + res.guesses_out
    assert res.violated and res.epsilon_lower_bound > 1.0
    assert res.epsilon_lower_bound <= res.ceiling + 1e-9
    blind = rng.normal(size=m)
    ok = audit.canary_audit(blind, inc, delta=1e-5, claimed_epsilon=1.0)
    assert not ok.violated
