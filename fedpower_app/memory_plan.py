"""``fedpower-memory``: the memory one ClientApp needs for a run configuration, without training.

It reads the SAME configuration as ``fedpower-run`` (pyproject.toml defaults, ``--preset``,
``--set key=value``, the method's tuned settings) and prints, for one silo's training step:

* the weights (the whole model stays on the device, float32 as ``model.build_model`` loads it);
* the trainable state: LoRA A and B (only B for FFA-LoRA and FedSVD) and the head if it trains,
  their gradients, the clipped sum DP-SGD keeps across a batch's chunks, Adam's two moments;
* DP-SGD's per-example gradients: Opacus keeps a ``grad_sample`` of every trainable tensor for
  every example of a physical chunk, chunk x trainable parameters x 4 bytes;
* the activations a chunk's forward keeps for its backward, through the layers that need
  gradients (from the lowest adapted layer up: the frozen layers below keep none, and with
  ``train.cache-frozen`` they do not even run; their cached output lives in host RAM);
* the peak of one step, and the Ray ``num-gpus`` fraction that fits a GPU of ``--gpu-memory``.

How: the model is built from its config on PyTorch's ``meta`` device (shapes, no weights, nothing
downloaded: ``model.name`` must resolve to a local directory, the pip-installed MiniLM, or a hub
copy already in the local cache) with the LoRA setup of ``model.build_model``, and one training
step of the product's code path (Opacus ``GradSampleModule``, the DP optimizer, Adam; the
prefix-skipped forward with the cache) runs on meta tensors while every tensor allocation and free
is counted. The peak of that dry run is the step's memory as allocated, with every temporary of
autograd and Opacus, and no arithmetic. ``tests/test_memory_plan.py`` checks it against the peak
RSS of a real CPU step (``dp_sgd_train_local``) of the same configuration at a small size.

What it cannot see (stated in the output): on CUDA the run uses bf16 autocast, which keeps most
activations in 2 bytes instead of 4 (the float32 count is an upper bound) but keeps a bf16 copy of
each frozen weight that the backward needs (added, 2 bytes each); the CUDA context of each
process (``--cuda-context``); the caching allocator's slack (``--headroom``).

Exit codes: 0 fits (or no GPU asked), 1 does not fit at the run's chunk size (the largest chunk
that would is printed), 2 invalid input (one line on stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import logging
import math
import os
import re
import sys
import tomllib
import warnings
import weakref
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

from .config import ConfigError, RunConfig, load_preset, parse_config, with_method_preset

GIB = 2 ** 30
MIB = 2 ** 20
FLOAT32 = 4
DEFAULT_HEADROOM = 0.20  # the caching allocator's reserved-but-unallocated slack and fragmentation
DEFAULT_CUDA_CONTEXT = 512 * MIB  # CUDA context, cuBLAS/cuDNN handles of one process (lazy module loading)
POISSON_TAIL_SIGMAS = 4.0  # a Poisson batch above b + 4·sqrt(b) is a ~3e-5 event per step

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b?|b)?\s*$", re.I)
_UNITS = {"": GIB, "b": 1, "k": 1000, "kb": 1000, "kib": 2 ** 10, "m": 10 ** 6, "mb": 10 ** 6, "mib": MIB,
          "g": 10 ** 9, "gb": 10 ** 9, "gib": GIB, "t": 10 ** 12, "tb": 10 ** 12, "tib": 2 ** 40,
          "ki": 2 ** 10, "mi": MIB, "gi": GIB, "ti": 2 ** 40}


def parse_size(text: str, *, allow_zero: bool = False) -> int:
    """``"24GiB"``, ``"16 GB"``, ``"512MiB"``, ``"24"`` (GiB) -> bytes."""
    m = _SIZE.match(str(text))
    if not m or (m.group(2) or "").lower() not in _UNITS:
        raise ValueError(f"not a memory size: {text!r} (use e.g. 24GiB, 16GB, 512MiB; a bare number is GiB)")
    value = float(m.group(1)) * _UNITS[(m.group(2) or "").lower()]
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"a memory size must be > 0, got {text!r}")
    return int(value)


def fmt(n: float) -> str:
    """Bytes in binary units (KiB, MiB, GiB)."""
    n = float(n)
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", 2 ** 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}" if unit == "GiB" else f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


# ------------------------------------------------------------------------------------------------
# the model on the meta device, as model.build_model sets it up
# ------------------------------------------------------------------------------------------------
def num_labels_of(cfg: RunConfig) -> int:
    if cfg["task.name"] == "synthetic":
        return 2
    if cfg["task.name"] == "text":  # declared in the configuration
        from .data.text_files import parse_labels

        return len(parse_labels(cfg["task.labels"]))
    from .data.glue_tasks import get_task_spec

    return get_task_spec(cfg["task.name"]).num_labels


@contextlib.contextmanager
def _quiet():
    """Silence transformers' and PEFT's warnings while the meta model is built and run."""
    hf = logging.getLogger("transformers")
    level = hf.level
    hf.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf.setLevel(level)


def meta_model(cfg: RunConfig, num_labels: int):
    """The run's PEFT model with shapes only (``meta`` device): ``model.build_model``'s LoRA setup
    (targets, ``lora.top-layers``, the trained head, mean pooling), float32, and the trainable set
    of the run's method (A and B, or only B). Returns (model, HF config)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from . import model as M
    from strategies.mechanisms import METHODS

    name = cfg["model.name"]
    try:
        path = M.resolve_model_path(name)
        config = AutoConfig.from_pretrained(path, local_files_only=True, num_labels=num_labels)
    except (OSError, ValueError, RuntimeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"config key 'model.name' ({name!r}): no local model config found ({first}); use a local "
                          "model directory, 'minilm', or a hub id already in the local cache") from None
    with _quiet():
        try:
            targets = M.target_modules_for(config.model_type, cfg.target_modules)
        except ValueError as exc:
            raise ConfigError(f"config key 'model.target-modules': {exc}") from None
        with torch.device("meta"):
            base = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
        base = base.float()
        if cfg["model.pooling"] == "mean":
            try:
                M.use_mean_pooling(base)
            except ValueError as exc:
                raise ConfigError(f"config key 'model.pooling': {exc}") from None
        M.apply_dropout(base, cfg)  # as build_model: a dropout at rate 0 keeps no mask
        top = cfg["lora.top-layers"]
        depth = int(getattr(base.config, "num_hidden_layers", 0) or 0)
        if top and not 0 < top <= depth:
            raise ConfigError(f"config key 'lora.top-layers' = {top} but {name!r} has {depth} layers")
        head = M.HEAD_MODULES.get(config.model_type, ["classifier"]) if cfg["model.train-head"] else None
        lora = LoraConfig(layers_to_transform=list(range(depth - top, depth)) if top else None,
                          r=cfg["lora.rank"], lora_alpha=cfg["lora.alpha"], lora_dropout=cfg["lora.dropout"],
                          target_modules=targets, modules_to_save=head, bias="none")
        try:
            model = get_peft_model(base, lora)
        except ValueError as exc:  # PEFT: targets not in the model
            raise ConfigError(f"config key 'model.target-modules' ({','.join(targets)!r}): {exc}") from None
    M.set_trainable(model, train_a="A" in METHODS[cfg["strategy.name"]].trains, train_b=True)
    model.fedpower_targets = list(targets)
    return model, config


# ------------------------------------------------------------------------------------------------
# the dry run: one training step on meta tensors, every allocation counted
# ------------------------------------------------------------------------------------------------
def _storage_key(t):
    return t.untyped_storage()


def _storage_id(t) -> int:
    """The address of a tensor's storage (its StorageImpl): equal for views, unique while alive."""
    return int(t.untyped_storage()._cdata)


class _LiveBytes:
    """A dispatch mode counting the bytes of live tensor storages (as an allocator would): every op
    output's storage is counted once, until it is freed. Storages that exist before (the weights)
    are not counted."""

    def __init__(self, existing=()):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils.weak import WeakIdKeyDictionary

        tracker = self
        self.now = 0
        self.peak = 0
        self._seen = WeakIdKeyDictionary()
        self._refs = []
        for t in existing:
            self._seen[_storage_key(t)] = 0

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                import torch.utils._pytree as pytree

                for t in pytree.tree_leaves(out):
                    if hasattr(t, "untyped_storage"):
                        tracker._add(t)
                return out

        self.mode = Mode()

    def _add(self, t) -> None:
        try:
            st = _storage_key(t)
        except (RuntimeError, NotImplementedError):
            return
        if st in self._seen:
            return
        n = int(st.nbytes())
        self._seen[st] = n
        self.now += n
        self.peak = max(self.peak, self.now)

        def freed(_ref, n=n):
            self.now -= n

        self._refs.append(weakref.ref(st, freed))

    def reset_peak(self) -> None:
        self.peak = self.now


def _bool_mask(n: int, tokens: int, device):
    import torch

    # A 4-D mask is used as given by transformers (its padding check reads values, which a meta tensor
    # has none of); a real chunk with padding builds one of this shape.
    return torch.ones(n, 1, tokens, tokens, dtype=torch.bool, device=device)


def _chunk_inputs(model, config, n: int, tokens: int, cached_layer: Optional[int]):
    import torch

    meta = torch.device("meta")
    labels = (torch.zeros(n, dtype=torch.float32, device=meta) if config.num_labels == 1
              else torch.zeros(n, dtype=torch.long, device=meta))
    batch = {"attention_mask": _bool_mask(n, tokens, meta), "labels": labels}
    if cached_layer is None:
        batch["input_ids"] = torch.zeros(n, tokens, dtype=torch.long, device=meta)
    else:  # the cached split's chunk: the hidden states at the lowest adapted layer (float32)
        batch["inputs_embeds"] = torch.zeros(n, tokens, int(config.hidden_size), dtype=torch.float32, device=meta)
    return batch


@dataclass
class StepTrace:
    peak: int  # bytes allocated at the step's peak, above the weights
    saved: int  # activations kept for backward (unique storages, weights excluded)
    saved_by_layer: dict  # encoder layer index -> saved bytes (-1: outside the layers)
    saved_weights: int  # frozen weights the backward reads (elements): bf16 copies under CUDA autocast


def dry_run_step(model, config, cfg: RunConfig, *, chunk: int, tokens: int, chunks: int = 1,
                 cached_layer: Optional[int] = None) -> StepTrace:
    """One local step of ``chunks`` physical chunks of ``chunk`` x ``tokens`` on the meta model, as
    ``dp_sgd_train_local`` runs it (DP-SGD) or ``train_local`` (plain), counting allocations."""
    import torch

    from .training.dp_sgd import DPSGDParams, dp_optimizer
    from .training.frozen_prefix import prefix_skipped
    from .training.loops import local_optimizer

    dp = dp_sgd_enabled(cfg)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    trainable = [p for _, p in named]
    weights = list(model.parameters()) + list(model.buffers())
    param_storages = {_storage_id(p): p for p in weights}
    tracker = _LiveBytes(existing=weights)
    saved: dict = {}
    layer_now = [-1]
    hooks = []
    layer_re = re.compile(r"(?:^|\.)layers?\.(\d+)$")
    for mname, module in model.named_modules():
        m = layer_re.search(mname)
        if m:
            idx = int(m.group(1))
            hooks.append(module.register_forward_pre_hook(lambda mod, args, idx=idx: layer_now.__setitem__(0, idx)))
            hooks.append(module.register_forward_hook(lambda mod, args, out: layer_now.__setitem__(0, -1)))

    def pack(t):
        # Saved tensors stay alive until the backward, so their storage addresses are unique here.
        key = _storage_id(t)
        if key in param_storages:
            p = param_storages[key]
            if not p.requires_grad:
                saved.setdefault(("w", key), (int(p.numel()), -2))
        elif ("a", key) not in saved:
            saved[("a", key)] = (int(t.untyped_storage().nbytes()), layer_now[0])
        return t

    base_opt = local_optimizer(trainable, lr=1e-3, kind=cfg["train.optimizer"], adam_eps=cfg["train.adam-eps"])
    ctx = prefix_skipped(model, cached_layer) if cached_layer is not None else contextlib.nullcontext()
    with _quiet(), ctx:
        if dp:
            from opacus import GradSampleModule

            # as fedpower_app.training.dp_sgd.grad_sample_module and dp_sgd_train_local build them
            net = GradSampleModule(model, batch_first=True, loss_reduction="mean", strict=True)
            head_clip = cfg["dp.head-clip"]
            opt = dp_optimizer(base_opt, named, DPSGDParams(1.0, cfg["dp.clip"], chunk * chunks, 1, head_clip=head_clip,
                                                            head_noise_ratio=cfg["dp.head-noise-ratio"] if head_clip else 0.0))
        else:
            net, opt = model, base_opt
        net.train()
        try:
            with tracker.mode:
                opt.zero_grad(set_to_none=True)
                for i in range(chunks):
                    batch = _chunk_inputs(model, config, chunk, tokens, cached_layer)
                    if i == 0:
                        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                            out = net(**batch)
                    else:
                        out = net(**batch)
                    loss = out.loss.float()
                    del out
                    (loss if dp else loss * (1.0 / chunks)).backward()
                    del loss, batch
                    if dp and i < chunks - 1:
                        opt.signal_skip_step(do_skip=True)
                        opt.step()
                        opt.zero_grad(set_to_none=True)
                opt.step()
                opt.zero_grad(set_to_none=True)
        except Exception as exc:  # the model's forward needs values a meta tensor has not
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ConfigError(f"config key 'model.name' ({cfg['model.name']!r}): the dry run on the meta device "
                              f"failed ({type(exc).__name__}: {first})") from None
        finally:
            for h in hooks:
                h.remove()
            if dp:
                net._close()
    by_layer: dict = {}
    total = 0
    frozen_read = 0
    for key, value in saved.items():
        if key[0] == "w":
            frozen_read += value[0]
            continue
        nbytes, layer = value[0], value[1]
        total += nbytes
        by_layer[layer] = by_layer.get(layer, 0) + nbytes
    return StepTrace(peak=tracker.peak, saved=total, saved_by_layer=by_layer, saved_weights=frozen_read)


def dry_run_no_grad(model, config, *, batch: int, tokens: int, layers: Optional[int] = None) -> int:
    """Peak allocation of a forward without gradients (evaluation; the frozen-prefix cache's build
    runs the layers below ``layers``), above the weights."""
    import torch

    weights = list(model.parameters()) + list(model.buffers())
    tracker = _LiveBytes(existing=weights)
    was = model.training
    model.eval()
    try:
        with _quiet(), torch.no_grad(), tracker.mode:
            inputs = _chunk_inputs(model, config, batch, tokens, None)
            inputs.pop("labels")
            _ = model(**inputs)
            del _
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"config key 'model.name' ({config.model_type!r} model): the dry run on the meta device "
                          f"failed ({type(exc).__name__}: {first})") from None
    finally:
        model.train(was)
    return tracker.peak


# ------------------------------------------------------------------------------------------------
# the plan
# ------------------------------------------------------------------------------------------------
def dp_sgd_enabled(cfg: RunConfig) -> bool:
    """DP-SGD runs on the silos (as ``client_app.app.silo_policy`` requires it from the run config)."""
    return cfg["dp.level"] == "sample" and cfg["dp.noise-at"] == "silo"


def physical_chunk(cfg: RunConfig) -> tuple[int, int, str]:
    """(examples per forward/backward pass, chunks per step, why): a step's batch in chunks of at
    most ``PHYSICAL_BATCH_SIZE``; a Poisson batch (``dp.level = "sample"``) is taken at its
    b + 4·sqrt(b) tail."""
    from .training.loops import PHYSICAL_BATCH_SIZE

    b = cfg["train.batch-size"]
    if cfg["dp.level"] == "sample":
        top = int(math.ceil(b + POISSON_TAIL_SIGMAS * math.sqrt(b)))
        what = f"Poisson batches of b = {b}, up to ~{top} at 4 sigma"
    else:
        top = b
        what = f"batches of b = {b}"
    chunk = min(PHYSICAL_BATCH_SIZE, top)
    return chunk, max(1, math.ceil(top / PHYSICAL_BATCH_SIZE)), f"{what}, in chunks of <= {PHYSICAL_BATCH_SIZE}"


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
    from .training.frozen_prefix import build_prefix_cache, lowest_adapted_layer
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


# ------------------------------------------------------------------------------------------------
# fitting a GPU: the Ray num-gpus fraction
# ------------------------------------------------------------------------------------------------
def gpu_fit(plan: MemoryPlan, gpu_memory: int, *, headroom: float = DEFAULT_HEADROOM,
            cuda_context: int = DEFAULT_CUDA_CONTEXT) -> dict[str, Any]:
    """How many ClientApps of ``plan`` fit a GPU of ``gpu_memory`` bytes, and the ``num-gpus``
    fraction that makes Ray place that many: 1/k, truncated to Ray's 4 decimals so that k of them
    still sum to <= 1. Raises ValueError when not even one example fits."""
    need = plan.gpu_need(headroom, cuda_context)
    one = need if need <= gpu_memory else plan.gpu_need(headroom, cuda_context, chunk=1)
    if one > gpu_memory:
        raise ValueError(f"a GPU of {fmt(gpu_memory)} is too small for even one example: a ClientApp of "
                         f"{plan.model!r} needs {fmt(one)} at a chunk of 1 example x {plan.tokens} tokens "
                         f"(weights {fmt(plan.weights)}, CUDA context {fmt(cuda_context)}, "
                         f"{headroom:.0%} headroom)")
    per_gpu = int(gpu_memory // need)
    out: dict[str, Any] = {"gpu_memory": gpu_memory, "need": need, "headroom": headroom,
                           "cuda_context": cuda_context, "fits": per_gpu >= 1}
    if per_gpu >= 1:
        fraction = math.floor(10000 / per_gpu) / 10000
        out.update(per_gpu=per_gpu, num_gpus=fraction, used=per_gpu * need)
    else:
        largest = 1
        while largest < plan.chunk and plan.gpu_need(headroom, cuda_context, chunk=largest + 1) <= gpu_memory:
            largest += 1
        out.update(per_gpu=0, num_gpus=None, largest_chunk=largest)
    return out


# ------------------------------------------------------------------------------------------------
# the command line
# ------------------------------------------------------------------------------------------------
#: Shortcut flags (argparse dest) -> the run-config key they set.
FLAG_KEYS = {"model": "model.name", "rank": "lora.rank", "batch_size": "train.batch-size"}


class _ArgError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise _ArgError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="fedpower-memory",
                description="The memory one ClientApp needs for a run configuration (weights, LoRA state, "
                            "DP-SGD's per-example gradients, activations) and the Ray num-gpus fraction that "
                            "fits a GPU. Trains nothing. Same configuration as fedpower-run.")
    run = p.add_argument_group("run configuration (as fedpower-run)")
    run.add_argument("--preset", help="a conf/*.toml preset")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override a run-config key (TOML value), repeatable")
    run.add_argument("--model", default=None, help="model.name (a local directory, 'minilm', or a cached hub id)")
    run.add_argument("--rank", default=None, help="lora.rank")
    run.add_argument("--batch-size", dest="batch_size", default=None, help="train.batch-size")
    gpu = p.add_argument_group("GPU")
    gpu.add_argument("--gpu-memory", action="append", default=[], metavar="SIZE",
                     help="memory of one GPU, e.g. 24GiB or 16GB (a bare number is GiB); repeatable")
    gpu.add_argument("--headroom", type=float, default=DEFAULT_HEADROOM,
                     help=f"fraction added to the tensor memory for the caching allocator (default {DEFAULT_HEADROOM})")
    gpu.add_argument("--cuda-context", default="512MiB", metavar="SIZE",
                     help="per-process CUDA context and library handles (default 512MiB; 0 to leave out)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def load_config(args) -> RunConfig:
    """defaults < preset < the method's settings < --set < shortcut flags, as fedpower-run."""
    from .launcher import parse_set

    overrides: dict[str, Any] = {}
    explicit: set = set()
    if args.preset:
        try:
            overrides.update(load_preset(args.preset))
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read preset {args.preset!r}: {exc}") from None
    sets = parse_set(args.set)
    overrides.update(sets)
    explicit |= set(sets)
    for dest, key in FLAG_KEYS.items():
        raw = getattr(args, dest)
        if raw is None:
            continue
        value = raw if dest == "model" else parse_set([f"{key}={raw}"])[key]
        if key in sets and sets[key] != value:
            raise ConfigError(f"config key {key!r} is set twice, by --set ({sets[key]!r}) and by "
                              f"--{dest.replace('_', '-')} ({value!r})")
        overrides[key] = value
        explicit.add(key)
    overrides, _applied, _source = with_method_preset(overrides, explicit=explicit)
    return parse_config(overrides)


def _layers(ix: list) -> str:
    if not ix:
        return "none"
    if ix == list(range(ix[0], ix[-1] + 1)) and len(ix) > 1:
        return f"{ix[0]}-{ix[-1]}"
    return ",".join(map(str, ix))


def render(plan: MemoryPlan, fits: list, *, source: str = "") -> str:
    P = plan.trainable_params
    what = {"AB": "LoRA A and B", "B": "LoRA B only (A frozen)"}[plan.trains]
    L = [f"fedpower-memory: one ClientApp{(' of ' + source) if source else ''} "
         f"({plan.method}, {'DP-SGD on the silo' if plan.dp_sgd else 'no per-example gradients (not DP-SGD)'})",
         f"model       {plan.model} ({plan.model_type}): {plan.layers} layers, hidden {plan.hidden}, "
         f"{plan.total_params / 1e6:.1f} M parameters",
         f"adapters    {what} on {','.join(plan.targets)} of layers {_layers(plan.adapted_layers)}; "
         f"{P:,} trainable parameters",
         f"chunk       {plan.chunk} examples x {plan.tokens} tokens per forward/backward ({plan.chunk_why}; "
         f"padded to the longest row, at most task.max-length)"]
    below = plan.lowest_adapted_layer
    if plan.cache_frozen:
        path = (f"layers {below}-{plan.layers - 1} backpropagated; layers 0-{below - 1} and the embeddings "
                f"cached once per silo (train.cache-frozen), host RAM <= {fmt(plan.cache_bytes_per_row)} per "
                f"training row")
    elif below > 0:
        path = (f"layers {below}-{plan.layers - 1} backpropagated; layers 0-{below - 1} run every step but keep "
                f"nothing for backward (train.cache-frozen would skip them)")
    else:
        path = "every layer backpropagated"
    L.append(f"backward    {path}")
    L.append("")
    rows = [("weights (float32, all of the model)", plan.weights, f"{plan.total_params:,} x 4 B"),
            ("trainable state", plan.trainable_state,
             f"grads{' + clipped sum' if plan.dp_sgd else ''}{' + Adam moments' if plan.optimizer == 'adam' else ''}: "
             f"{plan.trainable_state // (P * FLOAT32)} x {P:,} x 4 B")]
    if plan.dp_sgd:
        rows.append(("per-example gradients (Opacus)", plan.per_example_grads, f"{plan.chunk} x {P:,} x 4 B"))
    layer_bytes = [v for k, v in plan.activations_by_layer.items() if k >= 0]
    per_layer = f"{fmt(max(layer_bytes))} per adapted layer" if layer_bytes else ""
    rows.append(("activations kept for backward", plan.activations, per_layer))
    rows.append(("step peak above the weights", plan.step_peak,
                 "dry run: activations + per-example grads + temporaries, as allocated"))
    rows.append(("no-gradient passes peak", plan.no_grad_peak, plan.no_grad_why))
    w = max(len(r[0]) for r in rows)
    for label, n, how in rows:
        L.append(f"  {label:<{w}}  {fmt(n):>11}   {how}")
    L.append("")
    L.append(f"CPU ClientApp (float32): {fmt(plan.cpu_bytes())} of tensors")
    L.append(f"GPU ClientApp: {fmt(plan.gpu_tensor_bytes())} of tensors (with {fmt(plan.autocast_weight_copies)} of bf16 "
             f"copies of the frozen weights the backward reads under autocast; activations counted in float32: "
             f"an upper bound under bf16 autocast)")
    for fit in fits:
        G = fit["gpu_memory"]
        head = (f"GPU {fmt(G)}: each ClientApp needs {fmt(fit['need'])} "
                f"({fmt(plan.gpu_tensor_bytes())} x {1 + fit['headroom']:.2f} headroom + {fmt(fit['cuda_context'])} "
                f"CUDA context)")
        L.append(head)
        if fit["fits"]:
            L.append(f"  -> num-gpus = {fit['num_gpus']:g}: {fit['per_gpu']} ClientApp(s) per GPU, "
                     f"{fmt(fit['used'])} of {fmt(G)} "
                     f"(fedpower-run --gpus-per-client {fit['num_gpus']:g}; Flower federation key "
                     f"client-resources-num-gpus)")
        else:
            L.append(f"  -> DOES NOT FIT at chunks of {plan.chunk}; chunks of at most {fit['largest_chunk']} examples "
                     f"would (PHYSICAL_BATCH_SIZE in fedpower_app/training/loops.py), or lower task.max-length")
    for note in plan.notes:
        L.append(f"note: {note}")
    return "\n".join(L)


def main(argv: Optional[Sequence[str]] = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never download: shapes come from a local config
    parser = build_parser()
    try:
        args = parser.parse_args(list(argv) if argv is not None else None)
    except _ArgError as e:
        print(f"fedpower-memory: error: {e} (see fedpower-memory --help)", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return int(e.code or 0)
    try:
        if not 0 <= args.headroom < 10:
            raise ValueError(f"--headroom must be in [0, 10), got {args.headroom}")
        gpus = [parse_size(g) for g in args.gpu_memory]
        context = parse_size(args.cuda_context, allow_zero=True)
        cfg = load_config(args)
        import torch

        torch.set_num_threads(1)
        plan = plan_memory(cfg)
        fits = [gpu_fit(plan, g, headroom=args.headroom, cuda_context=context) for g in gpus]
    except ValueError as e:  # ConfigError is a ValueError
        print(f"fedpower-memory: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    if args.json:
        out = {k: v for k, v in asdict(plan).items() if not k.startswith("_")}
        out.update(cpu_bytes=plan.cpu_bytes(), gpu_tensor_bytes=plan.gpu_tensor_bytes(), gpus=fits)
        print(json.dumps(out))
    else:
        print(render(plan, fits, source=args.preset or ""))
    return 0 if all(f["fits"] for f in fits) else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
