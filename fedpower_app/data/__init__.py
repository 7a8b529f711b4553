"""The data layer: GLUE and the generated task, split across silos, tokenised once.

* ``pipeline``: pick a task's source, split it across silos (IID or label-skewed), tokenise once
  and cache on disk (``load_task``, ``client_shard``, ``eval_splits``, ``TokenizedSplit``, ...);
* ``glue``: SST-2, QNLI, MNLI and QQP from local files or the Hugging Face hub;
* ``synthetic``: the generated offline task;
* ``types``: ``TextExamples`` and ``TaskData``.

``from fedpower_app import data as D; D.client_shard(...)`` reaches the pipeline's names. They are
loaded on first use, so that importing ``fedpower_app.data.glue`` does not import torch.
"""

from __future__ import annotations


import importlib

_SUBMODULES = ("pipeline", "glue", "synthetic", "types")


def __getattr__(name: str):
    if name in _SUBMODULES:  # a submodule not imported yet (the import machinery asks for it too)
        return importlib.import_module(f"{__name__}.{name}")
    pipeline = importlib.import_module(f"{__name__}.pipeline")
    try:
        return getattr(pipeline, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> list[str]:
    pipeline = importlib.import_module(f"{__name__}.pipeline")
    return sorted(set(globals()) | {n for n in dir(pipeline) if not n.startswith("__")})
