"""The prepared device command (benchmarks/gpu/): its scripts parse, the GPU recipe preset is a valid
run config whose privacy plan calibrates, the run sizing and the summary behave. Fast, on a CPU;
nothing here needs .gpu-carry/ or a GPU (the dry run in benchmarks/gpu/README.md checks the rest)."""

from __future__ import annotations

import json
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


def test_the_carried_packages_are_pinned_once_each_and_flower_is_the_installed_one():
    from importlib.metadata import version

    pins = [ln.split()[0] for ln in (GPU / "wheels.txt").read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert all(re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][A-Za-z0-9_.]*", p) for p in pins), pins
    names = [p.split("==")[0].lower().replace("_", "-") for p in pins]
    assert len(names) == len(set(names)), "two versions of one package stop the device's install"
    assert f"flwr=={version('flwr')}" in pins
    assert {"opacus", "dp-accounting", "cryptography", "pycryptodome"} <= set(names)
    assert "/.gpu-carry/" in (ROOT / ".gitignore").read_text().splitlines()
