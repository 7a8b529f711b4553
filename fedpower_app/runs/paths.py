"""What every command that runs configurations shares (the seed of one runs layer):
where a grid's or an audit's Flower home lives and which SuperLink port it uses."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

from ..config import PROJECT_ROOT


def is_inside(path: Path, root: Path) -> bool:
    """Is ``path`` (resolved) inside ``root``?"""
    try:
        Path(path).resolve().relative_to(Path(root).resolve())
        return True
    except ValueError:
        return False


def default_flwr_home(out: Path) -> Path:
    """A Flower home private to this grid: ``<out>/flwr-home``, or, when ``<out>`` is inside the app
    directory (e.g. ``results/``), ``~/.cache/fedpower/flwr-home-<hash of out>``: a Flower home keeps
    installed apps and state that do not belong in the project tree. (``flwr run`` packs only what
    pyproject.toml's ``fab-include`` lists; without it, a nested home's installed apps would be
    packaged recursively.)"""
    out = Path(out).resolve()
    if not is_inside(out, PROJECT_ROOT):
        return out / "flwr-home"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fedpower"
    return cache / f"flwr-home-{zlib.crc32(str(out).encode()):08x}"


def default_port(out: Path) -> int:
    """A private managed-SuperLink port derived from the output directory (stable across resumes)."""
    return 41000 + (zlib.crc32(str(out.resolve()).encode()) % 1500) * 4
