"""The prepared device command (benchmarks/gpu/): its scripts parse, the GPU recipe preset is a valid
run config whose privacy plan calibrates, the run sizing and the summary behave. Fast, on a CPU;
nothing here needs .gpu-carry/ or a GPU (the dry run in benchmarks/gpu/README.md checks the rest)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / "benchmarks" / "gpu"
PRESET = ROOT / "conf" / "sst2-dp-gpu.toml"
SILO_SIZES = "10892,10892,10892,10891,10891,10891"  # SST-2's 67,349 train rows less 2,000 carved, over 6


@pytest.mark.parametrize("script", ["run.sh", "prepare.sh"])
def test_the_shell_scripts_parse(script):
    proc = subprocess.run(["bash", "-n", str(GPU / script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_run_sh_refuses_a_missing_or_tiny_budget():
    for args, message in (([], "BUDGET_SECONDS"), (["30"], "under 60 s"), (["120", "--bogus"], "unknown argument")):
        proc = subprocess.run(["bash", str(GPU / "run.sh"), *args], capture_output=True, text=True, cwd=ROOT)
        assert proc.returncode == 2 and message in proc.stderr, (args, proc.stderr)


@pytest.mark.parametrize("method", ["fedlora", "fedpower", "ffa-lora", "fedsvd"])
def test_the_gpu_preset_is_a_valid_run_config_for_every_method(method):
    from fedpower_app.config import load_preset, parse_config, with_method_preset

    overrides, _, _ = with_method_preset({**load_preset(PRESET), "strategy.name": method}, explicit={"strategy.name"})
    cfg = parse_config({**overrides, "device": "cpu"})
    assert cfg["task.name"] == "sst2" and cfg["dp.epsilon"] == 8.0 and cfg["dp.delta"] == 1e-5
    assert cfg["dp.level"] == "sample" and cfg["dp.noise-at"] == "silo"  # DP-SGD on the silos, as conf/sst2-dp.toml
    assert cfg["train.precision"] in ("auto", "bf16")
    assert "device" not in load_preset(PRESET)  # left to the command line, so the preset validates on a CPU
    epochs = cfg["num-server-rounds"] * cfg["train.local-steps"] * cfg["train.batch-size"] / 10892
    assert 50 <= epochs <= 100


def test_the_gpu_presets_privacy_plan_calibrates(capsys):
    from fedpower_app.privacy import cli as privacy_cli

    assert privacy_cli.main(["--preset", str(PRESET), "--client-sizes", SILO_SIZES]) == 0
    out = capsys.readouterr().out
    sigma = float(re.search(r"sigma=([0-9.]+) \(calibrated\)", out).group(1))
    assert 1.0 < sigma < 10.0
    assert re.search(r"T=50 rounds ends at eps (7\.99\d|8\.000)", out), out


def test_the_run_is_sized_to_the_time_left():
    sys.path.insert(0, str(GPU))
    try:
        from size_run import plan
    finally:
        sys.path.remove(str(GPU))
    probe = {"load_seconds": 5.0, "eval_seconds": 1.0,
             "round_estimate": {"seconds": 2.0, "epochs_per_round": 1.47, "cache_seconds_all_silos": 6.0}}
    roomy = plan(50, probe, 10_000, startup=30, overhead=1.3)
    assert roomy["rounds"] == 50 and roomy["reason"] == "the preset's rounds fit"
    tight = plan(50, probe, 200, startup=30, overhead=1.3)
    assert tight["rounds"] == (200 - 42) // 3.6 and tight["expected_seconds"] <= 200
    assert plan(50, probe, 30, startup=30, overhead=1.3)["rounds"] == 0
    assert plan(50, probe, 10_000, startup=30, overhead=1.3, max_rounds=2)["rounds"] == 2
    assert plan(50, None, 10_000, startup=30, overhead=1.3)["rounds"] == 2  # no probe: a short fallback


def test_the_run_is_sized_from_the_chunk_it_trains_in():
    """The plan picks the chunk the probe found fastest per example at the preset's b (a faster case
    at another b is not the run's) and sizes the rounds from that case, so the run ends by itself."""
    sys.path.insert(0, str(GPU))
    try:
        from size_run import plan
    finally:
        sys.path.remove(str(GPU))
    cases = [{"batch": 4000, "chunk": 128, "seconds_per_step": 0.50, "examples_per_s": 8000, "warmup_s": 2.0},
             {"batch": 1000, "chunk": 128, "seconds_per_step": 0.05, "examples_per_s": 20000, "warmup_s": 1.0},
             {"batch": 4000, "chunk": 1024, "seconds_per_step": 0.25, "examples_per_s": 16000, "warmup_s": 3.0}]
    probe = {"load_seconds": 5.0, "eval_seconds": 1.0, "cases": cases,
             "round_estimate": {"batch": 4000, "local_steps": 4, "silos": 6, "seconds": 13.0,
                                "epochs_per_round": 1.47, "cache_seconds_all_silos": 6.0}}
    p = plan(50, probe, 300, startup=30, overhead=1.3, round_fixed=1.0, finish=10)
    assert p["chunk"] == 1024
    assert p["round_seconds_probed"] == pytest.approx(6 * 4 * 0.25 + 1.0)  # not the chunk-128 estimate of 13 s
    assert p["seconds_per_round"] == pytest.approx(1.3 * 7.0 + 1.0)
    assert p["seconds_fixed"] == pytest.approx(30 + 5 + 6 + 1 + 3 + 10)  # start, cache, first evaluation, warm-up, end
    assert p["rounds"] == (300 - 55) // 10.1 and p["expected_seconds"] <= 300
    # the case at another b is scaled to the run's b when none was measured at it
    alone = plan(50, {**probe, "cases": cases[1:2]}, 300, startup=30, overhead=1.3)
    assert alone["chunk"] == 128 and alone["round_seconds_probed"] == pytest.approx(6 * 4 * 0.05 * 4 + 1.0)


def test_the_first_step_runs_the_products_code_and_names_the_part_that_fails(tmp_path, monkeypatch):
    from benchmarks.gpu import first_step
    from tests.tiny_bert import save_tiny_bert

    monkeypatch.setenv("FEDPOWER_CACHE", str(tmp_path / "cache"))
    model_dir = save_tiny_bert(tmp_path / "tiny-bert", num_layers=3)
    common = ["--preset", str(ROOT / "conf" / "tiny.toml"), "--set", "lora.top-layers=1",
              "--set", "train.cache-frozen=true", "--device", "cpu", "--silos", "2", "--rows", "64"]
    ok = tmp_path / "ok.json"
    assert first_step.main([*common, "--set", f'model.name="{model_dir}"', "--json", str(ok)]) == 0
    report = json.loads(ok.read_text())
    assert {"torch", "transformers", "peft"} <= set(report["versions"])
    assert list(report["parts"]) == ["task", "model", "data", "cache", "dp_sgd_step", "evaluate"]
    assert report["cache"]["rows"] == 64 and report["forward"] == "bf16 autocast"
    assert report["step"]["finite"] and report["step"]["tensors_moved"] == report["step"]["tensors"] > 0
    assert 0.0 <= report["evaluation"]["accuracy"] <= 1.0 and "failed" not in report
    bad = tmp_path / "bad.json"
    assert first_step.main([*common, "--set", f'model.name="{tmp_path / "no-such-model"}"', "--json", str(bad)]) == 1
    assert json.loads(bad.read_text())["failed"]["part"] in ("task", "model")


def test_run_sh_stops_after_a_failing_first_step_with_its_outputs_packed(tmp_path):
    """The fail-fast stage runs before the tests; when it fails, nothing after it starts and the
    session's folder is packed with a summary that names the failure."""
    env = {**os.environ, "OUT": str(tmp_path / "out"), "WORK": str(tmp_path / "work"),
           "CARRY": str(tmp_path / "no-carry"),
           "GLUE_SST2_DIR": str(tmp_path / "no-such-data"), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           # run.sh calls `python`: this interpreter's, whether or not its environment is activated
           "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])}
    proc = subprocess.run(["bash", str(GPU / "run.sh"), "120", "--dry-run"], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    stages = (tmp_path / "work" / "gpu-run" / "stages.tsv").read_text()
    assert "first_step\t1\t" in stages and "probe" not in stages and "tests" not in stages
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "first step" in summary and "FAILED at task" in summary
    assert (tmp_path / "out" / "gpu-run.tar.gz").is_file()


def test_run_sh_runs_the_fast_gpu_tests_before_the_run_and_the_slow_ones_last():
    text = (GPU / "run.sh").read_text()
    order = [text.index(marker) for marker in ("stage environment", "stage first_step", "stage tests", "stage probe",
                                               "stage sst2_run", "stage slow_tests", "\nfinish\n")]
    assert order == sorted(order)
    pytest_runs = [ln for ln in text.splitlines() if "-m pytest" in ln]
    # "-m gpu" alone would override the default "not slow" and pull the slow test into the first stage
    assert [re.search(r'-m ("[^"]*")', ln).group(1) for ln in pytest_runs] == ['"gpu and not slow"', '"gpu and slow"']


def test_the_summary_reads_a_session_folder_and_names_what_is_missing(tmp_path):
    (tmp_path / "stages.tsv").write_text("stage\trc\tseconds\tlimit_s\nsetup\t0\t3\t-\nprobe\t124\t90\t90\n")
    (tmp_path / "tests.log").write_text("....\n12 passed, 1 skipped in 40.1s\n")
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    rounds = [{"server_round": i, "validation-accuracy": 0.8 + i / 100, "validation-from-train-accuracy": 0.81,
               "wall_seconds": 10.0 * i} for i in range(1, 4)]
    (run / "results.json").write_text(json.dumps({"status": "completed", "rounds": rounds,
                                                  "config": {"num-server-rounds": 3, "strategy.name": "fedlora"},
                                                  "privacy_final": {"epsilon_spent": 7.99}}))
    proc = subprocess.run([sys.executable, str(GPU / "summarize.py"), str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "12 passed, 1 skipped" in out and "probe: no probe.json" in out
    assert "completed, 3/3 rounds" in out and "dev 0.830" in out and "probe 124 90s/90" in out
    assert "best" not in out  # the final round's dev, never one picked on the reporting split
    assert "NOT COMPLETE" in out and "adapter NOT saved" in out  # this folder has no saved adapter
    assert "first step: no first_step.json" in out
    (run / "adapter").mkdir()
    (run / "adapter" / "adapter_model.safetensors").write_bytes(b"")
    res = json.loads((run / "results.json").read_text())
    res["privacy"] = {"planned_epsilon": 7.99}
    (run / "results.json").write_text(json.dumps(res))
    out = subprocess.run([sys.executable, str(GPU / "summarize.py"), str(tmp_path)], capture_output=True,
                         text=True).stdout
    assert "complete: status completed; rounds 3/3" in out and "adapter saved" in out


def test_the_carried_packages_are_pinned_once_each_and_flower_is_the_installed_one():
    from importlib.metadata import version

    pins = [ln.split()[0] for ln in (GPU / "wheels.txt").read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert all(re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][A-Za-z0-9_.]*", p) for p in pins), pins
    names = [p.split("==")[0].lower().replace("_", "-") for p in pins]
    assert len(names) == len(set(names)), "two versions of one package stop the device's install"
    assert f"flwr=={version('flwr')}" in pins
    assert {"opacus", "dp-accounting", "cryptography", "pycryptodome"} <= set(names)
    assert "/.gpu-carry/" in (ROOT / ".gitignore").read_text().splitlines()
