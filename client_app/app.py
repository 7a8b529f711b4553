"""fedpower ClientApp: local LoRA training on one silo's shard (Flower Message API).

* ``query``: reports the size of the local training shard when the silo's policy sends it (a
  simulated partition, or node config ``send-shard-size = true``): the server needs n_i to plan
  q_s = b / n_i; a deployed silo keeps it by default, computes q itself and keeps its own ledger.
* ``train``: loads the global adapters, runs L local steps and replies with the adapters it was
  told to train (``train-lora``: A and B, or only B for FFA-LoRA). When the message carries DP-SGD
  parameters (or the silo requires them) the steps are DP-SGD (``fedpower_app.training.dp_sgd``): the silo
  first checks the parameters against its one ledger (its ledger file across runs, DP-SGD rounds
  and secure sums' noise shares together) and refuses a round past its budget; the refusal is an
  error reply the server drops and counts. Otherwise plain Adam (Poisson batches when
  ``dp.level = sample``, for the paper's server-side mechanism). Under secure aggregation the
  adapters stay on the silo and only masked vectors leave (``train.secagg`` messages).
* ``evaluate``: evaluates the global adapters on this silo's share of the evaluation split, if its
  policy agrees (counted across runs).

The silo's policy (``fedpower_app.privacy.silo_policy``) comes from its node config alone: a
deployed SuperNode is sovereign, and starts only with a budget or a written opt-out. The base model
and the tokenised shard are cached per process (a Ray actor keeps them across rounds). Any
exception becomes an error reply, which the server drops and logs.
"""

from __future__ import annotations

import io
import json
import logging
import math
import time
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedpower_app import data as D
from fedpower_app.runs.atomic import write_atomic
from fedpower_app import model as M
from fedpower_app.config import RunConfig, parse_config
from fedpower_app.training.dp_sgd import DPSGDParams
from fedpower_app.training.silo_round import train_round
from fedpower_app.privacy.accounting.silo import SiloLedger, SiloRefusal, paid_params, silo_gate
from fedpower_app.privacy.silo_policy import SiloPolicy
from strategies.secure_sum.session import SumGuard
from fedpower_app.training import evaluate as evaluate_model

RUNTIME_RECORD = "runtime"  # reply record of where the ClientApp ran; not data, not a metric of it


def _ray_node_mod(msg: Message, context: Context, call_next) -> Message:
    """Under the Ray simulation engine, every reply carries the id of the Ray node its ClientApp ran
    on: ``reply.content["runtime"]["ray-node-id"]`` (a ConfigRecord: the id is a hex string, which a
    MetricRecord cannot hold). Absent outside Ray (deployment, the in-process grid)."""
    import sys

    reply = call_next(msg, context)
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized() and reply.has_content():
        reply.content[RUNTIME_RECORD] = ConfigRecord({"ray-node-id": ray.get_runtime_context().get_node_id()})
    return reply


app = ClientApp(mods=[_ray_node_mod])
log = logging.getLogger("fedpower")


@lru_cache(maxsize=4)
def _config(items: tuple) -> RunConfig:
    return parse_config(dict(items))


def silo_run_config(context: Context) -> RunConfig:
    """The run configuration as this silo applies it: the run config, with the SuperNode's own
    choice of device (node config ``device = "cuda:1"`` on a multi-GPU host) where it makes one."""
    items = dict(context.run_config)
    if str(context.node_config.get("device", "")).strip():
        items["device"] = str(context.node_config["device"]).strip()
    return _config(tuple(sorted(items.items())))


def _setup(context: Context):
    cfg = silo_run_config(context)
    local_dir = context.node_config.get("data-dir")
    if local_dir:
        # A real silo with its own files (--node-config 'data-dir="/data/sst2" silo-id=0'): the whole
        # local training split is this silo's shard (num = OWN_DATA); bad files fail with one line.
        cfg, task = D.silo.own_data(cfg, local_dir)
        pid, num = D.silo.silo_id(context.node_config), D.silo.OWN_DATA
        return cfg, pid, num, task, M.cached_model(cfg, task.num_labels), M.load_tokenizer(cfg["model.name"])
    try:
        pid = int(context.node_config["partition-id"])
        num = int(context.node_config["num-partitions"])
    except KeyError as exc:
        raise RuntimeError(
            "node config needs data-dir (a silo's own files: flower-supernode --node-config "
            "'data-dir=\"/data/silo\" silo-id=0 dp-max-epsilon=8 ledger-file=\"/data/silo/ledger.json\"')"
        ) from exc
    task = D.load_task(cfg)
    model = M.cached_model(cfg, task.num_labels)
    tokenizer = M.load_tokenizer(cfg["model.name"])
    return cfg, pid, num, task, model, tokenizer


@lru_cache(maxsize=8)
def _shard(cfg: RunConfig, pid: int, num: int):
    if num == D.silo.OWN_DATA:  # a silo's own data-dir: all of it
        return D.silo.silo_shard(cfg, M.load_tokenizer(cfg["model.name"]))
    return D.client_shard(cfg, M.load_tokenizer(cfg["model.name"]), pid, num)


_PREFIX_CACHES: dict[tuple, object] = {}


def _training_split(cfg: RunConfig, pid: int, num: int, model):
    """The silo's shard, or with ``train.cache-frozen`` its frozen-prefix cache (built on the first
    round this process trains the silo, then reused: the frozen layers never change during a run).
    A process that serves several silos (in-process grid, Ray actors) keeps each one's cache: all
    of them together hold each training row once."""
    shard = _shard(cfg, pid, num)
    if not cfg["train.cache-frozen"]:
        return shard
    key = (cfg, pid, num)
    if key not in _PREFIX_CACHES:
        from fedpower_app.training.frozen_prefix import build_prefix_cache

        for stale in [k for k in _PREFIX_CACHES if k[0] != cfg]:  # another run's caches
            del _PREFIX_CACHES[stale]
        _PREFIX_CACHES[key] = build_prefix_cache(model, shard, device=next(model.parameters()).device, log=log)
    return _PREFIX_CACHES[key]


@lru_cache(maxsize=8)
def _eval_shard(cfg: RunConfig, pid: int, num: int):
    if num == D.silo.OWN_DATA:  # a silo's own evaluation split, if it has one
        return D.silo.silo_eval_split(cfg, M.load_tokenizer(cfg["model.name"]))
    split = next(iter(D.eval_splits(cfg, M.load_tokenizer(cfg["model.name"])).values()))
    idx = torch.tensor(D.partition_indices(len(split), num, pid, cfg["seed"]), dtype=torch.long)
    return D.TokenizedSplit(split.input_ids[idx], split.attention_mask[idx], split.labels[idx],
                            None if split.token_type_ids is None else split.token_type_ids[idx])


def reply_state(model, train_lora: str) -> dict[str, torch.Tensor]:
    state = M.adapter_state(model)
    if "A" not in train_lora:  # A was frozen (FFA-LoRA): public, never sent back
        state = {k: v for k, v in state.items() if not k.endswith(M.LORA_A)}
    return state


DP_SGD_KEYS = ("dp-sgd.noise-multiplier", "dp-sgd.clip", "dp-sgd.batch-size", "dp-sgd.local-steps")
LEDGER_KEY = "dp-sgd-ledger"


def dp_sgd_params(config) -> DPSGDParams | None:
    """The DP-SGD parameters a train message carries, or None if it carries none."""
    if not any(key in config for key in DP_SGD_KEYS):
        return None
    try:
        return DPSGDParams(float(config["dp-sgd.noise-multiplier"]), float(config["dp-sgd.clip"]),
                           int(config["dp-sgd.batch-size"]), int(config["dp-sgd.local-steps"]),
                           head_clip=float(config.get("dp-sgd.head-clip", 0.0)),
                           head_noise_ratio=float(config.get("dp-sgd.head-noise-ratio", 0.0)))
    except (KeyError, TypeError, ValueError) as exc:
        raise SiloRefusal(f"refused: incomplete or malformed DP-SGD parameters ({exc})") from exc


def policy_of(context: Context, cfg: RunConfig) -> SiloPolicy:
    """This silo's privacy policy (``fedpower_app.privacy.silo_policy``), from its own node config."""
    return SiloPolicy.from_node_config(context.node_config, cfg)


def silo_policy(cfg: RunConfig, node_config) -> tuple[bool, float, float]:
    """(requires DP-SGD, budget epsilon, delta) of this silo (``SiloPolicy``).

    A silo sets its own budget with node config ``dp-max-epsilon`` (and optionally ``dp-delta``);
    it then refuses any round without DP-SGD parameters, whatever the run config says, and its δ
    is its own ``dp-delta`` or the fixed ``SILO_DEFAULT_DELTA`` (1e-5), never the run config's: a
    server that raised δ would buy itself rounds. Without a budget the silo follows the run config:
    DP-SGD required when dp.level = sample and dp.noise-at = silo, with the run's (dp.epsilon,
    dp.delta) as its budget."""
    policy = SiloPolicy.from_node_config(node_config, cfg)
    return policy.requires_dp, policy.max_epsilon, policy.delta


def _ledger_file(context: Context, cfg: RunConfig | None = None) -> Path | None:
    """Where this silo keeps its ledger across runs and server restarts (node config ``ledger-file``,
    by default in its data directory); None: in the run's state only (Context.state lives as long
    as one run)."""
    if cfg is None:
        cfg = silo_run_config(context)
    return policy_of(context, cfg).ledger_file


def _read_ledger_payload(context: Context, cfg: RunConfig | None = None) -> dict | None:
    """What this silo keeps about itself across runs: its ledger, the seeded releases it paid for and
    the evaluate requests it answered; from its ledger file, else from the run's state (None: nothing yet)."""
    path = _ledger_file(context, cfg)
    if path is not None and path.exists():
        try:
            saved = json.loads(path.read_text())
            SiloLedger.from_state_dict(saved["ledger"])
            return saved
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SiloRefusal(f"refused: this silo's ledger file {path} cannot be read ({exc})") from None
    record = context.state.config_records.get(LEDGER_KEY)
    return None if record is None else json.loads(str(record["state"]))


def _load_ledger(context: Context, delta: float, accountant: str, cfg: RunConfig | None = None) -> tuple[SiloLedger, list]:
    """The silo's one ledger (DP-SGD rounds and noise shares) and the (run, round) releases it already
    paid for (seeded runs). ``accountant`` is the silo's own (its policy), used for a new ledger."""
    saved = _read_ledger_payload(context, cfg)
    if saved is None:
        return SiloLedger(delta, accountant), []
    ledger, paid = SiloLedger.from_state_dict(saved["ledger"]), list(saved.get("paid", []))
    if ledger.delta != delta:
        raise SiloRefusal(f"refused: this silo's ledger is kept at delta {ledger.delta:g}, not {delta:g}")
    return ledger, paid


def _save_ledger(context: Context, ledger: SiloLedger, paid: list, cfg: RunConfig | None = None, *,
                 evaluate_answers: int | None = None) -> None:
    previous = _read_ledger_payload(context, cfg) or {}
    answers = int(previous.get("evaluate-answers", 0)) if evaluate_answers is None else int(evaluate_answers)
    state = json.dumps({"ledger": ledger.state_dict(), "paid": paid, "evaluate-answers": answers})
    context.state[LEDGER_KEY] = ConfigRecord({"state": state})
    path = _ledger_file(context, cfg)
    if path is not None:
        try:
            write_atomic(path, state)
        except OSError as exc:
            raise SiloRefusal(f"refused: this silo cannot write its ledger file {path} ({exc}); set node config "
                              "ledger-file to a writable path") from None


OPTIMIZER_KEY = "optimizer-state"


def _optimizer_carry(context: Context, cfg: RunConfig) -> dict | None:
    """``train.optimizer-state = "run"``: the silo's optimizer state from its previous round (empty
    before its first), kept in its Context.state; None: a fresh optimizer every round."""
    if cfg["train.optimizer-state"] != "run":
        return None
    record = context.state.config_records.get(OPTIMIZER_KEY)
    if record is None:
        return {}
    # Saved where the silo trained; loaded onto the device it trains on now (a silo may move).
    return torch.load(io.BytesIO(record["state"]), weights_only=True, map_location=M.resolve_device(cfg["device"]))


def _keep_optimizer_carry(context: Context, carry: dict | None) -> None:
    if carry:
        buf = io.BytesIO()
        torch.save(carry, buf)
        context.state[OPTIMIZER_KEY] = ConfigRecord({"state": buf.getvalue()})


def _release_key(cfg: RunConfig, server_round: int) -> str | None:
    """A seeded round's identity: the same run configuration and round give the same draws (a
    resumed run re-running a round the silo already paid for). Hardened: None. The release is the
    same only on the same inputs too (``_release_inputs``), which the gate checks beside the key."""
    if cfg["dp.noise"] != "seeded":
        return None
    from fedpower_app.runs.checkpoint import config_fingerprint

    return f"{config_fingerprint(cfg.to_dict())[:32]}:{server_round}"


def _release_inputs(state: dict[str, torch.Tensor], context: Context) -> str:
    """A digest of everything else a seeded release is a function of: the arrays the silo received
    and the optimizer state it starts from (``train.optimizer-state = "run"``)."""
    import hashlib

    h = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().to("cpu").contiguous()
        h.update(name.encode())
        h.update(str(tuple(tensor.shape)).encode())
        h.update(tensor.numpy().tobytes())
    record = context.state.config_records.get(OPTIMIZER_KEY)
    h.update(b"optimizer:" + (bytes(record["state"]) if record is not None else b""))
    return h.hexdigest()[:32]


def _sends_train_metrics(context: Context, cfg: RunConfig) -> bool:
    """Train loss, examples seen, training time: statistics of the silo's private data that no
    noise covers. The silo's policy decides: its node config ``send-metrics``; without it a silo of
    its own (data-dir or budget) sends none, and a simulated partition sends them when the run is
    non-private or releases its diagnostics (``dp.diagnostics = "released"``)."""
    return policy_of(context, cfg).sends_metrics


_ANNOUNCED: set = set()


def _announce_policy(context: Context, cfg: RunConfig) -> None:
    """Log this silo's policy once per run, at its first message; warn when a budget it enforces
    lives in the run's state only without the operator having chosen it."""
    if context.run_id in _ANNOUNCED:
        return
    _ANNOUNCED.add(context.run_id)
    policy = policy_of(context, cfg)
    log.info("%s", policy.describe())
    _warn_if_ledger_is_per_run(context, cfg)


_WARNED_NO_LEDGER_FILE: set = set()


def _warn_if_ledger_is_per_run(context: Context, cfg: RunConfig) -> None:
    """A silo that keeps its ledger in Context.state only starts every new run from zero: say so,
    once per run, at its first message (unless its operator chose it: ledger-file = "memory")."""
    policy = policy_of(context, cfg)
    if (not policy.requires_dp or policy.ledger_file is not None or policy.ledger_in_memory_chosen
            or context.run_id in _WARNED_NO_LEDGER_FILE):
        return
    _WARNED_NO_LEDGER_FILE.add(context.run_id)
    log.warning("silo: no node config ledger-file: this silo's DP ledger lives in this run's state only, so a new "
                "run starts its budget from zero. Keep it across runs with --node-config "
                "'ledger-file=\"/path/on/the/silo/ledger.json\" dp-max-epsilon=8' (or ledger-file=\"memory\" to "
                "choose this; docs/deployment.md)")


@app.query()
def query(msg: Message, context: Context) -> Message:
    cfg, pid, num, _task, _model, _tok = _setup(context)
    _announce_policy(context, cfg)
    metrics = {"partition-id": pid}
    # Client-level accounting needs no shard size, and a sovereign silo keeps it unless its node config
    # says send-shard-size = true: it computes its own q and keeps its own ledger.
    if cfg["dp.level"] != "client" and policy_of(context, cfg).sends_shard_size:
        metrics["num-examples"] = _shard(cfg, pid, num).dp_size  # the size it samples and accounts with
    return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    cfg, pid, num, _task, model, _tok = _setup(context)
    shard = _shard(cfg, pid, num)
    config = msg.content["config"]
    server_round = int(config["server-round"])
    train_lora = str(config.get("train-lora", "AB"))
    if train_lora not in ("AB", "B"):
        raise ValueError(f"train-lora must be 'AB' or 'B', got {train_lora!r}")
    params = dp_sgd_params(config)
    policy = policy_of(context, cfg)
    _announce_policy(context, cfg)
    ledger = None
    received = msg.content["arrays"].to_torch_state_dict()
    # Distributed DP: this silo's privacy comes from the noise share it adds to every secure sum,
    # checked against its own ledger when it computes each masked input (_secure_sum_reply).
    distributed = params is None and _requests_noise(config)
    if (params is not None or policy.requires_dp) and not distributed:
        # The silo's own check, before its data is touched: it trusts only its own policy and ledger.
        ledger, paid = _load_ledger(context, policy.delta, policy.accountant, cfg)
        key = _release_key(cfg, server_round)
        inputs = _release_inputs(received, context) if key is not None else None
        sample_rate, charge = silo_gate(ledger, paid, key, params, shard.dp_size, max_epsilon=policy.max_epsilon,
                                        inputs=inputs)
        policy.check_noise_mode(cfg)
    M.load_adapter_state(model, received)
    M.set_trainable(model, train_a="A" in train_lora, train_b=True)  # before the frozen-prefix cache
    data = _training_split(cfg, pid, num, model)
    carry = _optimizer_carry(context, cfg)
    t0 = time.perf_counter()
    stats = train_round(cfg, model, data, partition_id=pid, server_round=server_round, train_lora=train_lora,
                        params=params if ledger is not None else None, optimizer_carry=carry)
    if ledger is not None:
        if charge:  # a seeded round re-run with the same parameters is the same release: paid once
            ledger.record(sample_rate, params.noise_multiplier, params.local_steps)
            if key is not None:
                paid.append({"key": key, "params": paid_params(params, sample_rate), "inputs": inputs})
        _save_ledger(context, ledger, paid, cfg)
    _keep_optimizer_carry(context, carry)
    if "secagg.request" in config:
        # Secure aggregation: the adapters stay here; the reply is the first secure sum's keys. The sums
        # of this round are the only ones this trained state may enter (session.SumGuard).
        content = begin_secure_round(context, server_round, reply_state(model, train_lora), received,
                                     dp_sgd=ledger is not None, json_request=str(config["secagg.request"]))
    else:
        content = RecordDict({"arrays": ArrayRecord(reply_state(model, train_lora))})
    if policy.sends_metrics:
        metrics = {
            "num-examples": len(shard),
            "train-loss": float(stats.loss) if stats.loss == stats.loss else -1.0,
            "examples-seen": stats.examples_seen,
            "train-seconds": time.perf_counter() - t0,
        }
        if ledger is not None:
            metrics["silo-epsilon"] = ledger.epsilon()
        content["metrics"] = MetricRecord(metrics)
    return Message(content, reply_to=msg)


SECURE_TRAINED_KEY, SECURE_STATE_KEY = "secagg-trained", "secagg-state"
SECURE_GLOBAL_KEY, SECURE_PRIVATE_KEY, SECURE_GUARD_KEY = "secagg-global", "secagg-private", "secagg-guard"


def begin_secure_round(context: Context, server_round: int, trained: dict, received: dict, *, dp_sgd: bool,
                       json_request: str) -> RecordDict:
    """After training for ``server_round`` under secure aggregation: keep the trained adapters (they
    never leave in the clear), the global state its round delta is against, whether DP-SGD trained
    them, and a fresh ``SumGuard`` (only this round's sums may use this state); answer the first
    sum's stage 1."""
    guard = SumGuard()
    guard.start_round(server_round)
    context.state[SECURE_GUARD_KEY] = ConfigRecord({"state": guard.to_json()})
    context.state[SECURE_TRAINED_KEY] = ArrayRecord(trained)
    context.state[SECURE_GLOBAL_KEY] = ArrayRecord(received)  # a silo's round delta is against it
    context.state[SECURE_PRIVATE_KEY] = ConfigRecord({"dp-sgd": bool(dp_sgd)})
    return _secure_sum_reply(json_request=json_request, context=context)


def _requests_noise(config) -> bool:
    """Does a train message ask for a secure sum with noise shares (distributed DP)?"""
    if "secagg.request" not in config:
        return False
    from strategies.secure_sum.session import decode

    try:
        return decode(str(config["secagg.request"]), {})["config"].get("noise") is not None
    except Exception:  # a malformed request fails at the secure-sum stage with its reason
        return False


def _charge_noise_share(context: Context, request: dict) -> None:
    """Before a masked input with a noise share leaves: this silo's own check of the release against
    its budget, in its one ledger (with its DP-SGD rounds, across runs), at the k it accounts at
    (``SiloPolicy.noise_share_contributors``: what the sum can prove, never more). Refuses past its
    budget."""
    from strategies.secure_sum.session import SecureSumConfig

    cfg = silo_run_config(context)
    policy = policy_of(context, cfg)
    config = request["config"]
    try:
        noise = config["noise"]
        threshold = SecureSumConfig.from_dict(config).threshold
        k = policy.noise_share_contributors(threshold, int(noise["contributors"]), int(cfg["secagg.colluders"]))
        share = (float(noise["clip"]), float(noise["scale"]), float(noise["local-std"]), int(config["size"]), k)
        if not (math.isfinite(share[2]) and share[2] >= 0.5):
            raise ValueError("the noise share's std must be >= 1/2 integer unit")
    except (KeyError, TypeError, ValueError) as exc:
        raise SiloRefusal(f"refused: malformed noise parameters ({exc})") from None
    ledger, paid = _load_ledger(context, policy.delta, policy.accountant, cfg)
    eps = ledger.epsilon_if_share(share)
    if eps > policy.max_epsilon * (1 + 1e-9):
        raise SiloRefusal(f"refused: this noise share, accounted at k = {k} unknown shares, would take this silo to "
                          f"eps {eps:.3f} > its budget {policy.max_epsilon:g} (spent {ledger.epsilon():.3f})"
                          + ("; an unsigned sum proves no other silo's share: sign with node config silo-signing-key "
                             "and secagg-peers" if policy.sovereign and not policy.signs else ""))
    ledger.record_share(share)
    _save_ledger(context, ledger, paid, cfg)


def _secure_identity(policy: SiloPolicy):
    """(identity, trusted silos) of a silo that signs its secure sums, else (None, None)."""
    if not policy.signs:
        return None, None
    from strategies.secure_sum.identity import IdentityError, SiloIdentity, TrustedSilos

    try:
        return SiloIdentity.from_file(policy.signing_key), TrustedSilos.from_file(policy.peers_file)
    except IdentityError as exc:
        raise SiloRefusal(f"refused: {exc}") from None


def _secure_sum_reply(context: Context, *, json_request: str | None = None, request=None) -> RecordDict:
    """Answer one stage of a secure sum (``strategies.secure_sum.session.client_step``), keeping this
    silo's secrets between stages in its Context.state. The vector it contributes is computed here,
    from the adapters it trained this round, and the server's basis is checked first."""
    from strategies.secure_rounds import pack
    from strategies.secure_sum import contributions as SC
    from strategies.secure_sum.session import client_step, decode

    if request is None:
        request = decode(json_request, {})
    record = context.state.config_records.get(SECURE_STATE_KEY)
    saved = str(record["state"]) if record is not None and request.get("stage") != "advertise_keys" else None

    def input_fn(req):
        trained = context.state.array_records.get(SECURE_TRAINED_KEY)
        if trained is None:
            raise ValueError("a secure sum asks for a vector, but this silo trained nothing this run")
        noise = req["config"].get("noise")
        if noise is None:
            # without noise shares, only adapters trained with DP-SGD may enter a sum of a silo that requires DP
            private = context.state.config_records.get(SECURE_PRIVATE_KEY)
            if policy.requires_dp and not (private and bool(private["dp-sgd"])):
                raise SiloRefusal("refused: a secure sum without noise of adapters not trained with DP-SGD")
        glob_record = context.state.array_records.get(SECURE_GLOBAL_KEY)
        vector = SC.silo_vector(req, trained.to_torch_state_dict(),
                                glob_record.to_torch_state_dict() if glob_record is not None else None)
        if noise is not None:
            _charge_noise_share(context, req)  # the last check before the share leaves
        return vector

    cfg = silo_run_config(context)
    policy = policy_of(context, cfg)
    identity, trusted = _secure_identity(policy)
    guard_record = context.state.config_records.get(SECURE_GUARD_KEY)
    guard = SumGuard.from_json(str(guard_record["state"]) if guard_record is not None else None)
    reply, saved = client_step(int(context.node_id), request, saved, input_fn, identity=identity, trusted=trusted,
                               guard=guard, colluders=policy.assumed_colluders(cfg["secagg.colluders"]))
    context.state[SECURE_STATE_KEY] = ConfigRecord({"state": saved})
    context.state[SECURE_GUARD_KEY] = ConfigRecord({"state": guard.to_json()})
    return pack(reply)


@app.train("secagg")
def secure_sum_stage(msg: Message, context: Context) -> Message:
    """One stage of a secure sum the server runs after a train round (``strategies/secure_rounds.py``)."""
    from strategies.secure_rounds import unpack

    return Message(_secure_sum_reply(context, request=unpack(msg.content)), reply_to=msg)




@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    # Exact loss and accuracy, on this silo's evaluation rows, of arrays the server chose: no noise
    # covers them. The silo's policy decides whether it answers, and how often (docs/privacy.md).
    cfg, pid, num, _task, model, _tok = _setup(context)
    policy = policy_of(context, cfg)
    _announce_policy(context, cfg)
    # Answers are counted across runs in the silo's ledger file (the run's state when it keeps none).
    saved = _read_ledger_payload(context, cfg)
    answered = int(saved.get("evaluate-answers", 0)) if saved is not None else 0
    policy.check_evaluate(answered)
    M.load_adapter_state(model, msg.content["arrays"].to_torch_state_dict())
    device = next(model.parameters()).device
    res = evaluate_model(model, _eval_shard(cfg, pid, num), batch_size=cfg["eval.batch-size"], device=device,
                         precision=cfg["train.precision"])
    if saved is not None:
        ledger, paid = SiloLedger.from_state_dict(saved["ledger"]), list(saved.get("paid", []))
    else:
        ledger, paid = SiloLedger(policy.delta, policy.accountant), []
    _save_ledger(context, ledger, paid, cfg, evaluate_answers=answered + 1)
    # accuracy, loss and the count only: the majority baseline would tell the silo's label mix
    return Message(RecordDict({"metrics": MetricRecord({k: res[k] for k in ("accuracy", "loss", "num-examples")})}),
                   reply_to=msg)
