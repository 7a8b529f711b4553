"""The released model: saved so that loading it gives exactly the model the run evaluated.

A run's ``<run>/adapter/`` directory is a PEFT adapter directory that also holds every weight the
base checkpoint lacks. For an encoder checkpoint that is the classifier head, which fedpower
initialises from the run seed and (by default) keeps frozen: it is not an adapter, so PEFT would
not save it, and a plain load would draw a fresh random head. ``save_released`` therefore adds
those tensors to ``adapter_model.safetensors`` and names their modules in ``modules_to_save``;
PEFT then restores them on load. ``base_model_name_or_path`` is the run's ``model.name`` as
configured (``minilm`` for the default), not a path inside one machine's site-packages.

Load it with plain PEFT::

    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification
    from fedpower_app.model import resolve_model_path       # "minilm" -> the pip-installed MiniLM
    base = AutoModelForSequenceClassification.from_pretrained(resolve_model_path("minilm"), num_labels=2)
    model = PeftModel.from_pretrained(base, "outputs/<run>/adapter").eval()

A run with ``train.what = "head"`` (or ``"head-then-adapters"``) classifies the sentence features
(``fedpower_app.training.features.install_feature_forward``, recorded as ``features`` in
``fedpower.json``). A run with ``model.pooling = "mean"`` also needs ``fedpower_app.model.use_mean_pooling(base)`` before
``PeftModel.from_pretrained`` (``fedpower.json`` records the pooling),
or in one call with ``load_released("outputs/<run>/adapter")``, which reads the base model and the
number of labels from ``fedpower.json`` beside the adapter.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .model import resolve_model_path

META_FILE = "fedpower.json"
WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
PEFT_PREFIX = "base_model.model."


def _module_of(key: str) -> str:
    return key.rsplit(".", 1)[0]


def save_released(model, directory: str | Path, *, base_model: str, num_labels: int,
                  **meta) -> Path:
    """Save the adapters and every weight missing from the base checkpoint (see module doc).

    ``model`` is a PEFT model built by ``fedpower_app.model.build_model`` (it records which base
    weights were missing from the checkpoint). ``meta`` goes to ``fedpower.json`` (task, seed...).
    """
    from safetensors.torch import load_file, save_file

    directory = Path(directory)
    from .training.features import feature_spec

    spec = feature_spec(model)
    if spec is not None:  # train.what = head / head-then-adapters: the classifier reads the sentence features
        meta = {**meta, "features": {"pair": spec.pair, "what": spec.what}}
    model.save_pretrained(str(directory))
    missing = sorted(getattr(model, "fedpower_missing_keys", ()))
    weights = load_file(str(directory / WEIGHTS_FILE))
    config = json.loads((directory / CONFIG_FILE).read_text())
    to_save = list(config.get("modules_to_save") or [])
    base_state = model.get_base_model().state_dict()
    for key in missing:
        saved_key = PEFT_PREFIX + key
        if saved_key in weights:  # a trained head: PEFT saved it already
            continue
        if key not in base_state:
            raise RuntimeError(f"cannot save base weight {key!r}: not in the model")
        weights[saved_key] = base_state[key].detach().to("cpu").contiguous().clone()
        if _module_of(key) not in to_save:
            to_save.append(_module_of(key))
    save_file(weights, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    config["modules_to_save"] = to_save or None
    config["base_model_name_or_path"] = base_model
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True))
    (directory / META_FILE).write_text(json.dumps(
        {"base_model": base_model, "num_labels": int(num_labels), "saved_base_weights": missing, **meta},
        indent=2, sort_keys=True))
    return directory


def load_released(directory: str | Path, *, device: str | torch.device = "cpu"):
    """``(model, tokenizer)`` of a saved run, in eval mode: the exact model the run evaluated."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as hf_logging

    directory = Path(directory)
    meta_path = directory / META_FILE
    if not meta_path.exists():
        raise FileNotFoundError(f"{meta_path} not found: not a fedpower adapter directory (outputs/<run>/adapter)")
    meta = json.loads(meta_path.read_text())
    path = resolve_model_path(meta["base_model"])
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the checkpoint lacks the head; the adapter restores it
    try:
        base = AutoModelForSequenceClassification.from_pretrained(path, num_labels=meta["num_labels"],
                                                                  torch_dtype=torch.float32)
    finally:
        hf_logging.set_verbosity(verbosity)
    if meta.get("features"):
        from .training.features import install_feature_forward

        install_feature_forward(base, pair=bool(meta["features"]["pair"]), num_labels=meta["num_labels"],
                                what=str(meta["features"].get("what", "head")))
    elif meta.get("pooling", "pooler") == "mean":
        from .model import use_mean_pooling

        use_mean_pooling(base)
    model = PeftModel.from_pretrained(base, str(directory)).to(device).eval()
    return model, AutoTokenizer.from_pretrained(path)
