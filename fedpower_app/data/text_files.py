"""Any text-classification table as a task (``task.name = "text"``): CSV, TSV, JSON Lines or Parquet
files, with the columns and the label set named in the configuration.

The label set is declared (``task.labels``), never read off the rows: which labels a silo holds is
itself private. A row's label is matched as text against the declared names ("positive", "3"; an
integer-valued number matches its digits, so 1, 1.0 and "1" are the label "1").

Files of a directory (``task.data-dir``, or a silo's node config ``data-dir``):

* training split: ``train.csv``, ``train.tsv``, ``train.jsonl`` (or ``.ndjson``) or ``train.parquet``
* evaluation split (optional on a silo): ``validation.*`` or ``dev.*``, the same formats

Rows: a row whose text (or pair text) or label is empty is skipped, and the skips are logged where
the file is read (a silo's own log), with their lines. Everything else that is wrong raises
:class:`TextDataError`, one line naming the file, the line and the column: an unknown label, a
missing column, an empty file, a line that cannot be parsed, a row with too many or too few fields.
The error also carries a ``public`` reason that names no row (no line, no value): what a silo tells
the server when it refuses.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from .types import TaskData, TextExamples

log = logging.getLogger("fedpower")

#: File suffix -> format.
FORMATS = {".csv": "csv", ".tsv": "tsv", ".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet"}
#: Split -> the file stems that hold it, first found wins.
SPLIT_STEMS = {"train": ("train",), "validation": ("validation", "dev")}
EVAL_SPLIT = "validation"
#: How many skipped lines a log line lists.
SHOWN_LINES = 10


class TextDataError(ValueError):
    """Rows that cannot be used. ``str(error)``: one line naming the file, line and column (local);
    ``error.public``: the same problem without any row's line or value (what a silo may tell the server)."""

    def __init__(self, message: str, public: str | None = None) -> None:
        super().__init__(message)
        self.public = public or message


@dataclass(frozen=True)
class TextTaskSpec:
    """The columns and the declared labels of a text-classification task (hashable: a cache key)."""

    text_column: str
    label_column: str
    labels: tuple[str, ...]
    pair_column: str = ""

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    def columns(self) -> tuple[str, ...]:
        return (self.text_column, *((self.pair_column,) if self.pair_column else ()), self.label_column)


def parse_labels(raw: str) -> tuple[str, ...]:
    """``task.labels`` ("negative,positive" or "0,1,2") as a tuple; ValueError saying what is wrong."""
    labels = tuple(part.strip() for part in str(raw).split(","))
    if not str(raw).strip():
        raise ValueError("is empty: declare the task's labels, comma-separated (e.g. 'negative,positive' or '0,1')")
    if any(not label for label in labels):
        raise ValueError(f"has an empty label in {raw!r}")
    if len(labels) < 2:
        raise ValueError(f"declares {len(labels)} label; a classification task needs at least 2")
    dupes = sorted({label for label in labels if labels.count(label) > 1})
    if dupes:
        raise ValueError(f"declares {', '.join(map(repr, dupes))} more than once")
    return labels


def text_spec(cfg) -> TextTaskSpec:
    """The text task of a run configuration (its ``task.*`` column keys and ``task.labels``)."""
    return TextTaskSpec(text_column=cfg["task.text-column"], label_column=cfg["task.label-column"],
                        labels=parse_labels(cfg["task.labels"]), pair_column=cfg["task.text-pair-column"])


def label_text(value: Any) -> str | None:
    """A cell's label as text ("1" for 1, 1.0 and "1.0"); None when the cell is empty."""
    if value is None or isinstance(value, bool):
        return None if value is None else str(value).lower()
    if isinstance(value, float):
        if math.isnan(value):
            return None
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, int):
        return str(value)
    text = str(value).strip()
    if not text:
        return None
    try:
        number = float(text)
    except ValueError:
        return text
    return str(int(number)) if number.is_integer() else text


def _cell_text(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return value if isinstance(value, str) else str(value)


# ------------------------------------------------------------------------------------------
# row readers: each yields (line or row number, {column: value}) after checking the columns
# ------------------------------------------------------------------------------------------


def _decode(path: Path) -> str:
    raw = path.read_bytes()
    if not raw.strip():
        what = "0 bytes" if not raw else "blank lines only"
        raise TextDataError(f"{path}: the file is empty ({what})", f"{path.name}: the file is empty")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        col = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise TextDataError(f"{path}:{line}:{col}: not UTF-8 text ({exc.reason})",
                            f"{path.name}: not UTF-8 text") from None


def _missing_columns(path: Path, spec: TextTaskSpec, found: list[str], where: str) -> None:
    missing = [c for c in spec.columns() if c not in found]
    if missing:
        keys = {spec.text_column: "task.text-column", spec.pair_column: "task.text-pair-column",
                spec.label_column: "task.label-column"}
        name = missing[0]
        raise TextDataError(f"{path}:{where}: no column {name!r} ({keys[name]}); the file has {found}",
                            f"{path.name}: no column {name!r} ({keys[name]})")


def _delimited_rows(path: Path, spec: TextTaskSpec, delimiter: str) -> Iterator[tuple[int, dict, dict]]:
    text = _decode(path)
    # TSV has no quoting (a field holds no tab): quotes are text, as in GLUE's files
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter, strict=True,
                        quoting=csv.QUOTE_NONE if delimiter == "\t" else csv.QUOTE_MINIMAL)
    try:
        header = next(reader)
    except StopIteration:  # pragma: no cover - _decode refuses empty files
        raise TextDataError(f"{path}: the file is empty", f"{path.name}: the file is empty") from None
    except csv.Error as exc:
        raise TextDataError(f"{path}:1: cannot parse the header ({exc})", f"{path.name}: cannot parse the header") from None
    header = [h.strip() for h in header]
    _missing_columns(path, spec, header, "1")
    where = {c: header.index(c) for c in spec.columns()}
    positions = {c: i + 1 for c, i in where.items()}
    while True:
        try:
            fields = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            raise TextDataError(f"{path}:{reader.line_num}: cannot parse the line ({exc})",
                                f"{path.name}: a line cannot be parsed") from None
        if not fields or (len(fields) == 1 and not fields[0].strip()):
            continue  # a blank line holds no row
        if len(fields) != len(header):
            raise TextDataError(
                f"{path}:{reader.line_num}: {len(fields)} field(s) where the header has {len(header)}"
                + (" (a comma inside unquoted text? quote the field)" if delimiter == "," else ""),
                f"{path.name}: a line has {'more' if len(fields) > len(header) else 'fewer'} fields than the header")
        yield reader.line_num, {c: fields[i] for c, i in where.items()}, positions


def _jsonl_rows(path: Path, spec: TextTaskSpec) -> Iterator[tuple[int, dict, dict]]:
    text = _decode(path)
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TextDataError(f"{path}:{number}:{exc.colno}: not valid JSON ({exc.msg})",
                                f"{path.name}: a line is not valid JSON") from None
        if not isinstance(row, dict):
            raise TextDataError(f"{path}:{number}:1: a JSON Lines row must be an object, got {type(row).__name__}",
                                f"{path.name}: a line is not a JSON object")
        _missing_columns(path, spec, list(row), str(number))
        yield number, {c: row[c] for c in spec.columns()}, {}


def _parquet_rows(path: Path, spec: TextTaskSpec) -> Iterator[tuple[int, dict, dict]]:
    import pyarrow.parquet as pq

    if path.stat().st_size == 0:
        raise TextDataError(f"{path}: the file is empty (0 bytes)", f"{path.name}: the file is empty")
    try:
        table = pq.read_table(path)
    except Exception as exc:  # ArrowInvalid and friends: not a Parquet file
        raise TextDataError(f"{path}: not a readable Parquet file ({str(exc).splitlines()[0]})",
                            f"{path.name}: not a readable Parquet file") from None
    _missing_columns(path, spec, list(table.column_names), "row 0")
    data = {c: table.column(c).to_pylist() for c in spec.columns()}
    for i in range(table.num_rows):
        yield i + 1, {c: data[c][i] for c in spec.columns()}, {}


def _rows(path: Path, spec: TextTaskSpec):
    kind = FORMATS.get(path.suffix.lower())
    if kind == "csv":
        return _delimited_rows(path, spec, ","), "line"
    if kind == "tsv":
        return _delimited_rows(path, spec, "\t"), "line"
    if kind == "jsonl":
        return _jsonl_rows(path, spec), "line"
    if kind == "parquet":
        return _parquet_rows(path, spec), "row"
    raise TextDataError(f"{path}: unsupported file type {path.suffix!r} (use {', '.join(FORMATS)})",
                        f"{path.name}: unsupported file type")


def read_text_file(path: str | Path, spec: TextTaskSpec) -> TextExamples:
    """The examples of one file; labels are indices into ``spec.labels``. Raises :class:`TextDataError`."""
    path = Path(path)
    if not path.is_file():
        raise TextDataError(f"{path}: no such file", f"{path.name}: no such file")
    rows, unit = _rows(path, spec)
    return collect_examples(rows, spec, source=str(path), public_name=path.name, unit=unit)


def collect_examples(rows, spec: TextTaskSpec, *, source: str, public_name: str, unit: str = "line") -> TextExamples:
    """Examples from ``(number, {column: cell}, {column: position})`` rows: empty cells skipped (and
    logged with their lines), an undeclared label refused naming ``source``, the line and the column."""
    index = {label: i for i, label in enumerate(spec.labels)}
    text_a: list[str] = []
    text_b: list[str] = []
    labels: list[int] = []
    skipped: dict[str, list[int]] = {}
    for number, row, positions in rows:
        a = _cell_text(row[spec.text_column])
        b = _cell_text(row[spec.pair_column]) if spec.pair_column else ""
        label = label_text(row[spec.label_column])
        empty = [c for c, v in ((spec.text_column, a), (spec.pair_column, b), (spec.label_column, label))
                 if c and not (v or "").strip()]
        if empty:
            skipped.setdefault(f"empty {empty[0]!r}", []).append(number)
            continue
        if label not in index:
            column = spec.label_column
            col = f"column {positions[column]} ({column!r})" if column in positions else f"column {column!r}"
            where = f"{source}:{number}: {col}" if unit == "line" else f"{source}: row {number}, {col}"
            raise TextDataError(f"{where}: unknown label {label!r} (task.labels declares {', '.join(spec.labels)})",
                                f"{public_name}: a row has a label that task.labels does not declare")
        text_a.append(a)
        text_b.append(b)
        labels.append(index[label])
    for why, numbers in skipped.items():
        shown = ", ".join(map(str, numbers[:SHOWN_LINES])) + (" ..." if len(numbers) > SHOWN_LINES else "")
        log.warning("%s: skipped %d row(s) with %s (%s %s)", source, len(numbers), why,
                    "lines" if unit == "line" else "rows", shown)
    if not labels:
        why = f" (all {sum(map(len, skipped.values()))} skipped: empty cells)" if skipped else ""
        raise TextDataError(f"{source}: no usable rows{why}", f"{public_name}: no usable rows")
    return TextExamples(text_a=text_a, labels=labels, text_b=text_b if spec.pair_column else None)


# ------------------------------------------------------------------------------------------
# a directory of split files
# ------------------------------------------------------------------------------------------


def split_file(directory: Path, split: str) -> Path | None:
    """The one file of ``split`` in ``directory`` (None when there is none); two candidates are an error."""
    found = [p for stem in SPLIT_STEMS[split] for p in sorted(directory.iterdir())
             if p.is_file() and p.stem.lower() == stem and p.suffix.lower() in FORMATS]
    stems = {p.stem.lower() for p in found}
    found = [p for p in found if p.stem.lower() == next(s for s in SPLIT_STEMS[split] if s in stems)] if found else []
    if len(found) > 1:
        raise TextDataError(f"{directory}: {' and '.join(p.name for p in found)} both hold the {split} split; keep one",
                            f"two files hold the {split} split")
    return found[0] if found else None


def expected_files(split: str) -> str:
    return " / ".join(f"{SPLIT_STEMS[split][0]}{suffix}" for suffix in (".csv", ".tsv", ".jsonl", ".parquet"))


def read_text_dir(directory: str | Path, spec: TextTaskSpec, *, need_eval: bool) -> TaskData:
    """A task from ``directory``: its training file (required) and its evaluation file (required when
    ``need_eval``). A directory may hold no training rows when it is only evaluated on (the server's):
    then ``train.*`` may be absent and the train split is empty."""
    root = Path(str(directory)).expanduser()
    if not root.exists():
        raise TextDataError(f"{root}: the data directory does not exist (expected {expected_files('train')})",
                            "the data directory does not exist")
    if not root.is_dir():
        raise TextDataError(f"{root}: the data directory is not a directory", "the data directory is not a directory")
    train_path = split_file(root, "train")
    eval_path = split_file(root, EVAL_SPLIT)
    if train_path is None and not (need_eval and eval_path is not None):
        raise TextDataError(f"{root}: no training file (expected {expected_files('train')})", "no training file")
    if need_eval and eval_path is None:
        raise TextDataError(f"{root}: no evaluation file (expected {expected_files('validation')}, or dev.*)",
                            "no evaluation file")
    train = read_text_file(train_path, spec) if train_path is not None else TextExamples(
        [], [], [] if spec.pair_column else None)
    evals = {EVAL_SPLIT: read_text_file(eval_path, spec)} if eval_path is not None else {}
    return TaskData(name="text", num_labels=spec.num_labels, train=train, eval_splits=evals,
                    label_names=list(spec.labels))
