"""GLUE data layer: SST-2, QNLI, MNLI and QQP from local files or the Hugging Face hub.

Every loader returns a :class:`~fedpower_app.data.types.TaskData` whose integer labels follow the
Hugging Face ``nyu-mll/glue`` convention exactly:

==========  ==========================================  ===============================
task        labels                                      eval splits (first = primary)
==========  ==========================================  ===============================
``sst2``    0 negative, 1 positive                      ``validation``
``qnli``    0 entailment, 1 not_entailment              ``validation``
``mnli``    0 entailment, 1 neutral, 2 contradiction    ``validation_matched``,
                                                        ``validation_mismatched``
``qqp``     0 not_duplicate, 1 duplicate                ``validation``
==========  ==========================================  ===============================

Local data (:func:`load_glue_local`)
------------------------------------
``data_dir`` is either the task folder itself (e.g. ``.../glue/SST-2``) or a parent containing
it. Task folders are matched ignoring case, ``-`` and ``_`` (``SST-2``, ``sst2``, ``QNLI``, ``MNLI``,
``QQP`` ...). Inside the task folder each split is looked up under these names (case-insensitive,
first match wins, TSV first):

* train: ``train.tsv``, ``train.parquet``, ``train-*.parquet`` (shards, concatenated in name
  order), ``train.csv``
* validation (sst2/qnli/qqp): ``dev.tsv``, ``validation.tsv``, ``validation.parquet``,
  ``validation-*.parquet``, ``validation.csv``, ``dev.parquet``, ``dev.csv``
* validation_matched / validation_mismatched (mnli): ``dev_matched.tsv`` /
  ``dev_mismatched.tsv``, then ``validation_matched.*`` / ``validation_mismatched.*`` as above.

Columns are resolved by name (case-insensitive), never by position, so every layout GLUE ships
loads: the official TSVs (SST-2 ``sentence label``; QNLI ``index question sentence label``; MNLI
with 12 columns in train and ``label1..label5 gold_label`` in dev; QQP ``id qid1 qid2 question1
question2 is_duplicate``), reduced TSVs (``sentence1 sentence2 gold_label``, ``gold_label
sentence1 sentence2``, ``question1 question2 is_duplicate``) and Hugging Face exports (parquet or
CSV with the ``nyu-mll/glue`` column names, e.g. ``premise hypothesis label``).

TSV files are read with quoting disabled (GLUE text contains stray ``"`` characters) by splitting
each line on tabs; text is kept verbatim (SST-2's trailing spaces included, as on the hub). A row
whose field count does not match the header is dropped with a logged warning when it cannot be
read unambiguously (too few fields to reach a required column, or extra non-empty fields);
trailing empty fields are tolerated.

Labels may be integers (``0``/``1``/``2``) or label names (``entailment``, ``not_entailment``,
``neutral``, ``contradiction``, ``negative``/``positive``, ``not_duplicate``/``duplicate``, any
case). An unknown label raises :class:`ValueError` naming the file, line and value.
MNLI rows whose gold label is empty or ``-`` (annotators did not agree; the official dev files
have a few hundred, the hub drops them too, hence 9,815 / 9,832 dev rows) are dropped. For the
other tasks a missing label is an error.

``max_train`` / ``max_eval`` keep a seeded random subset (original order preserved) of the train
split / of each eval split, for CPU-sized runs.
"""

from __future__ import annotations

import logging
import zlib
from pathlib import Path
from typing import Any

from .types import TaskData, TextExamples

__all__ = [
    "GLUE_TASKS",
    "GlueTaskSpec",
    "HUB_DATASET",
    "get_task_spec",
    "iid_partition_indices",
    "load_glue",
    "load_glue_hub",
    "load_glue_local",
    "normalise_task_name",
    "read_split_file",
    "subsample_examples",
]

log = logging.getLogger(__name__)

# The task specs (glue_tasks) and the file readers (glue_files), re-exported: ``glue`` is the front door.
from .glue_tasks import GLUE_TASKS, HUB_DATASET, GlueTaskSpec, get_task_spec, normalise_task_name  # noqa: F401
from .glue_files import _find_task_dir, _finish, _resolve_columns, _split_paths, read_split_file  # noqa: F401
# --------------------------------------------------------------------------------------------
# subsampling and partitioning
# --------------------------------------------------------------------------------------------


def _check_max(name: str, value: int | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer or None, got {value!r}")


def subsample_examples(examples: TextExamples, max_examples: int | None, seed: int, salt: str = "") -> TextExamples:
    """Deterministic seeded subset of at most ``max_examples`` rows (original order preserved).

    ``salt`` (e.g. the split name) decorrelates the subsets drawn from different splits.
    """
    _check_max("max_examples", max_examples)
    n = len(examples)
    if max_examples is None or max_examples >= n:
        return examples
    import numpy as np

    rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, zlib.crc32(salt.encode("utf-8"))])
    chosen = np.sort(rng.choice(n, size=max_examples, replace=False))
    return examples.select(chosen.tolist())


def _apply_limits(
    spec: GlueTaskSpec,
    splits: dict[str, TextExamples],
    max_train: int | None,
    max_eval: int | None,
    seed: int,
) -> TaskData:
    train = subsample_examples(splits["train"], max_train, seed, "train")
    evals = {s: subsample_examples(splits[s], max_eval, seed, s) for s in spec.eval_splits}
    return TaskData(
        name=spec.name,
        num_labels=spec.num_labels,
        train=train,
        eval_splits=evals,
        label_names=list(spec.label_names),
    )


def iid_partition_indices(num_examples: int, num_partitions: int, partition_id: int, seed: int) -> list[int]:
    """Indices of IID partition ``partition_id`` out of ``num_partitions``.

    Same semantics as ``flwr_datasets`` ``FederatedDataset(shuffle=True, seed=seed)`` with an
    ``IidPartitioner(num_partitions)``: a ``numpy.random.default_rng(seed)`` permutation of
    ``range(num_examples)`` cut into contiguous shards; the first ``num_examples % num_partitions``
    shards hold one extra example. So partitions are disjoint, cover every example, differ in size
    by at most one, and depend only on the arguments. Every partition must be non-empty.
    """
    for name, value in (
        ("num_examples", num_examples),
        ("num_partitions", num_partitions),
        ("partition_id", partition_id),
        ("seed", seed),
    ):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if num_partitions < 1:
        raise ValueError(f"num_partitions must be >= 1, got {num_partitions}")
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition_id must be in [0, {num_partitions - 1}], got {partition_id}")
    if num_examples < num_partitions:
        raise ValueError(
            f"cannot split {num_examples} example(s) into {num_partitions} non-empty partitions"
        )
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    import numpy as np

    size, extra = divmod(num_examples, num_partitions)
    start = size * partition_id + min(partition_id, extra)
    stop = start + size + (1 if partition_id < extra else 0)
    permutation = np.random.default_rng(seed).permutation(num_examples)
    return permutation[start:stop].tolist()


# --------------------------------------------------------------------------------------------
# public loaders
# --------------------------------------------------------------------------------------------


def load_glue_local(
    task: str,
    data_dir: str | Path,
    *,
    max_train: int | None = None,
    max_eval: int | None = None,
    seed: int = 0,
) -> TaskData:
    """Load a GLUE task from local files (see the module docstring for the accepted layouts)."""
    spec = get_task_spec(task)
    _check_max("max_train", max_train)
    _check_max("max_eval", max_eval)
    task_dir = _find_task_dir(spec, Path(data_dir).expanduser())
    paths = {split: _split_paths(spec, task_dir, split) for split in spec.splits}
    splits = {split: read_split_file(spec.name, p) for split, p in paths.items()}
    return _apply_limits(spec, splits, max_train, max_eval, seed)


def _hub_split_to_examples(spec: GlueTaskSpec, split: str, dataset: Any) -> TextExamples:
    columns = list(dataset.column_names)
    source = f"{HUB_DATASET}/{spec.hf_config} split {split!r}"
    cols = _resolve_columns(spec, columns, source)
    label_col = columns[cols["label"]]
    features = getattr(dataset, "features", None) or {}
    hub_names = getattr(features.get(label_col), "names", None)
    if hub_names is not None and list(hub_names) != list(spec.label_names):
        raise ValueError(
            f"{source}: label names {list(hub_names)} differ from the expected {list(spec.label_names)}"
        )
    names = {role: columns[i] for role, i in cols.items()}
    # One bulk Arrow -> Python conversion; iterating dataset[col] row by row is ~100x slower.
    if hasattr(dataset, "select_columns") and hasattr(dataset, "with_format"):
        data = dataset.with_format(None).select_columns(list(dict.fromkeys(names.values())))[:]
    else:  # plain mapping of lists
        data = {name: list(dataset[name]) for name in names.values()}
    text_b = data[names["text_b"]] if "text_b" in names else None
    return _finish(spec, data[names["text_a"]], text_b, data[names["label"]], source, None)


def _fetch_hub_splits(spec: GlueTaskSpec, cache_dir: str | None) -> dict[str, Any]:
    """Download (or read from the HF cache) every split the task needs."""
    kwargs: dict[str, Any] = {}
    if cache_dir is not None:
        kwargs["cache_dir"] = cache_dir
    try:
        from flwr_datasets import FederatedDataset
    except ImportError:
        FederatedDataset = None  # noqa: N806

    if FederatedDataset is not None:
        # Partitioning is done by iid_partition_indices on our side; the FederatedDataset only
        # fetches the splits (unshuffled, so local and hub data line up row for row).
        fds = FederatedDataset(
            dataset=HUB_DATASET,
            subset=spec.hf_config,
            partitioners={"train": 1},
            shuffle=False,
            **kwargs,
        )
        return {split: fds.load_split(split) for split in spec.splits}

    import datasets

    dsd = datasets.load_dataset(path=HUB_DATASET, name=spec.hf_config, **kwargs)
    missing = [s for s in spec.splits if s not in dsd]
    if missing:
        raise ValueError(f"{HUB_DATASET}/{spec.hf_config} lacks split(s) {missing}; has {list(dsd)}")
    return {split: dsd[split] for split in spec.splits}


def load_glue_hub(
    task: str,
    *,
    max_train: int | None = None,
    max_eval: int | None = None,
    seed: int = 0,
    cache_dir: str | None = None,
) -> TaskData:
    """Load a GLUE task from the Hugging Face hub (``nyu-mll/glue``, config = task name).

    Uses ``flwr_datasets.FederatedDataset`` (which calls ``datasets.load_dataset``) when
    flwr-datasets is installed, else ``datasets.load_dataset`` directly. Any failure to fetch the
    data is re-raised as :class:`RuntimeError` pointing at the local-files alternative. Without
    network access ``datasets`` retries for ~30 s before failing; ``HF_HUB_OFFLINE=1`` fails at once
    (and still serves a previously cached copy).
    """
    spec = get_task_spec(task)
    _check_max("max_train", max_train)
    _check_max("max_eval", max_eval)
    try:
        raw = _fetch_hub_splits(spec, cache_dir)
    except Exception as exc:  # network, auth, offline mode, missing split, ...
        raise RuntimeError(
            f"Could not load GLUE task {spec.name!r} from the Hugging Face hub "
            f"({HUB_DATASET!r}, config {spec.hf_config!r}): {type(exc).__name__}: {exc}. "
            "The hub is probably unreachable from this machine; point the run-config key "
            "`task.data-dir` (e.g. --set task.data-dir='\"/path/to/glue\"'; load_glue(data_dir=...) "
            "in Python) at a local GLUE directory (official TSVs or HF parquet/CSV exports) instead."
        ) from exc
    splits = {split: _hub_split_to_examples(spec, split, ds) for split, ds in raw.items()}
    return _apply_limits(spec, splits, max_train, max_eval, seed)


def load_glue(
    task: str,
    data_dir: str | Path | None = None,
    *,
    max_train: int | None = None,
    max_eval: int | None = None,
    seed: int = 0,
) -> TaskData:
    """Load a GLUE task: from ``data_dir`` when given (non-empty), else from the hub."""
    if data_dir is not None and str(data_dir).strip():
        return load_glue_local(task, data_dir, max_train=max_train, max_eval=max_eval, seed=seed)
    return load_glue_hub(task, max_train=max_train, max_eval=max_eval, seed=seed)

