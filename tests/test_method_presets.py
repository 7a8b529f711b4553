"""Method presets: `--set strategy.name=X` runs X at its tuned settings
(conf/methods/X.toml), says so at start, and an explicit choice still wins."""

import pytest

from fedpower_app import config as CFG
from fedpower_app.config import PROJECT_ROOT, STRATEGIES, load_preset, parse_config, with_method_preset


@pytest.fixture()
def presets(tmp_path, monkeypatch):
    (tmp_path / "ffa-lora.toml").write_text("[train]\nlr = 0.3\n[lora]\nalpha = 64.0\n")
    monkeypatch.setattr(CFG, "METHOD_PRESETS", tmp_path)
    return tmp_path


def test_a_method_runs_at_its_preset_unless_a_key_is_set(presets):
    merged, applied, path = with_method_preset({"strategy.name": "ffa-lora"})
    assert applied == {"train.lr": 0.3, "lora.alpha": 64.0} and path == str(presets / "ffa-lora.toml")
    assert parse_config(merged)["train.lr"] == 0.3
    merged, applied, _ = with_method_preset({"strategy.name": "ffa-lora", "train.lr": 0.01})
    assert merged["train.lr"] == 0.01 and applied == {"lora.alpha": 64.0}  # the explicit value wins
    assert with_method_preset({"strategy.name": "fedlora"}) == ({"strategy.name": "fedlora"}, {}, None)


def test_fedpower_run_says_which_preset_it_applied(presets, capsys, monkeypatch):
    from fedpower_app import launcher as L

    seen = {}
    monkeypatch.setattr(L.cli, "check_launch", lambda overrides, **kw: seen.update(overrides) or (_ for _ in ()).throw(
        CFG.ConfigError("stop here")))
    assert L.main(["--set", 'strategy.name="ffa-lora"', "--set", "train.lr=0.02"]) == 2
    out = capsys.readouterr().out
    assert "ffa-lora runs at its method preset" in out and "lora.alpha=64.0" in out and "train.lr" not in out
    assert seen["lora.alpha"] == 64.0 and seen["train.lr"] == 0.02


def test_every_shipped_method_preset_is_valid():
    for path in sorted((PROJECT_ROOT / "conf" / "methods").glob("*.toml")):
        assert path.stem in STRATEGIES, path
        parse_config({"strategy.name": path.stem, **load_preset(path)})


def test_a_presets_method_table_beats_its_other_keys_but_not_set(presets):
    """conf/sst2-dp.toml-style presets carry each method's settings for their recipe."""
    preset = {"train.lr": 0.0175, "dp.clip": 0.05, "methods.ffa-lora.train.lr": 0.09,
              "methods.fedsvd.train.lr": 0.05}
    merged, applied, source = with_method_preset({**preset, "strategy.name": "ffa-lora"}, explicit={"strategy.name"})
    assert merged["train.lr"] == 0.09 and merged["dp.clip"] == 0.05 and merged["lora.alpha"] == 64.0
    assert not any(k.startswith("methods.") for k in merged)
    assert applied == {"train.lr": 0.09, "lora.alpha": 64.0}
    assert "[methods.ffa-lora]" in source and "ffa-lora.toml" in source
    merged, applied, _ = with_method_preset({**preset, "strategy.name": "ffa-lora", "train.lr": 0.5},
                                            explicit={"strategy.name", "train.lr"})
    assert merged["train.lr"] == 0.5 and "train.lr" not in applied  # --set wins over the table
    merged, applied, source = with_method_preset({**preset, "strategy.name": "fedlora"}, explicit={"strategy.name"})
    assert merged["train.lr"] == 0.0175 and applied == {} and source is None  # another method's table


@pytest.mark.parametrize("table, message", [({"methods.nope.train.lr": 0.1}, "unknown method"),
                                            ({"methods.fedlora.train.nope": 0.1}, "unknown config key"),
                                            ({"methods.fedlora.strategy.name": "fedsvd"}, "strategy.name")])
def test_a_bad_method_table_is_refused_naming_it(table, message):
    with pytest.raises(CFG.ConfigError, match=message):
        with_method_preset({"strategy.name": "fedlora", **table})


def test_fedpower_run_applies_the_presets_method_table(tmp_path, presets, capsys, monkeypatch):
    from fedpower_app import launcher as L

    preset = tmp_path / "recipe.toml"
    preset.write_text('[train]\nlr = 0.0175\n[methods.ffa-lora.train]\nlr = 0.09\n')
    seen = {}
    monkeypatch.setattr(L.cli, "check_launch", lambda overrides, **kw: seen.update(overrides) or (_ for _ in ()).throw(
        CFG.ConfigError("stop here")))
    assert L.main(["--preset", str(preset), "--set", 'strategy.name="ffa-lora"']) == 2
    assert seen["train.lr"] == 0.09 and "[methods.ffa-lora]" in capsys.readouterr().out
    seen.clear()
    assert L.main(["--preset", str(preset), "--set", 'strategy.name="fedlora"']) == 2
    assert seen["train.lr"] == 0.0175


def test_a_grid_cell_takes_its_methods_table_from_the_preset(tmp_path):
    from fedpower_app.experiment import Cell, GridSpec, cell_overrides

    preset = tmp_path / "recipe.toml"
    preset.write_text('[train]\nlr = 0.0175\n[methods.ffa-lora.train]\nlr = 0.09\n[methods.fedsvd.dp]\nclip = 0.1\n')
    spec = GridSpec(tasks=["sst2"], seeds=[0], preset=str(preset), tables={"t": (["fedlora", "ffa-lora", "fedsvd"], [8.0])})
    ov = {m: cell_overrides(spec, Cell("sst2", m, 8.0, 0), tmp_path) for m in ("fedlora", "ffa-lora", "fedsvd")}
    assert [ov[m]["train.lr"] for m in ov] == [0.0175, 0.09, 0.0175]
    assert ov["fedsvd"]["dp.clip"] == 0.1 and "dp.clip" not in ov["fedlora"]
    assert not any(k.startswith("methods.") for o in ov.values() for k in o)
    spec.overrides = {"train.lr": 0.01}  # the grid's own override still wins
    assert cell_overrides(spec, Cell("sst2", "ffa-lora", 8.0, 0), tmp_path)["train.lr"] == 0.01
