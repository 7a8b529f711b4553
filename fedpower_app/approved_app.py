"""``fedpower-silo-app``: a silo runs only the ClientApp releases its operator approved.

A SuperNode runs whatever ClientApp is in the FAB that ``flwr run`` submits: whoever submits the run
chooses the code that reads the silo's rows. No check inside that code can protect the silo, so this
check lives outside it, in a process the silo starts itself. The silo starts its SuperNode with
``--isolation process`` (the SuperNode then runs no ClientApp of its own) and, beside it, this
runner, which takes the SuperNode's tasks over the same Runtime API as Flower's ``flower-superexec``
and ``flwr-clientapp``. For every message it:

1. pulls the task's input (the message, the silo's context, the run and the FAB) from the SuperNode;
2. computes the SHA-256 of the FAB's bytes (the hash ``flwr run`` computes, and the one whose
   signature the SuperNode's own ``--trusted-entities`` check verifies), never trusting the hash the
   server claims;
3. refuses a FAB whose hash is not in the silo's allow-list (``--approved-apps``, a file the
   operator controls): one line in the silo's log, an error reply to the server, and nothing of
   the FAB is installed, imported or run, so no file of the silo's is opened;
4. runs an approved FAB's ClientApp from a private, fresh install of exactly those bytes (never
   from ``$FLWR_HOME/apps``, whose directories are named by a truncated hash and by the run's
   claims), in a fresh process per message, and installs no dependencies (the silo's environment
   provides them).

Commands (``fedpower-silo-app --help``)::

    fedpower-silo-app hash    <project dir | app.fab>                       # the hash flwr run submits
    fedpower-silo-app approve <project dir | app.fab> --approved-apps FILE  # add it to the allow-list
    fedpower-silo-app revoke  <hash> --approved-apps FILE                   # remove it
    fedpower-silo-app list    --approved-apps FILE                          # check the file, list it
    fedpower-silo-app serve   --approved-apps FILE --insecure --runtime-api-address 127.0.0.1:9094

The allow-list holds one approved release per line: its 64-hex-digit SHA-256 first, then any note
(a name, who reviewed it); blank lines and lines starting with ``#`` are comments. ``serve`` reads
it again for every message, so approving or revoking a release needs no restart.

Why run the approved FAB rather than the copy installed in the silo's environment: the hash pins
every byte the ClientApp runs (its code, its ``clientapp`` component reference, its presets), so an
installed copy is safe only where it equals an approved release, which is what the hash check
establishes; running the installed copy instead would add a way to run a version other than the
server's, silently. To approve the version the silo installed, ``approve`` the checkout it was
installed from.

This module imports only Flower and the standard library: the project's own packages are imported
from the approved FAB, not from the environment (see :func:`_forget_app_modules`).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import date
from logging import ERROR, INFO, WARNING
from pathlib import Path

from flwr.supercore import log

#: the command name, in messages
COMMAND = "fedpower-silo-app"
#: the Runtime API address a SuperNode serves by default (``flower-supernode --port``)
DEFAULT_RUNTIME_API_ADDRESS = "127.0.0.1:9094"
#: the Runtime API method a SuperExec shared secret protects (``flower-supernode --superexec-auth-secret-file``)
_ACQUIRE_TASK_METHOD = "/flwr.proto.Runtime/AcquireTask"

_HASH = re.compile(r"[0-9a-f]{64}")


# --------------------------------------------------------------------------------------------------
# the allow-list
# --------------------------------------------------------------------------------------------------


class ApprovedAppsError(ValueError):
    """The allow-list cannot be used (missing, unreadable, malformed); the message is one line."""


class FabRefused(Exception):
    """A FAB this silo's operator did not approve; the message is the silo's one-line log entry."""

    def __init__(self, line: str, fab_sha256: str) -> None:
        super().__init__(line)
        self.fab_sha256 = fab_sha256


@dataclass(frozen=True)
class ApprovedApp:
    """One line of the allow-list."""

    sha256: str
    note: str
    line: int


def fab_sha256(fab: bytes) -> str:
    """The FAB's hash as ``flwr run`` computes it (``hashlib.sha256(fab_bytes).hexdigest()`` in
    flwr/cli/run/run.py; Flower has no named function for it) and as the SuperNode's own
    ``--trusted-entities`` check and ``install_from_fab`` compute it."""
    return hashlib.sha256(fab).hexdigest()


def read_approved_apps(path: str | Path) -> list[ApprovedApp]:
    """The allow-list's entries; raises :class:`ApprovedAppsError` (one line) if the file is
    missing, unreadable or has a line that is not ``<sha256> [note]``."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ApprovedAppsError(
            f"approved-apps file {path} does not exist; create it with `{COMMAND} approve <project dir or "
            f"app.fab> --approved-apps {path}`") from None
    except IsADirectoryError:
        raise ApprovedAppsError(f"approved-apps file {path} is a directory; expected a file of approved FAB hashes") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ApprovedAppsError(f"approved-apps file {path} cannot be read: {exc}") from None
    entries = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        first, _, note = line.replace("\t", " ").partition(" ")
        if not _HASH.fullmatch(first.lower()):
            shown = first if len(first) <= 80 else first[:77] + "..."
            raise ApprovedAppsError(
                f"approved-apps file {path}, line {number}: expected a FAB's SHA-256 (64 hex digits) first, "
                f"then an optional note, got {shown!r}")
        entries.append(ApprovedApp(first.lower(), " ".join(note.split()).lstrip("# "), number))
    return entries


def check_fab(fab: bytes, approved_apps: str | Path) -> ApprovedApp:
    """The allow-list entry that approves these FAB bytes, or :class:`FabRefused` with the silo's
    one-line log entry. An allow-list that cannot be used refuses every FAB (fails closed)."""
    digest = fab_sha256(fab)
    try:
        entries = read_approved_apps(approved_apps)
    except ApprovedAppsError as exc:
        raise FabRefused(f"refused FAB {digest}: the allow-list cannot be used: {exc}", digest) from None
    for entry in entries:
        if entry.sha256 == digest:
            return entry
    raise FabRefused(
        f"refused FAB {digest}: not in {approved_apps} ({len(entries)} approved release(s)); nothing of it was "
        f"installed or run. If it is a release you reviewed: `{COMMAND} approve <its project dir or .fab> "
        f"--approved-apps {approved_apps}`", digest)


def server_reason(fab_hash: str) -> str:
    """What the server learns of a refusal (the error reply's reason): no path of the silo's."""
    return (f"{COMMAND}: this silo runs only the app releases its operator approved; FAB {fab_hash} is not one of "
            f"them (its operator can approve a release with `{COMMAND} approve`)")


def release_fab(source: str | Path) -> bytes:
    """The FAB bytes of a release: a ``.fab`` file as is, or a project directory built exactly as
    ``flwr run <dir>`` builds it (``flwr.cli.build.build_fab_from_disk``: fixed file dates, sorted
    files, the project's fab-include and .gitignore), so its hash is the one the SuperNode receives."""
    source = Path(source).expanduser()
    if source.is_dir():
        if not (source / "pyproject.toml").is_file():
            raise ApprovedAppsError(f"{source} has no pyproject.toml: expected a Flower project directory or a .fab file")
        from flwr.cli.build import build_fab_from_disk
        from flwr.cli.utils import AppPathDepthError

        try:
            return build_fab_from_disk(source)
        except (ValueError, AppPathDepthError) as exc:
            raise ApprovedAppsError(f"cannot build a FAB from {source}: {' '.join(str(exc).split())}") from None
    if source.is_file():
        if source.suffix != ".fab":
            raise ApprovedAppsError(f"{source} is not a .fab file or a project directory")
        return source.read_bytes()
    raise ApprovedAppsError(f"{source} does not exist: expected a Flower project directory or a .fab file")


def _fab_name(fab: bytes) -> str:
    """``publisher/name version`` from an (approved or operator-given) FAB's pyproject.toml."""
    from flwr.cli.config_utils import get_fab_metadata

    try:
        fab_id, version = get_fab_metadata(fab)
    except Exception as exc:  # noqa: BLE001 (any malformed FAB)
        raise ApprovedAppsError(f"not a valid FAB: {' '.join(str(exc).split())}") from None
    return f"{fab_id} {version}"


def approve(source: str | Path, approved_apps: str | Path, note: str = "") -> tuple[str, bool]:
    """Add a release's hash to the allow-list (created if missing; its directory must exist).
    Returns (hash, added); ``added`` is False when it was already approved."""
    approved_apps = Path(approved_apps)
    fab = release_fab(source)
    digest = fab_sha256(fab)
    note = " ".join((note or f"{_fab_name(fab)}, from {Path(source).expanduser().resolve()}, approved "
                             f"{date.today().isoformat()}").split())
    if approved_apps.exists():
        entries = read_approved_apps(approved_apps)  # refuse to append to a malformed file
        if any(e.sha256 == digest for e in entries):
            return digest, False
        text = approved_apps.read_text(encoding="utf-8")
    else:
        if not approved_apps.parent.is_dir():
            raise ApprovedAppsError(f"cannot create {approved_apps}: directory {approved_apps.parent} does not exist")
        text = (f"# App releases this silo runs ({COMMAND} serve --approved-apps {approved_apps}).\n"
                "# One per line: the FAB's SHA-256, then a note. Remove a line to revoke a release.\n")
    if text and not text.endswith("\n"):
        text += "\n"
    _write_atomically(approved_apps, text + f"{digest}  {note}\n")
    return digest, True


def revoke(fab_hash: str, approved_apps: str | Path) -> list[ApprovedApp]:
    """Remove every line approving ``fab_hash`` (the full hash, or a prefix of at least 8 hex
    digits that matches one release only). Returns the removed entries."""
    approved_apps = Path(approved_apps)
    key = fab_hash.strip().lower()
    if not re.fullmatch(r"[0-9a-f]{8,64}", key):
        raise ApprovedAppsError(f"expected a FAB's SHA-256 (or its first 8+ hex digits), got {fab_hash!r}")
    entries = read_approved_apps(approved_apps)
    matching = {e.sha256 for e in entries if e.sha256.startswith(key)}
    if not matching:
        raise ApprovedAppsError(f"{fab_hash} is not approved in {approved_apps}")
    if len(matching) > 1:
        raise ApprovedAppsError(f"{fab_hash} matches {len(matching)} approved releases in {approved_apps}; give more digits")
    removed = [e for e in entries if e.sha256 in matching]
    lines = approved_apps.read_text(encoding="utf-8").splitlines(keepends=True)
    drop = {e.line for e in removed}
    _write_atomically(approved_apps, "".join(line for n, line in enumerate(lines, start=1) if n not in drop))
    return removed


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    if path.exists():
        os.chmod(tmp, path.stat().st_mode & 0o7777)
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------------
# one task: check the FAB, then run its ClientApp or refuse (the process serve starts per message)
# --------------------------------------------------------------------------------------------------


def _forget_app_modules(app_dir: Path) -> None:
    """Drop from ``sys.modules`` every module of a top-level package or module the FAB ships
    (``fedpower_app``, ``client_app``, ...), so the approved FAB's copies are imported, not the
    environment's (this runner itself lives in ``fedpower_app``; Flower's loader reuses a module
    already in ``sys.modules``). The running code keeps its own globals."""
    names = {p.name for p in app_dir.iterdir() if p.is_dir() and any(p.rglob("*.py"))}
    names |= {p.stem for p in app_dir.glob("*.py")}
    for module in list(sys.modules):
        if module.split(".")[0] in names:
            del sys.modules[module]
    importlib.invalidate_caches()


def run_task(runtime_api_address: str, token: str, insecure: bool, certificates: bytes | None,
             approved_apps: Path, parent_pid: int | None = None) -> int:
    """Handle one SuperNode task as ``flwr-clientapp`` does (Flower's own functions from
    flwr/supernode/runtime/run_clientapp.py pull the input and push the reply), with the FAB check
    before anything of the FAB is installed or run. Returns the process's exit code."""
    from flwr.app import Message
    from flwr.app.error import Error
    from flwr.cli.install import install_from_fab
    from flwr.clientapp.client_app import LoadClientAppError
    from flwr.clientapp.utils import get_load_client_app_fn
    from flwr.common.constant import ErrorCode, SubStatus
    from flwr.supercore.app_utils import start_parent_process_monitor
    from flwr.supercore.exit import register_signal_handlers
    from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
    from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.supercore.runtime import RuntimeHttpClient
    from flwr.supercore.telemetry import EventType
    from flwr.supernode.runtime.run_clientapp import pull_task_input, push_message, push_task_output

    if parent_pid is not None:
        start_parent_process_monitor(parent_pid)
    retry_invoker = make_simple_http_retry_invoker()
    client = RuntimeHttpClient.from_server_address(
        server_address=runtime_api_address, insecure=insecure, root_certificates=certificates,
        interceptors=[RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"), RuntimeTokenHttpInterceptor(token)],
        retry_invoker=retry_invoker)
    heartbeat = None
    message = reply = context = None
    outcome = {"sub_status": SubStatus.FAILED, "details": "the task failed before its input was read", "pushed": False}
    workdir = tempfile.TemporaryDirectory(prefix="fedpower-approved-app-")

    def finish() -> None:
        if outcome["pushed"]:
            return
        outcome["pushed"] = True
        retry_invoker.max_tries = 1
        push_task_output(client=client, context=context, sub_status=outcome["sub_status"], details=outcome["details"])
        if heartbeat is not None and heartbeat.is_running:
            heartbeat.stop()
        client.close()
        workdir.cleanup()

    register_signal_handlers(event_type=EventType.FLWR_CLIENTAPP_RUN_LEAVE, exit_message="Task stopped.",
                             exit_handlers=[finish])
    exit_code = 0
    try:
        heartbeat = HeartbeatSender(make_task_heartbeat_fn_http(client))
        heartbeat.start()
        message, context, run, fab = pull_task_input(client)
        where = f"run {run.run_id}, {message.metadata.message_type} message"
        entry = check_fab(fab.content, approved_apps)  # FabRefused: nothing below runs
        log(INFO, "approved FAB %s (%s; approved-apps line %d: %s): running its ClientApp", entry.sha256, where,
            entry.line, entry.note or "no note")
        app_dir = install_from_fab(fab.content, install_dir=Path(workdir.name), skip_prompt=True)
        _forget_app_modules(app_dir)
        load = get_load_client_app_fn(default_app_ref="", app_path=str(app_dir), multi_app=True)
        client_app = load(run.fab_id, run.fab_version, entry.sha256)
        reply = client_app(message=message, context=context)
        outcome.update(sub_status=SubStatus.COMPLETED, details="")
    except FabRefused as exc:
        log(ERROR, "%s [%s]", exc, where)
        outcome["details"] = server_reason(exc.fab_sha256)
        reply = Message(Error(code=ErrorCode.INVALID_FAB, reason=outcome["details"]), reply_to=message)
        exit_code = 3
    except Exception as ex:  # noqa: BLE001 -- as flwr-clientapp: any exception becomes an error reply
        code, reason = ErrorCode.CLIENT_APP_RAISED_EXCEPTION, str(type(ex)) + ":<'" + str(ex) + "'>"
        if isinstance(ex, LoadClientAppError):
            code, reason = ErrorCode.LOAD_CLIENT_APP_EXCEPTION, "An exception was raised when attempting to load `ClientApp`"
        log(ERROR, "ClientApp raised an exception", exc_info=ex)
        outcome["details"] = reason
        if message is not None:
            reply = Message(Error(code=code, reason=reason), reply_to=message)
        exit_code = 1
    finally:
        if reply is not None and context is not None:
            try:
                push_message(client, reply, context)
            except Exception as ex:  # noqa: BLE001
                log(ERROR, "Failed to push reply message", exc_info=ex)
                exit_code = exit_code or 1
        finish()
    return exit_code


# --------------------------------------------------------------------------------------------------
# serve: take the SuperNode's tasks, one fresh checking process per message
# --------------------------------------------------------------------------------------------------


def _is_unauthorized(exc: Exception) -> bool:
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None) == 401


def _task_command(approved_apps: Path, runtime_api_address: str, token: str, insecure: bool,
                  root_certificates: str | None) -> list[str]:
    cmd = [sys.executable, "-m", "fedpower_app.approved_app", "task", "--approved-apps", str(approved_apps),
           "--runtime-api-address", runtime_api_address, "--token", token, "--parent-pid", str(os.getpid())]
    if insecure:
        cmd.append("--insecure")
    elif root_certificates:
        cmd += ["--root-certificates", root_certificates]
    return cmd


def serve(approved_apps: Path, runtime_api_address: str, insecure: bool, root_certificates: str | None,
          superexec_auth_secret_file: str | None = None, poll_interval: float = 1.0) -> None:
    """Take the SuperNode's ClientApp tasks (as ``flower-superexec`` does) and start one checking
    process (:func:`run_task`) per task. Runs until stopped (SIGINT, SIGTERM); a task still running
    then stops too (it watches this process)."""
    from flwr.proto.runtime_pb2 import AcquireTaskRequest  # pylint: disable=E0611
    from flwr.supercore.auth import load_superexec_auth_secret
    from flwr.supercore.constant import TaskType
    from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor, SuperExecAuthHttpInterceptor
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.supercore.runtime import RuntimeHttpClient
    from flwr.supercore.tls import validate_and_resolve_root_certificates

    entries = read_approved_apps(approved_apps)  # a bad file stops the start, with its line
    interceptors = [RuntimeVersionHttpInterceptor(component_name="SuperExec")]
    if superexec_auth_secret_file is not None:
        try:
            secret = load_superexec_auth_secret(superexec_auth_secret_file)
        except ValueError as exc:
            raise ApprovedAppsError(f"--superexec-auth-secret-file: {exc}") from None
        interceptors.append(SuperExecAuthHttpInterceptor(master_secret=secret, protected_methods={_ACQUIRE_TASK_METHOD}))
    retry_invoker = make_simple_http_retry_invoker()
    flower_giveup = retry_invoker.should_giveup

    def giveup(exc: Exception) -> bool:  # Flower's invoker interrupts its own process on a 401: say why instead
        return _is_unauthorized(exc) or flower_giveup(exc)

    retry_invoker.should_giveup = giveup
    client = RuntimeHttpClient.from_server_address(
        server_address=runtime_api_address, insecure=insecure,
        root_certificates=validate_and_resolve_root_certificates(root_certificates, insecure),
        interceptors=interceptors, retry_invoker=retry_invoker)
    log(INFO, "%s: this silo runs only the app releases approved in %s (%d now: %s); it reads the file again for "
        "every message. SuperNode Runtime API %s", COMMAND, approved_apps, len(entries),
        "; ".join(f"{e.sha256[:12]} {e.note}".strip() for e in entries) or "none", runtime_api_address)
    if not entries:
        log(WARNING, "%s: %s approves no release yet: every message will be refused until one is approved",
            COMMAND, approved_apps)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    tasks: list[subprocess.Popen] = []
    try:
        while True:
            try:
                res = client.AcquireTask(AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP]))
            except Exception as exc:  # noqa: BLE001
                if _is_unauthorized(exc):
                    raise ApprovedAppsError(
                        f"the SuperNode at {runtime_api_address} refused this runner (401 Unauthorized): give "
                        "--superexec-auth-secret-file the secret file its flower-supernode was started with") from None
                raise
            if res.HasField("task") and res.token:
                tasks.append(subprocess.Popen(_task_command(approved_apps, runtime_api_address, res.token, insecure,
                                                            root_certificates)))
            tasks = [t for t in tasks if t.poll() is None]
            time.sleep(poll_interval)
    except KeyboardInterrupt:
        pass
    finally:
        client.close()


# --------------------------------------------------------------------------------------------------
# the command line
# --------------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=COMMAND,
        description="Run on a silo only the app releases its operator approved: approve a release's FAB hash, "
                    "then serve a SuperNode started with --isolation process (docs/deployment.md, "
                    "\"Approving the app a silo runs\").")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{hash,approve,revoke,list,serve}")

    def allow_list(p, required=True):
        p.add_argument("--approved-apps", required=required, type=Path, metavar="FILE",
                       help="the silo's allow-list: one approved FAB SHA-256 per line, then an optional note")

    p = sub.add_parser("hash", help="print the SHA-256 of the FAB that `flwr run` submits for a project directory "
                                    "(or of a .fab file)")
    p.add_argument("source", help="a Flower project directory (as given to `flwr run`) or a .fab file")
    p = sub.add_parser("approve", help="add a release's FAB hash to the allow-list (created if missing)")
    p.add_argument("source", help="a Flower project directory (as given to `flwr run`) or a .fab file")
    allow_list(p)
    p.add_argument("--note", default="", help="the note written after the hash (default: its name, version, "
                                              "source and today's date)")
    p = sub.add_parser("revoke", help="remove a release from the allow-list")
    p.add_argument("fab_hash", metavar="HASH", help="its SHA-256, or a prefix of at least 8 hex digits")
    allow_list(p)
    p = sub.add_parser("list", help="check the allow-list and print its releases")
    allow_list(p)
    p = sub.add_parser("serve", help="take the tasks of a SuperNode started with --isolation process; run approved "
                                     "FABs, refuse the others")
    allow_list(p)
    p.add_argument("--runtime-api-address", default=DEFAULT_RUNTIME_API_ADDRESS,
                   help=f"the SuperNode's Runtime API (its --host:--port; default {DEFAULT_RUNTIME_API_ADDRESS})")
    p.add_argument("--insecure", action="store_true", help="the Runtime API without TLS (the SuperNode's default)")
    p.add_argument("--root-certificates", metavar="CA", help="CA certificate of a Runtime API with TLS")
    p.add_argument("--superexec-auth-secret-file", metavar="FILE",
                   help="the shared secret the SuperNode was started with (flower-supernode "
                        "--superexec-auth-secret-file): then no other local process can take its tasks")
    p.add_argument("--poll-interval", type=float, default=1.0, help="seconds between task polls (default 1)")
    p = sub.add_parser("task")  # started by serve, once per message; not for operators
    allow_list(p)
    p.add_argument("--runtime-api-address", required=True)
    p.add_argument("--token", required=True)
    p.add_argument("--insecure", action="store_true")
    p.add_argument("--root-certificates")
    p.add_argument("--parent-pid", type=int)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "hash":
            fab = release_fab(args.source)
            print(f"{fab_sha256(fab)}  {_fab_name(fab)}")
        elif args.command == "approve":
            digest, added = approve(args.source, args.approved_apps, args.note)
            print(f"approved {digest} in {args.approved_apps}" if added else
                  f"{digest} is already approved in {args.approved_apps}")
        elif args.command == "revoke":
            for entry in revoke(args.fab_hash, args.approved_apps):
                print(f"revoked {entry.sha256} ({entry.note or 'no note'}) from {args.approved_apps}")
        elif args.command == "list":
            entries = read_approved_apps(args.approved_apps)
            for entry in entries:
                print(f"{entry.sha256}  {entry.note}".rstrip())
            print(f"{len(entries)} approved release(s) in {args.approved_apps}", file=sys.stderr)
        elif args.command == "serve":
            serve(args.approved_apps, args.runtime_api_address, args.insecure, args.root_certificates,
                  args.superexec_auth_secret_file, args.poll_interval)
        elif args.command == "task":
            from flwr.supercore.tls import validate_and_resolve_root_certificates

            certificates = validate_and_resolve_root_certificates(args.root_certificates, args.insecure)
            return run_task(args.runtime_api_address, args.token, args.insecure, certificates, args.approved_apps,
                            args.parent_pid)
    except ApprovedAppsError as exc:
        print(f"{COMMAND}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
