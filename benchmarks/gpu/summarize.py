"""The short summary table of a benchmarks/gpu/run.sh session, from its folder.

    python benchmarks/gpu/summarize.py /tmp/fedpower-gpu/gpu-run [--budget S] [--elapsed S]

Reads stages.tsv, environment.log, first_step.json, tests.log, probe.json, run_plan.json, the run's
results.json (runs/*/results.json) and slow_tests.log; anything missing is reported as missing,
never guessed. Accuracies are the final round's: "validation" is results.json's
``validation-from-train-accuracy`` (the rows carved from the train split), "dev" its
``validation-accuracy`` (GLUE's dev split, the reporting split: no round is picked by it).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _fmt(x, spec: str = ".3f", missing: str = "n/a") -> str:
    return missing if x is None else format(x, spec)


def environment_line(text: str) -> str:
    gpu = re.search(r"^gpu (.+)$", text, re.M)
    torch_v = re.search(r"^torch (\S+) cuda (\S+) available (\S+)", text, re.M)
    parts = [gpu.group(1) if gpu else "no CUDA GPU"]
    if torch_v:
        parts.append(f"torch {torch_v.group(1)}, CUDA {torch_v.group(2)}")
    for name in ("flwr", "opacus", "transformers"):
        m = re.search(rf"^{name} (\S+)", text, re.M)
        if m:
            parts.append(f"{name} {m.group(1)}")
    missing = re.findall(r"^(\S+) NOT IMPORTABLE", text, re.M)
    if missing:
        parts.append("NOT IMPORTABLE: " + ", ".join(missing))
    return "; ".join(parts)


def first_step_line(report: dict | None) -> str:
    if not report:
        return "first step: no first_step.json"
    v = report.get("versions", {})
    head = (f"first step ({report.get('device_name', report.get('device', '?'))}; torch {v.get('torch')},"
            f" transformers {v.get('transformers')}, peft {v.get('peft')}): ")
    if "failed" in report:
        return head + f"FAILED at {report['failed']['part']}: {report['failed']['error'][:300]}"
    step, ev = report.get("step", {}), report.get("evaluation", {})
    return head + (f"ok, forward in {report.get('forward')}; step loss {_fmt(step.get('loss'), '.4f')},"
                   f" {step.get('tensors_moved')}/{step.get('tensors')} tensors moved; {ev.get('split')} accuracy"
                   f" {_fmt(ev.get('accuracy'))} on {ev.get('rows')} rows; seconds "
                   + ", ".join(f"{k} {t:.2f}" for k, t in report.get("parts", {}).items()))


def tests_line(text: str) -> str:
    if not text:
        return "not run"
    lines = [ln.strip("= ").strip() for ln in text.strip().splitlines() if ln.strip()]
    outcome = [ln for ln in lines if re.search(r"\b(passed|failed|skipped|error|errors|deselected|no tests ran)\b", ln)
               and re.search(r"\d", ln)]
    return outcome[-1] if outcome else (lines[-1] if lines else "no output")


def completion_line(res: dict, run_dir: Path) -> str:
    """Whether the run ended as planned: all its rounds (the learning-rate schedule spans them and
    sigma is calibrated for them), its eps spent as planned, its adapter saved."""
    rounds = len(res.get("rounds", []))
    planned = (res.get("config") or {}).get("num-server-rounds")
    spent = (res.get("privacy_final") or {}).get("epsilon_spent")
    priv = res.get("privacy") or {}
    target = priv.get("planned_epsilon", priv.get("epsilon"))
    adapter = Path(res.get("adapter_dir") or run_dir / "adapter")
    if not adapter.is_dir():
        adapter = run_dir / "adapter"  # the folder unpacked elsewhere
    saved = (adapter / "adapter_model.safetensors").is_file()
    checks = {"rounds": planned is not None and rounds == planned,
              "eps": spent is not None and target is not None and abs(spent - target) <= 1e-3 * max(1.0, target),
              "adapter": saved}
    ok = res.get("status") == "completed" and all(checks.values())
    return (f"{'complete' if ok else 'NOT COMPLETE'}: status {res.get('status')}; rounds {rounds}/{planned}"
            f" (the schedule {'ran to its end' if checks['rounds'] else 'did not end'}); eps spent"
            f" {_fmt(spent)} of {_fmt(target)} planned; adapter {'saved' if saved else 'NOT saved'}")


def run_lines(root: Path, plan: dict | None) -> list[str]:
    results = sorted(root.glob("runs/*/results.json"))
    if not results:
        return ["run: no results.json"]
    out = []
    for path in results:
        res = _json(path) or {}
        rounds = res.get("rounds", [])
        cfg = res.get("config", {})
        planned = cfg.get("num-server-rounds")
        last = rounds[-1] if rounds else {}
        wall = last.get("wall_seconds")
        per_round = None
        if len(rounds) >= 3 and rounds[0].get("wall_seconds") is not None and wall is not None:
            per_round = (wall - rounds[0]["wall_seconds"]) / (len(rounds) - 1)
        epochs = None
        if plan and plan.get("epochs_per_round"):
            epochs = len(rounds) * plan["epochs_per_round"]
        pf = res.get("privacy_final") or {}
        sigma = next((s.get("sigma") for s in pf.get("silos", []) if s.get("sigma") is not None), None)
        out.append(f"run {path.parent.name}: {res.get('status')}, {len(rounds)}/{planned} rounds"
                   f" ({_fmt(epochs, '.1f')} epochs), {cfg.get('strategy.name')}, b {cfg.get('train.batch-size')},"
                   f" L {cfg.get('train.local-steps')}, sigma {_fmt(sigma, '.3f')}, device {cfg.get('device')}")
        out.append(f"    final round: validation {_fmt(last.get('validation-from-train-accuracy'))}, dev "
                   f"{_fmt(last.get('validation-accuracy'))}; eps "
                   f"{_fmt(pf.get('epsilon_spent', last.get('epsilon')), '.3f')}; wall {_fmt(wall, '.0f')} s,"
                   f" {_fmt(per_round, '.2f')} s a round after the first")
        out.append("    " + completion_line(res, path.parent))
        if res.get("status") not in ("completed", None) and res.get("error"):
            out.append(f"    error: {str(res.get('error'))[:300]}")
        curve = [(r.get("server_round"), r.get("validation-accuracy")) for r in rounds
                 if r.get("validation-accuracy") is not None]
        if curve:
            step = max(1, len(curve) // 10)
            shown = curve[::step] + ([curve[-1]] if (len(curve) - 1) % step else [])
            out.append("    dev by round: " + ", ".join(f"{k}: {v:.3f}" for k, v in shown))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder")
    ap.add_argument("--budget", type=float, default=None)
    ap.add_argument("--elapsed", type=float, default=None)
    a = ap.parse_args(argv)
    root = Path(a.folder)
    lines = ["=" * 100, "GPU session summary" + (f" (budget {a.budget:.0f} s, elapsed {a.elapsed:.0f} s)"
                                                 if a.budget is not None and a.elapsed is not None else "")]
    lines.append("environment: " + environment_line(_read(root / "environment.log")))
    lines.append(first_step_line(_json(root / "first_step.json")))
    lines.append('tests (pytest -m "gpu and not slow" tests/test_gpu.py): ' + tests_line(_read(root / "tests.log")))

    probe = _json(root / "probe.json")
    if probe:
        lines.append(f"probe ({probe['device_name']}, {probe.get('forward', probe['precision'])}; silo of {probe['silo_rows']} rows; "
                     f"FLOPs = {probe['flop_formula']}, {probe['params_touched']:,} parameters):")
        lines.append(f"    {'b':>6} {'chunk':>6} {'steps/s':>9} {'examples/s':>11} {'TFLOP/s':>9} {'% of peak':>10}")
        for c in probe["cases"]:
            lines.append(f"    {c['batch']:>6} {c['chunk']:>6} {c['steps_per_s']:>9.2f} {c['examples_per_s']:>11.0f}"
                         f" {c['model_tflops']:>9.2f} {100 * c['peak_share']:>9.2f}%")
        busy = probe.get("profile_device_busy_s")
        if "profile_step_wall_s" in probe:
            lines.append(f"    one step under the profiler: {1e3 * probe['profile_step_wall_s']:.0f} ms wall"
                         + (f", device busy {1e3 * busy:.0f} ms" if busy is not None else "")
                         + "; top ops: " + "; ".join(f"{r['op'][:40]} {r['self_device_ms'] or r['self_cpu_ms']:.1f} ms"
                                                     for r in probe.get("profile_top", [])[:4]))
        else:
            lines.append(f"    no profile ({probe.get('profile_error', 'the probe stopped before it')})")
        r = probe["round_estimate"]
        products = next((c["chunk"] for c in probe["cases"] if c.get("chunk_is_products") and c["batch"] == r["batch"]), "?")
        lines.append(f"    cache {probe['cache_seconds']:.1f} s a silo; evaluation {probe['eval_seconds']:.2f} s;"
                     f" a round ~{r['seconds']:.2f} s in the product's chunks of {products} ({r['epochs_per_round']:.3f} epochs)")
    else:
        lines.append("probe: no probe.json")
    plan = _json(root / "run_plan.json")
    if plan:
        lines.append(f"run plan: {plan.get('rounds')} rounds in chunks of {plan.get('chunk')} ({plan.get('reason')}; "
                     f"{_fmt(plan.get('seconds_available'), '.0f')} s left, ~{_fmt(plan.get('seconds_per_round'), '.2f')} s a round"
                     f" planned, {_fmt(plan.get('expected_seconds'), '.0f')} s in all, {_fmt(plan.get('epochs'), '.1f')} epochs)")
    lines += run_lines(root, plan)
    lines.append('slow tests (pytest -m "gpu and slow" tests/test_gpu.py): ' + tests_line(_read(root / "slow_tests.log")))
    stages = _read(root / "stages.tsv").strip().splitlines()[1:]
    if stages:
        lines.append("stages (rc, seconds, limit): " + "; ".join(
            "{} {} {}s/{}".format(*(s.split("\t") + ["", "", "", ""])[:4]) for s in stages))
    lines.append("=" * 100)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
