"""A silo's training, and evaluation:

* ``loops``: local training (plain; Poisson batches in length-sorted chunks), evaluation, the
  round's learning rate, the silo's randomness, the optimizer carried between rounds;
* ``dp_sgd``: DP-SGD inside a silo (Opacus per-example gradients, clipping, noise);
* ``frozen_prefix``: the frozen-prefix cache (``train.cache-frozen``).

``from fedpower_app.training import train_local`` reaches the loops' names (loaded on first use).
"""

from __future__ import annotations

import importlib

_SUBMODULES = ("loops", "dp_sgd", "frozen_prefix")


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    loops = importlib.import_module(f"{__name__}.loops")
    try:
        return getattr(loops, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
