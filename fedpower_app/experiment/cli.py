"""``fedpower-experiment``: run a grid of methods x epsilon x tasks x seeds and write the paper's tables.

Every cell of the grid is one ``flwr run`` of this app (Flower simulation, managed local SuperLink),
with a deterministic run name and output directory ``<out>/cells/<cell-id>/``. A cell is finished
when its ``results.json`` says ``completed`` (or ``stopped-budget``); re-running the same command
resumes a half-finished grid: finished cells are skipped, an interrupted cell continues from its
last per-round checkpoint (same overrides; its privacy ledger included), failed cells are run again
and reported. After the runs, the results of all finished cells are aggregated (mean +- std over
seeds) into

  table1.md/.csv   accuracy per method and epsilon, per task and averaged over tasks (paper Table 1)
  table2.md/.csv   noise injection scheme: PowerDP vs input vs output perturbation (paper Table 2)
  table3.md/.csv   refactorization every 1/5/10 rounds: server time per round, overhead vs FedLoRA,
                   total wall time, accuracy (paper Table 3)
  fig_*.png        accuracy vs rounds and vs transferred bits (real message bytes), per task and epsilon
  manifest.json    the grid, every cell's status and exact overrides, the invocations (commands, times)
  cells/<id>/      results.json (resolved config, calibration, per-round data), cell.json, flwr.log
  cells.json       the committed form (--report-only --compact --pack): every finished cell's compact
                   results.json in one file; a cell's own results.json, when there is one, wins

Examples:

  # the paper's Table 1 on SST-2 with the CPU preset, 3 seeds
  fedpower-experiment --table 1 --preset conf/cpu-sst2.toml --data-dir /work/shared/glue/SST-2 \\
      --seeds 0 1 2 --out results/cpu-sst2

  # everything a grid file describes (per-table epsilons, seeds, preset, overrides)
  fedpower-experiment --grid conf/grids/cpu-sst2.toml --table all --data-dir /work/shared/glue/SST-2

  # the paper's setup (RoBERTa-large, T = 200, all four tasks); needs a GPU and days of compute
  fedpower-experiment --grid conf/grids/paper.toml --table all --data-dir /path/to/glue

  # a custom grid, then only re-render the tables from what is there
  fedpower-experiment --methods fedpower fedpower-F5 ffa-lora --epsilons 3 none --tasks sst2 qnli \\
      --preset conf/cpu-sst2.toml --data-dir /data/glue --out results/custom
  fedpower-experiment --out results/custom --report-only

  # client-level DP with 1,000 virtual clients on the in-process grid (one model, one child process
  # per cell; a cell's log is cells/<id>/run.log), 2 torch threads
  fedpower-experiment --grid conf/grids/cross-device-sst2.toml --data-dir /work/shared/glue/SST-2

Grid files (conf/grids/*.toml) hold the same settings as the flags, plus:

  overrides = {...}            run-config keys for every cell (like --set)
  [method-overrides.<method>]  run-config keys for one method's cells, applied last (e.g. FFA-LoRA,
                               which trains only B, needs a larger "train.lr"); the keys that make a
                               cell (method, epsilon, seed, task) cannot be set here
  [private-method-overrides.<method>]
                               the same, for the method's private cells only (after the above): for
                               settings that matter only under DP (FedPower's power iterations and
                               clip), so that its non-private cells stay the best run without DP
  [nonprivate-overrides]       run-config keys for every non-private ("none") cell, after the preset's
                               method tables: a ceiling's own schedule (many small steps, where a
                               DP-SGD run takes few large ones); generalises nonprivate-lr
  [nonprivate-method-overrides.<method>]
                               the same, for the method's non-private cells only (applied last)
  [table1] ... [table3]        per-table methods and epsilons; cell-timeout = seconds per cell

A finished cell whose recorded settings (cells/<id>/cell.json) differ from what the grid now asks
for is stale: --dry-run marks it, the tables leave it out, and the next run moves it to
<out>/superseded/ and runs it again.

Methods are strategy names (fedpower, fedlora, ffa-lora, input-perturbation, output-perturbation)
or fedpower-F<n> (FedPower with PowerDP every n-th round, FedLoRA releases otherwise), or
fedpower-powerdp (FedPower refactorizing with the paper's PowerDP at client level, an ablation; at
any other DP level it is FedPower's run, so the grid runs that cell once and marks the shared row
with †). Epsilons are
positive numbers (dp.epsilon at the preset's dp.level, sample by default) or "none" (dp.level = none,
optionally with its own learning rate, --nonprivate-lr; the paper uses 0.05 vs 0.5 private).
"""

from __future__ import annotations

import argparse
import sys
import time
import tomllib
from pathlib import Path
from typing import Any, Sequence

from ..config import TASKS, ConfigError

from .spec import BACKENDS, GridError, GridSpec, TABLE_EPSILONS, TABLE_METHODS, _resolve_path, canonical_method, parse_epsilon, validate
from .store import PACK_FILE, compact_cells, _fmt_seconds, grid_status, has_cells, pack_cells, read_results
from .runner import run_grid
from .report import write_report


def _load_grid_file(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except OSError as exc:
        raise GridError(f"cannot read grid file {path}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise GridError(f"grid file {path}: {exc}") from None


_GRID_KEYS = {"out", "cell-timeout", "preset", "tasks", "seeds", "methods", "epsilons", "overrides", "method-overrides",
              "private-method-overrides", "nonprivate-overrides", "nonprivate-method-overrides",
              "data-dir", "nonprivate-lr", "supernodes", "backend", "threads", "cpus-per-client", "gpus-per-client",
              "table1", "table2", "table3"}


def _parse_set(items: Sequence[str]) -> dict[str, Any]:
    from ..launcher import parse_set

    try:
        return parse_set(items)
    except ConfigError as exc:
        raise GridError(str(exc)) from None


def build_spec(args: argparse.Namespace) -> tuple[GridSpec, Path]:
    """Combine a grid file (if any) and the command-line flags (flags win) into a GridSpec."""
    g: dict[str, Any] = {}
    base = Path.cwd()
    if args.grid:
        g = _load_grid_file(args.grid)
        unknown = sorted(set(g) - _GRID_KEYS)
        if unknown:
            raise GridError(f"grid file {args.grid}: unknown key(s) {', '.join(unknown)} (valid: {', '.join(sorted(_GRID_KEYS))})")
        base = Path(args.grid).resolve().parent
    out = args.out or g.get("out")
    if not out:
        raise GridError("no output directory: give --out (or 'out' in the grid file)")
    out_path = Path(out if Path(out).is_absolute() or not args.grid or args.out else _resolve_path(out, base)).expanduser().resolve()

    tasks = args.tasks or g.get("tasks") or ["sst2"]
    seeds = args.seeds if args.seeds is not None else g.get("seeds", [0])
    try:
        seeds = [int(s) for s in seeds]
    except (TypeError, ValueError):
        raise GridError(f"bad seeds {seeds!r}: integers expected") from None
    preset = args.preset or g.get("preset")
    if preset:
        preset = _resolve_path(preset, base if not args.preset else Path.cwd())
    overrides = dict(g.get("overrides") or {})
    overrides.update(_parse_set(args.set))
    data_dir = args.data_dir if args.data_dir is not None else g.get("data-dir")
    if data_dir:
        data_dir = str(Path(data_dir).expanduser().resolve()) if "{task}" not in data_dir else data_dir
    nonprivate_lr = args.nonprivate_lr if args.nonprivate_lr is not None else g.get("nonprivate-lr")
    supernodes = args.supernodes if args.supernodes is not None else int(g.get("supernodes", 6))
    backend = args.backend or g.get("backend", "flwr")
    threads = args.threads if args.threads is not None else g.get("threads")
    cpus_per_client = args.cpus_per_client if args.cpus_per_client is not None else g.get("cpus-per-client", 1.0)
    gpus_per_client = args.gpus_per_client if args.gpus_per_client is not None else g.get("gpus-per-client", 0.0)

    cli_eps = [parse_epsilon(e) for e in args.epsilons] if args.epsilons else None
    file_eps = [parse_epsilon(e) for e in g["epsilons"]] if g.get("epsilons") else None
    tables: dict[str, tuple[list[str], list[float | None]]] = {}
    wanted = []
    if args.table:
        wanted = ["1", "2", "3"] if "all" in args.table else sorted(set(args.table))
    for t in wanted:
        section = g.get(f"table{t}") or {}
        methods = args.methods or section.get("methods") or TABLE_METHODS[t]
        eps = cli_eps or ([parse_epsilon(e) for e in section["epsilons"]] if section.get("epsilons") else None) \
            or file_eps or TABLE_EPSILONS[t]
        tables[t] = (list(methods), eps)
    custom = None
    if not wanted:
        methods = args.methods or g.get("methods")
        eps = cli_eps or file_eps
        if methods or eps:
            custom = (list(methods or TABLE_METHODS["1"]), eps or TABLE_EPSILONS["1"])
    per_method = {}
    for table in ("method-overrides", "private-method-overrides", "nonprivate-method-overrides"):
        per_method[table] = g.get(table) or {}
        if not isinstance(per_method[table], dict):
            raise GridError(f"{table}: a table of methods expected, e.g. [{table}.ffa-lora]")
    spec = GridSpec(tasks=list(tasks), seeds=seeds, tables=tables, custom=custom, preset=preset,
                    overrides=overrides, data_dir=data_dir or None, nonprivate_lr=nonprivate_lr, supernodes=supernodes,
                    backend=str(backend), threads=None if threads is None else int(threads),
                    cpus_per_client=float(cpus_per_client), gpus_per_client=float(gpus_per_client),
                    method_overrides={canonical_method(str(m)): (dict(v) if isinstance(v, dict) else v)
                                      for m, v in per_method["method-overrides"].items()},
                    private_method_overrides={canonical_method(str(m)): (dict(v) if isinstance(v, dict) else v)
                                              for m, v in per_method["private-method-overrides"].items()},
                    nonprivate_overrides=g.get("nonprivate-overrides") or {},
                    nonprivate_method_overrides={canonical_method(str(m)): (dict(v) if isinstance(v, dict) else v)
                                                 for m, v in per_method["nonprivate-method-overrides"].items()})
    return spec, out_path


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fedpower-experiment", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("what to run")
    g.add_argument("--table", nargs="+", choices=["1", "2", "3", "all"],
                   help="standard grid(s) of the paper's tables: 1 = FedLoRA, FFA-LoRA, FedPower at non-private, "
                        "eps 9, 6, 3; 2 = input/output perturbation vs FedPower at eps 9, 6, 3; 3 = FedLoRA and "
                        "FedPower refactoring every 10/5/1 rounds at eps 3; all = 1 2 3 (shared cells run once)")
    g.add_argument("--grid", metavar="FILE", help="TOML grid file (see conf/grids/); command-line flags override it")
    g.add_argument("--methods", nargs="+", metavar="M",
                   help="methods (replace the table's): fedpower, fedlora, ffa-lora, input-perturbation, "
                        "output-perturbation, fedpower-F<n>")
    g.add_argument("--epsilons", nargs="+", metavar="EPS", help="privacy budgets (replace the table's): numbers or 'none'")
    g.add_argument("--tasks", nargs="+", metavar="T", help=f"tasks (default sst2): {', '.join(TASKS)}")
    g.add_argument("--seeds", nargs="+", type=int, metavar="S", help="seeds (default 0)")
    g.add_argument("--preset", metavar="TOML", help="base preset for every cell; '{task}' is replaced by the task "
                                                    "(e.g. conf/paper-{task}.toml)")
    g.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra run-config override for every cell (TOML value; strings need inner quotes)")
    g.add_argument("--data-dir", metavar="DIR", help="local GLUE directory (task folder or its parent) passed as "
                                                     "task.data-dir to every cell; '{task}' is substituted")
    g.add_argument("--nonprivate-lr", type=float, metavar="LR",
                   help="train.lr of the non-private cells (paper: 0.05, vs 0.5 private); default: the preset's")
    g.add_argument("--supernodes", type=int, help="simulated silos per run (default 6); with --backend inprocess, "
                                                  "the number of virtual clients")
    r = p.add_argument_group("how to run")
    r.add_argument("--out", metavar="DIR", help="output directory (tables, figures, manifest.json, cells/)")
    r.add_argument("--backend", choices=BACKENDS,
                   help="flwr (default): each cell is a `flwr run` Ray simulation; inprocess: each cell runs the "
                        "real ServerApp and ClientApp in one child process with one model for all virtual clients "
                        "(client-level DP with 1,000 clients on a CPU; not a deployment path)")
    r.add_argument("--threads", type=int, metavar="N", help="torch threads of an inprocess cell (default: torch's)")
    r.add_argument("--cpus-per-client", type=float, metavar="N",
                   help="Ray CPUs of each ClientApp in a flwr cell (default 1; grid key cpus-per-client)")
    r.add_argument("--gpus-per-client", type=float, metavar="F",
                   help="Ray GPUs of each ClientApp in a flwr cell (default 0: the silos train on the CPU; "
                        "0.25 = 4 ClientApps per GPU; grid key gpus-per-client; fedpower-memory sizes it)")
    r.add_argument("--dry-run", action="store_true", help="list the cells, where each stands and the cell time left; run nothing")
    r.add_argument("--report-only", action="store_true", help="only (re)write tables and figures from finished cells")
    r.add_argument("--pack", action="store_true",
                   help="with --compact: also pack the finished cells into one cells.json (the committed form; "
                        "a cell's own results.json, when there is one, wins over its packed copy)")
    r.add_argument("--compact", action="store_true",
                   help="with --report-only: also rewrite every finished cell's results.json in the compact form "
                        "committed to results/ (no ledger history, no per-client size list); tables unchanged")
    r.add_argument("--max-cells", type=int, metavar="N", help="run at most N unfinished cells this time")
    r.add_argument("--max-consecutive-failures", type=int, default=3, metavar="N",
                   help="stop the grid after N failed cells in a row (default 3; 0 = never)")
    r.add_argument("--cell-timeout", type=float, metavar="S",
                   help="give up on a cell after S seconds (stopped, reported as failed, retried on the next "
                        "invocation); default: no limit, or 'cell-timeout' of the grid file")
    r.add_argument("--flwr-home", metavar="DIR", help="Flower home, private to this grid (default <out>/flwr-home, or "
                                                      "~/.cache/fedpower/flwr-home-<hash> when <out> is inside the app "
                                                      "directory); must be outside the app directory")
    r.add_argument("--port", type=int, help="private managed SuperLink port (default derived from --out)")
    r.add_argument("--keep-adapters", action="store_true", help="keep each cell's final adapter/ (deleted by default)")
    r.add_argument("--echo", action="store_true", help="stream every run's Flower output")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    argv_list = list(sys.argv[1:] if argv is None else argv)
    try:
        if args.report_only and not args.grid and not (args.table or args.methods or args.epsilons) and args.out:
            man = read_results(Path(args.out) / "manifest.json")
            if not man or "grid" not in man:
                raise GridError(f"--report-only: no manifest.json with a grid in {args.out}")
            spec, out = GridSpec.from_dict(man["grid"]), Path(args.out).resolve()
        else:
            spec, out = build_spec(args)
        cells = validate(spec, out)
        cell_timeout = args.cell_timeout
        if cell_timeout is None and args.grid:
            cell_timeout = _load_grid_file(args.grid).get("cell-timeout")
    except GridError as exc:
        print(f"fedpower-experiment: error: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(grid_status(spec, cells, out))
        return 0
    summary = None
    if not args.report_only:
        import signal

        def _on_sigterm(signum, frame):  # behave like Ctrl-C: save the manifest, stop the SuperLink
            raise KeyboardInterrupt(f"signal {signum}")

        signal.signal(signal.SIGTERM, _on_sigterm)
        try:
            summary = run_grid(spec, out, flwr_home=Path(args.flwr_home) if args.flwr_home else None, port=args.port,
                               echo=args.echo, timeout=cell_timeout, keep_adapters=args.keep_adapters,
                               argv=argv_list, max_cells=args.max_cells,
                               max_consecutive_failures=args.max_consecutive_failures)
        except KeyboardInterrupt as exc:
            print(f"fedpower-experiment: interrupted ({exc or 'Ctrl-C'}) at {time.strftime('%Y-%m-%dT%H:%M:%S')}; "
                  "run the same command again to resume", file=sys.stderr, flush=True)
            return 130
        except GridError as exc:
            print(f"fedpower-experiment: error: {exc}", file=sys.stderr)
            return 2
    if args.report_only and not has_cells(out):
        print(f"fedpower-experiment: error: --report-only: no cells in {out} (run the grid first)", file=sys.stderr)
        return 2
    if args.pack and not args.compact:
        print("fedpower-experiment: error: --pack goes with --report-only --compact", file=sys.stderr)
        return 2
    if args.compact:
        if not args.report_only:
            print("fedpower-experiment: error: --compact goes with --report-only", file=sys.stderr)
            return 2
        print(f"fedpower-experiment: compacted {compact_cells(out, cells)} cell result(s) in {out}")
        if args.pack:
            print(f"fedpower-experiment: packed {pack_cells(out, cells)} cell result(s) into {out / PACK_FILE}")
    written = write_report(spec, out)
    print(f"fedpower-experiment: wrote {', '.join(t + '.md/.csv' for t in written['tables'])} and "
          f"{len(written['figures'])} figure(s) in {out}")
    narrowed = [f"--{k}" for k in ("methods", "epsilons", "seeds", "tasks") if getattr(args, k) is not None]
    if args.grid and narrowed:
        # The tables are this invocation's selection: a worker that ran one method must not leave
        # the grid's tables looking as if the others had no results.
        print(f"fedpower-experiment: the tables cover only the cells selected by {', '.join(narrowed)}; for the "
              f"whole grid: fedpower-experiment --grid {args.grid} --report-only", file=sys.stderr)
    if written["stale"]:
        print(f"fedpower-experiment: left out of the tables, made with other settings than the grid's (run the grid "
              f"to redo them): {', '.join(written['stale'])}", file=sys.stderr)
    if summary is not None:
        print(f"fedpower-experiment: ran {len(summary['ran'])} cell(s) in {_fmt_seconds(summary['seconds'])}, "
              f"skipped {summary['skipped']} finished")
        elsewhere = summary.get("running_elsewhere") or []
        if elsewhere:
            print(f"fedpower-experiment: {len(elsewhere)} cell(s) still running in another fedpower-experiment "
                  f"process: {', '.join(elsewhere)}")
        failed = [c for c in summary["unfinished"] if c not in elsewhere]
        if failed:
            print(f"fedpower-experiment: {len(failed)} cell(s) NOT finished (re-run the same command "
                  f"to retry): {', '.join(failed)}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
