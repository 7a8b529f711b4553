"""The server's privacy ledger: the privacy actually spent by the rounds that were released.

:class:`PrivacyLedger` follows a :class:`~fedpower_app.privacy.accounting.calibration.Calibration` during
training: the noise std of each block, the epsilon a release would reach (so the server stops
BEFORE crossing the budget, :class:`PrivacyBudgetExceeded`), and a JSON-able checkpoint
(``state_dict`` / ``load_state_dict``, format version 1). It composes rounds through the same
accountants and round events as the calibration, so after the planned schedule its epsilon equals
the calibrated one bit for bit.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ._common import _check_round_type, _is_int
from .calibration import Calibration, calibrate
from .interface import RdpAccountant, RoundEvent, make_accountant
from .plan import PrivacyPlan, _type_z, block_sensitivities, noise_stds, round_event
from .rdp import ORDERS, _as_curve, _orders_tuple


class PrivacyBudgetExceeded(RuntimeError):
    """Raised by :meth:`PrivacyLedger.assert_can_release` when a release would cross the budget."""


class PrivacyLedger:
    """Tracks the privacy actually spent by the rounds that happened.

    Usage by the server, each round t (BEFORE releasing)::

        vec = ledger.rdp_for_round(round_type)
        if ledger.would_exceed(vec, round_type=round_type):
            stop training with ledger.exceed_message(round_type, t)
        stds = ledger.noise_stds_for_round(round_type, k=k)   # realised k at sample level
        ... release ...
        ledger.record(round_type, ledger.z_for_round(round_type), vec, t, clients_sampled=k)

    (or ``vec = ledger.assert_can_release(round_type, t)``, which raises
    :class:`PrivacyBudgetExceeded`).

    Budget: ``plan.epsilon`` in rigorous / fixed-z mode. In paper mode it is the planned TRUE
    epsilon of the paper noise (``calibration.epsilon``, +1e-6 relative slack), so a paper run can
    reach its planned T but not go past it. The RDP epsilon of the history is always tracked; with
    ``accountant="pld"`` the decision uses the PLD of the history, composed round by round in the
    same order (and with the same discretisation) as the calibration's trajectory, so the ledger
    after the planned schedule equals ``calibration.epsilon``.
    """

    def __init__(self, plan: PrivacyPlan, calibration: Optional[Calibration] = None, *,
                 budget: Optional[float] = None, orders: Sequence[float] = ORDERS) -> None:
        if not isinstance(plan, PrivacyPlan):
            raise ValueError(f"plan must be a PrivacyPlan, got {type(plan).__name__}")
        self.plan = plan
        self.calibration = calibration if calibration is not None else calibrate(plan)
        self.orders = _orders_tuple(orders)
        if budget is None:
            budget = (self.calibration.epsilon * (1 + 1e-6) if self.calibration.mode == "paper"
                      else plan.epsilon)
        b = float(budget)
        if not (b > 0):
            raise ValueError(f"budget must be > 0, got {budget!r}")
        self.budget = b
        self.history: list = []
        self._vdi = self.calibration.pld_interval or plan.pld_interval
        self._reset_accountants()

    def _reset_accountants(self) -> None:
        # The accountant whose epsilon decides (the plan's), and an RDP accountant of the curves
        # the caller recorded: the RDP epsilon is reported with either accountant.
        self._accountant = make_accountant(self.plan.accountant, orders=self.orders,
                                           value_discretization_interval=self._vdi)
        self._rdp = (self._accountant if isinstance(self._accountant, RdpAccountant)
                     else RdpAccountant(self.orders))

    # ---- noise of a round ------------------------------------------------------------------
    def _noise(self, round_type: str, z: Optional[float]) -> tuple:
        if self.calibration.mode == "paper":
            return ("sigma", float(self.calibration.sigma_alg))
        return ("z", float(self.calibration.z if z is None else z))

    def _event(self, round_type: str, z: Optional[float]) -> RoundEvent:
        return round_event(self.plan, round_type, self._noise(round_type, z))

    def z_for_round(self, round_type: str) -> float:
        """Effective z of a round of this type (paper mode: worst case k = 1)."""
        return _type_z(self.plan, _check_round_type(round_type), self._noise(round_type, None))

    def noise_stds_for_round(self, round_type: str, k: Optional[int] = None) -> list:
        """Per-block noise std the server must use this round (at sample level pass the fixed m = q_c N)."""
        rt = _check_round_type(round_type)
        if self.calibration.mode == "paper":
            n = len(self.plan.sensitivities(rt))
            return [float(self.calibration.sigma_alg) * self.plan.clip] * n
        return self.plan.stds(rt, self.calibration.z, k)

    def rdp_for_round(self, round_type: str, z: Optional[float] = None) -> np.ndarray:
        """Per-round RDP curve of a round of this type under the plan (rigorous: same for all types)."""
        return self._rdp.curve(self._event(_check_round_type(round_type), z))

    # ---- queries ---------------------------------------------------------------------------
    def epsilon_rdp(self) -> tuple:
        """(epsilon, best order) spent so far, RDP."""
        return self._rdp.epsilon_and_order(self.plan.delta)

    def epsilon_pld(self) -> Optional[float]:
        """epsilon spent so far by PLD composition of the history (None unless accountant is pld)."""
        if self.plan.accountant != "pld":
            return None
        return float(self._accountant.epsilon(self.plan.delta))

    def epsilon(self) -> float:
        """epsilon spent so far under the plan's accountant."""
        return float(self._accountant.epsilon(self.plan.delta))

    def epsilon_at(self, delta: float) -> float:
        """epsilon spent so far at another ``delta``: the ledger's whole claimed privacy profile
        (what an audit tests, ``fedpower_app.audit.fdp_bound.profile_rejected``)."""
        return float(self._accountant.epsilon(delta))

    @property
    def rounds_recorded(self) -> int:
        return len(self.history)

    def _next_type(self) -> str:
        sched = self.plan.schedule
        t = len(self.history)
        return sched[t] if t < len(sched) else sched[-1]

    def epsilon_if_released(self, round_rdp_vec: Sequence[float], *, round_type: Optional[str] = None,
                            z: Optional[float] = None) -> float:
        """epsilon after one more release with per-round RDP ``round_rdp_vec``.

        With the PLD accountant the round's PLD is built from ``round_type`` (default: the next
        scheduled type; past T the last scheduled type) and ``z`` (default: the calibrated z).
        """
        vec = _as_curve(round_rdp_vec, len(self.orders), "round_rdp_vec")
        if self._accountant is self._rdp:
            # RDP decides on the curve the caller will record, whatever round it describes.
            return self._rdp.epsilon_after_curve(vec, self.plan.delta)
        rt = _check_round_type(round_type) if round_type is not None else self._next_type()
        return self._accountant.epsilon_after(self._event(rt, z), self.plan.delta)

    def would_exceed(self, round_rdp_vec: Sequence[float], *, round_type: Optional[str] = None,
                     z: Optional[float] = None) -> bool:
        """True if releasing one more round would make the spent epsilon exceed the budget."""
        # 1e-9 relative slack: float noise between composition orders, far below PLD/RDP accuracy.
        return self.epsilon_if_released(round_rdp_vec, round_type=round_type, z=z) > self.budget * (1 + 1e-9)

    def exceed_message(self, round_type: str, round_index: int) -> str:
        vec = self.rdp_for_round(round_type)
        e_next = self.epsilon_if_released(vec, round_type=round_type)
        return (
            f"privacy budget exhausted: releasing round {round_index} ({round_type}) would raise epsilon "
            f"from {self.epsilon():.4f} to {e_next:.4f} > budget {self.budget:.4f} "
            f"(delta={self.plan.delta:g}, {self.plan.level} level, {self.plan.accountant}); "
            f"stopping after {len(self.history)} released rounds"
        )

    def assert_can_release(self, round_type: str, round_index: int) -> np.ndarray:
        """Return the round's RDP vector, or raise PrivacyBudgetExceeded with a clear message."""
        vec = self.rdp_for_round(round_type)
        if self.would_exceed(vec, round_type=round_type):
            raise PrivacyBudgetExceeded(self.exceed_message(round_type, round_index))
        return vec

    # ---- updates ---------------------------------------------------------------------------
    def record(self, round_type: str, z: float, rdp_vec: Sequence[float], round_index: int,
               clients_sampled: Optional[int] = None) -> float:
        """Record a round that WAS released (noise is released even when k = 0). Returns epsilon."""
        rt = _check_round_type(round_type)
        vec = _as_curve(rdp_vec, len(self.orders), "rdp_vec")
        zz = float(z)
        if not zz > 0:
            raise ValueError(f"z must be > 0, got {z!r}")
        if not _is_int(round_index):
            raise ValueError(f"round_index must be an integer, got {round_index!r}")
        if clients_sampled is not None and (not _is_int(clients_sampled) or int(clients_sampled) < 0):
            raise ValueError(f"clients_sampled must be a non-negative integer, got {clients_sampled!r}")
        entry = {
            "round_index": int(round_index),
            "round_type": rt,
            "z": zz,
            "clients_sampled": None if clients_sampled is None else int(clients_sampled),
        }
        self._apply(entry, vec)
        entry["epsilon"] = self.epsilon()
        return entry["epsilon"]

    def _apply(self, entry: dict, vec: Optional[np.ndarray]) -> None:
        if self._accountant is not self._rdp:
            # PLD of the recorded z (rigorous / fixed-z); paper mode: the calibrated sigma_alg.
            z = entry["z"] if self.calibration.mode != "paper" else None
            self._accountant.compose(self._event(entry["round_type"], z))
        if vec is not None:
            self._rdp.compose_curve(vec)
        self.history.append(entry)

    # ---- checkpointing ---------------------------------------------------------------------
    def state_dict(self) -> dict:
        """JSON-able state (strict JSON: inf is stored as the string "inf")."""
        rdp = self._rdp.state_dict()
        return {
            "version": 1,
            "plan": self.plan.to_dict(),
            "calibration": self.calibration.to_dict(),
            "budget": self.budget,
            "orders": rdp["orders"],
            "rdp_sum": rdp["rdp"],
            "history": [dict(e) for e in self.history],
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore the history saved by :meth:`state_dict` (the plan must be identical)."""
        if not isinstance(state, dict) or state.get("version") != 1:
            raise ValueError("not a PrivacyLedger state dict (version 1)")
        if state.get("plan") != self.plan.to_dict():
            raise ValueError("ledger state was saved for a different PrivacyPlan; refusing to resume")
        if [float(a) for a in state["orders"]] != list(self.orders):
            raise ValueError("ledger state uses different RDP orders")
        self.budget = float(state["budget"])
        self.history = []
        self._reset_accountants()
        for e in state["history"]:
            self._apply(dict(e), None)  # replays the PLD composition (if any)
        # The RDP sum is stored, not replayed: it is the sum of the curves the caller recorded.
        if len(state["rdp_sum"]) != len(self.orders):
            raise ValueError("ledger state rdp_sum does not match the RDP orders")
        self._rdp.load_state_dict({"mechanism": "rdp", "orders": state["orders"], "rdp": state["rdp_sum"],
                                   "steps": len(self.history)})

    @classmethod
    def from_state_dict(cls, state: dict, calibration: Optional[Calibration] = None) -> "PrivacyLedger":
        """Rebuild a ledger (plan + calibration + history) from :meth:`state_dict` output."""
        plan = PrivacyPlan(**state["plan"])
        cal = calibration if calibration is not None else Calibration.from_dict(state["calibration"])
        ledger = cls(plan, cal, budget=float(state["budget"]))
        ledger.load_state_dict(state)
        return ledger
