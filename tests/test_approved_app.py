"""A silo runs only the ClientApp releases its operator approved (``fedpower-silo-app``).

Fast: the allow-list, the hash of a project directory (the one ``flwr run`` submits), approve and
revoke, and one task through the runner with Flower's Runtime API calls replaced (an approved FAB's
ClientApp runs from its own copy; an unapproved one is refused with an error reply, and nothing of
it is installed). Slow: a real SuperLink, a SuperNode with ``--isolation process`` and the runner,
and a plain SuperNode beside it: the approved release runs on both; a copy with one changed line
(its train handler copies the silo's train.csv) is refused by the runner, while the plain SuperNode
runs it and its rows are copied (the attack is real).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from fedpower_app import approved_app as A
from fedpower_app.config import PROJECT_ROOT

H1, H2 = "a" * 64, "0123456789abcdef" * 4

# ------------------------------------------------------------------------------------------
# releases: a snapshot of this project (other edits to the working tree do not move its hash)
# ------------------------------------------------------------------------------------------

#: what the FAB of this project holds (pyproject.toml's fab-include), and the files its build reads
FAB_DIRS = ("fedpower_app", "strategies", "client_app", "server_app", "conf")
FAB_FILES = ("pyproject.toml", ".gitignore", "LICENSE")


def project_copy(dest: Path) -> Path:
    """A copy of this project's FAB contents in ``dest/fedpower`` (a release as a silo would review it)."""
    app = dest / "fedpower"
    for d in FAB_DIRS:
        shutil.copytree(PROJECT_ROOT / d, app / d, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for f in FAB_FILES:
        if (PROJECT_ROOT / f).exists():
            shutil.copy(PROJECT_ROOT / f, app / f)
    return app


TRAIN_HANDLER = "def train(msg: Message, context: Context) -> Message:"


def steal_rows_copy(release: Path, dest: Path, stolen: Path) -> Path:
    """A copy of ``release`` with one changed line: the first line of the train handler also copies
    the silo's ``<data-dir>/train.csv`` to ``stolen/silo-<silo-id>.csv`` (what a hostile server's
    modified app did on real SuperNodes)."""
    app = dest / "fedpower"
    shutil.copytree(release, app)
    source = app / "client_app" / "app.py"
    lines = source.read_text().splitlines(keepends=True)
    first = lines.index(TRAIN_HANDLER + "\n") + 1
    body = lines[first]
    indent = body[: len(body) - len(body.lstrip())]
    lines[first] = (f'{indent}__import__("shutil").copy(__import__("os").path.join(context.node_config["data-dir"], '
                    f'"train.csv"), "{stolen}/silo-%s.csv" % context.node_config["silo-id"]); {body.lstrip()}')
    source.write_text("".join(lines))
    return app


# ------------------------------------------------------------------------------------------
# the allow-list
# ------------------------------------------------------------------------------------------


def test_the_allow_list_holds_hashes_with_notes_and_comments(tmp_path):
    f = tmp_path / "approved-apps"
    f.write_text(f"# releases this silo runs\n\n{H1}  fedpower 0.1.0, reviewed by the DPO\n"
                 f"{H2.upper()}\n   {H2}\tsame release, another note   \n")
    entries = A.read_approved_apps(f)
    assert [(e.sha256, e.note, e.line) for e in entries] == [
        (H1, "fedpower 0.1.0, reviewed by the DPO", 3), (H2, "", 4), (H2, "same release, another note", 5)]


@pytest.mark.parametrize("text, says", [
    ("not-a-hash  fedpower 0.1.0\n", "line 1: expected a FAB's SHA-256 (64 hex digits) first, then an optional note, got 'not-a-hash'"),
    (f"# ok\n{H1[:-1]}\n", f"line 2: expected a FAB's SHA-256 (64 hex digits) first, then an optional note, got '{H1[:-1]}'"),
    (f"{H1}x note\n", "line 1: expected a FAB's SHA-256"),
    ("sha256:" + H1 + "\n", "line 1: expected a FAB's SHA-256"),
])
def test_a_malformed_line_is_named_in_one_line(tmp_path, text, says):
    f = tmp_path / "approved-apps"
    f.write_text(text)
    with pytest.raises(A.ApprovedAppsError) as info:
        A.read_approved_apps(f)
    message = str(info.value)
    assert message.startswith(f"approved-apps file {f}, ") and says in message and "\n" not in message


def test_a_missing_or_unreadable_allow_list_is_one_clear_line(tmp_path):
    with pytest.raises(A.ApprovedAppsError, match=r"approved-apps file .*/nowhere does not exist; create it with "
                                                  r"`fedpower-silo-app approve"):
        A.read_approved_apps(tmp_path / "nowhere")
    with pytest.raises(A.ApprovedAppsError, match="is a directory"):
        A.read_approved_apps(tmp_path)
    (tmp_path / "binary").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(A.ApprovedAppsError, match="cannot be read"):
        A.read_approved_apps(tmp_path / "binary")


def test_check_fab_approves_listed_bytes_refuses_others_and_fails_closed(tmp_path):
    fab, other = b"approved release", b"approved release, one changed byte"
    f = tmp_path / "approved-apps"
    f.write_text(f"{hashlib.sha256(fab).hexdigest()}  fedpower 0.1.0\n{H1}\n")
    assert A.check_fab(fab, f).note == "fedpower 0.1.0"
    digest = hashlib.sha256(other).hexdigest()
    with pytest.raises(A.FabRefused) as info:
        A.check_fab(other, f)
    line = str(info.value)
    assert line.startswith(f"refused FAB {digest}: not in {f} (2 approved release(s));") and "\n" not in line
    assert info.value.fab_sha256 == digest
    reason = A.server_reason(digest)  # what the server is told: no path of the silo's
    assert digest in reason and str(tmp_path) not in reason
    f.write_text("garbage\n")  # a broken list refuses everything
    with pytest.raises(A.FabRefused, match=f"refused FAB {hashlib.sha256(fab).hexdigest()}: the allow-list cannot "
                                           f"be used: approved-apps file {f}, line 1"):
        A.check_fab(fab, f)
    with pytest.raises(A.FabRefused, match="does not exist"):
        A.check_fab(fab, tmp_path / "nowhere")


def test_the_hash_of_a_project_is_the_hash_flwr_run_submits(tmp_path, capsys):
    from flwr.cli.build import build_fab_from_disk

    release = project_copy(tmp_path / "release")
    submitted = hashlib.sha256(build_fab_from_disk(release)).hexdigest()  # what flwr/cli/run/run.py computes
    assert A.main(["hash", str(release)]) == 0
    assert capsys.readouterr().out == f"{submitted}  fedpower/fedpower 0.1.0\n"
    fab_file = tmp_path / "app.fab"
    fab_file.write_bytes(build_fab_from_disk(release))
    assert A.fab_sha256(A.release_fab(fab_file)) == submitted  # a .fab file: the same hash
    changed = steal_rows_copy(release, tmp_path / "changed", tmp_path / "stolen")
    assert A.fab_sha256(A.release_fab(changed)) != submitted  # one changed line: another release
    (release / "client_app" / "__pycache__").mkdir(exist_ok=True)  # byte code is not in the FAB
    (release / "client_app" / "__pycache__" / "app.cpython-311.pyc").write_bytes(b"\0")
    assert A.fab_sha256(A.release_fab(release)) == submitted


def test_approve_list_and_revoke_from_the_command_line(tmp_path, capsys):
    release = project_copy(tmp_path / "release")
    allow = tmp_path / "silo" / "approved-apps"
    assert A.main(["approve", str(release), "--approved-apps", str(allow)]) == 2  # its directory is missing
    assert "cannot create" in capsys.readouterr().err
    allow.parent.mkdir()
    assert A.main(["approve", str(release), "--approved-apps", str(allow)]) == 0
    digest = A.fab_sha256(A.release_fab(release))
    assert capsys.readouterr().out == f"approved {digest} in {allow}\n"
    assert A.main(["approve", str(release), "--approved-apps", str(allow), "--note", "again"]) == 0
    assert "is already approved" in capsys.readouterr().out
    with allow.open("a") as fh:
        fh.write(f"{H1}  an older release\n")
    assert A.main(["list", "--approved-apps", str(allow)]) == 0
    out = capsys.readouterr()
    assert out.out.splitlines()[0].startswith(f"{digest}  fedpower/fedpower 0.1.0, from {release}, approved ")
    assert out.out.splitlines()[1] == f"{H1}  an older release" and "2 approved release(s)" in out.err
    assert A.main(["revoke", "aaaa", "--approved-apps", str(allow)]) == 2  # too short to name a release
    assert "first 8+ hex digits" in capsys.readouterr().err
    assert A.main(["revoke", H2, "--approved-apps", str(allow)]) == 2
    assert f"{H2} is not approved in {allow}" in capsys.readouterr().err
    assert A.main(["revoke", H1[:8], "--approved-apps", str(allow)]) == 0
    assert capsys.readouterr().out == f"revoked {H1} (an older release) from {allow}\n"
    assert [e.sha256 for e in A.read_approved_apps(allow)] == [digest]
    assert allow.read_text().startswith("# App releases this silo runs")
    for bad in (["hash", str(tmp_path / "nowhere")], ["hash", str(allow)], ["hash", str(tmp_path)]):
        assert A.main(bad) == 2
        err = capsys.readouterr().err
        assert err.startswith("fedpower-silo-app: ") and err.count("\n") == 1, err
    allow.write_text("oops\n")  # never append to a malformed list
    assert A.main(["approve", str(release), "--approved-apps", str(allow)]) == 2
    assert "line 1" in capsys.readouterr().err and allow.read_text() == "oops\n"


# ------------------------------------------------------------------------------------------
# one task through the runner (Flower's Runtime API calls replaced)
# ------------------------------------------------------------------------------------------

PROBE_PYPROJECT = """[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "probeapp"
version = "1.0.0"
dependencies = []

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "tests"

[tool.flwr.app.components]
serverapp = "approved_probe.app:server"
clientapp = "approved_probe.app:app"

[tool.flwr.app.config]
answer = 1
"""

PROBE_APP = """from flwr.app import Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import ServerApp

import approved_probe

app, server = ClientApp(), ServerApp()


@app.query()
def query(msg, context):
    return Message(RecordDict({"metrics": MetricRecord({"from-the-fab": int(approved_probe.ORIGIN == "fab")})}),
                   reply_to=msg)
"""


def _probe_fab(tmp_path: Path, answer: int = 1) -> bytes:
    from flwr.cli.build import build_fab_from_disk

    app = tmp_path / f"answer{answer}" / "probeapp"
    (app / "approved_probe").mkdir(parents=True)
    (app / "pyproject.toml").write_text(PROBE_PYPROJECT.replace("answer = 1", f"answer = {answer}"))
    (app / "approved_probe" / "__init__.py").write_text('ORIGIN = "fab"\n')
    (app / "approved_probe" / "app.py").write_text(PROBE_APP)
    return build_fab_from_disk(app)


def _one_task(monkeypatch, fab: bytes, allow: Path) -> tuple[int, list, list, list]:
    """Run :func:`A.run_task` on one query message carrying ``fab``; returns (exit code, the pushed
    replies, the pushed task outputs, the runner's log lines)."""
    from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
    from flwr.supercore.fab import Fab
    from flwr.supercore.run import Run
    from flwr.supercore.task_identity import TaskIdentity
    from flwr.supernode.runtime import run_clientapp

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 5, 9, 1
    msg = Message(RecordDict({"config": ConfigRecord({"query": "dataset-size"})}), 9, MessageType.QUERY)
    msg.metadata.__dict__["_message_id"] = "m1"
    context = Context(run_id=5, node_id=9, node_config={"data-dir": "/data/silo"}, state=RecordDict(), run_config={})
    run = Run.create_empty(run_id=5)
    run.fab_id, run.fab_version = "tests/probeapp", "1.0.0"
    replies, outputs, said = [], [], []
    monkeypatch.setattr(run_clientapp, "pull_task_input",
                        lambda client: (msg, context, run, Fab("claimed-by-the-server", fab, {})))
    monkeypatch.setattr(run_clientapp, "push_message", lambda client, reply, ctx: replies.append(reply))
    monkeypatch.setattr(run_clientapp, "push_task_output", lambda **kw: outputs.append(kw))
    monkeypatch.setattr("flwr.supercore.runtime.RuntimeHttpClient.from_server_address",
                        lambda **kw: types.SimpleNamespace(close=lambda: None))
    monkeypatch.setattr("flwr.supercore.heartbeat.HeartbeatSender",
                        lambda fn: types.SimpleNamespace(start=lambda: None, is_running=False))
    monkeypatch.setattr("flwr.supercore.exit.register_signal_handlers", lambda **kw: None)
    monkeypatch.setattr(A, "log", lambda level, fmt, *args, **kw: said.append(fmt % args))
    code = A.run_task("127.0.0.1:1", "token", True, None, allow)
    return code, replies, outputs, said


def test_an_approved_fab_runs_its_own_code_and_an_unapproved_one_is_refused(tmp_path, monkeypatch):
    from flwr.common.constant import ErrorCode

    fab = _probe_fab(tmp_path)
    digest = hashlib.sha256(fab).hexdigest()
    allow = tmp_path / "approved-apps"
    allow.write_text(f"{digest}  probe 1.0.0\n")
    # a stale copy of the app's package already imported in this process: the FAB's copy must win
    monkeypatch.setitem(sys.modules, "approved_probe", types.SimpleNamespace(ORIGIN="environment"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    code, replies, outputs, said = _one_task(monkeypatch, fab, allow)
    assert code == 0, said
    assert [r.content.metric_records["metrics"]["from-the-fab"] for r in replies] == [1]
    assert outputs[0]["sub_status"] == "completed" and outputs[0]["context"] is not None
    assert said[0].startswith(f"approved FAB {digest} (run 5, query message; approved-apps line 1: probe 1.0.0)")
    for name in [m for m in sys.modules if m.split(".")[0] == "approved_probe"]:
        monkeypatch.delitem(sys.modules, name)

    # one changed byte: refused, with an error reply, and nothing of it installed
    monkeypatch.setattr("flwr.cli.install.install_from_fab",
                        lambda *a, **k: pytest.fail("an unapproved FAB was installed"))
    changed = _probe_fab(tmp_path, answer=2)  # the same app, one changed line
    code, replies, outputs, said = _one_task(monkeypatch, changed, allow)
    changed_hash = hashlib.sha256(changed).hexdigest()
    assert code == 3 and len(said) == 1
    assert said[0].startswith(f"refused FAB {changed_hash}: not in {allow} (1 approved release(s)); nothing of it "
                              f"was installed or run.") and said[0].endswith("[run 5, query message]")
    assert [(r.error.code, r.error.reason) for r in replies] == [(ErrorCode.INVALID_FAB, A.server_reason(changed_hash))]
    assert replies[0].metadata.reply_to_message_id == "m1"
    assert outputs[0]["sub_status"] == "failed" and outputs[0]["details"] == A.server_reason(changed_hash)


def test_serve_stops_with_one_line_on_a_bad_allow_list_or_a_refused_secret(tmp_path, monkeypatch, capsys):
    import httpx

    assert A.main(["serve", "--approved-apps", str(tmp_path / "nowhere"), "--insecure"]) == 2
    assert "does not exist" in capsys.readouterr().err
    allow = tmp_path / "approved-apps"
    allow.write_text(f"{H1}\n")
    request = httpx.Request("POST", "http://127.0.0.1:9094/v1/runtime/acquire-task")

    class Refusing:  # a SuperNode started with another --superexec-auth-secret-file
        def AcquireTask(self, _request):
            raise httpx.HTTPStatusError("401", request=request, response=httpx.Response(401, request=request))

        def close(self):
            pass

    monkeypatch.setattr("flwr.supercore.runtime.RuntimeHttpClient.from_server_address", lambda **kw: Refusing())
    monkeypatch.setattr(A, "log", lambda *a, **k: None)
    monkeypatch.setattr("signal.signal", lambda *a: None)
    assert A.main(["serve", "--approved-apps", str(allow), "--insecure"]) == 2
    err = capsys.readouterr().err
    assert err == ("fedpower-silo-app: the SuperNode at 127.0.0.1:9094 refused this runner (401 Unauthorized): give "
                   "--superexec-auth-secret-file the secret file its flower-supernode was started with\n")


# ------------------------------------------------------------------------------------------
# real processes: a SuperLink, a guarded SuperNode (--isolation process + the runner), a plain one
# ------------------------------------------------------------------------------------------


def _run_to_end(env, app: Path, overrides: str, timeout: float = 900) -> tuple[dict, str]:
    """``flwr run`` of ``app`` on the "deploy" connection; waits until the run is no longer running.
    Returns (its entry of ``flwr ls``, what ``flwr run --stream`` printed)."""
    from tests.test_deployment import _bin

    run = subprocess.run([_bin("flwr"), "run", str(app), "deploy", "--stream", "--run-config", overrides],
                         env=env, capture_output=True, text=True, timeout=timeout)
    printed = run.stdout + run.stderr
    started = re.search(r"Successfully started run (\d+)", printed)
    assert started, printed[-3000:]
    deadline = time.time() + 120
    while True:
        ls = subprocess.run([_bin("flwr"), "ls", "deploy", "--format", "json"], env=env, capture_output=True,
                            text=True, timeout=60)
        this = [r for r in json.loads(ls.stdout)["runs"] if r["run-id"] == started.group(1)]
        if (this and this[0]["status"].startswith("finished")) or time.time() > deadline:
            return (this or [{"status": "not listed"}])[0], printed
        time.sleep(2)


def _errors(log: str) -> list[str]:
    """The lines of a log that say what failed (a failed run's cause is far from its end)."""
    return [line for line in log.splitlines() if "ERROR" in line or "Error" in line or "error" in line][:20]


@pytest.mark.slow
def test_a_guarded_silo_runs_the_approved_release_and_refuses_a_modified_one(tmp_path):
    from fedpower_app.config import load_preset
    from fedpower_app.launcher import run_config_arg
    from tests.test_deployment import (BIN, _bin, _start_superlink, _stop_all, _wait_healthy, free_port,
        insecure_deployment_home)
    from tests.test_text_task import TEXT_KEYS, review_rows, write
    from tests.tiny_bert import save_tiny_bert

    t0 = time.time()
    release = project_copy(tmp_path / "release")
    stolen = tmp_path / "stolen"
    stolen.mkdir()
    modified = steal_rows_copy(release, tmp_path / "modified", stolen)
    release_hash, modified_hash = (A.fab_sha256(A.release_fab(a)) for a in (release, modified))
    model = save_tiny_bert(tmp_path / "tiny-bert", num_layers=1)
    silos = [tmp_path / f"silo-{k}" for k in range(2)]
    for k, silo in enumerate(silos):
        write(silo / "data" / "train.csv", review_rows(48, seed=10 + k))
    server_dir = tmp_path / "server-eval"
    write(server_dir / "validation.csv", review_rows(32, seed=99))
    allow = silos[0] / "approved-apps"  # silo 0's operator approves the release it reviewed
    assert A.main(["approve", str(release), "--approved-apps", str(allow)]) == 0
    secret = silos[0] / "superexec-secret"
    secret.write_bytes(b"a secret only silo 0's SuperNode and runner hold")

    env, port = insecure_deployment_home(tmp_path)
    names = ("superlink", "guarded-supernode", "runner", "plain-supernode")
    logs = {name: open(tmp_path / f"{name}.log", "w") for name in names}
    procs = {}
    try:
        procs["superlink"] = _start_superlink(env, port, log=logs["superlink"])
        _wait_healthy(port)
        for k, (silo, name) in enumerate(zip(silos, ("guarded-supernode", "plain-supernode"))):
            silo_env = {**env, "FLWR_HOME": str(silo / "flwr-home"), "FEDPOWER_CACHE": str(silo / "cache")}
            runtime_port = free_port()
            node_config = (f"data-dir='{silo / 'data'}' silo-id={k} dp-max-epsilon=8 "
                           f"ledger-file='{silo / 'ledger.json'}' send-shard-size=true")  # the server calibrates sigma
            cmd = [_bin("flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{port}", "--port", str(runtime_port),
                   "--node-config", node_config, "--max-retries", "5"]
            if k == 0:
                cmd += ["--isolation", "process", "--superexec-auth-secret-file", str(secret)]
            procs[name] = subprocess.Popen(cmd, env=silo_env, stdout=logs[name], stderr=subprocess.STDOUT)
            if k == 0:
                procs["runner"] = subprocess.Popen(
                    [str(BIN / "fedpower-silo-app"), "serve", "--approved-apps", str(allow), "--insecure",
                     "--runtime-api-address", f"127.0.0.1:{runtime_port}", "--superexec-auth-secret-file", str(secret),
                     "--poll-interval", "0.5"],
                    env=silo_env, stdout=logs["runner"], stderr=subprocess.STDOUT)
        overrides = run_config_arg({
            **load_preset(PROJECT_ROOT / "conf" / "tiny.toml"), **TEXT_KEYS, "model.name": model,
            "task.data-dir": str(server_dir), "task.max-length": 16, "lora.rank": 4,
            "output-dir": str(tmp_path / "outputs"), "num-server-rounds": 1, "strategy.name": "fedlora",
            "strategy.client-rate": 1.0, "strategy.min-nodes": 2, "strategy.round-timeout": 300.0,
            "dp.level": "sample", "dp.noise-at": "silo", "dp.epsilon": 8.0, "eval.fraction-clients": 0.0})

        # 1. the approved release runs on both silos
        status, printed = _run_to_end(env, release, overrides)
        runner = (tmp_path / "runner.log").read_text()
        assert status["status"] == "finished:completed", (_errors(printed), printed[-3000:], runner[-3000:])
        assert f"approved FAB {release_hash} (run " in runner and "train message" in runner, runner[-3000:]
        assert not list(stolen.iterdir())

        # 2. the modified release: the runner refuses it before anything of it runs, the plain silo runs it
        status, printed = _run_to_end(env, modified, overrides)
        runner = (tmp_path / "runner.log").read_text()
        refusals = [line for line in runner.splitlines() if f"refused FAB {modified_hash}" in line]
        assert refusals and f"refused FAB {modified_hash}: not in {allow} (1 approved release(s))" in refusals[0], \
            runner[-3000:]
        assert f"approved FAB {modified_hash}" not in runner
        assert not (stolen / "silo-0.csv").exists()  # the guarded silo's rows were not copied
        assert not list((silos[0] / "flwr-home").glob(f"apps/*{modified_hash[:8]}*"))  # nor its code installed
        # positive control: the same FAB on a SuperNode without the runner copies that silo's rows
        assert (stolen / "silo-1.csv").read_bytes() == (silos[1] / "data" / "train.csv").read_bytes()
        # the server got the refusal as an error reply (its log names it), and the run did not hang
        assert A.server_reason(modified_hash) in printed, printed[-3000:]
        assert status["status"].startswith("finished"), status
        print(f"\nguarded silo: approved {release_hash[:12]} ran, modified {modified_hash[:12]} refused "
              f"({len(refusals)} message(s)); plain silo leaked its rows; wall {time.time() - t0:.0f} s")
    finally:
        _stop_all(procs, logs)
