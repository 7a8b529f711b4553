"""fedpower ServerApp: builds the strategy from the run config, runs the rounds, evaluates the
global model centrally after every round, and writes results and the final adapters.

Output: ``<output-dir>/<run-name>/results.json`` (config, privacy calibration, per-round metrics,
totals; rewritten after every round) and ``<output-dir>/<run-name>/adapter/`` (PEFT
``save_pretrained``, loadable with ``PeftModel.from_pretrained``).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid, ServerApp

from fedpower_app.runs import checkpoint as CK
from fedpower_app.runs.spec import default_run_name
from fedpower_app import data as D
from fedpower_app import model as M
from fedpower_app.config import RunConfig, parse_config
from fedpower_app.logging_setup import setup_logging
from fedpower_app.privacy import build_privacy, guarantee
from fedpower_app.released import save_released
from fedpower_app.runs.auto import refuse_unresolved
from fedpower_app.runs.results import ResultsWriter, no_round_aggregated
from fedpower_app.training import evaluate as evaluate_model
from fedpower_app.training.metrics import final_baseline
from strategies.engine import build_engine
from strategies.flower import RoundReport, build_strategy, exchange
from strategies.privacy_contract import Disclosure
from strategies.noise import NoiseSource
from strategies.secure_sum.session import SecureAggregation

app = ServerApp()
log = logging.getLogger("fedpower")


def run_directory(cfg: RunConfig) -> Path:
    name = cfg["run-name"] or default_run_name(cfg)
    return Path(cfg["output-dir"]).expanduser() / name


def describe_sizes(sizes, *, list_up_to: int = 12) -> str:
    """The shard sizes for the start log: the sorted list for a few silos, a summary for many (a
    cross-device run with 1,000 clients would otherwise log a 5,000-character line)."""
    ordered = sorted(int(s) for s in sizes)
    if len(ordered) <= list_up_to:
        return str(ordered)
    median = ordered[len(ordered) // 2]
    return f"{ordered[0]}-{ordered[-1]} (median {median}, total {sum(ordered)})"


def discover_clients(grid: Grid, cfg: RunConfig) -> tuple[dict[int, int], dict[int, int]]:
    """Wait for ``strategy.min-nodes`` SuperNodes, then ask each for its training-shard size.
    Returns {node: size} in population order (``population_order``)."""
    deadline = time.time() + cfg["strategy.round-timeout"]
    while len(nodes := sorted(grid.get_node_ids())) < cfg["strategy.min-nodes"]:
        if time.time() > deadline:
            raise RuntimeError(f"only {len(nodes)} SuperNode(s) connected after {cfg['strategy.round-timeout']:.0f} s; "
                               f"strategy.min-nodes = {cfg['strategy.min-nodes']}")
        log.info("waiting for SuperNodes: %d connected, %d required", len(nodes), cfg["strategy.min-nodes"])
        time.sleep(2.0)
    sizes, partitions = query_sizes(grid, nodes, cfg["strategy.round-timeout"])
    if not sizes:
        raise RuntimeError("no SuperNode answered the size query; check the ClientApp logs")
    return {node: sizes[node] for node in population_order(sizes, partitions)}, partitions


def query_sizes(grid: Grid, nodes, timeout: float) -> tuple[dict[int, int], dict[int, int]]:
    """Ask nodes for their training-shard size (and partition id, if they have one)."""
    content = RecordDict({"config": ConfigRecord({"query": "dataset-size"})})
    msgs = [Message(content=content, dst_node_id=n, message_type=MessageType.QUERY) for n in nodes]
    sizes: dict[int, int] = {}
    partitions: dict[int, int] = {}
    for reply in exchange(grid, msgs, timeout):
        node = reply.metadata.src_node_id
        if reply.has_error():
            log.warning("node %s failed the size query and is left out: %s", node, reply.error.reason)
            continue
        try:
            metrics = reply.content.metric_records["metrics"]
            sizes[node] = int(metrics.get("num-examples", 0))  # none at client level: withheld by the silo
            if "partition-id" in metrics:
                partitions[node] = int(metrics["partition-id"])
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("node %s sent a malformed size reply and is left out: %s", node, exc)
    return sizes, partitions


class Roster:
    """Which node is which silo. The population (silo i = the i-th by partition id) is fixed at
    start; a silo whose SuperNode restarts comes back under a new node id (unless SuperNode
    authentication keeps its id), so before every round new nodes are asked for their partition id
    and shard size, and a node that matches a silo whose old node is gone takes its place, with
    its ledger. A node that matches no silo, or reports another shard size, is not admitted."""

    def __init__(self, grid: Grid, cfg: RunConfig, sizes: dict[int, int], partitions: dict[int, int]) -> None:
        self.grid, self.cfg = grid, cfg
        self.sizes = [int(n) for n in sizes.values()]
        self.partition_of_silo = [partitions.get(node) for node in sizes]
        self.ignored: set[int] = set()

    def refresh(self, server_round: int, strategy, privacy) -> list[dict]:
        current = set(self.grid.get_node_ids())
        new = sorted(current - set(strategy.population) - self.ignored)
        if not new:
            return []
        sizes, partitions = query_sizes(self.grid, new, min(60.0, self.cfg["strategy.round-timeout"]))
        events = []
        for node in new:
            pid, n = partitions.get(node), sizes.get(node)
            silo = self.partition_of_silo.index(pid) if pid is not None and pid in self.partition_of_silo else None
            old = strategy.population[silo] if silo is not None else None
            if silo is None or n != self.sizes[silo] or old in current:
                why = ("no silo with its partition id" if silo is None else
                       f"shard size {n} != {self.sizes[silo]}" if n != self.sizes[silo] else
                       f"silo {silo} is still connected as node {old}")
                log.warning("round %d: node %s is not admitted to the population: %s", server_round, node, why)
                if silo is None or n != self.sizes[silo]:
                    self.ignored.add(node)  # never a silo; a node waiting for its old id to go is asked again
                events.append({"round": server_round, "node": int(node), "admitted": False, "reason": why})
                continue
            strategy.population[silo] = node
            privacy.rebind(old, node)
            log.info("round %d: silo %d rejoined as node %s (was %s)", server_round, silo, node, old)
            events.append({"round": server_round, "node": int(node), "silo": silo, "admitted": True,
                           "replaces": int(old)})
        return events


def population_order(nodes, partitions: dict[int, int]) -> list[int]:
    """Nodes by (partition id, node id). Node ids are random per run, partition ids are not: in this
    order the seeded client-sampling coins pick the same silos, and the replies are summed in the same
    order, in every run of a seed."""
    return sorted(nodes, key=lambda node: (partitions.get(node, float("inf")), node))


class CentralEvaluator:
    """Central evaluation on every evaluation split; the first split drives the progress line.

    It keeps the state and the first split's logits of its last evaluation, so the run can save
    exactly what it evaluated and prove it (``final-eval-logits.pt``)."""

    def __init__(self, cfg: RunConfig, model, splits, device) -> None:
        self.cfg, self.model, self.splits, self.device = cfg, model, splits, device
        self.last_state: dict | None = None
        self.last_logits: torch.Tensor | None = None

    def __call__(self, server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        CK.fault_point("before-central-eval", server_round)  # tests: a kill after the evaluate messages left
        last = server_round == self.cfg["num-server-rounds"]
        if server_round > 0 and server_round % self.cfg["eval.every"] and not last:
            return None
        return self.evaluate_state(arrays.to_torch_state_dict())

    def evaluate_state(self, state: dict) -> MetricRecord:
        M.load_adapter_state(self.model, state)
        out: dict[str, float] = {}
        for i, (name, split) in enumerate(self.splits.items()):
            logits: list | None = [] if i == 0 else None
            res = evaluate_model(self.model, split, batch_size=self.cfg["eval.batch-size"], device=self.device,
                                 precision=self.cfg["train.precision"],
                                 logits_out=logits)
            if i == 0:
                out["accuracy"], out["loss"] = res["accuracy"], res["loss"]
                out.update({k: v for k, v in res.items() if k in EVALUATION_METRICS})  # macro-F1, baseline ...
                self.last_logits = torch.cat(logits) if logits else torch.empty(0)
            out[f"{name}-accuracy"], out[f"{name}-loss"] = res["accuracy"], res["loss"]
        self.last_state = {k: v.detach().clone() for k, v in state.items()}
        return MetricRecord(out)

    def evaluated(self, state: dict) -> bool:
        """Was ``state`` the subject of the last evaluation (bit for bit)?"""
        last = self.last_state
        return last is not None and last.keys() == state.keys() and all(torch.equal(last[k], state[k]) for k in state)


#: What a central evaluation reports beside accuracy and loss (fedpower_app.training.metrics).
EVALUATION_METRICS = ("macro-f1", "balanced-accuracy", "majority-accuracy", "majority-macro-f1")


def metric_text(metrics: MetricRecord, lead: str = "accuracy") -> str:
    """``acc 0.8123 loss 0.4120``, led by ``task.metric`` with the majority baseline when it is another."""
    text = f"acc {metrics['accuracy']:.4f} loss {metrics['loss']:.4f}"
    if lead != "accuracy" and lead in metrics:
        base = metrics.get("majority-macro-f1") if lead == "macro-f1" else None
        text = f"{lead} {metrics[lead]:.4f}" + (f" (majority {base:.4f})" if base is not None else "") + " " + text
    return text


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


# What the server does in a round when the noise is added on the silos (DP-SGD): no server noise.
SILO_DP_ROUND_LABELS = {"powerdp": "refactor, DP-SGD on silos", "fedlora": "average, DP-SGD on silos",
                        "ffa": "average B, DP-SGD on silos", "fedsvd": "SVD refactor, DP-SGD on silos"}


def progress_line(row: dict, metrics: MetricRecord | None, num_rounds: int, epsilon_target, wall: float | None,
                  round_seconds: float | None = None, label: str | None = None, lead: str = "accuracy") -> str:
    """The console line of a round, from its (possibly redacted) results row: what the row does
    not carry (a private run's reply counts, see Disclosure) is not shown. ``lead``: task.metric."""
    acc = metric_text(metrics, lead) if metrics is not None else "acc -"
    if row.get("epsilon") is None:
        eps = "eps n/a (non-private)"
    else:
        eps = f"eps {row['epsilon']:.3f}" + (f"/{epsilon_target:g}" if epsilon_target else "")
    if "aggregated" in row:
        over = f" ({row['over_budget']} more at their budget)" if row.get("over_budget") else ""
        missing = f", {len(row['missing'])} no reply" if row.get("missing") else ""
        clients = (f"clients {row['sampled']} sampled{over}, {row['aggregated']} aggregated, {len(row['dropped'])} "
                   f"dropped{missing} | up {_mb(row['bytes_up'])} down {_mb(row['bytes_down'])} | server "
                   f"{row['aggregation_seconds']:.2f} s ")
    elif "sampled" in row:
        over = f" ({row['over_budget']} more at their budget)" if row.get("over_budget") else ""
        clients = f"clients {row['sampled']} sent{over}; replies withheld (dp.diagnostics = off) "
    else:
        clients = "clients withheld (dp.diagnostics = off) "
    if row.get("message_rounds", 1) > 1:
        clients += f"| {row['message_rounds']} message rounds (secure sums) "
    timing = ((f"| round {round_seconds:.1f} s " if round_seconds is not None else "") + f"| elapsed {wall:.1f} s"
              if wall is not None else "| times withheld (secret cohort)")
    return f"[round {row['server_round']}/{num_rounds} {label or row['round_type']}] {acc} | {eps} | {clients}" + timing


def check_released_rounds(rows: list[dict], round_type) -> None:
    """Refuse to resume when the checkpoint's rounds released other round types than this code
    would (a checkpoint of an older version whose release changed, e.g. the client-level paper's
    PowerDP before it released round deltas): the run would mix two mechanisms."""
    changed = [f"round {int(r['server_round'])}: {r['round_type']} -> {round_type(int(r['server_round']))}"
               for r in rows if "round_type" in r and r["round_type"] != round_type(int(r["server_round"]))]
    if changed:
        raise CK.CheckpointError("the checkpoint's rounds were released by another mechanism than this code uses ("
                                 + "; ".join(changed[:3]) + (" ..." if len(changed) > 3 else "")
                                 + "); refusing to resume: start the run over")


def resume_state(cfg: RunConfig, run_dir: Path, checkpoint: dict | None, strategy, privacy,
                 population_sizes: list[int], results: ResultsWriter, initial_state: dict) -> tuple[int, dict]:
    """Restore a checkpoint into the strategy and the privacy layer; account for a round that was
    in flight at the kill (docs/privacy.md §11). Returns (first round to run, global adapters)."""
    inflight = CK.read_inflight(run_dir) if cfg["resume"] else None
    done = int(checkpoint["round"]) if checkpoint else 0
    state = initial_state
    if checkpoint:
        if list(checkpoint["population_sizes"]) != population_sizes:
            raise CK.CheckpointError(f"the checkpoint's silos held {list(checkpoint['population_sizes'])} examples, "
                                     f"the connected ones hold {population_sizes}: another population; refusing to resume")
        check_released_rounds((checkpoint.get("results") or {}).get("rounds") or [], strategy.round_type)
        try:
            privacy.load_state_dict(checkpoint["privacy"])
        except ValueError as exc:
            raise CK.CheckpointError(f"the checkpoint's privacy ledgers do not fit this run: {exc}") from None
        state = {k: v.to(torch.float32) for k, v in checkpoint["global_state"].items()}
        if state.keys() != initial_state.keys() or any(state[k].shape != initial_state[k].shape for k in state):
            raise CK.CheckpointError("the checkpoint's adapters do not match this model (keys or shapes differ)")
        strategy.global_state = {k: v.clone() for k, v in state.items()}
        strategy.stopped_reason = checkpoint.get("stopped_reason")
    note = {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "after_round": done, "inflight_round": None}
    if inflight and inflight["round"] == done + 1:
        note["inflight_round"] = inflight["round"]
        if cfg["dp.noise"] == "hardened" and privacy.enabled:
            privacy.charge_lost_release(inflight["silos"])
            # which silos (the cohort) is a diagnostic at client level; the charge itself is covered
            silos = inflight["silos"] if cfg.diagnostics_released else "it was sent to"
            note["inflight_counted_as"] = (f"a lost release charged to the silos {silos} (hardened noise "
                                           "cannot be reproduced); the re-run is charged again")
        else:
            note["inflight_counted_as"] = ("re-run with the same seeded draws: the same release, counted once"
                                           if privacy.enabled else "non-private: nothing to count")
        log.warning("resume: round %d was in flight at the interruption: %s", inflight["round"], note["inflight_counted_as"])
    if cfg["resume"]:
        results.data.setdefault("resumed", []).append(note)
        results.flush()
        if checkpoint:
            log.info("resume: continuing after round %d of %d (eps so far %s)", done, cfg["num-server-rounds"],
                     "n/a" if privacy.epsilon() is None else f"{privacy.epsilon():.3f}")
    return done + 1, state


@app.main()
def main(grid: Grid, context: Context) -> None:
    setup_logging()
    run_server(grid, parse_config(context.run_config))


def run_server(grid: Grid, cfg: RunConfig) -> None:
    """The whole server side of a run (what ``main`` does after parsing the config)."""
    run_dir = run_directory(cfg)
    # A checkpoint is checked before anything is written: a refused one leaves the run untouched.
    checkpoint = open_checkpoint(cfg, run_dir)
    results = (ResultsWriter.restore(run_dir, checkpoint["results"], elapsed=float(checkpoint["elapsed"]))
               if checkpoint else ResultsWriter(run_dir, cfg.to_dict()))
    log.info("fedpower run %s -> %s%s", run_dir.name, results.path,
             f" (resuming after round {checkpoint['round']})" if checkpoint else "")
    try:
        refuse_unresolved(cfg)  # train.auto is a launcher's to resolve (fedpower_app/runs/auto.py)
        _run(grid, cfg, run_dir, results, checkpoint=checkpoint)
    except Exception as exc:
        results.finish("failed", error=f"{type(exc).__name__}: {exc}")
        raise


def open_checkpoint(cfg: RunConfig, run_dir: Path) -> dict | None:
    """With ``resume``: the run's last checkpoint (None if it has none). Raises CheckpointError for a
    damaged or mismatched one. Without ``resume`` an existing checkpoint is refused too: starting
    over in its directory would silently spend the budget again."""
    if not cfg["resume"]:
        if (run_dir / CK.CHECKPOINT_FILE).exists():
            raise CK.CheckpointError(f"{run_dir} holds a checkpoint of an earlier run; resume it (resume = true, "
                                     "or fedpower-run --resume) or choose another run-name / output-dir")
        return None
    payload = CK.load_checkpoint(run_dir, config=cfg.to_dict(), strategy=cfg["strategy.name"])
    if payload is None:
        log.info("resume: %s has no checkpoint; starting from round 1", run_dir)
    return payload


def engine_arguments(cfg: RunConfig, initial_state: dict, privacy, *, population: list[int], device,
                     disclosure: Disclosure | None = None) -> dict:
    """The round engine's arguments for a run's configuration: one place for the ServerApp's
    strategy and the Flower-free engine of the benchmarks (``engine_for``)."""
    return dict(
        initial_state=initial_state,
        rank=cfg["lora.rank"],
        client_rate=cfg["strategy.client-rate"],
        noise=NoiseSource(cfg["seed"], cfg["dp.noise"]),
        privacy=privacy,
        power_iters=cfg["strategy.power-iters"],
        device=device,
        eval_fraction=cfg["eval.fraction-clients"],
        population=population,  # in partition order: the order of the sampling coins
        refactor_every=cfg["strategy.refactor-every"],
        client_level=cfg["dp.level"] == "client",
        refactorization=cfg["strategy.client-refactorization"],
        # m = q_c N: the client-level averages divide by it (sample level: privacy.fixed_denominator)
        denominator=(getattr(privacy, "denominator", None) or privacy.plan.denominator)
        if cfg["dp.level"] == "client" else None,
        disclosure=disclosure,
        secure_aggregation=SecureAggregation.from_config(cfg),
    )


def engine_for(cfg: RunConfig, initial_state: dict, client_sizes: list[int]):
    """The Flower-free round engine of a run over silos 0..N-1 of ``client_sizes`` (benchmarks)."""
    modules, _extras = M.split_adapter_keys(initial_state)
    privacy = build_privacy(cfg, client_sizes=client_sizes, num_modules=len(modules),
                            adapter_shapes={k: tuple(v.shape) for k, v in initial_state.items()})
    disclosure = Disclosure(private=privacy.enabled, diagnostics_released=cfg["dp.diagnostics"] == "released",
                            noise_at=privacy.noise_at, client_level=cfg["dp.level"] == "client")
    return build_engine(cfg["strategy.name"], **engine_arguments(
        cfg, initial_state, privacy, population=list(range(len(client_sizes))),
        device=M.resolve_device(M.server_config(cfg)["device"]), disclosure=disclosure))


def _run(grid: Grid, cfg: RunConfig, run_dir: Path, results: ResultsWriter, checkpoint: dict | None = None) -> None:
    task = D.load_task(cfg)
    device = M.resolve_device(M.server_config(cfg)["device"])
    model = M.cached_model(M.server_config(cfg), task.num_labels)
    tokenizer = M.load_tokenizer(cfg["model.name"])
    splits = D.eval_splits(cfg, tokenizer)
    initial_state = M.initial_adapter_state(cfg, task.num_labels)
    modules, extras = M.split_adapter_keys(initial_state)
    log.info("task %s: %d train / %s eval examples; model %s, %d LoRA modules (rank %d)%s",
             task.name, len(task.train), ", ".join(f"{k} {len(v)}" for k, v in splits.items()),
             cfg["model.name"], len(modules), cfg["lora.rank"], f", trainable head ({len(extras)} tensors)" if extras else "")

    sizes, partitions = discover_clients(grid, cfg)
    client_level = cfg["dp.level"] == "client"
    if not client_level:  # client level: the silos do not send their sizes (its accounting needs none)
        # a silo of its own may withhold its size (0 here): it checks its own batch against its own rows
        known = [n for n in sizes.values() if n > 0]
        problem = D.shard_size_problem(sum(known), len(known), cfg["train.batch-size"], known) if known else None
        if problem:
            raise ValueError(problem)  # before any round: the run fails with this reason in results.json
    roster = Roster(grid, cfg, sizes, partitions)
    if client_level:
        results.set("clients", {"count": len(sizes), "dataset_sizes": ResultsWriter.WITHHELD})
        log.info("%d clients (shard sizes withheld: client-level DP does not use them)", len(sizes))
    else:
        results.set("clients", {"count": len(sizes), "dataset_sizes": sorted(sizes.values())})
        log.info("%d clients, shard sizes %s", len(sizes), describe_sizes(sizes.values()))

    privacy = build_privacy(cfg, client_sizes=sizes, num_modules=len(modules),
                            adapter_shapes={k: tuple(v.shape) for k, v in initial_state.items()})
    results.set("privacy", privacy.describe())
    for line in privacy.summary_lines():
        log.info("%s", line)
    claim = guarantee(cfg)
    results.set("guarantee", claim)
    if privacy.enabled:
        (log.info if claim["valid"] else log.warning)("privacy: %s", claim["statement"])
    secure = SecureAggregation.from_config(cfg)
    if secure is not None:
        described = secure.describe(len(sizes))
        results.set("secure_aggregation", described)
        log.info("secure aggregation: %s (%d-bit sums, error <= %.2g per coordinate at %d silos)",
                 described["statement"], secure.bits, described["error_bound_per_coordinate"], len(sizes))
    disclosure = Disclosure(private=privacy.enabled, diagnostics_released=cfg["dp.diagnostics"] == "released",
                            noise_at=privacy.noise_at, client_level=client_level)
    results.withheld = disclosure.withheld_totals()
    results.set("diagnostics", disclosure.label())
    if privacy.enabled:
        (log.warning if disclosure.full else log.info)("privacy: results.json and this log hold: %s", disclosure.label())

    strategy = build_strategy(cfg["strategy.name"], **engine_arguments(
        cfg, initial_state, privacy, population=list(sizes), device=device, disclosure=disclosure))
    evaluate_fn = CentralEvaluator(cfg, model, splits, device)
    t_start = time.time() - (float(checkpoint["elapsed"]) if checkpoint else 0.0)
    population_sizes = [int(sizes[node]) for node in sizes]
    first_round, arrays = resume_state(cfg, run_dir, checkpoint, strategy, privacy, population_sizes, results,
                                       initial_state)

    def save_checkpoint(done_round: int, pending_row: dict | None) -> None:
        CK.save_checkpoint(run_dir, {
            "round": done_round, "strategy": cfg["strategy.name"],
            "fingerprint": CK.config_fingerprint(cfg.to_dict()), "config_json": json.dumps(cfg.to_dict(), default=str),
            "global_state": {k: v.clone() for k, v in strategy.global_state.items()},
            "privacy": privacy.state_dict(), "population_sizes": population_sizes,
            "results": results.data, "elapsed": time.time() - t_start,
            "noise": {"mode": cfg["dp.noise"], "seed": cfg["seed"],
                      "position": "stateless: every generator is derived from (seed, stream, round)"},
            "stopped_reason": strategy.stopped_reason,
            # the round released and charged whose results row is not written yet (resume evaluates it)
            "pending_row": pending_row})

    def on_release(report: RoundReport) -> None:
        # The round's release is applied and charged: make it durable before anything derived from
        # it leaves (evaluate messages, central evaluation, results.json, the console). The pending
        # row holds what results.json may show of the round, nothing more (no cohort, no node ids).
        save_checkpoint(report.server_round, disclosure.round_row(report.to_dict()))

    full_rows: list[dict] = []  # this process' rounds, reply counts included (results.json may withhold them)

    def record_round(full_row: dict, metrics: MetricRecord | None) -> None:
        full_rows.append(full_row)
        row = disclosure.round_row(full_row)
        if metrics is not None:
            row.update({k: float(v) for k, v in metrics.items()})
        if disclosure.shows_timing:  # with a secret cohort, a round's time would tell its size
            row["wall_seconds"] = time.time() - t_start
        results.add_round(row)
        paper = getattr(privacy, "source", None) == "paper"
        target = cfg["dp.epsilon"] if privacy.enabled and not paper else None
        label = SILO_DP_ROUND_LABELS.get(row["round_type"]) if privacy.noise_at == "silo" else None
        if disclosure.shows_timing:
            previous = results.data["rounds"][-2].get("wall_seconds", 0.0) if len(results.data["rounds"]) > 1 else 0.0
            line = progress_line(row, metrics, cfg["num-server-rounds"], target, row["wall_seconds"],
                                 row["wall_seconds"] - previous, label, cfg["task.metric"])
        else:
            line = progress_line(row, metrics, cfg["num-server-rounds"], target, None, None, label, cfg["task.metric"])
        if paper:  # the paper's calibration: show the true epsilon, never the claimed one as a budget
            line = line.replace("| eps ", f"| TRUE eps (paper claims {cfg['dp.epsilon']:g}) ")
        log.info("%s", line)
        # After the round's results: the checkpoint that a restart continues from.
        save_checkpoint(int(full_row["server_round"]), None)

    def on_round(report: RoundReport, metrics: MetricRecord | None) -> None:
        record_round(report.to_dict(), metrics)

    def on_round_start(server_round: int, nodes: list[int]) -> None:
        order = {node: i for i, node in enumerate(strategy.population)}
        CK.write_inflight(run_dir, server_round, [order[n] for n in nodes if n in order])

    def before_round(server_round: int) -> None:
        events = roster.refresh(server_round, strategy, privacy)
        if events:
            results.data.setdefault("roster_events", []).extend(events)
            results.flush()

    if checkpoint and checkpoint.get("pending_row"):
        # Killed after the round's release was charged and before its results row: the release is
        # the checkpoint's global state; evaluate it (deterministic) and write the row.
        pending = checkpoint["pending_row"]
        log.info("resume: round %d was released and charged before the interruption; writing its results",
                 int(pending["server_round"]))
        record_round(pending, evaluate_fn(int(pending["server_round"]), ArrayRecord(arrays)))

    if first_round == 1:
        initial = evaluate_fn(0, ArrayRecord(initial_state))
        if initial is not None:
            results.set("initial_evaluation", {k: float(v) for k, v in initial.items()})
            log.info("[round 0] %s (initial model)", metric_text(initial, cfg["task.metric"]))

    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(arrays),
        num_rounds=cfg["num-server-rounds"],
        timeout=cfg["strategy.round-timeout"],
        evaluate_fn=lambda r, a: None if r == 0 else evaluate_fn(r, a),
        on_round=on_round,
        first_round=first_round,
        on_round_start=on_round_start,
        before_round=before_round,
        on_release=on_release,
    )

    final_state = result.arrays.to_torch_state_dict() if len(result.arrays) else arrays
    if not evaluate_fn.evaluated(final_state):  # e.g. the budget stopped the run before its last round
        final_metrics = evaluate_fn.evaluate_state(final_state)
        results.set("final_evaluation", {k: float(v) for k, v in final_metrics.items()})
    # What the user takes away is what was evaluated: the adapters, the seeded head, and the
    # evaluation's logits to check a reload against (see fedpower_app.released).
    M.load_adapter_state(model, final_state)
    adapter_dir = save_released(model, run_dir / "adapter", base_model=cfg["model.name"],
                                num_labels=task.num_labels, task=cfg["task.name"], seed=cfg["seed"],
                                max_length=cfg["task.max-length"], pooling=cfg["model.pooling"])
    torch.save(evaluate_fn.last_logits, run_dir / "final-eval-logits.pt")
    status = "stopped-budget" if strategy.stopped_reason else "completed"
    nothing_learned = no_round_aggregated(full_rows) if first_round == 1 else None
    if nothing_learned:
        status = "failed-no-replies"
        log.error("run %s FAILED: %s. The released model is the initial one.", run_dir.name, nothing_learned)
    # The journal names the last round's silos (a cohort): server state for a resume, not an output.
    (run_dir / CK.INFLIGHT_FILE).unlink(missing_ok=True)
    results.finish(status, stopped_reason=strategy.stopped_reason, adapter_dir=str(adapter_dir),
                   privacy_final=privacy.final_report())
    totals = results.data["totals"]
    acc, eps = totals.get("final_accuracy"), totals.get("final_epsilon")
    kind = "" if not privacy.enabled else (
        " [a guarantee: noise and coins from generators seeded with OS entropy that no output holds]" if claim["valid"] else
        " [reproducible mode: not a guarantee against whoever holds the seed]" if claim["mode"] == "reproducible"
        else " [not a valid guarantee: the paper's calibration]")

    log.info("run %s %s: final accuracy %s%s, %s%s; results %s; model %s", run_dir.name, status,
             "n/a" if acc is None else f"{acc:.4f}", final_baseline(results.data),
             "non-private" if eps is None else f"epsilon {eps:.3f} (delta {cfg['dp.delta']:g})", kind,
             results.path, adapter_dir)
