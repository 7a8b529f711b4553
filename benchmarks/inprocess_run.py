"""Run a preset on the in-process grid: the real ServerApp and ClientApp, one process, no Ray.

For client-level DP with many virtual clients on a CPU (issue #14): one model serves every
virtual client (no model load per client, no Ray actors), so a run at N = 1,000 clients costs its
cohort's training plus O(N) bookkeeping. The run directory holds the same results.json,
checkpoint and released model as ``fedpower-run``'s; the progress lines are the same. Not a
deployment path (``fedpower_app.inprocess``): for a deployment or a Ray simulation use
``fedpower-run``.

    python -m benchmarks.inprocess_run --preset conf/cross-device-sst2.toml --clients 1000 \\
        --data-dir /path/to/glue/SST-2 --set strategy.name='"fedlora"' --set strategy.client-rate=0.25 \\
        --out results/cross-device-sst2/inprocess --name fedlora-eps8 [--threads 2]

``--set`` takes run-config keys with TOML values, as ``fedpower-run``. The RESULTS.md section
"Client-level DP across many clients (issue #14)" was measured with it.
"""

from __future__ import annotations

import argparse
import json
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

    torch.set_num_threads(a.threads)
    from client_app.app import app as client_app
    from fedpower_app.config import ConfigError, load_preset, parse_config
    from fedpower_app.inprocess import InProcessGrid
    from fedpower_app.launcher import parse_set
    from fedpower_app.logging_setup import setup_logging
    from fedpower_app.results import ResultsWriter
    from server_app import app as server

    setup_logging()
    overrides = load_preset(a.preset)
    if a.data_dir:
        overrides["task.data-dir"] = a.data_dir
    try:
        overrides.update(parse_set(a.set))
        overrides.update({"output-dir": a.out, "run-name": a.name})
        cfg = parse_config(overrides)  # fails here, before any training, on a bad key or value
    except ConfigError as exc:
        raise SystemExit(f"inprocess_run: {exc}") from None
    run_dir = server.run_directory(cfg)
    t0 = time.perf_counter()
    server._run(InProcessGrid(client_app, a.clients, cfg.to_dict()), cfg, run_dir,
                ResultsWriter(run_dir, cfg.to_dict()))
    res = json.loads((run_dir / "results.json").read_text())
    evals = [r for r in res["rounds"] if r.get("accuracy") is not None]
    final = evals[-1]["accuracy"] if evals else None
    print(f"inprocess_run: {a.name}: {len(res['rounds'])} rounds in {time.perf_counter() - t0:.0f} s, final accuracy "
          f"{final if final is None else round(final, 4)}; results in {run_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
