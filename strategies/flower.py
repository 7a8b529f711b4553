"""Flower strategies for FedPower, FedLoRA, FFA-LoRA and FedSVD: thin adapters over the round engine.

The round itself (sampling, the privacy plan, replies to updates, release, apply, commit) is
``strategies.engine.RoundEngine``, with no Flower in it. A strategy here adds only what Flower
needs: messages out (``configure_train``), message checks and decoding (``aggregate_train``),
federated evaluation and the round loop (``start``) with its budget check and callbacks.

Privacy is a hook (``PrivacyHook``): it plans a round (admitted silos, train config, noise std per
released block) and records what happened. ``fedpower_app.privacy`` implements it on top of the
accountant; ``NoPrivacy`` is the non-private mode.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Callable, Iterable

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from .aggregation import AdapterUpdate
from .engine import (  # noqa: F401 (re-exported)
    LORA_A, LORA_B, FedLoRAEngine, FedPowerEngine, FedSVDEngine, FFALoRAEngine, RoundEngine, RoundReport,
    engine_kwargs, trained_lora_factors)
from .privacy_contract import BudgetExhausted, Disclosure, NoPrivacy, PrivacyHook, RoundPlan  # noqa: F401 (re-exported)
from .validation import InvalidReply, check_declared_arrays

log = logging.getLogger("fedpower")


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


class LoRAStrategy(RoundEngine, Strategy):
    """The Flower adapter of the round engine. Subclasses pair it with a method's engine."""

    # -- Flower Strategy API -----------------------------------------------------------------
    def _nodes(self, grid: Grid) -> list[int]:
        if self.population is None:
            self.population = sorted(grid.get_node_ids())
        return self.population

    def plan_round(self, server_round: int, grid: Grid) -> RoundPlan:
        """Sample the round's silos and ask the privacy layer for the round's plan (the first of
        its two calls a round). Raises ``BudgetExhausted`` if the round must not start."""
        return self.plan_for(server_round, self._nodes(grid))

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        plan = getattr(self, "_plan", None)
        if plan is None or plan.server_round != server_round:
            plan = self.plan_round(server_round, grid)
        # DP-SGD on the silos: a silo whose ledger would cross the budget is never sent the round.
        self._sampled = list(plan.admitted)
        self._over_budget = plan.over_budget
        for key, value in self.train_instructions(plan).items():  # incl. what the silo trains and sends back
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
        return self.update_from_state(tensors)

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
        answered = {msg.metadata.src_node_id for msg in replies}
        report.missing = [int(n) for n in self._sampled if n not in answered]
        if report.missing and self.disclosure.full:
            log.warning("round %d: no reply from %d silo(s) %s within the round timeout; the round goes on without "
                        "them (under DP-SGD their ledgers still count the round: it was sent)", server_round,
                        len(report.missing), report.missing)
        report.train_loss = sum(losses) / len(losses) if losses and self.disclosure.full else None
        if not self.release_updates(report, updates):  # the engine: release, apply, commit
            return None, None
        metrics = {"aggregated": report.aggregated, "dropped": len(report.dropped)}
        if report.train_loss is not None:
            metrics["train-loss"] = report.train_loss
        return _state_to_record(self.global_state), MetricRecord(metrics)

    def aggregate_secure(self, server_round: int, replies: list[Message], grid: Grid,
                         timeout: float | None) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """A round under secure aggregation (``strategies.secure_release``): the train replies carry
        only the first secure sum's keys; the sums follow in ``train.secagg`` messages."""
        from .secure_release import release_secure_round
        from .secure_rounds import message_transport, train_reply_payloads

        report = RoundReport(server_round=server_round, round_type=self.round_type(server_round),
                             sampled=len(self._sampled), replied=len(replies),
                             bytes_down=getattr(self, "_bytes_down", 0),
                             over_budget=getattr(self, "_over_budget", 0))
        losses = []
        for msg in replies:
            metrics = msg.content.metric_records.get("metrics") if msg.has_content() else None
            if metrics is not None and "train-loss" in metrics:
                losses.append(float(metrics["train-loss"]))
        answered = {msg.metadata.src_node_id for msg in replies}
        report.missing = [int(n) for n in self._sampled if n not in answered]
        report.train_loss = sum(losses) / len(losses) if losses and self.disclosure.full else None
        counters: dict = {}
        advertised = {n: p for n, p in train_reply_payloads(replies).items() if n in self._sampled}
        released = release_secure_round(self, report, self._secure_round,
                                        message_transport(grid, timeout, exchange, counters), advertised)
        report.bytes_down += counters.get("bytes_down", 0)
        if self.disclosure.full:  # node ids and reasons are statistics of private data
            for d in report.dropped:
                log.warning("round %d: secure sum: dropped node %s at %s: %s", server_round, d["node"],
                            d.get("stage", "train"), d["reason"])
        if not released:
            return None, None
        metrics = {"aggregated": report.aggregated, "dropped": len(report.dropped),
                   "message-rounds": report.message_rounds}
        if report.train_loss is not None:
            metrics["train-loss"] = report.train_loss
        return _state_to_record(self.global_state), MetricRecord(metrics)

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
        total, acc, loss, dropped = 0, 0.0, 0.0, 0
        for msg in replies:
            if msg.has_error() or not msg.has_content():
                dropped += 1
                if self.disclosure.full:  # which silo refused is a statistic of private data: counted, not named
                    log.warning("round %d: dropped evaluate reply from node %s", server_round, msg.metadata.src_node_id)
                continue
            m = msg.content.metric_records.get("metrics")
            if m is None or "num-examples" not in m:
                continue
            n = int(m["num-examples"])
            total += n
            acc += float(m.get("accuracy", 0.0)) * n
            loss += float(m.get("loss", 0.0)) * n
        if dropped and not self.disclosure.full:
            log.info("round %d: %d evaluate repl(ies) dropped (a silo may refuse to evaluate on its rows)",
                     server_round, dropped)
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
            if self.secure is not None:  # the server sees only sums of the replies
                new_arrays, train_metrics = self.aggregate_secure(server_round, replies, grid, timeout)
            else:
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


class FedPowerStrategy(LoRAStrategy, FedPowerEngine):
    """FedPower (``FedPowerEngine``) as a Flower strategy."""


class FedLoRAStrategy(LoRAStrategy, FedLoRAEngine):
    """FedLoRA (``FedLoRAEngine``) as a Flower strategy."""


class FFALoRAStrategy(LoRAStrategy, FFALoRAEngine):
    """FFA-LoRA (``FFALoRAEngine``) as a Flower strategy."""


class FedSVDStrategy(LoRAStrategy, FedSVDEngine):
    """FedSVD (``FedSVDEngine``) as a Flower strategy."""


STRATEGY_CLASSES = {"fedpower": FedPowerStrategy, "input-perturbation": FedPowerStrategy,
                    "output-perturbation": FedPowerStrategy, "fedlora": FedLoRAStrategy,
                    "ffa-lora": FFALoRAStrategy, "fedsvd": FedSVDStrategy}


def build_strategy(name: str, **kw) -> LoRAStrategy:
    """Strategy for a ``strategy.name`` value (any method of ``strategies.mechanisms.METHODS``)."""
    _family, kw = engine_kwargs(name, kw)
    return STRATEGY_CLASSES.get(name, LoRAStrategy)(**kw)
