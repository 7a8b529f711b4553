"""Flower strategies for FedPower, FedLoRA and FFA-LoRA: thin adapters around the pure math.

Each strategy turns Flower messages into ``AdapterUpdate`` objects, calls a release function from
``strategies.releases`` and turns the result back into an ``ArrayRecord``. It adds what only a
server can do: Poisson client sampling, reply validation, the privacy budget check before each
release, and a per-round report.

Privacy is a hook (``PrivacyHook``): it gives the noise std per released block for a round and
records each release in the ledger. ``fedpower_app.privacy`` implements it on top of the
accountant; ``NoPrivacy`` is the non-private mode.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from .aggregation import AdapterUpdate, group_modules
from .noise import NoiseSource
from .releases import ReleaseContext
from .privacy_contract import BudgetExhausted, Disclosure, NoPrivacy, PrivacyHook, RoundPlan  # noqa: F401 (re-exported)
from . import mechanisms as MECH
from .validation import InvalidReply, check_declared_arrays, validate_tensors

log = logging.getLogger("fedpower")

LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"


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

    def to_dict(self) -> dict:
        return asdict(self)


def exchange(grid: Grid, messages: list[Message], timeout: float | None, *, min_poll: float = 0.02,
             max_poll: float = 0.5) -> list[Message]:
    """Push ``messages`` and collect the replies, polling with a short back-off.

    Flower's ``HttpGrid.send_and_receive`` sleeps a fixed 3 s between polls, which adds up to 3 s
    of idle time to every phase of every round; rounds here take seconds. Replies that miss the
    timeout are simply absent, as with Flower's own method.
    """
    if not messages:
        return []
    pending = set(grid.push_messages(messages))
    deadline = None if timeout is None else time.monotonic() + timeout
    replies: list[Message] = []
    poll = min_poll
    while pending and (deadline is None or time.monotonic() < deadline):
        got = list(grid.pull_messages(pending))
        replies.extend(got)
        pending.difference_update(m.metadata.reply_to_message_id for m in got)
        if pending:
            time.sleep(poll)
            poll = min(max_poll, poll * 1.5) if not got else min_poll
    return replies


def _state_to_record(state: dict[str, torch.Tensor]) -> ArrayRecord:
    return ArrayRecord(OrderedDict((k, v.detach().cpu().contiguous()) for k, v in state.items()))


class LoRAStrategy(Strategy):
    """Common machinery of the three strategies. Subclasses set ``method`` and the release."""

    method = "base"
    replies_a = True  # do clients send A back? (FFA-LoRA: no)

    def __init__(
        self,
        *,
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
    ) -> None:
        if not 0.0 < client_rate <= 1.0:
            raise ValueError(f"client_rate must be in (0, 1], got {client_rate}")
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
        if self.method == "fedsvd":  # refactorizes B_avg A_g: needs the round's public global A
            return MECH.ReleaseArgs(glob=self._global_factors())
        if self.privacy.noise_at == "server":
            # Sample level, server noise: the k-dependent releases (FedLoRA, FFA-LoRA, input
            # perturbation) average over the fixed m = q_c N, whose noise std is set before the
            # round; a reply dropped for NaN (which private data can cause) then moves the sum by at
            # most one clipped update and never the noise. The others normalise and ignore it.
            return MECH.ReleaseArgs(denominator=self.denominator or getattr(self.privacy, "fixed_denominator", None))
        return MECH.ReleaseArgs()

    # -- Flower Strategy API -----------------------------------------------------------------
    def summary(self) -> None:
        log.info("%s: %d LoRA modules in %d shape group(s), rank %d, client rate %.3g, privacy %s",
                 type(self).__name__, len(self.modules), len(self.ctx.groups), self.rank, self.client_rate,
                 "on" if self.privacy.enabled else "off")

    def _nodes(self, grid: Grid) -> list[int]:
        if self.population is None:
            self.population = sorted(grid.get_node_ids())
        return self.population

    def sample_clients(self, server_round: int, nodes: list[int]) -> list[int]:
        """Poisson sampling: each node independently with probability q_c (noise source coins)."""
        gen = self.noise.generator("client-sampling", server_round)
        coins = self.noise.bernoulli(len(nodes), self.client_rate, gen)
        return [n for n, c in zip(nodes, coins.tolist()) if c]

    def plan_round(self, server_round: int, grid: Grid) -> RoundPlan:
        """Sample the round's silos and ask the privacy layer for the round's plan (the first of
        its two calls a round). Raises ``BudgetExhausted`` if the round must not start."""
        sampled = self.sample_clients(server_round, self._nodes(grid))
        self._plan = self.privacy.plan_round(server_round, self.round_type(server_round), sampled)
        return self._plan

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        plan = getattr(self, "_plan", None)
        if plan is None or plan.server_round != server_round:
            plan = self.plan_round(server_round, grid)
        # DP-SGD on the silos: a silo whose ledger would cross the budget is never sent the round.
        self._sampled = list(plan.admitted)
        self._over_budget = plan.over_budget
        config["server-round"] = server_round
        config["round-type"] = plan.round_type
        config["train-lora"] = "AB" if self.replies_a else "B"  # what the silo trains and sends back
        for key, value in plan.train_config.items():
            config[key] = value
        content = RecordDict({"arrays": arrays, "config": config})
        self._bytes_down = arrays.count_bytes() * len(self._sampled)
        return [Message(content=content, dst_node_id=n, message_type=MessageType.TRAIN) for n in self._sampled]

    def _parse_reply(self, msg: Message, seen: set) -> AdapterUpdate:
        node = msg.metadata.src_node_id
        if msg.has_error():
            raise InvalidReply(f"error reply (code {msg.error.code}): {msg.error.reason}")
        if node not in self._sampled:
            raise InvalidReply("reply from a node that was not sampled this round")
        if node in seen:
            raise InvalidReply("duplicate reply")
        if not msg.has_content() or "arrays" not in msg.content.array_records:
            raise InvalidReply("reply has no 'arrays' ArrayRecord")
        record = msg.content.array_records["arrays"]
        try:
            declared = {k: (str(a.dtype), tuple(a.shape), len(a.data)) for k, a in record.items()}
        except Exception as exc:  # malformed metadata
            raise InvalidReply(f"arrays metadata could not be read: {exc}") from exc
        check_declared_arrays(declared, self.expected_reply_shapes())  # before decoding anything
        try:
            tensors = msg.content.array_records["arrays"].to_torch_state_dict()
        except Exception as exc:  # unsupported dtype, corrupt payload, ...
            raise InvalidReply(f"arrays could not be decoded: {exc}") from exc
        tensors = validate_tensors(dict(tensors), self.expected_reply_shapes())
        return AdapterUpdate(
            A={m: tensors[m + LORA_A] for m in self.modules} if self.replies_a else {},
            B={m: tensors[m + LORA_B] for m in self.modules},
            extra={k: tensors[k] - self.global_state[k] for k in self.extras},  # head: delta from global
        )

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        # Replies arrive in network order; summing in population order keeps a seeded run
        # repeatable (float addition is not associative). The sort is stable, so a duplicate
        # reply still loses to the first one received.
        position = {node: i for i, node in enumerate(self._sampled)}
        replies = sorted(replies, key=lambda msg: (position.get(msg.metadata.src_node_id, len(position)),
                                                   msg.metadata.src_node_id))
        report = RoundReport(server_round=server_round, round_type=self.round_type(server_round),
                             sampled=len(self._sampled), replied=len(replies),
                             bytes_down=getattr(self, "_bytes_down", 0),
                             over_budget=getattr(self, "_over_budget", 0))
        updates, losses, seen = [], [], set()
        for msg in replies:
            node = msg.metadata.src_node_id
            try:
                update = self._parse_reply(msg, seen)
            except InvalidReply as exc:
                if self.disclosure.full:  # node ids and reasons are statistics of private data
                    log.warning("round %d: dropped reply from node %s: %s", server_round, node, exc)
                report.dropped.append({"node": int(node), "reason": str(exc)})
                continue
            seen.add(node)
            updates.append(update)
            report.bytes_up += msg.content.array_records["arrays"].count_bytes()
            metrics = msg.content.metric_records.get("metrics")
            if metrics is not None and "train-loss" in metrics:
                losses.append(float(metrics["train-loss"]))
        report.aggregated = len(updates)
        answered = {msg.metadata.src_node_id for msg in replies}
        report.missing = [int(n) for n in self._sampled if n not in answered]
        if report.missing and self.disclosure.full:
            log.warning("round %d: no reply from %d silo(s) %s within the round timeout; the round goes on without "
                        "them (under DP-SGD their ledgers still count the round: it was sent)", server_round,
                        len(report.missing), report.missing)
        report.train_loss = sum(losses) / len(losses) if losses and self.disclosure.full else None

        plan = self._plan
        if not updates and self.privacy.noise_at != "server":
            # Nobody to aggregate and no server noise to release (non-private, or DP-SGD on the
            # silos where only the silos' replies touch data): keep the global model. The silos
            # sent the round are charged all the same (the second call to the privacy layer).
            report.released = False
            self.privacy.commit_round(plan, 0, released=False)
            self._finish_round(report)
            return None, None

        t0 = time.perf_counter()
        # The round step (strategies.mechanisms.release_round) at the planned stds, then the
        # commit: the silos sent the round and the release (it counts even if silos dropped out).
        release = MECH.release_round(report.round_type, updates, ctx=self.ctx, stds=plan.noise_stds,
                                     noise=self.noise, server_round=server_round,
                                     global_state=self.global_state, extra=self._release_args())
        self.privacy.commit_round(plan, len(updates), released=True)
        report.aggregation_seconds = time.perf_counter() - t0
        report.noise_stds = [float(s) for s in plan.noise_stds]
        if release.update_norms and self.disclosure.full:  # pre-clip norms: unbounded sensitivity
            report.update_norm_mean = sum(release.update_norms) / len(release.update_norms)
            report.clipped_fraction = sum(s < 1.0 for s in release.clip_scales) / len(release.clip_scales)
        self._finish_round(report)
        metrics = {"aggregated": report.aggregated, "dropped": len(report.dropped)}
        if report.train_loss is not None:
            metrics["train-loss"] = report.train_loss
        return _state_to_record(self.global_state), MetricRecord(metrics)

    def _finish_round(self, report: RoundReport) -> None:
        report.epsilon = self.privacy.epsilon()
        self.reports.append(report)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        if self.eval_fraction <= 0:
            return []
        nodes = self._nodes(grid)
        count = max(1, int(round(len(nodes) * self.eval_fraction)))
        gen = self.noise.generator("eval-sampling", server_round)
        chosen = [nodes[i] for i in torch.randperm(len(nodes), generator=gen)[:count].tolist()]
        config["server-round"] = server_round
        content = RecordDict({"arrays": arrays, "config": config})
        return [Message(content=content, dst_node_id=n, message_type=MessageType.EVALUATE) for n in chosen]

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        total, acc, loss = 0, 0.0, 0.0
        for msg in replies:
            if msg.has_error() or not msg.has_content():
                log.warning("round %d: dropped evaluate reply from node %s", server_round, msg.metadata.src_node_id)
                continue
            m = msg.content.metric_records.get("metrics")
            if m is None or "num-examples" not in m:
                continue
            n = int(m["num-examples"])
            total += n
            acc += float(m.get("accuracy", 0.0)) * n
            loss += float(m.get("loss", 0.0)) * n
        if total == 0:
            return None
        return MetricRecord({"accuracy": acc / total, "loss": loss / total, "num-examples": total})

    # -- the round loop ------------------------------------------------------------------------
    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
        on_round: Callable[[RoundReport, MetricRecord | None], None] | None = None,
        first_round: int = 1,
        on_round_start: Callable[[int, list[int]], None] | None = None,
        before_round: Callable[[int], None] | None = None,
        on_release: Callable[[RoundReport], None] | None = None,
    ) -> Result:
        """Flower's round loop plus a budget check before every release and a per-round callback.

        A round that would cross the privacy budget is not started: the run stops with
        ``stopped_reason`` set and the model of the last released round. ``on_round_start(round,
        nodes)`` runs after the round's silos are chosen and before any message leaves (the
        ServerApp journals the round there); ``first_round`` > 1 continues a checkpointed run.

        ``on_release(report)`` runs as soon as a round's release is applied and charged, before
        anything derived from it leaves: the evaluate messages that carry the new model, the
        central evaluation, ``on_round`` (results.json, the console). The ServerApp writes its
        checkpoint there, so no release leaves before it is charged durably.
        """
        self.summary()
        train_config = ConfigRecord() if train_config is None else train_config
        evaluate_config = ConfigRecord() if evaluate_config is None else evaluate_config
        result = Result()
        arrays = initial_arrays
        result.arrays = initial_arrays
        if evaluate_fn is not None and first_round == 1:
            res = evaluate_fn(first_round - 1, arrays)
            if res is not None:
                result.evaluate_metrics_serverapp[first_round - 1] = res
        for server_round in range(first_round, num_rounds + 1):
            if before_round is not None and server_round > 1:
                before_round(server_round)  # e.g. a silo whose SuperNode restarted rejoins
            try:
                self.plan_round(server_round, grid)  # the privacy layer's plan: may refuse the round
            except BudgetExhausted as exc:
                self.stopped_reason = str(exc)
                log.warning("stopping before round %d: %s", server_round, exc)
                break
            messages = list(self.configure_train(server_round, arrays, train_config, grid))
            if on_round_start is not None:
                on_round_start(server_round, list(self._sampled))
            replies = exchange(grid, messages, timeout)
            new_arrays, train_metrics = self.aggregate_train(server_round, replies)
            if on_release is not None:
                on_release(self.reports[-1])
            if new_arrays is not None:
                arrays = result.arrays = new_arrays
            if train_metrics is not None:
                result.train_metrics_clientapp[server_round] = train_metrics
            eval_msgs = list(self.configure_evaluate(server_round, arrays, evaluate_config, grid))
            if eval_msgs:
                agg = self.aggregate_evaluate(server_round, exchange(grid, eval_msgs, timeout))
                if agg is not None:
                    result.evaluate_metrics_clientapp[server_round] = agg
            central = evaluate_fn(server_round, arrays) if evaluate_fn is not None else None
            if central is not None:
                result.evaluate_metrics_serverapp[server_round] = central
            if on_round is not None:
                on_round(self.reports[-1], central)
        return result


class FedPowerStrategy(LoRAStrategy):
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


class FedLoRAStrategy(LoRAStrategy):
    """FedLoRA (paper App. Alg. 6): clip A_i and B_i, average each, add noise."""

    method = "fedlora"


class FFALoRAStrategy(LoRAStrategy):
    """FFA-LoRA (paper App. Alg. 7): A frozen at its seeded init; clip, average and noise B only."""

    method = "ffa-lora"
    replies_a = False


class FedSVDStrategy(LoRAStrategy):
    """FedSVD (Lee et al. 2025): silos train B with the global A frozen; the server averages B and
    refactorizes B_avg A_g by SVD into a new orthonormal A every round (strategies/fedsvd.py).
    Under DP-SGD on the silos that step is post-processing; no server-side noise is defined."""

    method = "fedsvd"
    replies_a = False

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        if self.privacy.noise_at == "server" or self.client_level:
            raise ValueError("FedSVD is defined with DP-SGD on the silos (dp.noise-at = silo) or without DP")


STRATEGY_CLASSES = {"fedpower": FedPowerStrategy, "input-perturbation": FedPowerStrategy,
                    "output-perturbation": FedPowerStrategy, "fedlora": FedLoRAStrategy,
                    "ffa-lora": FFALoRAStrategy, "fedsvd": FedSVDStrategy}


def trained_lora_factors(name: str) -> str:
    """What a silo trains under strategy ``name``: "AB", or "B" (FFA-LoRA freezes A)."""
    if name not in STRATEGY_CLASSES:
        raise ValueError(f"unknown strategy {name!r}")
    return "AB" if STRATEGY_CLASSES[name].replies_a else "B"


def build_strategy(name: str, **kw) -> LoRAStrategy:
    """Strategy for a ``strategy.name`` value."""
    refactor_every = kw.pop("refactor_every", 1)
    if name == "fedpower":
        return FedPowerStrategy(refactor_every=refactor_every, **kw)
    if name == "input-perturbation":
        return FedPowerStrategy(perturbation="input", **kw)
    if name == "output-perturbation":
        return FedPowerStrategy(perturbation="output", **kw)
    if name == "fedlora":
        return FedLoRAStrategy(**kw)
    if name == "ffa-lora":
        return FFALoRAStrategy(**kw)
    if name == "fedsvd":
        return FedSVDStrategy(**kw)
    raise ValueError(f"unknown strategy {name!r}")
