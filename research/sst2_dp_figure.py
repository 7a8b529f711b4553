"""The SST-2 table's figures (accuracy per round, mean ± std band) and its mean ± std per cell.

The opening table's seeds, as one figure of accuracy per round with bands, and the mean ± std of
each (method, ε) over its seeds' final rounds.

The SST-2 cells of RESULTS.md's opening table ran as single federated runs
(``benchmarks.inprocess_run``), one results directory per (method, ε, seed). This reads them and
draws them with the grid report's own plot (``fedpower_app.experiment.report.plot_curves``: mean
over seeds, a band of ± one std), so the figure and the grid's figures are one code path.

    python -m research.sst2_dp_figure --out results/sst2-dp/fig_sst2_dp_eps8.png --eps 8 \\
        --run fedlora:0:results/sst2-dp/fed2-fedlora-eps8-mean --run fedlora:1:results/sst2-dp/fed-fedlora-eps8-s1

Each ``--run`` is ``METHOD:SEED:DIR`` (DIR holds results.json). Prints, per method, the final
round's dev accuracy (GLUE's dev split; the figure plots it) and train-carved validation accuracy of every seed and their
mean ± std (sample std, ddof = 1).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fedpower_app.experiment.report import Collected, mean_std, plot_curves

VALIDATION = "validation-from-train-accuracy"  # the rows carved from train (tuning), the runs' "accuracy"
DEV = "validation-accuracy"  # GLUE's dev split: what the tables report


def as_dev(data: dict) -> dict:
    """``data`` with each round's (and the initial) ``accuracy`` set to its dev accuracy: the plot
    reads ``accuracy``, which these runs fill with the train-carved validation rows."""
    out = dict(data)
    out["rounds"] = [{**r, "accuracy": r.get(DEV)} for r in data.get("rounds", [])]
    if data.get("initial_evaluation"):
        out["initial_evaluation"] = {**data["initial_evaluation"], "accuracy": data["initial_evaluation"].get(DEV)}
    return out


def final_round(data: dict) -> dict:
    rounds = [r for r in data.get("rounds", []) if r.get(DEV) is not None]
    if not rounds:
        raise ValueError("no evaluated round")
    return rounds[-1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", action="append", required=True, metavar="METHOD:SEED:DIR")
    ap.add_argument("--eps", type=float, default=None, help="the runs' epsilon (omit: non-private)")
    ap.add_argument("--out", type=Path, required=True, help="the figure (.png)")
    ap.add_argument("--task", default="sst2")
    args = ap.parse_args(argv)
    runs: dict = {}
    for spec in args.run:
        method, seed, path = spec.split(":", 2)
        data = json.loads((Path(path) / "results.json").read_text())
        if data.get("status") != "completed":
            raise SystemExit(f"{path}: status {data.get('status')!r}, not completed")
        eps = data.get("privacy", {}).get("epsilon")
        if args.eps is not None and eps is not None and abs(float(eps) - args.eps) > 1e-9:
            raise SystemExit(f"{path}: a run at epsilon {eps}, not {args.eps:g}")
        runs.setdefault((args.task, method, args.eps), {})[int(seed)] = as_dev(data)
    for (_, method, _), seeds in runs.items():
        finals = {s: final_round(d) for s, d in sorted(seeds.items())}
        dev = mean_std(f[DEV] for f in finals.values())
        val = mean_std(f.get(VALIDATION) for f in finals.values())
        per_seed = ", ".join(f"s{s} {f[DEV]:.3f}/{f.get(VALIDATION, float('nan')):.3f}" for s, f in finals.items())
        print(f"{method}: dev {dev[0]:.4f} ± {dev[1]:.4f}, validation {val[0]:.4f} ± {val[1]:.4f} "
              f"(n={dev[2]}; dev/validation per seed: {per_seed})")
    methods = sorted({m for _, m, _ in runs})
    if not plot_curves(Collected(runs), args.task, args.eps, methods, args.out, title_prefix="6 silos: " if args.eps is None else "DP-SGD on 6 silos: "):
        raise SystemExit("nothing to plot")
    print(f"figure: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
