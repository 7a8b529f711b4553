"""fedpower ClientApp: local LoRA training on one silo's shard (Flower Message API).

* ``query``: reports the size of the local training shard (the server needs n_i to compute the
  sample-level rate q_s = b / n_i; this reveals n_i to the server, see docs/privacy.md).
* ``train``: loads the global adapters, runs L local steps of Adam and replies with the adapters
  (FFA-LoRA: only B). With ``dp.level = sample`` batches are Poisson sampled.
* ``evaluate``: evaluates the global adapters on this silo's share of the evaluation split.

The base model and the tokenised shard are cached per process (a Ray actor keeps them across
rounds). Any exception becomes an error reply, which the server drops and logs.
"""

from __future__ import annotations

import time
from functools import lru_cache

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedpower_app import data as D
from fedpower_app import model as M
from fedpower_app.config import RunConfig, parse_config
from fedpower_app.training import evaluate as evaluate_model
from fedpower_app.training import silo_randomness, train_local
from strategies.noise import NoiseSource

app = ClientApp()


@lru_cache(maxsize=4)
def _config(items: tuple) -> RunConfig:
    return parse_config(dict(items))


def _setup(context: Context):
    cfg = _config(tuple(sorted(context.run_config.items())))
    local_dir = context.node_config.get("data-dir")
    if local_dir:
        # A real silo with its own files (--node-config 'data-dir="/data/sst2"'): the whole local
        # training split is this silo's shard.
        cfg = _config(tuple(sorted({**cfg.values, "task.data-dir": str(local_dir)}.items())))
        pid, num = 0, 1
        task = D.load_task(cfg)
        return cfg, pid, num, task, M.cached_model(cfg, task.num_labels), M.load_tokenizer(cfg["model.name"])
    try:
        pid = int(context.node_config["partition-id"])
        num = int(context.node_config["num-partitions"])
    except KeyError as exc:
        raise RuntimeError(
            "node config needs partition-id and num-partitions, or data-dir "
            "(flower-supernode --node-config 'partition-id=0 num-partitions=6')"
        ) from exc
    task = D.load_task(cfg)
    model = M.cached_model(cfg, task.num_labels)
    tokenizer = M.load_tokenizer(cfg["model.name"])
    return cfg, pid, num, task, model, tokenizer


@lru_cache(maxsize=8)
def _shard(cfg: RunConfig, pid: int, num: int):
    return D.client_shard(cfg, M.load_tokenizer(cfg["model.name"]), pid, num)


@lru_cache(maxsize=8)
def _eval_shard(cfg: RunConfig, pid: int, num: int):
    split = next(iter(D.eval_splits(cfg, M.load_tokenizer(cfg["model.name"])).values()))
    idx = torch.tensor(D.partition_indices(len(split), num, pid, cfg["seed"]), dtype=torch.long)
    return D.TokenizedSplit(split.input_ids[idx], split.attention_mask[idx], split.labels[idx],
                            None if split.token_type_ids is None else split.token_type_ids[idx])


def _reply_state(cfg: RunConfig, model, method: str) -> dict[str, torch.Tensor]:
    state = M.adapter_state(model)
    if method == "ffa-lora":  # A is frozen and public: never sent back
        state = {k: v for k, v in state.items() if not k.endswith(M.LORA_A)}
    return state


@app.query()
def query(msg: Message, context: Context) -> Message:
    cfg, pid, num, _task, _model, _tok = _setup(context)
    n = len(_shard(cfg, pid, num))
    return Message(RecordDict({"metrics": MetricRecord({"num-examples": n, "partition-id": pid})}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    cfg, pid, num, _task, model, _tok = _setup(context)
    shard = _shard(cfg, pid, num)
    server_round = int(msg.content["config"]["server-round"])
    M.load_adapter_state(model, msg.content["arrays"].to_torch_state_dict())
    method = cfg["strategy.name"]
    M.set_trainable(model, train_a=(method != "ffa-lora"), train_b=True)
    gen, dropout_seed = silo_randomness(NoiseSource(cfg["seed"], cfg["dp.noise"]), pid, server_round)
    device = next(model.parameters()).device
    t0 = time.perf_counter()
    stats = train_local(
        model, shard, steps=cfg["train.local-steps"], batch_size=cfg["train.batch-size"], lr=cfg["train.lr"],
        generator=gen, poisson=(cfg["dp.level"] == "sample"), device=device,
        dropout_seed=dropout_seed,
    )
    metrics = MetricRecord({
        "num-examples": len(shard),
        "train-loss": float(stats.loss) if stats.loss == stats.loss else -1.0,
        "examples-seen": stats.examples_seen,
        "train-seconds": time.perf_counter() - t0,
    })
    arrays = ArrayRecord(_reply_state(cfg, model, method))
    return Message(RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    cfg, pid, num, _task, model, _tok = _setup(context)
    M.load_adapter_state(model, msg.content["arrays"].to_torch_state_dict())
    device = next(model.parameters()).device
    res = evaluate_model(model, _eval_shard(cfg, pid, num), batch_size=cfg["eval.batch-size"], device=device)
    return Message(RecordDict({"metrics": MetricRecord(res)}), reply_to=msg)
