"""Figures as the repository keeps them: PNGs with an adaptive 256-colour palette.

Line plots use a few dozen colours, so the palette loses nothing visible and the file is about a
third of matplotlib's RGBA PNG (``results/`` holds every figure RESULTS.md cites)."""

from __future__ import annotations

import io
from pathlib import Path

from .runs.atomic import write_atomic


def _palette_png(image) -> bytes:
    """``image`` (PIL) as an optimised PNG with an adaptive 256-colour palette."""
    from PIL import Image

    out = io.BytesIO()
    image.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(out, format="PNG", optimize=True)
    return out.getvalue()


def save_png(fig, path: Path | str, *, dpi: int = 110) -> Path:
    """Save a matplotlib figure to ``path`` as a palette PNG, atomically."""
    from PIL import Image

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    buf.seek(0)
    with Image.open(buf) as image:
        return write_atomic(path, _palette_png(image))


def compact_png(path: Path | str) -> int:
    """Rewrite an existing PNG with a 256-colour palette (a no-op on one that has one); the bytes saved."""
    from PIL import Image

    path = Path(path)
    before = path.stat().st_size
    with Image.open(path) as image:
        if image.mode == "P":
            return 0
        data = _palette_png(image)
    if len(data) >= before:
        return 0
    write_atomic(path, data)
    return before - len(data)
