"""Tests of ``fedpower-privacy`` (fedpower_app.privacy.cli).

The planner must read the run's configuration (pyproject defaults, presets, ``--set``) and report
exactly what the server's ``build_privacy`` calibrates; its printed sensitivity must be the one the
noise uses (std = z * Delta for the released round, spec 3.1).
"""

from __future__ import annotations

import json
import math
import re

import pytest

from strategies import mechanisms as MECH

from fedpower_app.privacy import accounting as A
from fedpower_app.privacy import cli as privacy_cli
from fedpower_app.config import SCHEMA, load_preset, parse_config
from fedpower_app.privacy import build_privacy

# Server-side noise (the paper's mechanisms). When the config has dp.noise-at, its default is DP-SGD
# on the silos at sample level; the sensitivity table is about the server-side releases.
SERVER = {"dp.noise-at": "server", "dp.clip": 2.0}  # the paper's server-side noise, with C = 2
SERVER_ARGS = [a for k, v in SERVER.items() for a in ("--set", f"{k}={v}")]

METHOD_ROUND_TYPE = {"fedpower": "powerdp", "fedlora": "fedlora", "ffa-lora": "ffa",
                     "input-perturbation": "input", "output-perturbation": "output"}
# Client level releases round deltas averaged over the fixed m = q_c N (6 here): DP-FedAvg style.
CLIENT_ROUND_TYPE = {"fedpower": "powerdp-l", "fedlora": "fedlora-delta", "ffa-lora": "ffa-delta",
                     "input-perturbation": "input-delta", "output-perturbation": "output-delta"}
C, M, R = 2.0, 12, 8  # defaults: dp.clip, MiniLM's LoRA modules (6 layers x query,value), lora.rank
# Spec 3.1: L2 sensitivity of everything released in a round (sample level at k = 1).
SPEC_DELTA = {
    ("powerdp", "sample"): 2 * math.sqrt(2) * C, ("powerdp", "client"): 2 * math.sqrt(2) * C,
    ("fedlora", "sample"): 2 * math.sqrt(2) * C, ("fedlora", "client"): math.sqrt(2) * C,
    ("ffa", "sample"): 2 * C, ("ffa", "client"): C,
    ("input", "sample"): 2 * C, ("input", "client"): C,
    ("output", "sample"): 2 * math.sqrt(M * R + C * C), ("output", "client"): 2 * math.sqrt(M * R + C * C),
    # m = 6, PowerDP-L with the default 2 power iterations: 4 releases of C/m each
    ("powerdp-l", "client"): math.sqrt(4) * C / 6, ("fedlora-delta", "client"): C / 6,
    ("ffa-delta", "client"): C / 6, ("input-delta", "client"): C / 6,
    # the paper's factor-noise releases on the delta keep their diameter sensitivities (random denominator)
    ("powerdp-delta", "client"): 2 * math.sqrt(2) * C, ("output-delta", "client"): 2 * math.sqrt(M * R + C * C),
}

# the default run: the generated training set split over fedpower-run's 6 silos
DEFAULT_SIZES = [parse_config({})["task.synthetic-train-size"] // 6] * 6


def run_json(argv, capsys) -> dict:
    assert privacy_cli.main(list(argv) + ["--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def run_text(argv, capsys) -> str:
    assert privacy_cli.main(list(argv)) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def expected(overrides: dict, sizes: list[int], num_modules: int = M) -> dict:
    hook = build_privacy(parse_config(overrides), client_sizes=sizes, num_modules=num_modules)
    return json.loads(json.dumps(hook.describe(), allow_nan=False))


# ------------------------------------------------------------------------------------------
# same configuration and same calibration as the run
# ------------------------------------------------------------------------------------------


def test_no_arguments_plans_the_default_run(capsys):
    d = run_json([], capsys)
    hook = build_privacy(parse_config({}), client_sizes=DEFAULT_SIZES, num_modules=12)
    assert d["config"] == parse_config({}).to_dict()
    assert d["num_modules"] == 12
    assert d["privacy"] == json.loads(json.dumps(hook.describe(), allow_nan=False))
    if hasattr(hook, "calibration"):  # server-side noise: z and epsilon
        assert d["calibration"]["z"] == pytest.approx(hook.calibration.z, rel=1e-9)
        assert d["calibration"]["epsilon"] == pytest.approx(hook.calibration.epsilon, rel=1e-9)
        assert d["plan"]["client_sizes"] == DEFAULT_SIZES
    out = run_text([], capsys)
    assert "config: pyproject.toml defaults" in out and f"{6 * DEFAULT_SIZES[0]} training examples" in out and "6 silos" in out


def test_default_run_with_server_noise_z_and_epsilon(capsys):
    d = run_json(SERVER_ARGS, capsys)
    hook = build_privacy(parse_config(SERVER), client_sizes=DEFAULT_SIZES, num_modules=12)
    assert d["calibration"]["z"] == pytest.approx(hook.calibration.z, rel=1e-9)
    assert d["calibration"]["epsilon"] == pytest.approx(hook.calibration.epsilon, rel=1e-9)
    assert d["plan"] == hook.plan.to_dict()
    cfg = parse_config(SERVER)
    assert d["plan"]["num_rounds"] == cfg["num-server-rounds"] and d["plan"]["local_steps"] == cfg["train.local-steps"]
    assert d["plan"]["batch_size"] == cfg["train.batch-size"]
    assert d["plan"]["clip"] == 2.0 and d["plan"]["num_modules"] == 12


def test_preset_values_are_used(capsys):
    preset = load_preset("conf/tiny.toml")
    d = run_json(["--preset", "conf/tiny.toml", "--supernodes", "3"], capsys)
    assert d["config"]["num-server-rounds"] == 2 and d["config"]["train.batch-size"] == 16
    assert d["privacy"] == expected(preset, [100] * 3)  # 300 generated examples over 3 silos
    d = run_json(["--preset", "conf/tiny.toml"] + SERVER_ARGS, capsys)
    assert d["plan"]["num_rounds"] == 2 and d["plan"]["local_steps"] == 2 and d["plan"]["batch_size"] == 16
    assert d["plan"]["client_sizes"] == [50] * 6
    assert d["privacy"] == expected({**preset, **SERVER}, [50] * 6)


def test_set_overrides_preset_and_defaults(capsys):
    argv = ["--preset", "conf/tiny.toml", "--set", "num-server-rounds=3", "--set", 'strategy.name="fedlora"',
            "--set", "dp.epsilon=4", "--set", "task.synthetic-train-size=601"] + SERVER_ARGS
    d = run_json(argv, capsys)
    over = {**load_preset("conf/tiny.toml"), "num-server-rounds": 3, "strategy.name": "fedlora", "dp.epsilon": 4.0,
            "task.synthetic-train-size": 601, **SERVER}
    assert d["plan"]["num_rounds"] == 3 and d["plan"]["method"] == "fedlora" and d["plan"]["epsilon"] == 4.0
    assert d["plan"]["client_sizes"] == [101] + [100] * 5  # the clients' IID split of 601
    assert d["privacy"] == expected(over, [101] + [100] * 5)


def test_glue_sizes_from_local_data_and_dataset_size(tmp_path, capsys):
    sst2 = tmp_path / "SST-2"
    sst2.mkdir()
    rows = [f"sentence {i}\t{i % 2}" for i in range(13)]
    (sst2 / "train.tsv").write_text("sentence\tlabel\n" + "\n".join(rows) + "\n", encoding="utf-8")
    (sst2 / "dev.tsv").write_text("sentence\tlabel\n" + "\n".join(rows[:4]) + "\n", encoding="utf-8")
    glue = ["--set", 'task.name="sst2"'] + SERVER_ARGS
    d = run_json(glue + ["--set", f'task.data-dir="{sst2}"'], capsys)
    assert d["plan"]["client_sizes"] == [3, 2, 2, 2, 2, 2]
    # Hub copy (empty data-dir): the rows of the train split are given, task.max-train caps them as in a run.
    d = run_json(glue + ["--set", "task.max-train=600", "--dataset-size", "67349"], capsys)
    assert d["plan"]["client_sizes"] == [100] * 6 and "capped by task.max-train" in d["data"]
    d = run_json(glue + ["--client-sizes", "100,200,300"], capsys)
    assert d["plan"]["client_sizes"] == [100, 200, 300] and d["plan"]["num_clients"] == 3
    # Client level needs no shard sizes.
    d = run_json(glue + ["--set", 'dp.level="client"'], capsys)
    assert d["plan"]["client_sizes"] is None and d["plan"]["num_clients"] == 6


@pytest.mark.parametrize("targets", ["", "dense"])
def test_module_count_is_the_servers(targets):
    """The count on the meta-device architecture equals len(modules) of the server's adapter state."""
    from fedpower_app import model as Mo

    cfg = parse_config({"model.target-modules": targets})
    modules, _ = Mo.split_adapter_keys(Mo.adapter_state(Mo.build_model(cfg, 2)))
    n, found, arch = privacy_cli.count_lora_modules(cfg["model.name"], tuple(cfg.target_modules), cfg["lora.rank"])
    assert n == len(modules) and arch == "bert"
    assert n == (12 if not targets else 19)  # "dense": 3 per layer + the pooler: not layers x targets


# ------------------------------------------------------------------------------------------
# printed sensitivity = the one the noise uses
# ------------------------------------------------------------------------------------------

_ROUND = re.compile(r"^  ([\w-]+)\s+Delta(?:_eff)?=(\S+)\s+std(?:_eq)?=(\S+)\s+z=(\S+)", re.M)
_BLOCKS = re.compile(r"^\s+blocks: (.*)$", re.M)
_BLOCK = re.compile(r"(\w+) Delta=([0-9.e+-]+) std=([0-9.e+-]+)")


@pytest.mark.parametrize("level", ["sample", "client"])
@pytest.mark.parametrize("method", list(METHOD_ROUND_TYPE))
@pytest.mark.parametrize("calibration", ["rigorous", "paper"])
def test_printed_std_is_z_times_printed_delta(method, level, calibration, capsys):
    if calibration == "paper" and level == "client" and method != "fedpower":
        pytest.skip("one client-level paper case is enough")
    over = {"strategy.name": method, "dp.level": level, "dp.calibration": calibration, **SERVER}
    argv = [a for k, v in over.items() for a in ("--set", f"{k}={v}")]
    rt = (CLIENT_ROUND_TYPE if level == "client" else METHOD_ROUND_TYPE)[method]
    hook = build_privacy(parse_config(over), client_sizes=DEFAULT_SIZES, num_modules=M)
    server_stds = hook.noise_stds(rt, 1)  # what the strategy adds (whatever the number of replies)
    # sample level: the k-dependent averages are over the fixed m = q_c N, Delta = 2C/m
    m = (hook.fixed_denominator or 1.0) if MECH.get(rt).k_dependent else 1.0

    # JSON: full precision.
    e = run_json(argv, capsys)["noise"][rt]
    assert e["std"] == pytest.approx(e["z"] * e["delta"], rel=1e-12)
    assert e["delta"] == pytest.approx(SPEC_DELTA[rt, level] / m, rel=1e-12)
    assert [b["std"] for b in e["blocks"]] == pytest.approx(server_stds, rel=1e-12)
    assert A.effective_z([b["delta"] for b in e["blocks"]], [b["std"] for b in e["blocks"]]) == pytest.approx(
        e["z"], rel=1e-12)
    assert e["z"] == pytest.approx(hook.calibration.z_per_round_type[rt], rel=1e-12)

    # Text: the printed numbers.
    out = run_text(argv, capsys)
    rounds = {m[0]: [float(x) for x in m[1:]] for m in _ROUND.findall(out)}
    delta, std, z = rounds[rt]
    assert std == pytest.approx(z * delta, rel=1e-6)
    assert delta == pytest.approx(SPEC_DELTA[rt, level] / m, rel=1e-6)
    if len(server_stds) > 1:
        blocks = [(n, float(d), float(s)) for n, d, s in _BLOCK.findall(_BLOCKS.search(out).group(1))]
        assert [b[2] for b in blocks] == pytest.approx(server_stds, rel=1e-6)
        assert math.sqrt(sum(b[1] ** 2 for b in blocks)) == pytest.approx(delta, rel=1e-6)
        assert A.effective_z([b[1] for b in blocks], [b[2] for b in blocks]) == pytest.approx(z, rel=1e-6)
        if len(set(server_stds)) == 1:  # one std on every block: it is the printed std
            assert std == pytest.approx(server_stds[0], rel=1e-6)
    else:
        assert std == pytest.approx(server_stds[0], rel=1e-6)
    assert "WARNING" not in out


def test_refactorization_prints_both_round_types(capsys):
    out = run_text(["--set", "strategy.refactor-every=3"] + SERVER_ARGS, capsys)
    rounds = {m[0]: [float(x) for x in m[1:]] for m in _ROUND.findall(out)}
    assert set(rounds) == {"powerdp", "fedlora"}
    for delta, std, z in rounds.values():
        assert std == pytest.approx(z * delta, rel=1e-6)
    assert "average over the fixed m = q_c*N" in out  # FedLoRA rounds at sample level: over the fixed m


# ------------------------------------------------------------------------------------------
# the older flag form (docs/privacy.md) still works
# ------------------------------------------------------------------------------------------

CLI_SAMPLE = ["--method", "fedpower", "--level", "sample", "--epsilon", "3", "--rounds", "200",
              "--client-rate", "0.5", "--num-clients", "6", "--dataset-size", "67349",
              "--batch-size", "128", "--local-steps", "1", "--every", "50"] + SERVER_ARGS


def test_old_flags_report(capsys):
    out = run_text(CLI_SAMPLE, capsys)
    assert "effective noise multiplier z = 0.730" in out
    assert "t=200" in out and "t=50 " in out
    assert "valid DP guarantee: yes" in out


def test_old_flags_json(capsys):
    d = run_json(CLI_SAMPLE + ["--sample-mode", "product"], capsys)
    assert d["calibration"]["z"] == pytest.approx(0.6705, rel=1e-3)
    assert d["calibration"]["is_valid_guarantee"] is False
    assert len(d["calibration"]["trajectory"]) == 200
    assert d["plan"]["client_sizes"] == [11225] * 5 + [11224]
    assert d["config"]["dp.sample-mode"] == "product" and d["config"]["dp.epsilon"] == 3.0


def test_old_flags_fixed_noise_and_paper(capsys):
    d = run_json(CLI_SAMPLE + ["--noise-multiplier", "0.8"], capsys)
    assert d["calibration"]["mode"] == "fixed-z" and d["calibration"]["z"] == 0.8
    assert d["calibration"]["epsilon"] < 3.0
    out = run_text(CLI_SAMPLE + ["--calibration", "paper"], capsys)
    assert "NOT a valid DP guarantee" in out and "TRUE epsilon" in out


def test_non_private_run(capsys):
    out = run_text(["--level", "none"], capsys)
    assert "privacy: OFF" in out


# ------------------------------------------------------------------------------------------
# bad input: exit 2, one line naming the config key (or the flag)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["--client-rate", "1.5"], "'strategy.client-rate'"),
        (["--method", "nope"], "'strategy.name'"),
        (["--epsilon", "abc"], "'dp.epsilon'"),
        (["--rounds", "2.5"], "'num-server-rounds'"),
        (["--set", "lora.rank=0"], "'lora.rank'"),
        (["--set", "dp.delta=2"], "'dp.delta'"),
        (["--set", "no.such-key=1"], "no.such-key"),
        (["--set", "dp.epsilon=3", "--epsilon", "4"], "'dp.epsilon'"),
        (["--set", 'task.name="sst2"'] + SERVER_ARGS, "--dataset-size"),
        (["--set", 'task.name="sst2"', "--set", 'task.data-dir="/nonexistent/glue"'], "'task.data-dir'"),
        (["--set", 'model.name="/nonexistent/model"'], "'model.name'"),
        (["--set", 'model.target-modules="nope"'], "'model.target-modules'"),
        (["--supernodes", "1"], "'strategy.min-nodes'"),
        (["--client-sizes", "10,x"], "--client-sizes"),
        (["--supernodes", "4", "--client-sizes", "10,20"], "--client-sizes"),
        (["--preset", "conf/does-not-exist.toml"], "preset"),
        (["--every", "0"], "--every"),
        (["--bogus"], "unrecognized arguments"),
    ],
)
def test_bad_input_exits_2_with_one_line(argv, msg, capsys):
    assert privacy_cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fedpower-privacy: error:") and msg in lines[0]


def test_help(capsys):
    assert privacy_cli.main(["--help"]) == 0
    assert "--preset" in capsys.readouterr().out


@pytest.mark.parametrize("extra", [[], ["--set", "model.train-head=true", "--set", "dp.head-clip=0.2"]])
def test_dp_sgd_printed_delta_is_the_one_the_silos_noise_uses(extra, capsys):
    # The silo builds its DP-SGD parameters from the train message the hook writes; its noise std
    # on a step's clipped sum is sigma * params.sensitivity. The planner must print that Delta.
    from client_app.app import dp_sgd_params

    out = run_text(extra, capsys)
    overrides = {extra[i + 1].split("=")[0]: json.loads(extra[i + 1].split("=")[1]) for i in range(0, len(extra), 2)}
    hook = build_privacy(parse_config(overrides), client_sizes=DEFAULT_SIZES, num_modules=12)
    params = dp_sgd_params(hook.train_config())
    printed_delta = float(re.search(r"each step: Delta=(?:sqrt\(C\^2\+C_h\^2\)=)?(?:C=)?([0-9.e-]+)", out).group(1))
    printed_std = float(re.search(r"sigma\*Delta=([0-9.e-]+)", out).group(1))
    assert printed_delta == pytest.approx(params.sensitivity, rel=1e-3)
    assert printed_std == pytest.approx(params.noise_multiplier * params.sensitivity, rel=1e-3)
    assert params.head_clip == (0.2 if extra else 0.0)
