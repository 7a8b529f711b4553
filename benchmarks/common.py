"""Shared helpers: device choice, interleaved timing, peak memory, machine description."""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def resolve_device(name: str = "auto"):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def synchronize(device) -> None:
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device) -> float:
    """Wall seconds of one call, with device synchronisation on both sides."""
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0


def interleaved(cases: dict[str, Callable[[], object]], *, repeats: int, device, warmup: int = 1) -> dict[str, list[float]]:
    """Time every case ``repeats`` times, alternating the order (ABAB, then BABA, ...).

    Background load on a shared machine hits all cases alike, so the ratio of medians is
    stable even when the absolute times are not.
    """
    names = list(cases)
    for _ in range(warmup):
        for name in names:
            cases[name]()
    out: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(repeats):
        order = names if rep % 2 == 0 else list(reversed(names))
        for name in order:
            out[name].append(timed(cases[name], device))
    return out


def median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (VmHWM), bytes."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss_bytes() -> int:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: write 5 to /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def run_json_subprocess(args: list[str], *, timeout: float = 1800, env: dict | None = None) -> dict:
    """Run ``python -m <args>`` in a fresh process and parse the last stdout line as JSON."""
    proc = subprocess.run([sys.executable, "-m", *args], cwd=PROJECT_ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _lscpu() -> dict[str, str]:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    keep = ("Model name", "CPU(s)", "Thread(s) per core", "Core(s) per socket", "L2 cache", "L3 cache",
            "Hypervisor vendor", "Flags")
    info = {}
    for line in out.splitlines():
        if ":" in line:
            k, v = line.split(":", 1)
            if k.strip() in keep:
                v = v.strip()
                if k.strip() == "Flags":
                    v = " ".join(f for f in v.split() if f in ("avx", "avx2", "avx512f", "fma", "amx_tile"))
                info[k.strip()] = v
    return info


def _mem_total() -> int:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def environment(device) -> dict:
    """Machine, versions and settings, written into the JSON next to the numbers."""
    import torch

    env = {
        "timestamp_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _lscpu(),
        "cpu_count": os.cpu_count(),
        "mem_total_gib": round(_mem_total() / 2**30, 1),
        "loadavg_at_start": list(os.getloadavg()),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "blas": "mkl" if torch.backends.mkl.is_available() else "other",
        "device": str(device),
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    for mod in ("flwr", "peft", "transformers", "ray"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:  # pragma: no cover - optional
            env[mod] = None
    return env


@dataclass
class Row:
    """One line of the summary table."""

    target: str
    what: str
    baseline: str
    candidate: str
    baseline_s: float | None
    candidate_s: float | None
    ratio: float | None  # as stated in ``ratio_is``
    ratio_is: str
    goal: str
    met: bool | None
    note: str = ""
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def fmt_s(x: float | None) -> str:
    if x is None or x != x:
        return "-"
    if x < 1e-3:
        return f"{x * 1e6:.0f} us"
    if x < 1:
        return f"{x * 1e3:.1f} ms"
    return f"{x:.2f} s"


def table(rows: list[Row]) -> str:
    head = ["target", "what", "baseline", "candidate", "base time", "cand time", "ratio", "goal", "met"]
    lines = [head]
    for r in rows:
        ratio = "-" if r.ratio is None else f"{r.ratio:.3g} ({r.ratio_is})"
        met = "-" if r.met is None else ("yes" if r.met else "NO")
        lines.append([r.target, r.what, r.baseline, r.candidate, fmt_s(r.baseline_s), fmt_s(r.candidate_s), ratio, r.goal, met])
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
    out = []
    for i, line in enumerate(lines):
        out.append(" | ".join(str(c).ljust(w) for c, w in zip(line, widths)))
        if i == 0:
            out.append("-+-".join("-" * w for w in widths))
    return "\n".join(out)


def markdown_table(rows: list[Row]) -> str:
    out = ["| target | what | baseline | candidate | baseline time | candidate time | ratio | goal | met |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = "-" if r.ratio is None else f"{r.ratio:.3g} ({r.ratio_is})"
        met = "-" if r.met is None else ("yes" if r.met else "**no**")
        out.append(f"| {r.target} | {r.what} | {r.baseline} | {r.candidate} | {fmt_s(r.baseline_s)} | "
                   f"{fmt_s(r.candidate_s)} | {ratio} | {r.goal} | {met} |")
    return "\n".join(out)


def silo_zero_setup(set_items, *, silos: int, threads: int):
    """(config, tokenizer, model, silo 0's shard) for the DP tuning diagnostics: the run's config
    with ``--set`` items, the production model with the strategy's trainable set (FFA-LoRA: B only)."""
    import torch

    from fedpower_app import model as M
    from fedpower_app.config import parse_config
    from fedpower_app.data import client_shard
    from fedpower_app.launcher import parse_set
    from strategies.engine import trained_lora_factors

    torch.set_num_threads(threads)
    cfg = parse_config(parse_set(set_items))
    tok = M.load_tokenizer(cfg["model.name"])
    model = M.build_model(cfg, 2)
    M.set_trainable(model, train_a="A" in trained_lora_factors(cfg["strategy.name"]), train_b=True)
    return cfg, tok, model, client_shard(cfg, tok, 0, silos)


def write_json(path: str, figures: dict) -> None:
    """A benchmark's figures to ``path`` (its ``--json``); nothing when ``path`` is empty."""
    if path:
        with open(path, "w") as f:
            json.dump(figures, f, indent=1)
