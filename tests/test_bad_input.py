"""Bad input never crashes or corrupts a run. Each case is tried the way a user
meets it, and the outcome is recorded here: a clear error naming the cause, before anything
starts, and no run directory left half written."""

from __future__ import annotations

import json

import pytest

from fedpower_app import launcher as L
from tests.test_app_inprocess import run_inprocess


def glue_dir(tmp_path, train_rows: str, dev_rows: str = "a fine film\t1\n", name: str = "train.tsv"):
    d = tmp_path / "glue" / "SST-2"
    d.mkdir(parents=True)
    if train_rows is not None:
        (d / name).write_text("sentence\tlabel\n" + train_rows)
    (d / "dev.tsv").write_text("sentence\tlabel\n" + dev_rows)
    return tmp_path / "glue"


def launch(tmp_path, capsys, *sets):
    out = tmp_path / "outputs"
    rc = L.main(["--set", f'output-dir="{out}"', "--flwr-home", str(tmp_path / "home"), *sum((["--set", s] for s in sets), [])])
    err = capsys.readouterr().err
    return rc, err, out


CASES = {
    "malformed run config (bad value)": (["lora.rank=0"], "config key 'lora.rank' must be >= 1"),
    "malformed run config (unknown key)": (["lora.rnak=4"], "unknown config key(s): lora.rnak"),
    "malformed run config (bad TOML type)": (['train.batch-size="many"'], "train.batch-size"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_malformed_run_config_fails_before_anything_starts(tmp_path, capsys, case):
    sets, message = CASES[case]
    rc, err, out = launch(tmp_path, capsys, *sets)
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists() and not (tmp_path / "home").exists()  # nothing started, nothing written


def test_missing_data_file_is_named(tmp_path, capsys):
    data = glue_dir(tmp_path, None)
    rc, err, out = launch(tmp_path, capsys, 'task.name="sst2"', f'task.data-dir="{data}"')
    assert rc == 2 and "split 'train' not found" in err and str(data / "SST-2") in err
    assert not out.exists()


def test_glue_file_with_a_bad_row_is_named_with_its_line(tmp_path, capsys):
    rows = "".join(f"sentence {i}\t{i % 2}\n" for i in range(40)) + "a broken row\tmaybe\n"
    data = glue_dir(tmp_path, rows)
    rc, err, out = launch(tmp_path, capsys, 'task.name="sst2"', f'task.data-dir="{data}"')
    assert rc == 2 and "Unknown label 'maybe'" in err and "train.tsv, line 42" in err
    assert not out.exists()


def test_dataset_smaller_than_the_batch_is_refused_before_start(tmp_path, capsys):
    rc, err, out = launch(tmp_path, capsys, "task.synthetic-train-size=50", "train.batch-size=16")
    assert rc == 2 and "fewer training examples (8) than config key 'train.batch-size' = 16" in err
    assert not out.exists()
    rows = "".join(f"sentence {i}\t{i % 2}\n" for i in range(30))
    data = glue_dir(tmp_path, rows)
    rc, err, _ = launch(tmp_path, capsys, 'task.name="sst2"', f'task.data-dir="{data}"', "train.batch-size=16")
    assert rc == 2 and "than config key 'train.batch-size' = 16 (30 examples over 6 silos)" in err


def test_in_a_deployment_the_server_fails_the_run_cleanly(tmp_path):
    """Without the launcher (a SuperLink deployment), the ServerApp finds the same problem after the
    size query, before any round: results.json says failed and why, and no adapter is written."""
    from client_app.app import app as client_app
    from fedpower_app.config import parse_config
    from fedpower_app.runs.inprocess_grid import InProcessGrid
    from server_app import app as server
    from tests.test_app_inprocess import TINY

    cfg = parse_config({**TINY, "output-dir": str(tmp_path), "run-name": "run", "num-server-rounds": 1,
                        "task.synthetic-train-size": 20, "train.batch-size": 16})
    with pytest.raises(ValueError, match="fewer training examples"):
        server.run_server(InProcessGrid(client_app, 2, cfg.to_dict()), cfg)
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    assert res["status"] == "failed" and "fewer training examples (10)" in res["error"] and res["rounds"] == []
    assert not (tmp_path / "run" / "adapter").exists() and not (tmp_path / "run" / "checkpoint.pt").exists()
