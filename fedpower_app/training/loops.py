"""Local training and evaluation loops (plain torch, shared by clients, server and benchmarks).

Batch sampling must match the accountant (privacy-accounting spec §2.6):

* ``poisson=True`` (whenever ``dp.level = sample``): every step includes each example
  independently with probability q_s = b / n (Poisson sampling, as opacus'
  ``UniformWithReplacementSampler``). Batch sizes vary; an empty batch is a step with no update.
* otherwise: fixed-size batches drawn without replacement from a shuffled order.

The coins come from a ``torch.Generator`` supplied by the caller (the run's noise source).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from strategies.privacy_contract import sample_rate

from ..choices import PRECISIONS
from ..data import TokenizedSplit

log = logging.getLogger(__name__)


@dataclass
class TrainStats:
    loss: float  # mean loss over non-empty steps
    steps: int
    examples_seen: int
    empty_steps: int


def batch_indices(n: int, batch_size: int, steps: int, generator: torch.Generator, poisson: bool,
                  rate_size: int | None = None) -> list[torch.Tensor]:
    """Indices of each local step's batch. Poisson: every example independently at q = b / N, with
    N = ``rate_size`` when the silo's size is declared in advance (>= n), else n."""
    if n <= 0:
        raise ValueError("cannot train on an empty shard")
    if poisson:
        q = sample_rate(batch_size, max(n, rate_size or 0))
        return [torch.nonzero(torch.rand(n, generator=generator, dtype=torch.float64) < q).flatten() for _ in range(steps)]
    out, order, pos = [], torch.randperm(n, generator=generator), 0
    for _ in range(steps):
        if pos + batch_size > n:
            order, pos = torch.randperm(n, generator=generator), 0
        out.append(order[pos : pos + batch_size])
        pos += batch_size
    return out


def uses_bf16(device: torch.device, precision: str = "auto") -> bool:
    """Whether a forward on ``device`` runs under bf16 autocast for ``train.precision``: "bf16"
    always; "auto" only on a GPU that computes bf16 natively (compute capability 8.0 and up: A100,
    H100, H200), never where it would be emulated; "fp32" never."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "bf16":
        return True
    return precision == "auto" and device.type == "cuda" and cuda_has_native_bf16(device)


@functools.lru_cache(maxsize=None)
def cuda_has_native_bf16(device: torch.device) -> bool:
    """A CUDA device of compute capability 8.0 or more (its tensor cores take bf16)."""
    try:
        return torch.cuda.get_device_capability(device)[0] >= 8
    except (RuntimeError, AssertionError):  # no such device, or CUDA not initialised
        return False


@contextlib.contextmanager
def _autocast(device: torch.device, precision: str = "auto"):
    """The forward's precision (``train.precision``, ``uses_bf16``): the forward under bf16 autocast
    or not; the adapters' weights, the optimizer and the DP arithmetic (per-example norms, clip,
    noise) stay float32 either way. "auto" is bf16 on a GPU with native bf16 and float32 elsewhere;
    "bf16" forces it on a CPU too, where it is 1.48x faster per DP-SGD step on a CPU with
    AVX512-BF16 (BENCHMARKS.md, "bf16 on a CPU"). On a CPU it also takes the math attention kernel:
    the fused CPU kernel's bf16 backward is ~5x slower than its float32 one. Training and
    evaluation take the same precision."""
    bf16 = uses_bf16(device, precision)
    _announce_precision(device.type, precision, bf16)
    if not bf16:
        yield
        return
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.autocast(device_type=device.type, dtype=torch.bfloat16))
        if device.type == "cpu":
            from torch.nn.attention import SDPBackend, sdpa_kernel
            stack.enter_context(sdpa_kernel(SDPBackend.MATH))
        yield


@functools.lru_cache(maxsize=None)
def cpu_has_native_bf16() -> bool | None:
    """Whether this x86 CPU computes bf16 natively (AVX512-BF16 or AMX-BF16); None where that is not
    known (not x86, or not Linux). Without them torch emulates bf16 on a CPU, slower than float32."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None  # ARM names its bf16 flag differently; say nothing rather than warn wrongly
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    return "avx512_bf16" in flags or "amx_bf16" in flags


@functools.lru_cache(maxsize=None)
def _announce_precision(device_type: str, precision: str, bf16: bool) -> None:
    """Say once per process how this silo trains, when ``train.precision`` is not float32 by default:
    a user who asked for bf16 sees it was taken, and is warned where it will be slow."""
    if not bf16:
        if precision == "fp32" and device_type == "cuda":
            log.info("train.precision = fp32: training in float32 on the GPU (no bf16 autocast)")
        return
    log.info("train.precision = %s: the forward under bf16 autocast on %s (its backward follows); per-example norms, "
             "clipping and noise stay float32 (docs/privacy.md)", precision, device_type)
    if device_type == "cpu" and cpu_has_native_bf16() is False:
        log.warning("train.precision = bf16 on a CPU without AVX512-BF16 or AMX-BF16: torch emulates bf16 here, "
                    "which is usually slower than float32; set train.precision = \"fp32\" (or \"auto\")")


class SiloStreams(NamedTuple):
    """The random streams of one silo's round."""

    sampling: torch.Generator  # example-sampling coins (Poisson under DP)
    dropout_seed: int  # LoRA / encoder dropout masks
    dp_noise: torch.Generator  # DP-SGD Gaussian noise (sample level, noise on the silo)


def silo_randomness(noise, partition_id: int, server_round: int, device: torch.device | str = "cpu") -> SiloStreams:
    """The random streams of one silo's round, from the run's ``NoiseSource`` (seeded per (silo,
    round), or OS entropy when hardened). One naming scheme for the ClientApp and the benchmarks'
    bare loop, so both do the same work. The DP-SGD noise generator lives on ``device``, the
    device of the gradients it noises (torch draws a CUDA tensor only from a CUDA generator); the
    sampling coins stay on the CPU, where the batch indices are drawn. A seeded run therefore
    repeats on the same kind of device; a CPU and a GPU draw different noise from the same seed."""
    return SiloStreams(noise.generator(f"example-sampling/{partition_id}", server_round),
                       noise.stream_seed(f"dropout/{partition_id}", server_round),
                       noise.generator(f"dp-sgd-noise/{partition_id}", server_round, device=torch.device(device)))


@contextlib.contextmanager
def _seeded_dropout(seed: int | None, device: torch.device):
    """Dropout draws from torch's global RNG. With a seed, that RNG is forked and seeded for the
    block only: a silo's round is reproducible whatever ran before it in the process (a simulation
    worker trains many silos in turn), and the caller's RNG state is left untouched."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


# Examples per forward/backward pass, in plain and in DP-SGD training. A batch of b examples is
# processed in chunks of at most this many and the step is the same (the batch's mean gradient;
# under DP-SGD its clipped sum plus one noise draw). Why: at b = 500 one pass held 4-5 GB per silo
# process (DP-SGD keeps every example's activations and gradients) and Ray killed workers.
# PHYSICAL_BATCH_SIZE is the GPU's (a chunk must be large to keep it busy; the memory plan sizes
# GPUs by it). On a CPU a small chunk costs nothing per example, and sorted small chunks are padded
# far less: a Poisson batch of b = 125 of the generated task runs 1.37x faster in chunks of 32 than
# in one chunk (BENCHMARKS.md, "Length-sorted chunks on a CPU").
PHYSICAL_BATCH_SIZE = 128
PHYSICAL_BATCH_SIZE_CPU = 32


def physical_batch_size_for(device: torch.device) -> int:
    """The chunk size a device trains in (see PHYSICAL_BATCH_SIZE)."""
    return PHYSICAL_BATCH_SIZE if device.type == "cuda" else PHYSICAL_BATCH_SIZE_CPU


def physical_chunks(data: TokenizedSplit, idx: torch.Tensor, size: int = PHYSICAL_BATCH_SIZE) -> list[torch.Tensor]:
    """A logical batch ``idx`` in chunks of at most ``size`` examples, shortest rows first.

    Why the sort: every chunk is padded to its longest row (``TokenizedSplit.batch``), and a random
    chunk of SST-2 is padded to ~3x its real tokens (mean 13 tokens, the chunk's longest ~45).
    Sorted, b = 500 costs 2.3x fewer padded tokens and b = 1000 2.8x (BENCHMARKS.md, "Length-sorted
    chunks"). The step does not depend on the order: it is the clipped per-example sum plus one
    noise draw (DP-SGD) or the length-weighted mean gradient (plain), equal up to float summation
    order. Only seeded dropout masks land on other examples: an equally distributed draw, so a
    seeded run with dropout repeats itself but not the unsorted code's trajectory."""
    if len(idx) <= size:
        return [idx]  # one chunk: its padding does not depend on the order
    lengths = data.attention_mask[idx].sum(dim=1)
    return list(idx[torch.argsort(lengths, stable=True)].split(size))


def round_lr(lr: float, schedule: str, server_round: int, num_rounds: int) -> float:
    """The silos' learning rate in round ``server_round`` (1-based) of ``num_rounds``.

    ``cosine`` decays from ``lr`` in round 1 towards 0 (half a cosine over the planned rounds). Why:
    under DP-SGD the rate that escapes the flat start quickly makes the later rounds oscillate
    (docs/changelog.md, the first DP-SGD grid); the decay keeps the fast start and a stable end."""
    if schedule == "constant":
        return lr
    if schedule == "cosine":
        t = min(max(server_round - 1, 0), num_rounds)
        return lr * 0.5 * (1.0 + math.cos(math.pi * t / max(num_rounds, 1)))
    raise ValueError(f"unknown learning-rate schedule {schedule!r}")


def local_optimizer(params, *, lr: float, kind: str = "adam", adam_eps: float = 1e-8):
    """A silo's optimizer for one round (fresh every round): Adam, or SGD. The one place both the
    plain and the DP-SGD local training build it. ``params``: tensors, or the groups of
    ``optimizer_groups`` (each group steps at ``lr`` times its ``lr_scale``). ``adam_eps``
    (``train.adam-eps``): Adam's denominator floor; under DP-SGD, set near the noise's
    per-coordinate std σC/b, a coordinate that only noise moves steps by about lr·std/eps instead
    of lr (a fresh Adam's first steps are sign-like: lr whatever the signal)."""
    params = list(params)
    if kind == "adam":
        opt = torch.optim.Adam(params, lr=lr, eps=adam_eps)
    elif kind == "sgd":
        opt = torch.optim.SGD(params, lr=lr)
    else:
        raise ValueError(f"unknown optimizer {kind!r}")
    _set_rate(opt, lr)
    return opt


def optimizer_groups(named_params, head_lr_scale: float = 1.0):
    """The trainable tensors of ``named_params`` as optimizer groups: the adapters at the round's
    rate, the classification head at ``head_lr_scale`` times it (``train.head-lr-scale``). Why a
    rate of its own: a fresh Adam moves every coordinate by about lr per step whatever its gradient,
    and the head's 384 inputs all push one logit, so at the adapters' rate its logits outgrow the
    evidence (training loss above ln 2 at 85 % accuracy on SST-2, RESULTS.md). Scale 1: one group."""
    from ..model import is_head_parameter

    named = [(n, p) for n, p in named_params if p.requires_grad]
    if head_lr_scale == 1.0:
        return [p for _, p in named]
    groups = [{"params": [p for n, p in named if not is_head_parameter(n)], "lr_scale": 1.0},
              {"params": [p for n, p in named if is_head_parameter(n)], "lr_scale": float(head_lr_scale)}]
    return [g for g in groups if g["params"]]


def _set_rate(opt, lr: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


def resume_optimizer(opt, params, *, lr: float, kind: str, carry: dict | None) -> None:
    """Load a silo's optimizer state from its previous round into ``opt`` (``train.optimizer-state
    = "run"``): Adam's moments then average over many rounds' noisy steps instead of restarting
    from zero (a fresh Adam's first steps move every coordinate by about lr, noise or not). A state
    of another optimizer or trainable set is ignored. ``carry`` empty or None: nothing to load."""
    if not carry or carry.get("kind") != kind or carry.get("shapes") != [tuple(p.shape) for p in params]:
        return
    opt.load_state_dict(carry["state"])
    _set_rate(opt, lr)  # this round's rate, not the saved one


def keep_optimizer(opt, params, *, kind: str, carry: dict | None) -> None:
    """Save ``opt``'s state into ``carry`` (if given) for the silo's next round."""
    if carry is None:
        return
    import copy

    carry.clear()
    carry.update(kind=kind, shapes=[tuple(p.shape) for p in params], state=copy.deepcopy(opt.state_dict()))


class LossSum:
    """The training loss summed on the device: one host sync per round (``mean``), not one per
    chunk (a ``float(loss)`` in the loop stalls a GPU until the chunk's kernels finish)."""

    def __init__(self, device: torch.device) -> None:
        self.total = torch.zeros((), dtype=torch.float64, device=device)

    def add(self, loss: torch.Tensor, weight: float) -> None:
        self.total += loss.detach().double() * weight

    def mean(self, steps: int) -> float:
        """The mean over ``steps`` non-empty steps of each step's batch-weighted loss (nan if none)."""
        return float(self.total) / steps if steps else math.nan


def training_loss(out, batch, label_smoothing: float = 0.0) -> torch.Tensor:
    """A batch's mean training loss: the model's cross-entropy, or with ``train.label-smoothing``
    s > 0 cross-entropy against torch's smoothed targets (1 - s/2 on the true class of two, s/2 on
    the other). The one place both
    the plain and the DP-SGD loops take it. Why smoothing under DP-SGD: once an example's gradient
    is clipped (the head's are ~72x C_h on SST-2), it pushes with the same force however well it
    is fitted, so the clipped objective drives the logits to extreme confidence; with smoothed
    targets the push turns at P = 1 - s/2 (RESULTS.md, "Where the 6 points to the ceiling go"). It costs no
    privacy: the loss is public, and the clip bounds each example's gradient whatever the loss."""
    if not label_smoothing:
        return out.loss.float()
    return torch.nn.functional.cross_entropy(out.logits.float(), batch["labels"], label_smoothing=label_smoothing)


def train_local(model, data: TokenizedSplit, *, steps: int, batch_size: int, lr: float,
                generator: torch.Generator, poisson: bool, device: torch.device,
                dropout_seed: int | None = None, physical_batch_size: int | None = None,
                optimizer: str = "adam", optimizer_carry: dict | None = None, adam_eps: float = 1e-8,
                head_lr_scale: float = 1.0, label_smoothing: float = 0.0, precision: str = "auto") -> TrainStats:
    """L steps of mini-batch Adam (or SGD: ``optimizer``) on the trainable parameters; a fresh
    optimizer every round.
    ``dropout_seed`` makes the dropout masks a function of the seed alone (see ``silo_randomness``)."""
    from .frozen_prefix import forward_context

    with _seeded_dropout(dropout_seed, device), forward_context(model, data):
        return _train_steps(model, data, steps=steps, batch_size=batch_size, lr=lr,
                            generator=generator, poisson=poisson, device=device,
                            physical_batch_size=physical_batch_size, optimizer=optimizer,
                            optimizer_carry=optimizer_carry, adam_eps=adam_eps, head_lr_scale=head_lr_scale,
                            label_smoothing=label_smoothing, precision=precision)


def _train_steps(model, data: TokenizedSplit, *, steps: int, batch_size: int, lr: float,
                 generator: torch.Generator, poisson: bool, device: torch.device,
                 physical_batch_size: int | None = None, optimizer: str = "adam",
                 optimizer_carry: dict | None = None, adam_eps: float = 1e-8,
                 head_lr_scale: float = 1.0, label_smoothing: float = 0.0, precision: str = "auto") -> TrainStats:
    model.train()
    chunk_size = physical_batch_size or physical_batch_size_for(device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = local_optimizer(optimizer_groups(model.named_parameters(), head_lr_scale), lr=lr, kind=optimizer,
                          adam_eps=adam_eps)
    resume_optimizer(opt, params, lr=lr, kind=optimizer, carry=optimizer_carry)
    losses = LossSum(device)
    count, seen, empty = 0, 0, 0
    for idx in batch_indices(len(data), batch_size, steps, generator, poisson, rate_size=getattr(data, "dp_size", None)):
        if len(idx) == 0:
            empty += 1
            continue
        opt.zero_grad(set_to_none=True)
        # The batch's mean gradient, accumulated over physical chunks (peak memory set by the chunk).
        for chunk in physical_chunks(data, idx, chunk_size):
            batch = data.batch(chunk, device)
            with _autocast(device, precision):
                out = model(**batch)
            loss = training_loss(out, batch, label_smoothing)
            (loss * (len(chunk) / len(idx))).backward()
            losses.add(loss, len(chunk) / len(idx))
        opt.step()
        count += 1
        seen += len(idx)
    keep_optimizer(opt, params, kind=optimizer, carry=optimizer_carry)
    return TrainStats(loss=losses.mean(count), steps=steps, examples_seen=seen, empty_steps=empty)


@torch.no_grad()
def evaluate(model, data: TokenizedSplit, *, batch_size: int, device: torch.device | None = None,
             logits_out: list | None = None, precision: str = "auto") -> dict[str, float]:
    """Accuracy and mean cross-entropy on a split, at ``precision`` (``train.precision``: the same
    as training), with macro-F1, balanced accuracy and the majority-class baseline (``metrics``).
    ``device``: the model's (default). ``logits_out``, if given, receives the logits (float32, CPU)
    batch by batch."""
    from .features import encoder_at_public_init, feature_logits, feature_spec, features_of
    from .metrics import confusion, scores

    model.eval()
    device = next(model.parameters()).device if device is None else torch.device(device)
    if feature_spec(model) is not None and encoder_at_public_init(model):
        # a head on the public encoder's features: the split's features once, then one product
        return _evaluate_logits(feature_logits(model, features_of(model, data, device=device)), data.labels,
                                logits_out=logits_out, batch_size=batch_size)
    correct = torch.zeros((), dtype=torch.long, device=device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    matrix = None
    n = len(data)
    for start in range(0, n, batch_size):
        idx = torch.arange(start, min(n, start + batch_size))
        batch = data.batch(idx, device)
        with _autocast(device, precision):
            out = model(**batch)
        logits = out.logits.float()
        if logits_out is not None:
            logits_out.append(logits.detach().cpu())
        loss_sum += torch.nn.functional.cross_entropy(logits, batch["labels"], reduction="sum").double()
        correct += (logits.argmax(-1) == batch["labels"]).sum()
        counts = confusion(logits.argmax(-1), batch["labels"], logits.shape[-1])
        matrix = counts if matrix is None else matrix + counts
    extra = {k: v for k, v in scores(matrix).items() if k != "accuracy"} if matrix is not None else {}
    return {"accuracy": int(correct) / max(n, 1), "loss": float(loss_sum) / max(n, 1), "num-examples": n, **extra}


def _evaluate_logits(logits: torch.Tensor, labels: torch.Tensor, *, logits_out: list | None,
                     batch_size: int) -> dict[str, float]:
    """``evaluate``'s figures from a split's logits computed at once (the feature head's)."""
    from .metrics import confusion, scores

    logits = logits.float()
    labels = labels.to(logits.device)
    if logits_out is not None:
        logits_out.extend(logits[i:i + batch_size].detach().cpu() for i in range(0, len(logits), batch_size))
    n = len(labels)
    loss = float(torch.nn.functional.cross_entropy(logits, labels, reduction="sum").double()) if n else 0.0
    pred = logits.argmax(-1)
    matrix = confusion(pred, labels, logits.shape[-1]) if n else None
    extra = {k: v for k, v in scores(matrix).items() if k != "accuracy"} if matrix is not None else {}
    return {"accuracy": int((pred == labels).sum()) / max(n, 1), "loss": loss / max(n, 1), "num-examples": n, **extra}
