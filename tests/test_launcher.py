"""fedpower-run: validation before anything starts, process cleanup by PID, a clean console.

Fast tests use fake processes (a fake SuperLink that answers /health and starts children the way
the real one does, one of them in a session of its own like flower-superexec); the slow test runs
the real thing twice and checks that nothing it started is left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from fedpower_app import launcher as L
from fedpower_app.config import PROJECT_ROOT, STRATEGIES, TASKS, ConfigError

TINY = str(PROJECT_ROOT / "conf" / "tiny.toml")


# ------------------------------------------------------------------------------------------------
# 1. Validation before anything starts
# ------------------------------------------------------------------------------------------------

@pytest.fixture
def nothing_may_start(monkeypatch):
    """Any attempt to start a process (SuperLink, flwr, Ray) fails the test."""
    def forbidden(*args, **kwargs):
        raise AssertionError(f"a process was started: {args[:1]}")

    monkeypatch.setattr(subprocess, "Popen", forbidden)
    monkeypatch.setattr(subprocess, "run", forbidden)
    monkeypatch.setattr(L.LocalSuperLink, "start", forbidden)
    monkeypatch.setattr(L.cli, "run_flwr", forbidden)


BAD = [
    (["--set", 'strategy.name="fedpwr"'], "strategy.name", ["must be one of", *STRATEGIES, "got 'fedpwr'"]),
    (["--set", "strategy.name=fedpwr"], "strategy.name", ["got 'fedpwr'"]),  # bare word
    (["--set", "dp.epsilon=-1"], "dp.epsilon", ["must be > 0"]),
    (["--set", "dp.epsilon=0"], "dp.epsilon", ["must be > 0"]),
    (["--set", "strategy.client-rate=0"], "strategy.client-rate", ["must be in (0, 1]", "got 0.0"]),
    (["--set", "strategy.client-rate=1.5"], "strategy.client-rate", ["must be in (0, 1]", "got 1.5"]),
    (["--set", "lora.rank=0"], "lora.rank", ["must be >= 1"]),
    (["--set", "lora.rank=-4"], "lora.rank", ["must be >= 1"]),
    (["--set", 'task.name="cola"'], "task.name", ["must be one of", *TASKS, "got 'cola'"]),
    (["--set", "dp.epsilon=\"high\""], "dp.epsilon", ["must be of type float"]),
    (["--set", "no.such-key=1"], "no.such-key", ["unknown config key"]),
    (["--supernodes", "1"], "strategy.min-nodes", ["exceeds --supernodes 1"]),
    (["--set", 'device="cuda"'], "device", ["--gpus-per-client"]),
    (["--set", 'task.name="sst2"', "--set", 'task.data-dir="/no/such/glue"'], "task.data-dir", ["does not exist"]),
]


@pytest.mark.parametrize("extra, key, words", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_config_fails_fast_without_starting_flower(extra, key, words, nothing_may_start, capsys):
    t0 = time.perf_counter()
    rc = L.main(["--preset", TINY, *extra])
    elapsed = time.perf_counter() - t0
    out, err = capsys.readouterr()
    assert rc == 2
    assert elapsed < 1.0, elapsed
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err  # one message, no traceback
    assert lines[0].startswith("fedpower-run: error: "), err
    assert key in lines[0], err
    for word in words:
        assert word in lines[0], err


def test_config_error_message_format(nothing_may_start, capsys):
    assert L.main(["--set", 'strategy.name="fedpwr"']) == 2
    assert capsys.readouterr().err == (
        "fedpower-run: error: config key 'strategy.name' must be one of fedpower, fedlora, ffa-lora, fedsvd, "
        "input-perturbation, output-perturbation, got 'fedpwr'\n")


def test_bad_preset_fails_fast(tmp_path, nothing_may_start, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("[dp]\nepsilon = -2\n")
    assert L.main(["--preset", str(bad)]) == 2
    assert "'dp.epsilon' must be > 0" in capsys.readouterr().err
    assert L.main(["--preset", str(tmp_path / "missing.toml")]) == 2
    assert "missing.toml" in capsys.readouterr().err
    bad.write_text("[dp\n")
    assert L.main(["--preset", str(bad)]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_bad_config_from_the_command_line_is_one_line():
    """The installed entry point, as a user runs it: exit 2, one line, no traceback, no children."""
    exe = Path(sys.executable).with_name("fedpower-run")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "fedpower_app.launcher"]
    t0 = time.perf_counter()
    proc = subprocess.run([*cmd, "--preset", TINY, "--set", "dp.epsilon=-1"], capture_output=True, text=True,
                          timeout=60)
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == "fedpower-run: error: config key 'dp.epsilon' must be > 0, got -1.0\n"
    assert elapsed < 10  # interpreter start included; the check itself is timed above (< 1 s)


def test_valid_config_passes_the_checks(tmp_path):
    # An explicit Flower home outside the app: the check must not depend on the caller's FLWR_HOME.
    cfg = L.check_launch({"num-server-rounds": 1, "strategy.name": "fedlora"}, num_supernodes=3,
                         flwr_home=tmp_path / "flwr-home")
    assert cfg["strategy.name"] == "fedlora"


def test_flower_home_inside_the_app_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="inside the app directory"):
        L.check_launch({"num-server-rounds": 1}, num_supernodes=3, flwr_home=PROJECT_ROOT / ".flwr-home")


# ------------------------------------------------------------------------------------------------
# 3. Process cleanup, by PID
# ------------------------------------------------------------------------------------------------

FAKE_SUPERLINK = textwrap.dedent('''
    """Fake flower-superlink: answers /health, starts a child in its group, a 'superexec' in a
    session of its own (with a 'simulation' child) and a child that ignores SIGTERM."""
    import http.server, json, os, subprocess, sys, time
    port, pidfile = int(sys.argv[1]), sys.argv[2]
    sleep = [sys.executable, "-c", "import time; time.sleep(600)"]
    stubborn = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"]
    superexec = [sys.executable, "-c", "import subprocess, sys, time; "
                 "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"]
    children = [subprocess.Popen(sleep), subprocess.Popen(superexec, start_new_session=True), subprocess.Popen(stubborn)]
    time.sleep(0.5)  # let the superexec start its child

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
        def log_message(self, *a):
            pass

    server = http.server.HTTPServer(("127.0.0.1", port), Health)
    with open(pidfile + ".tmp", "w") as fh:
        json.dump([os.getpid()] + [c.pid for c in children], fh)
    os.replace(pidfile + ".tmp", pidfile)
    server.serve_forever()
''')


@pytest.fixture
def fake_superlink(tmp_path, monkeypatch):
    """LocalSuperLink starts the fake; yields a function returning every PID of its tree."""
    script = tmp_path / "fake_superlink.py"
    script.write_text(FAKE_SUPERLINK)
    pidfile = tmp_path / "pids.json"
    monkeypatch.setattr(L.superlink, "_superlink_command", lambda port, env: [sys.executable, str(script), str(port), str(pidfile)])
    monkeypatch.setattr(L.processes, "STOP_GRACE_SECONDS", 1.5)

    def tree() -> list[int]:
        deadline = time.time() + 30
        while not pidfile.exists():
            assert time.time() < deadline, "the fake SuperLink did not start"
            time.sleep(0.05)
        pids = json.loads(pidfile.read_text())
        return sorted(set(pids) | {c.pid for p in pids for c in _children(p)})

    return tree


def _children(pid):
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _wait_gone(pids, timeout=15.0) -> list[int]:
    deadline = time.time() + timeout
    while (left := [p for p in pids if _running(p)]) and time.time() < deadline:
        time.sleep(0.05)
    return left


@pytest.mark.parametrize("error", [RuntimeError("the run exploded"), KeyboardInterrupt()])
def test_run_that_raises_stops_the_whole_superlink_tree(error, fake_superlink, tmp_path, monkeypatch):
    seen = {}

    def exploding_stream(cmd, env, **kwargs):
        seen["pids"] = fake_superlink()
        seen["cmd"], seen["home"] = cmd, env["FLWR_HOME"]
        assert all(_running(p) for p in seen["pids"])
        raise error

    monkeypatch.setattr(L.flwr_run, "_stream", exploding_stream)
    before = list(L._STARTED)
    with pytest.raises(type(error)):
        L.run_flwr(PROJECT_ROOT, {"num-server-rounds": 1}, flwr_home=tmp_path / "home", echo=False,
                   keep_superlink=False)
    assert len(seen["pids"]) == 5  # superlink, its child, superexec (own session), its child, stubborn child
    assert _wait_gone(seen["pids"]) == []
    assert L._STARTED == before
    # flwr ran against the launcher's own connection, from a private CLI home that is gone now
    assert seen["cmd"][3] == L.CONNECTION and "--stream" in seen["cmd"]
    assert not Path(seen["home"]).exists()
    assert not (tmp_path / "home" / "fedpower-run").exists()


def test_completed_run_stops_the_superlink_and_returns_the_status(fake_superlink, tmp_path, monkeypatch):
    seen = {}

    def stream(cmd, env, **kwargs):
        seen["pids"] = fake_superlink()
        seen["config"] = (Path(env["FLWR_HOME"]) / "config.toml").read_text()
        return "42", 0, "Successfully started run 42\n", False

    monkeypatch.setattr(L.flwr_run, "_stream", stream)
    monkeypatch.setattr(L.flwr_run, "run_status", lambda run_id, env, connection=None: "finished:completed")
    outcome = L.run_flwr(PROJECT_ROOT, {}, flwr_home=tmp_path / "home", echo=False, keep_superlink=False,
                         superlink_port=L.free_port())
    assert outcome.ok and outcome.run_id == "42"
    assert _wait_gone(seen["pids"]) == []
    assert 'default = "fedpower-run"' in seen["config"] and "insecure = true" in seen["config"]
    assert "address = \"127.0.0.1:" in seen["config"]


def test_kept_superlink_is_reused_then_stopped_by_pid(fake_superlink, tmp_path, monkeypatch):
    """Library use (fedpower-experiment): one SuperLink for several runs, stopped by stop_local_superlink."""
    monkeypatch.setattr(L.flwr_run, "_stream", lambda cmd, env, **kw: ("1", 0, "", False))
    monkeypatch.setattr(L.flwr_run, "run_status", lambda run_id, env, connection=None: "finished:completed")
    home = tmp_path / "home"
    before = list(L._STARTED)
    L.run_flwr(PROJECT_ROOT, {}, flwr_home=home, echo=False)
    pids = fake_superlink()
    link = L._kept_superlink(home.resolve(), None)
    assert link is not None and link.superlink_pid == pids[0] and pids[0] in [c.pid for c in _children(link.pid)]
    L.run_flwr(PROJECT_ROOT, {}, flwr_home=home, echo=False)
    assert L._kept_superlink(home.resolve(), None) is link  # reused, not a second SuperLink
    assert all(_running(p) for p in pids)
    L.stop_local_superlink(tmp_path / "other-home")  # someone else's home: nothing happens
    assert all(_running(p) for p in pids)
    stopped = L.stop_local_superlink(home)
    assert set(pids) <= set(stopped)
    assert _wait_gone(pids) == [] and L._STARTED == before


def test_sigterm_to_fedpower_run_stops_everything(fake_superlink, tmp_path):
    """The real entry point in a subprocess: SIGTERM while the run streams -> exit 130, nothing left."""
    pidfile = tmp_path / "pids.json"
    fake_flwr = tmp_path / "flwr"
    fake_flwr.write_text(f"#!{sys.executable}\n" + textwrap.dedent("""
        import json, sys, time
        if sys.argv[1] == "run":
            print("Successfully started run 7", flush=True)
            time.sleep(600)
        elif sys.argv[1] == "ls":
            print(json.dumps({"runs": [{"run-id": 7, "status": "running"}]}))
    """))
    fake_flwr.chmod(0o755)
    script = tmp_path / "fake_superlink.py"
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(f"""
        import sys
        from fedpower_app import launcher as L
        L.superlink._superlink_command = lambda port, env: [sys.executable, {str(script)!r}, str(port), {str(pidfile)!r}]
        L.flwr_run._flwr = lambda: {str(fake_flwr)!r}
        L.processes.STOP_GRACE_SECONDS = 1.5
        sys.exit(L.main(["--preset", {TINY!r}, "--flwr-home", {str(tmp_path / "home")!r}]))
    """))
    proc = subprocess.Popen([sys.executable, str(driver)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=str(PROJECT_ROOT))
    try:
        pids = fake_superlink()
        deadline = time.time() + 30
        while not [c for c in _children(proc.pid) if "flwr" in " ".join(c.cmdline()[:2]) and "run" in c.cmdline()]:
            assert time.time() < deadline, "flwr run did not start"
            time.sleep(0.05)
        pids += [c.pid for c in _children(proc.pid)]
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "terminated" in err and "Traceback" not in err
    assert _wait_gone(pids) == []


def test_sigkill_of_the_launcher_stops_the_whole_run_within_seconds(fake_superlink, tmp_path):
    """The launcher SIGKILLed as a whole process group (no cleanup of its own runs): the run's supervisor
    stops the SuperLink and everything below it (a child in a session of its own, one that ignores
    SIGTERM) within seconds, and the run directory's lock is free once they are gone."""
    from fedpower_app.runs import owner as O

    run_dir = (tmp_path / "out" / "run").resolve()
    script = tmp_path / "fake_superlink.py"
    pidfile = tmp_path / "pids.json"
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(f"""
        import sys, time
        from fedpower_app import launcher as L
        from fedpower_app.runs.owner import claim_run_dir
        L.superlink._superlink_command = lambda port, env: [sys.executable, {str(script)!r}, str(port), {str(pidfile)!r}]
        L.processes.STOP_GRACE_SECONDS = 1.5
        lock = claim_run_dir({str(run_dir)!r})
        link = L.LocalSuperLink({str(tmp_path / "home")!r}, run_lock=lock).start()
        print(link.pid, flush=True)
        time.sleep(600)
    """))
    launcher = subprocess.Popen([sys.executable, str(driver)], stdout=subprocess.PIPE, text=True, cwd=str(PROJECT_ROOT),
                                start_new_session=True)
    try:
        supervisor = int(launcher.stdout.readline())
        pids = fake_superlink()
        assert psutil.Process(pids[0]).ppid() == supervisor and os.getsid(supervisor) != launcher.pid
        assert set(O.run_processes(run_dir)) >= {supervisor, *pids}  # every process carries the run's mark
        assert O._try_lock(run_dir / O.LOCK_FILE) is None
        t0 = time.time()
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=10)
        assert _wait_gone([supervisor, *pids], timeout=15) == []
        assert time.time() - t0 < 10  # grace 1.5 s, then SIGKILL
        assert O.run_processes(run_dir) == []
        O.claim_run_dir(run_dir, say=pytest.fail).release()  # free, and no leftover to stop
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)


def test_timeout_stops_a_silent_flwr_run(fake_superlink, tmp_path, monkeypatch):
    """run_flwr(timeout=...) holds even when `flwr run` prints nothing (fedpower-experiment --cell-timeout)."""
    fake_flwr = tmp_path / "flwr"
    fake_flwr.write_text(f"#!{sys.executable}\nimport sys, time\nif sys.argv[1] == 'run':\n    time.sleep(600)\n")
    fake_flwr.chmod(0o755)
    monkeypatch.setattr(L.flwr_run, "_flwr", lambda: str(fake_flwr))
    t0 = time.time()
    outcome = L.run_flwr(PROJECT_ROOT, {}, flwr_home=tmp_path / "home", echo=False, timeout=1.5, keep_superlink=False)
    assert time.time() - t0 < 20
    assert outcome.status == "not-started" and not outcome.ok and outcome.timed_out
    assert _wait_gone(fake_superlink()) == []


def test_a_second_ctrl_c_does_not_interrupt_the_cleanup():
    # The handlers in force before are restored after. Not necessarily Python's default: a process
    # started in the background by a non-interactive shell (nohup, `&`) inherits SIGINT ignored.
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        with L._DeferSignals():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)  # the cleanup goes on
            done = True
    assert done
    with L._DeferSignals(reraise=False):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_terminate_tree_escalates_to_sigkill(tmp_path):
    stubborn = subprocess.Popen([sys.executable, "-c", "import signal, subprocess, sys, time; "
                                 "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                 "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], "
                                 "start_new_session=True); print('ready', flush=True); time.sleep(600)"],
                                stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert stubborn.stdout.readline().strip() == "ready"
    pids = [stubborn.pid] + [c.pid for c in _children(stubborn.pid)]
    assert len(pids) == 2
    t0 = time.time()
    signalled = L.terminate_tree(stubborn, grace=1.0)
    assert set(pids) <= set(signalled)
    assert _wait_gone(pids, timeout=5) == []
    assert time.time() - t0 < 10


def test_real_superlink_starts_and_stops(tmp_path):
    """The real flower-superlink: answers on a private port, and nothing of it is left after stop()."""
    link = L.LocalSuperLink(tmp_path / "home").start()
    try:
        assert link.alive() and L._health(link.port)
        assert psutil.Process(link.superlink_pid).ppid() == link.pid  # under the run's supervisor
        cmd = psutil.Process(link.superlink_pid).cmdline()
        for flag in ("--simulation", "--insecure", "--isolation", "subprocess", "--database", ":flwr-in-memory:"):
            assert flag in cmd
        assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[cmd.index("--port") + 1] == str(link.port)
        assert os.getsid(link.pid) == link.pid  # the supervisor: a session of its own
        deadline = time.time() + 20
        while not _children(link.pid) and time.time() < deadline:  # flower-superexec
            time.sleep(0.1)
        pids = [link.pid] + [c.pid for c in _children(link.pid)]
    finally:
        stopped = link.stop()
    assert set(pids) <= set(stopped)
    assert _wait_gone(pids) == []
    assert not L._health(link.port)


def test_health_probe_that_reads_back_its_own_request_means_not_yet():
    """A TCP self-connect (the probe's source port equals the SuperLink's port, which is in the
    ephemeral range and not yet listening) echoes the request back; http.client raises
    BadStatusLine. CI failed a start on it once: it must read as "not healthy yet", not crash."""
    import socket
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]

    def echo_once():
        conn, _ = server.accept()
        with conn:
            conn.sendall(conn.recv(4096))  # what a self-connected socket reads: its own bytes

    thread = threading.Thread(target=echo_once, daemon=True)
    thread.start()
    try:
        assert L._health(port) is False
    finally:
        thread.join(timeout=5)
        server.close()


def test_a_busy_port_is_never_shared(fake_superlink, tmp_path, monkeypatch, capsys):
    """A requested port someone else holds (e.g. a SuperLink of a concurrent test session): this process
    starts its own SuperLink on a free port instead of talking to theirs; later calls for the same
    port reuse it."""
    import socket

    monkeypatch.setattr(L.flwr_run, "_stream", lambda cmd, env, **kw: ("1", 0, "", False))
    monkeypatch.setattr(L.flwr_run, "run_status", lambda run_id, env, connection=None: "finished:completed")
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        busy = other.getsockname()[1]
        home = tmp_path / "home"
        L.run_flwr(PROJECT_ROOT, {}, flwr_home=home, superlink_port=busy, echo=False)
        link = L._kept_superlink(home.resolve(), busy)
        try:
            assert link is not None and link.port != busy and link.requested_port == busy
            assert f"port {busy} is in use" in capsys.readouterr().err
            L.run_flwr(PROJECT_ROOT, {}, flwr_home=home, superlink_port=busy, echo=False)
            assert L._kept_superlink(home.resolve(), busy) is link
        finally:
            L.stop_local_superlink(home)
    assert _wait_gone(fake_superlink()) == []


def test_no_pkill_and_no_stop_superlink_flag():
    source = Path(L.__file__).read_text()
    assert "pkill" not in source.replace("``pkill -f``", "")
    with pytest.raises(SystemExit):
        L.main(["--stop-superlink"])


# ------------------------------------------------------------------------------------------------
# 4. Console
# ------------------------------------------------------------------------------------------------

# Lines captured from `fedpower-run --preset conf/tiny.toml` before this change (flwr 1.41, ray 2.55,
# transformers 5.23): a completed run and a run failing in the ServerApp.
CAPTURED_OK = """\
Using SuperLink: local (127.0.0.1:49128)
Successfully started run 12380993264987078641
\x1b[92mINFO \x1b[0m:      Starting logstream for run_id `12380993264987078641`
\x1b[92mINFO \x1b[0m:      Starting Flower Simulation
\x1b[93mWARNING \x1b[0m:   Since flwr 1.32, default simulated SuperNodes changed from 10 to 2.
\x1b[92mINFO \x1b[0m:      Federation `@none/default` (6 simulated SuperNodes)
\x1b[92mINFO \x1b[0m:      To change federation size, use the following command:
\x1b[92mINFO \x1b[0m:      \tflwr federation simulation-config @none/default <superlink> --num-supernodes <N>
Successfully installed fedpower to /tmp/fp/home-before/apps/fedpower.fedpower.0.1.0.4868a2c8.
\x1b[92mINFO \x1b[0m:      fedpower run fedpower-synthetic-20261123-142816 -> /tmp/fp/out/results.json
11/23/2026 14:28:17:DEBUG:Initialising: RayBackend
11/23/2026 14:28:17:DEBUG:Backend config: {'client_resources': {'num_cpus': 1, 'num_gpus': 0.0}, 'init_args': {'logging_level': 'WARNING', 'log_to_driver': True}, 'actor': {'tensorflow': 0}}

Loading weights:   0%|          | 0/103 [00:00<?, ?it/s]
Loading weights: 100%|██████████| 103/103 [00:00<00:00, 8574.76it/s]
/work/main/.venv/lib/python3.11/site-packages/transformers/modeling_utils.py:3303: FutureWarning: `is_gradient_checkpointing` is deprecated and will be removed in v6. Use `is_activation_checkpointing` instead.
  warnings.warn(
\x1b[92mINFO \x1b[0m:      task synthetic: 300 train / validation 100 eval examples; model minilm, 12 LoRA modules (rank 8)
/work/main/.venv/lib/python3.11/site-packages/ray/_private/worker.py:2051: FutureWarning: Tip: In future versions of Ray, Ray will no longer override accelerator visible devices env var if num_gpus=0 or num_gpus=None (default). To enable this behavior and turn off this error message, set RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0
  warnings.warn(
11/23/2026 14:28:22:DEBUG:Constructed ActorPool with: 2 actors
\x1b[36m(ClientAppActor pid=4699)\x1b[0m 
Loading weights:   0%|          | 0/103 [00:00<?, ?it/s]
Loading weights: 100%|██████████| 103/103 [00:00<00:00, 26997.46it/s]
\x1b[36m(ClientAppActor pid=4699)\x1b[0m /work/main/.venv/lib/python3.11/site-packages/transformers/modeling_utils.py:3303: FutureWarning: `is_gradient_checkpointing` is deprecated and will be removed in v6. Use `is_activation_checkpointing` instead.
\x1b[36m(ClientAppActor pid=4699)\x1b[0m   warnings.warn(
\x1b[92mINFO \x1b[0m:      6 clients, shard sizes [50, 50, 50, 50, 50, 50]
\x1b[93mWARNING \x1b[0m:   node 3 failed the size query and is left out: boom
\x1b[92mINFO \x1b[0m:      [round 0] acc 0.6400 loss 0.6919 (initial model)
\x1b[92mINFO \x1b[0m:      [round 1/2 powerdp] acc 0.3900 loss 0.6996 | eps 5.821/8 | clients 2 sampled, 2 aggregated, 0 dropped | up 0.60 MB down 0.60 MB | server 0.01 s | round 2.5 s | elapsed 2.5 s
\x1b[36m(ClientAppActor pid=7791)\x1b[0m /work/main/fedpower_app/training/dp_sgd.py:123: UserWarning: Full backward hook is firing when gradients are computed with respect to module outputs since no inputs require gradients.
\x1b[36m(ClientAppActor pid=7791)\x1b[0m   loss.backward()
\x1b[36m(ClientAppActor pid=7791)\x1b[0m /work/main/fedpower_app/x.py:3: UserWarning: some new warning
\x1b[36m(ClientAppActor pid=7791)\x1b[0m   model.step()
\x1b[92mINFO \x1b[0m:      run fedpower-synthetic-20261123-142816 completed: final accuracy 0.5100, epsilon 8.000 (delta 1e-05)
11/23/2026 14:28:34:DEBUG:ServerApp finished running.
11/23/2026 14:28:34:DEBUG:Triggered stop event for Simulation Runtime.
11/23/2026 14:28:35:DEBUG:Terminated 2 actors
\x1b[36m(ClientAppActor pid=4698)\x1b[0m \x1b[93mWARNING \x1b[0m:   Manually terminating ClientAppActor
11/23/2026 14:28:37:DEBUG:Terminated RayBackend
\x1b[92mINFO \x1b[0m:      
11/23/2026 14:28:37:INFO:
11/23/2026 14:28:37:DEBUG:[flwr-simulation] Will push Simulation task output
"""

TRACEBACK = """\
Traceback (most recent call last):
  File "/work/main/.venv/lib/python3.11/site-packages/flwr/simulation/app.py", line 337, in run_simulation_process
    simulation_result = _run_simulation(
                        ^^^^^^^^^^^^^^^^
  File "/tmp/fp/home-before/apps/fedpower.fedpower.0.1.0.4868a2c8/server_app/app.py", line 131, in main
    cfg = parse_config(context.run_config)
          ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/tmp/fp/home-before/apps/fedpower.fedpower.0.1.0.4868a2c8/fedpower_app/config.py", line 173, in parse_config
    raise ConfigError(f"config key {key!r} {problem}, got {values[key]!r}")
fedpower_app.config.ConfigError: config key 'strategy.name' must be one of fedpower, fedlora, ffa-lora, input-perturbation, output-perturbation, got 'fedpwr'
"""
EXIT_700 = """\

An unhandled exception occurred when running the simulation.

For more information, visit: <https://flower.ai/docs/framework/1.41/en/ref-exit-codes/700.html>
"""
CAPTURED_FAILED = (
    "11/23/2026 14:27:31:DEBUG:Constructed ActorPool with: 2 actors\n"
    "11/23/2026 14:27:35:DEBUG:Queue timeout. No context received.\n"
    "\x1b[91mERROR \x1b[0m:     Simulation raised an exception\n" + TRACEBACK
    + "11/23/2026 14:27:35:ERROR:Simulation raised an exception\n" + TRACEBACK
    + "\x1b[91mERROR \x1b[0m:     Exit Code: 700\n" + EXIT_700
    + "11/23/2026 14:27:35:ERROR:Exit Code: 700\n" + EXIT_700
    + "11/23/2026 14:27:35:DEBUG:[flwr-simulation] Will push Simulation task output\n"
)


def _kept(text: str) -> str:
    return "".join(L.filter_lines(text.splitlines(keepends=True)))


def test_console_filter_hides_known_noise_and_keeps_the_run():
    kept = _kept(CAPTURED_OK)
    plain = L.ANSI_RE.sub("", kept)
    for noise in ("DEBUG", "FutureWarning", "warnings.warn(", "Full backward hook", "loss.backward()",
                  "Since flwr 1.32", "To change federation size",
                  "flwr federation simulation-config", "Loading weights", "Successfully installed",
                  "Manually terminating", "11/23/2026"):
        assert noise not in plain, noise
    for wanted in ("Successfully started run 12380993264987078641", "Starting Flower Simulation",
                   "Federation `@none/default` (6 simulated SuperNodes)", "task synthetic: 300 train",
                   "6 clients, shard sizes", "WARNING :   node 3 failed the size query and is left out: boom",
                   "[round 0] acc 0.6400", "[round 1/2 powerdp] acc 0.3900", "run fedpower-synthetic-20261123-142816 "
                   "completed", "UserWarning: some new warning", "  model.step()"):
        assert wanted in plain, wanted
    assert "\x1b[92mINFO" in kept  # colours are passed through untouched
    assert not any(line.strip() in ("INFO :", "(ClientAppActor pid=4699)") for line in plain.splitlines())


def test_console_filter_shows_a_failure_once():
    plain = L.ANSI_RE.sub("", _kept(CAPTURED_FAILED))
    assert plain.count("Traceback (most recent call last):") == 1
    assert plain.count("ConfigError: config key 'strategy.name' must be one of") == 1
    assert plain.count("Simulation raised an exception") == 1
    assert plain.count("Exit Code: 700") == 1 and plain.count("An unhandled exception occurred") == 1
    assert "DEBUG" not in plain
    assert plain.startswith("ERROR :     Simulation raised an exception\n" + TRACEBACK)


# A ClientApp that fails to import (captured with --verbose, frames trimmed): Flower logs the
# traceback itself, then again as the cause of "Simulation raised an exception".
CLIENTAPP_TB = """\
  File "/work/main/.venv/lib/python3.11/site-packages/flwr/simulation/run_simulation.py", line 319, in _main_loop
    vce.start_vce(
  File "/work/main/.venv/lib/python3.11/site-packages/flwr/supercore/object_ref.py", line 159, in load_app
    module = importlib.import_module(module_str)
             ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "<frozen importlib._bootstrap>", line 1204, in _gcd_import
  File "/tmp/fp/home-after/apps/fedpower.fedpower.0.1.0.342bc539/fedpower_app/silo_ledger.py", line 48, in <module>
    pld_interval: float = A.DEFAULT_PLD_INTERVAL) -> float:
                          ^^^^^^^^^^^^^^^^^^^^^^
AttributeError: module 'fedpower_app.privacy.accounting' has no attribute 'DEFAULT_PLD_INTERVAL'
"""
CAPTURED_CLIENTAPP = (
    "\x1b[91mERROR 2026-11-23 15:02:18,214\x1b[0m:     An exception occurred !! module 'fedpower_app.privacy.accounting' has "
    "no attribute 'DEFAULT_PLD_INTERVAL'\n"
    "\x1b[91mERROR 2026-11-23 15:02:18,221\x1b[0m:     Traceback (most recent call last):\n" + CLIENTAPP_TB + "\n"
    "\x1b[91mERROR 2026-11-23 15:02:18,221\x1b[0m:     Simulation raised an exception\n"
    "Traceback (most recent call last):\n" + CLIENTAPP_TB + "\n"
    "The above exception was the direct cause of the following exception:\n\n"
    "Traceback (most recent call last):\n"
    '  File "/work/main/.venv/lib/python3.11/site-packages/flwr/simulation/run_simulation.py", line 347, in _main_loop\n'
    '    raise RuntimeError("An error was encountered. Ending simulation.") from ex\n'
    "RuntimeError: An error was encountered. Ending simulation.\n"
    "\x1b[91mERROR 2026-11-23 15:02:18,225\x1b[0m:     Exit Code: 700\n" + EXIT_700
)


def test_console_filter_shows_a_repeated_traceback_once():
    plain = L.ANSI_RE.sub("", _kept(CAPTURED_CLIENTAPP))
    assert plain.count("AttributeError: module 'fedpower_app.privacy.accounting'") == 2  # traceback + the note
    assert plain.count("silo_ledger.py") == 1 and plain.count("Traceback (most recent call last):") == 2
    assert ("ERROR 2026-11-23 15:02:18,221:     Simulation raised an exception\n(the same traceback as above: "
            "AttributeError: module 'fedpower_app.privacy.accounting' has no attribute 'DEFAULT_PLD_INTERVAL')\n") in plain
    assert "The above exception was the direct cause" in plain and "RuntimeError: An error was encountered" in plain
    assert plain.count("Exit Code: 700") == 1
    # the closing line names the cause, not Flower's wrapper
    assert L.last_exception_line(CAPTURED_CLIENTAPP) == (
        "AttributeError: module 'fedpower_app.privacy.accounting' has no attribute 'DEFAULT_PLD_INTERVAL'")


def test_console_filter_flushes_a_traceback_cut_short():
    lines = ["Traceback (most recent call last):\n", '  File "x.py", line 1, in <module>\n']
    assert L.filter_lines(lines) == lines


def test_console_filter_never_drops_errors_or_new_text():
    lines = [
        "\x1b[91mERROR \x1b[0m:     Since flwr 1.32, default simulated SuperNodes changed from 10 to 2.\n",  # ERROR
        "11/23/2026 14:27:35:WARNING:a warning only the root logger printed\n",
        "11/23/2026 14:27:35:ERROR:an error only the root logger printed\n",
        "Traceback (most recent call last):\n",
        "ValueError: boom\n",
        "\x1b[93mWARNING \x1b[0m:   fedpower: budget exhausted, stopping\n",
    ]
    assert L.filter_lines(lines) == lines
    # a repeated block stops being dropped where it differs from what was shown
    shown = ["\x1b[91mERROR \x1b[0m:     Simulation raised an exception\n", "Traceback (most recent call last):\n",
             "KeyError: 'a'\n"]
    repeat = ["11/23/2026 14:27:35:ERROR:Simulation raised an exception\n", "Traceback (most recent call last):\n",
              "TypeError: something else\n"]
    assert L.filter_lines(shown + repeat) == shown + ["TypeError: something else\n"]


def test_last_exception_line_and_error_summary():
    assert L.last_exception_line(CAPTURED_FAILED) == (
        "ConfigError: config key 'strategy.name' must be one of fedpower, fedlora, ffa-lora, input-perturbation, "
        "output-perturbation, got 'fedpwr'")
    assert L.last_exception_line(CAPTURED_OK) is None
    outcome = L.RunOutcome("1", "finished:failed", 0, 3.0, CAPTURED_FAILED)
    assert not outcome.ok and outcome.error_summary().startswith("ConfigError: config key 'strategy.name'")


def test_quiet_and_verbose_environments(monkeypatch):
    monkeypatch.setenv("PYTHONWARNINGS", "error::DeprecationWarning")
    quiet = L.output_env(L.flwr_env(None), verbose=False)
    assert quiet["PYTHONWARNINGS"].startswith("error::DeprecationWarning,")  # the user's filters are kept
    assert "ignore::FutureWarning:ray._private.worker" in quiet["PYTHONWARNINGS"]
    assert "ignore::FutureWarning:transformers.modeling_utils" in quiet["PYTHONWARNINGS"]
    # The filters work in a fresh interpreter (as in the simulation and the Ray workers); other
    # warnings still show.
    code = textwrap.dedent("""
        import warnings
        warnings.warn_explicit("Tip: In future versions of Ray, Ray will no longer override accelerator", FutureWarning,
                               "worker.py", 2051, module="ray._private.worker")
        warnings.warn_explicit("`is_gradient_checkpointing` is deprecated", FutureWarning, "modeling_utils.py", 3303,
                               module="transformers.modeling_utils")
        warnings.warn("Full backward hook is firing when gradients are computed with respect to module outputs since "
                      "no inputs require gradients. See https://docs.pytorch.org/...", UserWarning)
        warnings.warn("a warning that must stay", FutureWarning)
    """)
    run = subprocess.run([sys.executable, "-c", code], env={**quiet, "PYTHONWARNINGS": quiet["PYTHONWARNINGS"].split(",", 1)[1]},
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and "Invalid -W option" not in run.stderr, run.stderr
    assert "a warning that must stay" in run.stderr
    for hidden in ("Tip: In future", "is_gradient_checkpointing", "Full backward hook"):
        assert hidden not in run.stderr, run.stderr
    assert quiet["HF_HUB_DISABLE_PROGRESS_BARS"] == "1" and "FLWR_LOG_LEVEL" not in quiet
    verbose = L.output_env(L.flwr_env(None), verbose=True)
    assert verbose["PYTHONWARNINGS"] == "error::DeprecationWarning"
    assert verbose["FLWR_LOG_LEVEL"] == "DEBUG" and verbose["FEDPOWER_VERBOSE"] == "1"


def test_setup_logging_stops_duplicate_flower_records(monkeypatch):
    import logging

    from fedpower_app.logging_setup import setup_logging

    flwr_logger = logging.getLogger("flwr")
    fed = logging.getLogger("fedpower")
    saved = (flwr_logger.propagate, list(fed.handlers), fed.level, fed.propagate)
    try:
        monkeypatch.delenv("FEDPOWER_VERBOSE", raising=False)
        flwr_logger.propagate = True
        setup_logging()
        if flwr_logger.handlers:
            assert flwr_logger.propagate is False
        assert fed.level == logging.INFO
        monkeypatch.setenv("FEDPOWER_VERBOSE", "1")
        flwr_logger.propagate = True
        setup_logging()
        assert flwr_logger.propagate is True and fed.level == logging.DEBUG
    finally:
        flwr_logger.propagate, fed.handlers[:], _, _ = saved[0], saved[1], None, None
        fed.setLevel(saved[2])
        fed.propagate = saved[3]


# ------------------------------------------------------------------------------------------------
# Slow: the real fedpower-run, twice; nothing it started may be left
# ------------------------------------------------------------------------------------------------

def _processes_tied_to(home: Path) -> list[str]:
    """Processes whose environment names ``home`` (the run's private FLWR_HOME, or the CLI home below
    it). Matching by environment is fine in a test; the product never matches processes."""
    found = []
    needle = str(home).encode()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            environ = (d / "environ").read_bytes()
            cmdline = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(v.startswith(b"FLWR_HOME=" + needle) for v in environ.split(b"\0")):
            found.append(f"{d.name}: {cmdline}")
    return found


@pytest.mark.slow
@pytest.mark.parametrize("verbose", [False, True], ids=["quiet", "verbose"])
def test_fedpower_run_leaves_no_process_behind(verbose, tmp_path):
    home = tmp_path / "flwr-home"
    exe = Path(sys.executable).with_name("fedpower-run")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [str(exe), "--preset", TINY, "--set", "num-server-rounds=1", "--supernodes", "2",
           "--set", f'output-dir="{tmp_path / "out"}"', "--flwr-home", str(home)] + (["--verbose"] if verbose else [])
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=str(tmp_path))
    descendants: set[int] = set()
    output = []
    assert proc.stdout is not None
    for line in proc.stdout:  # record every process the launcher starts while it runs
        output.append(line)
        descendants |= {c.pid for c in _children(proc.pid)}
    proc.wait(timeout=900)
    text = "".join(output)
    assert proc.returncode == 0, text[-4000:]
    assert "completed in" in text
    assert len(descendants) >= 3, descendants  # flwr run, the SuperLink, superexec, simulation...
    assert _wait_gone(descendants, timeout=30) == [], text[-2000:]
    assert _processes_tied_to(home) == []
    assert not (home / "fedpower-run").exists() and not (home / "local-superlink").exists()
    plain = L.ANSI_RE.sub("", text)
    if verbose:
        assert "DEBUG" in plain and "fedpower-run: SuperLink pid" in plain
    else:
        for noise in ("DEBUG", "FutureWarning", "Since flwr 1.32", "Loading weights", "Manually terminating"):
            assert noise not in plain, noise


def _start_fedpower_run(tmp_path, home, *extra):
    exe = Path(sys.executable).with_name("fedpower-run")
    cmd = [str(exe), "--preset", TINY, "--supernodes", "2", "--set", f'output-dir="{tmp_path / "out"}"',
           "--flwr-home", str(home), *extra]
    return subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=str(tmp_path), start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


@pytest.mark.slow
def test_failed_run_reports_the_error_once_and_leaves_nothing(tmp_path):
    """A run that fails inside the ServerApp, past every launcher check: it resumes a run directory
    whose checkpoint is damaged (only the ServerApp opens checkpoints). Exit 1, the traceback once,
    one closing error line, and no process left."""
    run_dir = tmp_path / "out" / "damaged"
    run_dir.mkdir(parents=True)
    (run_dir / "checkpoint.pt").write_bytes(b"not a checkpoint")
    home = tmp_path / "flwr-home"
    proc = _start_fedpower_run(tmp_path, home, "--set", 'run-name="damaged"', "--set", "resume=true",
                               "--set", "num-server-rounds=1")
    descendants: set[int] = set()
    output = []
    for line in proc.stdout:
        output.append(line)
        descendants |= {c.pid for c in _children(proc.pid)}
    proc.wait(timeout=600)
    text = L.ANSI_RE.sub("", "".join(output))
    assert proc.returncode == 1, text[-3000:]
    assert text.count("Traceback (most recent call last):") == 1, text
    assert text.count("CheckpointError: ") == 2, text  # the traceback's last line and the closing line
    assert "bad header" in text
    last = text.strip().splitlines()[-1]
    assert last.startswith("fedpower-run: error: run ") and "finished:failed" in last and "CheckpointError" in last
    assert _wait_gone(descendants, timeout=30) == [] and _processes_tied_to(home) == []


@pytest.mark.slow
def test_ctrl_c_stops_everything(tmp_path):
    """Ctrl-C (SIGINT to the foreground process group, as a terminal sends it) in the middle of a run."""
    home = tmp_path / "flwr-home"
    proc = _start_fedpower_run(tmp_path, home, "--set", "num-server-rounds=50")
    descendants: set[int] = set()
    output = []
    for line in proc.stdout:
        output.append(line)
        descendants |= {c.pid for c in _children(proc.pid)}
        if "[round 1/50" in line:  # the run is training: SuperLink, SuperExec, simulation and Ray are up
            break
    descendants |= {c.pid for c in _children(proc.pid)}
    assert len(descendants) >= 5, "".join(output)[-3000:]
    t0 = time.time()
    os.killpg(proc.pid, signal.SIGINT)
    rest, _ = proc.communicate(timeout=120)
    stop_seconds = time.time() - t0
    assert proc.returncode == 130, rest
    assert "fedpower-run: interrupted" in rest and "Traceback" not in rest
    assert stop_seconds < 30
    assert _wait_gone(descendants, timeout=30) == [] and _processes_tied_to(home) == []


@pytest.mark.slow
def test_sigkill_mid_round_leaves_no_process_and_the_resume_owns_the_run(tmp_path):
    """The launcher's whole process group SIGKILLed while round 2 is in flight (an OOM kill, a
    preempted job): within seconds no process of that run is left (SuperLink, SuperExec,
    flwr-simulation, Ray and its actors). `fedpower-run --resume` then takes the run directory's lock
    and completes it, every round counted once."""
    from fedpower_app.runs import owner as O

    home = tmp_path / "flwr-home"
    run_dir = (tmp_path / "out" / "killed").resolve()
    proc = _start_fedpower_run(tmp_path, home, "--set", "num-server-rounds=4", "--set", 'run-name="killed"')
    descendants: set[int] = set()
    output = []
    for line in proc.stdout:
        output.append(line)
        descendants |= {c.pid for c in _children(proc.pid)}
        if "[round 1/4" in line:  # round 2 is in flight
            break
    marked = O.run_processes(run_dir)
    descendants |= {c.pid for c in _children(proc.pid)} | set(marked)
    assert len(marked) >= 5, "".join(output)[-3000:]  # supervisor, SuperLink, SuperExec, simulation, Ray...
    assert O.read_owner(run_dir)["launcher"]["pid"] == proc.pid
    t0 = time.time()
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    left = _wait_gone(descendants, timeout=20)
    gone_seconds = time.time() - t0
    assert left == [] and O.run_processes(run_dir) == [] and _processes_tied_to(home) == []
    assert gone_seconds < 20, gone_seconds
    killed = json.loads((run_dir / "results.json").read_text())
    assert killed["status"] == "running" and [r["server_round"] for r in killed["rounds"]] == [1]

    exe = Path(sys.executable).with_name("fedpower-run")
    resumed = subprocess.Popen([str(exe), "--resume", str(run_dir), "--flwr-home", str(home)],
                               env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, cwd=str(tmp_path), start_new_session=True)
    output = []
    owner_while_running = None
    for line in resumed.stdout:
        output.append(line)
        if owner_while_running is None and "[round " in line:
            owner_while_running = O.read_owner(run_dir)
            assert O._try_lock(run_dir / O.LOCK_FILE) is None  # held while the resumed run runs
    resumed.wait(timeout=600)
    text = "".join(output)
    assert resumed.returncode == 0, text[-4000:]
    assert owner_while_running["launcher"]["pid"] == resumed.pid and owner_while_running["supervisor"]["pid"]
    res = json.loads((run_dir / "results.json").read_text())
    rounds = [r["server_round"] for r in res["rounds"]]
    assert rounds == list(range(1, len(rounds) + 1)) and len(rounds) >= 2  # none lost, none twice
    assert res["resumed"][-1]["after_round"] == 1 and res["status"] in ("completed", "stopped-budget")
    assert res["privacy_final"]["epsilon_spent"] <= res["privacy"]["epsilon"] * (1 + 1e-9)
    O.claim_run_dir(run_dir, say=pytest.fail).release()  # free again, nothing left over
