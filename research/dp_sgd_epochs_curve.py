"""Dev accuracy against epochs, private and non-private, and what the goals would take.

Dev accuracy against the epochs of training data seen, private and non-private, with the goal, and
what the measured private curve says it would take to reach it.

The opening table's runs stop at a fixed schedule. This puts them on one axis, epochs (what a run
costs here), beside the non-private 6-silo run and the central ceiling, and fits the private
finals as ``dev = a + s * log2(epochs)``: the points per doubling of the epochs, and the epochs
(and hours, at a measured run's pace) at which that line reaches the goal.

    python -m research.dp_sgd_epochs_curve --out results/sst2-dp/fig_sst2_dp_epochs.png --goal 0.86 \\
        --run "DP ε=8, T=14:results/sst2-dp/fed2-fedlora-eps8-mean" \\
        --run "DP ε=8, T=28:results/sst2-dp/fed-fedlora-eps8-s0-T28" \\
        --curve "non-private, central:results/sst2-dp/central-ceiling.json" \\
        --fit "DP ε=8, T=14" --fit "DP ε=8, T=28" --timing results/sst2-dp/fed2-fedlora-eps8-mean

``--run LABEL:DIR`` (repeat a label for its seeds: the line is their mean per round, with a band
of ± one std) reads DIR/results.json; a round's epochs are each silo's expected examples a round
(batch size × local steps; under Poisson sampling the batch is b in expectation) over the mean
silo size. ``--curve LABEL:FILE`` reads ``{"epochs": [...], "dev": [...]}`` (a run that is not a
federated results.json, such as the central ceiling). ``--fit`` names the labels whose final
rounds (mean over seeds) the line is fitted to. ``--timing DIR``: a run whose wall time per epoch
turns the epochs into hours.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from fedpower_app.experiment.report import mean_std
from research.sst2_dp_figure import DEV  # GLUE's dev split: what the tables report


def epochs_per_round(data: dict) -> float:
    """Each silo's expected examples a round over the mean silo size."""
    cfg = data["config"]
    sizes = data["clients"]["dataset_sizes"]
    return float(cfg["train.batch-size"]) * float(cfg["train.local-steps"]) / statistics.mean(sizes)


def run_curve(data: dict) -> tuple[list[float], list[float]]:
    """(epochs, dev accuracy) at every evaluated round, with the initial model at 0 epochs."""
    if data.get("status") != "completed":
        raise ValueError(f"status {data.get('status')!r}, not completed")
    per_round = epochs_per_round(data)
    xs, ys = [], []
    init = data.get("initial_evaluation") or {}
    if init.get(DEV) is not None:
        xs.append(0.0)
        ys.append(float(init[DEV]))
    for r in data.get("rounds", []):
        if r.get(DEV) is not None:
            xs.append(per_round * int(r["server_round"]))
            ys.append(float(r[DEV]))
    return xs, ys


def mean_band(curves: list[tuple[list[float], list[float]]]) -> tuple[list[float], list[float], list[float]]:
    """The seeds' mean and sample std per point (the points they share, in order)."""
    n = min(len(x) for x, _ in curves)
    xs = curves[0][0][:n]
    for x, _ in curves:
        if any(abs(a - b) > 1e-9 for a, b in zip(x[:n], xs)):
            raise ValueError("seeds of one label must share their schedule")
    stats = [mean_std(y[i] for _, y in curves) for i in range(n)]
    return xs, [m for m, _, _ in stats], [sd for _, sd, _ in stats]


def fit_log2(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``y = a + s * log2(x)`` through (x, y): returns (a, s)."""
    if len(points) < 2 or len({x for x, _ in points}) < 2:
        raise ValueError("the fit needs final rounds at two or more different epochs")
    lx = [math.log2(x) for x, _ in points]
    ys = [y for _, y in points]
    mx, my = statistics.mean(lx), statistics.mean(ys)
    s = sum((a - mx) * (b - my) for a, b in zip(lx, ys)) / sum((a - mx) ** 2 for a in lx)
    return my - s * mx, s


def epochs_to_reach(goal: float, a: float, s: float) -> float:
    """Epochs at which the fitted line reaches ``goal`` (inf if it never rises)."""
    return 2.0 ** ((goal - a) / s) if s > 0 else math.inf


def split_spec(spec: str) -> tuple[str, Path]:
    label, _, path = spec.rpartition(":")
    if not label:
        raise SystemExit(f"{spec!r}: expected LABEL:PATH")
    return label, Path(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", action="append", default=[], metavar="LABEL:DIR")
    ap.add_argument("--curve", action="append", default=[], metavar="LABEL:FILE")
    ap.add_argument("--fit", action="append", default=[], metavar="LABEL")
    ap.add_argument("--goal", action="append", default=[], metavar="GOAL[@LABEL]",
                    help="an accuracy goal; with @LABEL, reached along the fitted slope from that label's final "
                         "round (a budget with one schedule measured), else along the fitted line")
    ap.add_argument("--timing", type=Path, default=None, metavar="DIR",
                    help="a run whose wall seconds per epoch turn epochs into hours")
    ap.add_argument("--out", type=Path, default=None, help="the figure (.png)")
    args = ap.parse_args(argv)

    goals = []
    for g in args.goal:
        value, _, start = g.partition("@")
        goals.append((float(value), start or None))
    series: dict[str, list[tuple[list[float], list[float]]]] = {}
    for spec in args.run:
        label, path = split_spec(spec)
        try:
            series.setdefault(label, []).append(run_curve(json.loads((path / "results.json").read_text())))
        except ValueError as e:
            raise SystemExit(f"{path}: {e}")
    for spec in args.curve:
        label, path = split_spec(spec)
        data = json.loads(path.read_text())
        series.setdefault(label, []).append(([float(x) for x in data["epochs"]], [float(y) for y in data["dev"]]))
    if not series:
        raise SystemExit("nothing to show: give --run or --curve")

    lines = {}
    for label, curves in series.items():
        xs, mean, std = mean_band(curves)
        lines[label] = (xs, mean, std)
        print(f"{label}: final {mean[-1]:.4f} ± {std[-1]:.4f} dev at {xs[-1]:.2f} epochs (n={len(curves)})")

    fit = None
    if args.fit:
        missing = [f for f in args.fit if f not in lines]
        if missing:
            raise SystemExit(f"--fit names no --run/--curve label: {missing}")
        a, s = fit_log2([(lines[f][0][-1], lines[f][1][-1]) for f in args.fit])
        fit = (a, s)
        print(f"fit over {', '.join(args.fit)}: dev = {a:.4f} + {s:.4f} * log2(epochs): "
              f"{100 * s:+.2f} points per doubling of the epochs")
        per_epoch = None
        if args.timing is not None:
            t = json.loads((args.timing / "results.json").read_text())
            epochs = run_curve(t)[0][-1]  # the last evaluated round's epochs; refuses an unfinished run
            per_epoch = float(t["totals"]["wall_seconds"]) / epochs
            print(f"pace: {per_epoch:.0f} s per epoch ({args.timing.name}: {t['totals']['wall_seconds']:.0f} s "
                  f"for {epochs:.2f} epochs)")
        for goal, start in goals:
            if start is None:
                need, how = epochs_to_reach(goal, a, s), "the fitted line"
            else:
                if start not in lines:
                    raise SystemExit(f"--goal {goal}@{start}: no such label")
                x0, y0 = lines[start][0][-1], lines[start][1][-1]
                need, how = epochs_to_reach(goal, y0 - s * math.log2(x0), s), f"the fitted slope from {start}'s final"
            hours = f", about {need * per_epoch / 3600:.1f} h a run at that pace" if per_epoch and math.isfinite(need) else ""
            print(f"goal {goal:.3f}: {how} reaches it at {need:.0f} epochs{hours}")

    if args.out is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        from fedpower_app.figures import save_png

        fig, ax = plt.subplots(figsize=(7.5, 4.2))
        for label, (xs, mean, std) in lines.items():
            pts = [(x, m, sd) for x, m, sd in zip(xs, mean, std) if x > 0]  # log axis: leave the initial model out
            x = [p[0] for p in pts]
            line, = ax.plot(x, [p[1] for p in pts], marker="o", ms=3, label=f"{label} (n={len(series[label])})")
            if len(series[label]) > 1:
                ax.fill_between(x, [p[1] - p[2] for p in pts], [p[1] + p[2] for p in pts], alpha=0.15, color=line.get_color())
        if fit is not None:
            a, s = fit
            lo = min(lines[f][0][-1] for f in args.fit)
            hi = max([lines[f][0][-1] for f in args.fit] + [min(epochs_to_reach(g, a, s), 1e4) for g, st in goals if st is None])
            xs = [lo * (hi / lo) ** (i / 50) for i in range(51)]
            ax.plot(xs, [a + s * math.log2(x) for x in xs], ls=":", color="k", label=f"fit to the private finals ({100 * s:+.1f} per doubling)")
        ax.set_xscale("log", base=2)
        for goal, start in goals:
            ax.axhline(goal, ls="--", color="grey", lw=1)
            ax.text(0.01, goal, f"goal {goal:.2f}" + (f" ({(start or args.fit[0]).split(',')[0]})" if start or args.fit else ""), va="bottom", fontsize=8,
                    color="grey", transform=ax.get_yaxis_transform())
        finals = [m[-1] for _, m, _ in lines.values()]
        ax.set_ylim(max(0.5, min(finals + [g for g, _ in goals]) - 0.1), min(1.0, max(finals + [g for g, _ in goals]) + 0.02))
        ax.set_xlabel("epochs of training data seen (log scale)")
        ax.set_ylabel("dev accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
        ax.set_title("SST-2, MiniLM top-3 LoRA: accuracy against epochs")
        fig.tight_layout()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        save_png(fig, args.out, dpi=110)
        plt.close(fig)
        print(f"figure: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
