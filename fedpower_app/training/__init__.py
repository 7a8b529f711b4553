"""A silo's training, and evaluation:

* ``loops``: local training (plain; Poisson batches in length-sorted chunks), evaluation, the
  round's learning rate, the silo's randomness, the optimizer carried between rounds;
* ``dp_sgd``: DP-SGD inside a silo (Opacus per-example gradients, clipping, noise);
* ``frozen_prefix``: the frozen-prefix cache (``train.cache-frozen``).

``from fedpower_app.training import train_local`` reaches the loops' names (loaded on first use).
"""

from __future__ import annotations

from ..lazy import forward_to

__getattr__ = forward_to(__name__, "loops", ("loops", "dp_sgd", "frozen_prefix"))
