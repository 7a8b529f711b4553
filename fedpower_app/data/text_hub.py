"""A text-classification task from a Hugging Face dataset (``task.dataset``), loaded through
flwr-datasets' ``FederatedDataset`` (which calls ``datasets.load_dataset``), and silos cut by
flwr-datasets' partitioners (``task.partitioner = "iid"`` or ``"dirichlet"``).

``task.dataset`` is a hub id (``"stanfordnlp/imdb"``) or anything ``datasets.load_dataset`` reads,
such as a local directory of ``train.csv`` / ``validation.jsonl`` files (how the tests run this
code path offline). Its columns and labels are configured as for local files (``text_files``); a
``ClassLabel`` column matches the declared labels by its names or by its integers.

Without a network a hub id fails at once with one line (:func:`hub_unreachable`), instead of
``datasets``' retries; ``HF_DATASETS_OFFLINE=1`` serves a copy cached earlier.
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from functools import lru_cache
from pathlib import Path

from .text_files import TextDataError, TextTaskSpec, collect_examples
from .types import TaskData

#: Evaluation splits tried in order when ``task.dataset-eval-split`` is empty.
EVAL_SPLIT_CANDIDATES = ("validation", "test")
#: Seconds the reachability check waits for the hub.
HUB_TIMEOUT_S = 5.0


def _offline() -> bool:
    return any(os.environ.get(k, "").strip().lower() in ("1", "true", "yes", "on")
               for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"))


def hub_unreachable(endpoint: str | None = None, timeout: float = HUB_TIMEOUT_S) -> str | None:
    """Why the hub cannot be reached from here (None when it answers, whatever the status)."""
    url = (endpoint or os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/") + "/api/datasets?limit=1"
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout).close()
    except urllib.error.HTTPError:
        return None  # it answered
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return f"no answer from {url.split('/api/')[0]} within {timeout:g} s ({reason})"
    return None


def is_local_dataset(dataset: str) -> bool:
    return Path(dataset).expanduser().exists()


def _hub_error(dataset: str, why: str) -> RuntimeError:
    return RuntimeError(f"task.dataset {dataset!r}: cannot load it from the Hugging Face hub: {why}; on a machine "
                        "without network, use local files (task.name = 'text' with task.data-dir) or a copy cached "
                        "earlier (HF_DATASETS_OFFLINE=1)")


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


def fetch_splits(dataset: str, subset: str = "", eval_split: str = ""):
    """(train split, evaluation split name, evaluation split) as ``datasets.Dataset`` objects, through
    ``FederatedDataset.load_split``. Raises RuntimeError with one line when it cannot."""
    from flwr_datasets import FederatedDataset

    if not is_local_dataset(dataset):
        if _offline():
            pass  # datasets answers at once: from its cache, or an error naming offline mode
        else:
            why = hub_unreachable()
            if why:
                raise _hub_error(dataset, why)
    fds = FederatedDataset(dataset=str(Path(dataset).expanduser()) if is_local_dataset(dataset) else dataset,
                           subset=subset or None, partitioners={"train": 1}, shuffle=False)
    try:
        train = fds.load_split("train")
    except ValueError as exc:  # FederatedDataset's own check: no such split
        raise RuntimeError(f"task.dataset {dataset!r}: {_one_line(exc)}") from None
    except Exception as exc:  # network, offline mode, no such dataset, auth ...
        raise _hub_error(dataset, _one_line(exc)) from None
    names = [eval_split] if eval_split else list(EVAL_SPLIT_CANDIDATES)
    for name in names:
        try:
            return train, name, fds.load_split(name)
        except ValueError:
            continue
    raise RuntimeError(f"task.dataset {dataset!r} has no evaluation split {' or '.join(map(repr, names))} "
                       "(set task.dataset-eval-split)")


def _rows(split, spec: TextTaskSpec):
    columns = list(split.column_names)
    missing = [c for c in spec.columns() if c not in columns]
    if missing:
        raise TextDataError(f"no column {missing[0]!r}; the split has {columns}", f"no column {missing[0]!r}")
    feature = split.features.get(spec.label_column)
    names = list(getattr(feature, "names", None) or [])
    declared = set(spec.labels)
    data = split.with_format(None).select_columns(list(dict.fromkeys(spec.columns())))[:]
    for i in range(len(split)):
        row = {c: data[c][i] for c in spec.columns()}
        label = row[spec.label_column]
        if names and isinstance(label, int) and not isinstance(label, bool) and 0 <= label < len(names) \
                and str(label) not in declared:
            row[spec.label_column] = names[label]  # a ClassLabel: its name, unless the integers are declared
        yield i + 1, row, {}


@lru_cache(maxsize=2)
def load_text_hub(spec: TextTaskSpec, dataset: str, subset: str = "", eval_split: str = "") -> TaskData:
    """The task of ``task.dataset``: its train split and one evaluation split (see :func:`fetch_splits`)."""
    train, name, evaluation = fetch_splits(dataset, subset, eval_split)
    source = f"{dataset}{'/' + subset if subset else ''}"
    try:
        examples = {split: collect_examples(_rows(ds, spec), spec, source=f"{source} split {split!r}",
                                            public_name=f"split {split!r}", unit="row")
                    for split, ds in (("train", train), (name, evaluation))}
    except TextDataError as exc:
        raise TextDataError(f"task.dataset {source}: {exc}", exc.public) from None
    return TaskData(name="text", num_labels=spec.num_labels, train=examples["train"],
                    eval_splits={name: examples[name]},
                    label_names=list(spec.labels))


def flwr_partition_indices(labels: list[int], num_partitions: int, partition_id: int, seed: int,
                           partitioner: str, alpha: float = 0.0) -> list[int]:
    """Silo ``partition_id``'s rows of a train split, cut by flwr-datasets: ``IidPartitioner`` over
    the split shuffled with ``seed`` (as ``FederatedDataset(shuffle=True, seed=seed)`` does), or
    ``DirichletPartitioner`` by label with concentration ``alpha``."""
    return list(_flwr_partitions(tuple(labels), num_partitions, seed, partitioner, float(alpha))[partition_id])


@lru_cache(maxsize=4)
def _flwr_partitions(labels: tuple, num_partitions: int, seed: int, partitioner: str, alpha: float) -> tuple:
    import datasets
    from flwr_datasets.partitioner import DirichletPartitioner, IidPartitioner

    if num_partitions > len(labels):
        raise ValueError(f"cannot split {len(labels)} example(s) into {num_partitions} non-empty partitions")
    table = datasets.Dataset.from_dict({"row": list(range(len(labels))), "label": list(labels)})
    if partitioner == "iid":
        cut = IidPartitioner(num_partitions)
        table = table.shuffle(seed=seed)
    elif partitioner == "dirichlet":
        if not alpha > 0:
            raise ValueError("task.partitioner = 'dirichlet' needs task.dirichlet-alpha > 0")
        cut = DirichletPartitioner(num_partitions, partition_by="label", alpha=alpha, min_partition_size=1,
                                   seed=seed)
    else:
        raise ValueError(f"unknown flwr-datasets partitioner {partitioner!r}")
    cut.dataset = table
    return tuple(tuple(cut.load_partition(i)["row"]) for i in range(num_partitions))
