"""Empirical privacy auditing helpers (privacy-accounting spec §7): statistical LOWER bounds on epsilon.

An audit runs a mechanism many times on two neighbouring inputs D' ("negatives", label 0) and
D ("positives", label 1), reduces every output to one real score (e.g. the projection of the
release onto the difference of the two noise-free releases) and asks how well a threshold test
separates the two score samples. Under (epsilon, delta)-DP every test satisfies

    FPR + e^eps * FNR >= 1 - delta      and      FNR + e^eps * FPR >= 1 - delta,

so observed error rates give the lower bound of Jagielski, Ullman & Oprea (2020)::

    eps_LB = max{ log((1 - delta - FNR+) / FPR+),  log((1 - delta - FPR+) / FNR+) }

with FPR+ and FNR+ Clopper-Pearson upper confidence bounds. If an audit's eps_LB exceeds the
claimed epsilon (at the stated confidence), the claim, its analysis or its code is wrong. Passing
an audit proves nothing.

To keep the bound honest the threshold is chosen on one half of the trials ("tuning") and the
bound is computed on the other, independent half ("evaluation"): :func:`audit_scores`.

:func:`gaussian_epsilon` and :func:`gdp_mu_estimate` give the mu-GDP view (Nasr et al. 2023): the
exact (eps, delta) curve of a Gaussian mechanism with mu = sensitivity / noise std (Balle & Wang
2018), and a Gaussian fit of the two score samples. The fit is an ESTIMATE, not a bound.

Pure numpy + scipy (no torch, no flwr).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

import numpy as np
from scipy import optimize, special, stats

__all__ = [
    "clopper_pearson_upper",
    "clopper_pearson_lower",
    "clopper_pearson_interval",
    "epsilon_from_rates",
    "epsilon_lower_bound",
    "error_counts",
    "candidate_thresholds",
    "ThresholdChoice",
    "tune_threshold",
    "AuditResult",
    "audit_scores",
    "split_halves",
    "gaussian_delta",
    "gaussian_epsilon",
    "gdp_mu_estimate",
    "gdp_epsilon_estimate",
]


# --------------------------------------------------------------------------------------------
# Clopper-Pearson bounds
# --------------------------------------------------------------------------------------------


def _counts(k, n):
    k = np.asarray(k, dtype=float)
    n = np.asarray(n, dtype=float)
    if np.any(n <= 0) or np.any(k < 0) or np.any(k > n):
        raise ValueError(f"need 0 <= k <= n and n > 0, got k={k}, n={n}")
    return k, n


def clopper_pearson_upper(k, n, alpha: float = 0.05):
    """One-sided (1 - alpha) Clopper-Pearson upper bound on a binomial rate from k successes in n.

    ``P[p <= upper] >= 1 - alpha``. Equals 1 when k == n. Vectorised over k and n.
    """
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    k, n = _counts(k, n)
    full = k >= n
    out = stats.beta.ppf(1.0 - alpha, k + 1.0, np.where(full, 1.0, n - k))
    out = np.where(full, 1.0, out)
    return float(out) if out.ndim == 0 else out


def clopper_pearson_lower(k, n, alpha: float = 0.05):
    """One-sided (1 - alpha) Clopper-Pearson lower bound (0 when k == 0). Vectorised."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    k, n = _counts(k, n)
    zero = k <= 0
    out = stats.beta.ppf(alpha, np.where(zero, 1.0, k), n - k + 1.0)
    out = np.where(zero, 0.0, out)
    return float(out) if out.ndim == 0 else out


def clopper_pearson_interval(k, n, alpha: float = 0.05):
    """Two-sided (1 - alpha) Clopper-Pearson interval ``(lower, upper)`` (alpha/2 in each tail)."""
    return clopper_pearson_lower(k, n, alpha / 2.0), clopper_pearson_upper(k, n, alpha / 2.0)


# --------------------------------------------------------------------------------------------
# Error rates -> epsilon
# --------------------------------------------------------------------------------------------


def epsilon_from_rates(fpr, fnr, delta: float = 0.0):
    """Largest epsilon compatible with a test of the given error rates under (eps, delta)-DP.

    ``max{log((1-delta-FNR)/FPR), log((1-delta-FPR)/FNR), 0}``; ``inf`` if a rate is 0 and the
    matching numerator positive. With point estimates of the rates this is an estimate; with upper
    confidence bounds (:func:`epsilon_lower_bound`) it is a statistical lower bound. Vectorised.
    """
    fpr = np.asarray(fpr, dtype=float)
    fnr = np.asarray(fnr, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        num1 = 1.0 - delta - fnr
        num2 = 1.0 - delta - fpr
        e1 = np.where(num1 > 0, np.log(np.where(num1 > 0, num1, 1.0)) - np.log(fpr), -np.inf)
        e2 = np.where(num2 > 0, np.log(np.where(num2 > 0, num2, 1.0)) - np.log(fnr), -np.inf)
    out = np.maximum(np.maximum(e1, e2), 0.0)
    out = np.where(np.isnan(out), 0.0, out)
    return float(out) if out.ndim == 0 else out


def epsilon_lower_bound(fp, n_neg, fn, n_pos, delta: float = 0.0, alpha: float = 0.05):
    """Jagielski et al. (2020) epsilon lower bound from error COUNTS of a fixed threshold test.

    Args:
        fp: false positives (negatives, i.e. trials on D', classified as D), out of ``n_neg``.
        fn: false negatives (trials on D classified as D'), out of ``n_pos``.
        delta: the delta of the claim being audited.
        alpha: total miss probability. Each of the two Clopper-Pearson upper bounds (FPR+, FNR+) is
            taken at level alpha/2, so by a union bound the result is a lower bound on the true
            epsilon with confidence >= 1 - alpha (provided the test was fixed before seeing these
            trials).

    Returns ``max{log((1-delta-FNR+)/FPR+), log((1-delta-FPR+)/FNR+), 0}``. Vectorised over counts.
    """
    fpr_u = clopper_pearson_upper(fp, n_neg, alpha / 2.0)
    fnr_u = clopper_pearson_upper(fn, n_pos, alpha / 2.0)
    return epsilon_from_rates(fpr_u, fnr_u, delta)


def error_counts(neg, pos, thresholds):
    """Error counts of the tests "say D (positive) iff score >= t" for each threshold t.

    Returns ``(fp, fn)`` arrays: fp = #{neg >= t}, fn = #{pos < t}. ``neg``/``pos`` are the
    scores of trials on D' and on D. Vectorised via sorting (O((n + T) log n)).
    """
    neg_s = np.sort(np.asarray(neg, dtype=float).ravel())
    pos_s = np.sort(np.asarray(pos, dtype=float).ravel())
    t = np.asarray(thresholds, dtype=float)
    fp = neg_s.size - np.searchsorted(neg_s, t, side="left")
    fn = np.searchsorted(pos_s, t, side="left")
    return fp, fn


def candidate_thresholds(neg, pos, *, tail: int = 2000, grid: int = 1000) -> np.ndarray:
    """Thresholds worth trying: every score in the ``tail`` most extreme values on both sides of
    the pooled sample (where epsilon lower bounds are decided) plus ``grid`` evenly spaced pooled
    quantiles. Sorted and unique."""
    pooled = np.sort(np.concatenate([np.asarray(neg, float).ravel(), np.asarray(pos, float).ravel()]))
    if pooled.size == 0:
        raise ValueError("need at least one score")
    k = min(tail, pooled.size)
    idx = np.linspace(0, pooled.size - 1, num=min(grid, pooled.size)).round().astype(int)
    cand = np.concatenate([pooled[:k], pooled[-k:], pooled[idx]])
    return np.unique(cand)


@dataclass
class ThresholdChoice:
    """A test chosen on the tuning half: say D iff ``sign * score >= threshold``."""

    threshold: float
    sign: float
    epsilon: float  # epsilon lower bound of this test ON THE TUNING DATA (optimistic; not a result)


def tune_threshold(
    neg,
    pos,
    *,
    delta: float = 0.0,
    alpha: float = 0.05,
    both_directions: bool = True,
    tail: int = 2000,
    grid: int = 1000,
) -> ThresholdChoice:
    """Choose the threshold (and orientation) maximising the Clopper-Pearson epsilon lower bound
    on the given (tuning) scores. Maximising the CP bound rather than the point estimate avoids
    thresholds with only one or two errors in the tail."""
    neg = np.asarray(neg, dtype=float).ravel()
    pos = np.asarray(pos, dtype=float).ravel()
    if neg.size == 0 or pos.size == 0:
        raise ValueError("need scores from both worlds")
    best: Optional[ThresholdChoice] = None
    for sign in ((1.0, -1.0) if both_directions else (1.0,)):
        n_, p_ = sign * neg, sign * pos
        cand = candidate_thresholds(n_, p_, tail=tail, grid=grid)
        fp, fn = error_counts(n_, p_, cand)
        eps = epsilon_lower_bound(fp, n_.size, fn, p_.size, delta, alpha)
        i = int(np.argmax(eps))
        if best is None or eps[i] > best.epsilon:
            best = ThresholdChoice(threshold=float(cand[i]), sign=sign, epsilon=float(eps[i]))
    return best


def split_halves(scores, rng: Optional[np.random.Generator] = None):
    """Split a score sample into two halves (tuning, evaluation); shuffled first if ``rng``."""
    s = np.asarray(scores, dtype=float).ravel()
    if rng is not None:
        s = s[rng.permutation(s.size)]
    h = s.size // 2
    return s[:h], s[h:]


@dataclass
class AuditResult:
    """Outcome of :func:`audit_scores` (all rates measured on the evaluation half)."""

    epsilon_lb: float  # the (1 - alpha)-confidence lower bound on epsilon
    epsilon_point: float  # same formula with point-estimate rates (not a bound)
    threshold: float
    sign: float
    fp: int
    n_neg: int
    fn: int
    n_pos: int
    fpr_upper: float
    fnr_upper: float
    tuning_epsilon: float
    delta: float
    alpha: float

    def as_dict(self) -> dict:
        return asdict(self)


def audit_scores(
    neg,
    pos,
    *,
    delta: float = 0.0,
    alpha: float = 0.05,
    rng: Optional[np.random.Generator] = None,
    both_directions: bool = True,
    tail: int = 2000,
    grid: int = 1000,
) -> AuditResult:
    """Threshold-tuned Clopper-Pearson epsilon lower bound from two score samples.

    ``neg`` are the scores of trials run on D', ``pos`` those on D (i.i.d. trials). Each sample is
    split in two halves (shuffled with ``rng`` if given); the test is tuned on the first halves
    (:func:`tune_threshold`) and :func:`epsilon_lower_bound` is computed on the second halves,
    which the choice never saw, so the result is a valid (1 - alpha)-confidence lower bound.
    """
    n_tune, n_eval = split_halves(neg, rng)
    p_tune, p_eval = split_halves(pos, rng)
    choice = tune_threshold(n_tune, p_tune, delta=delta, alpha=alpha, both_directions=both_directions,
                            tail=tail, grid=grid)
    fp, fn = error_counts(choice.sign * n_eval, choice.sign * p_eval, [choice.threshold])
    fp, fn = int(fp[0]), int(fn[0])
    eps_lb = float(epsilon_lower_bound(fp, n_eval.size, fn, p_eval.size, delta, alpha))
    eps_pt = float(epsilon_from_rates(fp / n_eval.size, fn / p_eval.size, delta))
    return AuditResult(
        epsilon_lb=eps_lb,
        epsilon_point=eps_pt,
        threshold=choice.threshold,
        sign=choice.sign,
        fp=fp,
        n_neg=int(n_eval.size),
        fn=fn,
        n_pos=int(p_eval.size),
        fpr_upper=float(clopper_pearson_upper(fp, n_eval.size, alpha / 2.0)),
        fnr_upper=float(clopper_pearson_upper(fn, p_eval.size, alpha / 2.0)),
        tuning_epsilon=choice.epsilon,
        delta=float(delta),
        alpha=float(alpha),
    )


# --------------------------------------------------------------------------------------------
# Gaussian differential privacy (mu-GDP)
# --------------------------------------------------------------------------------------------


def gaussian_delta(mu: float, eps: float) -> float:
    """delta(eps) of a Gaussian mechanism with mu = sensitivity/std (Balle & Wang 2018, Thm 8):
    ``Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)``, second term in log space."""
    mu, eps = float(mu), float(eps)
    if mu < 0 or eps < 0:
        raise ValueError(f"need mu >= 0 and eps >= 0, got mu={mu}, eps={eps}")
    if mu == 0:
        return 0.0
    if math.isinf(mu):
        return 1.0
    a = special.ndtr(-eps / mu + mu / 2.0)
    b = math.exp(eps + special.log_ndtr(-eps / mu - mu / 2.0))
    return float(max(a - b, 0.0))


def gaussian_epsilon(mu: float, delta: float) -> float:
    """Smallest eps with ``gaussian_delta(mu, eps) <= delta``: the exact (eps, delta) of mu-GDP.

    Equals ``dp_accounting.get_epsilon_gaussian(1/mu, delta)`` (privacy-accounting spec §6.3: mu = 0.5 -> 1.99309,
    mu = 1 -> 4.37718, mu = 2 -> 9.99726 at delta = 1e-5).
    """
    mu, delta = float(mu), float(delta)
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if mu < 0 or math.isnan(mu):
        raise ValueError(f"mu must be >= 0, got {mu}")
    if mu == 0 or gaussian_delta(mu, 0.0) <= delta:
        return 0.0
    if math.isinf(mu):
        return math.inf
    hi = max(1.0, mu * mu)
    while gaussian_delta(mu, hi) > delta:
        hi *= 2.0
    return float(optimize.brentq(lambda e: gaussian_delta(mu, e) - delta, 0.0, hi, xtol=1e-12, rtol=1e-12))


def gdp_mu_estimate(neg, pos) -> float:
    """Gaussian fit of two score samples: ``(mean(pos) - mean(neg)) / pooled std`` (Nasr et al.
    2023). For a linear score of a Gaussian mechanism this estimates mu = ||Delta|| / std exactly;
    otherwise it is a heuristic. An ESTIMATE (no confidence guarantee), never a bound."""
    neg = np.asarray(neg, dtype=float).ravel()
    pos = np.asarray(pos, dtype=float).ravel()
    if neg.size < 2 or pos.size < 2:
        raise ValueError("need at least two scores per world")
    sd = math.sqrt((neg.var(ddof=1) + pos.var(ddof=1)) / 2.0)
    if sd == 0:
        return math.inf if pos.mean() != neg.mean() else 0.0
    return float(abs(pos.mean() - neg.mean()) / sd)


def gdp_epsilon_estimate(neg, pos, delta: float) -> float:
    """``gaussian_epsilon(gdp_mu_estimate(neg, pos), delta)``: epsilon estimate from a GDP fit."""
    return gaussian_epsilon(gdp_mu_estimate(neg, pos), delta)


# --------------------------------------------------------------------------------------------
# One-run auditing with canaries (Steinke, Nasr & Jagielski 2023)
# --------------------------------------------------------------------------------------------


def steinke_p_value(eps: float, r: int, v: int, m: int, delta: float) -> float:
    """Upper bound on P[v or more of r guesses correct] for an (eps, delta)-DP mechanism whose m
    canaries were each included independently with probability 1/2 (Steinke et al. 2023, Thm 5.2)::

        P[Bin(r, q) >= v] + 2 m delta * max_{1 <= i <= v} P[v - i <= Bin(r, q) < v] / i,
        q = e^eps / (1 + e^eps).
    """
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 <= v <= r <= m, got v={v}, r={r}, m={m}")
    q = special.expit(eps)
    tail = float(stats.binom.sf(v - 1, r, q))  # P[Bin >= v]
    if delta <= 0 or v == 0:
        return min(1.0, tail)
    i = np.arange(1, v + 1)
    cdf_below_v = stats.binom.cdf(v - 1, r, q)
    cdf_below_v_minus_i = stats.binom.cdf(v - i - 1, r, q)  # P[Bin < v - i]
    extra = float(np.max((cdf_below_v - cdf_below_v_minus_i) / i))
    return min(1.0, tail + 2.0 * m * delta * extra)


def steinke_epsilon_lower_bound(r: int, v: int, m: int, delta: float, beta: float = 0.05,
                                eps_max: float = 50.0) -> float:
    """The one-run lower bound eps_hat: the largest eps that the observation "v of r guesses right"
    rejects at level ``beta`` (p-value < beta), found by bisection (the p-value grows with eps).

    Valid when the r guesses are fixed in advance (how many IN and OUT guesses) and each of the m
    canaries was included by its own fair coin. 0 when nothing is rejected."""
    if not 0 < beta < 1:
        raise ValueError(f"beta must be in (0, 1), got {beta}")
    if r == 0 or steinke_p_value(0.0, r, v, m, delta) >= beta:
        return 0.0
    lo, hi = 0.0, eps_max
    if steinke_p_value(hi, r, v, m, delta) < beta:
        return hi
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if steinke_p_value(mid, r, v, m, delta) < beta:
            lo = mid
        else:
            hi = mid
    return lo


def steinke_ceiling(m: int, delta: float, beta: float = 0.05, guesses: int | None = None) -> float:
    """The largest eps_hat an audit with m canaries (``guesses`` of them guessed) can ever certify:
    the bound when every guess is right. A small eps_hat is not evidence of privacy beyond it."""
    r = m if guesses is None else guesses
    return steinke_epsilon_lower_bound(r, r, m, delta, beta)


#: The epsilons at which :func:`steinke_gdp_lower_bound` tests a mu (fixed in advance; Bonferroni).
GDP_EPS_GRID = tuple(float(e) for e in np.linspace(0.25, 12.0, 48))


def steinke_gdp_lower_bound(r: int, v: int, m: int, beta: float = 0.05, eps_grid=GDP_EPS_GRID,
                            mu_max: float = 20.0) -> float:
    """A Gaussian-DP lower bound mu_hat at confidence 1 - ``beta`` from the same guesses as
    :func:`steinke_epsilon_lower_bound`: the largest mu that the observation rejects.

    Why it is valid: a mu-GDP mechanism is (eps, delta_mu(eps))-DP for every eps at once
    (:func:`gaussian_delta`), so Steinke's theorem holds at each eps of the grid with
    delta = delta_mu(eps); mu is rejected when the smallest of those p-values, times the grid's
    size (Bonferroni), is below ``beta``. The p-values grow with mu, so mu_hat is found by
    bisection. Looser than a dedicated f-DP analysis (Mahloujifar et al. 2025), never invalid."""
    if not 0 < beta < 1:
        raise ValueError(f"beta must be in (0, 1), got {beta}")
    grid = tuple(float(e) for e in eps_grid)

    def rejected(mu: float) -> bool:
        p = min(steinke_p_value(e, r, v, m, gaussian_delta(mu, e)) for e in grid)
        return p * len(grid) < beta

    if r == 0 or not rejected(1e-6):
        return 0.0
    lo, hi = 0.0, float(mu_max)
    if rejected(hi):
        return hi
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if rejected(mid) else (lo, mid)
    return lo


@dataclass
class CanaryAudit:
    """Outcome of a one-run canary audit (guess counts fixed in advance)."""

    canaries: int
    guesses_in: int
    guesses_out: int
    correct: int
    delta: float
    confidence: float
    epsilon_lower_bound: float
    ceiling: float
    claimed_epsilon: Optional[float]

    @property
    def violated(self) -> bool:
        """True when the audit proves the claim false: eps_hat exceeds the claimed eps."""
        return self.claimed_epsilon is not None and self.epsilon_lower_bound > self.claimed_epsilon + 1e-9

    def as_dict(self) -> dict:
        return {**asdict(self), "violated": self.violated}


def canary_audit(scores, included, *, delta: float, guess_fraction: float = 0.1, beta: float = 0.05,
                 claimed_epsilon: Optional[float] = None) -> CanaryAudit:
    """Steinke et al.'s one-run audit from canary scores (larger = more likely included) and their
    inclusion coins: guess IN for the top ``guess_fraction`` of canaries and OUT for the bottom
    ``guess_fraction`` (fixed before looking), abstain on the rest, and bound eps from the number
    of correct guesses. Scores of several independent runs may be pooled: each (run, canary) pair
    is then one canary with its own coin, and m is the pooled count."""
    s = np.asarray(scores, dtype=float).ravel()
    inc = np.asarray(included, dtype=bool).ravel()
    if s.shape != inc.shape:
        raise ValueError(f"{s.size} scores but {inc.size} inclusion coins")
    m = s.size
    if not 0 < guess_fraction <= 0.5:
        raise ValueError(f"guess_fraction must be in (0, 0.5], got {guess_fraction}")
    k = int(math.floor(guess_fraction * m))
    order = np.argsort(s, kind="stable")
    guess_out, guess_in = order[:k], order[m - k:] if k else order[:0]
    correct = int(inc[guess_in].sum() + (~inc[guess_out]).sum())
    eps_hat = steinke_epsilon_lower_bound(2 * k, correct, m, delta, beta)
    return CanaryAudit(canaries=m, guesses_in=k, guesses_out=k, correct=correct, delta=delta, confidence=1 - beta,
                       epsilon_lower_bound=eps_hat, ceiling=steinke_ceiling(m, delta, beta, guesses=2 * k),
                       claimed_epsilon=claimed_epsilon)
