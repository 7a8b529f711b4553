"""One-run f-DP audit bound (Mahloujifar, Melis & Chaudhuri, "Auditing f-Differential Privacy in One
Run", ICML 2025 / PMLR 267:42615-42641, arXiv:2410.22235).

Setting (the same one as :func:`fedpower_app.audit.bounds.steinke_p_value`): each of m canaries is
included by its own fair coin S_j in {0, 1}; the mechanism is run once and produces Y; the auditor
reads Y and makes exactly r guesses fixed in number in advance (here: IN for the top k scores, OUT for
the bottom k, abstain on the rest, r = 2k), and C of them are right. We want an upper bound on
P[C >= v] that holds for EVERY mechanism that is f-DP with respect to each canary's inclusion. Steinke
et al. (2023) do this for (eps, delta)-DP; Mahloujifar et al. use the whole tradeoff curve f, which is
much tighter when the mechanism's true curve has the shape of f (Gaussian / DP-SGD curves). In
particular a run in which every guess is right refutes larger mu (and eps) than Steinke's bound can.

Notation. A tradeoff function f: [0, 1] -> [0, 1] (convex, continuous, non-increasing,
f(a) <= 1 - a) gives the "blow-up" g(x) = 1 - f(x) (concave, non-decreasing) and its inverse
g^-1(y) = inf{x : g(x) >= y} = f^-1(1 - y), which equals f(1 - y) for a symmetric f (Gaussian curves,
privacy-profile curves). mu-GDP is f = G_mu, G_mu(a) = Phi(Phi^-1(1 - a) - mu), and then
g^-1(y) = Phi(Phi^-1(y) - mu). "f-DP with respect to canary j" means: for every value s of the other
coins, the laws P1 = Y | (S_j = 1, s) and P0 = Y | (S_j = 0, s) satisfy T(P0, P1) >= f and
T(P1, P0) >= f (the usual symmetric neighbouring relation), i.e. for every event E of (Y, s)::

    P1(E) <= g(P0(E))   and   P0(E) <= g(P1(E)).                                          (1)

Lemma (recursive constraints). Let W = r - C be the number of wrong guesses and, for i >= 0,
a_i = E[C 1{C >= i}] / m and b_i = E[W 1{C >= i}] / m. Then for every i >= 1::

    a_i <= g(b_{i-1}).                                                                    (2)

Proof. Fix j and the other coins s; C_{-j}, the number of right guesses on the other canaries, is a
function of (Y, s). Let E_in = {guess j = IN, C_{-j} >= i - 1} and E_out = {guess j = OUT,
C_{-j} >= i - 1}. If S_j = 1, E_in means "j right and C >= i"; if S_j = 0 it means "j wrong and
C >= i - 1" (C = C_{-j} when j is wrong); symmetrically for E_out. So, with (1) and concavity of g,
P[j right, C >= i | s] = (P1(E_in) + P0(E_out)) / 2 <= (g(P0(E_in)) + g(P1(E_out))) / 2
<= g((P0(E_in) + P1(E_out)) / 2) = g(P[j wrong, C >= i - 1 | s]). Averaging over s and over the m
canaries (abstained canaries contribute 0 <= g(0)) and using Jensen's inequality once more gives
sum_j P[j right, C >= i] / m <= g(sum_j P[j wrong, C >= i - 1] / m), which is (2). []

Theorem (the bound computed here; the recursion is the paper's algorithm, as implemented in
``jax_privacy.auditing._epsilon_one_run_fdp`` -- "audit_rh_with_cap" in arXiv:2410.22235 -- which we
extend to two-sided guesses; the paper body could not be retrieved offline, so equation and algorithm
numbers are not quoted). For tau in (0, 1] run::

    a = tau v / m ;  b = tau (r - v) / m
    for i = v - 1, v - 2, ..., 0:
        b_new = max(b, g^-1(a));  a = a + i / (r - i) * (b_new - b);  b = b_new

If the final a + b > r / m, then P[C >= v] < tau for every mechanism satisfying (1). Hence
p(v) = sup{tau : final a + b <= r / m} bounds P[C >= v], and "reject f-DP when p(v) < beta" (or,
equivalently up to bisection accuracy, when tau = beta ends with a + b > r / m) is a level-beta test.

Proof. Let pi_c = P[C = c]. a_i = sum_{c >= i} c pi_c / m and b_i = sum_{c >= i} (r - c) pi_c / m;
only the constraints (2) for i = 1..v are used. (i) Moving mass from a level c > v down to v lowers
every a_i and raises every b_{i-1} (i <= v), so (2) still holds; moving mass above tau at level v down
to v - 1 lowers a_i (i <= v) and raises b_i (i <= v - 1), ditto. So if P[C >= v] >= tau there is a
law on {0..v} with mass exactly tau at v, total mass 1, satisfying (2) for i = 1..v. (ii) The
recursion builds the law pi^g on {0..v} with pi^g_v = tau in which each level i < v gets the least
mass making (2) hold at level i + 1 given the levels above (a level-i unit adds i/m to a and
(r - i)/m to b). Take the highest level i where a feasible law from (i) differs from pi^g: the levels
above agree, so its mass there is larger; move the excess to i - 1, which keeps (2) at i + 1 (b_i is
now the greedy value) and at every lower level (a decreases, b increases). Repeating, the feasible law
dominates pi^g level by level down to level 0, so sum_c pi^g_c <= 1, i.e. the final
a + b = (r / m) sum_c pi^g_c <= r / m. The contrapositive is the theorem. The same argument shows
feasibility is monotone in tau (p(v) is a bisection threshold) and, since G_mu decreases in mu, that
"mu-GDP rejected" is monotone in mu (mu_hat is a bisection threshold). []

Numerics and validity. Every approximation errs on the side of NOT rejecting: the recursion may stop
early (a and b only grow, so a truncated run under-states a + b; it stops exactly when b stops moving
or a + b already exceeds r / m), rejection needs a + b > (r / m)(1 + 1e-9), the p-value is the upper
end of its bisection bracket, mu_hat the lower end of its, and a generic f (a plain callable) is
inverted on a grid and looked up from below (g^-1 under-stated). No Monte-Carlo, no asymptotics.

Complexity. One feasibility check is at most v sequential steps, each a few numpy ufunc calls on a
batch of candidate taus or mus (~5 us per step for a batch of 48; ``fdp_rejects`` with a Gaussian f
uses a scalar loop, ~0.6 us per step). The p-value and mu_hat take <= 5 batched passes, so a call is
O(v) steps: worst case ~3 s at v = 100,000, in practice milliseconds (measured <= 0.25 s over random
(r, v) at m = 100,000; 0.75 s for a 2,001-point profile curve at r = v = m = 100,000) because the
recursion stops as soon as b freezes or a + b exceeds r / m. Memory O(batch).

Tightness (measured, tests/test_fdp_bound.py). For eps-DP randomized response, the extremal
mechanism for which P[C >= v] = P[Bin(r, e^eps/(1+e^eps)) >= v] exactly, the p-value is within
1.0001-1.8x of that exact tail (Steinke's bound is exact there); the exact size of the level-0.05 test
is 0.040 (eps = 1, m = r = 1000) and 0.032 (eps = 3, m = 2000, r = 400). On Gaussian one-run audits
(top/bottom 10 %) mu_hat recovers ~65 % of mu, ~1.7x Steinke's GDP bound on the same guesses.

Scope. ``fdp_epsilon_lower_bound`` is the paper's *empirical epsilon*: the eps at delta of the
Gaussian curve mu_hat. It refutes an eps claim read as "the mechanism is mu-GDP with the mu whose
(eps, delta) is the claim" (how DP-SGD curves are usually summarised), not an arbitrary
(eps, delta)-DP claim; to refute an accountant's whole privacy profile (eps, delta(eps)) audit that
profile directly with ``fdp_rejects(profile_tradeoff(eps_grid, delta_grid), r, v, m, beta)``.

Pure numpy + scipy (no torch).
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
from scipy import special

from .bounds import gaussian_delta, gaussian_epsilon

__all__ = [
    "GaussianTradeoff",
    "ProfileTradeoff",
    "gdp_tradeoff",
    "profile_tradeoff",
    "fdp_p_value",
    "fdp_rejects",
    "fdp_gdp_lower_bound",
    "fdp_epsilon_lower_bound",
]

#: A run rejects only if its final a + b exceeds r / m by this relative margin (float safety).
_REJECT_RTOL = 1e-9
#: Candidates evaluated per bisection pass (one batched recursion per pass).
_BATCH = 48
#: How often (in steps) the batched recursion checks whether it can stop.
_CHECK_EVERY = 16
_SQRT2 = math.sqrt(2.0)


# --------------------------------------------------------------------------------------------
# Tradeoff functions
# --------------------------------------------------------------------------------------------


class GaussianTradeoff:
    """The mu-GDP tradeoff curve G_mu(a) = Phi(Phi^-1(1 - a) - mu) (Dong, Roth & Su 2022).

    Callable on floats or numpy arrays. ``mu`` may itself be an array (one curve per entry, broadcast
    against the argument), which the bisections use to test many mu at once.
    """

    def __init__(self, mu):
        mu_arr = np.asarray(mu, dtype=float)
        if np.any(np.isnan(mu_arr)) or np.any(mu_arr < 0):
            raise ValueError(f"mu must be >= 0, got {mu}")
        self.mu = mu_arr if mu_arr.ndim else float(mu_arr)

    def __call__(self, alpha):
        a = np.clip(np.asarray(alpha, dtype=float), 0.0, 1.0)
        # Phi^-1(1 - a) = -Phi^-1(a), accurate for small a.
        out = special.ndtr(-special.ndtri(a) - self.mu)
        return float(out) if np.ndim(out) == 0 else out

    def inverse_blowup(self, y):
        """g^-1(y) = inf{x : 1 - G_mu(x) >= y} = Phi(Phi^-1(y) - mu) (vectorised)."""
        return special.ndtr(special.ndtri(np.clip(y, 0.0, 1.0)) - self.mu)

    def inverse_blowup_scalar(self, y: float) -> float:
        """Scalar g^-1 for the fast single-hypothesis loop (requires a scalar mu)."""
        z = float(special.ndtri(min(max(y, 0.0), 1.0)))
        return 0.5 * math.erfc(-(z - self.mu) / _SQRT2)

    def __repr__(self) -> str:
        return f"GaussianTradeoff(mu={self.mu!r})"


class ProfileTradeoff:
    """Tradeoff curve implied by a privacy profile: the mechanism is (eps_j, delta_j)-DP for every j.

    (eps, delta)-DP is equivalent to f_{eps,delta}-DP with
    f_{eps,delta}(a) = max(0, 1 - delta - e^eps a, e^-eps (1 - delta - a)) (Kairouz et al. 2015; Dong,
    Roth & Su 2022, Prop. 2.5), and being f_j-DP for all j implies max_j f_j-DP, so the curve is
    f(a) = max_j f_{eps_j, delta_j}(a): convex, symmetric, a valid (generally conservative) curve for
    the whole profile. A dense grid of a Gaussian profile recovers G_mu.
    """

    def __init__(self, epsilons, deltas):
        eps = np.asarray(epsilons, dtype=float).ravel()
        dl = np.asarray(deltas, dtype=float).ravel()
        if eps.size == 0 or eps.shape != dl.shape:
            raise ValueError(f"need matching non-empty eps/delta grids, got {eps.size} and {dl.size}")
        if np.any(np.isnan(eps)) or np.any(eps < 0):
            raise ValueError("epsilons must be >= 0")
        if np.any(np.isnan(dl)) or np.any(dl < 0) or np.any(dl > 1):
            raise ValueError("deltas must be in [0, 1]")
        keep = dl < 1  # delta = 1 says nothing
        if not np.any(keep):
            eps, dl = np.zeros(1), np.ones(1)
        else:
            eps, dl = eps[keep], dl[keep]
        self.epsilons = eps
        self.deltas = dl
        with np.errstate(over="ignore"):
            self._e = np.exp(eps)  # may be inf for eps > 709: handled below
        self._einv = np.exp(-eps)
        self._one_minus_delta = 1.0 - dl

    def __call__(self, alpha, _chunk: int = 4096):
        a = np.clip(np.asarray(alpha, dtype=float), 0.0, 1.0)
        flat = a.ravel()
        out = np.empty_like(flat)
        for s in range(0, flat.size, _chunk):
            x = flat[s:s + _chunk, None]
            with np.errstate(invalid="ignore", over="ignore"):
                t1 = np.where(x > 0, self._one_minus_delta - self._e * x, self._one_minus_delta)
            t2 = self._einv * (self._one_minus_delta - x)
            out[s:s + _chunk] = np.maximum(np.maximum(t1.max(axis=1), t2.max(axis=1)), 0.0)
        out = out.reshape(a.shape)
        return float(out) if out.ndim == 0 else out

    def inverse_blowup(self, y, _chunk: int = 4096):
        """g^-1(y) = f^-1(1 - y) = f(1 - y) (the curve is symmetric, f^-1 = f), evaluated without
        forming 1 - y: max_j max(0, e^eps_j y - expm1(eps_j) - delta_j, e^-eps_j (y - delta_j))."""
        yy = np.clip(np.asarray(y, dtype=float), 0.0, 1.0)
        flat = yy.ravel()
        out = np.empty_like(flat)
        with np.errstate(over="ignore", invalid="ignore"):
            em1 = np.expm1(self.epsilons)
        for s in range(0, flat.size, _chunk):
            x = flat[s:s + _chunk, None]
            with np.errstate(invalid="ignore", over="ignore"):
                # e^eps y - (e^eps - 1) - delta; for e^eps = inf the term is -inf unless y = 1
                t1 = np.where(x >= 1.0, 1.0 - self.deltas, self._e * x - em1 - self.deltas)
            t1 = np.nan_to_num(t1, nan=-np.inf)
            t2 = self._einv * (x - self.deltas)
            out[s:s + _chunk] = np.maximum(np.maximum(t1.max(axis=1), t2.max(axis=1)), 0.0)
        out = out.reshape(yy.shape)
        return float(out) if out.ndim == 0 else out

    def __repr__(self) -> str:
        return f"ProfileTradeoff({self.epsilons.size} points)"


def gdp_tradeoff(mu: float) -> GaussianTradeoff:
    """The mu-GDP tradeoff function f(a) = Phi(Phi^-1(1 - a) - mu), vectorised over numpy arrays.

    A mechanism is mu-GDP iff it is f-DP with this f; it is what a Gaussian mechanism of
    sensitivity / noise-std = mu achieves exactly, and what DP-SGD approaches (CLT of Dong et al.).
    """
    return GaussianTradeoff(mu)


def profile_tradeoff(epsilons, deltas) -> ProfileTradeoff:
    """The tradeoff curve implied by a privacy profile delta(eps) given on a grid.

    f(a) = max over the grid of max(0, 1 - delta - e^eps a, e^-eps (1 - delta - a)). A mechanism that is
    (eps, delta(eps))-DP at every grid point is f-DP (see :class:`ProfileTradeoff`), so a DP-SGD
    accountant's whole (eps, delta(eps)) curve can be audited as one f. Coarse grids give a smaller f
    (weaker claim, fewer rejections), never an invalid one.
    """
    return ProfileTradeoff(epsilons, deltas)


class _TabulatedInverse:
    """g^-1 of an arbitrary tradeoff callable, tabulated on a grid and read from below.

    g^-1(y) = inf{x : f(x) <= 1 - y} is non-decreasing, so for a query y the table value at the
    largest grid point <= y is a LOWER bound of g^-1(y) (weaker constraint, conservative), and the
    bisection keeps its lower end (also a lower bound). To absorb rounding in f near 1 the test is
    f(x) <= 1 - y + 1e-15 (again weaker), so queries below ~1e-15 get 0. Resolution: 0.12 % relative
    in y on [1e-15, 1] plus a uniform grid of step 2.5e-4. ``gdp_tradeoff``/``profile_tradeoff``
    have exact inverses and never come here.
    """

    def __init__(self, f: Callable):
        grid = np.unique(np.concatenate([[0.0], np.logspace(-15.0, 0.0, 30001), np.linspace(0.0, 1.0, 4001)]))
        target = (1.0 - grid) + 1e-15
        lo = np.zeros_like(grid)
        hi = np.ones_like(grid)
        done = np.asarray(f(lo), dtype=float) <= target  # g^-1 = 0 there
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            ok = np.asarray(f(mid), dtype=float) <= target
            hi = np.where(ok, mid, hi)
            lo = np.where(ok, lo, mid)
        table = np.where(done, 0.0, lo)
        self.grid = grid
        self.table = np.minimum.accumulate(table[::-1])[::-1]  # monotone from below: still a lower bound

    def inverse_blowup(self, y):
        y = np.clip(np.asarray(y, dtype=float), 0.0, 1.0)
        idx = np.searchsorted(self.grid, y, side="right") - 1
        return self.table[np.clip(idx, 0, self.grid.size - 1)]


def _inverse_of(f) -> Callable:
    """The vectorised g^-1 of a tradeoff function (closed form when known, else tabulated)."""
    inv = getattr(f, "inverse_blowup", None)
    if inv is not None:
        return inv
    if not callable(f):
        raise TypeError(f"f must be a tradeoff function (callable), got {type(f).__name__}")
    return _TabulatedInverse(f).inverse_blowup


# --------------------------------------------------------------------------------------------
# The recursion
# --------------------------------------------------------------------------------------------


def _check_counts(r: int, v: int, m: int) -> tuple[int, int, int]:
    r, v, m = int(r), int(v), int(m)
    if not (m >= 1 and 0 <= v <= r <= m):
        raise ValueError(f"need 0 <= v <= r <= m and m >= 1, got v={v}, r={r}, m={m}")
    return r, v, m


def _rejected_batch(ginv: Callable, r: int, v: int, m: int, tau) -> np.ndarray:
    """Run the Theorem's recursion for a batch (tau and/or the curve vary per entry).

    Returns a boolean array: True where the final a + b exceeds r / m, i.e. where "P[C >= v] >= tau"
    is impossible for the curve, so the f-DP hypothesis is rejected at level tau.
    """
    tau = np.atleast_1d(np.asarray(tau, dtype=float))
    a = tau * (v / m)
    shape = np.broadcast(a, np.asarray(ginv(np.minimum(a, 1.0)))).shape  # tau x curve batch
    a = np.array(np.broadcast_to(a, shape), dtype=float)
    b = np.array(np.broadcast_to(tau * ((r - v) / m), shape), dtype=float)
    limit = (r / m) * (1.0 + _REJECT_RTOL)
    bad = (a + b) > limit
    need = np.empty_like(a)
    step = 0
    for i in range(v - 1, -1, -1):
        need[...] = ginv(np.minimum(a, 1.0))
        np.subtract(need, b, out=need)  # need <- increment of b
        np.maximum(need, 0.0, out=need)
        b += need
        if i:
            a += (i / (r - i)) * need
        step += 1
        if step % _CHECK_EVERY == 0:
            bad |= (a + b) > limit
            # An entry whose b did not move at this step never moves again (a unchanged too).
            if not np.any((need > 0) & ~bad):
                break
    bad |= (a + b) > limit
    return bad


def _rejected_scalar(ginv_scalar: Callable[[float], float], r: int, v: int, m: int, tau: float) -> bool:
    """Scalar version of :func:`_rejected_batch` (same recursion, same stopping rules)."""
    a = tau * v / m
    b = tau * (r - v) / m
    limit = (r / m) * (1.0 + _REJECT_RTOL)
    if a + b > limit:
        return True
    for i in range(v - 1, -1, -1):
        need = ginv_scalar(a if a < 1.0 else 1.0)
        if need <= b:
            break  # b and a are frozen from here on
        a += (i / (r - i)) * (need - b)
        b = need
        if a + b > limit:
            return True
    return a + b > limit


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def fdp_rejects(f, r: int, v: int, m: int, beta: float = 0.05) -> bool:
    """Level-``beta`` test of the hypothesis "the mechanism is f-DP w.r.t. each canary's inclusion".

    True when the observation "v of r guesses right among m fair-coin canaries" has probability
    < ``beta`` under EVERY such mechanism, by the Theorem of the module docstring run at tau = beta
    (the recursion ends with a + b > r / m). Valid when r was fixed before looking at the output and
    the coins are independent and fair: then P[reject] <= P[C >= v_min] < beta where v_min is the
    smallest rejected count. ``f`` is :func:`gdp_tradeoff`, :func:`profile_tradeoff` or any
    vectorised tradeoff callable (tabulated conservatively).
    """
    r, v, m = _check_counts(r, v, m)
    if not 0 < beta < 1:
        raise ValueError(f"beta must be in (0, 1), got {beta}")
    if v == 0:
        return False
    if isinstance(f, GaussianTradeoff) and np.ndim(f.mu) == 0:
        return _rejected_scalar(f.inverse_blowup_scalar, r, v, m, float(beta))
    return bool(_rejected_batch(_inverse_of(f), r, v, m, beta)[0])


def fdp_p_value(f, r: int, v: int, m: int, rtol: float = 1e-4) -> float:
    """Upper bound on P[at least v of r guesses right] for ANY mechanism that is f-DP w.r.t. each of
    the m canaries' inclusion (each canary included by an independent fair coin; r fixed in advance).

    This is p(v) = sup{tau : the Theorem's recursion at tau ends with a + b <= r / m} (module
    docstring), found by batched bisection in log(tau) down to 1e-300, returning the upper end of
    the final bracket (relative width ``rtol``), so the result is >= the exact bound: valid. The
    p-value grows with the curve's leakage (e.g. with mu) and falls with v.

    Cost: <= 5 batched passes of <= v steps each (about 1-3 s at m = r = v = 1e5).
    """
    r, v, m = _check_counts(r, v, m)
    if v == 0:
        return 1.0
    ginv = _inverse_of(f)
    if not _rejected_batch(ginv, r, v, m, 1.0)[0]:
        return 1.0
    lo, hi = -300.0, 0.0  # log10 tau: lo assumed feasible, hi infeasible
    if _rejected_batch(ginv, r, v, m, 10.0 ** lo)[0]:
        return 10.0 ** lo
    width = math.log10(1.0 + rtol)
    while hi - lo > width:
        grid = np.linspace(lo, hi, _BATCH + 2)[1:-1]
        rej = _rejected_batch(ginv, r, v, m, 10.0 ** grid)
        idx = int(np.argmax(rej)) if np.any(rej) else grid.size
        # first rejected candidate becomes hi; the one before it (or the old lo) the new lo
        new_hi = grid[idx] if idx < grid.size else hi
        new_lo = grid[idx - 1] if idx > 0 else lo
        lo, hi = new_lo, new_hi
    return float(min(1.0, 10.0 ** hi))


def fdp_gdp_lower_bound(r: int, v: int, m: int, beta: float = 0.05, mu_max: float = 20.0,
                        tol: float = 1e-4) -> float:
    """Empirical mu_hat: the largest mu such that mu-GDP is rejected at level ``beta`` by
    :func:`fdp_rejects` (0 when even mu = 0 is not rejected; ``mu_max`` when mu_max is rejected).

    With probability >= 1 - beta, mu_hat <= the mechanism's true mu if it is mu-GDP w.r.t. each
    canary: mu_hat > mu_true implies mu_true was rejected (rejection is monotone in mu, since G_mu
    decreases in mu), which has probability <= beta. Found by batched bisection (the lower end of the
    final bracket of width ``tol``, so rounding only lowers mu_hat).
    """
    r, v, m = _check_counts(r, v, m)
    if not 0 < beta < 1:
        raise ValueError(f"beta must be in (0, 1), got {beta}")
    if v == 0 or r == 0:
        return 0.0

    def rejected(mus) -> np.ndarray:
        mus = np.atleast_1d(np.asarray(mus, dtype=float))
        return _rejected_batch(GaussianTradeoff(mus).inverse_blowup, r, v, m, beta)

    if not rejected(0.0)[0]:
        return 0.0
    if rejected(mu_max)[0]:
        return float(mu_max)
    lo, hi = 0.0, float(mu_max)  # lo rejected, hi not
    while hi - lo > tol:
        grid = np.linspace(lo, hi, _BATCH + 2)[1:-1]
        rej = rejected(grid)
        not_rej = ~rej
        idx = int(np.argmax(not_rej)) if np.any(not_rej) else grid.size
        new_hi = grid[idx] if idx < grid.size else hi
        new_lo = grid[idx - 1] if idx > 0 else lo
        lo, hi = new_lo, new_hi
    return float(lo)


def fdp_epsilon_lower_bound(r: int, v: int, m: int, delta: float, beta: float = 0.05,
                            mu_max: float = 20.0) -> float:
    """The paper's *empirical epsilon*: ``gaussian_epsilon(mu_hat, delta)`` with mu_hat from
    :func:`fdp_gdp_lower_bound` (the eps at ``delta`` of the strongest Gaussian curve that the
    observation refutes at level ``beta``; 0 when nothing is refuted).

    Valid, with confidence 1 - beta, as a lower bound on eps(delta) for mechanisms whose tradeoff
    curve is Gaussian-shaped (mu-GDP for some mu), e.g. an eps claim for DP-SGD read as "mu-GDP with
    the mu of that eps": eps_hat > eps_claim refutes it. It is NOT a lower bound for an arbitrary
    (eps, delta)-DP mechanism; audit such a profile directly with
    ``fdp_rejects(profile_tradeoff(eps_grid, delta_grid), r, v, m, beta)``.
    """
    mu_hat = fdp_gdp_lower_bound(r, v, m, beta=beta, mu_max=mu_max)
    if mu_hat <= 0:
        return 0.0
    return float(gaussian_epsilon(mu_hat, delta))


# --------------------------------------------------------------------------------------------
# Auditing an accountant's claim (its whole privacy profile) and the mu of a claimed (eps, delta)
# --------------------------------------------------------------------------------------------

#: The deltas at which an accountant's claimed profile eps(delta) is read, fixed in advance: a
#: finite grid gives the curve of "(eps_i, delta_i)-DP for every i", weaker than the accountant's
#: full curve, so testing it is valid (and only slightly less powerful).
PROFILE_DELTAS = tuple(float(10.0 ** -k) for k in np.arange(0.5, 15.01, 0.25))


def profile_rejected(epsilon_at: Callable[[float], float], r: int, v: int, m: int, beta: float = 0.05) -> bool:
    """Level-``beta`` test of an accountant's claim: "the mechanism is (eps(delta), delta)-DP for
    every delta of :data:`PROFILE_DELTAS`", with ``epsilon_at(delta)`` the accountant's eps. This is
    what the run claims (the printed (eps, delta) is one point of it); refuting it needs no
    Gaussian-shape assumption, unlike :func:`fdp_epsilon_lower_bound`."""
    deltas = np.asarray(PROFILE_DELTAS)
    eps = np.asarray([float(epsilon_at(float(d))) for d in deltas])
    keep = np.isfinite(eps)
    if not keep.any():
        return False  # no finite claim: nothing to refute
    return fdp_rejects(profile_tradeoff(eps[keep], deltas[keep]), r, v, m, beta)


def gaussian_mu(epsilon: float, delta: float, mu_max: float = 50.0) -> float:
    """The mu whose Gaussian curve has eps(delta) = ``epsilon``: the "mu of a claim" that the
    reports print beside mu_hat (inverse of ``bounds.gaussian_epsilon`` by bisection)."""
    lo, hi = 0.0, float(mu_max)
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if gaussian_delta(mid, epsilon) < delta else (lo, mid)
    return lo
