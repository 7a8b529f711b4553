"""Configuration: one source of truth, clear errors naming the key, presets and README in sync."""

import re

import pytest

from fedpower_app.config import PROJECT_ROOT, SCHEMA, ConfigError, load_preset, parse_config, pyproject_defaults


def test_defaults_cover_schema_exactly():
    assert set(pyproject_defaults()) == set(SCHEMA)
    cfg = parse_config({})
    assert cfg["strategy.name"] == "fedpower" and cfg["dp.level"] == "sample"


@pytest.mark.parametrize("key,value", [
    ("strategy.name", "fedavg"), ("lora.rank", 0), ("strategy.client-rate", 0.0), ("strategy.client-rate", 1.5),
    ("dp.delta", 1.0), ("dp.epsilon", -1.0), ("dp.level", "user"), ("train.local-steps", 0), ("device", "tpu"),
    ("task.name", "cola"), ("lora.dropout", 1.0), ("model.train-head", "yes"), ("num-server-rounds", 2.5),
])
def test_invalid_values_name_the_key(key, value):
    with pytest.raises(ConfigError, match=re.escape(repr(key))):
        parse_config({key: value})


def test_unknown_key_rejected():
    with pytest.raises(ConfigError, match="dp.sigma"):
        parse_config({"dp.sigma": 1.0})


def test_cross_checks():
    with pytest.raises(ConfigError, match="refactor-every"):
        parse_config({"strategy.name": "fedlora", "strategy.refactor-every": 5})
    with pytest.raises(ConfigError, match="exclusive"):
        parse_config({"dp.calibration": "paper", "dp.noise-multiplier": 1.0})


def test_every_key_documented_once_in_readme():
    readme = (PROJECT_ROOT / "docs" / "configuration.md").read_text()  # the one page that documents keys
    rows = re.findall(r"^\| `([a-z0-9.\-]+)` \|", readme, flags=re.M)
    documented = [r for r in rows if r in SCHEMA]
    assert sorted(documented) == sorted(SCHEMA), set(SCHEMA) ^ set(documented)


def test_all_presets_are_valid():
    presets = [p for p in (PROJECT_ROOT / "conf").glob("*.toml") if p.name != "flwr-config.toml"]
    assert presets
    from fedpower_app.config import preset_method_tables, with_method_preset

    for path in presets:
        preset = load_preset(path)
        rest, tables = preset_method_tables(preset)  # raises on a bad [methods.<name>] table
        parse_config(rest)  # raises on unknown keys or bad values
        for method in tables:  # and every method at its own settings for this preset
            parse_config(with_method_preset({**preset, "strategy.name": method}, explicit={"strategy.name"})[0])


def test_hashable_and_equal():
    assert hash(parse_config({})) == hash(parse_config({}))
    assert parse_config({}) == parse_config({})
    assert parse_config({"seed": 1}) != parse_config({})


def test_every_choice_list_has_one_home():
    """fedpower_app.choices holds the lists; config validation, the accountant and the noise source
    read them (strategies/ cannot import fedpower_app, so its noise modes are checked equal here)."""
    from fedpower_app.privacy import accounting as A
    from fedpower_app import choices as CH
    from fedpower_app.config import SCHEMA
    from strategies.noise import NOISE_MODES

    assert NOISE_MODES == CH.NOISE_MODES
    assert A.ACCOUNTANTS is CH.ACCOUNTANTS and A.SAMPLE_MODES is CH.SAMPLE_MODES and A.CALIBRATIONS is CH.CALIBRATIONS
    for key, choices in (("dp.accountant", CH.ACCOUNTANTS), ("strategy.name", CH.STRATEGIES),
                         ("strategy.client-refactorization", CH.CLIENT_REFACTORIZATIONS), ("dp.noise", CH.NOISE_MODES)):
        check = SCHEMA[key][1]
        assert all(check(c) is None for c in choices) and check("nope") is not None
