"""Names and input checks shared by every accounting module, and the k-mixture's binomial weights.

Kept in one place so that ``rdp``, ``pld``, ``plan`` and ``ledger`` accept exactly the same
spellings (``"two_stage"`` == ``"two-stage"``) and raise the same messages, and so that the RDP
and PLD k-mixtures weight the number of aggregated clients identically.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence, Union

import numpy as np

from strategies.mechanisms import CLIENT_REFACTORIZATION, DELTA_MECHANISMS, WHOLE_ADAPTER_MECHANISMS

from fedpower_app.choices import ACCOUNTANTS, ACCOUNTED_METHODS as METHODS, CALIBRATIONS, SAMPLE_MODES  # noqa: E402,F401
# Releases of the silos' whole clipped adapters (the paper's mechanisms; server-side noise).
ROUND_TYPES = WHOLE_ADAPTER_MECHANISMS
# Client level, on round deltas (DP-FedAvg style; strategies/client_delta.py).
DELTA_ROUND_TYPES = DELTA_MECHANISMS
#: How FedPower refactorizes at client level: PowerDP-L (noise inside the power iteration) or the
#: paper's PowerDP on the averaged delta (diameter sensitivity; an ablation).
CLIENT_REFACTORIZATIONS = tuple(CLIENT_REFACTORIZATION)
LEVELS = ("sample", "client")


def _norm_name(value: Any, valid: Sequence[str], what: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{what} must be one of {list(valid)}, got {value!r}")
    v = value.strip().lower().replace("_", "-")
    if v not in valid:
        raise ValueError(f"unknown {what} {value!r}; valid choices: {list(valid)}")
    return v


def _check_round_type(round_type: str) -> str:
    return _norm_name(round_type, ROUND_TYPES + DELTA_ROUND_TYPES, "round type")


def _check_level(level: str) -> str:
    return _norm_name(level, LEVELS, "level")


def _check_sample_mode(mode: str) -> str:
    return _norm_name(mode, SAMPLE_MODES, "sample_mode")


def _is_int(x: Any) -> bool:
    if isinstance(x, bool):
        return False
    if isinstance(x, (int, np.integer)):
        return True
    return isinstance(x, (float, np.floating)) and math.isfinite(x) and float(x).is_integer()


def _check_prob(x: Any, name: str, *, allow_zero: bool = False) -> float:
    try:
        v = float(x)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number in {'[0' if allow_zero else '(0'}, 1], got {x!r}")
    lo_ok = v >= 0 if allow_zero else v > 0
    if not (math.isfinite(v) and lo_ok and v <= 1):
        raise ValueError(f"{name} must be in {'[0' if allow_zero else '(0'}, 1], got {x!r}")
    return v


def _check_round_sampling(level: str, q_c: Any, pi: Any, sample_mode: str) -> tuple:
    """The sampling arguments of one round, checked: ``(level, q_c, pi, sample_mode)``; ``pi`` and
    ``sample_mode`` are None at client level (only client sampling amplifies there)."""
    lvl = _check_level(level)
    qc = _check_prob(q_c, "q_c (client_rate)")
    if lvl == "client":
        return lvl, qc, None, None
    if pi is None:
        raise ValueError("pi (per-round example inclusion probability) is required at sample level")
    return lvl, qc, _check_prob(pi, "pi", allow_zero=True), _check_sample_mode(sample_mode)


# --------------------------------------------------------------------------------------------
# k-mixture (fixed noise, random number k of aggregated clients), used by rdp and pld alike
# --------------------------------------------------------------------------------------------


def _binom_weights(num_clients: int, q_c: float) -> np.ndarray:
    """P[k-1 = j] for j = 0..N-1, k-1 ~ Binomial(N-1, q_c) (the other sampled clients)."""
    n = int(num_clients) - 1
    j = np.arange(n + 1)
    if q_c >= 1.0:
        w = np.zeros(n + 1)
        w[-1] = 1.0
        return w
    logc = np.array([math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) for i in j])
    return np.exp(logc + j * math.log(q_c) + (n - j) * math.log1p(-q_c))


def _z_of_k_list(z_of_k: Union[Callable[[int], float], Sequence[float]], num_clients: int) -> list:
    if callable(z_of_k):
        zs = [float(z_of_k(k)) for k in range(1, num_clients + 1)]
    else:
        zs = [float(v) for v in z_of_k]
        if len(zs) != num_clients:
            raise ValueError(
                f"z_of_k must give one z for each k = 1..num_clients ({num_clients}), got {len(zs)}"
            )
    return zs


def _check_num_clients(num_clients: Any) -> int:
    if not _is_int(num_clients) or int(num_clients) <= 0:
        raise ValueError(f"num_clients must be a positive integer, got {num_clients!r}")
    return int(num_clients)
