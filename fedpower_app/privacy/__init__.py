"""The privacy layer of the app (the Flower-free contract and the mechanisms' math are in
``strategies/``: ``privacy_contract``, ``mechanisms``):

* ``accounting``: the accounting package (an ``Accountant`` interface with RDP and PLD behind it,
  plans, calibration, the server's ledger, and the silo's DP-SGD ledger and its own check);
* ``hook``: the server's privacy hook (calibrated noise per released block, the per-round ledger,
  ``guarantee``);
* ``cli``: ``fedpower-privacy``, the privacy plan of a run without training.

``from fedpower_app.privacy import guarantee`` reaches the hook's names; they load on first use,
so that importing ``fedpower_app.privacy.accounting`` stays light (no torch).
"""

from __future__ import annotations

from ..lazy import forward_to

__getattr__ = forward_to(__name__, "hook", ("accounting", "hook", "cli"))
