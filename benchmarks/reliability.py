"""Fault injection: the table of RELIABILITY.md, measured.

Every scenario runs the real ServerApp and ClientApp in-process (``fedpower_app.runs.inprocess_grid``) on the
tiny generated task (2-3 silos, 3-4 rounds, DP-SGD on the silos) in a subprocess, so a fault can be
a real SIGKILL (``FEDPOWER_FAULT``, fedpower_app/checkpoint.py). For each scenario it reports the
rounds lost or repeated, the epsilon accounted against an uninterrupted run of the same seed,
whether the final adapters are bit-identical to it, and the time to recover (the resumed process's
wall time up to the end of the first round it runs, or the round that waited for a silent silo).

    python -m benchmarks.reliability            # ~4 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TINY = {"task.synthetic-train-size": 240, "task.synthetic-eval-size": 80, "task.max-length": 32,
        "train.local-steps": 2, "train.batch-size": 16, "strategy.client-rate": 1.0, "train.lr": 0.003,
        "train.lr-schedule": "constant", "num-server-rounds": 3, "run-name": "run", "dp.noise-at": "silo",
        "strategy.round-timeout": 5.0}


def worker(cfg_json: str, nodes: int, silent: str) -> None:
    """Child process: one in-process run. ``silent`` = "node:round,round" loses that node's train
    replies in those rounds; "restart" makes node 101 crash in round 2 and return as node 555."""
    from flwr.app import Context, RecordDict

    from client_app.app import app as client_app
    from fedpower_app.config import parse_config
    from fedpower_app.runs.inprocess_grid import InProcessGrid
    from server_app import app as server

    cfg = parse_config(json.loads(cfg_json))
    handlers = {}
    holder = {}
    if silent.startswith("node:"):
        node, rounds = silent[5:].split("@")
        lost = {int(r) for r in rounds.split(",")}

        def quiet(msg, context):
            rnd = int((msg.content.config_records.get("config") or {}).get("server-round", 0))
            return None if msg.metadata.message_type == "train" and rnd in lost else client_app(msg, context)

        handlers[int(node)] = quiet
    elif silent == "restart":
        def crash(msg, context):
            rnd = int((msg.content.config_records.get("config") or {}).get("server-round", 0))
            if msg.metadata.message_type == "train" and rnd == 2:
                grid = holder["grid"]
                grid.node_ids = [n for n in grid.node_ids if n != 101] + [555]
                old = grid._contexts[101]
                grid._contexts[555] = Context(run_id=1, node_id=555, node_config=dict(old.node_config),
                                              state=RecordDict(), run_config=dict(old.run_config))
                return None
            return client_app(msg, context)

        handlers[101] = crash
    grid = InProcessGrid(client_app, nodes, cfg.to_dict(), handlers=handlers)
    holder["grid"] = grid
    server.run_server(grid, cfg)


def run(cfg: dict, *, nodes: int = 2, fault: str | None = None, silent: str = "") -> tuple[int, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("FEDPOWER_FAULT", None)
    if fault:
        env["FEDPOWER_FAULT"] = fault
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "benchmarks.reliability", "--worker", json.dumps(cfg), str(nodes), silent],
                          env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode not in (0, -signal.SIGKILL):
        raise RuntimeError(proc.stderr[-3000:])
    return proc.returncode, time.time() - t0


def read(run_dir: Path) -> tuple[dict, bytes | None]:
    res = json.loads((run_dir / "results.json").read_text())
    adapter = run_dir / "adapter" / "adapter_model.safetensors"
    return res, adapter.read_bytes() if adapter.exists() else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a.worker[0], int(a.worker[1]), a.worker[2])
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)

        def cfg_in(name, **extra):
            return {**TINY, "output-dir": str(tmp / name), **extra}

        rc, base_s = run(cfg_in("base"))
        base, base_adapter = read(tmp / "base" / "run")
        base_eps = base["totals"]["final_epsilon"]
        per_round = base_s / 3
        print(f"uninterrupted: {base_s:.1f} s, eps {base_eps:.4f}", flush=True)

        for fault, what in (("after-journal:2", "server SIGKILLed mid-round 2 (round in flight)"),
                            ("checkpoint-tmp-written:2", "server SIGKILLed while writing round 2's checkpoint"),
                            ("after-checkpoint:2", "server SIGKILLed right after round 2's checkpoint"),
                            ("after-checkpoint:3", "server SIGKILLed after the last round, before saving the model")):
            name = fault.replace(":", "-")
            rc, killed_s = run(cfg_in(name), fault=fault)
            assert rc == -signal.SIGKILL
            rc, resume_s = run(cfg_in(name, resume=True))
            res, adapter = read(tmp / name / "run")
            rounds = [r["server_round"] for r in res["rounds"]]
            rows.append({"fault": what, "injection": f"FEDPOWER_FAULT={fault}",
                         "rounds lost / repeated": f"{3 - len(set(rounds))} / {len(rounds) - len(set(rounds))}",
                         "eps accounted (uninterrupted)": f"{res['totals']['final_epsilon']:.4f} ({base_eps:.4f})",
                         "final adapters": "bit-identical" if adapter == base_adapter else "DIFFER",
                         "recovery": f"resumed run {resume_s:.0f} s (uninterrupted run {base_s:.0f} s)"})
            print(rows[-1], flush=True)

        rc, _ = run(cfg_in("hard", **{"dp.noise": "hardened", "dp.epsilon": 50.0}), fault="after-journal:2")
        rc, resume_s = run(cfg_in("hard", **{"dp.noise": "hardened", "dp.epsilon": 50.0, "resume": True}))
        res, _ = read(tmp / "hard" / "run")
        charges = [s["entries"][0][3] for s in res["privacy_final"]["ledgers"].values()]
        rows.append({"fault": "same, hardened noise (the killed round cannot be reproduced)",
                     "injection": "FEDPOWER_FAULT=after-journal:2, dp.noise=hardened",
                     "rounds lost / repeated": f"0 / 0; round 3 not sent: budget ({res['status']})",
                     "eps accounted (uninterrupted)": f"{res['totals']['final_epsilon']:.4f}; charges per silo {charges} "
                                                       "(the lost release counts)",
                     "final adapters": "n/a (fresh noise)", "recovery": f"resumed run {resume_s:.0f} s"})
        print(rows[-1], flush=True)

        rc, s = run(cfg_in("silent", **{"num-server-rounds": 3}), nodes=3, silent="node:102@2")
        res, _ = read(tmp / "silent" / "run")
        r2 = res["rounds"][1]
        wait = r2["wall_seconds"] - res["rounds"][0]["wall_seconds"]
        rows.append({"fault": "a SuperNode's reply never comes in round 2 (killed or too slow)",
                     "injection": "train reply lost, round timeout 5 s",
                     "rounds lost / repeated": f"0 / 0 (round 2: {r2['aggregated']} of {r2['sampled']} aggregated, "
                                               f"missing {r2['missing']})",
                     "eps accounted (uninterrupted)": f"{res['totals']['final_epsilon']:.4f}; silo trained "
                                                       f"{[x['rounds_trained'] for x in res['privacy_final']['silos']]}"
                                                       " rounds (the lost round counts: it was sent)",
                     "final adapters": "n/a (other data)", "recovery": f"round 2 took {wait:.1f} s (timeout 5 s)"})
        print(rows[-1], flush=True)

        rc, s = run(cfg_in("restart", **{"num-server-rounds": 4}), nodes=2, silent="restart")
        res, _ = read(tmp / "restart" / "run")
        ev = [e for e in res.get("roster_events", []) if e.get("admitted")]
        rows.append({"fault": "a SuperNode crashes in round 2 and restarts under a new node id",
                     "injection": "node 101 lost in round 2, back as node 555",
                     "rounds lost / repeated": f"0 / 0 (aggregated per round {[r['aggregated'] for r in res['rounds']]})",
                     "eps accounted (uninterrupted)": f"{res['totals']['final_epsilon']:.4f}; silos trained "
                                                       f"{[x['rounds_trained'] for x in res['privacy_final']['silos']]}",
                     "final adapters": "n/a", "recovery": f"rejoined in round {ev[0]['round'] if ev else '-'} "
                                                          "(next round after it reconnected)"})
        print(rows[-1], flush=True)
    keys = list(rows[0])
    print("\n| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(str(r[k]) for k in keys) + " |")
    print(f"\nper round of the uninterrupted run: {per_round:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
