"""The GLUE tasks this project loads (SST-2, QNLI, MNLI, QQP): their columns, labels, splits and
the file names each split may have. The loaders are in ``glue`` and the file readers in
``glue_files``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

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


