"""The run configuration: one typed, validated view of Flower's flat run config.

Defaults live in ``pyproject.toml`` (``[tool.flwr.app.config]``), presets in ``conf/*.toml``,
and each key is documented once, in docs/configuration.md (checked by tests/test_config.py). This module only knows
each key's type and valid values, so a bad value fails at start with a message naming the key.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

PROJECT_ROOT = Path(__file__).resolve().parents[1]

# Every choice list lives in fedpower_app.choices (one home); re-exported here for the callers.
from .choices import (  # noqa: E402
    ACCOUNTANTS, CALIBRATIONS, CLIENT_REFACTORIZATIONS, DEVICES, DIAGNOSTICS, DP_LEVELS, LOCAL_OPTIMIZERS,
    LR_SCHEDULES, NOISE_AT, OPTIMIZER_STATES, POOLINGS, PRECISIONS, NOISE_MODES, SAMPLE_MODES, STRATEGIES, TASKS,
    PARTITIONERS, METRICS, TRAIN_WHAT,
)


class ConfigError(ValueError):
    """A run-config value is missing or invalid. The message names the key."""


def _in(choices) -> Callable[[Any], str | None]:
    return lambda v: None if v in choices else f"must be one of {', '.join(map(str, choices))}"


def _pos(v):
    return None if v > 0 else "must be > 0"


def _nonneg(v):
    return None if v >= 0 else "must be >= 0"


def _rate(v):
    return None if 0 < v <= 1 else "must be in (0, 1]"


def _open_unit(v):
    return None if 0 < v < 1 else "must be in (0, 1)"


def _zero_or_above_one(v):
    return None if v == 0 or v > 1 else "must be 0 or > 1"


def _unit(v):
    return None if 0 <= v <= 1 else "must be in [0, 1]"


def _device(v):
    """A device name: one of DEVICES, or ``cuda:N`` (the N-th visible GPU)."""
    if v in DEVICES or (v.startswith("cuda:") and v[5:].isdigit()):
        return None
    return f"must be one of {', '.join(DEVICES)}, or cuda:N"


def _min1(v):
    return None if v >= 1 else "must be >= 1"


# key -> (python type, validator or None). Keep in the order of the README table.
SCHEMA: dict[str, tuple[type, Callable[[Any], str | None] | None]] = {
    "num-server-rounds": (int, _min1),
    "seed": (int, None),
    "run-name": (str, None),
    "output-dir": (str, None),
    "resume": (bool, None),
    "device": (str, _device),
    "server-device": (str, _device),
    "task.name": (str, _in(TASKS)),
    "task.data-dir": (str, None),
    "task.max-length": (int, _min1),
    "task.max-train": (int, _nonneg),
    "task.max-eval": (int, _nonneg),
    "task.dirichlet-alpha": (float, lambda v: None if v >= 0 and v != float("inf") else "must be a finite number >= 0"),
    "task.synthetic-train-size": (int, _min1),
    "task.synthetic-eval-size": (int, _min1),
    "task.cache-dir": (str, None),
    "task.train-rows": (str, None),
    "task.validation-rows": (int, _nonneg),
    "task.text-column": (str, None),
    "task.text-pair-column": (str, None),
    "task.label-column": (str, None),
    "task.labels": (str, None),
    "task.dataset": (str, None),
    "task.dataset-subset": (str, None),
    "task.dataset-eval-split": (str, None),
    "task.partitioner": (str, _in(PARTITIONERS)),
    "task.metric": (str, _in(METRICS)),
    "model.name": (str, None),
    "model.target-modules": (str, None),
    "model.train-head": (bool, None),
    "model.pooling": (str, _in(POOLINGS)),
    "lora.rank": (int, _min1),
    "lora.alpha": (float, _pos),
    "model.dropout": (float, lambda v: None if v == -1 or 0 <= v < 1 else "must be -1 (the checkpoint's own) or in [0, 1)"),
    "lora.dropout": (float, lambda v: None if 0 <= v < 1 else "must be in [0, 1)"),
    "lora.top-layers": (int, _nonneg),
    "train.local-steps": (int, _min1),
    "train.batch-size": (int, _min1),
    "train.lr": (float, _pos),
    "train.lr-schedule": (str, _in(LR_SCHEDULES)),
    "train.optimizer": (str, _in(LOCAL_OPTIMIZERS)),
    "train.optimizer-state": (str, _in(OPTIMIZER_STATES)),
    "train.adam-eps": (float, _pos),
    "train.head-lr-scale": (float, _pos),
    "train.label-smoothing": (float, lambda v: None if 0 <= v < 1 else "must be in [0, 1)"),
    "train.cache-frozen": (bool, None),
    "train.precision": (str, _in(PRECISIONS)),
    "train.physical-batch-size": (int, _nonneg),
    "train.auto": (bool, None),
    "train.epochs": (float, _pos),
    "train.what": (str, _in(TRAIN_WHAT)),
    "train.head-rounds": (int, _nonneg),
    "train.class-prior": (str, None),
    "eval.batch-size": (int, _min1),
    "eval.every": (int, _min1),
    "eval.fraction-clients": (float, _unit),
    "strategy.name": (str, _in(STRATEGIES)),
    "strategy.client-rate": (float, _rate),
    "strategy.power-iters": (int, _min1),
    "strategy.refactor-every": (int, _min1),
    "strategy.client-refactorization": (str, _in(CLIENT_REFACTORIZATIONS)),
    "strategy.min-nodes": (int, _min1),
    "strategy.round-timeout": (float, _pos),
    "dp.level": (str, _in(DP_LEVELS)),
    "dp.epsilon": (float, _pos),
    "dp.delta": (float, _open_unit),
    "dp.noise-at": (str, _in(NOISE_AT)),
    "dp.clip": (float, _pos),
    "dp.head-clip": (float, _nonneg),
    "dp.head-noise-ratio": (float, _zero_or_above_one),
    "dp.noise-multiplier": (float, _nonneg),
    "dp.accountant": (str, _in(ACCOUNTANTS)),
    "dp.sample-mode": (str, _in(SAMPLE_MODES)),
    "dp.calibration": (str, _in(CALIBRATIONS)),
    "dp.noise": (str, _in(NOISE_MODES)),
    "dp.diagnostics": (str, _in(DIAGNOSTICS)),
    "secagg.enabled": (bool, None),
    "secagg.threshold": (float, lambda v: None if 0.5 < v <= 1 else "must be a fraction in (0.5, 1]"),
    "secagg.quantization-bits": (int, lambda v: None if 16 <= v <= 62 else "must be an integer in [16, 62]"),
    "secagg.clip-range": (float, _pos),
    "secagg.degree": (int, lambda v: None if v == 0 or (v >= 2 and v % 2 == 0) else
                      "must be 0 (every pair of silos) or an even integer >= 2"),
    "secagg.colluders": (int, _nonneg),
    "secagg.dropout-rate": (float, lambda v: None if 0 <= v < 0.5 else "must be a fraction in [0, 0.5)"),
}


def pyproject_defaults(path: Path | None = None) -> dict[str, Any]:
    """The flattened ``[tool.flwr.app.config]`` table of pyproject.toml (the single source of defaults)."""
    path = path or PROJECT_ROOT / "pyproject.toml"
    with open(path, "rb") as fh:
        table = tomllib.load(fh)["tool"]["flwr"]["app"]["config"]
    return flatten(table)


def flatten(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in table.items():
        full = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, full + "."))
        else:
            out[full] = value
    return out


def load_preset(path: str | Path) -> dict[str, Any]:
    """A ``conf/*.toml`` preset, flattened to run-config keys."""
    with open(path, "rb") as fh:
        return flatten(tomllib.load(fh))


@dataclass(frozen=True, eq=False)
class RunConfig:
    """Validated run configuration. Access values with ``cfg["dp.epsilon"]``. Hashable (cache key)."""

    values: dict[str, Any]

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.values.items())))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RunConfig) and self.values == other.values

    def __getitem__(self, key: str) -> Any:
        return self.values[key]

    def to_dict(self) -> dict[str, Any]:
        return dict(self.values)

    # Convenience views used in several places.
    @property
    def dp_enabled(self) -> bool:
        return self.values["dp.level"] != "none"

    @property
    def diagnostics_released(self) -> bool:
        """Does this run show what its guarantee does not cover? (always, when non-private)"""
        return not self.dp_enabled or self.values["dp.diagnostics"] == "released"

    @property
    def target_modules(self) -> list[str]:
        raw = self.values["model.target-modules"].strip()
        return [m.strip() for m in raw.split(",") if m.strip()]


METHOD_PRESETS = PROJECT_ROOT / "conf" / "methods"


def method_preset_path(method: str) -> Path:
    """``conf/methods/<method>.toml``: the settings a method was tuned at."""
    return METHOD_PRESETS / f"{method}.toml"


METHOD_TABLE = "methods."  # a preset's per-method settings: [methods.<name>.<section>] key = value


def preset_method_tables(overrides: dict[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Split a preset's ``[methods.<name>]`` tables (flattened ``methods.<name>.<key>``) from its
    run-config keys. Returns (the other keys, {method: {key: value}}); a table of an unknown method
    or with an unknown key raises ConfigError naming it."""
    rest: dict[str, Any] = {}
    tables: dict[str, dict[str, Any]] = {}
    for key, value in overrides.items():
        if not key.startswith(METHOD_TABLE):
            rest[key] = value
            continue
        method, _, inner = key[len(METHOD_TABLE):].partition(".")
        if method not in STRATEGIES:
            raise ConfigError(f"preset table [methods.{method}]: unknown method (use one of {', '.join(STRATEGIES)})")
        if inner not in SCHEMA:
            raise ConfigError(f"preset table [methods.{method}]: unknown config key {inner!r}")
        if inner == "strategy.name":
            raise ConfigError(f"preset table [methods.{method}]: may not set strategy.name")
        tables.setdefault(method, {})[inner] = value
    return rest, tables


def with_method_preset(overrides: dict[str, Any], explicit: Any = None
                       ) -> tuple[dict[str, Any], dict[str, Any], str | None]:
    """The run's overrides completed with its method's tuned settings.

    The method is ``strategy.name`` of ``overrides`` (the default's otherwise). Precedence, highest
    first: the ``explicit`` keys (``--set``; every key of ``overrides`` when None), the preset's own
    ``[methods.<method>]`` table (settings tuned for that preset's recipe), the preset's other
    keys, then ``conf/methods/<method>.toml`` (settings tuned for the defaults), then the defaults.
    Returns (overrides without any ``methods.*`` key, the keys a method table supplied, where they
    came from, or None when none applied)."""
    rest, tables = preset_method_tables(overrides)
    explicit = set(rest) if explicit is None else set(explicit)
    method = str(rest.get("strategy.name", pyproject_defaults().get("strategy.name")))
    applied: dict[str, Any] = {}
    sources = []
    for key, value in tables.get(method, {}).items():
        if key not in explicit:
            rest[key] = applied[key] = value
    if applied:
        sources.append(f"the preset's [methods.{method}]")
    path = method_preset_path(method)
    if path.exists():
        from_file = {k: v for k, v in load_preset(path).items() if k not in rest}
        if from_file:
            rest.update(from_file)
            applied.update(from_file)
            try:
                shown = str(path.relative_to(PROJECT_ROOT))
            except ValueError:
                shown = str(path)
            sources.append(shown)
    return rest, applied, (" and ".join(sources) or None)


def parse_config(run_config: dict[str, Any], *, defaults: dict[str, Any] | None = None) -> RunConfig:
    """Validate a flat run config (Flower's ``context.run_config``) against the schema.

    Keys missing from ``run_config`` are taken from ``defaults`` (pyproject.toml when None).
    Unknown keys and invalid values raise ConfigError naming the key.
    """
    base = pyproject_defaults() if defaults is None else dict(defaults)
    unknown = sorted(set(run_config) - set(SCHEMA))
    if unknown:
        raise ConfigError(f"unknown config key(s): {', '.join(unknown)} (valid keys are listed in the README)")
    merged = {**base, **run_config}
    values: dict[str, Any] = {}
    for key, (typ, check) in SCHEMA.items():
        if key not in merged:
            raise ConfigError(f"config key {key!r} is missing (no default in pyproject.toml)")
        values[key] = _coerce(key, merged[key], typ)
        if check is not None:
            problem = check(values[key])
            if problem:
                raise ConfigError(f"config key {key!r} {problem}, got {values[key]!r}")
    _cross_checks(values)
    return RunConfig(values)


def validate_overrides(overrides: dict[str, Any], *, pyproject: str | Path | None = None) -> RunConfig:
    """Validate run-config overrides (a preset merged with ``--set`` values) before a run starts,
    exactly as the ServerApp will: the defaults of ``pyproject`` (this project's when None) plus
    ``overrides`` through :func:`parse_config`. Needs no data; raises ConfigError naming the key."""
    defaults = None
    if pyproject is not None:
        try:
            defaults = pyproject_defaults(Path(pyproject))
        except (KeyError, TypeError):  # no [tool.flwr.app.config] table: this project's defaults
            defaults = None
    return parse_config(dict(overrides), defaults=defaults)


def _coerce(key: str, value: Any, typ: type) -> Any:
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ConfigError(f"config key {key!r} must be true or false, got {value!r}")
    if typ is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if typ is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if typ is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if typ is str and isinstance(value, str):
        return value
    raise ConfigError(f"config key {key!r} must be of type {typ.__name__}, got {value!r}")


def _cross_checks(v: dict[str, Any]) -> None:
    if v["strategy.refactor-every"] > 1 and v["strategy.name"] != "fedpower":
        raise ConfigError("config key 'strategy.refactor-every' > 1 only applies to strategy.name = 'fedpower'")
    if v["dp.head-noise-ratio"] > 0 and not (v["dp.head-clip"] > 0 and v["model.train-head"]
                                             and v["dp.level"] == "sample" and v["dp.noise-at"] == "silo"):
        raise ConfigError("config key 'dp.head-noise-ratio' > 0 splits DP-SGD's noise between the adapters and a "
                          "head clipped apart: it needs model.train-head = true, dp.head-clip > 0 and DP-SGD on "
                          "the silos (dp.level = 'sample', dp.noise-at = 'silo')")
    if v["dp.calibration"] == "paper" and v["dp.noise-multiplier"] > 0:
        raise ConfigError("config keys 'dp.calibration' = 'paper' and 'dp.noise-multiplier' > 0 are exclusive")
    if (v["dp.level"] == "sample" and v["dp.noise-at"] == "silo"
            and v["strategy.name"] in ("input-perturbation", "output-perturbation")):
        raise ConfigError(f"config key 'strategy.name' = {v['strategy.name']!r} is a server-side noise mechanism; "
                          "set dp.noise-at = 'server' (with DP-SGD on the silos use fedpower, fedlora or ffa-lora)")
    if v["dp.calibration"] == "paper" and v["dp.noise-at"] == "silo" and v["dp.level"] == "sample":
        raise ConfigError("config key 'dp.calibration' = 'paper' reproduces the paper's server-side noise; "
                          "set dp.noise-at = 'server'")
    if v["strategy.name"] == "fedsvd" and v["dp.level"] != "none" and not (
            v["dp.level"] == "sample" and v["dp.noise-at"] == "silo"):
        raise ConfigError("config key 'strategy.name' = 'fedsvd' is defined with DP-SGD on the silos "
                          "(dp.level = 'sample', dp.noise-at = 'silo') or without DP (dp.level = 'none'); "
                          "its server step adds no noise")
    if v["secagg.enabled"] and v["dp.level"] == "sample" and v["dp.noise-at"] == "server":
        raise ConfigError("config key 'secagg.enabled' = true with server-side noise at sample level: the server "
                          "would have to see each update to clip it; use DP-SGD on the silos (dp.noise-at = 'silo') "
                          "or client-level distributed DP (dp.level = 'client')")
    if v["secagg.enabled"] and v["dp.level"] == "client":
        if v["strategy.client-rate"] != 1.0:
            raise ConfigError("config key 'secagg.enabled' = true with dp.level = 'client' (distributed DP) needs "
                              "strategy.client-rate = 1: the server knows the cohort of a secure sum, so no "
                              "amplification by client sampling can be claimed")
        if v["strategy.name"] not in ("fedlora", "ffa-lora", "fedpower") or (
                v["strategy.name"] == "fedpower" and v["strategy.client-refactorization"] != "powerdp-l"):
            raise ConfigError("config key 'secagg.enabled' = true with dp.level = 'client' (distributed DP) runs "
                              "fedlora, ffa-lora, or fedpower with its PowerDP-L refactorization (the default of "
                              "strategy.client-refactorization)")
    if v["secagg.enabled"] and v["strategy.name"] in ("input-perturbation", "output-perturbation"):
        raise ConfigError(f"config key 'secagg.enabled' = true: {v['strategy.name']} is a server-side noise mechanism")
    if v["task.validation-rows"] and v["task.train-rows"]:
        raise ConfigError("config keys 'task.validation-rows' and 'task.train-rows' are exclusive (an audit lists "
                          "its own train rows)")
    if v["task.name"] == "synthetic" and v["task.data-dir"]:
        raise ConfigError("config key 'task.data-dir' is set but task.name = 'synthetic' (choose a GLUE task)")
    _text_task_checks(v)
    _train_what_checks(v)


def _train_what_checks(v: dict[str, Any]) -> None:
    """``train.what``, ``train.head-rounds`` and ``train.class-prior``."""
    if v["train.what"] != "adapters" and v["dp.level"] != "none" and not (
            v["dp.level"] == "sample" and v["dp.noise-at"] == "silo"):
        raise ConfigError(f"config key 'train.what' = {v['train.what']!r} trains the head on the silos' features: it "
                          "runs with DP-SGD on the silos (dp.level = 'sample', dp.noise-at = 'silo') or without DP "
                          "(dp.level = 'none')")
    if v["train.what"] == "head-then-adapters" and not 0 < v["train.head-rounds"] < v["num-server-rounds"]:
        raise ConfigError("config key 'train.head-rounds' must be in 1..num-server-rounds - 1 when train.what is "
                          f"head-then-adapters (the head's rounds, then the adapters'), got {v['train.head-rounds']}")
    if v["train.class-prior"].strip():
        from .training.features import parse_class_prior

        try:
            parse_class_prior(v["train.class-prior"])
        except ValueError as exc:
            raise ConfigError(f"config key 'train.class-prior' {exc}") from None


def _text_task_checks(v: dict[str, Any]) -> None:
    """The generic text task's keys: declared labels, named columns, one source of rows."""
    if v["task.name"] != "text":
        if v["task.dataset"]:
            raise ConfigError("config key 'task.dataset' needs task.name = 'text' (with task.labels and the columns)")
    else:
        from .data.text_files import parse_labels

        try:
            parse_labels(v["task.labels"])
        except ValueError as exc:
            raise ConfigError(f"config key 'task.labels' {exc}") from None
        for key in ("task.text-column", "task.label-column"):
            if not v[key].strip():
                raise ConfigError(f"config key {key!r} is empty: name the column of the task's files")
        columns = [v["task.text-column"], v["task.label-column"]] + ([v["task.text-pair-column"]] if v["task.text-pair-column"] else [])
        if len(set(columns)) < len(columns):
            raise ConfigError("config keys 'task.text-column', 'task.text-pair-column' and 'task.label-column' must "
                              "name different columns")
        if v["task.dataset"] and v["task.data-dir"]:
            raise ConfigError("config keys 'task.dataset' and 'task.data-dir' are exclusive (a hub dataset, or local files)")
    if v["task.partitioner"] == "dirichlet" and not v["task.dirichlet-alpha"] > 0:
        raise ConfigError("config key 'task.partitioner' = 'dirichlet' needs task.dirichlet-alpha > 0")
    if v["task.partitioner"] == "iid" and v["task.dirichlet-alpha"] > 0:
        raise ConfigError("config key 'task.partitioner' = 'iid' with task.dirichlet-alpha > 0: choose 'dirichlet' "
                          "(flwr-datasets) or 'fedpower' (this project's size-preserving split)")
    if v["task.partitioner"] != "fedpower" and v["task.train-rows"]:
        raise ConfigError("config key 'task.partitioner' must be 'fedpower' with task.train-rows (an audit places its rows)")
