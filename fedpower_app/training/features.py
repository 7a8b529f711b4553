"""A linear head on frozen sentence features (``train.what = "head"``, and the head phase of
``"head-then-adapters"``).

Why: with hundreds to a few thousand rows a silo, DP-SGD on adapters adds the noise of a
per-step sum over a few hundred examples to thousands of coordinates. A linear model on good,
fixed features has a few hundred to a few thousand coordinates, a convex loss, and steps cheap
enough to take many (Tramèr & Boneh 2021; Mehta et al. 2023). all-MiniLM-L6-v2 is a trained
sentence encoder, so its mean-pooled embedding is such a feature.

The features (public functions of a row and the public encoder, so computing them spends no
privacy):

* one sentence: u = the mean of the encoder's last hidden states over the real tokens, L2-normalised
  (the encoder's sentence embedding, as sentence-transformers computes it);
* a pair: u and v, each sentence encoded **on its own** (``[CLS] a [SEP]`` and ``[CLS] b [SEP]``,
  cut out of the pair's joint tokens by their token types), then ``[u, v, |u - v|, u * v]``
  (4 H features; the bi-encoder's own pair representation).

The model's forward computes exactly this (``install_feature_forward``: the encoder returns the
features as its pooled output, the classifier is a ``Linear(F, K)`` on them), so the released
model and the adapter phase of LP-FT use the same map; a silo computes its rows' features once
(``features_of``, cached per split object) and trains the head on them with closed-form
per-example gradients (``dp_sgd_head``): each step samples a Poisson batch at q = b / n, computes
every example's gradient of the (weighted) cross-entropy, g_i = (p_i - y_i) [x_i, 1]ᵀ, clips it to
the DP-SGD sensitivity, adds N(0, (σ·C)²) to the sum and divides by b: the same subsampled
Gaussian mechanism, with the same parameters, as the silo's ledger charges for an adapter round.

Class weights (``train.class-prior``): an example of class k weighs 1 / (K · π_k), π the prior
the operator declares (public, never the silo's label counts). Under DP-SGD the weight multiplies
the example's gradient *after* its clip, divided by the largest weight (the rarest class's weight
is 1, the others less): weighting before the clip would be undone by it (nearly every example's
gradient is above C), and weights of at most 1 keep every example's share of the sum within C, so
the guarantee is unchanged.
"""

from __future__ import annotations

import math
import time
import types
from dataclasses import dataclass

import torch

from ..data.pipeline import SiloRows


# ------------------------------------------------------------------------------------------
# Which runs use features, and their shape (public: the configuration alone)
# ------------------------------------------------------------------------------------------
def uses_features(cfg) -> bool:
    """Does a run of ``cfg`` classify from the sentence features (a head-only or LP-FT run)?"""
    return cfg["train.what"] != "adapters"


def pair_task(cfg) -> bool:
    """Does the task classify pairs of texts? (the generic text task with a pair column, or a GLUE
    pair task)."""
    name = cfg["task.name"]
    if name == "text":
        return bool(cfg["task.text-pair-column"].strip())
    if name == "synthetic":
        return False
    from ..data.glue_tasks import get_task_spec

    return get_task_spec(name).text_b_columns is not None


def feature_dim(hidden: int, pair: bool) -> int:
    return 4 * hidden if pair else hidden


def parse_class_prior(text: str) -> list[float]:
    """``"0.85,0.15"``: the declared share of each class, in label order (positive, summing to 1
    within 1 %). Raises ValueError."""
    try:
        prior = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"must be comma-separated numbers (each class's declared share), got {text!r}") from None
    if not prior or any(not (p > 0 and math.isfinite(p)) for p in prior):
        raise ValueError(f"must hold a share > 0 for every class, got {text!r}")
    if abs(sum(prior) - 1.0) > 0.01:
        raise ValueError(f"shares must sum to 1, got {sum(prior):g} ({text!r})")
    return prior


def class_weights(cfg, num_labels: int) -> torch.Tensor | None:
    """1 / (K·π_k) for the declared prior π (``train.class-prior``), None without one: a balanced
    loss, in which each class weighs as much as the others whatever its share."""
    text = cfg["train.class-prior"].strip()
    if not text:
        return None
    prior = parse_class_prior(text)
    if len(prior) != num_labels:
        raise ValueError(f"train.class-prior has {len(prior)} shares but the task has {num_labels} classes")
    return torch.tensor([1.0 / (num_labels * p) for p in prior], dtype=torch.float32)


# ------------------------------------------------------------------------------------------
# The feature map, inside the model's forward
# ------------------------------------------------------------------------------------------
def _mean_normalised(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.to(hidden.dtype).unsqueeze(-1)
    mean = (hidden * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)
    return torch.nn.functional.normalize(mean.float(), dim=-1)


def split_pair(input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None):
    """The two sentences of a jointly tokenised pair (``[CLS] a [SEP] b [SEP]``), each as a row of
    its own: (ids_a, mask_a), (ids_b, mask_b), ``[CLS] a [SEP]`` and ``[CLS] b [SEP]``, padded to
    the pair's width. The sentences are told apart by their token types (0 for a, 1 for b)."""
    if token_type_ids is None:
        raise ValueError("pair features need the tokenizer's token_type_ids to tell the two sentences apart "
                         "(BERT-style encoders such as MiniLM)")
    real = attention_mask.bool()
    in_a = real & (token_type_ids == 0)
    in_b = real & (token_type_ids == 1)
    ids_a = torch.where(in_a, input_ids, torch.zeros_like(input_ids))
    len_a = in_a.sum(dim=1)  # [CLS] a [SEP]
    width = input_ids.shape[1]
    pos = torch.arange(width, device=input_ids.device).unsqueeze(0)
    # row b: position 0 keeps [CLS]; position j >= 1 takes the pair's position len_a - 1 + j
    src = torch.where(pos == 0, torch.zeros_like(pos), (len_a.unsqueeze(1) - 1 + pos)).clamp(max=width - 1)
    ids_b = torch.gather(input_ids, 1, src)
    mask_b = torch.where(pos == 0, real[:, :1], torch.gather(in_b, 1, src) & (len_a.unsqueeze(1) - 1 + pos < width))
    ids_b = torch.where(mask_b, ids_b, torch.zeros_like(ids_b))
    return (ids_a, in_a.long()), (ids_b, mask_b.long())


def _encode(plain_forward, ids, mask):
    """One sentence per row through the encoder: its L2-normalised mean embedding."""
    width = max(int(mask.sum(dim=1).max().item()), 1)
    ids, mask = ids[:, :width], mask[:, :width]
    out = plain_forward(input_ids=ids, attention_mask=mask, token_type_ids=torch.zeros_like(ids))
    return _mean_normalised(out.last_hidden_state, mask)


def sentence_features(plain_forward, input_ids, attention_mask, token_type_ids, pair: bool) -> torch.Tensor:
    """The features of a tokenised batch (module docstring), through ``plain_forward`` (the
    encoder's own forward)."""
    if not pair:
        return _encode(plain_forward, input_ids, attention_mask)
    (ids_a, mask_a), (ids_b, mask_b) = split_pair(input_ids, attention_mask, token_type_ids)
    u = _encode(plain_forward, ids_a, mask_a)  # two forwards, one per sentence: per-example
    v = _encode(plain_forward, ids_b, mask_b)  # gradients (LP-FT's adapter phase) sum both
    return torch.cat([u, v, (u - v).abs(), u * v], dim=-1)


def _encoder_of(base):
    encoder = getattr(base, getattr(base, "base_model_prefix", ""), None)
    if encoder is None or not isinstance(getattr(base, "classifier", None), torch.nn.Linear):
        raise ValueError(f"train.what = 'head' / 'head-then-adapters' needs a BERT-style encoder whose head is one "
                         f"linear classifier (MiniLM, BERT); {type(base).__name__} is not")
    return encoder


def install_feature_forward(base, *, pair: bool, num_labels: int, what: str = "head") -> int:
    """Turn ``base`` (a ``*ForSequenceClassification`` with a BERT-style encoder, before PEFT
    wraps it) into a classifier on the sentence features: its encoder returns the features as
    its pooled output, and its classifier becomes a zero-initialised ``Linear(F, K)`` on them (a
    linear model trained privately from zero; Mehta et al. 2023). Returns F."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    encoder = _encoder_of(base)
    hidden = int(base.config.hidden_size)
    dim = feature_dim(hidden, pair)
    plain_forward = encoder.forward  # the class's forward, bound: the encoder itself

    def forward(input_ids=None, attention_mask=None, token_type_ids=None, *args, **kwargs):
        if input_ids is None:
            raise ValueError("the feature classifier needs input_ids (it encodes each sentence itself)")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        feats = sentence_features(plain_forward, input_ids, attention_mask, token_type_ids, pair)
        return BaseModelOutputWithPooling(last_hidden_state=feats.unsqueeze(1), pooler_output=feats)

    encoder.forward = forward
    encoder.fedpower_plain_forward = plain_forward
    head = torch.nn.Linear(dim, num_labels)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    base.classifier = head.to(next(base.parameters()).device)
    base.fedpower_features = FeatureSpec(pair=pair, dim=dim, what=what)
    return dim


@dataclass(frozen=True)
class FeatureSpec:
    pair: bool  # pairs encoded apart, [u, v, |u - v|, u * v]
    dim: int  # F
    what: str = "head"  # train.what


def feature_spec(model) -> FeatureSpec | None:
    """The model's feature map, or None for a model that classifies its pooled output as usual."""
    for module in (model, getattr(model, "base_model", None), getattr(getattr(model, "base_model", None), "model", None)):
        spec = getattr(module, "fedpower_features", None)
        if spec is not None:
            return spec
    return None


def encoder_at_public_init(model) -> bool:
    """Are all LoRA B matrices zero, so that the encoder computes what the public pretrained one
    does (whatever A)? Then cached features are the model's own."""
    return all(not bool(p.detach().any()) for n, p in model.named_parameters() if "lora_B" in n)


def _plain_encoder_forward(model):
    for module in model.modules():
        fwd = getattr(module, "fedpower_plain_forward", None)
        if fwd is not None:
            return fwd
    raise ValueError("this model has no feature forward (train.what = 'adapters')")


# ------------------------------------------------------------------------------------------
# Features computed once per split
# ------------------------------------------------------------------------------------------
@dataclass
class FeatureSplit(SiloRows):
    """A split as its rows' features: (N, F) float32 on the training device, labels on the CPU."""

    features: torch.Tensor
    labels: torch.Tensor
    declared_size: int | None = None


@torch.no_grad()
def compute_features(model, data, *, device, batch_size: int = 256, log=None) -> FeatureSplit:
    """Every row's features, in eval mode, with the adapters as they are (a head-only run never
    moves them from their public initialisation, where LoRA's B = 0 adds nothing)."""
    if isinstance(data, FeatureSplit):
        return data
    spec = feature_spec(model)
    if spec is None:
        raise ValueError("this model has no feature map (train.what = 'adapters')")
    if not hasattr(data, "input_ids"):
        raise ValueError(f"features are computed from tokens; got {type(data).__name__}")
    plain = _plain_encoder_forward(model)
    device = torch.device(device)
    was_training = model.training
    model.eval()
    t0 = time.perf_counter()
    out = torch.empty(len(data), spec.dim, dtype=torch.float32, device=device)
    lengths = data.attention_mask.sum(dim=1)
    order = torch.argsort(lengths, stable=True)  # similar lengths together: less padding
    try:
        for start in range(0, len(data), batch_size):
            idx = order[start:start + batch_size]
            batch = data.batch(idx, device)
            out[idx.to(device)] = sentence_features(plain, batch["input_ids"], batch["attention_mask"],
                                                    batch.get("token_type_ids"), spec.pair).float()
    finally:
        model.train(was_training)
    if log is not None:
        log.debug("sentence features: %d rows x %d in %.1f s", len(data), spec.dim, time.perf_counter() - t0)
    return FeatureSplit(out, data.labels, declared_size=getattr(data, "declared_size", None))


_FEATURES: dict[tuple, tuple] = {}
MAX_CACHED_SPLITS = 64


def features_of(model, data, *, device=None, log=None) -> FeatureSplit:
    """``data``'s features, computed on first use and kept for the process (per model and split
    object: a silo's shard and the evaluation split are the same objects every round)."""
    if isinstance(data, FeatureSplit):
        return data
    if not encoder_at_public_init(model):
        raise ValueError("cached features are those of the public encoder; this model's adapters have moved "
                         "(the adapter phase of head-then-adapters computes them in its forward)")
    device = next(model.parameters()).device if device is None else torch.device(device)
    key = (id(model), id(data), str(device))
    hit = _FEATURES.get(key)
    if hit is not None and hit[0] is data and hit[1] is model:
        return hit[2]
    while len(_FEATURES) >= MAX_CACHED_SPLITS:
        _FEATURES.pop(next(iter(_FEATURES)))
    feats = compute_features(model, data, device=device, log=log)
    _FEATURES[key] = (data, model, feats)  # the references keep the ids from being reused
    return feats


def clear_feature_cache() -> None:
    _FEATURES.clear()


# ------------------------------------------------------------------------------------------
# The head: its tensors, its logits, its per-example gradients
# ------------------------------------------------------------------------------------------
def head_tensors(model) -> tuple[torch.Tensor, torch.Tensor]:
    """The trained head's weight (K, F) and bias (K,) inside the model (PEFT's active copy)."""
    from ..model import is_head_parameter

    named = {n: p for n, p in model.named_parameters() if is_head_parameter(n)}
    weights = [p for n, p in named.items() if n.endswith("weight") and p.dim() == 2]
    biases = [p for n, p in named.items() if n.endswith("bias") and p.dim() == 1]
    if len(weights) != 1 or len(biases) != 1:
        raise ValueError(f"expected one trained linear head, found {sorted(named)}")
    return weights[0], biases[0]


def head_logits(weight: torch.Tensor, bias: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return x @ weight.t() + bias


def per_example_head_gradients(weight, bias, x, y, weights: torch.Tensor | None = None):
    """Each example's gradient of its (weighted) cross-entropy at (W, b), in closed form:
    r_i = w_{y_i} (softmax(W x_i + b) - e_{y_i}); dW_i = r_i x_iᵀ, db_i = r_i. Returns (r, norms)
    with ‖g_i‖ = ‖r_i‖ · √(‖x_i‖² + 1), and the mean loss."""
    logits = head_logits(weight, bias, x)
    logp = torch.log_softmax(logits, dim=-1)
    r = logp.exp()
    r[torch.arange(len(y)), y] -= 1.0
    nll = -logp[torch.arange(len(y)), y]
    if weights is not None:
        w = weights.to(x.device)[y]
        r = r * w.unsqueeze(1)
        nll = nll * w
    norms = r.norm(dim=1) * torch.sqrt((x * x).sum(dim=1) + 1.0)
    return r, norms, nll.mean() if len(y) else torch.zeros((), device=x.device)


@dataclass
class HeadStats:
    loss: float
    steps: int
    examples_seen: int
    empty_steps: int


def _noise(std: float, like: torch.Tensor, generator, secure: bool) -> torch.Tensor:
    from opacus.optimizers.optimizer import _generate_noise

    return _generate_noise(std=std, reference=like, generator=generator, secure_mode=secure)


def dp_sgd_head(model, data: FeatureSplit, *, params, lr: float, sampling_generator: torch.Generator,
                noise_generator: torch.Generator | None, secure_noise: bool = False, optimizer: str = "adam",
                optimizer_carry: dict | None = None, adam_eps: float = 1e-8,
                class_weight: torch.Tensor | None = None):
    """One silo's round of DP-SGD on the head alone (``params``: the round's ``DPSGDParams``, as
    the silo's ledger charges them). Each of the L steps: a Poisson batch at q = b / n, every
    example's gradient clipped to C = ``params.sensitivity`` (the whole bound the accountant's σ is
    relative to: the head is all that trains), then times its class's weight over the largest
    (``class_weight``; module docstring), N(0, (σC)²) on each coordinate of the sum, divided by b,
    one optimizer step. An empty batch is a noise-only step."""
    from .loops import TrainStats, batch_indices, keep_optimizer, local_optimizer, resume_optimizer

    problems = params.problems()
    if problems:
        raise ValueError("invalid DP-SGD parameters: " + "; ".join(problems))
    weight, bias = head_tensors(model)
    trainable = [weight, bias]
    opt = local_optimizer(trainable, lr=lr, kind=optimizer, adam_eps=adam_eps)
    resume_optimizer(opt, trainable, lr=lr, kind=optimizer, carry=optimizer_carry)
    clip = float(params.sensitivity)
    std = float(params.noise_multiplier) * clip
    x_all = data.features.to(weight.device)
    y_all = data.labels.to(weight.device)
    loss_sum, count, seen, empty = 0.0, 0, 0, 0
    for idx in batch_indices(len(data), params.batch_size, params.local_steps, sampling_generator,
                             poisson=True, rate_size=data.dp_size):
        idx = idx.to(weight.device)
        with torch.no_grad():
            if len(idx):
                x, y = x_all[idx], y_all[idx]
                r, norms, loss = per_example_head_gradients(weight, bias, x, y)
                factors = (clip / (norms + 1e-6)).clamp(max=1.0)
                if class_weight is not None:  # after the clip, at most 1: each example still adds <= C
                    w = class_weight.to(x.device)
                    factors = factors * (w / w.max())[y]
                rc = r * factors.unsqueeze(1)
                grad_w, grad_b = rc.t() @ x, rc.sum(dim=0)
                loss_sum += float(loss)
                count += 1
                seen += len(idx)
            else:
                empty += 1
                grad_w, grad_b = torch.zeros_like(weight), torch.zeros_like(bias)
            weight.grad = (grad_w + _noise(std, weight, noise_generator, secure_noise)) / params.batch_size
            bias.grad = (grad_b + _noise(std, bias, noise_generator, secure_noise)) / params.batch_size
        opt.step()
        opt.zero_grad(set_to_none=True)
    keep_optimizer(opt, trainable, kind=optimizer, carry=optimizer_carry)
    return TrainStats(loss=loss_sum / count if count else math.nan, steps=params.local_steps,
                      examples_seen=seen, empty_steps=empty)


def train_head(model, data: FeatureSplit, *, steps: int, batch_size: int, lr: float, generator: torch.Generator,
               poisson: bool, optimizer: str = "adam", optimizer_carry: dict | None = None, adam_eps: float = 1e-8,
               class_weight: torch.Tensor | None = None):
    """The non-private round of the head: ``steps`` steps of the mean (weighted) cross-entropy
    over batches of ``batch_size`` (Poisson at b / n when ``poisson``), no clip, no noise."""
    from .loops import TrainStats, batch_indices, keep_optimizer, local_optimizer, resume_optimizer

    weight, bias = head_tensors(model)
    trainable = [weight, bias]
    opt = local_optimizer(trainable, lr=lr, kind=optimizer, adam_eps=adam_eps)
    resume_optimizer(opt, trainable, lr=lr, kind=optimizer, carry=optimizer_carry)
    x_all = data.features.to(weight.device)
    y_all = data.labels.to(weight.device)
    loss_sum, count, seen, empty = 0.0, 0, 0, 0
    for idx in batch_indices(len(data), batch_size, steps, generator, poisson=poisson, rate_size=data.dp_size):
        if len(idx) == 0:
            empty += 1
            continue
        idx = idx.to(weight.device)
        with torch.no_grad():
            r, _, loss = per_example_head_gradients(weight, bias, x_all[idx], y_all[idx], class_weight)
            weight.grad = (r.t() @ x_all[idx]) / len(idx)
            bias.grad = r.sum(dim=0) / len(idx)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_sum += float(loss)
        count += 1
        seen += len(idx)
    keep_optimizer(opt, trainable, kind=optimizer, carry=optimizer_carry)
    return TrainStats(loss=loss_sum / count if count else math.nan, steps=steps, examples_seen=seen,
                      empty_steps=empty)


@torch.no_grad()
def feature_logits(model, data: FeatureSplit) -> torch.Tensor:
    """The model's logits on a split's cached features (what its forward computes on the rows)."""
    weight, bias = head_tensors(model)
    return head_logits(weight, bias, data.features.to(weight.device)).float()
