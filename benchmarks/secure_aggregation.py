"""Secure aggregation's cost against plain aggregation, and the accuracy of the same runs.

Each scenario runs the product twice in this process (``benchmarks.inprocess_run``: the real
ServerApp and ClientApp on the in-process grid, Flower messages, no Ray), the same seed and preset,
once plain and once with ``secagg.enabled``; results.json gives the message rounds, the bytes each
way and the time of each round. ``dp.diagnostics = "released"`` so that every count is shown.

* 6 silos, non-private, 4 rounds of 8 local steps (the tiny task learns there, so the accuracy
  compares): FedLoRA (one secure sum of the trained adapters) and FedPower (1 + 2
  ``strategy.power-iters`` secure sums of thin matrices);
* 6 silos at client level: central DP (the server clips and adds the noise) against distributed DP
  (each silo clips and adds its share inside the secure sum), both every silo every round;
* a cohort of 250 simulated clients, FedLoRA, SecAgg+ with 38 neighbours per client (the minimum
  degree at 250 clients, a 10 % dropout rate and no colluder: ``session.minimum_degree``);
* the signed protocol against the semi-honest one, protocol only (``protocol.simulate``): 6 silos,
  one FedLoRA-sized vector, with and without signing keys (the consistency stage and the signatures).

On the in-process grid every client's cryptography runs one after another in this process, so a
secure round's time here is the sum of all clients' work; in a deployment they work in parallel and
the added time is about one client's share plus the message round trips.

    python -m benchmarks.secure_aggregation [--only NAME] [--threads 2] [--out benchmarks/results/cpu-secure-aggregation.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

COMMON = ["--set", "dp.diagnostics=\"released\"", "--set", "dp.noise=\"seeded\""]

SCENARIOS = {
    "6 silos, FedLoRA, non-private": dict(
        clients=6, sets=["strategy.name=\"fedlora\"", "num-server-rounds=4", "train.local-steps=8",
                         "dp.level=\"none\""]),
    "6 silos, FedPower, non-private": dict(
        clients=6, sets=["strategy.name=\"fedpower\"", "num-server-rounds=4", "train.local-steps=8",
                         "dp.level=\"none\""]),
    "6 silos, FedLoRA, client level: central vs distributed DP": dict(
        clients=6, sets=["strategy.name=\"fedlora\"", "num-server-rounds=3", "dp.level=\"client\"", "dp.clip=0.5",
                         "strategy.client-rate=1.0"]),
    "250 clients, FedLoRA, DP-SGD on the clients, 38 neighbours": dict(
        clients=250, sets=["strategy.name=\"fedlora\"", "num-server-rounds=2", "task.synthetic-train-size=5000",
                           "secagg.degree=38"]),
}


def run_one(name: str, clients: int, sets: list[str], secure: bool, threads: int, tmp: Path) -> dict:
    from benchmarks import inprocess_run

    args = ["--preset", "conf/tiny.toml", "--clients", str(clients), "--name", name, "--out", str(tmp),
            "--threads", str(threads)] + COMMON
    for s in sets + [f"secagg.enabled={'true' if secure else 'false'}"]:
        args += ["--set", s]
    t0 = time.perf_counter()
    rc = inprocess_run.main(args)
    wall = time.perf_counter() - t0
    if rc != 0:
        raise SystemExit(f"{name}: inprocess_run exited {rc}")
    res = json.loads((tmp / name / "results.json").read_text())
    rounds = res["rounds"]
    n = len(rounds)
    per_round = [r["wall_seconds"] - (rounds[i - 1]["wall_seconds"] if i else 0.0) for i, r in enumerate(rounds)]
    return {
        "secure": secure, "clients": clients, "rounds": n,
        "message_rounds_per_round": sum(r.get("message_rounds", 1) for r in rounds) / n,
        "bytes_up_per_client_round": sum(r["bytes_up"] for r in rounds) / (n * clients),
        "bytes_down_per_client_round": sum(r["bytes_down"] for r in rounds) / (n * clients),
        "seconds_per_round": sum(per_round) / n,
        "server_seconds_per_round": sum(r.get("aggregation_seconds", 0.0) for r in rounds) / n,
        "final_accuracy": rounds[-1].get("accuracy"),
        "epsilon": rounds[-1].get("epsilon"),
        "released_rounds": sum(bool(r.get("released", True)) for r in rounds),
        "wall_seconds": wall,
    }


SIGNED_TITLE = "6 silos, one secure sum of 75,000 coordinates: semi-honest vs signed protocol"


def signed_against_semi_honest(clients: int = 6, size: int = 75_000, repeats: int = 3) -> dict:
    """The signed protocol's cost (the consistency stage and the signatures) against the semi-honest
    one: the product's protocol objects in this process (``protocol.simulate``), the best of
    ``repeats`` for each, on one vector of ``size`` 32-bit residues per silo."""
    import numpy as np

    from strategies.secure_sum.identity import SiloIdentity, TrustedSilos
    from strategies.secure_sum.protocol import simulate
    from strategies.secure_sum.session import SecureAggregation

    nodes = list(range(1, clients + 1))
    config = SecureAggregation().config_for(nodes, size - 1, b"benchmark", label="1/trained/0")
    rng = np.random.default_rng(0)
    inputs = {u: rng.integers(0, 1 << 32, size=size, dtype=np.int64) for u in nodes}
    identities = {u: SiloIdentity.generate() for u in nodes}
    trusted = TrustedSilos([k.public for k in identities.values()])
    out = {}
    for side, ids in (("semi-honest", None), ("signed", identities)):
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            total, survivors = simulate(config, inputs, identities=ids, trusted=trusted if ids else None)
            best = min(best, time.perf_counter() - t0)
        assert len(survivors) == clients
        out[side] = {"seconds_per_sum": best, "stages": 4 if ids is None else 5}
    out["time_ratio"] = out["signed"]["seconds_per_sum"] / out["semi-honest"]["seconds_per_sum"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.secure_aggregation", description=__doc__.split("\n")[0])
    ap.add_argument("--only", action="append", default=[], help="run only the scenarios whose name contains this")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/cpu-secure-aggregation.json")
    ap.add_argument("--merge", action="store_true", help="keep the other scenarios of an existing --out file")
    a = ap.parse_args(argv)
    out = {}
    if a.merge and Path(a.out).exists():
        out = {k: v for k, v in json.loads(Path(a.out).read_text())["scenarios"].items() if k in SCENARIOS}
        # (the signed scenario is kept below unless it runs again)
    with tempfile.TemporaryDirectory() as tmp:
        for i, (title, sc) in enumerate(SCENARIOS.items()):
            if a.only and not any(o in title for o in a.only):
                continue
            plain = run_one(f"s{i}-plain", sc["clients"], sc["sets"], False, a.threads, Path(tmp))
            secure = run_one(f"s{i}-secure", sc["clients"], sc["sets"], True, a.threads, Path(tmp))
            out[title] = {"plain": plain, "secure": secure,
                          "time_ratio": secure["seconds_per_round"] / plain["seconds_per_round"],
                          "bytes_up_ratio": secure["bytes_up_per_client_round"] / plain["bytes_up_per_client_round"]}
            print(json.dumps({title: out[title]}, indent=1), flush=True)
    if not a.only or any(o in SIGNED_TITLE for o in a.only):
        out[SIGNED_TITLE] = signed_against_semi_honest()
        print(json.dumps({SIGNED_TITLE: out[SIGNED_TITLE]}, indent=1), flush=True)
    elif a.merge and Path(a.out).exists():
        previous = json.loads(Path(a.out).read_text())["scenarios"].get(SIGNED_TITLE)
        if previous:
            out[SIGNED_TITLE] = previous
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    import os
    import platform

    Path(a.out).write_text(json.dumps({"command": "python -m benchmarks.secure_aggregation", "threads": a.threads,
                                       "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
                                       "scenarios": {k: out[k] for k in [*SCENARIOS, SIGNED_TITLE] if k in out}},
                                      indent=1))
    print("| scenario | message rounds | up per client | down per client | s per round | server s | accuracy |")
    print("|---|---|---|---|---|---|---|")
    for title, r in out.items():
        if title == SIGNED_TITLE:
            print(f"| {title} | 4 / 5 | | | {r['semi-honest']['seconds_per_sum']:.2f} / "
                  f"{r['signed']['seconds_per_sum']:.2f} (x{r['time_ratio']:.2f}) | | |")
            continue
        for side in ("plain", "secure"):
            x = r[side]
            print(f"| {title} ({side}) | {x['message_rounds_per_round']:.0f} | {x['bytes_up_per_client_round'] / 1e6:.2f} MB "
                  f"| {x['bytes_down_per_client_round'] / 1e6:.2f} MB | {x['seconds_per_round']:.1f} "
                  f"| {x['server_seconds_per_round']:.1f} | {x['final_accuracy']} |")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
