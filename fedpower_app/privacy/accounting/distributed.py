"""Distributed DP at client level: each silo's share of discrete Gaussian noise in a secure sum.

With ``secagg.enabled`` and ``dp.level = "client"`` the server never clips or noises anything: each
silo clips its round delta to C, scales it by s, rounds it conditionally and adds its share of
N_Z(0, sigma^2) noise before the secure sum (``strategies.secure_sum.distributed_dp``). A round
releases ``releases_per_round`` such sums (FedLoRA/FFA-LoRA deltas: 1; FedPower's PowerDP-L: 2 per
power iteration, of W Q^T with the head and of P^T W), each of L2 sensitivity C in float units.

**Trust and k.** The secure sum completes only with at least t survivors, so at least t noise shares
are in every released sum; a server colluding with c silos knows their shares, so against it at
least k = t - c unknown shares remain. Each share is calibrated for k (docs/secure-aggregation.md §3).

**Accounting.** The RDP of each release is Kairouz, Liu & Steinke (2021), Prop. 14 with Thm 1
(``distributed_dp.sum_rdp``); releases compose in RDP; (eps, delta) by dp_accounting's conversion.
No amplification by client sampling: the server runs the protocol with the cohort, so it knows it
(the runs need ``strategy.client-rate = 1``).

**Scale.** s is chosen so that the rounding's slack sqrt(d) is 1/``precision`` of the clipped norm
Cs (Delta_2 within 1 + 1/(2 precision^2) of Cs), lowered until the sum of n silos cannot wrap the
ring except with probability below 1e-9; too few bits to get there is a configuration error.

Imports numpy and dp_accounting only (no torch).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

from strategies.secure_sum.distributed_dp import ORDERS, DistributedDiscreteGaussian, rounded_norm_bound, sum_rdp

WRAP_TOLERANCE = 1e-9


@dataclass(frozen=True)
class DistributedPlan:
    """Everything a run's distributed-DP calibration depends on (all public)."""

    epsilon: float
    delta: float
    num_rounds: int
    clip: float
    num_clients: int            # n: the cohort (every silo, each round)
    min_contributors: int       # k = t - colluders
    schedule: tuple             # per round t = 1..T, the dimension of each of its releases
    bits: int
    precision: float = 100.0    # Cs / sqrt(d) for the largest d

    def __post_init__(self):
        if len(self.schedule) != self.num_rounds or any(not r or any(int(d) < 1 for d in r) for r in self.schedule):
            raise ValueError(f"need the releases' dimensions of each of the {self.num_rounds} rounds")
        if not 1 <= self.min_contributors <= self.num_clients:
            raise ValueError(f"k = t - colluders must be in [1, {self.num_clients}], got {self.min_contributors}: "
                             "lower secagg.colluders or raise secagg.threshold")


@dataclass(frozen=True)
class DistributedCalibration:
    scale: float                # s: integers per unit
    local_std: float            # sigma: each silo's share, integer units
    epsilon: float              # after the planned rounds
    sum_std: float              # std of the summed noise per coordinate, float units, at k shares
    noise_multiplier: float     # sum_std / C: the Gaussian-equivalent z of each release
    wrap_probability: float     # per release, at most

    def to_dict(self) -> dict:
        return asdict(self)


def mechanisms(plan: DistributedPlan, scale: float, local_std: float, dimensions=None,
               beta: float = math.exp(-0.5)):
    """Releases of the given dimensions (default: every distinct one of the plan) as mechanisms."""
    dims = sorted({int(d) for r in plan.schedule for d in r}) if dimensions is None else dimensions
    return [DistributedDiscreteGaussian(plan.clip, scale, local_std, int(d), plan.bits, plan.num_clients,
                                        plan.min_contributors, beta) for d in dims]


def round_rdp(plan: DistributedPlan, dimensions, scale: float, local_std: float) -> np.ndarray:
    """The RDP of one round whose releases have ``dimensions``, composed, at ``ORDERS``."""
    return sum(m.rdp(ORDERS) for m in mechanisms(plan, scale, local_std, dimensions))


def schedule_rdp(plan: DistributedPlan, scale: float, local_std: float) -> np.ndarray:
    return sum(round_rdp(plan, dims, scale, local_std) for dims in plan.schedule)


def epsilon_of(rdp: np.ndarray, delta: float) -> float:
    eps, _ = compute_epsilon(list(ORDERS), np.asarray(rdp), delta)
    return float(eps)


def choose_scale(plan: DistributedPlan, z_guess: float) -> float:
    """s with Cs = precision sqrt(d_max), lowered (to precision 2) until n silos cannot wrap the ring."""
    d = max(int(x) for r in plan.schedule for x in r)
    precision = plan.precision
    while precision >= 2:
        scale = precision * math.sqrt(d) / plan.clip
        sigma = max(0.5, z_guess * plan.clip * scale / math.sqrt(plan.min_contributors))
        if all(m.wrap_probability() < WRAP_TOLERANCE for m in mechanisms(plan, scale, sigma)):
            return scale
        precision /= 2
    raise ValueError(f"{plan.bits}-bit sums of {plan.num_clients} silos would wrap around: raise "
                     "secagg.quantization-bits")


def calibrate(plan: DistributedPlan) -> DistributedCalibration:
    """The smallest share std (to 0.1 %) whose planned rounds spend at most ``plan.epsilon``."""
    def eps_at(scale, sigma):
        return epsilon_of(schedule_rdp(plan, scale, sigma), plan.delta)

    # a first guess of z from the Gaussian mechanism composed once per release (no amplification)
    releases = sum(len(r) for r in plan.schedule)
    lo, hi = 0.05, 1.0
    gauss = lambda z: epsilon_of(np.asarray(ORDERS, dtype=float) * releases / (2 * z * z), plan.delta)  # noqa: E731
    while gauss(hi) > plan.epsilon:
        hi *= 2
        if hi > 1e6:
            raise ValueError(f"no noise reaches eps = {plan.epsilon} in {plan.num_rounds} rounds")
    scale = choose_scale(plan, hi)
    lo, hi = 0.5, 1.0
    while eps_at(scale, hi) > plan.epsilon:
        lo, hi = hi, hi * 2
        if hi > 1e15:
            raise ValueError(f"no noise share reaches eps = {plan.epsilon} in {plan.num_rounds} rounds")
    if eps_at(scale, lo) <= plan.epsilon:
        hi = lo
    while hi / lo > 1.001:
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if eps_at(scale, mid) <= plan.epsilon else (mid, hi)
    mechs = mechanisms(plan, scale, hi)
    sum_std = mechs[0].sum_std()
    return DistributedCalibration(scale=scale, local_std=hi, epsilon=eps_at(scale, hi), sum_std=sum_std,
                                  noise_multiplier=sum_std / plan.clip,
                                  wrap_probability=max(m.wrap_probability() for m in mechs))


def release_rdp(*, clip: float, scale: float, local_std: float, dimension: int, contributors: int,
                beta: float = math.exp(-0.5)) -> np.ndarray:
    """One release's RDP as a silo computes it for its own ledger (its own k, the public parameters)."""
    return sum_rdp(ORDERS, l2=rounded_norm_bound(clip * scale, dimension, beta), sigma=local_std,
                   contributors=contributors, dimension=dimension)
