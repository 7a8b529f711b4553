"""Quantization of float vectors to the ring Z_M (M = 2^bits) and back, with a stated error bound.

Every secure sum here adds vectors of integers modulo M = 2^bits (bits in [8, 62], so that a sum of
two residues fits an int64). A float vector is brought there by:

1. clamping every coordinate to [-r, r] (``clip_range`` r > 0);
2. scaling by s (``scale``, integers per unit);
3. rounding to an integer: ``"stochastic"`` (unbiased: floor(v) + Bernoulli(v - floor(v))) or
   ``"nearest"``;
4. reducing mod M (two's complement: a negative integer q is stored as q + M).

A sum of k <= n such vectors is decoded by lifting it to the centred range [-M/2, M/2) and dividing
by s. The scale is chosen so that the sum of the n clients of a round can never wrap:

    s = L / r with L = floor((M/2 - 1) / n) - 1:  |s x_ij| <= L, so |q_ij| <= L and |sum_i q_ij| <= n L < M/2,

so the decoded sum is exact up to rounding. **Error bound** (per coordinate, for k summed vectors
whose coordinates lie inside [-r, r]):

    |decode(sum_i q_i) - sum_i x_i| <= k / s        (stochastic rounding: each |q_ij - s x_ij| < 1)
                                    <= k / (2 s)    (nearest rounding)

and stochastic rounding is unbiased, with standard deviation <= sqrt(k) / (2 s). Coordinates
outside [-r, r] are clamped first; that is a clipping error, not a quantization error, and
``encode`` reports how many there were.

Why not ``flwr.common.secure_aggregation.quantization``: it draws its rounding coins from numpy's
global generator (not seedable per client, not independent of other users of ``np.random``), shifts
every value by +r (so a sum carries an offset n r that the decoder must know), divides by zero at
``clipping_range = 0`` and gives no wrap bound. The arithmetic here is a few lines; the bound is
what matters. Pure numpy, no Flower.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import numpy as np

MIN_BITS, MAX_BITS = 8, 62
ROUNDINGS = ("stochastic", "nearest")


def fresh_rng() -> np.random.Generator:
    """A numpy generator seeded with 128 bits of OS entropy (a statistical generator, not a CSPRNG)."""
    return np.random.Generator(np.random.PCG64(secrets.randbits(128)))


def check_bits(bits) -> int:
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not MIN_BITS <= int(bits) <= MAX_BITS:
        raise ValueError(f"quantization bits must be an integer in [{MIN_BITS}, {MAX_BITS}], got {bits!r}")
    return int(bits)


def modulus(bits: int) -> int:
    return 1 << check_bits(bits)


def add_mod(a: np.ndarray, b: np.ndarray, bits: int) -> np.ndarray:
    """(a + b) mod 2^bits for residues a, b in [0, 2^bits) stored as int64."""
    return (a + b) & (modulus(bits) - 1)


def sub_mod(a: np.ndarray, b: np.ndarray, bits: int) -> np.ndarray:
    return (a - b) & (modulus(bits) - 1)


def centered(v: np.ndarray, bits: int) -> np.ndarray:
    """The residues v in [0, M) lifted to the centred integers [-M/2, M/2)."""
    M = modulus(bits)
    v = np.asarray(v, dtype=np.int64) & (M - 1)
    return np.where(v >= M // 2, v - M, v)


def to_field(q: np.ndarray, bits: int) -> np.ndarray:
    """Integers (any sign, |q| < 2^62) as residues mod 2^bits."""
    return np.asarray(q, dtype=np.int64) & (modulus(bits) - 1)


def round_to_integers(v: np.ndarray, rounding: str, rng: np.random.Generator | None) -> np.ndarray:
    """Round float64 ``v`` to int64: unbiased stochastic rounding or round-to-nearest."""
    if rounding == "nearest":
        return np.rint(v).astype(np.int64)
    if rounding != "stochastic":
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    rng = rng or fresh_rng()
    low = np.floor(v)
    up = rng.random(v.shape) < (v - low)
    return (low + up).astype(np.int64)


@dataclass(frozen=True)
class FieldQuantizer:
    """Float vectors <-> Z_{2^bits}, scaled so that the sum of ``num_clients`` vectors never wraps."""

    bits: int
    clip_range: float
    num_clients: int
    rounding: str = "stochastic"

    def __post_init__(self):
        check_bits(self.bits)
        r = self.clip_range
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not (math.isfinite(r) and r > 0):
            raise ValueError(f"clip range must be a finite number > 0, got {r!r}")
        if isinstance(self.num_clients, bool) or not isinstance(self.num_clients, int) or self.num_clients < 1:
            raise ValueError(f"num_clients must be a positive integer, got {self.num_clients!r}")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}, got {self.rounding!r}")
        if self.levels < 1:
            raise ValueError(f"{self.bits} bits cannot hold the sum of {self.num_clients} clients without wrapping: "
                             f"need M/2 - 1 >= 2 n, i.e. bits >= {math.ceil(math.log2(4 * self.num_clients + 2))}")

    @property
    def modulus(self) -> int:
        return modulus(self.bits)

    @property
    def levels(self) -> int:
        """L = floor((M/2 - 1) / n) - 1: a clamped coordinate scales to |s x| <= L and rounds to |q| <= L,
        so n L < M/2 (one level of margin for the float product r s)."""
        return (self.modulus // 2 - 1) // self.num_clients - 1

    @property
    def scale(self) -> float:
        """s: integers per unit; n (r s + 1) <= M/2 - 1, so the sum of n clients never wraps."""
        return self.levels / float(self.clip_range)

    def error_bound(self, summed: int | None = None) -> float:
        """The most a decoded sum of ``summed`` (default n) in-range vectors differs from the float
        sum, per coordinate: k / s (stochastic) or k / (2 s) (nearest)."""
        k = self.num_clients if summed is None else int(summed)
        if not 0 <= k <= self.num_clients:
            raise ValueError(f"a sum of {k} vectors is outside [0, {self.num_clients}] this quantizer was sized for")
        return k / self.scale if self.rounding == "stochastic" else k / (2.0 * self.scale)

    def encode(self, x, rng: np.random.Generator | None = None) -> tuple[np.ndarray, int]:
        """A float vector as residues mod M, and how many of its coordinates were clamped to [-r, r]."""
        v = np.asarray(x, dtype=np.float64).ravel()
        if not np.all(np.isfinite(v)):
            raise ValueError("cannot quantize a vector with NaN or Inf")
        r = float(self.clip_range)
        clamped = int(np.count_nonzero(np.abs(v) > r))
        q = round_to_integers(np.clip(v, -r, r) * self.scale, self.rounding, rng)
        return to_field(q, self.bits), clamped

    def decode_sum(self, v: np.ndarray, summed: int) -> np.ndarray:
        """The float sum of ``summed`` encoded vectors from their residue sum mod M."""
        if not 0 <= int(summed) <= self.num_clients:
            raise ValueError(f"a sum of {summed} vectors is outside [0, {self.num_clients}] this quantizer was sized for")
        return centered(v, self.bits).astype(np.float64) / self.scale
