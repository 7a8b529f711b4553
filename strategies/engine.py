"""The round engine: one round of a federated LoRA strategy, with no Flower in it.

A round is: sample the silos (Poisson, from the noise source's coins), ask the privacy layer for
the round's plan (admitted silos, train config, noise stds), turn each silo's reply into an
``AdapterUpdate`` (validated), release the round with its mechanism (``strategies.mechanisms``)
at the planned stds, apply it to the global state, and commit the round to the privacy layer.
The privacy layer is called twice a round: ``plan_round`` and ``commit_round``.

``strategies.flower`` adapts this engine to Flower's ``Strategy`` (messages in, records out), the
in-process benchmarks (``benchmarks/e2e.py``) drive it directly: both run this code, not a copy.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field

import torch

from .aggregation import AdapterUpdate, group_modules
from .noise import NoiseSource
from .releases import ReleaseContext
from .privacy_contract import Disclosure, NoPrivacy, PrivacyHook, RoundPlan
from . import mechanisms as MECH
from .validation import validate_tensors

log = logging.getLogger("fedpower")

LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"

#: Each strategy name's engine (FedPower's ablations are FedPower with another release): the
#: method table (strategies.mechanisms.METHODS) is the one home.
METHOD_FAMILY = {name: m.engine for name, m in MECH.METHODS.items()}
#: Methods whose silos train (and send back) only B against the global A.
B_ONLY_METHODS = tuple(name for name, m in MECH.METHODS.items() if m.trains == "B")


def trained_lora_factors(name: str) -> str:
    """What a silo trains under strategy ``name``: "AB", or "B" (FFA-LoRA and FedSVD freeze A)."""
    if name not in MECH.METHODS:
        raise ValueError(f"unknown strategy {name!r}")
    return MECH.METHODS[name].trains


@dataclass
class RoundReport:
    """What happened in one round (logged, written to results.json)."""

    server_round: int
    round_type: str
    sampled: int = 0
    replied: int = 0
    aggregated: int = 0
    dropped: list[dict] = field(default_factory=list)
    bytes_down: int = 0
    bytes_up: int = 0
    aggregation_seconds: float = 0.0
    train_loss: float | None = None
    update_norm_mean: float | None = None
    clipped_fraction: float | None = None
    epsilon: float | None = None
    noise_stds: list[float] = field(default_factory=list)
    released: bool = True
    over_budget: int = 0  # sampled silos not sent the round: their ledger would cross the budget
    missing: list[int] = field(default_factory=list)  # silos sent the round whose reply never came (timeout, crash)
    message_rounds: int = 1  # server-silo exchanges of the round's training (more under secure aggregation)
    secure_clamped: float | None = None  # secure aggregation: fraction of coordinates clamped to the field's range
    secure_refused: str | None = None  # secure aggregation: why the round's sums were refused (nothing released)

    def to_dict(self) -> dict:
        return asdict(self)


class RoundEngine:
    """One federated LoRA method's rounds, Flower-free: sampling, plan, replies to updates,
    release, apply, commit. Subclasses (or ``method=``) choose the method."""

    method = "base"
    replies_a = True  # do silos send A back? Set from the method table (FFA-LoRA, FedSVD: no)

    def __init__(
        self,
        *,
        method: str | None = None,
        initial_state: dict[str, torch.Tensor],
        rank: int,
        client_rate: float,
        noise: NoiseSource | None = None,
        privacy: PrivacyHook | None = None,
        power_iters: int = 1,
        factored: bool = True,
        device: str | torch.device = "cpu",
        eval_fraction: float = 0.0,
        population: list[int] | None = None,
        client_level: bool = False,
        refactorization: str = "powerdp-l",
        denominator: float | None = None,
        disclosure: Disclosure | None = None,
        secure_aggregation=None,
    ) -> None:
        if not 0.0 < client_rate <= 1.0:
            raise ValueError(f"client_rate must be in (0, 1], got {client_rate}")
        if method is not None:
            self.method = method
        spec = MECH.METHODS.get(self.method)  # the method table: what its silos train, where it is defined
        if spec is not None:
            self.replies_a = spec.trains == "AB"
        self.rank = rank
        self.client_rate = client_rate
        self.noise = noise or NoiseSource()
        self.privacy = privacy or NoPrivacy()
        # What the logs may say about replies (node ids, reasons, counts) and whether pre-clip norms
        # are computed: the ServerApp passes the run's Disclosure (only what the guarantee covers,
        # unless dp.diagnostics = released); a strategy used as a library shows everything.
        self.disclosure = disclosure or Disclosure()
        self.eval_fraction = eval_fraction
        # The population's order is the order of the client-sampling coins (and of summation).
        # Callers give a run-independent order (the ServerApp: by partition id), so a seeded run
        # samples the same silos again; without one, node ids in ascending order.
        if population and len(set(population)) != len(population):
            raise ValueError("population lists a node more than once")
        self.population = list(population) if population else None
        # Client level (strategies/client_delta.py): releases of each silo's round delta, averaged
        # over the fixed expected cohort m = q_c N; FedPower refactorizes with PowerDP-L (or the
        # paper's PowerDP on the delta, an ablation).
        if client_level and not (denominator and denominator > 0):
            raise ValueError("client level needs the fixed denominator m = q_c N > 0")
        if refactorization not in MECH.CLIENT_REFACTORIZATION:
            raise ValueError(f"refactorization must be one of {list(MECH.CLIENT_REFACTORIZATION)}, "
                             f"got {refactorization!r}")
        self.client_level, self.refactorization, self.denominator = client_level, refactorization, denominator
        if spec is not None and spec.silo_noise_only and (self.privacy.noise_at == "server" or client_level):
            raise ValueError(f"{self.method} is defined with DP-SGD on the silos (dp.noise-at = silo) or without DP")
        self.method_name = self.method  # FedPower's ablations set their own (input/output-perturbation)
        self.refactor_every = 1
        self.device = device
        self.global_state = {k: v.detach().to(torch.float32).clone() for k, v in initial_state.items()}
        self.modules = sorted(k[: -len(LORA_A)] for k in self.global_state if k.endswith(LORA_A))
        if not self.modules:
            raise ValueError("initial_state has no LoRA adapters (keys ending in .lora_A.weight)")
        self.extras = sorted(k for k in self.global_state if not (k.endswith(LORA_A) or k.endswith(LORA_B)))
        shapes = {}
        for name in self.modules:
            r, n = self.global_state[name + LORA_A].shape
            m, r_b = self.global_state[name + LORA_B].shape
            if r != r_b or r != rank:
                raise ValueError(f"module {name}: A is {r}x{n}, B is {m}x{r_b}, but rank is {rank}")
            shapes[name] = (m, n, r)
        clip = self.privacy.clip if self.privacy.clip is not None else float("inf")  # None: the server does not clip
        self.ctx = ReleaseContext(
            groups=group_modules(shapes),
            extra_shapes={k: tuple(self.global_state[k].shape) for k in self.extras},
            clip=clip,
            rank=rank,
            power_iters=power_iters,
            noise=self.noise,
            factored=factored,
            device=device,
        )
        # Secure aggregation (strategies/secure_release.py): the server sees only sums of the replies.
        self.secure = secure_aggregation
        self._secure_round = None
        if self.secure is not None:
            from .secure_release import unsupported_reason

            reason = unsupported_reason(self)
            if reason:
                raise ValueError(f"secagg.enabled: {reason}")
        self._sampled: list[int] = []
        self._plan: RoundPlan | None = None  # the privacy layer's plan of the current round
        self.reports: list[RoundReport] = []
        self.stopped_reason: str | None = None

    # -- round schedule --------------------------------------------------------------------
    def round_type(self, server_round: int) -> str:
        """What is released in this round: the one schedule (strategies.mechanisms.round_type) that
        the accountant also follows."""
        return MECH.round_type(self.method_name, server_round, refactor_every=self.refactor_every,
                               level="client" if self.client_level else "sample",
                               refactorization=self.refactorization)

    def _global_factors(self):
        return ({m: self.global_state[m + LORA_A] for m in self.modules},
                {m: self.global_state[m + LORA_B] for m in self.modules})

    def expected_reply_shapes(self) -> dict[str, tuple[int, ...]]:
        keys = [m + LORA_B for m in self.modules] + self.extras
        if self.replies_a:
            keys += [m + LORA_A for m in self.modules]
        return {k: tuple(self.global_state[k].shape) for k in keys}

    def _release_args(self) -> MECH.ReleaseArgs:
        if self.client_level:
            return MECH.ReleaseArgs(glob=self._global_factors(), denominator=self.denominator)
        if self.needs_global:  # e.g. FedSVD refactorizes B_avg A_g: needs the round's public global A
            return MECH.ReleaseArgs(glob=self._global_factors())
        if self.privacy.noise_at == "server":
            # Sample level, server noise: the k-dependent releases (FedLoRA, FFA-LoRA, input
            # perturbation) average over the fixed m = q_c N, whose noise std is set before the
            # round; a reply dropped for NaN (which private data can cause) then moves the sum by at
            # most one clipped update and never the noise. The others normalise and ignore it.
            return MECH.ReleaseArgs(denominator=self.denominator or getattr(self.privacy, "fixed_denominator", None))
        return MECH.ReleaseArgs()

    @property
    def needs_global(self) -> bool:
        spec = MECH.METHODS.get(self.method)
        return bool(spec and spec.needs_global)

    def summary(self) -> None:
        log.info("%s: %d LoRA modules in %d shape group(s), rank %d, client rate %.3g, privacy %s",
                 type(self).__name__, len(self.modules), len(self.ctx.groups), self.rank, self.client_rate,
                 "on" if self.privacy.enabled else "off")

    # -- sampling and the round's plan (the privacy layer's first call) ------------------------
    def sample_clients(self, server_round: int, nodes: list[int]) -> list[int]:
        """Poisson sampling: each node independently with probability q_c (noise source coins)."""
        gen = self.noise.generator("client-sampling", server_round)
        coins = self.noise.bernoulli(len(nodes), self.client_rate, gen)
        return [n for n, c in zip(nodes, coins.tolist()) if c]

    def plan_for(self, server_round: int, nodes: list[int]) -> RoundPlan:
        """Sample the round's silos among ``nodes`` and ask the privacy layer for the round's plan.
        Raises ``BudgetExhausted`` if the round must not start."""
        sampled = self.sample_clients(server_round, nodes)
        self._plan = self.privacy.plan_round(server_round, self.round_type(server_round), sampled)
        self._sampled = list(self._plan.admitted)
        self._over_budget = self._plan.over_budget
        if self.secure is not None:
            from .secure_release import SecureRound

            self._secure_round = SecureRound(self, server_round, self._plan.round_type, self._sampled)
        return self._plan

    def train_instructions(self, plan: RoundPlan) -> dict:
        """What every admitted silo is told for the round (the train message's config)."""
        out = {"server-round": plan.server_round, "round-type": plan.round_type,
               "train-lora": "AB" if self.replies_a else "B", **plan.train_config}
        if self._secure_round is not None and self._secure_round.server_round == plan.server_round:
            request = self._secure_round.train_request()
            if request is not None:  # keep the adapters, answer with the first secure sum's keys
                out["secagg.request"] = request
        return out

    # -- replies -------------------------------------------------------------------------------
    def update_from_state(self, tensors: dict[str, torch.Tensor]) -> AdapterUpdate:
        """A silo's reply (its trained adapters and head) as an update; raises ``InvalidReply``
        on a missing, extra, misshapen or non-finite tensor."""
        tensors = validate_tensors(dict(tensors), self.expected_reply_shapes())
        return AdapterUpdate(
            A={m: tensors[m + LORA_A] for m in self.modules} if self.replies_a else {},
            B={m: tensors[m + LORA_B] for m in self.modules},
            extra={k: tensors[k] - self.global_state[k] for k in self.extras},  # head: delta from global
        )

    # -- the release and the commit (the privacy layer's second call) -------------------------
    def release_updates(self, report: RoundReport, updates: list[AdapterUpdate]) -> bool:
        """Release the round from ``updates`` at the planned stds, apply it to the global state and
        commit the round. Returns whether a new global model was released."""
        plan = self._plan
        report.aggregated = len(updates)
        if not updates and self.privacy.noise_at != "server":
            # Nobody to aggregate and no server noise to release (non-private, or DP-SGD on the
            # silos where only the silos' replies touch data): keep the global model. The silos
            # sent the round are charged all the same.
            report.released = False
            self.privacy.commit_round(plan, 0, released=False)
            self.finish_round(report)
            return False
        t0 = time.perf_counter()
        release = MECH.release_round(report.round_type, updates, ctx=self.ctx, stds=plan.noise_stds,
                                     noise=self.noise, server_round=report.server_round,
                                     global_state=self.global_state, extra=self._release_args())
        # the silos sent the round and the release count even if silos dropped out
        self.privacy.commit_round(plan, len(updates), released=True)
        report.aggregation_seconds = time.perf_counter() - t0
        report.noise_stds = [float(s) for s in plan.noise_stds]
        if release.update_norms and self.disclosure.full:  # pre-clip norms: unbounded sensitivity
            report.update_norm_mean = sum(release.update_norms) / len(release.update_norms)
            report.clipped_fraction = sum(s < 1.0 for s in release.clip_scales) / len(release.clip_scales)
        self.finish_round(report)
        return True

    def finish_round(self, report: RoundReport) -> None:
        report.epsilon = self.privacy.epsilon()
        self.reports.append(report)


class FedPowerEngine(RoundEngine):
    """FedPower: merge B_i A_i, clip the whole update, average, refactorize with PowerDP.

    ``perturbation`` selects the paper's ablations (§6.3): ``"powerdp"`` (default), ``"input"``
    or ``"output"``. With ``refactor_every = F > 1`` only rounds t with t % F == 0 refactorize;
    the others use a FedLoRA release (paper §6.4).
    """

    method = "fedpower"
    _METHOD_OF = {"powerdp": "fedpower", "input": "input-perturbation", "output": "output-perturbation"}

    def __init__(self, *, perturbation: str = "powerdp", refactor_every: int = 1, **kw) -> None:
        if perturbation not in self._METHOD_OF:
            raise ValueError(f"perturbation must be powerdp, input or output, got {perturbation!r}")
        if refactor_every < 1:
            raise ValueError(f"refactor_every must be >= 1, got {refactor_every}")
        super().__init__(**kw)
        self.perturbation = perturbation
        self.method_name = self._METHOD_OF[perturbation]
        self.refactor_every = refactor_every


class FedLoRAEngine(RoundEngine):
    """FedLoRA (paper App. Alg. 6): clip A_i and B_i, average each, add noise."""

    method = "fedlora"


class FFALoRAEngine(RoundEngine):
    """FFA-LoRA (paper App. Alg. 7): A frozen at its seeded init; clip, average and noise B only."""

    method = "ffa-lora"


class FedSVDEngine(RoundEngine):
    """FedSVD (Lee et al. 2025): silos train B with the global A frozen; the server averages B and
    refactorizes B_avg A_g by SVD into a new orthonormal A every round (strategies/fedsvd.py).
    Under DP-SGD on the silos that step is post-processing; no server-side noise is defined."""

    method = "fedsvd"


#: Engines with a constructor of their own; any other method of the table runs on RoundEngine.
ENGINES = {"fedpower": FedPowerEngine, "fedlora": FedLoRAEngine, "ffa-lora": FFALoRAEngine, "fedsvd": FedSVDEngine}
_PERTURBATION = {"input-perturbation": "input", "output-perturbation": "output"}


def engine_kwargs(name: str, kw: dict) -> tuple[str, dict]:
    """The engine of strategy ``name`` and its constructor arguments (``refactor_every``
    applies to FedPower only; the ablations are FedPower with another perturbation; a method
    without an engine of its own gets ``method=name``)."""
    if name not in METHOD_FAMILY:
        raise ValueError(f"unknown strategy {name!r}")
    kw = dict(kw)
    refactor_every = kw.pop("refactor_every", 1)
    family = METHOD_FAMILY[name]
    if name == "fedpower":
        kw["refactor_every"] = refactor_every
    elif name in _PERTURBATION:
        kw["perturbation"] = _PERTURBATION[name]
    elif family not in ENGINES:
        kw["method"] = name
    return family, kw


def build_engine(name: str, **kw) -> RoundEngine:
    """The Flower-free engine of a ``strategy.name`` value (the strategies' twin)."""
    family, kw = engine_kwargs(name, kw)
    return ENGINES.get(family, RoundEngine)(**kw)
