"""Distributed discrete Gaussian noise at client level (Kairouz, Liu & Steinke, ICML 2021), Flower-free.

Each client i, on its update x_i (a float vector of dimension d):

1. clips it to L2 norm c;
2. scales by s (integers per unit) and rounds **conditionally**: stochastic rounding repeated until
   the integer vector has L2 norm <= Delta_2 (``rounded_norm_bound``), so Delta_2 is a hard bound;
3. adds its share z_i ~ N_Z(0, sigma^2)^d of discrete Gaussian noise (sigma in integer units);
4. reduces mod M = 2^bits and enters the secure sum.

The server learns only S = sum_i (q_i + z_i) mod M, lifts it to [-M/2, M/2) and divides by s.

**Privacy** (docs/secure-aggregation.md): with at least k clients whose noise the adversary does not
know in the sum (k = t − colluders: t the reconstruction threshold, so that up to n − t dropouts
leave at least t shares of noise), the release of one round satisfies, for every order alpha > 1
(Kairouz et al. 2021, Proposition 14 with Theorem 1),

    eps(alpha) = min{ alpha/2 * (D2/sk)^2 + tau d,
                      alpha/2 * ((D2/sk)^2 + 2 tau D1/sk + tau^2 d),
                      alpha/2 * (D2/sk + tau sqrt(d))^2 },
    sk = sqrt(k) sigma,  tau = 10 sum_{j=1}^{k-1} exp(-2 pi^2 sigma^2 j / (j + 1)),
    D1 = D2 min(sqrt(d), D2)  (integers: |v|_1 <= |v|_2^2),

against add/remove of one client. More contributors only add independent noise (post-processing),
so the bound at k covers every round with >= k of them. The modular reduction is post-processing
too: it costs accuracy, never privacy. Rounds compose in RDP (no amplification by client sampling:
the server knows who takes part).

**Wrap-around.** |sum_i q_ij| <= n D2 (|q_i|_inf <= |q_i|_2), and the noise sum is
n sigma^2-subgaussian (a discrete Gaussian is sigma^2-subgaussian, Canonne, Kamath & Steinke 2020),
so P(some coordinate wraps) <= 2 d exp(-(M/2 − n D2)^2 / (2 n sigma^2)) (``wrap_probability``).

The sampler is the rejection sampler of Canonne, Kamath & Steinke (2020, Alg. 3) vectorised in
float64 (discrete Laplace proposals from two geometrics): a statistical sampler, not an exact or
constant-time one, drawing from numpy's PCG64 seeded with OS entropy (not a CSPRNG).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

from .field import centered, check_bits, fresh_rng, modulus, round_to_integers, to_field

#: RDP orders (integers, as in the published accounting).
ORDERS = tuple(range(2, 129)) + (256,)


# -- the discrete Gaussian --------------------------------------------------------------------------
def sample_discrete_gaussian(size: int, sigma: float, rng: np.random.Generator | None = None) -> np.ndarray:
    """``size`` independent draws of N_Z(0, sigma^2): P(z) ∝ exp(-z^2 / (2 sigma^2)) on the integers."""
    sigma = float(sigma)
    if not (math.isfinite(sigma) and sigma >= 0):
        raise ValueError(f"sigma must be a finite number >= 0, got {sigma!r}")
    if sigma == 0:
        return np.zeros(size, dtype=np.int64)
    rng = rng or fresh_rng()
    t = math.floor(sigma) + 1
    p = -math.expm1(-1.0 / t)  # geometric success probability: discrete Laplace of scale t
    out = np.empty(0, dtype=np.int64)
    while out.size < size:
        m = int(1.3 * (size - out.size)) + 16
        y = rng.geometric(p, m) - rng.geometric(p, m)
        accept = rng.random(m) < np.exp(-((np.abs(y) - sigma * sigma / t) ** 2) / (2 * sigma * sigma))
        out = np.concatenate([out, y[accept].astype(np.int64)])
    return out[:size]


def discrete_gaussian_variance(sigma: float) -> float:
    """The exact variance of N_Z(0, sigma^2) (a little below sigma^2), by summing its mass function."""
    z = np.arange(-int(40 * sigma) - 40, int(40 * sigma) + 41, dtype=np.float64)
    w = np.exp(-z * z / (2.0 * sigma * sigma))
    return float((w * z * z).sum() / w.sum())


# -- norms and the RDP of the sum ------------------------------------------------------------------
def rounded_norm_bound(norm: float, dimension: int, beta: float) -> float:
    """Delta_2: the L2 norm bound after conditional stochastic rounding of a vector of norm <= ``norm``
    (integer units), retried until the rounded norm is within it (Kairouz et al. 2021, Thm 1 / Prop 22).
    ``beta`` in [0, 1): the chance one rounding exceeds the bound; 0 gives the unconditional norm + sqrt(d)."""
    if not 0 <= beta < 1:
        raise ValueError(f"beta must be in [0, 1), got {beta!r}")
    bound = norm + math.sqrt(dimension)
    if beta == 0:
        return bound
    sq = norm * norm + dimension / 4.0 + math.sqrt(2.0 * math.log(1.0 / beta)) * (norm + math.sqrt(dimension) / 2.0)
    return min(bound, math.sqrt(sq))


def tau(sigma: float, contributors: int) -> float:
    """tau = 10 sum_{j=1}^{k-1} exp(-2 pi^2 sigma^2 j/(j+1)): how far a sum of k discrete Gaussians is from one."""
    return 10.0 * sum(math.exp(-2.0 * math.pi ** 2 * sigma ** 2 * j / (j + 1)) for j in range(1, contributors))


def sum_rdp(orders, *, l2: float, sigma: float, contributors: int, dimension: int) -> np.ndarray:
    """RDP of one release of sum_i q_i + sum of ``contributors`` N_Z(0, sigma^2)^d shares, sensitivity
    ``l2`` (integer units), at each order (Proposition 14 with Theorem 1; see the module docstring)."""
    if sigma < 0.5:
        raise ValueError(f"the bound needs sigma >= 1/2 integer units, got {sigma}")
    sk = math.sqrt(contributors) * sigma
    tt = tau(sigma, contributors)
    a2 = l2 / sk
    a1 = l2 * min(math.sqrt(dimension), l2) / sk
    out = []
    for alpha in orders:
        out.append(min(alpha / 2 * a2 ** 2 + tt * dimension,
                       alpha / 2 * (a2 ** 2 + 2 * tt * a1 + tt ** 2 * dimension),
                       alpha / 2 * (a2 + tt * math.sqrt(dimension)) ** 2))
    return np.asarray(out)


# -- the mechanism ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class DistributedDiscreteGaussian:
    """The parameters every client and the server share for one release of a secure sum with noise."""

    clip: float               # c: L2 clip of a client's vector (float units)
    scale: float              # s: integers per unit
    local_std: float          # sigma: each client's noise std in integer units
    dimension: int            # d
    bits: int                 # the ring Z_{2^bits}
    num_clients: int          # n: the cohort (most contributors)
    min_contributors: int     # k: least clients whose noise the adversary does not know (t − colluders)
    beta: float = math.exp(-0.5)

    def __post_init__(self):
        check_bits(self.bits)
        for name in ("clip", "scale"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
        if not (math.isfinite(self.local_std) and self.local_std >= 0.5):
            raise ValueError(f"local_std must be >= 1/2 integer units, got {self.local_std!r}")
        if not (isinstance(self.dimension, int) and self.dimension >= 1):
            raise ValueError(f"dimension must be a positive integer, got {self.dimension!r}")
        if not (isinstance(self.min_contributors, int) and 1 <= self.min_contributors <= self.num_clients):
            raise ValueError(f"min_contributors must be in [1, num_clients = {self.num_clients}], got {self.min_contributors!r}")
        if not 0 <= self.beta < 1:
            raise ValueError(f"beta must be in [0, 1), got {self.beta!r}")

    @property
    def norm_bound(self) -> float:
        """Delta_2 in integer units: the sensitivity of the integer sum to adding or removing a client."""
        return rounded_norm_bound(self.clip * self.scale, self.dimension, self.beta)

    def sum_std(self, contributors: int | None = None) -> float:
        """The std of each coordinate of the decoded sum's noise (float units) with k contributors."""
        k = self.min_contributors if contributors is None else contributors
        return math.sqrt(k * discrete_gaussian_variance(self.local_std)) / self.scale

    def wrap_probability(self) -> float:
        """An upper bound on the chance that some coordinate of the sum of n clients wraps mod M."""
        gap = modulus(self.bits) / 2 - self.num_clients * self.norm_bound
        if gap <= 0:
            return 1.0
        return min(1.0, 2 * self.dimension * math.exp(-gap * gap / (2 * self.num_clients * self.local_std ** 2)))

    def encode(self, x, rng: np.random.Generator | None = None, *, max_tries: int = 1000) -> np.ndarray:
        """A client's contribution: clip, scale, round conditionally, add its noise share, mod M."""
        v = np.asarray(x, dtype=np.float64).ravel()
        if v.shape != (self.dimension,) or not np.all(np.isfinite(v)):
            raise ValueError(f"a client's vector must be {self.dimension} finite numbers")
        rng = rng or fresh_rng()
        norm = float(np.linalg.norm(v))
        if norm > self.clip:
            v = v * (self.clip / norm)
        v = v * self.scale
        bound = self.norm_bound
        for _ in range(max_tries):
            q = round_to_integers(v, "stochastic", rng)
            if float(np.linalg.norm(q.astype(np.float64))) <= bound:
                break
        else:
            raise RuntimeError(f"conditional rounding failed {max_tries} times (beta = {self.beta})")
        return to_field(q + sample_discrete_gaussian(self.dimension, self.local_std, rng), self.bits)

    def decode_sum(self, v: np.ndarray) -> np.ndarray:
        return centered(v, self.bits).astype(np.float64) / self.scale

    def rdp(self, orders=ORDERS) -> np.ndarray:
        return sum_rdp(orders, l2=self.norm_bound, sigma=self.local_std, contributors=self.min_contributors,
                       dimension=self.dimension)

    def epsilon(self, releases: int, delta: float, orders=ORDERS) -> float:
        """(eps, delta) of ``releases`` composed rounds, each one release of this mechanism."""
        if releases < 1 or not 0 < delta < 1:
            raise ValueError(f"need releases >= 1 and delta in (0, 1), got {releases}, {delta}")
        eps, _ = compute_epsilon(list(orders), self.rdp(orders) * releases, delta)
        return float(eps)


def calibrate_local_std(target_epsilon: float, delta: float, releases: int, *, clip: float, scale: float,
                        dimension: int, bits: int, num_clients: int, min_contributors: int,
                        beta: float = math.exp(-0.5)) -> DistributedDiscreteGaussian:
    """The smallest local std (integer units, to 0.1 %) whose ``releases`` rounds spend at most
    ``target_epsilon`` at ``delta``; raises if even a large one cannot."""
    def mech(sigma):
        return DistributedDiscreteGaussian(clip, scale, sigma, dimension, bits, num_clients, min_contributors, beta)

    lo, hi = 0.5, 1.0
    while mech(hi).epsilon(releases, delta) > target_epsilon:
        lo, hi = hi, hi * 2
        if hi > 1e12:
            raise ValueError(f"no local std reaches eps = {target_epsilon} at delta = {delta} in {releases} releases")
    if mech(lo).epsilon(releases, delta) <= target_epsilon:
        return mech(lo)
    while hi / lo > 1.001:
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if mech(mid).epsilon(releases, delta) <= target_epsilon else (mid, hi)
    return mech(hi)
