"""Reading GLUE files: labels, columns resolved by name, TSV / parquet / CSV readers, and the
task folder and split files of a local GLUE directory (the rules are in ``glue``'s docstring)."""

from __future__ import annotations

import fnmatch
import logging
from pathlib import Path
from typing import Any, Sequence

from .glue_tasks import _MNLI_MISSING_LABELS, GlueTaskSpec, _norm, get_task_spec
from .types import TextExamples

log = logging.getLogger("fedpower_app.data.glue")  # one logger for the GLUE loader

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


