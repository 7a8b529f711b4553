"""Cache what the frozen layers below the lowest adapter compute (``train.cache-frozen``).

Why: with LoRA only on the top layers (``lora.top-layers``), the embeddings and the encoder layers
below the lowest adapter never change during a run: their output for a given example is the same
every round. A silo computes it once, then every training step runs only the layers from the lowest
adapter up (forward and backward). On MiniLM with LoRA on the top 3 of 6 layers that removes the
frozen half's forward from every step (BENCHMARKS.md, "Frozen-prefix cache").

What changes: the cached layers run in eval mode, so their dropout is off during training (the
layers above keep theirs). Everything else is the same computation: in eval mode the cached
model's logits equal the full model's (tests/test_frozen_prefix.py). Privacy is unaffected: the
cache is a deterministic function of the silo's own examples and public weights, and DP-SGD clips
and noises the same per-example gradients of the same trainable tensors.

How: ``prefix_skipped(model, k)`` swaps, for the duration of a step, the embeddings for a
pass-through and the encoder's layer list for its layers k and up, then calls the unchanged Hugging
Face forward with ``inputs_embeds`` = the cached hidden states. Supported: encoders with
``embeddings`` and ``encoder.layer`` (BERT, RoBERTa, ELECTRA, DeBERTa, MiniLM) or
``transformer.layer`` (DistilBERT).
"""

from __future__ import annotations

import re
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from ..data.pipeline import SiloRows

_LAYER = re.compile(r"(?:^|\.)(?:encoder|transformer)\.layer\.(\d+)\.")
#: Where an encoder keeps its layer stack: ``encoder.layer`` (BERT, RoBERTa, ELECTRA, DeBERTa) or
#: ``transformer.layer`` (DistilBERT).
_STACKS = ("encoder", "transformer")


def _stack(owner):
    """The module whose ``layer`` is the encoder's list of layers."""
    for attr in _STACKS:
        stack = getattr(owner, attr, None)
        if isinstance(getattr(stack, "layer", None), torch.nn.ModuleList):
            return stack
    return None


def _encoder_owner(model):
    """The submodule holding ``embeddings`` and the layer stack (e.g. PEFT -> ... -> ``bert``)."""
    for module in model.modules():
        if hasattr(module, "embeddings") and _stack(module) is not None:
            return module
    raise ValueError("train.cache-frozen needs an encoder with `embeddings` and `encoder.layer` or "
                     "`transformer.layer` (BERT, RoBERTa, ELECTRA, DeBERTa, DistilBERT, MiniLM); this model has neither")


def lowest_adapted_layer(model) -> int:
    """The index of the lowest encoder layer that holds a LoRA module or a trainable tensor.

    Everything below it is frozen and adapter-free, so its output is the same every round. Raises
    if the embeddings train or carry adapters (nothing to cache) or if nothing trains."""
    lowest = None
    for name, p in model.named_parameters():
        if not (p.requires_grad or "lora_" in name):
            continue
        if ".embeddings." in name:
            raise ValueError(f"train.cache-frozen: the embeddings are adapted or trained ({name}); nothing below is frozen")
        m = _LAYER.search(name)
        if m is not None:
            lowest = int(m.group(1)) if lowest is None else min(lowest, int(m.group(1)))
    if lowest is None:
        # Only modules above the encoder train (the head, the pooler): cache the whole encoder.
        owner = _encoder_owner(model)
        return len(_stack(owner).layer)
    return lowest


class _PassThrough(torch.nn.Module):
    """Stands in for the embeddings: the cached hidden states come in as ``inputs_embeds``."""

    def forward(self, input_ids=None, inputs_embeds=None, *args, **kwargs):  # DistilBERT adds position_ids
        if inputs_embeds is None:
            raise RuntimeError("a prefix-skipped model needs the cached hidden states as inputs_embeds")
        return inputs_embeds


@contextmanager
def prefix_skipped(model, layer: int):
    """Within the block, ``model(inputs_embeds=h, attention_mask=m, labels=y)`` runs encoder layers
    ``layer`` and up on ``h`` (the output of layer ``layer - 1``), then the pooler and the head."""
    owner = _encoder_owner(model)
    stack = _stack(owner)
    embeddings, layers = owner.embeddings, stack.layer
    owner.embeddings = _PassThrough()
    stack.layer = torch.nn.ModuleList(list(layers)[layer:])
    try:
        yield model
    finally:
        owner.embeddings = embeddings
        stack.layer = layers


@torch.no_grad()
def _prefix_hidden(model, batch: dict, layer: int) -> torch.Tensor:
    """The output of encoder layer ``layer - 1`` (eval mode) for a tokenized batch."""
    owner = _encoder_owner(model)
    stack = _stack(owner)
    keep = stack.layer
    stack.layer = torch.nn.ModuleList(list(keep)[:layer])
    extra = {"token_type_ids": batch["token_type_ids"]} if batch.get("token_type_ids") is not None else {}
    try:
        out = owner(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **extra)
    finally:
        stack.layer = keep
    return out.last_hidden_state


@dataclass
class CachedPrefixSplit(SiloRows):
    """A split whose batches are the cached hidden states at the lowest adapted layer.

    It quacks like ``TokenizedSplit`` for training (``len``, ``attention_mask`` for length-sorted
    chunks, ``dp_size`` for the sampling rate, ``batch``). Rows are stored trimmed to their real
    tokens, one flat float32 tensor (MiniLM on SST-2: 13.4 tokens x 384 floats per row) on the
    device that trains on them, so a batch is one gather there, with no host-to-device copy of
    hidden states. The masks and labels stay on the CPU, where batches are drawn and sorted."""

    hidden: torch.Tensor  # (total real tokens, H), on the training device
    offsets: torch.Tensor  # (N + 1,) row i is hidden[offsets[i]:offsets[i+1]]
    attention_mask: torch.Tensor  # (N, L) int64, as the tokenized split's
    labels: torch.Tensor  # (N,)
    layer: int  # the hidden states are the input of encoder layer ``layer``
    declared_size: int | None = None

    def batch(self, idx: torch.Tensor, device) -> dict[str, torch.Tensor]:
        lengths = self.attention_mask[idx].sum(dim=1)
        width = max(int(lengths.max().item()), 1) if len(idx) else 1
        positions = self.offsets[idx].unsqueeze(1) + torch.arange(width)  # (B, width) rows of ``hidden``
        real = torch.arange(width) < lengths.unsqueeze(1)
        positions = torch.where(real, positions, 0)
        out = self.hidden[positions.to(self.hidden.device)]  # (B, width, H): one gather
        out = out.masked_fill_(~real.to(out.device).unsqueeze(-1), 0.0)  # padding rows are zero
        return {"inputs_embeds": out.to(device), "attention_mask": self.attention_mask[idx, :width].to(device),
                "labels": self.labels[idx].to(device)}


def build_prefix_cache(model, data, *, device: torch.device, batch_size: int = 256, log=None) -> CachedPrefixSplit:
    """Run the frozen prefix (embeddings and the layers below the lowest adapter) over ``data``
    once, in eval mode, and keep each row's real tokens, on ``device``. Rows are attended only by
    their real tokens, so trimming the padding does not change what the layers above compute for
    them. The log line says nothing of the silo's data beyond what its process already shows."""
    from .features import encoder_at_public_init, feature_spec, features_of

    spec = feature_spec(model)
    if spec is not None:
        # train.what = "head" / "head-then-adapters": what a silo caches is its rows' sentence
        # features (training.features), computed in the head's rounds; the adapter rounds of
        # head-then-adapters run the whole encoder (each sentence of a pair apart), on the tokens.
        if spec.what == "head" and encoder_at_public_init(model):
            return features_of(model, data, device=device, log=log)
        return data
    layer = lowest_adapted_layer(model)
    device = torch.device(device)
    was_training = model.training
    model.eval()
    lengths = data.attention_mask.sum(dim=1)
    offsets = torch.zeros(len(data) + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(lengths, 0)
    hidden = None
    t0 = time.perf_counter()
    order = torch.argsort(lengths, stable=True)  # similar lengths together: less padding
    try:
        for start in range(0, len(data), batch_size):
            idx = order[start:start + batch_size]
            h = _prefix_hidden(model, data.batch(idx, device), layer).float().to(device)
            if hidden is None:
                hidden = torch.empty(int(offsets[-1]), h.shape[-1], dtype=torch.float32, device=device)
            width = h.shape[1]
            real = data.attention_mask[idx, :width].bool()  # each row's real tokens come first
            rows = (offsets[idx].unsqueeze(1) + torch.arange(width))[real]
            hidden.index_copy_(0, rows.to(device), h[real.to(device)])
    finally:
        model.train(was_training)
    if hidden is None:
        hidden = torch.empty(0, 0, device=device)
    if log is not None:
        log.debug("frozen-prefix cache: layers below %d, built in %.1f s", layer, time.perf_counter() - t0)
    return CachedPrefixSplit(hidden, offsets, data.attention_mask, data.labels, layer,
                             declared_size=getattr(data, "declared_size", None))


def forward_context(model, data):
    """The context a training step's forward runs in: prefix skipped for a cached split."""
    if isinstance(data, CachedPrefixSplit):
        return prefix_skipped(model, data.layer)
    return nullcontext()
