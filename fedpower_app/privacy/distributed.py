"""The privacy hook of distributed DP at client level (``secagg.enabled`` with ``dp.level = "client"``).

The server adds no noise and clips nothing: it plans the rounds, sends every silo the public noise
parameters of each secure sum (clip C, scale s, share std sigma, the k it is calibrated for), keeps
the run's ledger and stops the run before the budget is crossed. Each silo clips its own round delta,
adds its share and keeps its own ledger, at its own k (``client_app``). The accounting is
``accounting.distributed``; docs/secure-aggregation.md §3 derives it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from strategies import mechanisms as MECH
from strategies.privacy_contract import BudgetExhausted, ServerSideDefaults

from ..config import RunConfig
from .accounting import distributed as DA

LORA_A, LORA_B = MECH.LORA_A, MECH.LORA_B

#: The client-level releases a secure sum with noise shares can carry.
DISTRIBUTED_ROUND_TYPES = ("fedlora-delta", "ffa-delta", "powerdp-l")


def release_dimensions(round_type: str, shapes: dict[str, tuple], rank: int, iters: int) -> tuple[int, ...]:
    """The dimension of each secure sum a round of ``round_type`` releases (each + 1: the coordinate
    every secure-sum vector ends with)."""
    modules = sorted(k[: -len(LORA_A)] for k in shapes if k.endswith(LORA_A))
    extras = [k for k in shapes if not (k.endswith(LORA_A) or k.endswith(LORA_B))]
    head = sum(int(np.prod(shapes[k])) for k in extras)
    b = sum(int(np.prod(shapes[m + LORA_B])) for m in modules)
    a = sum(int(np.prod(shapes[m + LORA_A])) for m in modules)
    if round_type == "fedlora-delta":
        return (a + b + head + 1,)
    if round_type == "ffa-delta":
        return (b + head + 1,)
    if round_type == "powerdp-l":
        right = sum(shapes[m + LORA_B][0] * rank for m in modules) + 1
        left = sum(rank * shapes[m + LORA_A][1] for m in modules) + 1
        return (right + head, left) + (right, left) * (iters - 1)
    raise ValueError(f"round type {round_type!r} cannot run with distributed DP; it supports "
                     f"{list(DISTRIBUTED_ROUND_TYPES)} (fedlora, ffa-lora, fedpower with PowerDP-L)")


class DistributedClientDP(ServerSideDefaults):
    """Client-level DP whose noise the silos add inside the secure sum."""

    enabled = True
    noise_at = "distributed"
    clip = None  # the server clips nothing: every silo clips its own delta
    enforces_budget = True

    def __init__(self, cfg: RunConfig, *, num_clients: int, shapes: dict[str, tuple]) -> None:
        from strategies.secure_sum.session import SecureAggregation

        if cfg["strategy.client-rate"] != 1.0:
            raise ValueError("distributed DP needs strategy.client-rate = 1: the server runs the secure sum with the "
                             "cohort, so it knows it, and no amplification by client sampling can be claimed")
        secure = SecureAggregation.from_config(cfg)
        self.secure = secure
        self.num_clients = int(num_clients)
        cohort = secure.config_for(list(range(1, max(2, self.num_clients) + 1)), 1, b"")
        self.threshold = cohort.threshold
        self.colluders = int(cfg["secagg.colluders"])
        self.min_contributors = self.threshold - self.colluders
        self.denominator = float(self.num_clients)  # m = q_c N with q_c = 1
        self.delta, self.epsilon_target = cfg["dp.delta"], cfg["dp.epsilon"]
        self.num_rounds = cfg["num-server-rounds"]
        self.round_types = [MECH.round_type(cfg["strategy.name"], t, refactor_every=cfg["strategy.refactor-every"],
                                            level="client", refactorization=cfg["strategy.client-refactorization"])
                            for t in range(1, self.num_rounds + 1)]
        self.dimensions = {rt: release_dimensions(rt, shapes, cfg["lora.rank"], cfg["strategy.power-iters"])
                           for rt in set(self.round_types)}
        self.plan = DA.DistributedPlan(epsilon=self.epsilon_target, delta=self.delta, num_rounds=self.num_rounds,
                                       clip=cfg["dp.clip"], num_clients=self.num_clients,
                                       min_contributors=self.min_contributors,
                                       schedule=tuple(self.dimensions[rt] for rt in self.round_types),
                                       bits=secure.bits)
        self.calibration = DA.calibrate(self.plan)
        self.rdp = np.zeros(len(DA.ORDERS))
        self.rounds_recorded = 0

    # -- what each silo is told ------------------------------------------------------------------
    def noise_parameters(self) -> dict:
        c = self.calibration
        return {"clip": float(self.plan.clip), "scale": float(c.scale), "local-std": float(c.local_std),
                "contributors": int(self.min_contributors)}

    def _round_rdp(self, round_type: str) -> np.ndarray:
        return DA.round_rdp(self.plan, self.dimensions[round_type], self.calibration.scale, self.calibration.local_std)

    # -- PrivacyHook -------------------------------------------------------------------------------
    def noise_stds(self, round_type: str, num_clients: int) -> list[float]:
        return [0.0] * len(self.dimensions.get(round_type, (0,)))

    def check(self, round_type: str, server_round: int) -> None:
        if round_type not in self.dimensions:
            raise BudgetExhausted(f"round {server_round}: round type {round_type} was not planned")
        eps = DA.epsilon_of(self.rdp + self._round_rdp(round_type), self.delta)
        if eps > self.epsilon_target * (1 + 1e-9):
            raise BudgetExhausted(f"round {server_round} would spend eps {eps:.4f} > {self.epsilon_target:g}")

    def record(self, round_type: str, server_round: int, num_sampled: int, num_aggregated: int) -> None:
        self.rdp = self.rdp + self._round_rdp(round_type)
        self.rounds_recorded += 1

    def epsilon(self) -> float | None:
        return DA.epsilon_of(self.rdp, self.delta) if self.rounds_recorded else 0.0

    def epsilon_at(self, delta: float) -> float:
        """epsilon spent so far at another delta: the ledger's claimed profile (what an audit tests)."""
        return DA.epsilon_of(self.rdp, delta) if self.rounds_recorded else 0.0

    def state_dict(self) -> dict:
        return {"kind": "distributed", "rdp": [float(x) for x in self.rdp], "rounds": self.rounds_recorded,
                "calibration": self.calibration.to_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "distributed":
            raise ValueError(f"privacy state of kind {state.get('kind')!r} cannot resume a distributed-DP run")
        if state.get("calibration") != self.calibration.to_dict():
            raise ValueError("the checkpoint's distributed-DP calibration differs from this run's")
        self.rdp = np.asarray(state["rdp"], dtype=float)
        self.rounds_recorded = int(state["rounds"])

    @property
    def is_valid_guarantee(self) -> bool:
        return True  # every share is drawn on its silo from OS entropy (the seed plays no part)

    # -- reporting ---------------------------------------------------------------------------------
    def trust_statement(self) -> str:
        return (f"distributed DP: each silo adds its share of discrete Gaussian noise before the secure sum, so the "
                f"guarantee holds against a server that adds no noise, if it colludes with at most "
                f"{self.colluders} silo(s) (secagg.colluders) and at least t = {self.threshold} silos are in "
                f"every sum (k = t - colluders = {self.min_contributors} unknown shares, t fixed for every sum of a "
                f"round); against a server that deviates from the protocol only for silos that sign their sums "
                f"(node config silo-signing-key, secagg-peers), which each account at the k the sum proves; for a "
                f"semi-honest server only otherwise")

    def describe(self) -> dict[str, Any]:
        return {"level": "client", "mechanism": "distributed discrete Gaussian (Kairouz, Liu & Steinke 2021)",
                "clip": self.plan.clip, "num_clients": self.num_clients, "threshold": self.threshold,
                "colluders": self.colluders, "min_contributors": self.min_contributors,
                "releases_per_round": {rt: len(d) for rt, d in self.dimensions.items()},
                "calibration": {**self.calibration.to_dict(), "is_valid_guarantee": True,
                                "level": "client", "target_epsilon": self.epsilon_target, "delta": self.delta},
                "trust": self.trust_statement(),
                "neighbouring": "add or remove one silo's data (its clipped delta and its noise share); no "
                                "amplification by client sampling"}

    def summary_lines(self) -> list[str]:
        c = self.calibration
        return [
            f"privacy: client-level distributed DP, target (eps={self.epsilon_target:g}, delta={self.delta:g}), "
            f"N={self.num_clients} silos every round, T={self.num_rounds}, C={self.plan.clip:g}",
            f"privacy: {self.trust_statement()}",
            f"privacy: each share sigma={c.local_std:.5g} integer units at scale s={c.scale:.5g}; the sum carries noise "
            f"std {c.sum_std:.4g} per coordinate (z={c.noise_multiplier:.4g} per release); expected epsilon after "
            f"T={self.num_rounds} rounds: {c.epsilon:.4f}",
        ]

    def final_report(self) -> dict[str, Any]:
        return {"epsilon_spent": self.epsilon(), "delta": self.delta, "level": "client", "noise_at": "distributed",
                "rounds_released": self.rounds_recorded, "is_valid_guarantee": True,
                "label": self.trust_statement()}
