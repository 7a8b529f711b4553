"""Membership-inference attacks and their metrics, as pure functions over logits.

Nothing here knows about models, torch or Flower: every attack takes arrays of logits (or signals
derived from them), true labels and the membership of each (run, example) pair, and returns one
score per example of the target run, larger = more likely a member. The command that trains the
runs (``fedpower_app.audit.membership``, ``fedpower-audit``) sits apart.

Notation (docs/privacy.md §10 and ``../shared/docs/mia-notes.md`` §1): R runs were trained with
independent Bernoulli(1/2) membership coins ``keep[r, i]`` over an audit pool of n examples; a
population set Z is a member of no run. Each run is attacked in turn as the *target*, with the other
R - 1 runs as *reference* models (leave-one-out). Scores of all targets are pooled before the ROC.

Attacks (all evaluated by sweeping the threshold, never at a single tuned threshold):

* ``loss``        Yeom et al. 2018: s = -loss_T(x).
* ``calibration`` Watson et al. 2022: s = phi_T(x) - mean over OUT references of phi_j(x).
* ``lira-online`` / ``lira-offline``  Carlini et al. 2022 with a fixed (pooled) variance, on the
  logit-scaled confidence phi = z_y - logsumexp_{j != y} z_j.
* ``rmia-online`` / ``rmia-offline``  Zarifzadeh et al. 2024 with gamma = 1.
* ``shadow``      Shokri et al. 2017: one logistic-regression attack model per class, trained on the
  reference runs' (features, membership) and applied to the target.

Metrics: ROC, AUC, TPR at a fixed FPR (the last ROC point with FPR <= alpha), balanced accuracy
(the paper's "success rate", max over thresholds of (TPR + 1 - FPR) / 2), bootstrap CIs over
targets, and the DP ceiling TPR <= min over delta of e^eps(delta) * FPR + delta.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np
from scipy import special, stats

__all__ = [
    "ATTACKS",
    "signals",
    "loss_scores",
    "calibration_scores",
    "lira_online_scores",
    "lira_offline_scores",
    "rmia_scores",
    "tune_rmia_offline_a",
    "shadow_scores",
    "roc",
    "auc",
    "tpr_at_fpr",
    "balanced_accuracy",
    "AttackMetrics",
    "attack_metrics",
    "leave_one_out_scores",
    "dp_tpr_ceiling",
    "MIN_NONMEMBERS_PER_FPR",
]

# TPR at FPR alpha rests on about alpha * n_out false positives; below ~20 it is noise.
MIN_NONMEMBERS_PER_FPR = 20.0


# ------------------------------------------------------------------------------------------------
# Signals
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Signals:
    """Per-(run, example) signals from logits of shape (..., C) and labels (...,)."""

    phi: np.ndarray   # logit-scaled confidence z_y - logsumexp_{j != y} z_j (near Gaussian)
    loss: np.ndarray  # cross-entropy -log p_y
    prob: np.ndarray  # p_y, softmax probability of the true label


def signals(logits: np.ndarray, labels: np.ndarray) -> Signals:
    """phi, loss and p_y, computed stably in float64 (phi without ever forming 1 - p_y)."""
    z = np.asarray(logits, dtype=np.float64)
    y = np.asarray(labels, dtype=np.int64)
    if z.ndim < 2 or z.shape[-1] < 2:
        raise ValueError(f"logits must have shape (..., C) with C >= 2, got {z.shape}")
    y = np.broadcast_to(y, z.shape[:-1])
    if y.size and (y.min() < 0 or y.max() >= z.shape[-1]):
        raise ValueError(f"labels must lie in [0, {z.shape[-1]}), got {y.min()}..{y.max()}")
    z_y = np.take_along_axis(z, y[..., None], axis=-1)[..., 0]
    others = z.copy()
    np.put_along_axis(others, y[..., None], -np.inf, axis=-1)
    lse_others = special.logsumexp(others, axis=-1)
    lse_all = special.logsumexp(z, axis=-1)
    loss = lse_all - z_y
    return Signals(phi=z_y - lse_others, loss=loss, prob=np.exp(-loss))


# ------------------------------------------------------------------------------------------------
# Attacks. Arrays: target signal (n,), reference signals (M, n), reference membership (M, n) bool.
# ------------------------------------------------------------------------------------------------

def loss_scores(loss_target: np.ndarray) -> np.ndarray:
    """Yeom et al.: members have lower loss."""
    return -np.asarray(loss_target, dtype=np.float64)


def _masked_mean(values: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Column means of ``values`` over rows where ``mask``; count of such rows (NaN where zero)."""
    count = mask.sum(axis=0)
    total = np.where(mask, values, 0.0).sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / np.maximum(count, 1), np.nan), count


def calibration_scores(phi_target: np.ndarray, phi_refs: np.ndarray, keep_refs: np.ndarray) -> np.ndarray:
    """Watson et al.: the target's phi minus the mean phi of the references that did NOT train on x
    (falls back to the mean of all references for an example no reference left out)."""
    phi_refs = np.asarray(phi_refs, dtype=np.float64)
    keep_refs = np.asarray(keep_refs, dtype=bool)
    mean_out, _ = _masked_mean(phi_refs, ~keep_refs)
    mean_out = np.where(np.isnan(mean_out), phi_refs.mean(axis=0), mean_out)
    return np.asarray(phi_target, dtype=np.float64) - mean_out


def _lira_fit(phi_refs: np.ndarray, keep_refs: np.ndarray):
    """Per-example IN/OUT means and one pooled (fixed) standard deviation per side.

    An example with no IN (or OUT) reference gets the other side's mean shifted by the average
    IN - OUT gap over the examples that have both (few references make this common: with M = 3,
    one example in 8 has no IN reference)."""
    phi_refs = np.asarray(phi_refs, dtype=np.float64)
    keep_refs = np.asarray(keep_refs, dtype=bool)
    mu_in, n_in = _masked_mean(phi_refs, keep_refs)
    mu_out, n_out = _masked_mean(phi_refs, ~keep_refs)
    both = (n_in > 0) & (n_out > 0)
    gap = float(np.mean(mu_in[both] - mu_out[both])) if both.any() else 0.0
    mu_in = np.where(n_in > 0, mu_in, mu_out + gap)
    mu_out = np.where(n_out > 0, mu_out, mu_in - gap)
    # Fixed variance (Carlini et al. §VI-B; TF-Privacy fix_variance): residuals pooled over examples.
    res_in = np.where(keep_refs, phi_refs - mu_in, np.nan)
    res_out = np.where(~keep_refs, phi_refs - mu_out, np.nan)
    all_res = np.concatenate([res_in[~np.isnan(res_in)], res_out[~np.isnan(res_out)]])
    fallback = float(np.std(all_res)) if all_res.size > 1 else 1.0
    sd_in = float(np.nanstd(res_in)) if np.sum(~np.isnan(res_in)) > 1 else fallback
    sd_out = float(np.nanstd(res_out)) if np.sum(~np.isnan(res_out)) > 1 else fallback
    floor = 1e-6
    return mu_in, mu_out, max(sd_in, floor), max(sd_out, floor)


def lira_online_scores(phi_target: np.ndarray, phi_refs: np.ndarray, keep_refs: np.ndarray) -> np.ndarray:
    """Likelihood ratio of the target's phi under N(mu_in, s_in^2) vs N(mu_out, s_out^2)."""
    mu_in, mu_out, sd_in, sd_out = _lira_fit(phi_refs, keep_refs)
    x = np.asarray(phi_target, dtype=np.float64)
    return stats.norm.logpdf(x, mu_in, sd_in) - stats.norm.logpdf(x, mu_out, sd_out)


def lira_offline_scores(phi_target: np.ndarray, phi_refs: np.ndarray, keep_refs: np.ndarray) -> np.ndarray:
    """One-sided offline test: log Phi((phi_T - mu_out) / s_out), using OUT references only."""
    phi_refs = np.asarray(phi_refs, dtype=np.float64)
    keep_refs = np.asarray(keep_refs, dtype=bool)
    mu_out, n_out = _masked_mean(phi_refs, ~keep_refs)
    mu_out = np.where(n_out > 0, mu_out, np.nanmean(np.where(~keep_refs, phi_refs, np.nan)))
    res = np.where(~keep_refs, phi_refs - mu_out, np.nan)
    sd_out = max(float(np.nanstd(res)), 1e-6) if np.sum(~np.isnan(res)) > 1 else 1.0
    return stats.norm.logcdf((np.asarray(phi_target, dtype=np.float64) - mu_out) / sd_out)


def _rmia_prob_x(p_refs: np.ndarray, keep_refs: np.ndarray | None, offline_a: float | None) -> np.ndarray:
    """Pr(x): online, the mean of p_y over all references; offline, the linear approximation
    1/2 [(1 + a) mean_OUT p_y + (1 - a)] from OUT references only."""
    p_refs = np.asarray(p_refs, dtype=np.float64)
    if offline_a is None:
        return p_refs.mean(axis=0)
    if keep_refs is None:  # population points are OUT for every reference
        mean_out = p_refs.mean(axis=0)
    else:
        mean_out, n_out = _masked_mean(p_refs, ~np.asarray(keep_refs, dtype=bool))
        mean_out = np.where(n_out > 0, mean_out, p_refs.mean(axis=0))
    return 0.5 * ((1.0 + offline_a) * mean_out + (1.0 - offline_a))


def rmia_scores(p_target: np.ndarray, p_refs: np.ndarray, keep_refs: np.ndarray,
                p_target_pop: np.ndarray, p_refs_pop: np.ndarray, *, offline_a: float | None = None,
                gamma: float = 1.0) -> np.ndarray:
    """RMIA: the fraction of population points z with LR(x, z) = [p_T(x)/Pr(x)] / [p_T(z)/Pr(z)] > gamma.

    ``offline_a`` None is the online attack (all references); a number in [0, 1] the offline one."""
    tiny = 1e-300
    ratio_x = np.asarray(p_target, dtype=np.float64) / np.maximum(_rmia_prob_x(p_refs, keep_refs, offline_a), tiny)
    ratio_z = np.asarray(p_target_pop, dtype=np.float64) / np.maximum(_rmia_prob_x(p_refs_pop, None, offline_a), tiny)
    ratio_z = np.sort(ratio_z)
    if ratio_z.size == 0:
        raise ValueError("RMIA needs a non-empty population set")
    # LR(x, z) > gamma  <=>  ratio_z < ratio_x / gamma
    return np.searchsorted(ratio_z, ratio_x / gamma, side="left") / ratio_z.size


def tune_rmia_offline_a(p_refs: np.ndarray, keep_refs: np.ndarray, p_refs_pop: np.ndarray,
                        grid: Sequence[float] = tuple(np.round(np.linspace(0, 1, 11), 2)),
                        max_targets: int = 4) -> float:
    """Choose RMIA's offline ``a`` by attacking reference models with the other references (never the
    target): the a with the best mean AUC over up to ``max_targets`` pseudo-targets."""
    p_refs = np.asarray(p_refs, dtype=np.float64)
    keep_refs = np.asarray(keep_refs, dtype=bool)
    m = p_refs.shape[0]
    if m < 2:
        return 0.3  # Privacy Meter's default for one reference
    best_a, best_auc = float(grid[0]), -1.0
    for a in grid:
        aucs = []
        for j in range(min(m, max_targets)):
            others = [k for k in range(m) if k != j]
            s = rmia_scores(p_refs[j], p_refs[others], keep_refs[others], p_refs_pop[j], p_refs_pop[others],
                            offline_a=float(a))
            aucs.append(auc(s, keep_refs[j]))
        mean_auc = float(np.mean(aucs))
        if mean_auc > best_auc + 1e-12:
            best_a, best_auc = float(a), mean_auc
    return best_a


def _shadow_features(sig: Signals, logits: np.ndarray) -> np.ndarray:
    """Features of one (model, example): [phi, loss, p_y, entropy of the softmax]."""
    z = np.asarray(logits, dtype=np.float64)
    logp = z - special.logsumexp(z, axis=-1, keepdims=True)
    entropy = -(np.exp(logp) * logp).sum(axis=-1)
    return np.stack([sig.phi, sig.loss, sig.prob, entropy], axis=-1)


def shadow_scores(logits_target: np.ndarray, logits_refs: np.ndarray, labels: np.ndarray,
                  keep_refs: np.ndarray, *, seed: int = 0) -> np.ndarray:
    """Shokri et al.: per class y, a logistic-regression attack model trained on the reference runs'
    features with their known membership; the score is its P(member) on the target's features."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    labels = np.asarray(labels, dtype=np.int64)
    keep_refs = np.asarray(keep_refs, dtype=bool)
    m, n = keep_refs.shape
    f_target = _shadow_features(signals(logits_target, labels), logits_target)
    f_refs = _shadow_features(signals(logits_refs, labels[None, :]), logits_refs)
    out = np.full(n, 0.5)
    for y in np.unique(labels):
        cols = labels == y
        x = f_refs[:, cols].reshape(-1, f_refs.shape[-1])
        t = keep_refs[:, cols].reshape(-1)
        if t.all() or not t.any():
            continue  # one-sided training data: no information, keep 0.5
        clf = make_pipeline(StandardScaler(), LogisticRegression(max_iter=1000, random_state=seed))
        clf.fit(x, t)
        out[cols] = clf.predict_proba(f_target[cols])[:, 1]
    return out


# ------------------------------------------------------------------------------------------------
# Metrics
# ------------------------------------------------------------------------------------------------

def roc(scores: np.ndarray, members: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(fpr, tpr) over all thresholds, from (0, 0) to (1, 1); ties are one point."""
    from sklearn.metrics import roc_curve

    members = np.asarray(members, dtype=bool)
    if members.all() or not members.any():
        raise ValueError("a ROC needs both members and non-members")
    fpr, tpr, _ = roc_curve(members.astype(int), np.asarray(scores, dtype=np.float64), drop_intermediate=False)
    return fpr, tpr


def auc(scores: np.ndarray, members: np.ndarray) -> float:
    """Area under the ROC = P(score of a member > score of a non-member) (+ half the ties)."""
    members = np.asarray(members, dtype=bool)
    s = np.asarray(scores, dtype=np.float64)
    ranks = stats.rankdata(s)
    n_in, n_out = int(members.sum()), int((~members).sum())
    if n_in == 0 or n_out == 0:
        raise ValueError("AUC needs both members and non-members")
    return float((ranks[members].sum() - n_in * (n_in + 1) / 2) / (n_in * n_out))


def tpr_at_fpr(fpr: np.ndarray, tpr: np.ndarray, alpha: float) -> float:
    """The TPR of the last ROC point whose FPR is at most ``alpha`` (Privacy Meter's convention)."""
    ok = np.asarray(fpr) <= alpha + 1e-15
    return float(np.max(np.asarray(tpr)[ok])) if ok.any() else 0.0


def balanced_accuracy(fpr: np.ndarray, tpr: np.ndarray) -> float:
    """max over thresholds of (TPR + 1 - FPR) / 2: the paper's attack "success rate" on a balanced set."""
    return float(np.max((np.asarray(tpr) + 1.0 - np.asarray(fpr)) / 2.0))


@dataclass
class AttackMetrics:
    attack: str
    auc: float
    auc_ci: tuple[float, float]
    tpr_at_1pct: float
    tpr_at_1pct_ci: tuple[float, float]
    tpr_at_01pct: float
    tpr_at_01pct_ci: tuple[float, float]
    tpr_at_01pct_low_count: bool  # fewer than ~20 false positives behind it
    balanced_accuracy: float
    balanced_accuracy_ci: tuple[float, float]
    members: int
    nonmembers: int
    fpr: np.ndarray
    tpr: np.ndarray

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k not in ("fpr", "tpr")}
        for k, v in list(d.items()):
            if isinstance(v, tuple):
                d[k] = [float(x) for x in v]
        return d


def _point_metrics(scores: np.ndarray, members: np.ndarray) -> tuple[float, float, float, float]:
    fpr, tpr = roc(scores, members)
    return auc(scores, members), tpr_at_fpr(fpr, tpr, 0.01), tpr_at_fpr(fpr, tpr, 0.001), balanced_accuracy(fpr, tpr)


def attack_metrics(attack: str, scores_per_target: Sequence[np.ndarray], members_per_target: Sequence[np.ndarray],
                   *, bootstrap: int = 200, confidence: float = 0.95, seed: int = 0) -> AttackMetrics:
    """Metrics of scores pooled over targets, with percentile bootstrap CIs that resample *targets*
    (the unit that is independent: one trained run)."""
    scores = [np.asarray(s, dtype=np.float64) for s in scores_per_target]
    members = [np.asarray(m, dtype=bool) for m in members_per_target]
    s_all, m_all = np.concatenate(scores), np.concatenate(members)
    point = _point_metrics(s_all, m_all)
    fpr, tpr = roc(s_all, m_all)
    rng = np.random.default_rng(seed)
    boots = []
    k = len(scores)
    for _ in range(bootstrap if k > 1 else 0):
        pick = rng.integers(0, k, size=k)
        sb, mb = np.concatenate([scores[i] for i in pick]), np.concatenate([members[i] for i in pick])
        if mb.all() or not mb.any():
            continue
        boots.append(_point_metrics(sb, mb))
    lo_q, hi_q = (1 - confidence) / 2, 1 - (1 - confidence) / 2
    if boots:
        b = np.asarray(boots)
        cis = [(float(np.quantile(b[:, j], lo_q)), float(np.quantile(b[:, j], hi_q))) for j in range(4)]
    else:
        cis = [(float("nan"), float("nan"))] * 4
    n_out = int((~m_all).sum())
    return AttackMetrics(attack=attack, auc=point[0], auc_ci=cis[0], tpr_at_1pct=point[1], tpr_at_1pct_ci=cis[1],
                         tpr_at_01pct=point[2], tpr_at_01pct_ci=cis[2],
                         tpr_at_01pct_low_count=n_out * 0.001 < MIN_NONMEMBERS_PER_FPR,
                         balanced_accuracy=point[3], balanced_accuracy_ci=cis[3],
                         members=int(m_all.sum()), nonmembers=n_out, fpr=fpr, tpr=tpr)


# ------------------------------------------------------------------------------------------------
# Leave-one-out over R runs
# ------------------------------------------------------------------------------------------------

ATTACKS = ("loss", "calibration", "shadow", "lira-online", "lira-offline", "rmia-online", "rmia-offline")


def leave_one_out_scores(logits: np.ndarray, labels: np.ndarray, keep: np.ndarray,
                         logits_pop: np.ndarray, labels_pop: np.ndarray,
                         attacks: Iterable[str] = ATTACKS, *, seed: int = 0) -> dict[str, list[np.ndarray]]:
    """Scores of every attack for every run as target, the other runs as references.

    logits (R, n, C) on the audit pool, labels (n,), keep (R, n) bool; logits_pop (R, nz, C) on the
    population set with labels_pop (nz,). Returns {attack: [scores of target 0, ..., target R-1]}."""
    logits = np.asarray(logits, dtype=np.float64)
    keep = np.asarray(keep, dtype=bool)
    r = logits.shape[0]
    if r < 2:
        raise ValueError("leave-one-out attacks need at least 2 runs")
    if keep.shape != logits.shape[:2]:
        raise ValueError(f"keep has shape {keep.shape}, logits {logits.shape}")
    attacks = list(attacks)
    unknown = [a for a in attacks if a not in ATTACKS]
    if unknown:
        raise ValueError(f"unknown attack(s) {unknown}: use {', '.join(ATTACKS)}")
    sig = signals(logits, np.asarray(labels)[None, :])
    sig_pop = signals(np.asarray(logits_pop, dtype=np.float64), np.asarray(labels_pop)[None, :])
    out: dict[str, list[np.ndarray]] = {a: [] for a in attacks}
    for t in range(r):
        refs = [j for j in range(r) if j != t]
        kr = keep[refs]
        for a in attacks:
            if a == "loss":
                s = loss_scores(sig.loss[t])
            elif a == "calibration":
                s = calibration_scores(sig.phi[t], sig.phi[refs], kr)
            elif a == "lira-online":
                s = lira_online_scores(sig.phi[t], sig.phi[refs], kr)
            elif a == "lira-offline":
                s = lira_offline_scores(sig.phi[t], sig.phi[refs], kr)
            elif a == "rmia-online":
                s = rmia_scores(sig.prob[t], sig.prob[refs], kr, sig_pop.prob[t], sig_pop.prob[refs])
            elif a == "rmia-offline":
                a_off = tune_rmia_offline_a(sig.prob[refs], kr, sig_pop.prob[refs])
                s = rmia_scores(sig.prob[t], sig.prob[refs], kr, sig_pop.prob[t], sig_pop.prob[refs], offline_a=a_off)
            else:  # shadow
                s = shadow_scores(logits[t], logits[refs], labels, kr, seed=seed)
            out[a].append(np.asarray(s, dtype=np.float64))
    return out


# ------------------------------------------------------------------------------------------------
# The DP ceiling on any attack's ROC
# ------------------------------------------------------------------------------------------------

def dp_tpr_ceiling(fpr: np.ndarray, eps_of_delta: Mapping[float, float] | Sequence[tuple[float, float]]) -> np.ndarray:
    """The largest TPR any test can reach at each FPR against an (eps(delta), delta)-DP mechanism,
    for every (delta, eps) point of the accountant's curve:

        TPR <= min over delta of min(e^eps * FPR + delta,  1 - e^-eps * (1 - delta - FPR))

    (both hypothesis-testing constraints of (eps, delta)-DP, Kairouz et al. 2015)."""
    pairs = list(eps_of_delta.items()) if isinstance(eps_of_delta, Mapping) else list(eps_of_delta)
    if not pairs:
        raise ValueError("the eps(delta) curve is empty")
    x = np.clip(np.asarray(fpr, dtype=np.float64), 0.0, 1.0)
    best = np.ones_like(x)
    for delta, eps in pairs:
        if not (math.isfinite(eps) and 0 <= delta <= 1):
            continue
        a = np.exp(eps) * x + delta
        b = 1.0 - np.exp(-eps) * (1.0 - delta - x)
        best = np.minimum(best, np.minimum(a, b))
    return np.clip(best, x, 1.0)  # never below chance: TPR = FPR is always reachable
