"""The privacy contract between a strategy and the run's privacy layer (no Flower, no accountant).

A strategy talks to its privacy layer twice a round (``PlanAndCommit``): ``plan_round`` before
any message leaves, ``commit_round`` once the round's release is made. Both are built on the
hook's primitives, round by round:

* ``admit(nodes, round)``: which of the sampled silos may train this round. A silo whose own
  ledger would cross the budget is never sent the round (DP-SGD on the silos).
* ``train_config()``: the DP parameters the train message carries (σ, C, b, L for DP-SGD), which
  every silo checks against its own ledger before touching its data.
* ``record_sent(nodes, round)``: the silos that were sent the round (their data is used).
* ``check(round_type, round)``: raise ``BudgetExhausted`` if the next round must not start.
* ``noise_stds(round_type, k)``: the server-side noise std per released block (zeros when the
  noise is added on the silos).
* ``record(...)``: a server release happened (it always counts, even if silos dropped out).
* ``epsilon()``: ε spent so far (the maximum over silos for DP-SGD), or None when non-private.
* ``state_dict()`` / ``load_state_dict(state)``: every ledger, for checkpoints; loading refuses a
  state from another plan or population.
* ``rebind(old_node, new_node)``: a silo came back under a new node id; its ledger follows it.
* ``charge_lost_release(silos)``: a round that was in flight when the server died, and whose noise
  cannot be reproduced, released something: charge it to those silos (population indices).

``noise_at`` says where the noise is added: ``"server"`` (the paper's mechanisms), ``"silo"``
(DP-SGD; the server's merge, average and refactorization are post-processing) or None.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


def sample_rate(batch_size: int, n: float) -> float:
    """q = min(1, b/n): the Poisson rate at which a silo of (declared) size n samples each example
    for an expected batch of b. The one formula: the silo's sampler, its own ledger, the server's
    ledgers and the planner all call it."""
    if not n > 0:
        raise ValueError(f"a sampling rate needs a positive size, got {n!r}")
    return min(1.0, batch_size / n)


class BudgetExhausted(RuntimeError):
    """The next release would exceed the privacy budget; nothing was released."""


class PrivacyHook(Protocol):
    noise_at: str | None

    # what a strategy calls (PlanAndCommit builds them on the primitives below)
    def plan_round(self, server_round: int, round_type: str, sampled: list) -> "RoundPlan": ...
    def commit_round(self, plan: "RoundPlan", num_aggregated: int, released: bool) -> None: ...

    def admit(self, nodes: list[int], server_round: int) -> list[int]: ...
    def train_config(self) -> dict: ...
    def record_sent(self, nodes: list[int], server_round: int) -> None: ...
    def noise_stds(self, round_type: str, num_clients: int) -> list[float]: ...
    def check(self, round_type: str, server_round: int) -> None: ...
    def record(self, round_type: str, server_round: int, num_sampled: int, num_aggregated: int) -> None: ...
    def epsilon(self) -> float | None: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...
    def charge_lost_release(self, silos: list[int]) -> None: ...
    def rebind(self, old_node: int, new_node: int) -> None: ...
    @property
    def clip(self) -> float | None: ...
    @property
    def enabled(self) -> bool: ...


@dataclass(frozen=True)
class RoundPlan:
    """What the privacy layer decided for a round before any message leaves: the silos that may
    train (a silo whose ledger would cross its budget is never sent the round), the DP parameters
    every train message carries, and the server's noise std per released block (fixed before any
    reply: it never depends on who answered)."""

    server_round: int
    round_type: str
    admitted: tuple
    over_budget: int
    train_config: dict
    noise_stds: tuple


class PlanAndCommit:
    """The two calls a strategy makes to its privacy layer each round, built on a hook's primitives:

    * ``plan_round(round, round_type, sampled)``: raises ``BudgetExhausted`` if the round must not
      start; otherwise the round's :class:`RoundPlan`;
    * ``commit_round(plan, num_aggregated, released)``: what happened. The admitted silos are
      charged (they were sent the round: their data was used, whatever came back), and a server
      release is recorded when there was one (it always counts, even if silos dropped out).
    """

    def plan_round(self, server_round: int, round_type: str, sampled: list) -> RoundPlan:
        self.check(round_type, server_round)
        admitted = self.admit(list(sampled), server_round)
        return RoundPlan(server_round=server_round, round_type=round_type, admitted=tuple(admitted),
                         over_budget=len(sampled) - len(admitted), train_config=dict(self.train_config()),
                         noise_stds=tuple(float(s) for s in self.noise_stds(round_type, len(admitted))))

    def commit_round(self, plan: RoundPlan, num_aggregated: int, released: bool) -> None:
        self.record_sent(list(plan.admitted), plan.server_round)
        if released:
            self.record(plan.round_type, plan.server_round, len(plan.admitted), num_aggregated)


class ServerSideDefaults(PlanAndCommit):
    """Silo-side parts of the contract for hooks whose noise is not added on the silos."""

    def admit(self, nodes: list[int], server_round: int) -> list[int]:
        return list(nodes)

    def train_config(self) -> dict:
        return {}

    def record_sent(self, nodes: list[int], server_round: int) -> None:
        return None

    def rebind(self, old_node: int, new_node: int) -> None:
        # The server-side ledgers are indexed by silo position, not node id.
        return None

    def charge_lost_release(self, silos: list[int]) -> None:
        # Server-side noise: a round killed before its checkpoint never left the server (the
        # release is published by the checkpoint or the next round's messages), so it costs nothing.
        return None


class NoPrivacy(ServerSideDefaults):
    """Non-private mode: no clipping, no noise, no ledger."""

    enabled = False
    clip = None
    noise_at = None

    def noise_stds(self, round_type: str, num_clients: int) -> list[float]:
        return [0.0, 0.0]

    def check(self, round_type: str, server_round: int) -> None:
        return None

    def record(self, round_type, server_round, num_sampled, num_aggregated) -> None:
        return None

    def epsilon(self) -> float | None:
        return None

    def state_dict(self) -> dict:
        return {"kind": "none"}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "none":
            raise ValueError(f"privacy state of kind {state.get('kind')!r} cannot resume a non-private run")


@dataclass(frozen=True)
class Disclosure:
    """What a run may show about its rounds (results.json, the console, the logs).

    A private run's guarantee covers its releases (the global adapters), evaluation of them on the
    evaluation split, ε, and the public configuration. Everything else a round produces (the silos'
    pre-clip update norms, the clipped fraction, train loss, which replies were dropped or missing
    and why, how many arrived) is a statistic of private data that no noise covers. ``full`` shows
    it all: a non-private run, or ``dp.diagnostics = "released"`` (marked "not covered").

    Without it a round row keeps only :data:`COVERED_ROUND_FIELDS`, plus, with DP-SGD on the silos,
    :data:`SCHEDULE_FIELDS`: which silos are sent a round depends only on the client-sampling coins
    and the public ledgers, and no amplification by client sampling is claimed there. With noise
    on the server the cohort stays secret (client level: its size would weaken the secret-cohort
    assumption of the subsampled accounting), so the counts are withheld there too.
    """

    private: bool = False
    diagnostics_released: bool = False
    noise_at: str | None = None
    client_level: bool = False

    COVERED_ROUND_FIELDS = ("server_round", "round_type", "epsilon", "noise_stds", "released")
    # message_rounds: secure aggregation's exchanges (fixed by the config unless a sum is refused)
    SCHEDULE_FIELDS = ("sampled", "over_budget", "bytes_down", "message_rounds")

    @property
    def full(self) -> bool:
        return not self.private or self.diagnostics_released

    def round_fields(self) -> tuple | None:
        """The fields a round row may carry (None: all of them)."""
        if self.full:
            return None
        return self.COVERED_ROUND_FIELDS + (self.SCHEDULE_FIELDS if self.noise_at in ("silo", "distributed") else ())

    def round_row(self, row: dict) -> dict:
        keep = self.round_fields()
        return dict(row) if keep is None else {k: v for k, v in row.items() if k in keep}

    @property
    def shows_timing(self) -> bool:
        """Per-round wall time: with noise on the server it is about proportional to the secret
        cohort's size (each sampled silo trains), so it is shown only where the cohort is not secret."""
        return self.full or self.noise_at in ("silo", "distributed")  # distributed DP: every silo, every round

    @property
    def shows_sizes(self) -> bool:
        """The silos' shard sizes: client-level accounting does not use them, so they are withheld."""
        return self.full or not self.client_level

    #: results.json totals and the round fields each sums (a total of withheld fields is withheld too)
    TOTALS_OF = {"bytes_up": "bytes_up", "bytes_down": "bytes_down",
                 "server_aggregation_seconds": "aggregation_seconds", "dropped_replies": "dropped",
                 "missing_replies": "missing"}

    def withheld_totals(self) -> tuple[str, ...]:
        """The totals a results.json writes as "withheld" (never as zeros: a zero is a claim)."""
        keep = self.round_fields()
        withheld = [] if keep is None else [t for t, f in self.TOTALS_OF.items() if f not in keep]
        if not self.shows_timing:
            withheld.append("wall_seconds")
        return tuple(withheld)

    def label(self) -> str:
        if not self.private:
            return "non-private: every diagnostic is shown"
        if self.diagnostics_released:
            return ("diagnostics released, NOT covered by the guarantee (dp.diagnostics = released): per-round "
                    "update norms, clipped fraction, train loss, reply counts, node ids and reasons")
        return "covered only: released adapters, evaluation on the evaluation split, epsilon, public configuration"
