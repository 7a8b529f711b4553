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

import fnmatch
import logging
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

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

HUB_DATASET = "nyu-mll/glue"

_MNLI_MISSING_LABELS = frozenset({"", "-"})


@dataclass(frozen=True)
class GlueTaskSpec:
    """Static description of one GLUE task.

    ``split_files`` maps every split (train first, then the eval splits in order, the first eval
    split being the primary one) to the candidate file names tried in ``data_dir``'s task folder
    (``*`` patterns allowed, matched case-insensitively; all files matching a pattern are
    concatenated in name order).
    """

    name: str
    hf_config: str
    folder_names: tuple[str, ...]
    label_names: tuple[str, ...]
    text_a_columns: tuple[str, ...]
    text_b_columns: tuple[str, ...] | None
    label_columns: tuple[str, ...]
    eval_splits: tuple[str, ...]
    split_files: dict[str, tuple[str, ...]]
    drop_missing_labels: bool = False

    @property
    def num_labels(self) -> int:
        return len(self.label_names)

    @property
    def splits(self) -> tuple[str, ...]:
        return ("train", *self.eval_splits)


def _split_candidates(split: str, tsv_names: Sequence[str], extra: Sequence[str] = ()) -> tuple[str, ...]:
    return (
        *tsv_names,
        f"{split}.tsv",
        f"{split}.parquet",
        f"{split}-*.parquet",
        f"{split}.csv",
        *extra,
    )


def _dedupe(names: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(names))


_TRAIN_FILES = _dedupe(_split_candidates("train", ["train.tsv"]))
_VALIDATION_FILES = _dedupe(_split_candidates("validation", ["dev.tsv"], ["dev.parquet", "dev.csv"]))

GLUE_TASKS: dict[str, GlueTaskSpec] = {
    "sst2": GlueTaskSpec(
        name="sst2",
        hf_config="sst2",
        folder_names=("SST-2", "sst2"),
        label_names=("negative", "positive"),
        text_a_columns=("sentence",),
        text_b_columns=None,
        label_columns=("label",),
        eval_splits=("validation",),
        split_files={"train": _TRAIN_FILES, "validation": _VALIDATION_FILES},
    ),
    "qnli": GlueTaskSpec(
        name="qnli",
        hf_config="qnli",
        folder_names=("QNLI", "qnli"),
        label_names=("entailment", "not_entailment"),
        text_a_columns=("question",),
        text_b_columns=("sentence",),
        label_columns=("label",),
        eval_splits=("validation",),
        split_files={"train": _TRAIN_FILES, "validation": _VALIDATION_FILES},
    ),
    "mnli": GlueTaskSpec(
        name="mnli",
        hf_config="mnli",
        folder_names=("MNLI", "mnli"),
        label_names=("entailment", "neutral", "contradiction"),
        text_a_columns=("premise", "sentence1"),
        text_b_columns=("hypothesis", "sentence2"),
        label_columns=("gold_label", "label"),
        eval_splits=("validation_matched", "validation_mismatched"),
        split_files={
            "train": _TRAIN_FILES,
            "validation_matched": _dedupe(_split_candidates("validation_matched", ["dev_matched.tsv"])),
            "validation_mismatched": _dedupe(
                _split_candidates("validation_mismatched", ["dev_mismatched.tsv"])
            ),
        },
        drop_missing_labels=True,
    ),
    "qqp": GlueTaskSpec(
        name="qqp",
        hf_config="qqp",
        folder_names=("QQP", "qqp"),
        label_names=("not_duplicate", "duplicate"),
        text_a_columns=("question1",),
        text_b_columns=("question2",),
        label_columns=("is_duplicate", "label"),
        eval_splits=("validation",),
        split_files={"train": _TRAIN_FILES, "validation": _VALIDATION_FILES},
    ),
}


# --------------------------------------------------------------------------------------------
# task names
# --------------------------------------------------------------------------------------------


def _norm(name: str) -> str:
    return name.strip().lower().replace("-", "").replace("_", "")


def normalise_task_name(task: str) -> str:
    """Canonical task name (``"SST-2"`` -> ``"sst2"``); :class:`ValueError` for unknown tasks."""
    if not isinstance(task, str):
        raise ValueError(f"GLUE task must be a string, got {task!r}; valid tasks: {sorted(GLUE_TASKS)}")
    key = _norm(task)
    if key not in GLUE_TASKS:
        raise ValueError(
            f"Unknown GLUE task {task!r}; valid tasks: {', '.join(GLUE_TASKS)} "
            "(case and '-'/'_' are ignored, e.g. 'SST-2')"
        )
    return key


def get_task_spec(task: str) -> GlueTaskSpec:
    return GLUE_TASKS[normalise_task_name(task)]


# --------------------------------------------------------------------------------------------
# labels
# --------------------------------------------------------------------------------------------


def _label_lookup(spec: GlueTaskSpec) -> dict[str, int]:
    lookup: dict[str, int] = {}
    for i, name in enumerate(spec.label_names):
        lookup[str(i)] = i
        lookup[f"{i}.0"] = i  # CSV exports written from float columns
        lookup[name] = i
        lookup[name.lower()] = i
        lookup[name.replace("_", "-")] = i
    return lookup


def _expected_labels(spec: GlueTaskSpec) -> str:
    return ", ".join(f"{i} / {n!r}" for i, n in enumerate(spec.label_names))


def _convert_labels(
    spec: GlueTaskSpec,
    raw_labels: Sequence[Any],
    source: str,
    line_numbers: Sequence[int] | None = None,
) -> tuple[list[int], list[int]]:
    """Map raw label values to ints. Returns ``(labels, kept_row_positions)``.

    Rows with a missing MNLI gold label (``''``/``'-'``/None) are dropped; any other unknown
    value raises :class:`ValueError` naming ``source`` (and the line when known) and the value.
    """
    lookup = _label_lookup(spec)
    labels: list[int] = []
    kept: list[int] = []
    for pos, raw in enumerate(raw_labels):
        if isinstance(raw, bool):
            value: int | None = None
        elif isinstance(raw, int) or (isinstance(raw, float) and raw.is_integer()):
            value = int(raw) if 0 <= raw < spec.num_labels else None
        else:
            key = "" if raw is None else str(raw).strip()
            value = lookup.get(key)
            if value is None:
                value = lookup.get(key.lower())
            if value is None and spec.drop_missing_labels and key in _MNLI_MISSING_LABELS:
                continue
        if value is None:
            where = source if line_numbers is None else f"{source}, line {line_numbers[pos]}"
            raise ValueError(
                f"Unknown label {raw!r} for GLUE task {spec.name!r} in {where}; "
                f"expected one of {_expected_labels(spec)}"
            )
        labels.append(value)
        kept.append(pos)
    return labels, kept


# --------------------------------------------------------------------------------------------
# column resolution
# --------------------------------------------------------------------------------------------


def _resolve_columns(spec: GlueTaskSpec, header: Sequence[str], source: str) -> dict[str, int]:
    """Map the roles text_a / text_b / label to column positions in ``header`` (by name)."""
    lowered = [str(h).strip().lower() for h in header]
    roles: dict[str, tuple[str, ...]] = {"text_a": spec.text_a_columns, "label": spec.label_columns}
    if spec.text_b_columns is not None:
        roles["text_b"] = spec.text_b_columns
    resolved: dict[str, int] = {}
    missing: list[str] = []
    for role, names in roles.items():
        for name in names:
            if name in lowered:
                resolved[role] = lowered.index(name)
                break
        else:
            missing.append(role)
    if missing:
        expected = "; ".join(f"{role}: one of {list(roles[role])}" for role in roles)
        raise ValueError(
            f"Unrecognised column layout for GLUE task {spec.name!r} in {source}: "
            f"found columns {list(header)}; expected {expected} "
            f"(missing: {', '.join(missing)})"
        )
    return resolved


# --------------------------------------------------------------------------------------------
# file readers
# --------------------------------------------------------------------------------------------


def _read_tsv(spec: GlueTaskSpec, path: Path) -> TextExamples:
    """Quote-free TSV reader: split each line on tabs, resolve columns by header name."""
    with open(path, encoding="utf-8-sig", newline="") as f:
        content = f.read()
    # Split on '\n' only: str.splitlines() would also break on U+2028, U+0085, ... inside text.
    lines = content.split("\n")
    header_idx = next((i for i, line in enumerate(lines) if line.strip("\r")), None)
    if header_idx is None:
        raise ValueError(f"{path} is empty: expected a header row with the GLUE column names")
    header = lines[header_idx].rstrip("\r").split("\t")
    cols = _resolve_columns(spec, header, str(path))
    ia, il = cols["text_a"], cols["label"]
    ib = cols.get("text_b")
    needed = max(cols.values()) + 1
    n_header = len(header)

    text_a: list[str] = []
    text_b: list[str] = []
    raw_labels: list[str] = []
    line_numbers: list[int] = []
    bad_lines: list[int] = []
    for lineno in range(header_idx + 1, len(lines)):
        line = lines[lineno]
        if line.endswith("\r"):
            line = line[:-1]
        if not line:
            continue
        fields = line.split("\t")
        nf = len(fields)
        if nf != n_header:
            if nf < needed or (nf > n_header and any(fields[n_header:])):
                bad_lines.append(lineno + 1)
                continue
        text_a.append(fields[ia])
        if ib is not None:
            text_b.append(fields[ib])
        raw_labels.append(fields[il])
        line_numbers.append(lineno + 1)
    if bad_lines:
        log.warning(
            "%s: dropped %d malformed row(s) whose field count does not match the %d header "
            "columns (lines %s%s)",
            path,
            len(bad_lines),
            n_header,
            ", ".join(map(str, bad_lines[:10])),
            ", ..." if len(bad_lines) > 10 else "",
        )
    return _finish(spec, text_a, text_b if ib is not None else None, raw_labels, str(path), line_numbers)


def _read_table(spec: GlueTaskSpec, paths: Sequence[Path]) -> TextExamples:
    """Read parquet / CSV exports (one file or several shards) with HF column names."""
    text_a: list[Any] = []
    text_b: list[Any] = []
    raw_labels: list[Any] = []
    has_b = spec.text_b_columns is not None
    for path in paths:
        suffix = path.suffix.lower()
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            header = pq.read_schema(path).names
            cols = _resolve_columns(spec, header, str(path))
            names = [header[cols[r]] for r in ("text_a", "text_b", "label") if r in cols]
            table = pq.read_table(path, columns=names)
            data = {name: table.column(name).to_pylist() for name in names}
        elif suffix == ".csv":
            import pandas as pd

            frame = pd.read_csv(path, dtype=str, keep_default_na=False, encoding="utf-8-sig")
            header = list(frame.columns)
            cols = _resolve_columns(spec, header, str(path))
            data = {header[i]: frame[header[i]].tolist() for i in cols.values()}
        else:  # pragma: no cover - guarded by the candidate list
            raise ValueError(f"Unsupported GLUE file type: {path}")
        text_a.extend(data[header[cols["text_a"]]])
        if has_b:
            text_b.extend(data[header[cols["text_b"]]])
        raw_labels.extend(data[header[cols["label"]]])
    source = str(paths[0]) if len(paths) == 1 else f"{paths[0].parent}/{{{', '.join(p.name for p in paths)}}}"
    return _finish(spec, text_a, text_b if has_b else None, raw_labels, source, None)


def _text(values: Sequence[Any]) -> list[str]:
    return ["" if v is None else v if isinstance(v, str) else str(v) for v in values]


def _finish(
    spec: GlueTaskSpec,
    text_a: Sequence[Any],
    text_b: Sequence[Any] | None,
    raw_labels: Sequence[Any],
    source: str,
    line_numbers: Sequence[int] | None,
) -> TextExamples:
    labels, kept = _convert_labels(spec, raw_labels, source, line_numbers)
    if len(kept) != len(raw_labels):
        dropped = len(raw_labels) - len(kept)
        log.info("%s: dropped %d MNLI row(s) without a gold label ('-' or empty)", source, dropped)
        text_a = [text_a[i] for i in kept]
        text_b = None if text_b is None else [text_b[i] for i in kept]
    return TextExamples(
        text_a=_text(text_a), labels=labels, text_b=None if text_b is None else _text(text_b)
    )


def read_split_file(task: str, path: str | Path | Sequence[str | Path]) -> TextExamples:
    """Read one GLUE split file (TSV, parquet or CSV; or a list of parquet/CSV shards)."""
    spec = get_task_spec(task)
    paths = [Path(path)] if isinstance(path, (str, Path)) else [Path(p) for p in path]
    if not paths:
        raise ValueError("read_split_file needs at least one file")
    for p in paths:
        if not p.is_file():
            raise FileNotFoundError(f"GLUE {spec.name} file not found: {p}")
    if len(paths) == 1 and paths[0].suffix.lower() in (".tsv", ".txt"):
        return _read_tsv(spec, paths[0])
    if any(p.suffix.lower() in (".tsv", ".txt") for p in paths):
        examples = [_read_tsv(spec, p) for p in paths]
        return _concat(examples)
    return _read_table(spec, paths)


def _concat(parts: Sequence[TextExamples]) -> TextExamples:
    has_b = parts[0].text_b is not None
    return TextExamples(
        text_a=[t for p in parts for t in p.text_a],
        labels=[y for p in parts for y in p.labels],
        text_b=[t for p in parts for t in p.text_b] if has_b else None,  # type: ignore[union-attr]
    )


# --------------------------------------------------------------------------------------------
# local directory
# --------------------------------------------------------------------------------------------


def _find_task_dir(spec: GlueTaskSpec, data_dir: Path) -> Path:
    if not data_dir.exists():
        raise FileNotFoundError(
            f"GLUE data directory does not exist: {data_dir} (expected the {spec.folder_names[0]} "
            f"task folder holding {'/'.join(_primary_names(spec))}, or a parent directory "
            f"containing a {spec.folder_names[0]} folder)"
        )
    if not data_dir.is_dir():
        raise FileNotFoundError(f"GLUE data directory is not a directory: {data_dir}")
    wanted = {_norm(n) for n in spec.folder_names}
    if _norm(data_dir.name) in wanted:
        return data_dir
    children = sorted(p for p in data_dir.iterdir() if p.is_dir() and _norm(p.name) in wanted)
    if children:
        return children[0]
    if any(_match_split(spec, data_dir, split) for split in spec.splits):
        return data_dir
    raise FileNotFoundError(
        f"No GLUE {spec.name} data in {data_dir}: expected a folder named "
        f"{' or '.join(spec.folder_names)} (any case) inside it, or the split files "
        f"({', '.join(_primary_names(spec))}, or HF-style "
        f"{', '.join(s + '.parquet' for s in spec.splits)}) directly in it"
    )


def _primary_names(spec: GlueTaskSpec) -> list[str]:
    return [spec.split_files[s][0] for s in spec.splits]


def _match_split(spec: GlueTaskSpec, task_dir: Path, split: str) -> list[Path]:
    files = {p.name.lower(): p for p in task_dir.iterdir() if p.is_file()}
    for pattern in spec.split_files[split]:
        pattern = pattern.lower()
        if any(ch in pattern for ch in "*?["):
            hits = sorted(files[name] for name in files if fnmatch.fnmatchcase(name, pattern))
            if hits:
                return hits
        elif pattern in files:
            return [files[pattern]]
    return []


def _split_paths(spec: GlueTaskSpec, task_dir: Path, split: str) -> list[Path]:
    paths = _match_split(spec, task_dir, split)
    if not paths:
        raise FileNotFoundError(
            f"GLUE {spec.name} split {split!r} not found in {task_dir}: tried "
            f"{', '.join(spec.split_files[split])} (case-insensitive)"
        )
    return paths


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

