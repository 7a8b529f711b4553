"""How many rounds of the GPU recipe fit in the seconds left, and the chunk they train in, from the
throughput probe's numbers.

The run trains in the chunk (``train.physical-batch-size``) the probe found fastest per example at
the preset's batch b; the rounds are sized from that same case, so the plan and the run agree. A
round costs 6 silos x L DP-SGD steps at that case's seconds a step, plus the server's evaluation,
times ``--overhead`` for what the probe does not see (Flower's messages, the adapters' load and
save, the accountant, results.json and the checkpoint), plus ``--round-fixed`` seconds. The run
also pays once for its start (imports, model and data, the privacy calibration: ``--startup``
seconds plus the probe's load time), every silo's frozen-prefix cache, the initial evaluation, the
first step's warm-up and its end (the released adapter, the final logits, the privacy report:
``--finish`` seconds). The rounds never exceed the preset's num-server-rounds (its epochs target)
nor ``--max-rounds`` when given.

The run must end by itself: num-server-rounds is what the server calibrates sigma for, what the
learning-rate schedule spans and what the released adapter follows, so a run killed at its time
limit has neither its eps spent as planned, nor its schedule's end, nor a saved adapter. Fewer
rounds than the preset's is still an eps = 8 run: the server calibrates sigma for the rounds it
will run.

Prints the number of rounds (0: none fits) on stdout and writes the plan, with its chunk, as JSON.

    python benchmarks/gpu/size_run.py --preset conf/sst2-dp-gpu.toml --probe probe.json --seconds 300
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tomllib
from pathlib import Path


def training_case(probe: dict, batch: int) -> dict | None:
    """The probe's case the run trains in: at the run's batch b, the chunk with the most examples
    per second (at the largest batch measured when none is at b); None when the probe has no cases."""
    cases = probe.get("cases") or []
    if not cases:
        return None
    at_b = [c for c in cases if c["batch"] == batch]
    if not at_b:
        top = max(c["batch"] for c in cases)
        at_b = [c for c in cases if c["batch"] == top]
    return max(at_b, key=lambda c: c["examples_per_s"])


def plan(preset_rounds: int, probe: dict | None, seconds: float, *, startup: float, overhead: float,
         max_rounds: int = 0, fallback_rounds: int = 2, round_fixed: float = 1.0, finish: float = 0.0) -> dict:
    cap = min(preset_rounds, max_rounds) if max_rounds > 0 else preset_rounds
    if probe is None:
        return {"rounds": min(cap, fallback_rounds), "reason": "no probe numbers: a short fallback run",
                "seconds_available": seconds, "chunk": None}
    est = probe["round_estimate"]
    case = training_case(probe, est.get("batch", 0))
    if case is None:  # a probe without its cases: its round estimate, at the product's chunk
        chunk, warmup, round_seconds = None, 0.0, est["seconds"]
    else:
        # a step's time grows with its examples: scaled from the case's batch to the run's b
        step = case["seconds_per_step"] * est["batch"] / case["batch"]
        chunk, warmup = case["chunk"], case.get("warmup_s", 0.0)
        round_seconds = est["silos"] * est["local_steps"] * step + est.get("eval_seconds", probe.get("eval_seconds", 0.0))
    per_round = overhead * round_seconds + round_fixed
    fixed = (startup + probe.get("load_seconds", 0.0) + est.get("cache_seconds_all_silos", 0.0)
             + probe.get("eval_seconds", 0.0) + warmup + finish)
    fit = max(0, math.floor((seconds - fixed) / per_round))
    rounds = min(cap, fit)
    return {"rounds": rounds, "rounds_that_fit": fit, "rounds_cap": cap, "chunk": chunk,
            "round_seconds_probed": round_seconds, "overhead": overhead, "seconds_available": seconds,
            "seconds_fixed": fixed, "seconds_per_round": per_round, "epochs_per_round": est["epochs_per_round"],
            "epochs": rounds * est["epochs_per_round"], "expected_seconds": fixed + rounds * per_round,
            "reason": ("the preset's rounds fit" if rounds == preset_rounds else
                       f"capped by --max-rounds {max_rounds}" if rounds == cap else "the rounds that fit the time left")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", required=True)
    ap.add_argument("--probe", required=True, help="the probe's JSON (missing: a fallback of --fallback-rounds)")
    ap.add_argument("--seconds", type=float, required=True, help="seconds left for the run")
    ap.add_argument("--max-rounds", type=int, default=0, help="never more rounds than this (0: the preset's)")
    ap.add_argument("--startup", type=float, default=30.0, help="the run's fixed start beyond the probe's load time")
    ap.add_argument("--overhead", type=float, default=1.3, help="factor on a round's probed seconds")
    ap.add_argument("--round-fixed", type=float, default=1.0, help="seconds a round costs beyond the factor")
    ap.add_argument("--finish", type=float, default=10.0,
                    help="the run's end: the released adapter, the final logits, the privacy report")
    ap.add_argument("--fallback-rounds", type=int, default=2)
    ap.add_argument("--json", default="")
    ap.add_argument("--set", action="append", default=[], help="ignored (accepted as run.sh passes the run's --set)")
    a = ap.parse_args(argv)
    with open(a.preset, "rb") as fh:
        preset_rounds = int(tomllib.load(fh).get("num-server-rounds", 8))
    probe = None
    if Path(a.probe).is_file():
        try:
            probe = json.loads(Path(a.probe).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            print(f"size_run: {a.probe} unreadable ({exc}): fallback", file=sys.stderr)
    out = plan(preset_rounds, probe, a.seconds, startup=a.startup, overhead=a.overhead, max_rounds=a.max_rounds,
               fallback_rounds=a.fallback_rounds, round_fixed=a.round_fixed, finish=a.finish)
    out["preset_rounds"] = preset_rounds
    if a.json:
        Path(a.json).write_text(json.dumps(out))
    print(out["rounds"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
