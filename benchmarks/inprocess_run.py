"""Run a preset on the in-process grid: the real ServerApp and ClientApp, one process, no Ray.

A command-line front end for ``fedpower_app.runs.inprocess`` (preset + ``--set`` overrides, as
``fedpower-run``), for client-level DP with many virtual clients on a CPU. For a grid
of methods, budgets and seeds use ``fedpower-experiment --backend inprocess``.

    python -m benchmarks.inprocess_run --preset conf/cross-device-sst2.toml --clients 1000 \\
        --data-dir /path/to/glue/SST-2 --set strategy.name='"fedlora"' \\
        --out results/cross-device-sst2/inprocess --name fedlora-eps8 [--threads 2]

The RESULTS.md section "Client level across many clients" was measured with it.
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", required=True, help="a conf/*.toml preset")
    ap.add_argument("--clients", type=int, required=True, help="number of virtual clients N")
    ap.add_argument("--data-dir", default="", help="task.data-dir (the GLUE task's directory)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", default="outputs", help="output-dir")
    ap.add_argument("--name", required=True, help="run-name (the run directory under --out)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 when another job holds a core)")
    a = ap.parse_args(argv)
    if a.clients < 2:
        ap.error("--clients must be >= 2")

    import torch

    from fedpower_app.config import ConfigError, load_preset, parse_config, with_method_preset
    from fedpower_app.runs.inprocess import final_line, run_inprocess
    from fedpower_app.launcher import parse_set
    from fedpower_app.logging_setup import setup_logging

    torch.set_num_threads(a.threads)
    setup_logging()
    overrides = load_preset(a.preset)
    if a.data_dir:
        overrides["task.data-dir"] = a.data_dir
    try:
        sets = parse_set(a.set)
        overrides.update(sets)
        explicit = set(sets) | ({"task.data-dir"} if a.data_dir else set())
        overrides, from_method, source = with_method_preset(overrides, explicit=explicit)  # as fedpower-run
        if from_method:
            print(f"inprocess_run: {overrides.get('strategy.name')} runs at its method preset ({source}): "
                  f"{from_method}", file=sys.stderr)
        overrides.update({"output-dir": a.out, "run-name": a.name})
        parse_config(overrides)  # fails here, before any training, on a bad key or value
    except ConfigError as exc:
        raise SystemExit(f"inprocess_run: {exc}") from None
    t0 = time.perf_counter()
    run_dir = run_inprocess(overrides, a.clients, explicit=explicit)
    print(f"inprocess_run: {final_line(run_dir, time.perf_counter() - t0)}{final_baseline(run_dir)}", file=sys.stderr)
    return 0


def final_baseline(run_dir) -> str:
    """The final evaluation beside the majority answer's (``training.metrics.final_baseline``)."""
    import json
    from pathlib import Path

    from fedpower_app.training.metrics import final_baseline as of_results

    try:
        res = json.loads((Path(run_dir) / "results.json").read_text())
    except (OSError, ValueError):
        return ""
    return of_results(res)


if __name__ == "__main__":
    raise SystemExit(main())
