"""The run's model on PyTorch's meta device, as ``model.build_model`` sets it up, and one training
step dry-run on it with every tensor allocation and free counted (no weights, no arithmetic)."""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
import weakref
from dataclasses import dataclass
from typing import Optional

from ..config import ConfigError, RunConfig

# ------------------------------------------------------------------------------------------------
# the model on the meta device, as model.build_model sets it up
# ------------------------------------------------------------------------------------------------
def dp_sgd_enabled(cfg: RunConfig) -> bool:
    """DP-SGD runs on the silos (as ``client_app.app.silo_policy`` requires it from the run config)."""
    return cfg["dp.level"] == "sample" and cfg["dp.noise-at"] == "silo"


def num_labels_of(cfg: RunConfig) -> int:
    if cfg["task.name"] == "synthetic":
        return 2
    if cfg["task.name"] == "text":  # declared in the configuration
        from ..data.text_files import parse_labels

        return len(parse_labels(cfg["task.labels"]))
    from ..data.glue_tasks import get_task_spec

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

    from .. import model as M
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

    from ..training.dp_sgd import DPSGDParams, dp_optimizer
    from ..training.frozen_prefix import prefix_skipped
    from ..training.loops import local_optimizer

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
