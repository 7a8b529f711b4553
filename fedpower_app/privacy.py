"""The server's privacy hook: calibrated noise per released block, and the per-round ledger.

Built once at start from the run config and the clients' shard sizes. The strategy asks it for
the noise std of each block of a round (``noise_stds``), checks the budget before each release
(``check``), and records every release that happened (``record``), including rounds in which
some or all sampled clients dropped out. All privacy math is in ``fedpower_app.accounting``.
"""

from __future__ import annotations

import logging
from typing import Any

from strategies.flower import BudgetExhausted, NoPrivacy

from . import accounting as A
from .config import RunConfig

log = logging.getLogger("fedpower")


class NonPrivate(NoPrivacy):
    """``dp.level = none``: no clipping, no noise; ε is reported as n/a."""

    enforces_budget = False

    def describe(self) -> dict[str, Any]:
        return {"level": "none", "label": "non-private: no differential-privacy guarantee"}

    def summary_lines(self) -> list[str]:
        return ["privacy: OFF (dp.level = none). The released model has no DP guarantee."]

    def final_report(self) -> dict[str, Any]:
        return self.describe()


class AccountedPrivacy:
    """DP at sample or client level with a calibrated (or user-fixed) noise multiplier."""

    enabled = True

    def __init__(self, plan: A.PrivacyPlan, calibration: A.Calibration, *, source: str) -> None:
        self.plan = plan
        self.calibration = calibration
        self.source = source  # "calibrated", "noise-multiplier" or "paper"
        self.ledger = A.PrivacyLedger(plan, calibration, budget=plan.epsilon if source != "paper" else None)
        self.enforces_budget = True

    @property
    def clip(self) -> float:
        return float(self.plan.clip)

    # -- PrivacyHook ------------------------------------------------------------------------
    def noise_stds(self, round_type: str, num_clients: int) -> list[float]:
        # Sample level, linear releases: noise scaled to the realised k (k = 0 uses k = 1).
        return [float(s) for s in self.ledger.noise_stds_for_round(round_type, k=max(1, num_clients))]

    def check(self, round_type: str, server_round: int) -> None:
        vec = self.ledger.rdp_for_round(round_type)
        if self.ledger.would_exceed(vec, round_type=round_type):
            raise BudgetExhausted(self.ledger.exceed_message(round_type, server_round))

    def record(self, round_type: str, server_round: int, num_sampled: int, num_aggregated: int) -> None:
        self.ledger.record(round_type, self.ledger.z_for_round(round_type), self.ledger.rdp_for_round(round_type),
                           server_round, clients_sampled=num_sampled)

    def epsilon(self) -> float | None:
        return self.ledger.epsilon() if self.ledger.rounds_recorded else 0.0

    # -- reporting ---------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        return {"source": self.source, "plan": self.plan.to_dict(), "calibration": self.calibration.to_dict()}

    def summary_lines(self) -> list[str]:
        c, p = self.calibration, self.plan
        lines = [
            f"privacy: {p.level}-level DP, target (eps={p.epsilon:g}, delta={p.delta:g}), accountant {p.accountant}, "
            + (f"sample mode {p.sample_mode}, pi={c.pi:.5f}, " if p.level == "sample" else "")
            + f"q_c={p.client_rate:g}, N={p.num_clients}, T={p.num_rounds}, C={p.clip:g}",
            f"privacy: {c.label}",
        ]
        if self.source == "paper":
            lines.append(f"privacy: PAPER calibration sigma_alg={c.sigma_alg:.5g} (noise std sigma_alg*C per entry); "
                         f"its TRUE epsilon at T is {c.epsilon:.4g}, not {p.epsilon:g}")
        else:
            lines.append(f"privacy: effective noise multiplier z={c.z:.5g} ({self.source}); expected epsilon after "
                         f"T={p.num_rounds} rounds: {c.epsilon:.4f}")
        for rt, stds in c.noise_std.items():
            lines.append(f"privacy: round type {rt}: z={c.z_per_round_type.get(rt, c.z):.5g}, noise std per block "
                         f"{', '.join(f'{s:.5g}' for s in stds)}" + (" (at k=1; scaled by 1/k realised)" if p.level == "sample" and rt not in ('powerdp', 'output') else ""))
        if self.source == "noise-multiplier" and c.epsilon > p.epsilon:
            lines.append(f"privacy: WARNING: with dp.noise-multiplier={c.z:g} the budget eps={p.epsilon:g} is "
                         f"reached before round {p.num_rounds}; the run will stop there")
        return lines

    def final_report(self) -> dict[str, Any]:
        eps_rdp, order = self.ledger.epsilon_rdp()
        return {
            "epsilon_spent": self.ledger.epsilon() if self.ledger.rounds_recorded else 0.0,
            "epsilon_spent_rdp": eps_rdp,
            "best_order": order,
            "delta": self.plan.delta,
            "level": self.plan.level,
            "rounds_released": self.ledger.rounds_recorded,
            "is_valid_guarantee": self.calibration.is_valid_guarantee,
            "label": self.calibration.label,
            "ledger": self.ledger.state_dict(),
        }


def make_plan(cfg: RunConfig, *, client_sizes: list[int], num_modules: int) -> A.PrivacyPlan:
    return A.PrivacyPlan(
        method=cfg["strategy.name"],
        level=cfg["dp.level"],
        epsilon=cfg["dp.epsilon"],
        delta=cfg["dp.delta"],
        num_rounds=cfg["num-server-rounds"],
        client_rate=cfg["strategy.client-rate"],
        num_clients=len(client_sizes),
        client_sizes=list(client_sizes) if cfg["dp.level"] == "sample" else None,
        batch_size=cfg["train.batch-size"] if cfg["dp.level"] == "sample" else None,
        local_steps=cfg["train.local-steps"],
        clip=cfg["dp.clip"],
        rank=cfg["lora.rank"],
        num_modules=num_modules,
        refactor_every=cfg["strategy.refactor-every"],
        sample_mode=cfg["dp.sample-mode"],
        accountant=cfg["dp.accountant"],
        calibration=cfg["dp.calibration"],
    )


def build_privacy(cfg: RunConfig, *, client_sizes: list[int], num_modules: int):
    """The hook for this run: NonPrivate, or AccountedPrivacy calibrated from (ε, δ)."""
    if not cfg.dp_enabled:
        return NonPrivate()
    plan = make_plan(cfg, client_sizes=client_sizes, num_modules=num_modules)
    if cfg["dp.calibration"] == "paper":
        return AccountedPrivacy(plan, A.calibrate(plan), source="paper")
    if cfg["dp.noise-multiplier"] > 0:
        return AccountedPrivacy(plan, A.epsilon_for_noise_multiplier(plan, cfg["dp.noise-multiplier"]),
                                source="noise-multiplier")
    return AccountedPrivacy(plan, A.calibrate(plan), source="calibrated")
