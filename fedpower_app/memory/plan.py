"""The memory plan of one ClientApp: weights, trainable state, per-example gradients,
activations and the step's peak, from a dry run of the product's training step (``meta``)."""

from __future__ import annotations

import inspect
import math
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from ..config import ConfigError, RunConfig
from .meta import dp_sgd_enabled, dry_run_no_grad, dry_run_step, meta_model, num_labels_of

FLOAT32 = 4
POISSON_TAIL_SIGMAS = 4.0  # a Poisson batch above b + 4·sqrt(b) is a ~3e-5 event per step

# ------------------------------------------------------------------------------------------------
# the plan
# ------------------------------------------------------------------------------------------------
def physical_chunk(cfg: RunConfig) -> tuple[int, int, str]:
    """(examples per forward/backward pass, chunks per step, why): a step's batch in chunks of at
    most ``PHYSICAL_BATCH_SIZE``; a Poisson batch (``dp.level = "sample"``) is taken at its
    b + 4·sqrt(b) tail."""
    from ..training.loops import PHYSICAL_BATCH_SIZE

    b = cfg["train.batch-size"]
    if cfg["dp.level"] == "sample":
        top = int(math.ceil(b + POISSON_TAIL_SIGMAS * math.sqrt(b)))
        what = f"Poisson batches of b = {b}, up to ~{top} at 4 sigma"
    else:
        top = b
        what = f"batches of b = {b}"
    size = cfg["train.physical-batch-size"] or PHYSICAL_BATCH_SIZE  # the GPU's chunk, unless the run sets one
    chunk = min(size, top)
    return chunk, max(1, math.ceil(top / size)), f"{what}, in chunks of <= {size}"


@dataclass
class MemoryPlan:
    model: str
    model_type: str
    layers: int
    hidden: int
    targets: list
    adapted_layers: list
    lowest_adapted_layer: int
    cache_frozen: bool
    method: str
    trains: str
    dp_sgd: bool
    optimizer: str
    chunk: int
    chunks_per_step: int
    chunk_why: str
    tokens: int
    total_params: int
    trainable_params: int
    weights: int  # every parameter and buffer, float32
    trainable_state: int  # gradients, the clipped sum (DP-SGD), optimizer moments (params are in weights)
    per_example_grads: int  # chunk x trainable x 4 (DP-SGD)
    activations: int  # kept for backward by one chunk's forward (float32)
    activations_by_layer: dict
    step_peak: int  # dry-run peak of one step above the weights (activations, grad samples, temporaries)
    no_grad_peak: int  # evaluation / prefix-cache build, above the weights
    no_grad_why: str
    autocast_weight_copies: int  # CUDA only: bf16 copies of frozen weights the backward reads
    cache_bytes_per_row: int  # host RAM per training row of the frozen-prefix cache (upper bound)
    notes: list = field(default_factory=list)

    #: the dry run of a step of one example (run when first needed; not part of the plan's fields)
    _one_example: Optional[Any] = field(default=None, repr=False, compare=False)

    @property
    def step_peak_one_example(self) -> int:
        if callable(self._one_example):
            self._one_example = int(self._one_example())
        return self.step_peak if self._one_example is None else self._one_example

    # -- totals -----------------------------------------------------------------------------------
    def step_peak_at(self, chunk: int) -> float:
        """The step's peak at another chunk size: linear between the dry runs at one example and at
        the plan's chunk (every per-example tensor scales with the chunk; checked in the tests)."""
        if chunk == self.chunk:
            return float(self.step_peak)
        if self.chunk <= 1:
            return float(self.step_peak) * chunk
        one = self.step_peak_one_example
        return one + (self.step_peak - one) / (self.chunk - 1) * (chunk - 1)

    def cpu_bytes(self, chunk: Optional[int] = None) -> float:
        """Tensor memory of one ClientApp on a CPU (float32, no autocast)."""
        step = self.step_peak if chunk is None else self.step_peak_at(chunk)
        return self.weights + max(step, self.no_grad_peak)

    def gpu_tensor_bytes(self, chunk: Optional[int] = None) -> float:
        """Tensor memory on a GPU: the CPU count (float32 activations: an upper bound under bf16
        autocast) plus the bf16 copies of the frozen weights the backward reads."""
        step = self.step_peak if chunk is None else self.step_peak_at(chunk)
        return self.weights + max(step + self.autocast_weight_copies, self.no_grad_peak)

    def gpu_need(self, headroom: float, cuda_context: int, chunk: Optional[int] = None) -> float:
        return self.gpu_tensor_bytes(chunk) * (1.0 + headroom) + cuda_context


def plan_memory(cfg: RunConfig, *, chunk: Optional[int] = None, chunks: Optional[int] = None,
                tokens: Optional[int] = None) -> MemoryPlan:
    """The memory plan of one ClientApp of ``cfg``. ``chunk``/``chunks``/``tokens`` override the
    physical chunk size, the chunks per step and the padded width (default: from the config)."""
    from ..training.frozen_prefix import build_prefix_cache, lowest_adapted_layer
    from strategies.mechanisms import METHODS

    model, config = meta_model(cfg, num_labels_of(cfg))
    auto_chunk, auto_chunks, why = physical_chunk(cfg)
    if chunk is not None:
        why = f"chunk of {chunk} (given)"
    chunk = auto_chunk if chunk is None else int(chunk)
    chunks = auto_chunks if chunks is None else int(chunks)
    tokens = cfg["task.max-length"] if tokens is None else int(tokens)
    if chunk < 1 or chunks < 1 or tokens < 1:
        raise ValueError("chunk, chunks and tokens must be >= 1")
    limit = int(getattr(config, "max_position_embeddings", 0) or 0)
    notes = []
    if limit and tokens > limit:
        notes.append(f"task.max-length = {tokens} exceeds the model's {limit} positions: the run would fail")
    named = [(n, p) for n, p in model.named_parameters()]
    trainable = sum(p.numel() for _, p in named if p.requires_grad)
    if trainable == 0:
        raise ConfigError("nothing trains: no LoRA module and no head (check model.target-modules and lora.top-layers)")
    weights = sum(p.numel() * p.element_size() for _, p in named) + sum(b.numel() * b.element_size()
                                                                         for b in model.buffers())
    try:
        lowest = lowest_adapted_layer(model)
    except ValueError:
        lowest = 0
    cached = lowest if cfg["train.cache-frozen"] else None
    if cfg["train.cache-frozen"] and lowest == 0:
        notes.append("train.cache-frozen with adapters on layer 0: nothing below to cache")
        cached = None
    dp = dp_sgd_enabled(cfg)
    moments = 2 if cfg["train.optimizer"] == "adam" else 0
    state = trainable * FLOAT32 * (1 + (1 if dp else 0) + moments)
    per_example = chunk * trainable * FLOAT32 if dp else 0
    # Two chunks show everything a step holds (the second adds to the clipped sum the first left);
    # more chunks repeat the second.
    step = dry_run_step(model, config, cfg, chunk=chunk, tokens=tokens, chunks=min(chunks, 2), cached_layer=cached)

    def one_example() -> int:
        return dry_run_step(model, config, cfg, chunk=1, tokens=tokens, chunks=1, cached_layer=cached).peak

    # Passes without gradients: evaluation, and the cache's build (the layers below the lowest adapted
    # one, counted here as a whole forward: an upper bound). One dry run at the larger batch.
    no_grad_batch, no_grad_why = cfg["eval.batch-size"], f"evaluation at eval.batch-size = {cfg['eval.batch-size']}"
    if cached is not None:
        cache_batch = inspect.signature(build_prefix_cache).parameters["batch_size"].default
        if cache_batch > no_grad_batch:
            no_grad_batch, no_grad_why = cache_batch, f"the frozen-prefix cache's build in batches of {cache_batch}"
    no_grad = dry_run_no_grad(model, config, batch=no_grad_batch, tokens=tokens)
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    adapted = sorted({int(m.group(1)) for n, _ in named if "lora_" in n
                      for m in [re.search(r"\.(\d+)\.", n)] if m})
    return MemoryPlan(
        model=cfg["model.name"], model_type=str(config.model_type), layers=layers,
        hidden=int(getattr(config, "hidden_size", 0) or 0), targets=list(model.fedpower_targets),
        adapted_layers=adapted, lowest_adapted_layer=lowest, cache_frozen=cached is not None,
        method=cfg["strategy.name"], trains=METHODS[cfg["strategy.name"]].trains, dp_sgd=dp,
        optimizer=cfg["train.optimizer"], chunk=chunk, chunks_per_step=chunks, chunk_why=why, tokens=tokens,
        total_params=sum(p.numel() for _, p in named), trainable_params=trainable, weights=weights,
        trainable_state=state, per_example_grads=per_example, activations=step.saved,
        activations_by_layer={int(k): int(v) for k, v in sorted(step.saved_by_layer.items())},
        step_peak=step.peak, no_grad_peak=no_grad, no_grad_why=no_grad_why,
        autocast_weight_copies=2 * step.saved_weights,
        cache_bytes_per_row=tokens * int(getattr(config, "hidden_size", 0) or 0) * FLOAT32 if cached is not None else 0,
        notes=notes, _one_example=None if chunk == 1 else one_example)
