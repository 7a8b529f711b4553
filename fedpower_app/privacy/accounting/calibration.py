"""Noise calibration: the noise multiplier that meets the target epsilon, and the epsilon of given noise.

* :func:`calibrate`: rigorous mode, the smallest effective z with epsilon(z) <= target under the
  plan's accountant; paper mode, the paper's ``sigma_alg`` and the TRUE epsilon of that noise;
* :func:`epsilon_for_noise_multiplier`: epsilon trajectory of a user-fixed z;
* :func:`epsilon_for_sigma_alg`: TRUE epsilon of the paper's noise convention;
* :class:`Calibration`: their result (noise per block, z per round type, epsilon trajectory,
  validity label), which the server's :class:`~fedpower_app.privacy.accounting.ledger.PrivacyLedger` follows.

Every epsilon is computed by composing the plan's round events through an
:class:`~fedpower_app.privacy.accounting.interface.Accountant`. The RDP epsilon is always reported; with
``accountant="pld"`` the PLD epsilon (tighter) is the one that counts.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable, Optional, Sequence

import numpy as np

from .interface import Accountant, PldAccountant, RdpAccountant
from .pld import _auto_vdi
from .plan import (
    PrivacyPlan,
    _k_dependent,
    _schedule_counts,
    _type_z,
    block_sensitivities,
    noise_stds,
    round_event,
)
from .rdp import ORDERS, _orders_tuple

PAPER_LABEL = "paper calibration: NOT a valid DP guarantee"
RIGOROUS_LABEL = "rigorous: valid (epsilon, delta)-DP guarantee under the stated assumptions"
PRODUCT_LABEL = (
    "sample_mode=product: paper-comparable SGM(q_c*pi) bound, believed but not proven valid "
    "for FedPower-type releases; use two-stage for a proven guarantee"
)


def paper_sigma_alg(epsilon: float, delta: float, num_rounds: int, q: float) -> float:
    """The paper's heuristic ``sigma_alg = q * sqrt(2 T ln(1.25/delta)) / eps`` (NOT a theorem)."""
    return float(q) * math.sqrt(2.0 * int(num_rounds) * math.log(1.25 / float(delta))) / float(epsilon)


# --------------------------------------------------------------------------------------------
# epsilon of a plan's schedule under a noise specification
# --------------------------------------------------------------------------------------------


def _safe_vdi(plan: PrivacyPlan, types: Iterable[str], noise: tuple, vdi: float) -> float:
    # k = 1 gives the smallest z of a k-mixture, so _type_z is each type's smallest z.
    zmin = min(_type_z(plan, rt, noise) for rt in types)
    return _auto_vdi(zmin, vdi)


def _epsilon(plan: PrivacyPlan, counts: dict, noise: tuple, accountant: Accountant) -> float:
    """epsilon after ``counts`` rounds of each type (composed per type, in ``counts`` order)."""
    accountant.compose_all((round_event(plan, rt, noise), n) for rt, n in counts.items())
    return accountant.epsilon(plan.delta)


def _trajectory(accountant: Accountant, schedule: Sequence[str], events: dict, delta: float) -> list:
    """epsilon after each round, composing round by round in schedule order (as the ledger does)."""
    traj = []
    for rt in schedule:
        accountant.compose(events[rt])
        traj.append(accountant.epsilon(delta))
    return traj


def _evaluate(plan: PrivacyPlan, noise: tuple, *, accountant: str, trajectory: bool,
              orders: tuple = ORDERS, vdi: Optional[float] = None) -> dict:
    schedule = plan.schedule
    counts = _schedule_counts(schedule)
    events = {rt: round_event(plan, rt, noise) for rt in counts}
    out: dict = {"notes": []}
    # RDP always: its epsilon and best order are reported with either accountant.
    rdp = RdpAccountant(orders)
    rdp.compose_all((events[rt], n) for rt, n in counts.items())
    eps_rdp, order = rdp.epsilon_and_order(plan.delta)
    out["epsilon_rdp"], out["best_order"] = eps_rdp, order
    if not math.isnan(order) and (order == orders[0] or order == orders[-1]):
        out["notes"].append(
            f"RDP optimum at the {'smallest' if order == orders[0] else 'largest'} order ({order:g}); "
            "the RDP bound may be loose"
        )
    traj_rdp = None
    if trajectory:
        traj_rdp = _trajectory(RdpAccountant(orders), schedule, events, plan.delta)
        traj_rdp[-1] = eps_rdp  # summed per type above: the reported final value
    if accountant == "rdp":
        out["epsilon"], out["trajectory"], out["vdi"] = eps_rdp, traj_rdp, None
        out["trajectory_accountant"] = "rdp"
        return out
    if vdi is None:
        vdi = _safe_vdi(plan, counts, noise, plan.pld_interval)
    coarsened = vdi > plan.pld_interval * (1 + 1e-12)
    if coarsened:
        out["notes"].append(
            f"PLD memory guard: value_discretization_interval coarsened from {plan.pld_interval:g} "
            f"to {vdi:.3g} (still a pessimistic upper bound)"
        )
    traj, traj_acc = None, "pld"
    if trajectory and not coarsened:
        # Round by round, exactly as PrivacyLedger composes, so the ledger's epsilon after the
        # planned rounds equals this one.
        traj = _trajectory(PldAccountant(vdi), schedule, events, plan.delta)
        eps_pld = traj[-1]
    else:
        eps_pld = _epsilon(plan, counts, noise, PldAccountant(vdi))
        if trajectory:
            # Tiny noise: a round-by-round PLD trajectory (large-epsilon PLD queries) would take
            # minutes. Report the RDP trajectory (valid, looser) and the final epsilon by PLD.
            traj, traj_acc = list(traj_rdp), "rdp"
            out["notes"].append("trajectory computed with RDP (PLD trajectory too expensive at this "
                                "noise level); final epsilon by PLD")
    out["epsilon"], out["trajectory"], out["vdi"] = eps_pld, traj, vdi
    out["trajectory_accountant"] = traj_acc
    return out


# --------------------------------------------------------------------------------------------
# Result
# --------------------------------------------------------------------------------------------


@dataclass
class Calibration:
    """Result of :func:`calibrate` / :func:`epsilon_for_noise_multiplier` / :func:`epsilon_for_sigma_alg`.

    ``z``: effective noise multiplier of every round (rigorous / fixed-z modes). In paper mode it is
    the smallest worst-case (k = 1) effective multiplier over the round types of the schedule.
    ``noise_std``: round type -> per-block noise std per entry (sample level: at worst case k = 1;
    the server must use ``noise_stds(round_type, level, z, clip, k=k_realised)`` in rigorous mode;
    client level and paper mode: the fixed value). ``epsilon``/``trajectory``: expected epsilon
    (with the chosen accountant) after T rounds / after each round t = 1..T, computed for the
    plan's schedule. In paper mode they are the TRUE epsilon of the paper's noise
    (``true_epsilon``), while ``target_epsilon`` is the claimed one.
    """

    mode: str
    z: float
    sigma_alg: Optional[float]
    noise_std: dict
    z_per_round_type: dict
    epsilon: float
    trajectory: list
    target_epsilon: float
    delta: float
    accountant: str
    level: str
    sample_mode: Optional[str]
    client_rate: float
    pi: Optional[float]
    num_rounds: int
    schedule_counts: dict
    is_valid_guarantee: bool
    label: str
    epsilon_rdp: float
    best_order: Optional[float] = None
    true_epsilon: Optional[float] = None
    pld_interval: Optional[float] = None
    trajectory_accountant: str = "rdp"
    notes: list = field(default_factory=list)

    def to_dict(self) -> dict:
        def clean(v):
            if isinstance(v, dict):
                return {str(k): clean(x) for k, x in v.items()}
            if isinstance(v, (list, tuple)):
                return [clean(x) for x in v]
            if isinstance(v, (np.floating, float)):
                f = float(v)
                if math.isnan(f):
                    return None
                if math.isinf(f):
                    return "inf" if f > 0 else "-inf"
                return f
            if isinstance(v, np.integer):
                return int(v)
            return v

        return clean(asdict(self))

    @classmethod
    def from_dict(cls, d: dict) -> "Calibration":
        """Inverse of :meth:`to_dict`."""
        def unclean(v):
            if isinstance(v, str) and v in ("inf", "-inf"):
                return float(v)
            if isinstance(v, list):
                return [unclean(x) for x in v]
            if isinstance(v, dict):
                return {k: unclean(x) for k, x in v.items()}
            return v
        vals = {k: unclean(v) for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**vals)


def _noise_tables(plan: PrivacyPlan, counts: dict, noise: tuple) -> tuple:
    stds, zs = {}, {}
    kind, val = noise
    for rt in counts:
        if kind == "z":
            stds[rt] = plan.stds(rt, val)
        else:
            n = len(plan.sensitivities(rt))
            stds[rt] = [float(val) * plan.clip] * n
        zs[rt] = _type_z(plan, rt, noise)
    return stds, zs


def _labels(plan: PrivacyPlan, mode: str) -> tuple:
    if mode == "paper":
        return False, PAPER_LABEL
    if plan.level == "sample" and plan.sample_mode == "product":
        return False, PRODUCT_LABEL
    return True, RIGOROUS_LABEL


def _common_notes(plan: PrivacyPlan) -> list:
    notes = []
    if plan.level == "client":
        notes.append("client level: the server must release noise even in empty rounds (k = 0) "
                     "and must not scale the noise with k")
    else:
        notes.append("sample level: clients must use Poisson example sampling (rate b/n_i) and report n_i; "
                     "empty rounds still release noise (k = 0 uses the k = 1 noise scale)")
    # units protected: examples (sample level) or clients (client level)
    n = sum(plan.client_sizes) if plan.level == "sample" else plan.num_clients
    if plan.delta * n > 0.1:
        unit = "examples" if plan.level == "sample" else "clients"
        notes.append(f"delta = {plan.delta:g} is not << 1/n (n = {n} {unit}); consider delta <= {0.1 / n:.1e}")
    return notes


def _build(plan: PrivacyPlan, noise: tuple, mode: str, ev: dict) -> Calibration:
    counts = _schedule_counts(plan.schedule)
    stds, zs = _noise_tables(plan, counts, noise)
    valid, label = _labels(plan, mode)
    kind, val = noise
    z = float(val) if kind == "z" else min(zs.values())
    notes = list(ev["notes"]) + _common_notes(plan)
    if kind == "sigma" and plan.level == "sample" and any(_k_dependent(plan, rt) for rt in counts):
        notes.append("fixed noise with a random number k of aggregated clients: z_per_round_type is the "
                     "worst case k = 1; epsilon uses the mixture over k ~ 1 + Binomial(N-1, q_c)"
                     + (" (product mode: worst case k = 1)" if plan.sample_mode == "product" else ""))
    if mode != "paper" and ev["epsilon"] > plan.epsilon * (1 + 1e-9):
        notes.append(f"epsilon {ev['epsilon']:.4g} EXCEEDS the target {plan.epsilon:g}")
    return Calibration(
        mode=mode,
        z=z,
        sigma_alg=float(val) if kind == "sigma" else None,
        noise_std=stds,
        z_per_round_type=zs,
        epsilon=float(ev["epsilon"]),
        trajectory=[float(x) for x in ev["trajectory"]] if ev.get("trajectory") is not None else [],
        target_epsilon=plan.epsilon,
        delta=plan.delta,
        accountant=plan.accountant,
        level=plan.level,
        sample_mode=plan.sample_mode if plan.level == "sample" else None,
        client_rate=plan.client_rate,
        pi=plan.pi,
        num_rounds=plan.num_rounds,
        schedule_counts=counts,
        is_valid_guarantee=valid,
        label=label,
        epsilon_rdp=float(ev["epsilon_rdp"]),
        best_order=None if math.isnan(ev["best_order"]) else float(ev["best_order"]),
        true_epsilon=float(ev["epsilon"]) if mode == "paper" else None,
        pld_interval=ev.get("vdi"),
        trajectory_accountant=ev.get("trajectory_accountant", plan.accountant),
        notes=notes,
    )


# --------------------------------------------------------------------------------------------
# Root finding
# --------------------------------------------------------------------------------------------


def _solve_log(eps_of_z: Callable[[float], float], target: float, lo: float, hi: float,
               rel_tol: float, known: Optional[dict] = None) -> tuple:
    """Smallest z in [lo, hi] (eps(lo) > target >= eps(hi)) with eps(z) <= target.

    Brent's method (scipy ``brentq``) on ``g(u) = log eps(e^u) - log target`` to locate the
    crossing, then bisection on the tightest evaluated bracket until ``hi/lo - 1 <= rel_tol``.
    Returns ``(hi, eps(hi))``: hi is always a point that was evaluated and is feasible.
    """
    from scipy.optimize import brentq

    seen: dict = dict(known or {})

    def ev(z: float) -> float:
        if z not in seen:
            seen[z] = eps_of_z(z)
        return seen[z]

    ends = {math.log(lo): lo, math.log(hi): hi}

    def g(u: float) -> float:
        e = ev(ends.get(u, math.exp(u)))
        if not e > 0:
            return -50.0
        if e == math.inf:
            return 50.0
        return max(min(math.log(e) - math.log(target), 50.0), -50.0)

    def bracket() -> tuple:
        feas = [z for z, e in seen.items() if e <= target and lo <= z <= hi]
        infeas = [z for z, e in seen.items() if e > target and lo <= z <= hi]
        return max(infeas), min(feas)

    ev(lo)
    ev(hi)
    tol = math.log1p(rel_tol)
    if math.log(hi) - math.log(lo) > tol:
        try:
            brentq(g, math.log(lo), math.log(hi), xtol=tol / 4.0, rtol=4 * np.finfo(float).eps,
                   maxiter=200)
        except (ValueError, RuntimeError):
            pass  # fall back to plain bisection below
    zl, zh = bracket()
    it = 0
    while math.log(zh) - math.log(zl) > tol and it < 200:
        it += 1
        ev(math.sqrt(zl * zh))
        zl, zh = bracket()
    return zh, seen[zh]


def _bracket(eps_of_z: Callable[[float], float], target: float, z0: float,
             z_min: float = 1e-3, z_max: float = 1e6) -> tuple:
    """Find lo < hi with eps(lo) > target >= eps(hi) by doubling/halving from z0.

    Returns (lo, hi, evaluated) with evaluated = {z: eps}; lo is None if eps(z_min) <= target.
    """
    seen: dict = {}

    def ev(z: float) -> float:
        seen[z] = eps_of_z(z)
        return seen[z]

    z = z0
    if ev(z) <= target:
        hi = z
        while True:
            lo = hi / 2.0
            if lo < z_min:
                return None, hi, seen  # feasible down to z_min
            if ev(lo) > target:
                return lo, hi, seen
            hi = lo
    lo = z
    while True:
        hi = lo * 2.0
        if hi > z_max:
            raise ValueError(
                f"cannot reach epsilon <= {target:g} with any noise multiplier <= {z_max:g}"
            )
        if ev(hi) <= target:
            return lo, hi, seen
        lo = hi


# --------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------


def _check_plan(plan: PrivacyPlan) -> None:
    if not isinstance(plan, PrivacyPlan):
        raise ValueError(f"plan must be a PrivacyPlan, got {type(plan).__name__}")


def calibrate(plan: PrivacyPlan, *, rel_tol: float = 1e-5, orders: Sequence[float] = ORDERS) -> Calibration:
    """Calibrate the noise for ``plan``.

    Rigorous mode: smallest effective z (log-scale Brent + bisection, rel. tol ``rel_tol``) with
    epsilon(z) <= target under the chosen accountant. With PLD the search is bracketed around the
    RDP solution (PLD is 5-9% tighter), never probing tiny z (memory pitfall).

    Paper mode: ``sigma_alg = q sqrt(2T ln(1.25/delta))/eps`` and the TRUE epsilon of that noise
    (``is_valid_guarantee = False``).
    """
    _check_plan(plan)
    ords = _orders_tuple(orders)
    if plan.calibration == "paper":
        sigma = paper_sigma_alg(plan.epsilon, plan.delta, plan.num_rounds, plan.paper_q())
        cal = epsilon_for_sigma_alg(plan, sigma, orders=ords)
        cal.notes.insert(0, f"paper formula sigma_alg = q*sqrt(2T ln(1.25/delta))/eps with q = {plan.paper_q():.6g}; "
                            f"claimed epsilon {plan.epsilon:g}, true epsilon {cal.epsilon:.4g}")
        return cal

    counts = _schedule_counts(plan.schedule)
    target = plan.epsilon
    vdi = None

    # The search always starts with RDP (cheap, no memory pitfall at small z).
    def eps_rdp(z: float) -> float:
        return _epsilon(plan, counts, ("z", z), RdpAccountant(ords))

    q_eff = plan.client_rate if plan.level == "client" else plan.client_rate * plan.pi
    z0 = max(0.5, paper_sigma_alg(plan.epsilon, plan.delta, plan.num_rounds, q_eff))
    lo, hi, seen = _bracket(eps_rdp, target, z0)
    notes = []
    if lo is None:
        z = hi
        notes.append(f"target reached at the smallest searched z = {hi:g}")
    else:
        z, _ = _solve_log(eps_rdp, target, lo, hi, rel_tol, known=seen)

    if plan.accountant == "pld":
        z_rdp = z
        # PLD needs 5-9% less noise than RDP: the answer is near 0.9 z_rdp (search floor 0.5 z_rdp).
        vdi = _auto_vdi(0.7 * z_rdp, plan.pld_interval)

        def eps_pld(zz: float) -> float:
            return _epsilon(plan, counts, ("z", zz), PldAccountant(vdi))

        seen_pld: dict = {}

        def ev_pld(zz: float) -> float:
            seen_pld[zz] = eps_pld(zz)
            return seen_pld[zz]

        hi = z_rdp
        n = 0
        while ev_pld(hi) > target:
            hi *= 1.05
            n += 1
            if n > 40:
                raise ValueError("PLD calibration failed to find a feasible noise multiplier")
        lo = hi * 0.85
        while ev_pld(lo) <= target:
            hi = lo
            lo *= 0.85
            if lo < 0.5 * z_rdp:
                lo = None
                break
        if lo is None:
            z = hi
            notes.append("PLD calibration stopped at 0.5 x the RDP solution (memory guard)")
        else:
            z, _ = _solve_log(eps_pld, target, lo, hi, rel_tol, known=seen_pld)
        notes.append(f"RDP solution for comparison: z = {z_rdp:.6g}")

    ev = _evaluate(plan, ("z", z), accountant=plan.accountant, trajectory=True, orders=ords, vdi=vdi)
    nudges = 0
    while ev["epsilon"] > target and nudges < 50:
        # PLD: round-by-round composition (what the ledger does) can differ from self_compose in
        # the last digits; nudge z up so the ledger never stops before the planned T.
        z *= 1.0 + rel_tol
        nudges += 1
        ev = _evaluate(plan, ("z", z), accountant=plan.accountant, trajectory=True, orders=ords, vdi=vdi)
    cal = _build(plan, ("z", z), "rigorous", ev)
    cal.notes = notes + cal.notes
    return cal


def epsilon_for_noise_multiplier(plan: PrivacyPlan, z: float, *, orders: Sequence[float] = ORDERS) -> Calibration:
    """epsilon trajectory when the user fixes the effective multiplier ``z`` of every round."""
    _check_plan(plan)
    zz = float(z)
    if not (zz > 0 and math.isfinite(zz)):
        raise ValueError(f"noise multiplier z must be a positive finite number, got {z!r}")
    ev = _evaluate(plan, ("z", zz), accountant=plan.accountant, trajectory=True, orders=_orders_tuple(orders))
    return _build(plan, ("z", zz), "fixed-z", ev)


def epsilon_for_sigma_alg(plan: PrivacyPlan, sigma_alg: float, *, orders: Sequence[float] = ORDERS) -> Calibration:
    """TRUE epsilon of the paper's noise convention: per-entry std ``sigma_alg * C`` on every block.

    Uses the correct sensitivities (PowerDP 2*sqrt(2)*C, sample-level 2C/k with the k-mixture, ...).
    Always labelled as paper calibration (not a valid guarantee for the claimed epsilon).
    """
    _check_plan(plan)
    s = float(sigma_alg)
    if not (s > 0 and math.isfinite(s)):
        raise ValueError(f"sigma_alg must be a positive finite number, got {sigma_alg!r}")
    ev = _evaluate(plan, ("sigma", s), accountant=plan.accountant, trajectory=True, orders=_orders_tuple(orders))
    return _build(plan, ("sigma", s), "paper", ev)
