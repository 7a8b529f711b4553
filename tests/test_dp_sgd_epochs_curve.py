"""research/dp_sgd_epochs_curve: the "what it would take" figures (points per doubling of the
epochs, the epochs and hours to the goal) come from it, so its epochs, means and fit must be right."""

from __future__ import annotations

import json
import math

import pytest

from research import dp_sgd_epochs_curve


def _run(tmp_path, name, devs, *, b=1000, L=4, sizes=(2000, 2000), wall=100.0, status="completed"):
    d = tmp_path / name
    d.mkdir()
    data = {"status": status, "config": {"train.batch-size": b, "train.local-steps": L},
            "clients": {"dataset_sizes": list(sizes)}, "totals": {"wall_seconds": wall},
            "initial_evaluation": {"validation-accuracy": 0.5},
            "rounds": [{"server_round": i + 1, "validation-accuracy": v} for i, v in enumerate(devs)]}
    (d / "results.json").write_text(json.dumps(data))
    return d


def test_epochs_come_from_each_silos_examples_a_round(tmp_path):
    d = _run(tmp_path, "r", [0.6, 0.7], b=500, L=2, sizes=(1000, 3000))  # 1,000 examples a round over 2,000
    xs, ys = dp_sgd_epochs_curve.run_curve(json.loads((d / "results.json").read_text()))
    assert xs == [0.0, 0.5, 1.0] and ys == [0.5, 0.6, 0.7]


def test_fit_recovers_a_log_linear_curve_and_the_epochs_to_a_goal():
    a, s = dp_sgd_epochs_curve.fit_log2([(4.0, 0.80), (8.0, 0.81), (16.0, 0.82)])
    assert a == pytest.approx(0.78) and s == pytest.approx(0.01)
    assert dp_sgd_epochs_curve.epochs_to_reach(0.85, a, s) == pytest.approx(128.0)
    assert dp_sgd_epochs_curve.epochs_to_reach(0.85, a, -0.01) == math.inf  # a falling line never reaches it
    with pytest.raises(ValueError, match="two or more"):
        dp_sgd_epochs_curve.fit_log2([(4.0, 0.8), (4.0, 0.81)])


def test_main_prints_seed_means_the_fit_and_hours(tmp_path, capsys):
    s0 = _run(tmp_path, "s0", [0.70, 0.80], wall=3600.0)          # 2 epochs a round: 4 epochs, 900 s each
    s1 = _run(tmp_path, "s1", [0.72, 0.82])
    long = _run(tmp_path, "long", [0.7, 0.75, 0.8, 0.82], )       # 8 epochs
    other = _run(tmp_path, "eps3", [0.70, 0.79])
    out = tmp_path / "f.png"
    assert dp_sgd_epochs_curve.main(["--out", str(out), "--run", f"short:{s0}", "--run", f"short:{s1}",
                                "--run", f"long:{long}", "--run", f"eps3:{other}", "--fit", "short", "--fit", "long",
                                "--goal", "0.85", "--goal", "0.83@eps3", "--timing", str(s0)]) == 0
    text = capsys.readouterr().out
    assert "short: final 0.8100 ± 0.0141 dev at 4.00 epochs (n=2)" in text
    assert "+1.00 points per doubling" in text  # 0.81 at 4 epochs, 0.82 at 8
    assert "pace: 900 s per epoch" in text
    assert "goal 0.850: the fitted line reaches it at 64 epochs, about 16.0 h" in text
    # from eps3's final (0.79 at 4 epochs) along +1 point per doubling: 0.83 at 4 * 2^4 = 64 epochs
    assert "goal 0.830: the fitted slope from eps3's final reaches it at 64 epochs" in text
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_refuses_unfinished_runs_and_unknown_fit_labels(tmp_path):
    running = _run(tmp_path, "running", [0.6], status="running")
    with pytest.raises(SystemExit, match="not completed"):
        dp_sgd_epochs_curve.main(["--run", f"x:{running}"])
    done = _run(tmp_path, "done", [0.6])
    with pytest.raises(SystemExit, match="no --run/--curve label"):
        dp_sgd_epochs_curve.main(["--run", f"x:{done}", "--fit", "y"])
