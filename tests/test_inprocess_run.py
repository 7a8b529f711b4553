"""benchmarks/inprocess_run.py: a preset on the in-process grid (many virtual clients, one process)."""

import json

import pytest

from benchmarks import inprocess_run


def test_bad_set_value_fails_before_anything_runs(tmp_path):
    with pytest.raises(SystemExit, match="dp.epsilon"):
        inprocess_run.main(["--preset", "conf/tiny.toml", "--clients", "4", "--name", "x", "--out", str(tmp_path),
                            "--set", "dp.epsilon=lots"])
    assert not any(tmp_path.iterdir())


def test_client_level_run_with_many_clients_accounts_at_the_fixed_cohort(tmp_path, capsys):
    rc = inprocess_run.main([
        "--preset", "conf/tiny.toml", "--clients", "12", "--name", "cd", "--out", str(tmp_path),
        "--set", 'strategy.name="fedlora"', "--set", 'dp.level="client"', "--set", "strategy.client-rate=0.5",
        "--set", "dp.clip=0.5", "--set", "task.synthetic-train-size=240",
        "--set", 'dp.diagnostics="released"'])  # the cohort size per round is a diagnostic at client level
    assert rc == 0
    res = json.loads((tmp_path / "cd" / "results.json").read_text())
    assert res["status"] == "completed" and len(res["rounds"]) == 2
    cal = res["privacy"]["calibration"]
    assert cal["is_valid_guarantee"] and cal["level"] == "client"
    assert 0 < res["rounds"][-1]["epsilon"] <= 8.0 * (1 + 1e-6)
    assert all(0 <= r["sampled"] <= 12 for r in res["rounds"])
    assert "final accuracy" in capsys.readouterr().err


def test_product_entry_point_rejects_a_bad_config_before_training(tmp_path, capsys):
    from fedpower_app.runs import inprocess as R

    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"task.name": "synthetic", "lora.rank": 0, "output-dir": str(tmp_path / "out")}))
    assert R.main(["--config-json", str(cfg), "--clients", "4"]) == 2
    assert "lora.rank" in capsys.readouterr().err and not (tmp_path / "out").exists()
    cfg.write_text("[1, 2]")
    with pytest.raises(SystemExit):
        R.main(["--config-json", str(cfg), "--clients", "4"])
    assert "JSON object" in capsys.readouterr().err


@pytest.mark.parametrize("strategy", ["fedpower", "ffa-lora"])
def test_a_head_run_trains_the_head_on_features_and_every_strategy_averages_it(tmp_path, capsys, strategy):
    """train.what = "head": the silos train the head alone on their cached features under DP-SGD; the
    server's strategy releases the averaged head and leaves the adapters at their initial state;
    the final line sets the accuracy beside the majority baseline."""
    import torch
    from safetensors.torch import load_file

    rc = inprocess_run.main([
        "--preset", "conf/tiny.toml", "--clients", "2", "--name", "head", "--out", str(tmp_path),
        "--set", f'strategy.name="{strategy}"', "--set", 'train.what="head"', "--set", "dp.clip=1.0",
        "--set", "train.lr=0.05", "--set", 'dp.noise="seeded"'])
    assert rc == 0
    res = json.loads((tmp_path / "head" / "results.json").read_text())
    assert res["status"] == "completed" and 0 < res["rounds"][-1]["epsilon"] <= 8.0 * (1 + 1e-6)
    assert "majority baseline" in capsys.readouterr().err
    weights = load_file(str(tmp_path / "head" / "adapter" / "adapter_model.safetensors"))
    heads = [v for k, v in weights.items() if "classifier" in k and k.endswith("weight")]
    assert heads and all(h.abs().sum() > 0 for h in heads)  # the head moved from zero
    assert all(not v.any() for k, v in weights.items() if "lora_B" in k)  # the adapters did not
    assert torch.isfinite(torch.cat([v.flatten() for v in weights.values()])).all()
