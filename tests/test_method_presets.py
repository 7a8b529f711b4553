"""Method presets (issue #32): `--set strategy.name=X` runs X at its tuned settings
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
    assert applied == {"train.lr": 0.3, "lora.alpha": 64.0} and path == presets / "ffa-lora.toml"
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
