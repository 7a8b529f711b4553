"""PLD math: dp_accounting privacy-loss distributions of fedpower rounds, with memory guards.

Stateless functions over ``dp_accounting.pld`` (pessimistic estimates, add/remove adjacency):

* :func:`round_pld` / :func:`round_pld_k_mixture`: one round, the PLD analogues of
  :func:`~fedpower_app.privacy.accounting.rdp.round_rdp` / ``round_rdp_k_mixture``;
* :func:`pld_epsilon`: epsilon of a (composed) PLD, robust to dp_accounting's overflow at large epsilon;
* :func:`pld_grid_points` / :func:`safe_discretization_interval`: the memory guard. A PLD at tiny
  noise (paper-mode z ~ 0.05) would need millions of grid points, so builds are refused
  (spec section 5) or the discretisation is coarsened (still a valid, looser upper bound).

The stateful composition of rounds is :class:`~fedpower_app.privacy.accounting.interface.PldAccountant`.
"""

from __future__ import annotations

import math
import warnings
from typing import Callable, Optional, Sequence, Union

from ._common import (
    _check_round_sampling,
    _binom_weights,
    _check_num_clients,
    _check_prob,
    _check_sample_mode,
    _z_of_k_list,
)

#: Default PLD discretisation (the spec uses 1e-4; 1e-3 is ~10x faster and within ~1e-3 rel.).
DEFAULT_PLD_INTERVAL = 1e-3
#: Memory guard (spec section 5): refuse to build ONE round's PLD with more (estimated) grid points.
DEFAULT_PLD_MAX_POINTS = 1_000_000
#: Internal evaluations coarsen the interval for tiny noise (z < 0.3) so one round's PLD has at
#: most max(this, points of a z = 0.3 PLD at the requested interval): keeps paper-mode evaluations
#: (z ~ 0.05) at seconds instead of minutes/GBs. Never triggers for z >= 0.3.
_AUTO_MAX_POINTS = 50_000


def _pld_module():
    # Imported on first use: dp_accounting is only needed with the PLD accountant.
    from dp_accounting.pld import privacy_loss_distribution as pld

    return pld


def pld_grid_points(z: float, value_discretization_interval: float) -> float:
    """Rough number of grid points of one Gaussian/SGM privacy-loss distribution.

    The privacy loss of N(0, z^2) vs N(1, z^2), truncated at ~10 std (log-mass bound -50), spans
    about ``2*(10/z + 1/(2 z^2))``. Used only as a memory guard (spec section 5).
    """
    zz = float(z)
    if zz == math.inf:
        return 1.0
    if not zz > 0:
        return math.inf
    return 2.0 * (10.0 / zz + 1.0 / (2.0 * zz * zz) + 1.0) / float(value_discretization_interval)


def safe_discretization_interval(
    z_min: float,
    value_discretization_interval: float = DEFAULT_PLD_INTERVAL,
    max_grid_points: int = DEFAULT_PLD_MAX_POINTS,
) -> float:
    """Coarsen the PLD discretisation so one round's PLD at ``z_min`` has <= max_grid_points.

    Coarser pessimistic discretisation is still a valid upper bound, only looser.
    """
    vdi = float(value_discretization_interval)
    if not (vdi > 0 and math.isfinite(vdi)):
        raise ValueError(f"value_discretization_interval must be > 0, got {value_discretization_interval!r}")
    pts = pld_grid_points(z_min, vdi)
    if pts <= max_grid_points:
        return vdi
    if math.isinf(pts):
        raise ValueError("cannot build a PLD without noise (z <= 0)")
    return vdi * pts / float(max_grid_points)


def _auto_vdi(z_min: float, vdi: float) -> float:
    """The interval internal evaluations use for noise down to ``z_min`` (see ``_AUTO_MAX_POINTS``)."""
    cap = max(_AUTO_MAX_POINTS, int(pld_grid_points(0.3, vdi)) + 1)
    return safe_discretization_interval(z_min, vdi, cap)


def _guard(z: float, vdi: float, max_grid_points: int) -> None:
    pts = pld_grid_points(z, vdi)
    if pts > max_grid_points:
        raise ValueError(
            f"PLD at z={z:.4g} with value_discretization_interval={vdi:g} needs ~{pts:.3g} grid points "
            f"(> max_grid_points={max_grid_points}); use a coarser interval "
            f"(safe_discretization_interval gives {safe_discretization_interval(z, vdi, max_grid_points):.3g}) "
            "or the RDP accountant"
        )


def _sgm_pld(q: float, z: float, vdi: float):
    pld = _pld_module()
    if q == 0.0 or z == math.inf:
        return pld.identity(value_discretization_interval=vdi)
    return pld.from_gaussian_mechanism(
        standard_deviation=z, sampling_prob=q, value_discretization_interval=vdi
    )


def round_pld(
    level: str,
    z: float,
    *,
    q_c: float,
    pi: Optional[float] = None,
    sample_mode: str = "two-stage",
    value_discretization_interval: float = DEFAULT_PLD_INTERVAL,
    max_grid_points: int = DEFAULT_PLD_MAX_POINTS,
):
    """dp_accounting PrivacyLossDistribution of one round (pessimistic, add/remove).

    * client level / sample product: ``from_gaussian_mechanism(z, sampling_prob=q)``;
    * sample two-stage: ``SGM(pi, z).compute_mixture(identity, q_c)``.

    Raises ValueError instead of allocating a huge grid (tiny z; spec section 5 memory pitfall).
    """
    lvl, qc, p, mode = _check_round_sampling(level, q_c, pi, sample_mode)
    zz = float(z)
    if not zz > 0:
        raise ValueError(f"z (noise multiplier) must be > 0 for a PLD, got {z!r}")
    vdi = float(value_discretization_interval)
    _guard(zz, vdi, max_grid_points)
    if lvl == "client":
        return _sgm_pld(qc, zz, vdi)
    if mode == "product":
        return _sgm_pld(qc * p, zz, vdi)
    inner = _sgm_pld(p, zz, vdi)
    if qc >= 1.0:
        return inner
    return inner.compute_mixture(_pld_module().identity(value_discretization_interval=vdi), qc)


def round_pld_k_mixture(
    z_of_k: Union[Callable[[int], float], Sequence[float]],
    *,
    q_c: float,
    pi: float,
    num_clients: int,
    sample_mode: str = "two-stage",
    value_discretization_interval: float = DEFAULT_PLD_INTERVAL,
    max_grid_points: int = DEFAULT_PLD_MAX_POINTS,
):
    """PLD analogue of :func:`~fedpower_app.privacy.accounting.rdp.round_rdp_k_mixture` (mixture over k of SGM(pi, z(k)) PLDs)."""
    qc = _check_prob(q_c, "q_c (client_rate)")
    p = _check_prob(pi, "pi", allow_zero=True)
    N = _check_num_clients(num_clients)
    zs = _z_of_k_list(z_of_k, N)
    vdi = float(value_discretization_interval)
    if any(not zk > 0 for zk in zs):
        raise ValueError(f"every z(k) must be > 0 for a PLD, got {zs}")
    _guard(min(zs), vdi, max_grid_points)
    if _check_sample_mode(sample_mode) == "product":
        return _sgm_pld(qc * p, min(zs), vdi)
    w = _binom_weights(N, qc)
    items = [(wk, zk) for wk, zk in zip(w, zs) if wk > 1e-300]
    # Build sum_k w_k PLD(z_k) from the tail: M = w_k/(w_k + rest) * PLD_k + (rest share) * M.
    mix = None
    rest = 0.0
    for wk, zk in reversed(items):
        comp = _sgm_pld(p, zk, vdi)
        if mix is None:
            mix, rest = comp, wk
        else:
            mix = comp.compute_mixture(mix, wk / (wk + rest))
            rest += wk
    if qc >= 1.0:
        return mix
    return mix.compute_mixture(_pld_module().identity(value_discretization_interval=vdi), qc)


def pld_epsilon(pld, delta: float) -> float:
    """epsilon of a (composed) PLD at ``delta`` (dp_accounting ``get_epsilon_for_delta``).

    For epsilon above ~700, ``get_epsilon_for_delta`` overflows (``exp(-loss)`` underflows) and
    returns inf. In that case epsilon is found by bisection on the library's
    ``get_delta_for_epsilon`` (monotone in epsilon), returning the upper end of the bracket.
    """
    d = float(delta)
    if not (0 < d < 1):
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        eps = float(pld.get_epsilon_for_delta(d))
        if not math.isinf(eps):
            return eps
        hi = 1.0
        while float(pld.get_delta_for_epsilon(hi)) > d:
            hi *= 2.0
            if hi > 1e9:
                return math.inf  # genuinely infinite (e.g. infinity mass > delta)
        lo = hi / 2.0 if hi > 1.0 else 0.0
        while hi - lo > 1e-10 * hi:
            mid = 0.5 * (lo + hi)
            if float(pld.get_delta_for_epsilon(mid)) > d:
                lo = mid
            else:
                hi = mid
        return hi
