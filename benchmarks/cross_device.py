"""Cross-device cost: a round's time at N = 100 and N = 1000 clients with the same cohort.

The real ServerApp and ClientApp run on an in-process grid (``fedpower_app.runs.inprocess_grid``: Flower
Messages and ArrayRecords, no Ray, no SuperLink) at client level (DP on round deltas), with the
same expected cohort (q_c N = 10), the same per-client shard (40 generated examples) and the same
local work. What may grow with N is the server's bookkeeping: the sampling coins, the roster
check, the population list. The start (one size query per client, tokenizing every shard once) is
O(N) and reported apart. One process, one model: no model is loaded per virtual client.

    python -m benchmarks.cross_device [--rounds 3] [--cohort 10] [--sizes 100 1000]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def one(n: int, cohort: int, rounds: int, tmp: Path) -> dict:
    from client_app.app import app as client_app
    from fedpower_app.config import parse_config
    from fedpower_app.runs.inprocess_grid import InProcessGrid
    from fedpower_app.runs.results import ResultsWriter
    from server_app import app as server

    cfg = parse_config({"task.synthetic-train-size": 40 * n, "task.synthetic-eval-size": 100, "task.max-length": 32,
                        "train.local-steps": 2, "train.batch-size": 16, "train.lr": 0.003,
                        "train.lr-schedule": "constant", "strategy.client-rate": cohort / n,
                        "num-server-rounds": rounds, "dp.level": "client", "dp.clip": 0.5, "eval.every": rounds,
                        # results.json shows each round's wall time at client level only with released
                        # diagnostics (the time would tell the secret cohort's size)
                        "dp.diagnostics": "released",
                        "output-dir": str(tmp), "run-name": f"n{n}"})
    grid = InProcessGrid(client_app, n, cfg.to_dict())
    run_dir = server.run_directory(cfg)
    t0 = time.perf_counter()
    server._run(grid, cfg, run_dir, ResultsWriter(run_dir, cfg.to_dict()))
    total = time.perf_counter() - t0
    res = json.loads((run_dir / "results.json").read_text())
    walls = [0.0] + [r["wall_seconds"] for r in res["rounds"]]
    per_round = [b - a for a, b in zip(walls, walls[1:])]
    start = total - walls[-1]
    sampled = [r["sampled"] for r in res["rounds"]]
    return {"n": n, "cohort_expected": cohort, "sampled": sampled, "round_seconds": per_round,
            "seconds_per_sampled_client": sum(per_round[:-1]) / max(1, sum(sampled[:-1])),
            "start_seconds": start, "total_seconds": total}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[100, 1000])
    ap.add_argument("--cohort", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in a.sizes:
            r = one(n, a.cohort, a.rounds, Path(tmp))
            out.append(r)
            print(f"N = {n:5d}: start {r['start_seconds']:.1f} s (size query + shards), rounds "
                  f"{', '.join(f'{s:.1f}' for s in r['round_seconds'])} s with {r['sampled']} sampled; "
                  f"{r['seconds_per_sampled_client']:.2f} s per sampled client (rounds without evaluation)", flush=True)
    base, big = out[0], out[-1]
    ratio = big["seconds_per_sampled_client"] / base["seconds_per_sampled_client"]
    print(f"\nratio of the time per sampled client, N = {big['n']} vs N = {base['n']}: {ratio:.3f}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
