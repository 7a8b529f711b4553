"""The server's privacy hook: calibrated noise per released block, and the per-round ledger.

Built once at start from the run config and the clients' shard sizes. The strategy asks it for
the noise std of each block of a round (``noise_stds``), checks the budget before each release
(``check``), and records every release that happened (``record``), including rounds in which
some or all sampled clients dropped out. All privacy math is in ``fedpower_app.privacy.accounting``.
"""

from __future__ import annotations

import logging
from typing import Any

from strategies.privacy_contract import BudgetExhausted, NoPrivacy, PlanAndCommit, ServerSideDefaults, sample_rate

from . import accounting as A
from ..config import RunConfig
from .accounting.silo import SiloLedger, calibrate_noise_multiplier, dp_sgd_epsilon

log = logging.getLogger("fedpower")


def guarantee(cfg: RunConfig) -> dict[str, Any]:
    """Which kind of claim a run makes, for results.json, the console and ``fedpower-privacy``.

    * ``secret`` (``dp.noise = "hardened"``, the default): ``strategies.noise.HARDENED_SOURCE``
      (each silo's DP-SGD noise and Poisson coins on that silo, the server's noise and
      client-sampling coins on the server); no output holds a seed. The printed (ε, δ) is a
      guarantee.
    * ``reproducible`` (``dp.noise = "seeded"``): every draw follows from the run seed, which every
      silo receives in the run config and results.json records. Whoever holds the seed can
      subtract the noise: an experiment, not a guarantee.
    * the paper's calibration is never a guarantee (its true ε is printed beside the claim).
    """
    if not cfg.dp_enabled:
        return {"mode": "none", "valid": False, "statement": "non-private: no differential-privacy guarantee"}
    if cfg["dp.noise"] == "seeded":
        return {"mode": "reproducible", "valid": False,
                "statement": f"reproducible mode: not a guarantee against whoever holds the seed (every noise draw "
                             f"and sampling coin follows from seed={cfg['seed']}, which every silo receives and "
                             "results.json records); set dp.noise = \"hardened\" for a guarantee"}
    if cfg["dp.calibration"] == "paper":
        return {"mode": "paper", "valid": False,
                "statement": "the paper's calibration: the claimed epsilon is not the true one (printed beside it)"}
    from strategies.noise import HARDENED_SOURCE

    if cfg["secagg.enabled"] and cfg["dp.level"] == "client":
        return {"mode": "secret", "valid": True,
                "statement": "(eps, delta)-DP guarantee: every silo draws its discrete Gaussian noise share on the "
                             "silo from a generator seeded with 128 bits of OS entropy, whatever dp.noise says; the "
                             "server draws nothing and no output holds a seed"}
    return {"mode": "secret", "valid": True, "statement": f"(eps, delta)-DP guarantee: {HARDENED_SOURCE}"}


#: The neighbouring relation each level's guarantee is stated for, as the code implements it
#: (docs/privacy.md §1.1). Client level: the population of N silos is public and fixed at start
#: (m = q_c N is computed from it); two datasets are neighbours when one silo's data is replaced by
#: a silo that contributes nothing (zero-out). The Poisson-subsampled Gaussian's add/remove
#: analysis is exactly that case: the sampled sum carries the special silo's clipped delta or 0.
NEIGHBOURING = {
    "sample": "add or remove one training example of one silo; each silo's size n_k is public",
    "client": "zero-out: one silo's data replaced by a silo that contributes nothing (N silos, public and "
              "fixed at start; m = q_c N); sensitivity C/m",
}


class NonPrivate(NoPrivacy):
    """``dp.level = none``: no clipping, no noise; ε is reported as n/a."""

    enforces_budget = False

    def describe(self) -> dict[str, Any]:
        return {"level": "none", "label": "non-private: no differential-privacy guarantee"}

    def summary_lines(self) -> list[str]:
        return ["privacy: OFF (dp.level = none). The released model has no DP guarantee."]

    def final_report(self) -> dict[str, Any]:
        return self.describe()


class AccountedPrivacy(ServerSideDefaults):
    """The paper's mechanisms: server-side noise on the silos' clipped whole adapters, at sample or
    client level, with a calibrated (or user-fixed) noise multiplier."""

    enabled = True
    noise_at = "server"

    def __init__(self, plan: A.PrivacyPlan, calibration: A.Calibration, *, source: str,
                 noise_mode: str = "hardened", record_cohort: bool = False) -> None:
        self.plan = plan
        self.calibration = calibration
        self.source = source  # "calibrated", "noise-multiplier" or "paper"
        self.noise_mode = noise_mode
        # The ledger's per-round count of sampled clients is a cohort statistic: kept only when the
        # run releases its diagnostics (the checkpoint and results.json carry the ledger).
        self.record_cohort = record_cohort
        self.ledger = A.PrivacyLedger(plan, calibration, budget=plan.epsilon if source != "paper" else None)
        self.enforces_budget = True

    @property
    def clip(self) -> float:
        return float(self.plan.clip)

    # -- PrivacyHook ------------------------------------------------------------------------
    @property
    def fixed_denominator(self) -> float | None:
        """m = q_c N: what the sample-level k-dependent averages divide by, so that their noise is
        fixed before the round. None in paper mode: the paper's noise σ_alg·C never depended on k
        and its true ε is accounted at the worst case k = 1, so it keeps the paper's mean over k."""
        if self.plan.level != "sample" or self.calibration.mode == "paper":
            return None
        return self.plan.expected_cohort

    def noise_stds(self, round_type: str, num_clients: int) -> list[float]:
        # Never the realised number of replies (``num_clients`` is ignored): a reply dropped for NaN,
        # which private data can cause, would move the noise. Sample level: the k-dependent
        # releases average over the fixed m = q_c N (``fixed_denominator``) and their noise is
        # scaled to it; client level: the fixed denominator is in the sensitivity already.
        return [float(s) for s in self.ledger.noise_stds_for_round(round_type, k=self.fixed_denominator)]

    def check(self, round_type: str, server_round: int) -> None:
        vec = self.ledger.rdp_for_round(round_type)
        if self.ledger.would_exceed(vec, round_type=round_type):
            raise BudgetExhausted(self.ledger.exceed_message(round_type, server_round))

    def record(self, round_type: str, server_round: int, num_sampled: int, num_aggregated: int) -> None:
        self.ledger.record(round_type, self.ledger.z_for_round(round_type), self.ledger.rdp_for_round(round_type),
                           server_round, clients_sampled=num_sampled if self.record_cohort else None)

    def epsilon(self) -> float | None:
        return self.ledger.epsilon() if self.ledger.rounds_recorded else 0.0

    def state_dict(self) -> dict:
        return {"kind": "server", "ledger": self.ledger.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "server":
            raise ValueError(f"privacy state of kind {state.get('kind')!r} cannot resume a server-noise run")
        self.ledger.load_state_dict(state["ledger"])

    @property
    def is_valid_guarantee(self) -> bool:
        """A valid calibration whose noise no output can reproduce (not the seeded mode)."""
        return bool(self.calibration.is_valid_guarantee) and self.noise_mode != "seeded"

    # -- reporting ---------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        cal = {**self.calibration.to_dict(), "is_valid_guarantee": self.is_valid_guarantee}
        return {"source": self.source, "plan": self.plan.to_dict(), "calibration": cal,
                "neighbouring": NEIGHBOURING[self.plan.level]}

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
            "is_valid_guarantee": self.is_valid_guarantee,
            "label": self.calibration.label,
            "ledger": self.ledger.state_dict(),
        }


class SiloDPSGD(PlanAndCommit):
    """Sample-level DP by DP-SGD on the silos (``dp.noise-at = silo``): the server adds no noise.

    σ is calibrated at start so that a silo that trains in *every* one of the T planned rounds
    (L steps each, at its rate q_k = b / n_k) ends at ε; the smallest silo (largest q_k) decides.
    The server keeps one ``SiloLedger`` per silo, counts a round for a silo when it sends it the
    round, and never sends a round that would take a silo past ε. The run's ε is the maximum over
    silos. Every silo also keeps its own ledger (client_app) and refuses rounds past its budget.
    """

    enabled = True
    noise_at = "silo"
    clip = None  # the server does not clip: every silo clips per example
    enforces_budget = True

    def __init__(self, cfg: RunConfig, client_sizes: dict[int, int]) -> None:
        self.epsilon_target, self.delta = cfg["dp.epsilon"], cfg["dp.delta"]
        self.is_valid_guarantee = cfg["dp.noise"] != "seeded"  # seeded: reproducible, not a guarantee
        self.batch_size, self.local_steps = cfg["train.batch-size"], cfg["train.local-steps"]
        self.num_rounds, self.clip_norm, self.accountant = cfg["num-server-rounds"], cfg["dp.clip"], cfg["dp.accountant"]
        # A trained head may be clipped apart from the adapters (dp_sgd.GroupClippedDPOptimizer).
        self.head_clip = cfg["dp.head-clip"] if cfg["model.train-head"] else 0.0
        # ... and take its own share of the noise (strategies.mechanisms.dp_sgd_group_multipliers).
        self.head_noise_ratio = cfg["dp.head-noise-ratio"] if self.head_clip else 0.0
        # train.what = head / head-then-adapters: each phase clips to its own C (training.silo_round.phase_params)
        from strategies.mechanisms import dp_sgd_phase_clips

        self.phase_clips = dp_sgd_phase_clips(cfg["train.what"], self.clip_norm, self.head_clip)
        self.silos = list(client_sizes)  # population order: silo i is self.silos[i]
        self.sizes = dict(client_sizes)
        # A silo of its own may withhold its size (n = 0 here): it samples and accounts with its own n, and
        # its own ledger decides; the server neither plans nor tracks its rate.
        self.rates = {node: sample_rate(self.batch_size, n) if n > 0 else None for node, n in client_sizes.items()}
        known = [q for q in self.rates.values() if q is not None]
        planned_steps = self.local_steps * self.num_rounds
        if cfg["dp.noise-multiplier"] > 0:
            self.source, self.sigma = "noise-multiplier", float(cfg["dp.noise-multiplier"])
        elif known:
            self.source = "calibrated"
            self.sigma = calibrate_noise_multiplier(max(known), planned_steps, self.epsilon_target,
                                                    self.delta, self.accountant)
        else:
            raise ValueError("every silo withholds its shard size, so the server cannot calibrate sigma: set "
                             "dp.noise-multiplier (fedpower-privacy --recommend --client-sizes with the sizes the "
                             "silos declare), or the silos send theirs (node config send-shard-size = true)")
        self.planned_epsilon = (max(dp_sgd_epsilon([(q, self.sigma, planned_steps)], self.delta, self.accountant)
                                    for q in set(known)) if known else None)
        self.ledgers = {node: SiloLedger(self.delta, self.accountant) for node in self.silos}

    # -- PrivacyHook ------------------------------------------------------------------------
    def _epsilon_after_one_more(self, node: int) -> float:
        if self.rates[node] is None:  # a silo that withheld its size: its own ledger decides
            return 0.0
        return self.ledgers[node].epsilon_if(self.rates[node], self.sigma, self.local_steps)

    def admit(self, nodes: list[int], server_round: int) -> list[int]:
        admitted = []
        for node in nodes:
            if node not in self.ledgers:
                log.warning("round %d: node %s is not a known silo; not sent the round", server_round, node)
            elif self._epsilon_after_one_more(node) <= self.epsilon_target * (1 + 1e-9):
                admitted.append(node)
            else:
                log.info("round %d: silo %d is at its budget (eps %.3f); not sent the round", server_round,
                         self.silos.index(node), self.ledgers[node].epsilon())
        return admitted

    def train_config(self) -> dict:
        return {"dp-sgd.noise-multiplier": self.sigma, "dp-sgd.clip": self.clip_norm,
                "dp-sgd.batch-size": self.batch_size, "dp-sgd.local-steps": self.local_steps,
                "dp-sgd.head-clip": self.head_clip, "dp-sgd.head-noise-ratio": self.head_noise_ratio}

    def record_sent(self, nodes: list[int], server_round: int) -> None:
        # Counted when sent: a silo that trained and whose reply was lost still used its data.
        for node in nodes:
            if self.rates.get(node) is not None:
                self.ledgers[node].record(self.rates[node], self.sigma, self.local_steps)

    def noise_stds(self, round_type: str, num_clients: int) -> list[float]:
        return [0.0, 0.0]

    def check(self, round_type: str, server_round: int) -> None:
        if not any(self._epsilon_after_one_more(node) <= self.epsilon_target * (1 + 1e-9) for node in self.silos):
            raise BudgetExhausted(f"every silo would cross epsilon {self.epsilon_target:g} in round {server_round}")

    def record(self, round_type: str, server_round: int, num_sampled: int, num_aggregated: int) -> None:
        return None  # the server's release is post-processing of the silos' DP-SGD

    def epsilon(self) -> float:
        return max(ledger.epsilon() for ledger in self.ledgers.values())

    def state_dict(self) -> dict:
        """Every silo's ledger, by population index (node ids change when a run restarts)."""
        return {"kind": "silo", "sigma": self.sigma,
                "silos": [{"n": self.sizes[node], "ledger": self.ledgers[node].state_dict()} for node in self.silos]}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "silo":
            raise ValueError(f"privacy state of kind {state.get('kind')!r} cannot resume a DP-SGD run")
        saved = state["silos"]
        sizes = [self.sizes[node] for node in self.silos]
        if [int(s["n"]) for s in saved] != sizes:
            raise ValueError(f"the checkpoint's silos hold {[int(s['n']) for s in saved]} examples, this run's "
                             f"{sizes}: another population")
        if abs(float(state["sigma"]) - self.sigma) > 1e-12 * max(1.0, self.sigma):
            raise ValueError(f"the checkpoint's noise multiplier {state['sigma']} differs from this run's {self.sigma}")
        for node, s in zip(self.silos, saved):
            self.ledgers[node] = SiloLedger.from_state_dict(s["ledger"])

    def rebind(self, old_node: int, new_node: int) -> None:
        """Silo ``old_node`` reconnected as ``new_node``: its ledger, size and rate move with it."""
        i = self.silos.index(old_node)
        self.silos[i] = new_node
        self.ledgers[new_node] = self.ledgers.pop(old_node)
        self.sizes[new_node] = self.sizes.pop(old_node)
        self.rates[new_node] = self.rates.pop(old_node)

    def charge_lost_release(self, silos: list[int]) -> None:
        """The silos of a round lost in flight released noised updates nobody can reproduce."""
        for i in silos:
            node = self.silos[i]
            if self.rates[node] is not None:
                self.ledgers[node].record(self.rates[node], self.sigma, self.local_steps)

    # -- reporting ---------------------------------------------------------------------------
    def silo_table(self) -> list[dict[str, Any]]:
        return [{"silo": i, "node": int(node), "n": self.sizes[node] if self.rates[node] is not None else "withheld",
                 "q": self.rates[node], "sigma": self.sigma, "local_steps": self.local_steps,
                 "rounds_trained": self.ledgers[node].rounds,
                 "epsilon": self.ledgers[node].epsilon() if self.rates[node] is not None else "in the silo's own ledger"}
                for i, node in enumerate(self.silos)]

    def describe(self) -> dict[str, Any]:
        return {"source": self.source, "mechanism": "dp-sgd on the silos (Opacus)", "level": "sample",
                "noise_at": "silo", "noise_multiplier": self.sigma, "clip": self.clip_norm,
                "head_clip": self.head_clip, "head_noise_ratio": self.head_noise_ratio,
                "silo_noise_stds": ({phase: self.sigma * c for phase, c in self.phase_clips.items()} if self.phase_clips
                                    else dict(zip(("adapters", "head"), self.silo_noise_stds))),
                "batch_size": self.batch_size, "local_steps": self.local_steps, "epsilon": self.epsilon_target,
                "delta": self.delta, "accountant": self.accountant, "planned_rounds": self.num_rounds,
                "planned_epsilon": self.planned_epsilon,
                "participation_assumption": "calibrated as if every silo trained in every planned round; the "
                                            "budget check enforces each silo's bound whatever happens",
                "sample_rates": {str(i): self.rates[node] for i, node in enumerate(self.silos)},
                "is_valid_guarantee": self.is_valid_guarantee, "neighbouring": NEIGHBOURING["sample"],
                "label": "sample-level (eps, delta)-DP of every silo's examples, add/remove one example; "
                         "run epsilon = max over silos; no amplification by client sampling claimed"}

    @property
    def sensitivity(self) -> float:
        from strategies.mechanisms import dp_sgd_sensitivity  # the mechanism's formula (one home)

        return dp_sgd_sensitivity(self.clip_norm, self.head_clip)

    @property
    def silo_noise_stds(self) -> tuple[float, float]:
        """The noise std on a step's clipped sum of the adapters and of the head (the silos' own; the
        server adds none, ``noise_stds``)."""
        from strategies.mechanisms import dp_sgd_noise_stds

        return dp_sgd_noise_stds(self.sigma, self.clip_norm, self.head_clip, self.head_noise_ratio)

    def summary_lines(self) -> list[str]:
        known = [r for r in self.rates.values() if r is not None]
        q = max(known) if known else None
        if self.phase_clips:
            head_c = self.phase_clips["head rounds"]
            noise_line = (f"privacy: each step of a head round: the head's gradient clipped to C={head_c:g}, noise std "
                          f"on the clipped sum sigma*C={self.sigma * head_c:.4g}")
            if "adapter rounds" in self.phase_clips:
                adapter_c = self.phase_clips["adapter rounds"]
                noise_line += (f"; of an adapter round: the adapters' clipped to C={adapter_c:g} (the head stays "
                               f"as its rounds left it), sigma*C={self.sigma * adapter_c:.4g}; every round one "
                               f"Gaussian mechanism of multiplier sigma")
        elif self.head_noise_ratio:
            from strategies.mechanisms import dp_sgd_group_multipliers

            sig_a, sig_h = dp_sgd_group_multipliers(self.sigma, self.clip_norm, self.head_clip, self.head_noise_ratio)
            std_a, std_h = sig_a * self.clip_norm, sig_h * self.head_clip
            noise_line = (f"privacy: each step: adapters clipped to C={self.clip_norm:g}, head to C_h={self.head_clip:g} "
                          f"(one example added/removed), each its own noise: adapters sigma_a*C={std_a:.4g} "
                          f"(sigma_a={sig_a:.4g}), head sigma_h*C_h={std_h:.4g} (sigma_h={sig_h:.4g} = "
                          f"{self.head_noise_ratio:g}*sigma); 1/sigma_a^2+1/sigma_h^2 = 1/sigma^2: one Gaussian "
                          f"mechanism of multiplier sigma")
        else:
            delta = (f"Delta=C={self.clip_norm:g}" if not self.head_clip else
                     f"Delta=sqrt(C^2+C_h^2)={self.sensitivity:.4g} (adapters clipped to C, head to C_h={self.head_clip:g})")
            noise_line = (f"privacy: each step: {delta} (one example added/removed), noise std on the clipped sum "
                          f"sigma*Delta={self.sigma * self.sensitivity:.4g}, on the mean gradient sigma*Delta/b="
                          f"{self.sigma * self.sensitivity / self.batch_size:.3g}")
        return [
            f"privacy: sample-level DP by DP-SGD on the silos, target (eps={self.epsilon_target:g}, "
            f"delta={self.delta:g}), accountant {self.accountant}",
            f"privacy: sigma={self.sigma:.4f} ({self.source}), per-example clip C={self.clip_norm:g}, b={self.batch_size}, "
            f"L={self.local_steps}, " + (f"max q={q:.5f}" if q is not None else "q: each silo's own (sizes withheld)"),
            noise_line,
            (f"privacy: a silo that trains all T={self.num_rounds} rounds ends at eps {self.planned_epsilon:.3f}; "
             f"no silo is sent a round past eps {self.epsilon_target:g}" if self.planned_epsilon is not None else
             "privacy: the silos withheld their sizes: each silo's own ledger enforces its budget"),
        ]

    def final_report(self) -> dict[str, Any]:
        return {"epsilon_spent": self.epsilon(), "delta": self.delta, "level": "sample", "noise_at": "silo",
                "is_valid_guarantee": self.is_valid_guarantee, "silos": self.silo_table(),
                "ledgers": {str(i): self.ledgers[node].state_dict() for i, node in enumerate(self.silos)}}


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
        refactorization=cfg["strategy.client-refactorization"],
        power_iters=cfg["strategy.power-iters"],
        sample_mode=cfg["dp.sample-mode"],
        accountant=cfg["dp.accountant"],
        calibration=cfg["dp.calibration"],
    )


def build_privacy(cfg: RunConfig, *, client_sizes: list[int] | dict[int, int], num_modules: int,
                  adapter_shapes: dict | None = None):
    """The hook for this run: NonPrivate, SiloDPSGD (``dp.noise-at = silo``), or the paper's
    server-side AccountedPrivacy calibrated from (ε, δ). ``client_sizes`` maps node -> n_k in
    population order (a list means nodes 0..N-1)."""
    if not cfg.dp_enabled:
        return NonPrivate()
    if not isinstance(client_sizes, dict):
        client_sizes = dict(enumerate(client_sizes))
    if cfg["dp.level"] == "sample" and cfg["dp.noise-at"] == "silo":
        return SiloDPSGD(cfg, client_sizes)
    if cfg["secagg.enabled"] and cfg["dp.level"] == "client":  # the silos add the noise inside the secure sum
        from .distributed import DistributedClientDP

        if adapter_shapes is None:
            raise ValueError("distributed DP needs the adapters' shapes (the dimension of each secure sum)")
        return DistributedClientDP(cfg, num_clients=len(client_sizes), shapes=adapter_shapes)
    client_sizes = list(client_sizes.values())
    plan = make_plan(cfg, client_sizes=client_sizes, num_modules=num_modules)
    kw = {"noise_mode": cfg["dp.noise"], "record_cohort": cfg.diagnostics_released}
    if cfg["dp.calibration"] == "paper":
        return AccountedPrivacy(plan, A.calibrate(plan), source="paper", **kw)
    if cfg["dp.noise-multiplier"] > 0:
        return AccountedPrivacy(plan, A.epsilon_for_noise_multiplier(plan, cfg["dp.noise-multiplier"]),
                                source="noise-multiplier", **kw)
    return AccountedPrivacy(plan, A.calibrate(plan), source="calibrated", **kw)
