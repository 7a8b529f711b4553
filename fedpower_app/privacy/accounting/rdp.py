"""RDP math: per-round Renyi-DP curves of fedpower rounds and their conversion to (epsilon, delta).

Stateless functions over opacus' exact sampled-Gaussian RDP (``compute_rdp`` /
``get_privacy_spent``); nothing here re-derives privacy math beyond combining library outputs:

* :func:`rdp_sgm`: one Poisson sampled Gaussian mechanism (SGM);
* :func:`round_rdp`: one round (client level SGM(q_c); sample level two-stage mixture
  ``(1-q_c) id + q_c SGM(pi)`` or the paper-comparable product SGM(q_c*pi));
* :func:`round_rdp_k_mixture`: fixed noise with a random number k of aggregated clients;
* :func:`rdp_to_epsilon`: RDP curve -> (epsilon, best order).

The stateful composition of rounds is :class:`~fedpower_app.privacy.accounting.interface.RdpAccountant`.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Callable, Iterable, Optional, Sequence, Union

import numpy as np

from ._common import (
    _check_round_sampling,
    _binom_weights,
    _check_num_clients,
    _check_prob,
    _check_sample_mode,
    _z_of_k_list,
)


def _load_opacus_rdp():
    """opacus' RDP analysis module (``opacus.accountants.analysis.rdp``).

    ``import opacus`` imports torch (several seconds). The RDP module itself only needs math,
    numpy and scipy, so when torch is not loaded yet we execute the installed opacus file directly
    under a private module name; otherwise (or if anything looks different) we import it normally.
    """
    import importlib.util
    import os
    import sys

    if "opacus" not in sys.modules and "torch" not in sys.modules:
        try:
            spec = importlib.util.find_spec("opacus")
            if spec is not None and spec.origin:
                path = os.path.join(os.path.dirname(spec.origin), "accountants", "analysis", "rdp.py")
                fspec = importlib.util.spec_from_file_location("_fedpower_opacus_rdp", path)
                mod = importlib.util.module_from_spec(fspec)
                fspec.loader.exec_module(mod)
                if callable(getattr(mod, "compute_rdp", None)) and callable(
                    getattr(mod, "get_privacy_spent", None)
                ):
                    return mod
        except Exception:  # pragma: no cover - fall back to the regular import
            pass
    from opacus.accountants.analysis import rdp

    return rdp


_opacus_rdp = _load_opacus_rdp()

#: dp_accounting's default RDP orders (opacus' default list stops at 63 and lacks 11).
ORDERS: tuple = tuple(
    [1 + x / 10.0 for x in range(1, 100)] + list(range(11, 64)) + [128, 256, 512, 1024]
)


def _orders_tuple(orders: Iterable[float]) -> tuple:
    t = tuple(float(a) for a in orders)
    if not t:
        raise ValueError("orders must be a non-empty list of RDP orders > 1")
    if any(not (a > 1) or not math.isfinite(a) for a in t):
        raise ValueError(f"every RDP order must be a finite number > 1, got {list(orders)}")
    return t


def _as_curve(values: Sequence[float], num_orders: int, name: str, suffix: str = "") -> np.ndarray:
    """``values`` as a float array of one RDP value per order (ValueError naming ``name`` otherwise)."""
    vec = np.asarray(values, dtype=float)
    if vec.shape != (num_orders,):
        raise ValueError(f"{name} has shape {vec.shape}, expected ({num_orders},){suffix}")
    return vec


@functools.lru_cache(maxsize=4096)
def _rdp_sgm_cached(q: float, z: float, orders: tuple) -> tuple:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = _opacus_rdp.compute_rdp(q=q, noise_multiplier=z, steps=1, orders=list(orders))
    return tuple(float(x) for x in np.atleast_1d(r))


def rdp_sgm(q: float, z: float, orders: Sequence[float] = ORDERS) -> np.ndarray:
    """RDP of one Poisson sampled Gaussian mechanism (opacus ``compute_rdp``, steps=1).

    ``z <= 0`` means no noise (infinite RDP); ``z = inf`` or ``q = 0`` means zero RDP.
    """
    qq = _check_prob(q, "q (sampling rate)", allow_zero=True)
    ords = _orders_tuple(orders)
    zz = float(z)
    if math.isnan(zz):
        raise ValueError("z (noise multiplier) must not be NaN")
    if qq == 0.0 or zz == math.inf:
        return np.zeros(len(ords))
    if zz <= 0:
        return np.full(len(ords), np.inf)
    return np.array(_rdp_sgm_cached(qq, zz, ords), dtype=float)


def _two_stage(q_c: float, inner: np.ndarray, orders: tuple) -> np.ndarray:
    a = np.asarray(orders, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        log_stay = np.log1p(-q_c) if q_c < 1 else -np.inf
        out = np.logaddexp(log_stay, math.log(q_c) + (a - 1.0) * inner) / (a - 1.0)
    out = np.where(np.isinf(inner), np.inf, out)
    return out


def round_rdp(
    level: str,
    z: float,
    *,
    q_c: float,
    pi: Optional[float] = None,
    sample_mode: str = "two-stage",
    orders: Sequence[float] = ORDERS,
) -> np.ndarray:
    """Per-round RDP curve for effective multiplier ``z``.

    * client level: ``SGM(q_c, z)``;
    * sample level, two-stage: ``log(1 - q_c + q_c exp((a-1) eps_SGM(a; pi, z)))/(a-1)``;
    * sample level, product: ``SGM(q_c*pi, z)`` (paper-comparable, not proven).
    """
    lvl, qc, p, mode = _check_round_sampling(level, q_c, pi, sample_mode)
    ords = _orders_tuple(orders)
    if lvl == "client":
        return rdp_sgm(qc, z, ords)
    if mode == "product":
        return rdp_sgm(qc * p, z, ords)
    return _two_stage(qc, rdp_sgm(p, z, ords), ords)


def round_rdp_k_mixture(
    z_of_k: Union[Callable[[int], float], Sequence[float]],
    *,
    q_c: float,
    pi: float,
    num_clients: int,
    sample_mode: str = "two-stage",
    orders: Sequence[float] = ORDERS,
) -> np.ndarray:
    """Sample-level per-round RDP for FIXED noise with a k-dependent effective multiplier z(k).

    Spec section 4.2 step 4: given that the target's client participates, the number of aggregated
    clients is ``k = 1 + Binomial(N-1, q_c)``, so (two-stage, revealed client set)
    ``eps(a) = log(1 - q_c + sum_k q_c Binom(k-1; N-1, q_c) exp((a-1) eps_SGM(a; pi, z(k))))/(a-1)``.

    ``z_of_k`` is a callable ``k -> z`` or a sequence of z for k = 1..N. With
    ``sample_mode="product"`` there is no mixture formula; the worst case ``min_k z(k)`` is used in
    ``SGM(q_c*pi, .)``.
    """
    qc = _check_prob(q_c, "q_c (client_rate)")
    p = _check_prob(pi, "pi", allow_zero=True)
    N = _check_num_clients(num_clients)
    ords = _orders_tuple(orders)
    zs = _z_of_k_list(z_of_k, N)
    mode = _check_sample_mode(sample_mode)
    if mode == "product":
        return rdp_sgm(qc * p, min(zs), ords)
    a = np.asarray(ords, dtype=float)
    w = _binom_weights(N, qc)
    terms = []
    for wk, zk in zip(w, zs):
        if wk <= 0:
            continue
        inner = rdp_sgm(p, zk, ords)
        with np.errstate(invalid="ignore"):
            terms.append(math.log(qc) + math.log(wk) + (a - 1.0) * inner)
    if qc < 1:
        terms.append(np.full(len(ords), math.log1p(-qc)))
    stacked = np.vstack(terms)
    with np.errstate(invalid="ignore"):
        out = np.logaddexp.reduce(stacked, axis=0) / (a - 1.0)
    return np.where(np.isnan(out), np.inf, out)


def rdp_to_epsilon(rdp_vec: Sequence[float], delta: float, orders: Sequence[float] = ORDERS) -> tuple:
    """Convert an RDP curve to (epsilon, best_order) with opacus ``get_privacy_spent``."""
    d = float(delta)
    if not (0 < d < 1):
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    ords = _orders_tuple(orders)
    vec = _as_curve(rdp_vec, len(ords), "rdp_vec", " to match orders")
    if np.all(vec == 0):
        return 0.0, float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eps, order = _opacus_rdp.get_privacy_spent(orders=list(ords), rdp=vec, delta=d)
    eps = float(eps)
    if math.isnan(eps):
        eps = math.inf
    return max(eps, 0.0), float(order)
