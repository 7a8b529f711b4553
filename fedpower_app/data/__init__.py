"""The data layer: GLUE and the generated task, split across silos, tokenised once.

* ``pipeline``: pick a task's source, split it across silos (IID or label-skewed), tokenise once
  and cache on disk (``load_task``, ``client_shard``, ``eval_splits``, ``TokenizedSplit``, ...);
* ``glue``: SST-2, QNLI, MNLI and QQP from local files or the Hugging Face hub (the loaders; the
  task specs are in ``glue_tasks``, the file readers in ``glue_files``);
* ``text_files``: any text-classification table (``task.name = "text"``): CSV, TSV, JSON Lines or
  Parquet, with configured columns and declared labels; ``text_hub``: the same from a Hugging Face
  dataset through flwr-datasets, and silos cut by its partitioners;
* ``synthetic``: the generated offline task;
* ``silo``: a deployed silo's own directory (node config ``data-dir``), read with one-line errors;
* ``types``: ``TextExamples`` and ``TaskData``.

``from fedpower_app import data as D; D.client_shard(...)`` reaches the pipeline's names. They are
loaded on first use, so that importing ``fedpower_app.data.glue`` does not import torch.
"""

from __future__ import annotations

from ..lazy import forward_to

__getattr__ = forward_to(__name__, "pipeline", ("pipeline", "glue", "glue_tasks", "glue_files", "synthetic", "silo", "types",
                                                          "text_files", "text_hub"))

