"""fedpower benchmark suite: one entry point, a table of ratios, a JSON file.

    python -m benchmarks.run                          # CPU-sized default (~15-25 min on 2 cores)
    python -m benchmarks.run --large                  # + Llama dense subset of 8 modules, more repeats
    python -m benchmarks.run --only server,client     # a subset: server, e2e, framework, client
    python -m benchmarks.run --json bench.json --device cuda

Every number that matters is a ratio of two cases measured in the same process run, interleaved
(ABAB/BABA) and summarised by medians, so background load on a shared machine mostly cancels.
Absolute times are recorded too, with the machine, the versions and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from .common import Row, environment, markdown_table, resolve_device, table

SUITES = ("server", "e2e", "framework", "client", "dp-sgd")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--large", action="store_true", help="Llama-2-7B dense reference on 8 modules (default 4), more repeats")
    p.add_argument("--only", default=",".join(SUITES), help=f"comma-separated subset of {','.join(SUITES)}")
    p.add_argument("--json", default="bench-results/benchmarks.json", help="where to write the JSON results")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda")
    p.add_argument("--repeats", type=int, default=0, help="timing repeats per case (default 5, --large 7)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of the end-to-end runs (targets 3, 4)")
    p.add_argument("--client-steps", type=int, default=5, help="local steps per timed client run (target 5)")
    p.add_argument("--threads", type=int, default=0, help="torch/OpenMP threads here and in the flwr processes (default: torch's choice). "
                        "Use 1 on a shared, loaded machine: OpenMP regions then cannot stall on a descheduled thread")
    p.add_argument("--workdir", default="", help="directory for flwr homes, logs and run outputs (default: a temp dir)")
    p.add_argument("--client-cpus", type=float, default=2.0,
                   help="Ray client-resources-num-cpus of the flwr runs (2 on 2 cores = one ClientApp at a time, "
                        "like the bare loop; 1 = two in parallel)")
    p.add_argument("--client-gpus", type=float, default=-1.0,
                   help="Ray client-resources-num-gpus (default: 0 on CPU, 1 on CUDA; 0.25 = 4 ClientApps per GPU)")
    p.add_argument("--e2e-timeout", type=float, default=900.0, help="seconds before a flwr run is stopped")
    args = p.parse_args(argv)

    only = {s.strip() for s in args.only.split(",") if s.strip()}
    bad = only - set(SUITES)
    if bad:
        p.error(f"unknown suite(s) {', '.join(sorted(bad))}; choose from {', '.join(SUITES)}")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
        # Children too: the flwr SuperLink, the ServerApp process and the Ray ClientApp actors
        # (Ray only sets OMP_NUM_THREADS for an actor when it is not already set).
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = str(args.threads)
    device = resolve_device(args.device)
    repeats = args.repeats or (7 if args.large else 5)
    out: dict = {"environment": environment(device), "args": vars(args), "suites": {}}
    rows: list[Row] = []
    t0 = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - t0:7.1f} s] {msg}", flush=True)

    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)

    def save(new_rows: list[Row]) -> None:  # after every suite, so a crash keeps finished suites
        for r in new_rows:
            log(f"  => target {r.target}: {r.what}: ratio {r.ratio:.3g} ({r.ratio_is}), goal {r.goal}"
                if r.ratio is not None else f"  => target {r.target}: {r.what}: n/a")
        out["rows"] = [r.to_dict() for r in sorted(rows, key=lambda r: r.target)]
        out["markdown_table"] = markdown_table(sorted(rows, key=lambda r: r.target))
        out["environment"]["loadavg_at_end"] = list(os.getloadavg())
        out["total_seconds"] = time.time() - t0
        path.write_text(json.dumps(out, indent=2, default=str) + "\n")

    log(f"device {device}, torch {torch.__version__} ({torch.get_num_threads()} threads), load avg {os.getloadavg()}")
    if "server" in only:
        from . import server

        r, d = server.run(large=args.large, device=device, repeats=repeats, log=log)
        rows += r
        out["suites"]["server"] = d
        save(r)
    if "client" in only:
        from . import client

        r, d = client.run(device=device, steps=args.client_steps, repeats=repeats, log=log)
        rows += r
        out["suites"]["client"] = d
        save(r)
    if "dp-sgd" in only:
        from . import dp_sgd

        r, d = dp_sgd.run(device=device, steps=args.client_steps, repeats=repeats, log=log)
        rows += r
        out["suites"]["dp-sgd"] = d
        save(r)
    if only & {"e2e", "framework"}:
        from . import e2e

        r, d = e2e.run(rounds=args.rounds, device=device, only=only, workdir=Path(args.workdir) if args.workdir else None,
                       timeout=args.e2e_timeout, log=log, cpus_per_client=args.client_cpus,
                       gpus_per_client=args.client_gpus if args.client_gpus >= 0 else (1.0 if device.type == "cuda" else 0.0))
        rows += r
        out["suites"]["e2e"] = d
        save(r)

    rows.sort(key=lambda r: r.target)
    save([])
    print()
    print(table(rows))
    for r in rows:
        if r.note:
            print(f"  [{r.target}] {r.what}: {r.note}")
    print(f"\nwrote {path} ({out['total_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
