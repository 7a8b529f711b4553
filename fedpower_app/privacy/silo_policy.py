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

**Who decides.** A silo that holds its own data (node config ``data-dir``) or sets its own budget
(``dp-max-epsilon``) is *sovereign*: its node config decides, with the safe defaults above (no
reproducible mode, no diagnostics, no evaluation on its rows under a budget). A simulated partition
of a shared dataset (node config ``partition-id`` / ``num-partitions`` only: one person owns every
silo and the server) follows the run config, which then speaks for its owner: ``dp.noise =
"seeded"`` opts every silo into reproducible mode (and the run says so), ``dp.diagnostics =
"released"`` makes them send their metrics.

Flower-free: the ClientApp (``client_app/app.py``) builds it from ``Context.node_config``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from .accounting.silo import SILO_DEFAULT_DELTA, SiloRefusal

#: The node-config keys a silo's policy reads (docs/deployment.md documents each).
POLICY_KEYS = ("dp-max-epsilon", "dp-delta", "dp-noise", "send-metrics", "evaluate", "evaluate-max", "ledger-file")
#: ``ledger-file`` value of a silo that keeps its ledger in the run's state only.
IN_MEMORY = "memory"
#: The ledger of a silo with a data directory and no ``ledger-file``, in that directory.
DEFAULT_LEDGER_NAME = "fedpower-ledger.json"


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

    sovereign: bool  # the node config decides (own data or own budget); else the run's owner does
    requires_dp: bool  # trains only with DP-SGD parameters
    max_epsilon: float  # the budget its own ledger enforces
    delta: float
    reproducible: bool  # accepts seeded (reproducible-mode) noise
    sends_metrics: bool  # train loss, examples seen, timings in its train replies
    evaluates: bool  # answers evaluate requests on its own rows
    evaluate_max: int | None  # at most this many answers per run (None: no cap)
    ledger_file: Path | None  # None: the run's state only
    ledger_in_memory_chosen: bool = False  # the operator asked for it (``ledger-file = "memory"``)

    @classmethod
    def from_node_config(cls, node_config: Mapping[str, Any], cfg) -> "SiloPolicy":
        """The policy of a silo with this node config in a run of configuration ``cfg`` (a
        ``RunConfig``: consulted only where the silo is not sovereign, and for the run's level)."""
        budget = "dp-max-epsilon" in node_config
        data_dir = str(node_config.get("data-dir", "")).strip()
        sovereign = budget or bool(data_dir)
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
        if evaluates is None:  # a silo that enforces a budget, or sends no metrics, keeps its rows to itself
            evaluates = not budget and metrics is not False
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
        return cls(sovereign, requires_dp, max_epsilon, delta, reproducible, bool(sends_metrics), evaluates,
                   evaluate_max, ledger_file, chosen)

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
        who = "its node config decides" if self.sovereign else "a simulated partition: the run config speaks for its owner"
        budget = (f"DP-SGD required, budget epsilon {self.max_epsilon:g} at delta {self.delta:g}" if self.requires_dp
                  else "DP-SGD as the run asks")
        noise = "reproducible-mode noise accepted" if self.reproducible else "noise from its own secrets only"
        metrics = "sends training metrics" if self.sends_metrics else "sends no training metrics"
        if not self.evaluates:
            evaluate = "no evaluation on its rows"
        else:
            evaluate = "evaluates on its rows" + ("" if self.evaluate_max is None else f" at most {self.evaluate_max} times")
            evaluate += " (NOT covered by the guarantee)" if self.requires_dp else ""
        return f"silo policy ({who}): {budget}; {noise}; {metrics}; {evaluate}; ledger {self.ledger_where()}"
