"""Figures as the repository keeps them: PNGs with an adaptive 256-colour palette.

Line plots use a few dozen colours, so the palette loses nothing visible and the file is about a
third of matplotlib's RGBA PNG (``results/`` holds every figure RESULTS.md cites)."""

from __future__ import annotations

import io
from pathlib import Path

from .runs.atomic import write_atomic


def save_png(fig, path: Path | str, *, dpi: int = 110) -> Path:
    """Save a matplotlib figure to ``path`` as a palette PNG, atomically."""
    from PIL import Image

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    buf.seek(0)
    image = Image.open(buf).convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    out = io.BytesIO()
    image.save(out, format="PNG", optimize=True)
    return write_atomic(path, out.getvalue())


def compact_png(path: Path | str) -> int:
    """Rewrite an existing PNG with a 256-colour palette (a no-op on one that has one); the bytes saved."""
    from PIL import Image

    path = Path(path)
    before = path.stat().st_size
    with Image.open(path) as image:
        if image.mode == "P":
            return 0
        converted = image.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    out = io.BytesIO()
    converted.save(out, format="PNG", optimize=True)
    if len(out.getvalue()) >= before:
        return 0
    write_atomic(path, out.getvalue())
    return before - len(out.getvalue())
