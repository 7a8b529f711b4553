"""fedpower-experiment: grid spec, resume, aggregation math, tables and plots.

The fast tests use synthetic results.json files (no Flower); the slow one runs a tiny grid
(2 methods x 1 epsilon x 1 seed x 2 rounds) end to end through the real `flwr run`.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from pathlib import Path

import pytest

from fedpower_app import experiment as X
from fedpower_app.config import PROJECT_ROOT, load_preset, parse_config

TINY = str(PROJECT_ROOT / "conf" / "tiny.toml")


# ------------------------------------------------------------------------------------------------
# helpers: synthetic results.json
# ------------------------------------------------------------------------------------------------

def fake_results(accs, *, status="completed", eps_final=5.9, agg=0.01, bytes_round=1000, splits=("validation",),
                 wall=10.0, init_acc=0.5, method="fedpower"):
    """A results.json payload with one evaluated round per entry of ``accs`` (a float, or a dict
    split -> accuracy)."""
    rounds = []
    for i, a in enumerate(accs, 1):
        per = a if isinstance(a, dict) else {s: a for s in splits}
        row = {"server_round": i, "round_type": "powerdp", "accuracy": per[splits[0]], "loss": 0.7,
               "epsilon": None if eps_final is None else eps_final * i / len(accs), "bytes_up": bytes_round,
               "bytes_down": 2 * bytes_round, "aggregation_seconds": agg, "wall_seconds": wall * i / len(accs),
               "sampled": 3, "aggregated": 3, "dropped": []}
        for s in splits:
            row[f"{s}-accuracy"] = per[s]
            row[f"{s}-loss"] = 0.7
        rounds.append(row)
    init = {"accuracy": init_acc, "loss": 0.69, **{f"{s}-accuracy": init_acc for s in splits}}
    return {"status": status, "config": {"strategy.name": method}, "privacy": {"calibration": {"z": 0.7}},
            "initial_evaluation": init, "rounds": rounds,
            "totals": {"final_accuracy": rounds[-1]["accuracy"] if rounds else None,
                       "best_accuracy": max(r["accuracy"] for r in rounds) if rounds else None,
                       "final_epsilon": rounds[-1]["epsilon"] if rounds else None, "wall_seconds": wall}}


def write_cell(out: Path, cell: X.Cell, payload: dict) -> None:
    path = X.results_path(out, cell)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload))


def tiny_spec(**kw) -> X.GridSpec:
    base = dict(tasks=["synthetic"], seeds=[0], tables={"1": (["fedpower", "fedlora"], [8.0])}, preset=TINY,
                supernodes=3)
    base.update(kw)
    return X.GridSpec(**base)


# ------------------------------------------------------------------------------------------------
# grid specification
# ------------------------------------------------------------------------------------------------

def test_methods_and_epsilons():
    assert X.method_overrides("fedpower-F5") == {"strategy.name": "fedpower", "strategy.refactor-every": 5}
    assert X.method_overrides("ffa-lora")["strategy.name"] == "ffa-lora"
    assert X.canonical_method("fedpower-F1") == "fedpower"
    assert X.refactor_every("fedlora") is None and X.refactor_every("fedpower") == 1
    for bad in ("fedavg", "fedpower-F0", "fedpower-Fx", "FedPower"):
        with pytest.raises(X.GridError, match="unknown method"):
            X.method_overrides(bad)
    assert X.parse_epsilon("none") is None and X.parse_epsilon("6") == 6.0 and X.parse_epsilon(3) == 3.0
    for bad in ("-1", 0, "abc", "nan", True):
        with pytest.raises(X.GridError, match="bad epsilon"):
            X.parse_epsilon(bad)


def test_cells_are_deduplicated_and_ids_deterministic(tmp_path):
    spec = X.GridSpec(tasks=["sst2"], seeds=[0, 1],
                      tables={"1": (X.TABLE_METHODS["1"], [None, 6.0]), "2": (X.TABLE_METHODS["2"], [6.0]),
                              "3": (["fedlora", "fedpower-F5", "fedpower"], [6.0])})
    cells = spec.cells()
    ids = [c.cell_id for c in cells]
    assert len(ids) == len(set(ids))
    # table 1: 3 x 2 x 2 = 12; table 2 adds input/output x 2 seeds = 4; table 3 adds F5 x 2 seeds = 2
    assert len(cells) == 18
    assert "sst2__fedpower__eps6__s1" in ids and "sst2__fedlora__nonprivate__s0" in ids
    assert "sst2__fedpower-F5__eps6__s0" in ids
    assert [c.cell_id for c in spec.cells()] == ids  # stable order


def test_cell_overrides(tmp_path):
    spec = X.GridSpec(tasks=["sst2"], seeds=[3], tables={"1": (["fedpower-F5"], [None, 6.0])},
                      preset=str(PROJECT_ROOT / "conf" / "cpu-sst2.toml"), data_dir="/data/SST-2", nonprivate_lr=0.05,
                      overrides={"num-server-rounds": 4})
    private, nonprivate = [c for c in spec.cells() if c.epsilon], [c for c in spec.cells() if c.epsilon is None]
    ov = X.cell_overrides(spec, private[0], tmp_path)
    assert ov["strategy.name"] == "fedpower" and ov["strategy.refactor-every"] == 5
    assert ov["dp.level"] == "sample" and ov["dp.epsilon"] == 6.0 and ov["seed"] == 3
    assert ov["num-server-rounds"] == 4 and ov["task.data-dir"] == "/data/SST-2"
    assert ov["train.lr"] == load_preset(spec.preset)["train.lr"]
    assert ov["run-name"] == private[0].cell_id and ov["output-dir"] == str((tmp_path / "cells").resolve())
    ov = X.cell_overrides(spec, nonprivate[0], tmp_path)
    assert ov["dp.level"] == "none" and ov["train.lr"] == 0.05
    parse_config(ov)


def test_validate_rejects_bad_grids(tmp_path):
    with pytest.raises(X.GridError, match="unknown task"):
        X.validate(tiny_spec(tasks=["cola"]), tmp_path)
    with pytest.raises(X.GridError, match="unknown method"):
        X.validate(tiny_spec(tables={"1": (["fedavg"], [3.0])}), tmp_path)
    with pytest.raises(X.GridError, match="lora.rank"):
        X.validate(tiny_spec(overrides={"lora.rank": 0}), tmp_path)
    with pytest.raises(X.GridError, match="unknown config key"):
        X.validate(tiny_spec(overrides={"dp.sigma": 1.0}), tmp_path)


@pytest.mark.parametrize("argv,message", [
    (["--table", "1", "--methods", "fedavg"], "unknown method"),
    (["--table", "1", "--epsilons", "-3"], "bad epsilon"),
    (["--table", "1", "--epsilons", "abc"], "bad epsilon"),
    (["--table", "1", "--tasks", "cola"], "unknown task"),
    (["--table", "1", "--set", "lora.rank=0"], "lora.rank"),
    (["--methods", "fedpower"], "no output directory"),
    (["--table", "1", "--backend", "inprocess", "--supernodes", "1"], "needs --supernodes >= 2"),
    (["--table", "1", "--backend", "inprocess", "--threads", "0"], "--threads must be >= 1"),
])
def test_cli_errors_exit_2(argv, message, tmp_path, capsys):
    if "--out" not in argv and message != "no output directory":
        argv = argv + ["--out", str(tmp_path / "o")]
    assert X.main(argv) == 2
    assert message in capsys.readouterr().err


def test_help_exits_0(capsys):
    with pytest.raises(SystemExit) as exc:
        X.main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for word in ("--table", "--grid", "--epsilons", "fedpower-F<n>", "--report-only", "resume"):
        assert word in text


def test_grid_files_and_table_flags(tmp_path):
    from argparse import Namespace

    parser = X.make_parser()
    args = parser.parse_args(["--grid", str(PROJECT_ROOT / "conf/grids/cpu-sst2.toml"), "--table", "all",
                              "--data-dir", "/work/shared/glue/SST-2", "--out", str(tmp_path)])
    spec, out = X.build_spec(args)
    assert out == tmp_path.resolve()
    assert spec.seeds == [0, 1, 2] and spec.nonprivate_lr == 0.005
    assert spec.tables["1"][1] == [None, 9.0, 6.0, 3.0]
    assert spec.tables["2"][1] == [6.0] and spec.tables["3"][1] == [6.0]
    cells = X.validate(spec, out)
    assert len(cells) == 36 + 6 + 6
    # paper grid: per-task presets, all four tasks
    args = parser.parse_args(["--grid", str(PROJECT_ROOT / "conf/grids/paper.toml"), "--table", "1", "--out", str(tmp_path)])
    spec, _ = X.build_spec(args)
    assert spec.tasks == ["sst2", "qnli", "mnli", "qqp"] and len(spec.seeds) == 5
    cells = X.validate(spec, tmp_path)
    ov = X.cell_overrides(spec, next(c for c in cells if c.task == "mnli"), tmp_path)
    assert ov["model.name"] == "FacebookAI/roberta-large" and ov["task.name"] == "mnli"
    assert ov["num-server-rounds"] == 200 and ov["train.batch-size"] == 128
    # the CLI table defaults
    spec, _ = X.build_spec(parser.parse_args(["--table", "3", "--out", str(tmp_path)]))
    assert spec.tables == {"3": (X.TABLE_METHODS["3"], [3.0])}
    spec, _ = X.build_spec(parser.parse_args(["--table", "2", "--epsilons", "6", "none", "--out", str(tmp_path)]))
    assert spec.tables["2"] == (X.TABLE_METHODS["2"], [6.0, None])
    assert isinstance(Namespace, type)
    # the Table 3 supplement: the paper's F = 1/5/10 need T >= 10 rounds
    args = parser.parse_args(["--grid", str(PROJECT_ROOT / "conf/grids/cpu-sst2-table3.toml"), "--table", "3",
                              "--out", str(tmp_path)])
    spec, _ = X.build_spec(args)
    cells = X.validate(spec, tmp_path)
    assert sorted({c.method for c in cells}) == ["fedlora", "fedpower", "fedpower-F10", "fedpower-F5"]
    assert len(cells) == 12
    ov = X.cell_overrides(spec, next(c for c in cells if c.method == "fedpower-F10"), tmp_path)
    assert ov["num-server-rounds"] == 10 and ov["strategy.refactor-every"] == 10


def test_cross_device_grid_runs_in_process(tmp_path):
    parser = X.make_parser()
    args = parser.parse_args(["--grid", str(PROJECT_ROOT / "conf/grids/cross-device-sst2.toml"), "--out", str(tmp_path)])
    spec, _ = X.build_spec(args)
    assert spec.backend == "inprocess" and spec.supernodes == 1000 and spec.threads == 2
    cells = X.validate(spec, tmp_path)
    assert len(cells) == (4 * 2 - 1) * 3  # without DP the paper's PowerDP variant is FedPower's run
    ov = X.cell_overrides(spec, next(c for c in cells if c.method == "fedpower-powerdp" and c.epsilon == 8.0), tmp_path)
    assert ov["dp.level"] == "client" and ov["strategy.client-refactorization"] == "powerdp"
    # the command line wins over the grid file, and the spec round-trips through the manifest
    spec, _ = X.build_spec(parser.parse_args(["--grid", str(PROJECT_ROOT / "conf/grids/cross-device-sst2.toml"),
                                              "--backend", "flwr", "--threads", "1", "--out", str(tmp_path)]))
    assert (spec.backend, spec.threads) == ("flwr", 1)
    assert X.GridSpec.from_dict(spec.to_dict()) == spec


def test_round_lines_are_picked_from_a_run_log():
    line = "\x1b[92mINFO \x1b[0m:      [round 3/10 ffa-delta] acc 0.5722 loss 0.6915 | eps 5.177/8\n"
    assert X._round_line(line) == "[round 3/10 ffa-delta] acc 0.5722 loss 0.6915 | eps 5.177/8"
    assert X._round_line("INFO : privacy: z=0.9\n") is None


def test_output_reader_stops_at_the_deadline_of_a_silent_child():
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    try:
        t0 = time.time()
        lines = list(X._lines_until(proc, time.time() + 10))  # 10 s: Python's start on a busy machine
        assert lines == ["started\n"] and time.time() - t0 < 25 and proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_inprocess_cell_past_its_timeout_is_stopped_and_reported(tmp_path):
    import psutil

    spec = tiny_spec(tables={"1": (["fedlora"], [8.0])}, backend="inprocess", supernodes=4)
    cell = spec.cells()[0]
    children_before = {p.pid for p in psutil.Process().children(recursive=True)}
    entry = X.run_cell(spec, cell, tmp_path, flwr_home=tmp_path / "unused", port=0, echo=False, timeout=2,
                       keep_adapters=False)
    assert entry["process_status"] == "timed out after 2 s" and entry["status"] != "completed"
    assert entry["error"] == "timed out after 2 s" and entry["seconds"] < 60
    left = {p.pid for p in psutil.Process().children(recursive=True)} - children_before
    assert not left  # the cell's process is gone
    assert json.loads((tmp_path / "cells" / cell.cell_id / "cell.json").read_text())["backend"] == "inprocess"


def test_inprocess_grid_runs_skips_finished_cells_and_reports(tmp_path, capsys):
    """A 2-cell grid on the in-process backend, each cell a child process with 8 virtual clients at
    client level; the second invocation runs nothing; the report is written."""
    out = tmp_path / "grid"
    argv = ["--methods", "fedlora", "ffa-lora", "--epsilons", "8", "--seeds", "0", "--tasks", "synthetic",
            "--preset", TINY, "--supernodes", "8", "--backend", "inprocess", "--threads", "1", "--out", str(out),
            "--set", 'dp.level="client"', "--set", "strategy.client-rate=0.5", "--set", "task.synthetic-train-size=160",
            "--cell-timeout", "600"]
    assert X.main(argv) == 0, capsys.readouterr()
    printed = capsys.readouterr().out
    assert "[cell 1/2]" in printed and "[cell 2/2]" in printed
    assert "  synthetic__fedlora__eps8__s0: [round 2/2" in printed  # the cell's rounds as they finish
    for method in ("fedlora", "ffa-lora"):
        cell_dir = out / "cells" / f"synthetic__{method}__eps8__s0"
        res = json.loads((cell_dir / "results.json").read_text())
        assert res["status"] == "completed" and res["config"]["strategy.name"] == method
        assert res["privacy"]["calibration"]["level"] == "client" and len(res["clients"]["dataset_sizes"]) == 8
        cell = json.loads((cell_dir / "cell.json").read_text())
        assert cell["backend"] == "inprocess" and cell["exit_code"] == 0 and cell["status"] == "completed"
        assert "final accuracy" in (cell_dir / "run.log").read_text()
        assert not (cell_dir / "adapter").exists() and not (cell_dir / "checkpoint.pt").exists()
    assert "| ε = 8 | FedLoRA |" in (out / "table_custom.md").read_text()
    assert not (out / "flwr-home").exists()  # no Flower state for in-process cells
    assert X.main(argv) == 0
    assert "2 already finished, 0 to run" in capsys.readouterr().out


@pytest.mark.parametrize("grid", sorted(p.name for p in (PROJECT_ROOT / "conf" / "grids").glob("*.toml")))
def test_every_shipped_grid_validates(grid, tmp_path):
    parser = X.make_parser()
    path = PROJECT_ROOT / "conf/grids" / grid
    tables = ["--table", "all"] if any(k.startswith("table") for k in X._load_grid_file(str(path))) else []
    spec, _ = X.build_spec(parser.parse_args(["--grid", str(path), *tables, "--out", str(tmp_path)]))
    assert X.validate(spec, tmp_path)  # every cell's run config parses


def test_paper_presets():
    for task in ("sst2", "qnli", "mnli", "qqp"):
        cfg = parse_config(load_preset(PROJECT_ROOT / "conf" / f"paper-{task}.toml"))
        assert cfg["task.name"] == task and cfg["model.name"] == "FacebookAI/roberta-large"
        assert cfg["num-server-rounds"] == 200 and cfg["train.batch-size"] == 128 and cfg["lora.rank"] == 8
        assert cfg["lora.dropout"] == 0.05 and cfg["train.lr"] == 0.5 and cfg["strategy.client-rate"] == 0.5
        assert cfg["dp.clip"] == 2.0 and cfg["dp.delta"] == 1e-5 and cfg["dp.level"] == "sample"
        assert cfg["dp.sample-mode"] == "two-stage" and cfg["dp.calibration"] == "rigorous"
        assert cfg.target_modules == ["query", "value"]


# ------------------------------------------------------------------------------------------------
# resume (fast, no Flower)
# ------------------------------------------------------------------------------------------------

def test_inprocess_workers_share_a_grid_cell_by_cell(tmp_path, monkeypatch):
    """Two in-process invocations on one grid: a cell held by the other one is skipped, and the
    manifest keeps both invocations' entries."""
    spec = tiny_spec(tables={"1": (["fedpower", "fedlora"], [8.0])}, backend="inprocess")
    first, second = spec.cells()
    other = X.Manifest(tmp_path)
    other.invocation_id = "other"
    other.data["invocations"].append({"id": "other", "ran": [first.cell_id]})
    other.data["cells"][first.cell_id] = {"method": "fedpower", "seconds": 12.0}
    other.dirty.add(first.cell_id)
    other.save()
    held = X._try_lock(tmp_path / "locks" / f"{first.cell_id}.lock")  # the other worker runs this cell
    assert held is not None and X._try_lock(tmp_path / "locks" / f"{first.cell_id}.lock") is None
    also_held = X._try_lock(tmp_path / ".grid.lock", shared=True)
    write_cell(tmp_path, first, {"status": "running"})

    def fake_run_cell(spec_, cell, out, **kw):
        write_cell(out, cell, fake_results([0.6]))
        return {"status": "completed", "seconds": 1.0}

    monkeypatch.setattr(X.runner, "run_cell", fake_run_cell)
    logged = []
    summary = X.run_grid(spec, tmp_path, log=logged.append)
    assert summary["ran"] == [second.cell_id] and summary["unfinished"] == [first.cell_id]
    assert summary["running_elsewhere"] == [first.cell_id]  # not this invocation's failure
    assert any("taken by another fedpower-experiment process" in line for line in logged)
    assert not any("re-running" in line for line in logged)  # a cell another worker runs is not a failed one
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert [inv["id"] for inv in manifest["invocations"]][0] == "other" and len(manifest["invocations"]) == 2
    assert manifest["cells"][first.cell_id]["seconds"] == 12.0  # the other worker's entry is kept
    assert manifest["cells"][second.cell_id]["status"] == "completed"
    # the other worker saving again later does not put back an entry it wrote before
    other.save()
    assert json.loads((tmp_path / "manifest.json").read_text())["cells"][second.cell_id].get("seconds") == 1.0
    # worker A writes a failed attempt, worker B re-runs the cell later: A's next save keeps B's entry
    worker_a, worker_b = X.Manifest(tmp_path), X.Manifest(tmp_path)
    worker_a.data["cells"][second.cell_id] = {"error": "boom", "attempts": 1}
    worker_a.dirty.add(second.cell_id)
    worker_a.save()
    worker_b.data["cells"][second.cell_id] = {"seconds": 2.0, "attempts": 2}
    worker_b.dirty.add(second.cell_id)
    worker_b.save()
    worker_a.save()
    assert X.Manifest(tmp_path).data["cells"][second.cell_id] == {"seconds": 2.0, "attempts": 2}
    # --max-cells counts the cells this invocation runs, not the ones another one holds
    write_cell(tmp_path, second, {"status": "running"})
    third = X.GridSpec(**{**spec.__dict__, "seeds": [0, 1]})
    summary = X.run_grid(third, tmp_path, log=logged.append, max_cells=1)
    assert summary["ran"] == [second.cell_id]
    # a Flower grid cannot share: its invocations stop the one local SuperLink
    with pytest.raises(X.GridBusy, match="another fedpower-experiment"):
        X.run_grid(X.GridSpec(**{**spec.__dict__, "backend": "flwr"}), tmp_path, log=logged.append)
    held.close()
    also_held.close()


def test_grid_locks_tolerate_probes_failures_and_count_only_own_work(tmp_path, monkeypatch):
    """A probe's momentary hold is not a running cell; a failure before the loop frees the grid lock;
    the ETA counts only the cells this invocation can still run."""
    import threading

    path = tmp_path / "locks" / "c.lock"
    probe = X._try_lock(path)  # another worker's _held probe, released a moment later
    threading.Timer(0.05, probe.close).start()
    lock = X._try_lock(path, patience=X.PROBE_PATIENCE_S)
    assert lock is not None
    assert X._try_lock(path, patience=0.05) is None  # a cell really running stays held
    lock.close()

    spec = tiny_spec(tables={"1": (["fedpower", "fedlora", "ffa-lora"], [8.0])}, backend="inprocess")

    def broken_manifest(*a, **k):
        raise OSError("disk full")

    with monkeypatch.context() as m:
        m.setattr(X.runner, "Manifest", broken_manifest)
        with pytest.raises(OSError, match="disk full"):
            X.run_grid(spec, tmp_path, log=lambda msg: None)
    exclusive = X._try_lock(tmp_path / ".grid.lock")
    assert exclusive is not None  # not left held by the failed invocation
    exclusive.close()

    first, second, third = spec.cells()
    held = X._try_lock(tmp_path / "locks" / f"{third.cell_id}.lock")  # another worker runs the third

    def fake_run_cell(spec_, cell, out, **kw):
        write_cell(out, cell, fake_results([0.6]))
        return {"status": "completed", "seconds": 1.0}

    monkeypatch.setattr(X.runner, "run_cell", fake_run_cell)
    logged: list[str] = []
    summary = X.run_grid(spec, tmp_path, log=logged.append)
    assert summary["ran"] == [first.cell_id, second.cell_id] and summary["running_elsewhere"] == [third.cell_id]
    etas = [line.split("ETA ")[1] for line in logged if "ETA" in line]
    assert etas[0].endswith("for 1 more") and etas[1].endswith("for 0 more")
    held.close()


def test_resume_skips_finished_cells(tmp_path, monkeypatch):
    spec = tiny_spec(tables={"1": (["fedpower", "fedlora"], [8.0])}, seeds=[0, 1])
    cells = spec.cells()
    for cell in cells:
        write_cell(tmp_path, cell, fake_results([0.6, 0.7]))
    calls = []
    monkeypatch.setattr(X.runner, "run_cell", lambda *a, **k: calls.append(a) or {})
    import fedpower_app.launcher as L

    monkeypatch.setattr(L, "stop_local_superlink", lambda *a, **k: calls.append("stop"))
    summary = X.run_grid(spec, tmp_path, log=lambda *_: None)
    assert calls == [] and summary["ran"] == [] and summary["skipped"] == 4 and summary["unfinished"] == []
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert all(c["status"] == "completed" for c in manifest["cells"].values())
    assert manifest["invocations"][-1]["skipped"] == 4
    # and through the CLI: 0 cells to run, tables written, exit 0
    rc = X.main(["--table", "1", "--methods", "fedpower", "fedlora", "--epsilons", "8", "--seeds", "0", "1",
                 "--tasks", "synthetic", "--preset", TINY, "--supernodes", "3", "--out", str(tmp_path)])
    assert rc == 0 and calls == []
    assert (tmp_path / "table1.md").exists()
    # --report-only re-renders from the manifest's grid, without running anything
    (tmp_path / "table1.md").unlink()
    assert X.main(["--out", str(tmp_path), "--report-only"]) == 0 and calls == []
    assert "| ε = 8 | FedPower | 70.00 ± 0.00 |" in (tmp_path / "table1.md").read_text()


def test_resume_reruns_failed_and_interrupted_cells(tmp_path, monkeypatch):
    spec = tiny_spec(seeds=[0])
    done, failed = spec.cells()
    write_cell(tmp_path, done, fake_results([0.6, 0.7]))
    write_cell(tmp_path, failed, fake_results([0.6], status="failed"))
    assert X.cell_status(tmp_path, failed) == "failed" and not X.is_finished(tmp_path, failed)
    ran = []

    def fake_run_cell(spec_, cell, out, **kw):
        ran.append(cell.cell_id)
        write_cell(out, cell, fake_results([0.55, 0.65], status="stopped-budget"))
        return {"status": X.cell_status(out, cell)}

    monkeypatch.setattr(X.runner, "run_cell", fake_run_cell)
    import fedpower_app.launcher as L

    monkeypatch.setattr(L, "stop_local_superlink", lambda *a, **k: None)
    logs = []
    summary = X.run_grid(spec, tmp_path, log=logs.append)
    assert ran == [failed.cell_id] and summary["unfinished"] == []
    assert any("re-running 1" in line and failed.cell_id in line for line in logs)
    # a cell that keeps failing is reported and makes the CLI exit 1
    monkeypatch.setattr(X.runner, "run_cell", lambda spec_, cell, out, **kw: {"status": "failed", "error": "boom"})
    write_cell(tmp_path, done, {"status": "running", "rounds": []})  # interrupted run
    summary = X.run_grid(spec, tmp_path, log=logs.append)
    assert summary["failed"] == [done.cell_id] and summary["unfinished"] == [done.cell_id]
    assert any("FAILED" in line and "boom" in line for line in logs)


def test_grid_stops_after_consecutive_failures(tmp_path, monkeypatch):
    spec = tiny_spec(seeds=[0, 1, 2])  # 6 cells
    ran = []
    monkeypatch.setattr(X.runner, "run_cell", lambda spec_, cell, out, **kw: ran.append(cell.cell_id) or {"status": "missing"})
    import fedpower_app.launcher as L

    monkeypatch.setattr(L, "stop_local_superlink", lambda *a, **k: None)
    logs = []
    summary = X.run_grid(spec, tmp_path, log=logs.append, max_consecutive_failures=3)
    assert len(ran) == 3 and len(summary["unfinished"]) == 6 and any("3 cells failed in a row" in m for m in logs)


def test_flwr_home_never_inside_the_app(tmp_path):
    inside = PROJECT_ROOT / "results" / "x"
    home = X.default_flwr_home(inside)
    assert not X._inside(home, PROJECT_ROOT) and X.default_flwr_home(tmp_path) == tmp_path.resolve() / "flwr-home"
    with pytest.raises(X.GridError, match="inside the app directory"):
        X.run_grid(tiny_spec(), tmp_path, flwr_home=PROJECT_ROOT / "flwr-home", log=lambda *_: None)


def _interrupted_cell(out: Path, spec: X.GridSpec, cell: X.Cell, *, overrides=None) -> Path:
    """What a killed attempt leaves: cell.json with its overrides, results.json 'running' after
    two rounds, and the per-round checkpoint."""
    cell_dir = out / "cells" / cell.cell_id
    write_cell(out, cell, fake_results([0.55, 0.6], status="running"))
    ov = X.cell_overrides(spec, cell, out) if overrides is None else overrides
    (cell_dir / "cell.json").write_text(json.dumps({"overrides": ov}))
    (cell_dir / "checkpoint.pt").write_bytes(b"checkpoint of round 2")
    return cell_dir


def _fake_run_flwr(out, cell, calls, outputs):
    from types import SimpleNamespace

    def run_flwr(root, overrides, **kw):
        cell_dir = out / "cells" / cell.cell_id
        calls.append({"resume": overrides.get("resume", False),
                      "checkpoint": (cell_dir / "checkpoint.pt").exists()})
        output = outputs.pop(0)
        status = "failed" if "Error" in output else "completed"
        write_cell(out, cell, fake_results([0.55, 0.6, 0.7], status=status))
        return SimpleNamespace(run_id=7, status=f"finished:{status}", seconds=1.0, output=output)
    return run_flwr


def test_interrupted_cell_resumes_from_its_checkpoint(tmp_path, monkeypatch):
    import fedpower_app.launcher as L

    spec = tiny_spec()
    cell = spec.cells()[0]
    _interrupted_cell(tmp_path, spec, cell)
    calls = []
    monkeypatch.setattr(L, "run_flwr", _fake_run_flwr(tmp_path, cell, calls, [""]))
    monkeypatch.setattr(X.backends, "_stop_run", lambda *a, **k: None)
    entry = X.run_cell(spec, cell, tmp_path, flwr_home=tmp_path / "home", port=1, echo=False, timeout=None,
                       keep_adapters=False)
    assert calls == [{"resume": True, "checkpoint": True}]  # the checkpoint was kept and resumed
    assert entry["status"] == "completed" and entry["resumed_after_round"] == 2
    assert "resume" not in entry["overrides"]  # the cell's identity is unchanged
    assert entry["code"] == X.code_version()  # which code ran the cell (the FAB carries no .git)
    assert not (tmp_path / "cells" / cell.cell_id / "checkpoint.pt").exists()  # finished: dropped


def test_code_version_names_the_commit_and_ignores_result_files(tmp_path):
    import subprocess

    assert X.code_version(tmp_path) == {"git_commit": None, "code_modified": None}  # not a checkout
    git = lambda *a: subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True, text=True)
    git("init", "-q")
    (tmp_path / "fedpower_app").mkdir()
    (tmp_path / "fedpower_app" / "x.py").write_text("a = 1\n")
    (tmp_path / "results.json").write_text("{}\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x")
    head = git("rev-parse", "HEAD").stdout.strip()
    assert X.code_version(tmp_path) == {"git_commit": head, "code_modified": False}
    (tmp_path / "results.json").write_text("{\"a\": 1}\n")  # a grid's own output: not code
    assert X.code_version(tmp_path)["code_modified"] is False
    (tmp_path / "fedpower_app" / "x.py").write_text("a = 2\n")
    assert X.code_version(tmp_path) == {"git_commit": head, "code_modified": True}


def test_interrupted_cell_with_other_overrides_or_a_bad_checkpoint_starts_over(tmp_path, monkeypatch):
    import fedpower_app.launcher as L

    spec = tiny_spec()
    cell = spec.cells()[0]
    monkeypatch.setattr(X.backends, "_stop_run", lambda *a, **k: None)
    # another configuration (the grid file changed since): never resumed
    _interrupted_cell(tmp_path, spec, cell, overrides={**X.cell_overrides(spec, cell, tmp_path), "train.lr": 9.0})
    calls = []
    monkeypatch.setattr(L, "run_flwr", _fake_run_flwr(tmp_path, cell, calls, [""]))
    X.run_cell(spec, cell, tmp_path, flwr_home=tmp_path / "home", port=1, echo=False, timeout=None,
               keep_adapters=False)
    assert calls == [{"resume": False, "checkpoint": False}]
    # the ServerApp refuses the checkpoint (damaged): the cell runs again from round 1, once
    _interrupted_cell(tmp_path, spec, cell)
    calls = []
    monkeypatch.setattr(L, "run_flwr", _fake_run_flwr(tmp_path, cell, calls, ["CheckpointError: bad header", ""]))
    entry = X.run_cell(spec, cell, tmp_path, flwr_home=tmp_path / "home", port=1, echo=False, timeout=None,
                       keep_adapters=False)
    assert calls == [{"resume": True, "checkpoint": True}, {"resume": False, "checkpoint": False}]
    assert entry["status"] == "completed" and "resumed_after_round" not in entry
    # a failed (not interrupted) attempt is never resumed
    write_cell(tmp_path, cell, fake_results([0.55], status="failed"))
    (tmp_path / "cells" / cell.cell_id / "checkpoint.pt").write_bytes(b"x")
    assert X.resumable_round(tmp_path / "cells" / cell.cell_id, X.cell_overrides(spec, cell, tmp_path)) is None


def test_cell_timeout_stops_a_hung_run(tmp_path, monkeypatch):
    """A `flwr run` that hangs without output is terminated by the watchdog; the cell is reported failed."""
    import sys

    import fedpower_app.launcher as L

    fake = tmp_path / "bin" / "flwr"
    fake.parent.mkdir()
    fake.write_text(f"#!{sys.executable}\nimport sys, time\nif sys.argv[1] == 'run':\n    time.sleep(60)\n")
    fake.chmod(0o755)
    monkeypatch.setattr(L, "_flwr", lambda: str(fake))
    spec = tiny_spec()
    cell = spec.cells()[0]
    t0 = __import__("time").time()
    entry = X.run_cell(spec, cell, tmp_path, flwr_home=tmp_path / "home", port=39999, echo=False, timeout=2.0,
                       keep_adapters=False)
    assert __import__("time").time() - t0 < 30
    assert entry["status"] == "missing" and "timed out after 2 s" in entry["flwr_status"]
    assert json.loads((tmp_path / "cells" / cell.cell_id / "cell.json").read_text())["status"] == "missing"


def test_dry_run_lists_cells(tmp_path, capsys):
    rc = X.main(["--table", "1", "--epsilons", "3", "none", "--seeds", "0", "--tasks", "synthetic", "--preset", TINY,
                 "--out", str(tmp_path), "--dry-run"])
    out = capsys.readouterr().out
    assert rc == 0 and "6 cells" in out and "synthetic__fedpower__eps3__s0" in out and "missing" in out


# ------------------------------------------------------------------------------------------------
# aggregation math and rendering (synthetic data)
# ------------------------------------------------------------------------------------------------

def test_mean_std():
    assert X.mean_std([]) == (None, None, 0)
    assert X.mean_std([0.5, None]) == (0.5, 0.0, 1)
    m, s, n = X.mean_std([0.6, 0.7, 0.8])
    assert n == 3 and math.isclose(m, 0.7) and math.isclose(s, 0.1)  # sample std (ddof = 1)
    assert X._pm(0.7, 0.0, 1) == "70.00"  # one seed: no "± 0.00"
    assert X._pm(0.7, 0.1, 3) == "70.00 ± 10.00" and X._pm(None, None, 0) == "—"


def test_cell_metrics_and_curve():
    data = fake_results([0.6, 0.8, 0.7], bytes_round=100, agg=0.02)
    m = X.cell_metrics(data)
    assert m["final_accuracy"] == 0.7 and m["best_accuracy"] == 0.8
    assert m["final"]["validation"] == 0.7 and m["best"]["validation"] == 0.8
    assert math.isclose(m["epsilon"], 5.9) and m["aggregation_seconds"] == 0.02 and m["bytes"] == 900
    pts = X.curve(data)
    assert pts[0] == (0, 0.0, 0.5)
    assert [p[1] for p in pts[1:]] == [2400.0, 4800.0, 7200.0]  # 8 * (up + down), cumulative
    # a round without evaluation (eval.every > 1) still counts its bytes
    data["rounds"][1]["accuracy"] = None
    assert [p[0] for p in X.curve(data)] == [0, 1, 3] and X.curve(data)[-1][1] == 7200.0


def test_metrics_beside_accuracy_are_not_evaluation_splits():
    """A round row carries balanced-accuracy and majority-accuracy beside the splits' accuracy:
    the grid's tables keep one column per split."""
    row = {"accuracy": 0.7, "loss": 0.5, "validation-accuracy": 0.7, "validation-loss": 0.5,
           "balanced-accuracy": 0.66, "majority-accuracy": 0.51, "macro-f1": 0.65}
    assert X.eval_splits_of({"rounds": [row]}) == ["validation"]
    data = fake_results([0.6, 0.7], bytes_round=100, agg=0.02)
    for r in data["rounds"]:
        r.update({"balanced-accuracy": 0.5, "majority-accuracy": 0.5})
    assert X.cell_metrics(data)["splits"] == ["validation"]


def synthetic_grid(tmp_path):
    spec = X.GridSpec(tasks=["sst2", "mnli"], seeds=[0, 1, 2],
                      tables={"1": (["fedlora", "fedpower"], [None, 6.0]),
                              "3": (["fedlora", "fedpower-F5", "fedpower"], [6.0])})
    acc = {  # (task, method, eps) -> per-seed final accuracy
        ("fedlora", None): [0.80, 0.82, 0.84], ("fedpower", None): [0.85, 0.86, 0.87],
        ("fedlora", 6.0): [0.50, 0.52, 0.54], ("fedpower", 6.0): [0.60, 0.60, 0.60],
        ("fedpower-F5", 6.0): [0.55, 0.56, 0.57],
    }
    agg = {"fedlora": 0.010, "fedpower": 0.015, "fedpower-F5": 0.011}
    for cell in spec.cells():
        a = acc[(cell.method, cell.epsilon)][cell.seed]
        if cell.task == "mnli":
            splits = ("validation_matched", "validation_mismatched")
            rounds = [{splits[0]: 0.4, splits[1]: 0.4}, {splits[0]: a - 0.1, splits[1]: a - 0.2}]
        else:
            splits = ("validation",)
            rounds = [0.9, a]  # best = 0.9, final = a
        write_cell(tmp_path, cell, fake_results(rounds, splits=splits, agg=agg[cell.method],
                                                eps_final=None if cell.epsilon is None else 5.99))
    return spec, acc


def test_accuracy_table_math(tmp_path):
    spec, acc = synthetic_grid(tmp_path)
    collected = X.collect(tmp_path, spec.cells())
    table = X.accuracy_table(collected, spec.tasks, ["fedlora", "fedpower"], [None, 6.0], "T1")
    assert table.headers[:5] == ["Privacy budget", "Method", "SST-2", "MNLI-m", "MNLI-mm"]
    assert table.headers[5] == "Average"
    # rows: non-private first, then eps 6 (paper order)
    assert [r[:2] for r in table.rows] == [["non-private", "FedLoRA"], ["non-private", "FedPower"],
                                           ["ε = 6", "FedLoRA"], ["ε = 6", "FedPower"]]
    fl = table.rows[0]
    m, s = statistics.mean(acc[("fedlora", None)]), statistics.stdev(acc[("fedlora", None)])
    assert fl[2] == f"{100 * m:.2f} ± {100 * s:.2f}"  # SST-2: 82.00 ± 2.00
    assert fl[2] == "82.00 ± 2.00"
    assert fl[3] == "72.00 ± 2.00" and fl[4] == "62.00 ± 2.00"  # MNLI m / mm
    # average over the three columns per seed: (a + a-0.1 + a-0.2)/3 = a - 0.1
    assert fl[5] == "72.00 ± 2.00"
    assert table.rows[3][2] == "60.00 ± 0.00" and table.rows[3][6] == "3"
    assert table.rows[3][7] == "5.990" and table.rows[0][7] == "—"
    # best-round variant
    best = X.accuracy_table(collected, spec.tasks, ["fedlora"], [6.0], "T1b", which="best")
    assert best.rows[0][2] == "90.00 ± 0.00"
    # csv: numeric mean/std/n columns
    table.write(tmp_path, "t")
    rows = list(csv.DictReader(open(tmp_path / "t.csv")))
    assert len(rows) == 4 and rows[0]["epsilon"] == "none" and rows[0]["method"] == "fedlora"
    assert math.isclose(float(rows[0]["SST-2_mean"]), 0.82) and rows[0]["SST-2_n"] == "3"
    assert math.isclose(float(rows[0]["average_mean"]), 0.72)
    md = (tmp_path / "t.md").read_text()
    assert md.startswith("### T1") and "| ε = 6 | FedPower | 60.00 ± 0.00 |" in md


def test_missing_cells_render_as_dash(tmp_path):
    spec, _ = synthetic_grid(tmp_path)
    collected = X.collect(tmp_path, spec.cells())
    table = X.accuracy_table(collected, ["sst2"], ["ffa-lora"], [3.0], "T")
    assert table.rows == [["ε = 3", "FFA-LoRA", "—", "0", "—"]]
    # a failed run is not aggregated
    cell = X.Cell("sst2", "fedpower", 6.0, 0)
    write_cell(tmp_path, cell, fake_results([0.1], status="failed"))
    table = X.accuracy_table(X.collect(tmp_path, spec.cells()), ["sst2"], ["fedpower"], [6.0], "T")
    assert table.rows[0][2] == "60.00 ± 0.00" and table.rows[0][3] == "2"


def test_refactor_table(tmp_path):
    spec, _ = synthetic_grid(tmp_path)
    collected = X.collect(tmp_path, spec.cells())
    table = X.refactor_table(collected, spec.tasks, ["fedlora", "fedpower-F5", "fedpower"], [6.0], "T3")
    by = {r[1]: r for r in table.rows}
    assert by["FedLoRA"][2].startswith("none") and by["FedLoRA"][4] == "+0.0 % (×1.00)"
    assert by["FedPower (F=5)"][2] == "every 5 rounds" and by["FedPower (F=5)"][4] == "+10.0 % (×1.10)"
    assert by["FedPower"][2] == "every 1 round" and by["FedPower"][4] == "+50.0 % (×1.50)"
    assert by["FedPower"][3] == "0.0150 ± 0.0000" and by["FedPower"][7] == "6"  # 3 seeds x 2 tasks
    assert by["FedPower"][6] == "50.00 ± 0.00"  # average over SST-2, MNLI-m, MNLI-mm = 0.6 - 0.1


def test_write_report_tables_and_figures(tmp_path):
    spec, _ = synthetic_grid(tmp_path)
    written = X.write_report(spec, tmp_path)
    assert written["tables"] == ["table1", "table3"]
    for stem in ("table1", "table3"):
        assert (tmp_path / f"{stem}.md").stat().st_size > 0 and (tmp_path / f"{stem}.csv").stat().st_size > 0
    expected = {f"fig_t1_{t}_{e}.png" for t in ("sst2", "mnli") for e in ("nonprivate", "eps6")}
    expected |= {f"fig_t3_{t}_eps6.png" for t in ("sst2", "mnli")}
    assert set(written["figures"]) == expected
    for name in expected:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert X.mean_curve(X.collect(tmp_path, spec.cells()).get("sst2", "fedpower", 6.0))[0] == [0, 1, 2]


# ------------------------------------------------------------------------------------------------
# end to end through `flwr run` (slow)
# ------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_tiny_grid_end_to_end(tmp_path, capsys):
    out = tmp_path / "grid"
    argv = ["--table", "1", "--methods", "fedpower", "fedlora", "--epsilons", "8", "--seeds", "0",
            "--tasks", "synthetic", "--preset", TINY, "--supernodes", "3", "--out", str(out),
            "--set", "num-server-rounds=2", "--port", "39471", "--cell-timeout", "1200"]
    assert X.main(argv) == 0, capsys.readouterr()
    printed = capsys.readouterr().out
    assert "[cell 1/2]" in printed and "[cell 2/2]" in printed and "ETA" in printed
    for method in ("fedpower", "fedlora"):
        cell_dir = out / "cells" / f"synthetic__{method}__eps8__s0"
        results = json.loads((cell_dir / "results.json").read_text())
        assert results["status"] == "completed" and len(results["rounds"]) == 2
        assert results["config"]["strategy.name"] == method and results["config"]["dp.epsilon"] == 8.0
        # a private cell shows what its guarantee covers: bytes sent (client-sampling coins), not
        # the bytes of the replies that arrived (dp.diagnostics = off)
        assert all(r["bytes_down"] > 0 and "bytes_up" not in r for r in results["rounds"])
        assert json.loads((cell_dir / "cell.json").read_text())["status"] == "completed"
        assert not (cell_dir / "adapter").exists()
    md = (out / "table1.md").read_text()
    assert "| ε = 8 | FedPower |" in md and "| ε = 8 | FedLoRA |" in md
    rows = list(csv.DictReader(open(out / "table1.csv")))
    assert [r["method"] for r in rows] == ["fedpower", "fedlora"] and all(r["synthetic_n"] == "1" for r in rows)
    png = out / "fig_t1_synthetic_eps8.png"
    assert png.read_bytes()[:4] == b"\x89PNG"
    manifest = json.loads((out / "manifest.json").read_text())
    assert len(manifest["cells"]) == 2 and manifest["invocations"][-1]["ran"]
    # resume: a second invocation runs 0 cells
    assert X.main(argv) == 0
    printed = capsys.readouterr().out
    assert "2 already finished, 0 to run" in printed and "[cell" not in printed


# ------------------------------------------------------------------------------------------------
# per-method overrides and stale cells (a grid edited after some cells finished)
# ------------------------------------------------------------------------------------------------

def _finished_cell(out: Path, spec: X.GridSpec, cell: X.Cell, acc=0.7) -> Path:
    """What a finished run leaves: results.json with its resolved config, cell.json with its overrides."""
    ov = X.cell_overrides(spec, cell, out)
    payload = fake_results([acc - 0.1, acc])
    payload["config"] = parse_config(ov).to_dict()
    write_cell(out, cell, payload)
    cell_dir = out / "cells" / cell.cell_id
    (cell_dir / "cell.json").write_text(json.dumps({"overrides": ov, "status": "completed"}))
    return cell_dir


def test_method_overrides_from_a_grid_file_and_their_checks(tmp_path):
    grid = tmp_path / "g.toml"
    grid.write_text(f'out = "{tmp_path / "o"}"\npreset = "{TINY}"\ntasks = ["synthetic"]\nmethods = ["fedlora", "ffa-lora"]\n'
                    'epsilons = [8, "none"]\nnonprivate-lr = 0.001\n[method-overrides.ffa-lora]\n"train.lr" = 0.03\n')
    spec, out = X.build_spec(X.make_parser().parse_args(["--grid", str(grid)]))
    cells = {c.cell_id: c for c in X.validate(spec, out)}
    lr = {cid: X.cell_overrides(spec, c, out)["train.lr"] for cid, c in cells.items()}
    # FFA-LoRA's own lr wins in its private and non-private cells; the others keep the grid's
    assert lr == {"synthetic__fedlora__eps8__s0": load_preset(TINY)["train.lr"], "synthetic__ffa-lora__eps8__s0": 0.03,
                  "synthetic__fedlora__nonprivate__s0": 0.001, "synthetic__ffa-lora__nonprivate__s0": 0.03}
    assert X.GridSpec.from_dict(json.loads(json.dumps(spec.to_dict()))).method_overrides == {"ffa-lora": {"train.lr": 0.03}}
    subset = X.build_spec(X.make_parser().parse_args(["--grid", str(grid), "--methods", "fedlora"]))[0]
    assert len(X.validate(subset, out)) == 2  # --methods may leave the overridden method out
    for bad, message in [({"fedavg": {"train.lr": 0.1}}, "unknown method"),
                         ({"ffa-lora": {"dp.epsilon": 1.0}}, "define.*cell"),
                         ({"ffa-lora": {"strategy.name": "fedlora"}}, "define.*cell"),
                         ({"ffa-lora": {}}, "table of run-config keys"),
                         ({"ffa-lora": {"train.lr": -1.0}}, "train.lr")]:
        spec.method_overrides = bad
        with pytest.raises(X.GridError, match=message):
            X.validate(spec, out)


def test_stale_cells_are_detected_left_out_of_tables_and_rerun_without_losing_the_old_results(tmp_path, monkeypatch):
    old = tiny_spec(tables={}, custom=(["fedlora", "ffa-lora"], [8.0]))
    fedlora, ffa = old.cells()
    for cell in (fedlora, ffa):
        _finished_cell(tmp_path, old, cell)
    assert X.config_changes(old, ffa, tmp_path) == [] and X.is_done(old, ffa, tmp_path)
    # pinning a key to the value the old run used (a default) is no change; a new lr for FFA is
    pinned = tiny_spec(tables={}, custom=old.custom, overrides={"train.optimizer": "adam"})
    assert X.config_changes(pinned, ffa, tmp_path) == []
    new = tiny_spec(tables={}, custom=old.custom, method_overrides={"ffa-lora": {"train.lr": 0.03}})
    old_lr = load_preset(TINY)["train.lr"]
    assert X.config_changes(new, ffa, tmp_path) == [f"train.lr: {old_lr!r} -> 0.03"]
    assert X.config_changes(new, fedlora, tmp_path) == [] and not X.is_done(new, ffa, tmp_path)
    # a key the old run's code did not know (absent from its resolved config) cannot be compared
    res = json.loads(X.results_path(tmp_path, ffa).read_text())
    del res["config"]["train.optimizer"]
    X.results_path(tmp_path, ffa).write_text(json.dumps(res))
    assert X.config_changes(pinned, ffa, tmp_path) == []
    # --dry-run marks it; the tables leave it out and say so
    written = X.write_report(new, tmp_path)
    assert written["stale"] == [ffa.cell_id]
    table = (tmp_path / "table_custom.md").read_text()
    assert "| ε = 8 | FedLoRA | 70.00 | 1 |" in table and "| ε = 8 | FFA-LoRA | — |" in table
    # the grid runs only the stale cell, and its old results move aside, not away
    import fedpower_app.launcher as L

    from types import SimpleNamespace

    def run_flwr(root, overrides, **kw):  # a finished run records its resolved config
        payload = fake_results([0.6, 0.75])
        payload["config"] = parse_config(overrides).to_dict()
        write_cell(tmp_path, ffa, payload)
        return SimpleNamespace(run_id=7, status="finished:completed", seconds=1.0, output="")

    monkeypatch.setattr(L, "run_flwr", run_flwr)
    monkeypatch.setattr(L, "stop_local_superlink", lambda *a, **k: None)
    logs = []
    summary = X.run_grid(new, tmp_path, log=logs.append)
    assert summary["ran"] == [ffa.cell_id] and summary["skipped"] == 1 and summary["unfinished"] == []
    assert any("1 finished cell(s) were made with other settings" in line and "train.lr" in line for line in logs)
    assert not any("re-running" in line for line in logs)  # stale is not failed
    moved = list((tmp_path / "superseded").iterdir())
    assert len(moved) == 1 and moved[0].name.startswith(ffa.cell_id + "__")
    assert json.loads((moved[0] / "cell.json").read_text())["overrides"]["train.lr"] == old_lr
    assert json.loads((tmp_path / "cells" / ffa.cell_id / "cell.json").read_text())["overrides"]["train.lr"] == 0.03
    assert X.is_done(new, ffa, tmp_path) and X.write_report(new, tmp_path)["stale"] == []


def test_dry_run_marks_stale_cells(tmp_path, capsys):
    argv = ["--methods", "fedlora", "--epsilons", "8", "--tasks", "synthetic", "--preset", TINY, "--out", str(tmp_path)]
    spec, out = X.build_spec(X.make_parser().parse_args(argv))
    _finished_cell(out, spec, spec.cells()[0])
    assert X.main(argv + ["--dry-run"]) == 0 and "STALE" not in capsys.readouterr().out
    assert X.main(argv + ["--set", "train.lr=0.5", "--dry-run"]) == 0
    assert "completed but STALE, runs again (train.lr:" in capsys.readouterr().out


def test_dry_run_reports_progress_and_time_left(tmp_path):
    """--dry-run tells an operator of a long grid where each cell stands (finished with its accuracy,
    running now in another process, interrupted and resumable, to restart, not started) and how much
    cell time is left, from the finished cells' time per round."""
    total = 5
    spec = tiny_spec(seeds=[0, 1, 2], overrides={"num-server-rounds": total})  # 6 cells
    cells = X.validate(spec, tmp_path)
    _finished_cell(tmp_path, spec, cells[0], acc=0.7)  # fake_results: 2 rounds in 10 s
    _interrupted_cell(tmp_path, spec, cells[1])  # 2 rounds done, checkpointed
    other = _interrupted_cell(tmp_path, spec, cells[2], overrides={"train.lr": 9.0})  # other settings
    running = X._try_lock(tmp_path / "locks" / f"{cells[3].cell_id}.lock")  # another worker holds it
    try:
        progress = [X.cell_progress(spec, c, tmp_path) for c in cells]
        report = X.grid_status(spec, cells, tmp_path)
    finally:
        running.close()
    assert [p.state for p in progress] == ["finished", "interrupted", "restart", "running", "missing", "missing"]
    assert "completed: accuracy 0.700" in progress[0].text and "eps 5.90, 2 rounds, 0m10s" in progress[0].text
    assert progress[1].text == f"interrupted after round 2/{total}: resumes from its checkpoint"
    assert progress[2].text == (f"interrupted after round 2/{total}, no checkpoint to resume: "
                                "runs again from the start") and other.exists()
    assert progress[3].text == "running now: no round finished yet"
    fresh = tmp_path / "fresh"  # a dry run creates nothing
    assert X.cell_progress(spec, cells[0], fresh).state == "missing" and not fresh.exists()
    lines = report.splitlines()
    assert lines[0] == f"6 cells -> {tmp_path}" and cells[0].cell_id in lines[1] and len(lines) == 8
    # 5 s per round (the finished cell); rounds left: the interrupted cell's total - 2, the rest in full
    left = (total - 2) + 4 * total
    assert lines[-1] == (f"1 finished, 1 running now, 1 interrupted (resume), 1 to restart, 2 not started; about "
                         f"{X._fmt_seconds(5.0 * left)} of cell time left at one worker ({left} rounds at the "
                         f"finished cells' median 0m05s per round)")


def test_a_narrowed_grid_says_its_tables_cover_only_its_cells(tmp_path, capsys):
    grid = tmp_path / "g.toml"
    grid.write_text(f'out = "{tmp_path / "out"}"\npreset = "{TINY}"\ntasks = ["synthetic"]\n'
                    'methods = ["fedpower", "fedlora"]\nepsilons = [8]\n')
    assert X.main(["--grid", str(grid), "--report-only"]) == 2  # nothing run yet: a clear error, no traceback
    assert f"--report-only: no cells in {tmp_path / 'out'} (run the grid first)" in capsys.readouterr().err
    (tmp_path / "out" / "cells").mkdir(parents=True)
    assert X.main(["--grid", str(grid), "--report-only"]) == 0
    assert "cover only" not in capsys.readouterr().err
    assert X.main(["--grid", str(grid), "--methods", "fedlora", "--seeds", "0", "--report-only"]) == 0
    err = capsys.readouterr().err
    assert "the tables cover only the cells selected by --methods, --seeds" in err
    assert f"fedpower-experiment --grid {grid} --report-only" in err


def test_client_level_variant_shares_its_base_cell_away_from_client_dp(tmp_path):
    """FedPower with the paper's PowerDP differs from FedPower only in the client-level release:
    without DP (or at sample level) it is the same run, so the grid runs it once and both rows
    show it, marked; a per-method override that makes the runs differ keeps them apart."""
    methods = ["fedpower", "fedpower-powerdp"]
    client = tiny_spec(tables={}, custom=(methods, [8.0, None]), seeds=[0, 1], overrides={"dp.level": "client"})
    ids = [c.cell_id for c in X.validate(client, tmp_path)]
    assert ids == ["synthetic__fedpower__eps8__s0", "synthetic__fedpower-powerdp__eps8__s0",
                   "synthetic__fedpower__nonprivate__s0", "synthetic__fedpower__eps8__s1",
                   "synthetic__fedpower-powerdp__eps8__s1", "synthetic__fedpower__nonprivate__s1"]
    assert client.shared_rows() == {("synthetic", "fedpower-powerdp", None): "fedpower"}
    # at sample level the variant does not exist: both methods are one cell at every epsilon
    sample = tiny_spec(tables={}, custom=(methods, [8.0]), overrides={"dp.level": "sample"})
    assert [c.cell_id for c in sample.cells()] == ["synthetic__fedpower__eps8__s0"]
    # its own settings make it a different run again
    own = tiny_spec(tables={}, custom=(methods, [None]), method_overrides={"fedpower-powerdp": {"train.lr": 0.03}})
    assert [c.cell_id for c in own.cells()] == ["synthetic__fedpower__nonprivate__s0",
                                                "synthetic__fedpower-powerdp__nonprivate__s0"]
    # the table shows the shared run in both rows, marked and explained
    for cell, acc in zip(client.cells(), (0.6, 0.5, 0.8, 0.6, 0.5, 0.8)):
        _finished_cell(tmp_path, client, cell, acc)
    written = X.write_report(client, tmp_path)
    assert written["stale"] == [] and "fig_custom_synthetic_nonprivate.png" in written["figures"]
    table = (tmp_path / "table_custom.md").read_text()
    assert "| non-private | FedPower | 80.00 ± 0.00 | 2 |" in table
    assert "| non-private | FedPower (paper's PowerDP) † | 80.00 ± 0.00 | 2 |" in table
    assert "| ε = 8 | FedPower (paper's PowerDP) | 50.00 ± 0.00 | 2 |" in table
    assert "† FedPower (paper's PowerDP), non-private, is the run of FedPower" in table
    rows = {(r["epsilon"], r["method"]): r for r in csv.DictReader(open(tmp_path / "table_custom.csv"))}
    assert rows[("none", "fedpower-powerdp")]["run_of"] == "fedpower" and rows[("8", "fedpower-powerdp")]["run_of"] == ""


def test_private_method_overrides_apply_to_private_cells_only(tmp_path):
    """[private-method-overrides.<m>] sets keys that matter only under DP (FedPower's power
    iterations and clip): its non-private cells keep the grid's settings, and stay shared with the
    paper's-PowerDP variant."""
    grid = tmp_path / "g.toml"
    grid.write_text(f'out = "{tmp_path / "o"}"\npreset = "{TINY}"\ntasks = ["synthetic"]\n'
                    'methods = ["fedpower", "fedpower-powerdp"]\nepsilons = [8, "none"]\noverrides = {"dp.level" = "client"}\n'
                    '[method-overrides.fedpower]\n"train.lr" = 0.01\n[method-overrides.fedpower-powerdp]\n"train.lr" = 0.01\n'
                    '[private-method-overrides.fedpower]\n"strategy.power-iters" = 1\n"dp.clip" = 1.6\n')
    spec, out = X.build_spec(X.make_parser().parse_args(["--grid", str(grid)]))
    cells = {c.cell_id: c for c in X.validate(spec, out)}
    assert sorted(cells) == ["synthetic__fedpower-powerdp__eps8__s0", "synthetic__fedpower__eps8__s0",
                             "synthetic__fedpower__nonprivate__s0"]
    preset = parse_config(load_preset(TINY))
    got = {cid: parse_config(X.cell_overrides(spec, c, out)) for cid, c in cells.items()}
    assert got["synthetic__fedpower__eps8__s0"]["strategy.power-iters"] == 1
    assert got["synthetic__fedpower__eps8__s0"]["dp.clip"] == 1.6
    assert got["synthetic__fedpower__nonprivate__s0"]["strategy.power-iters"] == preset["strategy.power-iters"]
    assert got["synthetic__fedpower-powerdp__eps8__s0"]["strategy.power-iters"] == preset["strategy.power-iters"]
    assert all(g["train.lr"] == 0.01 for g in got.values())  # method-overrides: every cell
    assert X.GridSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    spec.private_method_overrides = {"fedpower": {"dp.epsilon": 1.0}}
    with pytest.raises(X.GridError, match="private-method-overrides.fedpower: dp.epsilon define"):
        X.validate(spec, out)


def test_nonprivate_overrides_give_the_ceiling_its_own_schedule(tmp_path):
    """[nonprivate-overrides] and [nonprivate-method-overrides.<m>]: the non-private cells train at
    their own schedule (they beat the preset's method tables), the private cells are untouched, and a
    key that makes a cell, or train.lr set twice, is refused."""
    grid = tmp_path / "g.toml"
    grid.write_text(f'out = "{tmp_path / "o"}"\npreset = "{TINY}"\ntasks = ["synthetic"]\n'
                    'methods = ["fedlora", "ffa-lora"]\nepsilons = [8, "none"]\n'
                    '[nonprivate-overrides]\n"train.lr" = 0.001\n"train.local-steps" = 7\n'
                    '[nonprivate-method-overrides.ffa-lora]\n"train.lr" = 0.005\n'
                    '[private-method-overrides.ffa-lora]\n"train.lr" = 0.09\n')
    spec, out = X.build_spec(X.make_parser().parse_args(["--grid", str(grid)]))
    cells = {c.cell_id: c for c in X.validate(spec, out)}
    preset = parse_config(load_preset(TINY))
    got = {cid: parse_config(X.cell_overrides(spec, c, out)) for cid, c in cells.items()}
    assert got["synthetic__fedlora__nonprivate__s0"]["train.lr"] == 0.001
    assert got["synthetic__ffa-lora__nonprivate__s0"]["train.lr"] == 0.005
    assert all(got[f"synthetic__{m}__nonprivate__s0"]["train.local-steps"] == 7 for m in ("fedlora", "ffa-lora"))
    assert got["synthetic__fedlora__eps8__s0"]["train.lr"] == preset["train.lr"]
    assert got["synthetic__ffa-lora__eps8__s0"]["train.lr"] == 0.09
    assert all(got[f"synthetic__{m}__eps8__s0"]["train.local-steps"] == preset["train.local-steps"]
               for m in ("fedlora", "ffa-lora"))
    assert X.GridSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    spec.nonprivate_lr = 0.002
    with pytest.raises(X.GridError, match="nonprivate-lr and nonprivate-overrides both set train.lr"):
        X.validate(spec, out)
    spec.nonprivate_lr = None
    spec.nonprivate_overrides = {"dp.level": "sample"}
    with pytest.raises(X.GridError, match="nonprivate-overrides: dp.level define"):
        X.validate(spec, out)
    spec.nonprivate_overrides = {}
    spec.nonprivate_method_overrides = {"fedlora": {"seed": 3}}
    with pytest.raises(X.GridError, match="nonprivate-method-overrides.fedlora: seed define"):
        X.validate(spec, out)


def test_compact_cells_keep_the_tables_and_drop_the_bulk(tmp_path, capsys):
    """--report-only --compact: the committed form of a grid's cells; the tables it writes are the same."""
    import shutil

    src = PROJECT_ROOT / "results" / "cross-device-sst2"
    out = tmp_path / "grid"
    shutil.copytree(src, out)
    X.unpack_cells(out)  # the committed cells are packed into cells.json: one file per cell again
    for path in (out / "cells").glob("*/results.json"):  # the committed cells are compact: inflate them
        data = json.loads(path.read_text())
        data.pop(X.COMPACT_MARK, None)
        data.setdefault("privacy_final", {})["ledger"] = {"history": [{"round": r, "z": 0.9} for r in range(200)]}
        data.setdefault("clients", {})["dataset_sizes"] = [67] * 1000
        path.write_text(json.dumps(data))
    assert X.main(["--out", str(out), "--report-only"]) == 0
    before = {p.name: p.read_text() for p in out.glob("table*.md")}
    spec = X.GridSpec.from_dict(json.loads((out / "manifest.json").read_text())["grid"])
    paths = [X.results_path(out, c) for c in X.validate(spec, out) if X.is_finished(out, c)]
    sizes = {p: p.stat().st_size for p in paths}
    assert len(sizes) >= 10
    assert X.main(["--out", str(out), "--report-only", "--compact"]) == 0
    assert "compacted" in capsys.readouterr().out
    after = {p.name: p.read_text() for p in out.glob("table*.md")}
    assert before and after == before
    for path, size in sizes.items():
        data = json.loads(path.read_text())
        assert X.COMPACT_MARK in data and "ledger" not in data.get("privacy_final", {})
        assert data["clients"]["dataset_sizes"]["count"] == 1000
        assert path.stat().st_size < size
    # a second pass leaves compacted cells alone
    assert X.main(["--out", str(out), "--report-only", "--compact"]) == 0
    assert "compacted 0 cell" in capsys.readouterr().out


def test_compact_cells_fold_the_cell_record_into_one_minified_file(tmp_path, capsys):
    """A committed cell is one file. --compact folds cell.json into results.json
    (minified); the cell's record still answers "were these results made with other settings?"."""
    import shutil

    out = tmp_path / "grid"
    shutil.copytree(PROJECT_ROOT / "results" / "cross-device-sst2", out)
    X.unpack_cells(out)
    spec = X.GridSpec.from_dict(json.loads((out / "manifest.json").read_text())["grid"])
    cells = [c for c in X.validate(spec, out) if X.is_finished(out, c)]
    cell = cells[0]
    path = X.results_path(out, cell)
    data = json.loads(path.read_text())
    record = data.pop("cell", None) or {"overrides": X.cell_overrides(spec, cell, out), "status": "completed"}
    data.pop(X.COMPACT_MARK, None)
    path.write_text(json.dumps(data, indent=2))
    (path.parent / "cell.json").write_text(json.dumps(record, indent=2))
    before = X.config_changes(spec, cell, out)
    assert X.compact_cells(out, [cell]) == 1
    assert not (path.parent / "cell.json").exists()
    text = path.read_text()
    assert "\n" not in text.rstrip("\n") and json.loads(text)["cell"] == record
    assert X.store.cell_record(path.parent) == record
    assert X.config_changes(spec, cell, out) == before
    spec.overrides = {**spec.overrides, "train.lr": 0.123}  # a changed setting is still seen
    assert any(c.startswith("train.lr") for c in X.config_changes(spec, cell, out))


def test_figures_are_saved_with_a_palette(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    from fedpower_app.figures import compact_png, save_png

    fig, ax = plt.subplots()
    ax.plot(range(10), [x * x for x in range(10)], label="a")
    ax.legend()
    fig.savefig(tmp_path / "rgba.png", dpi=110)
    save_png(fig, tmp_path / "palette.png", dpi=110)
    plt.close(fig)
    with Image.open(tmp_path / "palette.png") as im, Image.open(tmp_path / "rgba.png") as ref:
        assert im.mode == "P" and im.size == ref.size
    assert (tmp_path / "palette.png").stat().st_size < (tmp_path / "rgba.png").stat().st_size
    assert compact_png(tmp_path / "rgba.png") > 0 and compact_png(tmp_path / "rgba.png") == 0


def test_a_packed_grid_reports_the_same_and_a_cells_own_file_wins(tmp_path, capsys):
    """The committed form packs a grid's finished cells into one cells.json; status,
    tables and --report-only read it as they read the cells' own files."""
    import shutil

    out = tmp_path / "grid"
    shutil.copytree(PROJECT_ROOT / "results" / "cross-device-sst2", out)
    X.unpack_cells(out)
    spec = X.GridSpec.from_dict(json.loads((out / "manifest.json").read_text())["grid"])
    cells = X.validate(spec, out)
    status = {c.cell_id: X.cell_status(out, c) for c in cells}
    assert X.main(["--out", str(out), "--report-only"]) == 0
    before = {p.name: p.read_text() for p in out.glob("table*.md")}
    assert X.main(["--out", str(out), "--report-only", "--compact", "--pack"]) == 0
    assert "packed" in capsys.readouterr().out
    left = {p.parent.name for p in (out / "cells").glob("*/results.json")}
    assert (out / X.PACK_FILE).exists() and len(X.packed_cells(out)) >= 10
    assert all(status.get(cell_id) not in X.FINISHED for cell_id in left)  # only unfinished cells keep a file
    assert {c.cell_id: X.cell_status(out, c) for c in cells} == status
    assert X.main(["--out", str(out), "--report-only"]) == 0
    assert {p.name: p.read_text() for p in out.glob("table*.md")} == before
    done = next(c for c in cells if status[c.cell_id] == "completed")
    own = X.packed_cells(out)[done.cell_id] | {"status": "failed"}
    X.results_path(out, done).parent.mkdir(parents=True, exist_ok=True)
    X.results_path(out, done).write_text(json.dumps(own))
    assert X.cell_status(out, done) == "failed"  # the cell's own file wins over the pack
    assert X.main(["--out", str(out), "--report-only", "--pack"]) == 2
