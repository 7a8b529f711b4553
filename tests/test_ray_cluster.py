"""A multi-node Ray simulation, tested.

A real Ray cluster of several nodes on this host (``ray.cluster_utils.Cluster`` through
``fedpower_app.launcher.ray_cluster``: the head and worker raylets as separate processes, each with
its own CPU), and ``fedpower-run`` joining it (``RAY_ADDRESS``). The run is the recipe of
BENCHMARKS.md, "Multi-node Ray simulation", word for word (``test_the_recipe_is_the_documented_one``).

It checks that the ClientApps ran on more than one Ray node (the cluster's own task events), that
every reply says on which node its ClientApp ran (the ClientApp's ``runtime`` record), that the run
completed (results.json and fedpower-run's exit code, which follows ``flwr ls``, not ``flwr run``),
and that it released what a single-node run of the same seed releases.

The launcher's refusals (a cluster address with resource arguments, an address where no cluster
answers) are checked without any cluster: they must fail before anything starts.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedpower_app.config import PROJECT_ROOT

NODES, CPUS_PER_NODE = 3, 1
# The BENCHMARKS.md recipe: the cluster, then the run against it. The test adds only where the
# outputs go (--set output-dir/run-name, --flwr-home).
CLUSTER = ["python", "-m", "fedpower_app.launcher.ray_cluster", "--nodes", str(NODES),
           "--cpus-per-node", str(CPUS_PER_NODE)]
RUN = ["fedpower-run", "--preset", "conf/tiny.toml", "--supernodes", "3", "--set", 'dp.noise="seeded"']
EXACT = ("server_round", "round_type", "sampled", "epsilon", "noise_stds", "released", "over_budget")
CLOSE = ("accuracy", "loss")  # float rounding of MKL kernels may differ between processes (~1e-7)


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_TMPDIR")}
    env.update(OMP_NUM_THREADS="1", FLWR_TELEMETRY_ENABLED="0", PYTHONUNBUFFERED="1")
    return env


def _outputs(tmp_path: Path, name: str) -> list[str]:
    return ["--set", f'output-dir="{tmp_path / "outputs"}"', "--set", f'run-name="{name}"',
            "--flwr-home", str(tmp_path / f"flwr-home-{name}")]


def _run(cmd: list[str], tmp_path: Path, log_name: str, timeout: float = 1800) -> subprocess.CompletedProcess:
    cmd = [sys.executable if c == "python" else c for c in cmd]
    proc = subprocess.run(cmd, cwd=PROJECT_ROOT, env=_env(tmp_path), capture_output=True, text=True,
                          timeout=timeout)
    (tmp_path / log_name).write_text(proc.stdout + proc.stderr)
    return proc


def _adapters(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))


DOCUMENTED = ("python -m fedpower_app.launcher.ray_cluster --nodes 3 --cpus-per-node 1 -- "
              "fedpower-run --preset conf/tiny.toml --supernodes 3 --set dp.noise='\"seeded\"'")


def test_the_recipe_is_the_documented_one():
    """BENCHMARKS.md shows the command this file runs (line continuations and spacing aside)."""
    import shlex

    assert shlex.split(DOCUMENTED) == CLUSTER + ["--"] + RUN
    text = (PROJECT_ROOT / "BENCHMARKS.md").read_text()
    section = text.split("## Multi-node Ray simulation", 1)[1].split("\n## ", 1)[0]
    assert DOCUMENTED in re.sub(r"\s+", " ", section.replace("\\\n", " ")), DOCUMENTED


@pytest.mark.slow
def test_multi_node_run_completes_on_several_nodes_and_equals_a_single_node_run(tmp_path):
    t0 = time.monotonic()
    placement_json = tmp_path / "cluster.json"
    cmd = CLUSTER + ["--json", str(placement_json), "--"] + RUN + _outputs(tmp_path, "multi")
    multi = _run(cmd, tmp_path, "multi.log")
    out = multi.stdout + multi.stderr
    assert multi.returncode == 0, out[-4000:]
    cluster = json.loads(placement_json.read_text())
    assert cluster["exit_code"] == 0 and len(cluster["node_ids"]) == NODES
    # fedpower-run joined the cluster (it describes what it joined before starting anything) ...
    assert f"Ray cluster at {cluster['address']}: {NODES} node(s), {NODES * CPUS_PER_NODE} CPUs" in out, out[-4000:]
    # ... and the run completed: fedpower-run's exit code follows `flwr ls`, results.json agrees.
    assert re.search(r"fedpower-run: run \d+ completed", out), out[-4000:]
    multi_res = json.loads((tmp_path / "outputs" / "multi" / "results.json").read_text())
    assert multi_res["status"] == "completed" and len(multi_res["rounds"]) == 2

    # The ClientApps ran on more than one node: every ClientApp call (message) the cluster ran, by node.
    calls = cluster["clientapp_calls_per_node"]
    assert set(calls) <= set(cluster["node_ids"])
    assert len(calls) >= 2, calls
    # 3 size queries + 3 silos x 2 rounds of training (client rate 1, no federated evaluation)
    assert sum(calls.values()) == 3 + 3 * 2, calls
    t_multi = time.monotonic() - t0

    # The same seed on a single node: fedpower-run's private Ray instance on this machine.
    single = _run(RUN + _outputs(tmp_path, "single"), tmp_path, "single.log")
    assert single.returncode == 0, (single.stdout + single.stderr)[-4000:]
    assert "Ray cluster at" not in single.stdout
    single_res = json.loads((tmp_path / "outputs" / "single" / "results.json").read_text())
    assert single_res["status"] == "completed"

    for a, b in zip(multi_res["rounds"], single_res["rounds"], strict=True):
        assert {k: a.get(k) for k in EXACT} == {k: b.get(k) for k in EXACT}
        for k in CLOSE:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), k
    assert multi_res["initial_evaluation"]["accuracy"] == single_res["initial_evaluation"]["accuracy"]
    def ledgers(res):  # every silo's ledger; node ids are drawn at random per run, partition ids are not
        return [{k: v for k, v in row.items() if k != "node"} for row in res["privacy_final"]["silos"]]

    assert ledgers(multi_res) == ledgers(single_res)
    assert multi_res["privacy_final"]["epsilon_spent"] == single_res["privacy_final"]["epsilon_spent"]
    ma, sa = _adapters(tmp_path / "outputs" / "multi"), _adapters(tmp_path / "outputs" / "single")
    assert set(ma) == set(sa)
    import torch

    moved = 0
    for key in ma:
        assert torch.allclose(ma[key], sa[key], rtol=1e-5, atol=1e-7), key
        moved += int("lora_B" in key and bool(ma[key].abs().sum() > 0))
    assert moved, "the adapters did not train: the comparison would be vacuous"
    bitwise = all(torch.equal(ma[k], sa[k]) for k in ma)
    print(f"\nmulti-node run + placement {t_multi:.0f} s; single-node run {time.monotonic() - t0 - t_multi:.0f} s; "
          f"ClientApp calls per node {calls}; adapters bit-identical: {bitwise}")


# -- every reply says where its ClientApp ran ------------------------------------------------------

def _query_replies() -> list[tuple[str | None, int]]:
    """The real ClientApp answers a size query for two silos, in this process: for each reply, the
    Ray node id it carries (None if absent) and the shard size it reports."""
    from client_app.app import app as client_app
    from fedpower_app.config import parse_config
    from fedpower_app.runs.inprocess_grid import InProcessGrid
    from flwr.app import ConfigRecord, Message, MessageType, RecordDict

    cfg = parse_config({"task.synthetic-train-size": 64, "task.synthetic-eval-size": 16, "task.max-length": 16,
                        "train.batch-size": 8})
    grid = InProcessGrid(client_app, 2, cfg.to_dict())
    content = RecordDict({"config": ConfigRecord({"query": "dataset-size"})})
    msgs = [Message(content=content, dst_node_id=n, message_type=MessageType.QUERY) for n in grid.get_node_ids()]
    out = []
    for reply in grid.send_and_receive(msgs):
        assert not reply.has_error(), reply.error.reason
        runtime = reply.content.config_records.get("runtime")
        out.append((None if runtime is None else str(runtime["ray-node-id"]),
                    int(reply.content.metric_records["metrics"]["num-examples"])))
    return out


@pytest.mark.slow
def test_every_reply_carries_the_ray_node_id_it_ran_on(monkeypatch):
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from fedpower_app.launcher.ray_cluster import LocalRayCluster

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert not ray.is_initialized()
    outside = _query_replies()
    assert [node for node, _ in outside] == [None, None]  # not under Ray: absent

    with LocalRayCluster(2, 1) as cluster:
        nodes = cluster.node_ids
        ray.init(address=cluster.address, runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(sys.path)}},
                 logging_level="WARNING")
        try:
            remote = ray.remote(num_cpus=1)(_query_replies)
            got = ray.get([remote.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
                           for node in nodes], timeout=900)
        finally:
            ray.shutdown()
    assert len(set(nodes)) == 2
    for node, replies in zip(nodes, got, strict=True):
        assert [n for n, _ in replies] == [node, node]  # each reply names the node it ran on
        assert [size for _, size in replies] == [size for _, size in outside]  # and answers the same


# -- the launcher's refusals: before anything starts ----------------------------------------------

def _fedpower_run(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "fedpower_app.launcher", "--preset", "conf/tiny.toml",
                           "--supernodes", "3", *args], cwd=PROJECT_ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("args, env, words", [
    (["--ray-address", "127.0.0.1:9", "--ray-cpus", "2"], {}, "Ray refuses num_cpus/num_gpus when joining"),
    (["--ray-gpus", "1"], {"RAY_ADDRESS": "127.0.0.1:9"}, "Ray refuses num_cpus/num_gpus when joining"),
    (["--ray-address", "127.0.0.1:9"], {}, "no Ray cluster answers there"),
    (["--ray-address", "ray://127.0.0.1:10001"], {}, "Ray Client addresses (ray://) are not supported"),
    (["--backend", "inprocess", "--ray-address", "127.0.0.1:9"], {}, "the in-process backend runs without Ray"),
])
def test_refused_ray_arguments_fail_fast_with_one_line(args, env, words):
    proc = _fedpower_run(*args, env_extra=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("fedpower-run: error: ") and words in lines[0], proc.stderr


def test_private_ray_instance_unless_a_cluster_is_named(monkeypatch):
    from fedpower_app.launcher.ray_cluster import ray_address_from, ray_env

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert ray_address_from(None) is None and ray_env(None) == {"RAY_ADDRESS": "local"}
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert ray_address_from(None) == "10.0.0.1:6379"  # the environment variable joins
    assert ray_address_from("local") is None  # the flag wins
    assert ray_env("10.0.0.1:6379") == {"RAY_ADDRESS": "10.0.0.1:6379"}
