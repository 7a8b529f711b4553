"""The accountant interface (in the style of opacus ``accountants/``) and its RDP and PLD implementations.

A :class:`RoundEvent` describes what one round releases, as far as privacy goes: a Poisson
subsampled Gaussian (client level, or sample level "product"), the two-stage mixture
``(1-q_c) id + q_c SGM(pi, z)`` (sample level), or a mixture over the number k of aggregated
clients (fixed noise at sample level). An :class:`Accountant` composes events and answers
``epsilon(delta)``:

* :class:`RdpAccountant`: sums opacus RDP curves (:mod:`.rdp`);
* :class:`PldAccountant`: composes dp_accounting privacy-loss distributions (:mod:`.pld`).

Calibration and the ledger compose rounds only through this interface; :func:`make_accountant`
builds one from the plan's ``accountant`` ("rdp" / "pld"). What stays PLD-specific there is the
choice of the discretisation interval (memory guard) and the PLD search bracketed around the RDP
solution.
"""

from __future__ import annotations

import abc
import math
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from ._common import ACCOUNTANTS, _norm_name
from .pld import DEFAULT_PLD_INTERVAL, DEFAULT_PLD_MAX_POINTS, pld_epsilon, round_pld, round_pld_k_mixture
from .rdp import ORDERS, _as_curve, _orders_tuple, rdp_to_epsilon, round_rdp, round_rdp_k_mixture


@dataclass(frozen=True)
class RoundEvent:
    """One round's mechanism. Hashable: accountants cache per-event curves/PLDs.

    ``level``/``q_c``/``pi``/``sample_mode`` describe the sampling (``pi`` only at sample level).
    Exactly one of ``z`` (effective noise multiplier of the round) and ``z_of_k`` (fixed noise with
    a random number of aggregated clients: z for k = 1..N, sample level) is given.
    """

    level: str
    q_c: float
    pi: Optional[float]
    sample_mode: str
    z: Optional[float] = None
    z_of_k: Optional[tuple] = None

    def __post_init__(self) -> None:
        if (self.z is None) == (self.z_of_k is None):
            raise ValueError("a RoundEvent needs exactly one of z and z_of_k")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["z_of_k"] = None if self.z_of_k is None else list(self.z_of_k)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "RoundEvent":
        zk = d.get("z_of_k")
        return cls(**{**d, "z_of_k": None if zk is None else tuple(float(z) for z in zk)})


#: ``RoundEvent.sample_mode`` of one DP-SGD step (see :func:`dp_sgd_step`).
DP_SGD_STEP = "dp-sgd-step"


def dp_sgd_step(sample_rate: float, noise_multiplier: float) -> RoundEvent:
    """One DP-SGD step on a silo's data: Poisson sampling of examples at rate q = b/n, the clipped
    sum noised at multiplier σ, i.e. the subsampled Gaussian SGM(q, σ) under add/remove of one
    example. A silo's trained round is this event composed L times. It is the same mechanism as a
    client-level round (SGM(q_c, z) over silos), so both accountants price it with their
    client-level curve; ``sample_mode`` marks it as a step over examples."""
    return RoundEvent(level="client", q_c=float(sample_rate), pi=None, sample_mode=DP_SGD_STEP,
                      z=float(noise_multiplier))


def _composition_order(event: RoundEvent) -> tuple:
    """Order in which :meth:`PldAccountant.compose_all` composes distinct events.

    k-mixtures first, then single-z events by ``repr(z)``: the order the accountant has always
    used. PLD composition (FFT convolutions) is not bitwise commutative, so changing the order
    would change the last digits of the calibrated epsilon.
    """
    return (0, repr(event.z_of_k)) if event.z_of_k is not None else (1, repr(event.z))


def _json_float(x: float):
    x = float(x)
    if math.isnan(x):
        return None
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def _from_json_float(x) -> float:
    if x is None:
        return math.nan
    return float(x)  # also parses "inf" / "-inf"


class Accountant(abc.ABC):
    """Composes round events and reports the epsilon spent (cf. opacus ``IAccountant``)."""

    #: "rdp" or "pld" (the plan's ``accountant``); checked by :meth:`load_state_dict`.
    name: str = ""

    @abc.abstractmethod
    def compose(self, event: RoundEvent, count: int = 1) -> None:
        """Compose ``event`` ``count`` times onto what has been spent."""

    def compose_all(self, events: Iterable[tuple]) -> None:
        """Compose ``(event, count)`` pairs, in the given order."""
        for event, count in events:
            self.compose(event, count)

    @abc.abstractmethod
    def epsilon(self, delta: float) -> float:
        """epsilon spent so far at ``delta`` (0 before the first event)."""

    @abc.abstractmethod
    def epsilon_after(self, event: RoundEvent, delta: float) -> float:
        """epsilon if ``event`` were composed once more (nothing is composed)."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """Number of rounds composed so far."""

    @abc.abstractmethod
    def state_dict(self) -> dict:
        """JSON-able state (strict JSON: inf is stored as the string "inf")."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` saved (into an accountant built with the same settings)."""

    def _check_state(self, state: Any) -> None:
        if not isinstance(state, dict) or state.get("mechanism") != self.name:
            got = state.get("mechanism") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"not a {self.name} accountant state (mechanism {got!r})")


#: Per-event RDP curves shared by every RdpAccountant of the process (read-only arrays; bounded):
#: calibration builds many short-lived accountants over the same events.
_SHARED_CURVES: dict = {}


class RdpAccountant(Accountant):
    """Sum of per-round RDP curves over fixed orders; epsilon by opacus ``get_privacy_spent``.

    Besides events it accepts ready-made curves (:meth:`compose_curve`): the ledger records the
    curve its caller released with.
    """

    name = "rdp"

    def __init__(self, orders: Sequence[float] = ORDERS) -> None:
        self.orders = _orders_tuple(orders)
        self.rdp = np.zeros(len(self.orders))
        self.steps = 0
        self._curves: dict = {}

    def curve(self, event: RoundEvent) -> np.ndarray:
        """Per-round RDP curve of ``event`` (a fresh array; callers may modify it)."""
        if event not in self._curves:
            shared = _SHARED_CURVES.get((event, self.orders))
            if shared is not None:  # computed by another accountant of this process (calibration)
                self._curves[event] = shared
            elif event.z_of_k is not None:
                self._curves[event] = round_rdp_k_mixture(
                    event.z_of_k, q_c=event.q_c, pi=event.pi, num_clients=len(event.z_of_k),
                    sample_mode=event.sample_mode, orders=self.orders,
                )
            else:
                self._curves[event] = round_rdp(event.level, event.z, q_c=event.q_c, pi=event.pi,
                                                sample_mode=event.sample_mode, orders=self.orders)
            if len(_SHARED_CURVES) < 4096:
                _SHARED_CURVES[(event, self.orders)] = self._curves[event]
        return self._curves[event].copy()

    def compose(self, event: RoundEvent, count: int = 1) -> None:
        self.compose_curve(self.curve(event), count)

    def compose_curve(self, rdp_vec: Sequence[float], count: int = 1) -> None:
        """Add ``count`` times a per-round RDP curve over :attr:`orders`."""
        vec = _as_curve(rdp_vec, len(self.orders), "rdp_vec")
        self.rdp = self.rdp + count * vec
        self.steps += int(count)

    def epsilon_and_order(self, delta: float) -> tuple:
        """(epsilon, best RDP order) spent so far; (0, nan) before the first round."""
        if not self.steps:
            return 0.0, math.nan
        return rdp_to_epsilon(self.rdp, delta, self.orders)

    def epsilon(self, delta: float) -> float:
        return float(self.epsilon_and_order(delta)[0])

    def epsilon_after(self, event: RoundEvent, delta: float) -> float:
        return self.epsilon_after_curve(self.curve(event), delta)

    def epsilon_after_curve(self, rdp_vec: np.ndarray, delta: float) -> float:
        """epsilon if the curve ``rdp_vec`` were added once more."""
        return rdp_to_epsilon(self.rdp + rdp_vec, delta, self.orders)[0]

    def __len__(self) -> int:
        return self.steps

    def state_dict(self) -> dict:
        return {"mechanism": self.name, "orders": list(self.orders),
                "rdp": [_json_float(x) for x in self.rdp], "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self._check_state(state)
        if [float(a) for a in state["orders"]] != list(self.orders):
            raise ValueError("RDP accountant state uses different RDP orders")
        rdp = np.array([_from_json_float(x) for x in state["rdp"]], dtype=float)
        self.rdp = _as_curve(rdp, len(self.orders), "RDP accountant state rdp")
        self.steps = int(state["steps"])


class PldAccountant(Accountant):
    """Composition of dp_accounting PLDs at one value discretisation interval.

    Each distinct event's PLD is built once. :meth:`epsilon_after` keeps the composed candidate, so
    the usual "check, then compose the same event" costs one composition, not two.
    """

    name = "pld"

    def __init__(self, value_discretization_interval: float = DEFAULT_PLD_INTERVAL,
                 max_grid_points: int = DEFAULT_PLD_MAX_POINTS) -> None:
        self.value_discretization_interval = float(value_discretization_interval)
        self.max_grid_points = max_grid_points
        self.pld = None  # the composed PrivacyLossDistribution (None before the first round)
        self.history: list = []  # [(event, count)] in composition order: replayed by load_state_dict
        self._plds: dict = {}
        self._eps: Optional[tuple] = None  # (delta, epsilon of self.pld)
        self._pending: Optional[tuple] = None  # (len(history), event, composed pld, delta, epsilon)

    def round_pld(self, event: RoundEvent):
        """PLD of one round of ``event`` (cached)."""
        if event not in self._plds:
            vdi = self.value_discretization_interval
            if event.z_of_k is not None:
                self._plds[event] = round_pld_k_mixture(
                    event.z_of_k, q_c=event.q_c, pi=event.pi, num_clients=len(event.z_of_k),
                    sample_mode=event.sample_mode, value_discretization_interval=vdi,
                    max_grid_points=self.max_grid_points,
                )
            else:
                self._plds[event] = round_pld(
                    event.level, event.z, q_c=event.q_c, pi=event.pi, sample_mode=event.sample_mode,
                    value_discretization_interval=vdi, max_grid_points=self.max_grid_points,
                )
        return self._plds[event]

    def _composed_with(self, event: RoundEvent, count: int):
        p = self.round_pld(event)
        part = p if count == 1 else p.self_compose(count)
        return part if self.pld is None else self.pld.compose(part)

    def compose(self, event: RoundEvent, count: int = 1) -> None:
        pending = self._pending
        if count == 1 and pending is not None and pending[:2] == (len(self.history), event):
            self.pld, self._eps = pending[2], (pending[3], pending[4])
        else:
            self.pld, self._eps = self._composed_with(event, count), None
        self._pending = None
        self.history.append((event, int(count)))

    def compose_all(self, events: Iterable[tuple]) -> None:
        """Compose ``(event, count)`` pairs, identical events merged into one self-composition.

        ``self_compose(n1 + n2)`` is cheaper and no less accurate than composing two
        self-compositions; distinct events are composed in a fixed order (``_composition_order``).
        """
        counts: dict = {}
        for event, count in events:
            counts[event] = counts.get(event, 0) + count
        for event in sorted(counts, key=_composition_order):
            if counts[event] > 0:
                self.compose(event, counts[event])

    def epsilon(self, delta: float) -> float:
        if self.pld is None:
            return 0.0
        if self._eps is None or self._eps[0] != delta:
            self._eps = (delta, pld_epsilon(self.pld, delta))
        return self._eps[1]

    def epsilon_after(self, event: RoundEvent, delta: float) -> float:
        n = len(self.history)
        pending = self._pending
        if pending is None or pending[:2] != (n, event) or pending[3] != delta:
            cand = self._composed_with(event, 1)
            self._pending = pending = (n, event, cand, delta, pld_epsilon(cand, delta))
        return pending[4]

    def __len__(self) -> int:
        return sum(count for _, count in self.history)

    def state_dict(self) -> dict:
        # A PLD is not serialisable; its history is, and replaying it rebuilds the same PLD.
        return {"mechanism": self.name, "value_discretization_interval": self.value_discretization_interval,
                "history": [[event.to_dict(), count] for event, count in self.history]}

    def load_state_dict(self, state: dict) -> None:
        self._check_state(state)
        if float(state["value_discretization_interval"]) != self.value_discretization_interval:
            raise ValueError("PLD accountant state uses a different value_discretization_interval")
        self.pld, self.history, self._eps, self._pending = None, [], None, None
        for event, count in state["history"]:
            self.compose(RoundEvent.from_dict(event), int(count))


def make_accountant(name: str, *, orders: Sequence[float] = ORDERS,
                    value_discretization_interval: float = DEFAULT_PLD_INTERVAL) -> Accountant:
    """The accountant called ``name`` ("rdp" or "pld"); each uses only its own keyword."""
    if _norm_name(name, ACCOUNTANTS, "accountant") == "rdp":
        return RdpAccountant(orders)
    return PldAccountant(value_discretization_interval)
