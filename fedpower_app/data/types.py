"""Plain data containers shared by every data source (synthetic task, GLUE local files, GLUE hub).

Kept free of torch/transformers imports so loaders stay cheap to import.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TextExamples:
    """Columnar text-classification examples. ``text_b`` is None for single-sentence tasks."""

    text_a: list[str]
    labels: list[int]
    text_b: list[str] | None = None

    def __post_init__(self) -> None:
        if len(self.text_a) != len(self.labels):
            raise ValueError(f"text_a has {len(self.text_a)} rows but labels has {len(self.labels)}")
        if self.text_b is not None and len(self.text_b) != len(self.text_a):
            raise ValueError(f"text_b has {len(self.text_b)} rows but text_a has {len(self.text_a)}")

    def __len__(self) -> int:
        return len(self.labels)

    def select(self, indices) -> "TextExamples":
        idx = list(indices)
        return TextExamples(
            text_a=[self.text_a[i] for i in idx],
            labels=[self.labels[i] for i in idx],
            text_b=None if self.text_b is None else [self.text_b[i] for i in idx],
        )


@dataclass
class TaskData:
    """A task: its training split and one or more named evaluation splits.

    ``eval_splits`` maps a split name to examples, e.g. ``{"validation": ...}`` or, for MNLI,
    ``{"validation_matched": ..., "validation_mismatched": ...}``. The first entry is the primary
    split used for the per-round accuracy line.
    """

    name: str
    num_labels: int
    train: TextExamples
    eval_splits: dict[str, TextExamples] = field(default_factory=dict)
    label_names: list[str] | None = None
