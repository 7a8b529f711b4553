"""``train.auto`` resolved when a run is launched, for every launcher alike (``fedpower-run``, the
experiment grid, the in-process runner): the public rules' settings (``privacy/recommend.py``) for
the run's silos are written into the run config, and ``train.auto`` reads false from there on, so
that results.json's config and run.json hold the settings that ran and a resume never plans again.

The ServerApp refuses a run config that still asks for ``train.auto``: the rules need the silos'
shard sizes, which a launcher knows from the task it partitions and a bare ``flwr run`` does not
pass on. There, ``fedpower-privacy --recommend --client-sizes ...`` prints the keys to set.
"""

from __future__ import annotations

from typing import Any, Iterable

UNRESOLVED = ("train.auto is resolved when a run is launched (fedpower-run, fedpower-experiment, "
              "benchmarks.inprocess_run), from the silos' shard sizes; this run config still asks for it. "
              "Launch with one of those, or set the keys that `fedpower-privacy --recommend --client-sizes "
              "n1,n2,...` prints and train.auto = false")


def resolve_train_auto(overrides: dict[str, Any], explicit: Iterable[str], num_silos: int
                       ) -> tuple[dict[str, Any], list[str]]:
    """``overrides`` with ``train.auto`` replaced by the plan's keys for ``num_silos`` silos of the
    run's task (a key in ``explicit``, set by hand, is kept), and the lines that say what was chosen
    and why. Unchanged, with no lines, without ``train.auto``. Raises ConfigError."""
    from ..config import ConfigError, parse_config

    cfg = parse_config(overrides)
    if not cfg["train.auto"]:
        return overrides, []
    from ..data import load_task, shard_sizes
    from ..privacy.recommend import auto_settings

    try:
        sizes = shard_sizes(len(load_task(cfg).train), num_silos)
        settings, lines = auto_settings(cfg, sizes, set(explicit))
    except (OSError, ValueError, RuntimeError) as exc:
        raise ConfigError(f"train.auto: {' '.join(str(exc).split())}") from None
    return {**overrides, **settings, "train.auto": False}, lines


def refuse_unresolved(cfg) -> None:
    """At the ServerApp: a run config that still asks for ``train.auto`` is refused (ConfigError)."""
    if cfg["train.auto"]:
        from ..config import ConfigError

        raise ConfigError(UNRESOLVED)
