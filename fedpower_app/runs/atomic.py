"""The one atomic file write: a temporary file beside the target, flushed and fsynced, then
renamed over it. A reader (another process, a resumed run) sees the old file or the new one,
never half of one. Pure python."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable


def write_atomic(path: Path | str, data: bytes | str, *, before_replace: Callable[[], None] | None = None) -> Path:
    """Write ``data`` to ``path`` atomically (parent directories are created). ``before_replace``
    runs after the temporary file is durable and before the rename (the checkpoint's fault point)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as fh:
        fh.write(data.encode() if isinstance(data, str) else data)
        fh.flush()
        os.fsync(fh.fileno())
    if before_replace is not None:
        before_replace()
    os.replace(tmp, path)
    return path


def write_json_atomic(path: Path | str, payload: Any, *, indent: int | None = 2) -> Path:
    """``payload`` as JSON (non-JSON values via ``str``), one trailing newline, written atomically.
    ``indent=None`` writes it minified (the compact results committed to ``results/``)."""
    separators = (",", ":") if indent is None else None
    return write_atomic(path, json.dumps(payload, indent=indent, separators=separators, default=str) + "\n")
