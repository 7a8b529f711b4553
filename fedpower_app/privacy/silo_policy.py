"""A silo's privacy policy: what this silo agrees to, set by the silo alone (its node config).

The run config can ask; it cannot overrule. One object, built once per run from the SuperNode's
node config, decides everything about the silo's privacy:

* its budget (ε, δ): node config ``dp-max-epsilon`` and ``dp-delta`` (δ defaults to
  ``SILO_DEFAULT_DELTA``, never the run config's);
* its noise source: OS entropy unless the node config opts into reproducible mode (``dp-noise =
  "seeded"``): a server that sends ``dp.noise = "seeded"`` knows the seed, so it could rebuild
  every noise draw and subtract it from the silo's update;
* whether it sends training diagnostics (``send-metrics``): train loss, examples seen, timings;
* whether it evaluates on its own rows (``evaluate``), and at most how often (``evaluate-max``,
  answers per run): exact loss and accuracy of an array the server chose, on private rows, that
  no noise covers;
* where its ledger lives (``ledger-file``): a path on the silo's disk, by default
  ``fedpower-ledger.json`` in its data directory; ``"memory"`` keeps it in the run's state only,
  an explicit choice that is printed.

**Who decides.** Every deployed SuperNode is *sovereign*: its node config decides, with safe
defaults (no reproducible mode, no diagnostics, no shard size, no evaluation on its rows). It starts
only with an explicit choice: a budget (``dp-max-epsilon``), or a written opt-out (``dp-opt-out =
"<why>"``) that it prints at start; with neither it refuses every message. A budgeted silo keeps
its ledger on its own disk (``ledger-file``, by default in its data directory) and refuses to
train with nowhere to keep it, unless its operator chose ``ledger-file = "memory"``. Only a
partition that the simulation engine itself made (Flower's Ray engine, or the in-process grid:
:func:`simulation_engine`) and whose node config sets no budget of its own is a
*simulated partition*: one person owns every silo and the server, so the run config speaks for
its owner (``dp.noise = "seeded"``, ``dp.diagnostics = "released"``). A node config that anyone
can type (``partition-id=0 num-partitions=6``) does not make a deployed SuperNode one.

Flower-free: the ClientApp (``client_app/app.py``) builds it from ``Context.node_config``.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from .accounting.silo import SILO_DEFAULT_DELTA, SiloRefusal

#: The node-config keys a silo's policy reads (docs/deployment.md documents each).
POLICY_KEYS = ("dp-max-epsilon", "dp-delta", "dp-opt-out", "dp-accountant", "dp-noise", "send-metrics",
               "send-shard-size", "evaluate", "evaluate-max", "ledger-file", "secagg-colluders", "secagg-contributors",
               "silo-signing-key", "secagg-peers")
#: ``ledger-file`` value of a silo that keeps its ledger in the run's state only.
IN_MEMORY = "memory"
#: The ledger of a silo with a data directory and no ``ledger-file``, in that directory.
DEFAULT_LEDGER_NAME = "fedpower-ledger.json"


_SIMULATION_ENGINE = threading.local()


@contextlib.contextmanager
def simulation_engine():
    """A simulation engine of this process (the in-process grid) delivers a message inside this
    block: the node it delivers to is a partition the engine made. Not reachable from a node config
    or a message."""
    previous = getattr(_SIMULATION_ENGINE, "active", False)
    _SIMULATION_ENGINE.active = True
    try:
        yield
    finally:
        _SIMULATION_ENGINE.active = previous


def in_simulation_engine() -> bool:
    """Does this ClientApp run inside a simulation engine (Flower's Ray engine, or the in-process
    grid), where partition-id / num-partitions come from the engine, not from an operator?"""
    import sys

    if getattr(_SIMULATION_ENGINE, "active", False):
        return True
    ray = sys.modules.get("ray")
    return bool(ray is not None and ray.is_initialized())


def _flag(node_config: Mapping[str, Any], key: str) -> bool | None:
    raw = node_config.get(key)
    if raw is None:
        return None
    text = str(raw).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise SiloRefusal(f"refused: node config {key} = {raw!r} is not a boolean (true or false)")


@dataclass(frozen=True)
class SiloPolicy:
    """What one silo agrees to. Build it with :meth:`from_node_config`."""

    sovereign: bool  # the node config decides (a deployed SuperNode, own data or own budget); else the run's owner does
    requires_dp: bool  # trains only with DP-SGD parameters (or its own noise shares)
    max_epsilon: float  # the budget its own ledger enforces
    delta: float
    reproducible: bool  # accepts seeded (reproducible-mode) noise
    sends_metrics: bool  # train loss, examples seen, timings in its train replies
    evaluates: bool  # answers evaluate requests on its own rows
    evaluate_max: int | None  # at most this many answers, across runs (None: no cap)
    ledger_file: Path | None  # None: the run's state only
    ledger_in_memory_chosen: bool = False  # the operator asked for it (``ledger-file = "memory"``)
    opt_out: str = ""  # the operator's written reason to train without DP (sovereign silos only)
    sends_shard_size: bool = True  # tells the server its shard size n
    accountant: str = "rdp"  # the silo's own accountant (node config dp-accountant), never the run's
    colluders: int = 0  # silos it assumes collude with the server (node config secagg-colluders)
    contributors: int | None = None  # the k it accounts its noise shares at, at most (node config secagg-contributors)
    signing_key: Path | None = None  # its signing key for secure sums against a deviating server
    peers_file: Path | None = None  # the public keys of the silos it aggregates with

    @classmethod
    def from_node_config(cls, node_config: Mapping[str, Any], cfg, *, simulated: bool | None = None) -> "SiloPolicy":
        """The policy of a silo with this node config in a run of configuration ``cfg`` (a
        ``RunConfig``: consulted only where the silo is not sovereign, and for the run's level).
        ``simulated``: whether a simulation engine made this node (default: :func:`in_simulation_engine`)."""
        if simulated is None:
            simulated = in_simulation_engine()
        budget = "dp-max-epsilon" in node_config
        data_dir = str(node_config.get("data-dir", "")).strip()
        opt_out = str(node_config.get("dp-opt-out", "")).strip()
        if "dp-opt-out" in node_config and not opt_out:
            raise SiloRefusal("refused: node config dp-opt-out must give the operator's reason in words")
        if budget and opt_out:
            raise SiloRefusal("refused: node config sets both dp-max-epsilon and dp-opt-out: choose one")
        sovereign = budget or bool(data_dir) or bool(opt_out) or not simulated
        if sovereign and not budget and not opt_out:
            raise SiloRefusal("refused: this silo has made no privacy choice: set node config dp-max-epsilon=8 (its "
                              "budget; with ledger-file=\"/path/ledger.json\"), or dp-opt-out=\"<why this silo "
                              "trains without DP>\" (docs/deployment.md)")
        if budget:
            try:
                max_epsilon = float(node_config["dp-max-epsilon"])
                delta = float(node_config.get("dp-delta", SILO_DEFAULT_DELTA))
            except (TypeError, ValueError):
                raise SiloRefusal("refused: node config dp-max-epsilon and dp-delta must be numbers") from None
            if not (max_epsilon > 0 and 0 < delta < 1):
                raise SiloRefusal(f"refused: node config dp-max-epsilon = {max_epsilon:g} must be > 0 and "
                                  f"dp-delta = {delta:g} in (0, 1)")
            requires_dp = True
        elif opt_out:
            requires_dp, max_epsilon, delta = False, float("inf"), SILO_DEFAULT_DELTA
        else:
            requires_dp = cfg["dp.level"] == "sample" and cfg["dp.noise-at"] == "silo"
            max_epsilon, delta = cfg["dp.epsilon"], cfg["dp.delta"]
        noise = str(node_config.get("dp-noise", "")).strip().lower()
        if noise not in ("", "hardened", "seeded"):
            raise SiloRefusal(f"refused: node config dp-noise = {noise!r} must be 'hardened' or 'seeded'")
        reproducible = noise == "seeded" if sovereign or noise else True
        metrics = _flag(node_config, "send-metrics")
        sends_metrics = metrics if metrics is not None else (not sovereign and cfg.diagnostics_released)
        evaluates = _flag(node_config, "evaluate")
        if evaluates is None:  # a sovereign silo keeps its rows to itself unless its node config says so
            evaluates = not sovereign and metrics is not False
        shard = _flag(node_config, "send-shard-size")
        sends_shard_size = shard if shard is not None else not sovereign
        raw_max = node_config.get("evaluate-max")
        try:
            evaluate_max = None if raw_max is None else int(raw_max)
        except (TypeError, ValueError):
            raise SiloRefusal(f"refused: node config evaluate-max = {raw_max!r} is not an integer") from None
        raw_ledger = str(node_config.get("ledger-file", "")).strip()
        if raw_ledger.lower() == IN_MEMORY:
            ledger_file, chosen = None, True
        elif raw_ledger:
            ledger_file, chosen = Path(raw_ledger).expanduser(), False
        elif data_dir:
            ledger_file, chosen = Path(data_dir).expanduser() / DEFAULT_LEDGER_NAME, False
        else:
            ledger_file, chosen = None, False
        if budget and ledger_file is None and not chosen:
            raise SiloRefusal("refused: this silo has a budget but nowhere to keep its ledger across runs: set node "
                              "config ledger-file=\"/path/on/the/silo/ledger.json\" (or ledger-file=\"memory\" to "
                              "start every run from zero)")
        accountant = str(node_config.get("dp-accountant", "rdp")).strip().lower()
        if accountant not in ("rdp", "pld"):
            raise SiloRefusal(f"refused: node config dp-accountant = {accountant!r} must be 'rdp' or 'pld'")
        try:
            colluders = int(node_config.get("secagg-colluders", 0))
            raw_k = node_config.get("secagg-contributors")
            contributors = None if raw_k is None else int(raw_k)
        except (TypeError, ValueError):
            raise SiloRefusal("refused: node config secagg-colluders and secagg-contributors must be integers") from None
        if colluders < 0 or (contributors is not None and contributors < 1):
            raise SiloRefusal("refused: node config secagg-colluders must be >= 0 and secagg-contributors >= 1")
        key = str(node_config.get("silo-signing-key", "")).strip()
        peers = str(node_config.get("secagg-peers", "")).strip()
        if bool(key) != bool(peers):
            raise SiloRefusal("refused: node config silo-signing-key and secagg-peers go together (the silo's own key "
                              "and the public keys of the silos it aggregates with)")
        return cls(sovereign, requires_dp, max_epsilon, delta, reproducible, bool(sends_metrics), evaluates,
                   evaluate_max, ledger_file, chosen, opt_out, bool(sends_shard_size),
                   accountant if sovereign else cfg["dp.accountant"], colluders, contributors,
                   Path(key).expanduser() if key else None, Path(peers).expanduser() if peers else None)

    @property
    def signs(self) -> bool:
        """Does this silo run the signed secure-sum protocol (against a server that deviates)?"""
        return self.signing_key is not None

    def assumed_colluders(self, run_colluders: int = 0) -> int:
        """The colluding silos this silo assumes in a secure sum: its own node config's, or the run's
        if more (a server cannot lower it)."""
        return max(self.colluders, int(run_colluders))

    def noise_share_contributors(self, threshold: int, requested: int, run_colluders: int = 0) -> int:
        """The k this silo accounts a noise share at: what the sum can prove, never more. A signed sum
        proves t trusted silos in the survivor set, so k = t less the colluders it assumes (its own
        node config, or the run's if more), capped by its node config secagg-contributors. An unsigned
        sum proves nothing about the other ids of a deployed silo's cohort: k = 1 (its own share).
        A simulated partition follows the run's k (its owner runs every silo)."""
        colluders = self.assumed_colluders(run_colluders)
        if self.sovereign and not self.signs:
            k = 1
        else:
            k = max(1, min(int(requested), int(threshold) - colluders))
        if self.contributors is not None:
            k = min(k, self.contributors)
        return k

    # -- the checks ---------------------------------------------------------------------------
    def check_noise_mode(self, cfg) -> None:
        """Refuse a DP round in reproducible mode that this silo did not opt into."""
        if cfg["dp.noise"] == "seeded" and not self.reproducible:
            raise SiloRefusal("refused: the run asks for reproducible-mode noise (dp.noise = 'seeded'), which "
                              "whoever holds the seed can subtract; this silo draws its noise from its own "
                              "secrets (opt in with node config dp-noise = \"seeded\")")

    def check_evaluate(self, answered: int) -> None:
        """Refuse an evaluate request on the silo's own rows beyond what it agreed to."""
        if not self.evaluates:
            raise SiloRefusal("refused: this silo does not evaluate on its own rows (node config evaluate = false; "
                              "the default for a silo with a budget)")
        if self.evaluate_max is not None and answered >= self.evaluate_max:
            raise SiloRefusal(f"refused: this silo answers at most {self.evaluate_max} evaluate request(s) per run "
                              "(node config evaluate-max)")

    # -- what it prints once at start ---------------------------------------------------------
    def ledger_where(self) -> str:
        if self.ledger_file is not None:
            return f"on its disk at {self.ledger_file} (kept across runs)"
        if self.ledger_in_memory_chosen:
            return "in this run's state only (ledger-file = \"memory\": each new run starts from zero)"
        return ("in this run's state only: each new run starts its budget from zero. Keep it across runs with "
                "node config ledger-file=\"/path/on/the/silo/ledger.json\"")

    def describe(self) -> str:
        """The policy in one line (the silo logs it once per run)."""
        who = ("its node config decides" if self.sovereign else
               "a simulated partition made by the simulation engine: the run config speaks for its owner")
        if self.requires_dp:
            budget = f"DP required, budget epsilon {self.max_epsilon:g} at delta {self.delta:g} ({self.accountant})"
        elif self.opt_out:
            budget = f"trains WITHOUT differential privacy by its operator's written choice: {self.opt_out!r}"
        else:
            budget = "DP-SGD as the run asks"
        noise = "reproducible-mode noise accepted" if self.reproducible else "noise from its own secrets only"
        metrics = "sends training metrics" if self.sends_metrics else "sends no training metrics"
        shard = "sends its shard size" if self.sends_shard_size else "keeps its shard size"
        if not self.evaluates:
            evaluate = "no evaluation on its rows"
        else:
            evaluate = "evaluates on its rows" + ("" if self.evaluate_max is None else
                                                  f" at most {self.evaluate_max} times across runs")
            evaluate += " (NOT covered by the guarantee)" if self.requires_dp else ""
        secure = ("secure sums signed (protected from a server that deviates)" if self.signs else
                  "secure sums unsigned (protected from a semi-honest server only)")
        return (f"silo policy ({who}): {budget}; {noise}; {metrics}; {shard}; {evaluate}; {secure}; "
                f"ledger {self.ledger_where()}")
