"""``fedpower-run``: run the app through ``flwr run`` on a SuperLink this process owns, and report
the run's real status.

    fedpower-run                                   # default config, 6 simulated silos
    fedpower-run --preset conf/tiny.toml --set num-server-rounds=3 --set strategy.name='"fedlora"'
    fedpower-run --verbose ...                     # everything Flower, Ray and transformers print

What it does, in order:

1. **Validates the configuration before anything starts.** pyproject defaults + ``--preset`` +
   ``--set`` go through :func:`fedpower_app.config.validate_overrides` (the ServerApp's own
   ``parse_config``), plus the checks that involve the simulation flags or the file system
   (``--supernodes`` against ``strategy.min-nodes``, ``device = "cuda"`` without
   ``--gpus-per-client``, a ``task.data-dir`` that does not exist). A bad value exits 2 with one
   line naming the key, in well under a second, without starting any process.
2. **Starts its own SuperLink** as a child process: ``flower-superlink --insecure --simulation
   --isolation subprocess --host 127.0.0.1 --port <port> --database :flwr-in-memory:
   --disable-runtime-dependency-installation``, in a new session (``start_new_session=True``), and
   waits until its HTTP API (Control, Fleet and Runtime APIs share one port in Flower 1.41)
   answers ``/health``. The port: free, and stable per ``--flwr-home`` when that port is free; a
   busy requested port is replaced by a free one (never share a SuperLink someone else started). Its
   output goes to ``$FLWR_HOME/fedpower-run/<pid>-<port>/superlink.log``, kept only if it fails
   to start.
3. **Runs** ``flwr run <app> fedpower-run --stream`` against it. The connection
   ``fedpower-run`` (explicit address ``127.0.0.1:<port>``, ``insecure = true``) lives in the
   ``config.toml`` of a private CLI home (``$FLWR_HOME/fedpower-run/<pid>-<port>/``), given to the
   ``flwr`` CLI processes only as their ``FLWR_HOME``; the user's ``$FLWR_HOME/config.toml`` is
   never touched. The SuperLink and the simulation keep the real ``FLWR_HOME`` (installed apps).
   ``--federation-config "num-supernodes=..."`` works as with ``:local:`` (it is a per-run
   ``SimulationConfig`` that any ``--simulation`` SuperLink accepts).
4. **Checks the status** with ``flwr ls --run-id <id> --format json`` while the SuperLink is still
   up (``flwr run`` exits 0 when a run fails), stops a run that is still going (``flwr stop``).
5. **Stops everything it started, by PID**, in a ``finally`` (success, failure, Ctrl-C, SIGTERM,
   SIGHUP): :func:`terminate_tree` snapshots the SuperLink's descendants (``flower-superexec``
   runs in a session of its own, ``flwr-simulation`` and Ray below it), sends SIGTERM to the
   process groups they lead and to each PID, waits :data:`STOP_GRACE_SECONDS`, then SIGKILLs what
   is left. Processes orphaned on the way (e.g. ``flwr-simulation`` once its SuperExec exited) come
   back to the run's supervisor (6.), a child subreaper, and are stopped and reaped there;
   ``fedpower-run`` is one too, for its own children. A second Ctrl-C during this cleanup is
   deferred, not allowed to interrupt it. Nothing is ever matched by name or pattern.
6. **Dies with its run, however it dies.** The SuperLink runs under the run's supervisor
   (``supervisor.py``): a child subreaper in a session of its own that watches this process through
   a pidfd. If ``fedpower-run`` is killed without running any of the above (SIGKILL, an OOM kill),
   the supervisor stops every process of the run (SIGTERM, SIGKILL after
   :data:`STOP_GRACE_SECONDS`) within seconds.
7. **Owns its run directory.** Before writing ``outputs/<run>``, it takes the directory's lock
   (``owner.lock``, ``fedpower_app.runs.owner``), shared with the supervisor, so it is held until the
   run's last process is gone. A second launcher on the same directory is refused with one line
   naming the owner's PIDs; ``--resume`` of a run whose launcher died stops the run's leftovers
   (found by ``FEDPOWER_RUN_DIR`` in their environment), says so, and takes the lock.

Why not ``flwr run`` with the ``:local:`` connection: it spawns a *detached, persistent*
``flower-superlink`` (``flwr/cli/local_superlink.py``) whose PID nobody records, shared by every
user of the same port, which leaves the SuperLink, a SuperExec and a zombie ``flwr-simulation``
behind and could only be stopped by pattern (``pkill -f``). An explicit-address connection also
means a dead SuperLink gives a connection error instead of silently spawning a new detached one.

Library use (:func:`run_flwr`, e.g. ``fedpower-experiment``): by default the SuperLink is kept for
the next call with the same ``flwr_home`` (a grid of cells reuses it; ``flwr ls``/``flwr stop``
with ``flwr_env(flwr_home, port)`` reach it between calls) and stopped by
:func:`stop_local_superlink`, at interpreter exit, or by its supervisor if this process dies. ``keep_superlink=False`` stops it before
returning; ``fedpower-run`` always does.

Console: unless ``--verbose``, known-harmless noise is switched off in the environment of the
processes started (:data:`QUIET_ENV`: Ray's and transformers' FutureWarnings, torch's warning under
Opacus' hooks, model-loading progress bars) and hidden from the streamed output
(:data:`NOISE_PATTERNS`, :class:`ConsoleFilter`: Flower notices, Flower records repeated by the
root logger, a traceback repeated verbatim); the full output is still returned in
:class:`RunOutcome`. A failed run ends with one ``fedpower-run: error`` line naming the run's
status and the exception that caused it. ``--verbose`` shows everything, with Flower's DEBUG log.

Ray: the simulation runs on a private Ray instance (``RAY_ADDRESS=local`` in the SuperLink's
environment, so a cluster that someone's ``ray start`` left on the machine is never joined by
accident), of ``--ray-cpus``/``--ray-gpus`` when given. ``--ray-address HOST:PORT`` (or ``RAY_ADDRESS``)
joins an existing, possibly multi-node, cluster instead: checked to answer and to fit a ClientApp
before anything starts; ``--ray-cpus``/``--ray-gpus`` are then refused, since Ray refuses resource
arguments when connecting (``ray_cluster``; BENCHMARKS.md, "Multi-node Ray simulation").

Exit codes: 0 run completed, 1 run failed (or stopped), 2 bad arguments or configuration, or the
SuperLink could not be started, 130 interrupted (Ctrl-C, SIGTERM, SIGHUP).
"""


from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from ..config import PROJECT_ROOT, ConfigError, RunConfig, load_preset, validate_overrides, with_method_preset
from ..runs import BACKENDS, RunSpec
from ..runs.owner import claim_run_dir
from ..runs.spec import default_run_name

from .flwr_cli import _home
from .processes import _DeferSignals, _Terminated, _become_subreaper, _on_signal, _stop_orphans
from .flwr_run import run_flwr
from .ray_cluster import check_ray_resources, describe_cluster, ray_address_from, resolve_ray_address


def _shown_path(path: Path) -> str:
    """A project file relative to the project (as the README names it), any other path in full."""
    try:
        return str(Path(path).resolve().relative_to(PROJECT_ROOT))
    except ValueError:
        return str(path)


def parse_set(items) -> dict[str, Any]:
    """``--set key=value`` items as a dict; values are TOML, a bare word is taken as a string."""
    import tomllib

    out = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        key, raw = item.split("=", 1)
        try:
            out[key.strip()] = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            out[key.strip()] = raw  # bare word: treat as a string
    return out


def resume_overrides(run_dir: str | Path) -> dict[str, Any]:
    """The run config of a run to resume: its resolved config (results.json), with ``resume`` set,
    checked against its checkpoint now, so a refused checkpoint fails before anything starts."""
    from ..runs.checkpoint import CheckpointError, load_checkpoint

    run_dir = Path(run_dir).expanduser().resolve()
    try:
        config = json.loads((run_dir / "results.json").read_text())["config"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"--resume {run_dir}: no readable results.json with the run's config ({exc})") from None
    config = {**config, "resume": True, "output-dir": str(run_dir.parent), "run-name": run_dir.name}
    try:
        load_checkpoint(run_dir, config=config, strategy=str(config.get("strategy.name")))
    except CheckpointError as exc:
        raise ConfigError(f"--resume: {exc}") from None
    return config


def resumed_supernodes(run_dir: str | Path, requested: int | None) -> int:
    """The number of simulated silos of the run being resumed (results.json ``clients.count``): a
    resume with another number would be another population, which the server refuses. A
    ``--supernodes`` that disagrees fails here, before anything starts."""
    run_dir = Path(run_dir).expanduser().resolve()
    try:
        count = int(json.loads((run_dir / "results.json").read_text())["clients"]["count"])
    except (OSError, ValueError, KeyError, TypeError):
        count = None  # killed before its silos answered: nothing recorded, nothing to contradict
    if count is None:
        return 6 if requested is None else requested
    if requested is not None and requested != count:
        raise ConfigError(f"--resume {run_dir}: the run had {count} silos; --supernodes {requested} would be "
                          "another population (leave --supernodes out to resume with the run's own)")
    return count


def check_launch(overrides: dict[str, Any], *, app_dir: str | Path = PROJECT_ROOT, num_supernodes: int = 6,
                 cpus_per_client: float = 1, gpus_per_client: float = 0.0,
                 flwr_home: str | Path | None = None, backend: str = "flwr") -> RunConfig:
    """Every check that needs no data, before anything starts: the merged run config as the ServerApp
    will validate it, and its consistency with the simulation flags. Raises ConfigError."""
    pyproject = Path(app_dir) / "pyproject.toml"
    cfg = validate_overrides(overrides, pyproject=pyproject if pyproject.exists() else None)
    if num_supernodes < 1:
        raise ConfigError(f"--supernodes must be >= 1, got {num_supernodes}")
    if num_supernodes < cfg["strategy.min-nodes"]:
        raise ConfigError(f"config key 'strategy.min-nodes' = {cfg['strategy.min-nodes']} exceeds --supernodes "
                          f"{num_supernodes}: the run would wait strategy.round-timeout for nodes that never come")
    if cpus_per_client <= 0:
        raise ConfigError(f"--cpus-per-client must be > 0, got {cpus_per_client:g}")
    if gpus_per_client < 0:
        raise ConfigError(f"--gpus-per-client must be >= 0, got {gpus_per_client:g}")
    data_dir = cfg["task.data-dir"].strip()
    if data_dir and not Path(data_dir).expanduser().exists():
        raise ConfigError(f"config key 'task.data-dir' = {data_dir!r} does not exist (relative paths are resolved "
                          f"against the current directory {Path.cwd()})")
    from ..runs.spec import gpu_placement

    refusal, warning = (gpu_placement(cfg["device"], gpus_per_client, server_device=cfg["server-device"])
                        if backend == "flwr" else (None, None))  # in-process: one process, no Ray to hide a GPU
    if refusal:
        raise ConfigError(refusal)
    if warning:
        print(f"fedpower-run: warning: {warning}", file=sys.stderr, flush=True)
    home, app = _home(flwr_home), Path(app_dir).expanduser().resolve()
    if home == app or app in home.parents:
        raise ConfigError(f"the Flower home {home} is inside the app directory {app}: `flwr run` would package the "
                          "installed apps into the FAB; use --flwr-home outside it")
    check_data(cfg, num_supernodes)
    return cfg


def check_data(cfg: RunConfig, num_supernodes: int) -> None:
    """Read the task's data as the silos will (local files, or the generated task) and check that
    every silo's shard can hold a batch; raises ConfigError naming the file, line or sizes. GLUE
    from the hub is left to the run (no download before it starts)."""
    from ..data import load_task, shard_size_problem

    if cfg["task.train-rows"]:
        n = None  # the listed rows decide; read them
    elif cfg["task.name"] == "synthetic":
        n = cfg["task.synthetic-train-size"]  # known without generating it
    elif not cfg["task.data-dir"].strip():
        return
    else:
        n = None
    if n is None:
        try:
            n = len(load_task(cfg).train)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"task data: {exc}") from None
    problem = shard_size_problem(n, num_supernodes, cfg["train.batch-size"])
    if problem:
        raise ConfigError(problem)


def resolve_auto(overrides: dict[str, Any], explicit, *, app_dir: str | Path, num_supernodes: int) -> dict[str, Any]:
    """With ``train.auto``: the overrides completed with the public rules' settings for these silos
    (fedpower_app/runs/auto.py), printed with why; unchanged otherwise. Raises ConfigError."""
    from ..runs.auto import resolve_train_auto

    pyproject = Path(app_dir) / "pyproject.toml"
    validate_overrides(overrides, pyproject=pyproject if pyproject.exists() else None)
    overrides, lines = resolve_train_auto(overrides, explicit, num_supernodes)
    for line in lines:
        print(f"fedpower-run: {line}", flush=True)
    return overrides


def check_ray(args: argparse.Namespace, backend: str) -> str | None:
    """The Ray cluster to join (``--ray-address``, else ``RAY_ADDRESS``), checked before anything
    starts: it answers, it has a node that fits a ClientApp, and no resource argument that Ray refuses
    on connect comes with it. None: a private Ray instance. Raises ConfigError."""
    if backend == "inprocess":
        given = [f"--{k.replace('_', '-')}" for k in ("ray_address", "ray_cpus", "ray_gpus")
                 if getattr(args, k) is not None]
        if given:
            raise ConfigError(f"{', '.join(given)}: the in-process backend runs without Ray; leave "
                              f"{'it' if len(given) == 1 else 'them'} out or use --backend flwr")
        return None
    address = ray_address_from(args.ray_address)
    check_ray_resources(address, args.ray_cpus, args.ray_gpus)
    address = resolve_ray_address(address)
    if address is not None:
        try:
            line = describe_cluster(address, args.cpus_per_client, args.gpus_per_client)
        except ConfigError:
            raise
        except Exception as exc:  # the GCS answered the probe but not the node query
            raise ConfigError(f"--ray-address {address}: could not read the cluster's nodes ({exc})") from None
        print(f"fedpower-run: {line}", flush=True)
    return address


def _run_inprocess(spec: RunSpec, threads: int | None) -> int:
    """The in-process backend: the run in this process; exit 0 when it completed."""
    import time as _time

    import torch

    from ..logging_setup import setup_logging
    from ..runs.inprocess import final_line, run_inprocess

    if threads:
        torch.set_num_threads(threads)
    setup_logging()
    t0 = _time.perf_counter()
    run_dir = run_inprocess(spec.overrides, spec.supernodes)
    print(f"\nfedpower-run: {final_line(run_dir, _time.perf_counter() - t0)}")
    status = (json.loads((run_dir / "results.json").read_text()) or {}).get("status")
    return 0 if status == "completed" else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fedpower-run", description=__doc__.split("\n\n")[0],
                                epilog="Exit codes: 0 run completed, 1 run failed, 2 bad arguments/config or "
                                       "launcher error, 130 interrupted. The SuperLink this starts, and every "
                                       "process below it, is stopped before it exits.")
    p.add_argument("--app", default=str(PROJECT_ROOT), help="app directory (default: this project)")
    p.add_argument("--preset", help="a conf/*.toml preset")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a run-config key (TOML value)")
    p.add_argument("--supernodes", type=int, default=None,
                   help="number of simulated silos (default 6; with --resume, the run's own number)")
    p.add_argument("--cpus-per-client", type=float, default=None, help="CPUs per ClientApp (default 1; with "
                   "--resume, the run's own)")
    p.add_argument("--gpus-per-client", type=float, default=None, help="fraction of a GPU per ClientApp (e.g. 0.25; "
                   "default 0; with --resume, the run's own)")
    p.add_argument("--backend", choices=BACKENDS, default=None,
                   help="flwr: a Flower simulation through a SuperLink (default); inprocess: the real ServerApp and "
                        "ClientApp in this process, one model for every virtual silo (no Ray, no transport)")
    p.add_argument("--threads", type=int, default=None, help="inprocess backend: torch threads")
    p.add_argument("--ray-address", default=None, metavar="HOST:PORT",
                   help="run the ClientApps on an existing Ray cluster: its head's address (GCS port, 6379 for "
                        "`ray start --head`), or 'auto' for the one `ray start` started on this host (default: "
                        "$RAY_ADDRESS; without either, a private Ray instance). The cluster's nodes bring their own "
                        "resources (`ray start --num-cpus/--num-gpus`); see BENCHMARKS.md, 'Multi-node Ray simulation'")
    p.add_argument("--ray-cpus", type=int, default=None, metavar="N",
                   help="CPUs of the private Ray instance (default: all of this machine's); refused with --ray-address")
    p.add_argument("--ray-gpus", type=int, default=None, metavar="N",
                   help="GPUs of the private Ray instance (default: all visible); refused with --ray-address")
    p.add_argument("--flwr-home", default=os.environ.get("FLWR_HOME"), help="Flower home (default ~/.flwr)")
    p.add_argument("--verbose", action="store_true",
                   help="show all output (Flower DEBUG log, Ray and library warnings, progress bars)")
    p.add_argument("--resume", metavar="RUN_DIR",
                   help="continue a stopped or killed run from its last checkpoint (outputs/<run>); its "
                        "configuration is read from RUN_DIR/results.json")
    args = p.parse_args(argv)

    # 1. Everything that needs no data, before any process starts.
    try:
        sets = parse_set(args.set)
        overrides = {**(load_preset(args.preset) if args.preset else {}), **sets}
        if args.resume:
            overrides = {**resume_overrides(args.resume), **overrides}
            spec = RunSpec.load(Path(args.resume).expanduser())
            if spec is None:  # a run from before run.json: its silo count is in results.json
                spec = RunSpec(supernodes=resumed_supernodes(args.resume, args.supernodes))
            federation = {"supernodes": args.supernodes, "cpus_per_client": args.cpus_per_client,
                          "gpus_per_client": args.gpus_per_client, "backend": args.backend}
            for key, value in federation.items():  # the run's own federation; a different one is refused
                if value is not None and value != getattr(spec, key):
                    raise ConfigError(f"--resume {args.resume}: the run was started with --{key.replace('_', '-')} "
                                      f"{getattr(spec, key)}; {value} would be another federation (leave it out "
                                      "to resume with the run's own)")
            spec.overrides = overrides
        else:  # the method's tuned settings, where neither the preset nor --set chose
            overrides, from_method, method_source = with_method_preset(overrides, explicit=sets)
            if from_method:
                print(f"fedpower-run: {overrides.get('strategy.name')} runs at its method preset "
                      f"({method_source}): "
                      + ", ".join(f"{k}={v!r}" for k, v in from_method.items()) + " (a --set of a key wins)",
                      flush=True)
            overrides = resolve_auto(overrides, sets, app_dir=args.app,
                                     num_supernodes=6 if args.supernodes is None else args.supernodes)
            spec = RunSpec(overrides, backend=args.backend or "flwr",
                           supernodes=6 if args.supernodes is None else args.supernodes,
                           cpus_per_client=1.0 if args.cpus_per_client is None else args.cpus_per_client,
                           gpus_per_client=0.0 if args.gpus_per_client is None else args.gpus_per_client)
        spec.check()
        args.supernodes, args.cpus_per_client, args.gpus_per_client = (spec.supernodes, spec.cpus_per_client,
                                                                       spec.gpus_per_client)
        cfg = check_launch(overrides, app_dir=args.app, num_supernodes=args.supernodes,
                           cpus_per_client=args.cpus_per_client, gpus_per_client=args.gpus_per_client,
                           flwr_home=args.flwr_home, backend=spec.backend)
        ray_address = check_ray(args, spec.backend)
        if args.resume:
            run_dir = Path(args.resume).expanduser().resolve()
        else:  # name the run now, so that its spec is in its directory before it starts
            if not cfg["run-name"]:
                overrides["run-name"] = spec.overrides["run-name"] = default_run_name(cfg)
            run_dir = Path(cfg["output-dir"]).expanduser() / overrides.get("run-name", cfg["run-name"])
        # One owner per run directory, before anything is written there (runs.owner).
        run_lock = claim_run_dir(run_dir, say=lambda line: print(line, file=sys.stderr, flush=True))
        if not args.resume:
            spec.save(run_dir)
    except ConfigError as exc:
        print(f"fedpower-run: error: {exc}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as exc:  # unreadable or malformed preset
        print(f"fedpower-run: error: preset {args.preset}: {exc}", file=sys.stderr)
        return 2

    if cfg.dp_enabled:  # who decides each silo's privacy (fedpower_app.privacy.silo_policy)
        print(f"fedpower-run: silos: {args.supernodes} simulated partitions of one dataset, one owner: the run "
              "config speaks for them (noise source, metrics, evaluation). A SuperNode of its own sets its policy "
              "in its node config: dp-max-epsilon, dp-delta, dp-noise, send-metrics, evaluate, evaluate-max, "
              "ledger-file, device (docs/deployment.md)", flush=True)

    # 2. The run, on a SuperLink stopped (by PID) whatever happens.
    subreaper = _become_subreaper()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            previous[sig] = signal.signal(sig, _on_signal)
    try:
        if spec.backend == "inprocess":
            return _run_inprocess(spec, args.threads)
        outcome = run_flwr(args.app, overrides, num_supernodes=args.supernodes,
                           cpus_per_client=args.cpus_per_client, gpus_per_client=args.gpus_per_client,
                           flwr_home=args.flwr_home, verbose=args.verbose, keep_superlink=False,
                           ray_address=ray_address or "local", ray_cpus=args.ray_cpus, ray_gpus=args.ray_gpus,
                           run_lock=run_lock)
    except KeyboardInterrupt as exc:
        what = "terminated" if isinstance(exc, _Terminated) else "interrupted"
        print(f"\nfedpower-run: {what}; the SuperLink and every process it started were stopped", file=sys.stderr)
        return 130
    except (ConfigError, RuntimeError, OSError) as exc:
        print(f"fedpower-run: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if subreaper:
            with _DeferSignals(reraise=False):  # main is ending anyway
                _stop_orphans()
        run_lock.release()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if outcome.ok:
        print(f"\nfedpower-run: run {outcome.run_id} completed in {outcome.seconds:.0f} s")
        return 0
    error = outcome.error_summary()
    print(f"\nfedpower-run: error: run {outcome.run_id} {outcome.status} after {outcome.seconds:.0f} s"
          + (f": {error}" if error else ""), file=sys.stderr)
    return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
