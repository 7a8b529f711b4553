"""research/sst2_dp_figure: RESULTS.md's opening-table figures and their mean ± std come from it,
so it must average the right rounds (the final one, dev accuracy) and refuse runs that do not
belong in the figure."""

from __future__ import annotations

import json

import pytest

from research import sst2_dp_figure


def _run(tmp_path, name, devs, vals, *, eps=8.0, status="completed"):
    d = tmp_path / name
    d.mkdir()
    rounds = [{"server_round": i + 1, "validation-accuracy": dv, "validation-from-train-accuracy": vl, "accuracy": vl}
              for i, (dv, vl) in enumerate(zip(devs, vals))]
    data = {"status": status, "privacy": {"epsilon": eps}, "rounds": rounds,
            "initial_evaluation": {"validation-accuracy": 0.5, "validation-from-train-accuracy": 0.51, "accuracy": 0.51}}
    (d / "results.json").write_text(json.dumps(data))
    return d


def test_final_round_dev_mean_and_std_over_seeds(tmp_path, capsys):
    a = _run(tmp_path, "s0", [0.70, 0.80, 0.82], [0.71, 0.81, 0.84])
    b = _run(tmp_path, "s1", [0.60, 0.85, 0.84], [0.62, 0.86, 0.86])
    out = tmp_path / "fig.png"
    assert sst2_dp_figure.main(["--eps", "8", "--out", str(out), "--run", f"fedlora:0:{a}", "--run", f"fedlora:1:{b}"]) == 0
    text = capsys.readouterr().out
    # the final round (not the best one: seed 1's 0.85 in round 2 is not used), dev not validation
    assert "fedlora: dev 0.8300 ± 0.0141" in text
    assert "validation 0.8500 ± 0.0141" in text
    assert "n=2" in text
    assert out.exists() and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_as_dev_plots_dev_not_the_validation_rows():
    data = {"rounds": [{"validation-accuracy": 0.8, "validation-from-train-accuracy": 0.9, "accuracy": 0.9}],
            "initial_evaluation": {"validation-accuracy": 0.5, "accuracy": 0.6}}
    dev = sst2_dp_figure.as_dev(data)
    assert dev["rounds"][0]["accuracy"] == 0.8 and dev["initial_evaluation"]["accuracy"] == 0.5
    assert data["rounds"][0]["accuracy"] == 0.9  # the input is not modified


def test_refuses_unfinished_runs_and_runs_at_another_epsilon(tmp_path):
    running = _run(tmp_path, "running", [0.7], [0.7], status="running")
    with pytest.raises(SystemExit, match="not completed"):
        sst2_dp_figure.main(["--eps", "8", "--out", str(tmp_path / "f.png"), "--run", f"fedlora:0:{running}"])
    eps3 = _run(tmp_path, "eps3", [0.7], [0.7], eps=3.0)
    with pytest.raises(SystemExit, match="not 8"):
        sst2_dp_figure.main(["--eps", "8", "--out", str(tmp_path / "f.png"), "--run", f"fedlora:0:{eps3}"])
