"""The runs layer: what every command that runs a configuration stands on.

* ``spec``: a run's spec (validated config, backend, federation), written to ``<run>/run.json``;
* ``results``: ``results.json``, written after every round; ``checkpoint``: the round checkpoint
  a run resumes from; ``atomic``: the one atomic write under both;
* ``inprocess``: the in-process backend (the real ServerApp and ClientApp in one process, over
  ``inprocess_grid``'s Grid); the ``flwr`` backend (a SuperLink and its process tree) is
  ``fedpower_app.launcher``;
* ``owner``: one owner per run directory (``owner.lock``), and a killed run's leftovers;
* ``paths``: a grid's or an audit's private Flower home and SuperLink port.

``fedpower-run``, ``fedpower-experiment``, ``fedpower-audit`` and ``benchmarks.inprocess_run`` are
drivers over these."""

from __future__ import annotations

from .paths import default_flwr_home, default_port, is_inside  # noqa: F401
from .spec import BACKENDS, SPEC_FILE, RunSpec  # noqa: F401
