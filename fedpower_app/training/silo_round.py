"""One silo's local training for one round, with no Flower in it.

The ClientApp (``client_app/app.py``) wraps this with what only a silo deployment has: the check
of the DP parameters against its own ledger before the data is touched, the ledger's record
afterwards, and the reply message. The in-process benchmarks (``benchmarks/e2e.py``) call it
directly, so they train exactly as a silo does (DP-SGD when the round's config carries DP-SGD
parameters, plain Adam otherwise).
"""

from __future__ import annotations

from strategies.noise import NoiseSource

from .. import model as M
from .dp_sgd import DPSGDParams, dp_sgd_train_local
from .loops import TrainStats, round_lr, silo_randomness, train_local


def train_round(cfg, model, data, *, partition_id: int, server_round: int, train_lora: str,
                params: DPSGDParams | None, optimizer_carry: dict | None = None, canaries=None) -> TrainStats:
    """Train ``model`` (its adapters already set to the round's global state) on ``data`` for one
    round: DP-SGD with ``params`` when given, else ``train.local-steps`` plain steps. The silo's
    sampling, dropout and DP-noise streams come from the run's noise source for (silo, round).
    ``canaries``: the federated white-box audit's gradient canaries of this silo (never in a run)."""
    if train_lora not in ("AB", "B"):
        raise ValueError(f"train-lora must be 'AB' or 'B', got {train_lora!r}")
    M.set_trainable(model, train_a="A" in train_lora, train_b=True)
    noise = NoiseSource(cfg["seed"], cfg["dp.noise"])
    device = next(model.parameters()).device
    streams = silo_randomness(noise, partition_id, server_round, device)
    lr = round_lr(cfg["train.lr"], cfg["train.lr-schedule"], server_round, cfg["num-server-rounds"])
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
