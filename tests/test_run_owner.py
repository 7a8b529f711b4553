"""One owner per run directory (``fedpower_app.runs.owner``): a second launcher is refused with one
line and the owner's PIDs; leftovers of a dead launcher are stopped and said so. Fast: real processes,
no Flower."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from fedpower_app.config import PROJECT_ROOT, ConfigError
from fedpower_app.runs import owner as O

TINY = str(PROJECT_ROOT / "conf" / "tiny.toml")
SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


def _alive(pid: int) -> bool:
    return O._start_time(pid) is not None


def _wait_gone(pids, timeout=10.0) -> list[int]:
    deadline = time.time() + timeout
    while (left := [p for p in pids if _alive(p)]) and time.time() < deadline:
        time.sleep(0.05)
    return left


def test_two_owners_of_one_run_directory_are_refused(tmp_path):
    """A second claim, from this process or another, is refused while the first owner lives; the
    directory is free again once the owner releases it."""
    run_dir = tmp_path / "out" / "run-a"
    lock = O.claim_run_dir(run_dir, say=pytest.fail)
    assert O.read_owner(run_dir)["launcher"]["pid"] == os.getpid()
    with pytest.raises(O.RunDirInUse) as err:
        O.claim_run_dir(run_dir, say=pytest.fail)
    message = str(err.value)
    assert "\n" not in message and f"pid {os.getpid()}" in message and "in use" in message
    assert isinstance(err.value, ConfigError)  # the CLI's one-line exit 2
    other = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        from fedpower_app.runs import owner as O
        try:
            O.claim_run_dir({str(run_dir)!r})
        except O.RunDirInUse as exc:
            print(exc)
            raise SystemExit(3)
    """)], capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)})
    assert other.returncode == 3, other.stderr
    assert f"pid {os.getpid()}" in other.stdout
    lock.release()
    O.claim_run_dir(run_dir, say=pytest.fail).release()


def test_fedpower_run_on_a_run_directory_another_launcher_owns_exits_2_with_one_line(tmp_path):
    """The real entry point: a second `fedpower-run` on the same run directory is refused before it
    writes anything there (run.json untouched) or starts any process."""
    out = tmp_path / "out"
    run_dir = out / "shared"
    lock = O.claim_run_dir(run_dir, say=pytest.fail)
    try:
        exe = os.path.join(os.path.dirname(sys.executable), "fedpower-run")
        proc = subprocess.run([exe, "--preset", TINY, "--set", f'output-dir="{out}"', "--set", 'run-name="shared"',
                               "--flwr-home", str(tmp_path / "home")], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}, cwd=str(tmp_path))
    finally:
        lock.release()
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fedpower-run: error: ") and f"pid {os.getpid()}" in lines[0]
    assert not (run_dir / "run.json").exists() and not (tmp_path / "home").exists()


def test_leftovers_of_a_killed_launcher_are_stopped_and_said(tmp_path):
    """A launcher SIGKILLed while a process of its run (its 'supervisor', sharing the lock, marked with
    the run directory) lives: the next claim sees the owner dead, stops that process by PID, says so,
    and takes the lock."""
    run_dir = (tmp_path / "run-b").resolve()
    launcher = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import subprocess, sys
        from fedpower_app.runs import owner as O
        lock = O.claim_run_dir({str(run_dir)!r})
        child = subprocess.Popen({SLEEPER!r}, pass_fds=(lock.fd,), env={{**lock.env(), "PATH": ""}},
                                 start_new_session=True)
        lock.note(supervisor={{"pid": child.pid}})
        print(child.pid, flush=True)
        import time; time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)})
    try:
        child = int(launcher.stdout.readline())
        assert O.run_processes(run_dir) == [child]
        launcher.kill()
        launcher.wait()
        assert _alive(child) and O._try_lock(run_dir / O.LOCK_FILE) is None  # the lock outlives the launcher
        said = []
        t0 = time.time()
        lock = O.claim_run_dir(run_dir, say=said.append)
        assert time.time() - t0 < 10
        assert len(said) == 1 and "is gone" in said[0] and str(child) in said[0]
        assert _wait_gone([child]) == [] and O.run_processes(run_dir) == []
        assert O.read_owner(run_dir)["launcher"]["pid"] == os.getpid()
        lock.release()
    finally:
        if launcher.poll() is None:
            launcher.kill()


def test_a_marked_process_without_a_lock_holder_is_stopped_before_the_claim(tmp_path):
    """A process of the run whose supervisor was killed too (nothing holds the lock): still found by
    its mark, stopped, and said so."""
    run_dir = (tmp_path / "run-c").resolve()
    run_dir.mkdir()
    ghost = subprocess.Popen(SLEEPER, env={O.RUN_DIR_ENV: str(run_dir)}, start_new_session=True)
    try:
        deadline = time.time() + 10
        while O.run_processes(run_dir) != [ghost.pid]:
            assert time.time() < deadline
            time.sleep(0.05)
        said = []
        O.claim_run_dir(run_dir, say=said.append).release()
        assert len(said) == 1 and str(ghost.pid) in said[0] and "leftover" in said[0]
        ghost.wait(timeout=10)
        assert ghost.returncode == -signal.SIGTERM
    finally:
        if ghost.poll() is None:
            ghost.kill()


def test_the_lock_file_is_rewritten_in_place_and_names_the_owner(tmp_path):
    lock = O.claim_run_dir(tmp_path / "run-d", say=pytest.fail)
    inode = os.stat(lock.path).st_ino
    lock.note(supervisor={"pid": 123})
    record = json.loads(lock.path.read_text())
    assert os.stat(lock.path).st_ino == inode  # the file the lock is on, not a replacement
    assert record["supervisor"] == {"pid": 123} and record["launcher"]["pid"] == os.getpid()
    assert record["command"] == "fedpower-run" and lock.env() == {O.RUN_DIR_ENV: str(lock.run_dir)}
    lock.release()
