"""The grid's tables and figures, from the finished cells' results (mean +- std over seeds)."""

from __future__ import annotations

import csv
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence


from ..figures import save_png
from .spec import Cell, FINISHED, GridSpec, SPLIT_LABELS, TABLE_TITLES, TASK_LABELS, _eps_sort_key, canonical_method, eps_label, eps_tag, method_label, refactor_every
from .store import cell_metrics, config_changes, eval_splits_of, read_results, results_path


#: What a best-round figure is: the round picked by looking at the evaluation split's accuracy, so
#: the figure is optimistic and no release's measurement (RESULTS.md reports final rounds only).
BEST_ROUND_LABEL = "selected on the evaluation split, not a result"

def curve(data: dict[str, Any]) -> list[tuple[int, float, float]]:
    """(round, cumulative transferred bits, accuracy) for every evaluated round, with round 0 = the
    initial model at 0 bits."""
    pts: list[tuple[int, float, float]] = []
    init = data.get("initial_evaluation") or {}
    if init.get("accuracy") is not None:
        pts.append((0, 0.0, float(init["accuracy"])))
    bits = 0.0
    for r in data.get("rounds", []):
        bits += 8.0 * (int(r.get("bytes_up", 0)) + int(r.get("bytes_down", 0)))
        if r.get("accuracy") is not None:
            pts.append((int(r["server_round"]), bits, float(r["accuracy"])))
    return pts


def mean_std(values: Iterable[float | None]) -> tuple[float | None, float | None, int]:
    """Mean and sample standard deviation (ddof = 1; 0 for a single value) of the non-missing values."""
    vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not vals:
        return None, None, 0
    if len(vals) == 1:
        return vals[0], 0.0, 1
    return statistics.mean(vals), statistics.stdev(vals), len(vals)


@dataclass
class Collected:
    """Finished runs by (task, method, epsilon): seed -> results.json data."""

    runs: dict[tuple[str, str, float | None], dict[int, dict[str, Any]]]
    stale: list[str] = field(default_factory=list)  # finished cells left out: made with other settings
    shared: dict[tuple[str, str, float | None], str] = field(default_factory=dict)  # GridSpec.shared_rows

    def get(self, task: str, method: str, eps: float | None) -> dict[int, dict[str, Any]]:
        method = self.shared.get((task, method, eps), method)
        return self.runs.get((task, method, eps), {})


def collect(out: Path, cells: Sequence[Cell], spec: GridSpec | None = None) -> Collected:
    """The finished cells' results; with ``spec``, without the stale ones (made with other settings)."""
    runs: dict[tuple[str, str, float | None], dict[int, dict[str, Any]]] = {}
    stale: list[str] = []
    for cell in cells:
        data = read_results(results_path(out, cell))
        if data is None or data.get("status") not in FINISHED:
            continue
        if spec is not None and config_changes(spec, cell, out):
            stale.append(cell.cell_id)
            continue
        runs.setdefault((cell.task, cell.method, cell.epsilon), {})[cell.seed] = data
    return Collected(runs, stale, spec.shared_rows() if spec is not None else {})


def task_columns(collected: Collected, tasks: Sequence[str]) -> list[tuple[str, str, str]]:
    """Accuracy columns: (task, split, header). One per evaluation split (MNLI: matched and
    mismatched), in task order."""
    cols: list[tuple[str, str, str]] = []
    for task in tasks:
        splits: list[str] = []
        for (t, _, _), seeds in collected.runs.items():
            if t != task:
                continue
            for data in seeds.values():
                for s in eval_splits_of(data):
                    if s not in splits:
                        splits.append(s)
        if not splits:
            splits = ["validation_matched", "validation_mismatched"] if task == "mnli" else ["validation"]
        label = TASK_LABELS.get(task, task)
        for s in splits:
            header = label if len(splits) == 1 else f"{label}-{SPLIT_LABELS.get(s, s)}"
            cols.append((task, s, header))
    return cols


def _pm(mean: float | None, std: float | None, n: int, scale: float = 100.0, digits: int = 2) -> str:
    if mean is None:
        return "—"
    if n < 2:  # one seed has no spread to show; "± 0.00" would claim one
        return f"{mean * scale:.{digits}f}"
    return f"{mean * scale:.{digits}f} ± {std * scale:.{digits}f}"


@dataclass
class Table:
    title: str
    headers: list[str]
    rows: list[list[str]]
    csv_headers: list[str]
    csv_rows: list[list[Any]]
    notes: list[str] = field(default_factory=list)

    def markdown(self) -> str:
        lines = [f"### {self.title}", ""]
        lines.append("| " + " | ".join(self.headers) + " |")
        lines.append("|" + "|".join("---" for _ in self.headers) + "|")
        for row in self.rows:
            lines.append("| " + " | ".join(row) + " |")
        if self.notes:
            lines.append("")
            lines.extend(self.notes)
        return "\n".join(lines) + "\n"

    def write(self, out: Path, stem: str) -> None:
        (out / f"{stem}.md").write_text(self.markdown())
        with open(out / f"{stem}.csv", "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(self.csv_headers)
            for row in self.csv_rows:
                w.writerow(["" if v is None else (f"{v:.6g}" if isinstance(v, float) else v) for v in row])


def _seed_average_over_columns(cols: list[tuple[str, str, str]], collected: Collected, method: str, eps: float | None, which: str) -> list[float]:
    """Per seed: the average over all task columns (only seeds that finished every task)."""
    per_seed: list[float] = []
    common = None
    for task in {c[0] for c in cols}:
        s = set(collected.get(task, method, eps))
        common = s if common is None else common & s
    for seed in sorted(common or ()):
        vals = []
        for task, split, _ in cols:
            m = cell_metrics(collected.get(task, method, eps)[seed])
            vals.append(m[which].get(split))
        if all(v is not None for v in vals):
            per_seed.append(statistics.mean(vals))
    return per_seed


def accuracy_table(collected: Collected, tasks: Sequence[str], methods: Sequence[str],
                   epsilons: Sequence[float | None], title: str, which: str = "final") -> Table:
    """Accuracy (%) mean ± std over seeds per (epsilon, method) row and task column, plus the
    average over columns (computed per seed, then mean ± std)."""
    cols = task_columns(collected, tasks)
    multi = len(cols) > 1
    headers = ["Privacy budget", "Method"] + [c[2] for c in cols] + (["Average"] if multi else []) + ["n seeds", "ε spent"]
    csv_headers = ["epsilon", "method"]
    for c in cols:
        csv_headers += [f"{c[2]}_mean", f"{c[2]}_std", f"{c[2]}_n"]
    if multi:
        csv_headers += ["average_mean", "average_std", "average_n"]
    csv_headers += ["epsilon_spent_mean", "z_mean", "run_of"]  # run_of: the method whose cells a shared row shows
    rows, csv_rows = [], []
    shared_notes: set[str] = set()
    for eps in sorted(set(epsilons), key=_eps_sort_key):
        for method in methods:
            method = canonical_method(method)
            row = [eps_label(eps), method_label(method)]
            crow: list[Any] = ["none" if eps is None else eps, method]
            ns, spent, zs = [], [], []
            for task, split, _ in cols:
                seeds = collected.get(task, method, eps)
                metrics = [cell_metrics(d) for d in seeds.values()]
                mean, std, n = mean_std(m[which].get(split) for m in metrics)
                row.append(_pm(mean, std, n))
                crow += [mean, std, n]
                ns.append(n)
                spent += [m["epsilon"] for m in metrics if m["epsilon"] is not None]
                zs += [m["z"] for m in metrics if m["z"] is not None]
            if multi:
                per_seed = _seed_average_over_columns(cols, collected, method, eps, which)
                mean, std, n = mean_std(per_seed)
                row.append(_pm(mean, std, n))
                crow += [mean, std, n]
            row.append(str(min(ns)) if ns and min(ns) == max(ns) else f"{min(ns) if ns else 0}–{max(ns) if ns else 0}")
            row.append("—" if not spent else f"{statistics.mean(spent):.3f}")
            crow += [statistics.mean(spent) if spent else None, statistics.mean(zs) if zs else None]
            run_by = {collected.shared[(t, method, eps)] for t in tasks if (t, method, eps) in collected.shared}
            crow.append(",".join(sorted(run_by)))
            if run_by:
                row[1] += " †"
                shared_notes.add(f"† {method_label(method)}, {eps_label(eps)}, is the run of "
                                 f"{', '.join(method_label(m) for m in sorted(run_by))}: the two differ only in "
                                 "the client-level DP release, so one cell serves both rows.")
            rows.append(row)
            csv_rows.append(crow)
    init_parts = []
    for task, split, header in cols:
        per_seed: dict[int, float] = {}
        for (t, _, _), seeds in collected.runs.items():
            if t == task:
                for seed, data in seeds.items():
                    v = (data.get("initial_evaluation") or {}).get(f"{split}-accuracy")
                    if v is not None:
                        per_seed.setdefault(seed, float(v))
        mean, std, n = mean_std(per_seed.values())
        if n:
            init_parts.append(f"{header} {_pm(mean, std, n)} (n={n})")
    notes = [f"Accuracy in %, {'final (last evaluated round)' if which == 'final' else BEST_ROUND_LABEL}, "
             "mean ± sample std over seeds (n seeds per cell). "
             + ("Average = mean over the task columns per seed (seeds that finished every task), then mean ± std. " if multi else "")
             + "ε spent = accountant's ε after the last round (target in the first column), δ from the config; "
             "— = no finished run."]
    if shared_notes:
        notes.append("")
        notes.extend(sorted(shared_notes))
    if init_parts:
        notes.append("")
        notes.append("Initial model (round 0, LoRA B = 0, untrained frozen head), per seed: " + "; ".join(init_parts) + ".")
    return Table(title, headers, rows, csv_headers, csv_rows, notes)


def refactor_table(collected: Collected, tasks: Sequence[str], methods: Sequence[str],
                   epsilons: Sequence[float | None], title: str) -> Table:
    """Table 3: per method and epsilon, server aggregation time per round (mean over rounds, then
    mean ± std over seeds and tasks), overhead vs FedLoRA at the same epsilon, total wall time of a
    run, accuracy averaged over tasks."""
    cols = task_columns(collected, tasks)
    headers = ["Privacy budget", "Method", "Refactorization frequency", "Server time per round (s)",
               "Overhead vs FedLoRA", "Wall time per run (s)", "Accuracy (avg over tasks)", "n runs"]
    csv_headers = ["epsilon", "method", "refactor_every", "server_seconds_per_round_mean", "server_seconds_per_round_std",
                   "overhead_vs_fedlora", "wall_seconds_mean", "wall_seconds_std", "accuracy_mean", "accuracy_std", "n"]
    rows, csv_rows = [], []
    for eps in sorted(set(epsilons), key=_eps_sort_key):
        base = None
        stats: dict[str, tuple] = {}
        for method in methods:
            method = canonical_method(method)
            metrics = [cell_metrics(d) for task in tasks for d in collected.get(task, method, eps).values()]
            agg = mean_std(m["aggregation_seconds"] for m in metrics)
            wall = mean_std(m["wall_seconds"] for m in metrics)
            acc_per_seed = _seed_average_over_columns(cols, collected, method, eps, "final")
            acc = mean_std(acc_per_seed)
            stats[method] = (agg, wall, acc, len(metrics))
            if method == "fedlora":
                base = agg[0]
        for method in methods:
            method = canonical_method(method)
            agg, wall, acc, n = stats[method]
            f = refactor_every(method)
            freq = "none (FedLoRA release)" if f is None else f"every {f} round{'s' if f > 1 else ''}"
            overhead = None if (base is None or agg[0] is None or base <= 0) else agg[0] / base - 1.0
            rows.append([eps_label(eps), method_label(method), freq,
                         "—" if agg[0] is None else f"{agg[0]:.4f} ± {agg[1]:.4f}",
                         "—" if overhead is None else f"{overhead * 100:+.1f} % (×{overhead + 1:.2f})",
                         "—" if wall[0] is None else f"{wall[0]:.1f} ± {wall[1]:.1f}",
                         _pm(*acc), str(n)])
            csv_rows.append(["none" if eps is None else eps, method, f, agg[0], agg[1], overhead, wall[0], wall[1],
                             acc[0], acc[1], n])
    notes = ["Server time per round = the ServerApp's `aggregation_seconds` (validation, clipping, averaging, "
             "noise and refactorization; not client training), mean over the rounds of a run, then mean ± std over runs "
             "(seeds × tasks). Overhead = ratio to FedLoRA at the same ε minus 1. Wall time = whole run incl. "
             "model loading, client training and evaluation. Accuracy in %, final round, averaged over tasks per seed."]
    return Table(title, headers, rows, csv_headers, csv_rows, notes)


def mean_curve(seeds: dict[int, dict[str, Any]]) -> tuple[list[int], list[float], list[float], list[float]]:
    """Mean over seeds of (bits, accuracy) at each evaluated round present in every seed."""
    curves = [curve(d) for d in seeds.values()]
    if not curves:
        return [], [], [], []
    common = set.intersection(*({p[0] for p in c} for c in curves))
    rounds = sorted(common)
    bits, acc, std = [], [], []
    for r in rounds:
        b = [p[1] for c in curves for p in c if p[0] == r]
        a = [p[2] for c in curves for p in c if p[0] == r]
        bits.append(statistics.mean(b))
        acc.append(statistics.mean(a))
        std.append(statistics.stdev(a) if len(a) > 1 else 0.0)
    return rounds, bits, acc, std


def plot_curves(collected: Collected, task: str, eps: float | None, methods: Sequence[str], path: Path,
                title_prefix: str = "") -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = []
    canon = [canonical_method(m) for m in methods]
    for method in methods:
        method = canonical_method(method)
        if collected.shared.get((task, method, eps)) in canon:  # the same run as another line of this plot
            continue
        seeds = collected.get(task, method, eps)
        if seeds:
            series.append((method, len(seeds), *mean_curve(seeds)))
    if not series:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for method, n, rounds, bits, acc, std in series:
        lo = [a - s for a, s in zip(acc, std)]
        hi = [a + s for a, s in zip(acc, std)]
        label = f"{method_label(method)} (n={n})"
        line, = ax1.plot(rounds, acc, marker="o", ms=3, label=label)
        ax1.fill_between(rounds, lo, hi, alpha=0.15, color=line.get_color())
        ax2.plot(bits, acc, marker="o", ms=3, label=label, color=line.get_color())
        ax2.fill_between(bits, lo, hi, alpha=0.15, color=line.get_color())
    ax1.set_xlabel("round")
    ax2.set_xlabel("transferred bits (up + down, cumulative)")
    ax2.ticklabel_format(axis="x", style="sci", scilimits=(0, 0))
    for ax in (ax1, ax2):
        ax.set_ylabel("accuracy")
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    fig.suptitle(f"{title_prefix}{TASK_LABELS.get(task, task)}, {'non-private' if eps is None else f'ε = {eps:g}'} "
                 f"(mean ± std over seeds)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_png(fig, path, dpi=110)
    plt.close(fig)
    return True


def write_report(spec: GridSpec, out: Path) -> dict[str, list[str]]:
    """Write the tables and figures of the grid from the finished cells; return what was written."""
    cells = spec.cells()
    collected = collect(out, cells, spec)
    written: dict[str, list[str]] = {"tables": [], "figures": [], "stale": collected.stale}
    for block, methods, epsilons in spec.blocks():
        methods = [canonical_method(m) for m in methods]
        if block == "3":
            table = refactor_table(collected, spec.tasks, methods, epsilons, TABLE_TITLES["3"])
        else:
            title = TABLE_TITLES.get(block, "Accuracy per method and privacy budget (custom grid)")
            table = accuracy_table(collected, spec.tasks, methods, epsilons, title)
            best = accuracy_table(collected, spec.tasks, methods, epsilons,
                                  f"{title} (best round: {BEST_ROUND_LABEL})", which="best")
            table.notes.append("")
            table.notes.append(best.markdown().strip())
        stem = f"table{block}" if block != "custom" else "table_custom"
        table.write(out, stem)
        written["tables"].append(stem)
        for task in spec.tasks:
            for eps in sorted(set(epsilons), key=_eps_sort_key):
                name = f"fig_{'t' + block if block != 'custom' else 'custom'}_{task}_{eps_tag(eps)}.png"
                if plot_curves(collected, task, eps, methods, out / name,
                               title_prefix=f"{'Table ' + block if block != 'custom' else 'custom grid'}: "):
                    written["figures"].append(name)
    return written


def grid_summary_markdown(spec: GridSpec, out: Path) -> str:
    """The tables written by write_report, concatenated (for README/RESULTS)."""
    parts = []
    for block, _, _ in spec.blocks():
        stem = f"table{block}" if block != "custom" else "table_custom"
        p = out / f"{stem}.md"
        if p.exists():
            parts.append(p.read_text())
    return "\n".join(parts)
