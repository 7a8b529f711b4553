"""A real deployment on localhost: one SuperLink and two SuperNodes as separate processes.

Slow (SuperNodes spawn a fresh `flwr-clientapp` process per message). Follows Flower's own CI
recipe; completion is asserted through `flwr ls --format json`.
"""

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from fedpower_app.config import PROJECT_ROOT, load_preset
from fedpower_app.launcher import flwr_env, run_config_arg

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_superlink_and_two_supernodes(tmp_path):
    home = tmp_path / "flwr-home"
    home.mkdir()
    port = free_port()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "deploy"\n\n[superlink.deploy]\naddress = "127.0.0.1:{port}"\ninsecure = true\n')
    env = flwr_env(home)
    procs = []
    try:
        procs.append(subprocess.Popen([str(BIN / "flower-superlink"), "--insecure", "--host", "127.0.0.1", "--port", str(port),
                                       "--database", ":flwr-in-memory:", "--disable-runtime-dependency-installation"],
                                      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.time() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert time.time() < deadline, "SuperLink did not start"
                time.sleep(0.5)
        for i in range(2):
            procs.append(subprocess.Popen([str(BIN / "flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{port}",
                                           "--port", str(free_port()), "--node-config", f"partition-id={i} num-partitions=2",
                                           "--max-retries", "5"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        out = tmp_path / "outputs"
        overrides = run_config_arg({**load_preset(PROJECT_ROOT / "conf" / "tiny.toml"), "output-dir": str(out),
                                    "run-name": "deploy", "num-server-rounds": 1, "strategy.client-rate": 1.0})
        run = subprocess.run([str(BIN / "flwr"), "run", str(PROJECT_ROOT), "deploy", "--stream",
                              "--run-config", overrides],
                             env=env, capture_output=True, text=True, timeout=900)
        ls = subprocess.run([str(BIN / "flwr"), "ls", "deploy", "--format", "json"], env=env, capture_output=True,
                            text=True, timeout=60)
        runs = json.loads(ls.stdout)["runs"]
        assert runs and runs[0]["status"] == "finished:completed", run.stdout[-3000:] + run.stderr[-2000:]
        results = json.loads((out / "deploy" / "results.json").read_text())
        assert results["status"] == "completed" and results["clients"]["count"] == 2
        assert results["rounds"][0]["aggregated"] == 2
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
