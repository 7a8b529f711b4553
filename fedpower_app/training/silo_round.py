"""One silo's local training for one round, with no Flower in it.

The ClientApp (``client_app/app.py``) wraps this with what only a silo deployment has: the check
of the DP parameters against its own ledger before the data is touched, the ledger's record
afterwards, and the reply message. The in-process benchmarks (``benchmarks/e2e.py``) call it
directly, so they train exactly as a silo does (DP-SGD when the round's config carries DP-SGD
parameters, plain Adam otherwise).
"""

from __future__ import annotations

from strategies.mechanisms import dp_sgd_phase_clips
from strategies.noise import NoiseSource

from .. import model as M
from .dp_sgd import DPSGDParams, dp_sgd_train_local
from .features import class_weights, dp_sgd_head, features_of, head_tensors, train_head
from .loops import TrainStats, round_lr, silo_randomness, train_local


def train_round(cfg, model, data, *, partition_id: int, server_round: int, train_lora: str,
                params: DPSGDParams | None, optimizer_carry: dict | None = None, canaries=None) -> TrainStats:
    """Train ``model`` (its adapters already set to the round's global state) on ``data`` for one
    round: DP-SGD with ``params`` when given, else ``train.local-steps`` plain steps. The silo's
    sampling, dropout and DP-noise streams come from the run's noise source for (silo, round).
    ``canaries``: the federated white-box audit's gradient canaries of this silo (never in a run)."""
    if train_lora not in ("AB", "B"):
        raise ValueError(f"train-lora must be 'AB' or 'B', got {train_lora!r}")
    params = phase_params(cfg, params, server_round)
    if head_phase(cfg, server_round):
        if canaries is not None:
            raise ValueError("the white-box audit's gradient canaries are planted in adapter rounds, not head-only ones")
        return _train_head_round(cfg, model, data, partition_id=partition_id, server_round=server_round,
                                 params=params, optimizer_carry=optimizer_carry)
    # head-then-adapters: the adapters learn under the head the probe trained (frozen)
    M.set_trainable(model, train_a="A" in train_lora, train_b=True,
                    train_head=False if cfg["train.what"] == "head-then-adapters" else None)
    noise = NoiseSource(cfg["seed"], cfg["dp.noise"])
    device = next(model.parameters()).device
    streams = silo_randomness(noise, partition_id, server_round, device)
    lr = _adapter_phase_lr(cfg, server_round)
    if params is not None:
        return dp_sgd_train_local(model, data, params=params, lr=lr,
                                  sampling_generator=streams.sampling, noise_generator=streams.dp_noise,
                                  secure_noise=noise.hardened, device=device, dropout_seed=streams.dropout_seed,
                                  optimizer=cfg["train.optimizer"], optimizer_carry=optimizer_carry,
                                  adam_eps=cfg["train.adam-eps"], head_lr_scale=cfg["train.head-lr-scale"],
                                  label_smoothing=cfg["train.label-smoothing"], canaries=canaries,
                                  precision=cfg["train.precision"],
                                  physical_batch_size=cfg["train.physical-batch-size"] or None)
    return train_local(model, data, steps=cfg["train.local-steps"], batch_size=cfg["train.batch-size"], lr=lr,
                       generator=streams.sampling, poisson=(cfg["dp.level"] == "sample"), device=device,
                       dropout_seed=streams.dropout_seed, optimizer=cfg["train.optimizer"],
                       optimizer_carry=optimizer_carry, adam_eps=cfg["train.adam-eps"],
                       head_lr_scale=cfg["train.head-lr-scale"], label_smoothing=cfg["train.label-smoothing"],
                       precision=cfg["train.precision"], physical_batch_size=cfg["train.physical-batch-size"] or None)


def head_phase(cfg, server_round: int) -> bool:
    """Does round ``server_round`` train the head alone on the frozen features? Every round of
    ``train.what = "head"``; the first ``train.head-rounds`` of ``"head-then-adapters"``."""
    what = cfg["train.what"]
    return what == "head" or (what == "head-then-adapters" and server_round <= cfg["train.head-rounds"])


def phase_params(cfg, params: DPSGDParams | None, server_round: int) -> DPSGDParams | None:
    """The DP-SGD parameters a round applies, from those its message carries (and its ledger
    charges: σ, b, L): in a head-only round, the head's clip (``dp.head-clip`` when set, else
    ``dp.clip``); in an adapter round of head-then-adapters, the adapters' clip alone (the head
    stays as the head's rounds left it). Each round clips every example to its own C and adds
    N(0, (σC)²): one Gaussian mechanism of multiplier σ whatever C is, so the ledger's charge is
    the same (docs/privacy.md, "The head on frozen features"). Adapter rounds of ``adapters`` runs
    apply ``params`` as sent."""
    clips = {} if params is None else dp_sgd_phase_clips(cfg["train.what"], params.clip, params.head_clip)
    if not clips:
        return params
    clip = clips["head rounds" if head_phase(cfg, server_round) else "adapter rounds"]
    return DPSGDParams(params.noise_multiplier, clip, params.batch_size, params.local_steps)


def _adapter_phase_lr(cfg, server_round: int) -> float:
    """The adapters' rate: ``train.lr`` on its schedule over the run, or over the adapter phase
    of head-then-adapters (the schedule restarts where the head's rounds end)."""
    if cfg["train.what"] == "head-then-adapters":
        skip = cfg["train.head-rounds"]
        return round_lr(cfg["train.lr"], cfg["train.lr-schedule"], server_round - skip,
                        cfg["num-server-rounds"] - skip)
    return round_lr(cfg["train.lr"], cfg["train.lr-schedule"], server_round, cfg["num-server-rounds"])


def head_phase_lr(cfg, server_round: int) -> float:
    """The head's rate in a head-only round: ``train.lr`` on its schedule over the head's rounds
    (``train.head-lr-scale`` times it in head-then-adapters, whose ``train.lr`` is the adapters')."""
    if cfg["train.what"] == "head-then-adapters":
        return round_lr(cfg["train.lr"] * cfg["train.head-lr-scale"], cfg["train.lr-schedule"], server_round,
                        cfg["train.head-rounds"])
    return round_lr(cfg["train.lr"], cfg["train.lr-schedule"], server_round, cfg["num-server-rounds"])


def _train_head_round(cfg, model, data, *, partition_id: int, server_round: int, params: DPSGDParams | None,
                      optimizer_carry: dict | None) -> TrainStats:
    """A head-only round: the silo's features (computed on its first round, then cached), then
    DP-SGD on the head with the round's parameters (or plain steps without them)."""
    noise = NoiseSource(cfg["seed"], cfg["dp.noise"])
    device = next(model.parameters()).device
    streams = silo_randomness(noise, partition_id, server_round, device)
    feats = features_of(model, data, device=device)
    weights = class_weights(cfg, model_num_labels(model))
    lr = head_phase_lr(cfg, server_round)
    if params is not None:
        return dp_sgd_head(model, feats, params=params, lr=lr, sampling_generator=streams.sampling,
                           noise_generator=streams.dp_noise, secure_noise=noise.hardened,
                           optimizer=cfg["train.optimizer"], optimizer_carry=optimizer_carry,
                           adam_eps=cfg["train.adam-eps"], class_weight=weights)
    return train_head(model, feats, steps=cfg["train.local-steps"], batch_size=cfg["train.batch-size"], lr=lr,
                      generator=streams.sampling, poisson=(cfg["dp.level"] == "sample"),
                      optimizer=cfg["train.optimizer"], optimizer_carry=optimizer_carry,
                      adam_eps=cfg["train.adam-eps"], class_weight=weights)


def model_num_labels(model) -> int:
    return int(head_tensors(model)[0].shape[0])
