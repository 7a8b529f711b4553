"""The privacy contract between a strategy and the run's privacy layer (no Flower, no accountant).

A strategy asks its ``PrivacyHook``, round by round:

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

from typing import Protocol


class BudgetExhausted(RuntimeError):
    """The next release would exceed the privacy budget; nothing was released."""


class PrivacyHook(Protocol):
    noise_at: str | None

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


class ServerSideDefaults:
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
