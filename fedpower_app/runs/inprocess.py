"""Run one run config on the in-process grid: the real ServerApp and ClientApp, one process, no Ray.

Why it exists: client-level DP needs many clients (RESULTS.md, "Client level across
many clients"). The Ray engine runs 1,000 SuperNodes here too (one ClientApp actor per CPU, not
per SuperNode), but Flower's message routing scans every pending message once per node every
0.1 s, so at 1,000 SuperNodes it costs about 2.8x the CPU of this grid (BENCHMARKS.md, "1,000
SuperNodes on the Ray engine"). Here one model serves every virtual client, and a round
costs its cohort's training plus O(N) bookkeeping (BENCHMARKS.md, "Cross-device"). The run directory
holds the same results.json, checkpoint and released model as a ``flwr run`` of the same config,
and ``resume = true`` continues an interrupted run from its checkpoint, as there.

Not a deployment path: no transport, no SuperLink, no silo isolation. ``fedpower-experiment
--backend inprocess`` runs each grid cell through this module in a child process:

    python -m fedpower_app.runs.inprocess --config-json cell.json --clients 1000 [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any


def run_inprocess(overrides: dict[str, Any], num_clients: int, explicit=()) -> Path:
    """Run ``overrides`` (run-config keys) with ``num_clients`` virtual clients; return the run
    directory. ``train.auto`` is resolved here if no launcher did (``explicit``: the keys set by
    hand, which it keeps). A bad config raises ConfigError before anything trains."""
    if num_clients < 2:
        raise ValueError(f"the in-process grid needs at least 2 clients, got {num_clients}")
    from client_app.app import app as client_app
    from server_app import app as server

    from ..config import parse_config
    from .auto import resolve_train_auto
    from .inprocess_grid import InProcessGrid

    overrides, lines = resolve_train_auto(overrides, explicit, num_clients)
    for line in lines:
        print(line, file=sys.stderr, flush=True)
    cfg = parse_config(overrides)
    # run_server, as the ServerApp's main: checkpoints, resume, and a failed status in results.json.
    server.run_server(InProcessGrid(client_app, num_clients, cfg.to_dict(), record_sent=False), cfg)
    return server.run_directory(cfg)


def final_line(run_dir: Path, seconds: float) -> str:
    """One progress line: rounds, final accuracy, where the results are."""
    res = json.loads((run_dir / "results.json").read_text())
    evals = [r for r in res["rounds"] if r.get("accuracy") is not None]
    final = evals[-1]["accuracy"] if evals else None
    return (f"{run_dir.name}: {res.get('status')} after {len(res['rounds'])} rounds in {seconds:.0f} s, final accuracy "
            f"{'n/a' if final is None else f'{final:.4f}'}; results in {run_dir}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fedpower_app.runs.inprocess", description=__doc__.split("\n")[0])
    ap.add_argument("--config-json", required=True, help="a JSON object of run-config keys (the full overrides)")
    ap.add_argument("--clients", type=int, required=True, help="number of virtual clients N")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's; 1 when another job holds a core)")
    a = ap.parse_args(argv)
    if a.clients < 2:
        ap.error("--clients must be >= 2")
    try:
        overrides = json.loads(Path(a.config_json).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        ap.error(f"--config-json {a.config_json}: {exc}")
    if not isinstance(overrides, dict):
        ap.error(f"--config-json {a.config_json}: a JSON object of run-config keys expected")

    from ..config import ConfigError, parse_config

    try:
        parse_config(overrides)  # a bad config fails here, before torch threads or logging are touched
    except ConfigError as exc:
        print(f"inprocess_run: error: {exc}", file=sys.stderr)
        return 2

    import torch

    from ..logging_setup import setup_logging

    if a.threads:
        torch.set_num_threads(a.threads)
    setup_logging()
    t0 = time.perf_counter()
    run_dir = run_inprocess(overrides, a.clients)
    print(f"inprocess_run: {final_line(run_dir, time.perf_counter() - t0)}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
