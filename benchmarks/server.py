"""Targets 1 and 2: server aggregation math (pure torch, no Flower).

* factored vs dense FedPower release on the same inputs and generator state (outputs compared);
* FedPower (factored) vs FedLoRA release time;
* server peak memory of one release, measured in a fresh subprocess per case, against the bytes
  of the received adapters (K clients x sum_j (m + n) r x 4 bytes).

Run alone: ``python -m benchmarks.server [--large]``; a memory case:
``python -m benchmarks.server --mem fedpower-factored --shape llama-2-7b --modules 128``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
from dataclasses import dataclass

from .common import (
    Row,
    current_rss_bytes,
    interleaved,
    median,
    peak_rss_bytes,
    reset_peak_rss,
    resolve_device,
    run_json_subprocess,
)


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    modules: tuple[str, ...]
    m: int
    n: int
    r: int

    @property
    def total_modules(self) -> int:
        return self.layers * len(self.modules)

    def names(self, count: int | None = None) -> list[str]:
        names = [f"layers.{i:02d}.{mod}" for i in range(self.layers) for mod in self.modules]
        return names[: count or len(names)]


SHAPES = {
    "roberta-large": Shape("roberta-large", 24, ("query", "value"), 1024, 1024, 8),
    "llama-2-7b": Shape("llama-2-7b", 32, ("q_proj", "k_proj", "v_proj", "o_proj"), 4096, 4096, 16),
}
CLIENTS = 3
POWER_ITERS = 2  # strategy.power-iters default
CLIP = 2.0
NOISE_STD = 1e-3


def make_updates(shape: Shape, modules: int, clients: int = CLIENTS, seed: int = 0):
    """K clients' LoRA factors with LoRA-like scales (A ~ kaiming-ish, B small)."""
    import torch

    from strategies import AdapterUpdate, group_modules

    g = torch.Generator().manual_seed(seed)
    names = shape.names(modules)
    ups = []
    for _ in range(clients):
        A = {nm: torch.randn(shape.r, shape.n, generator=g).mul_(1.0 / math.sqrt(shape.n)) for nm in names}
        B = {nm: torch.randn(shape.m, shape.r, generator=g).mul_(0.02) for nm in names}
        ups.append(AdapterUpdate(A=A, B=B))
    groups = group_modules({nm: (shape.m, shape.n, shape.r) for nm in names})
    return ups, groups


def adapter_bytes(shape: Shape, modules: int, clients: int = CLIENTS) -> int:
    return clients * modules * (shape.m + shape.n) * shape.r * 4


def make_ctx(groups, shape: Shape, *, factored: bool, device):
    from strategies import ReleaseContext

    return ReleaseContext(groups=groups, extra_shapes={}, clip=CLIP, rank=shape.r, power_iters=POWER_ITERS,
                          factored=factored, device=device)


def gen(device, seed: int = 1234):
    import torch

    return torch.Generator(device=device).manual_seed(seed)


def case_fns(ups, groups, shape: Shape, device) -> dict:
    """Callables of every server release variant on the same inputs and generator seed."""
    from strategies import dense_clipped_average, fedlora_release, fedpower_release
    from strategies.powerdp import powerdp

    ctx_f = make_ctx(groups, shape, factored=True, device=device)
    ctx_d = make_ctx(groups, shape, factored=False, device=device)

    def naive_dense():
        # What a server without the factored trick does: materialise every client's B_i A_i,
        # clip on the dense norms, average, then PowerDP on the dense average.
        moved = [type(u)(A={k: v.to(device) for k, v in u.A.items()}, B={k: v.to(device) for k, v in u.B.items()})
                 for u in ups]
        avgs, _ = dense_clipped_average(moved, groups, CLIP)
        g = gen(device)
        return [powerdp(W, rank=shape.r, iters=POWER_ITERS, noise_std=NOISE_STD, generator=g) for W in avgs]

    return {
        "fedpower-factored": lambda: fedpower_release(ups, ctx_f, NOISE_STD, gen(device)),
        "fedpower-dense": lambda: fedpower_release(ups, ctx_d, NOISE_STD, gen(device)),
        "fedpower-naive-dense": naive_dense,
        "fedlora": lambda: fedlora_release(ups, ctx_f, NOISE_STD, NOISE_STD, gen(device)),
    }


def compare_releases(a, b) -> dict:
    """Relative max-abs difference of the released factors (same generator state)."""
    rel_b = max(float((a.B[k] - b.B[k]).abs().max() / b.B[k].abs().max().clamp_min(1e-30)) for k in a.B)
    rel_a = max(float((a.A[k] - b.A[k]).abs().max() / b.A[k].abs().max().clamp_min(1e-30)) for k in a.A)
    return {"max_rel_diff_B": rel_b, "max_rel_diff_A": rel_a, "equal_within_1e-3": bool(max(rel_a, rel_b) < 1e-3)}


# ----------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------
def time_cases(shape: Shape, modules: int, names: list[str], repeats: int, device, log) -> dict:
    import torch

    ups, groups = make_updates(shape, modules)
    fns = case_fns(ups, groups, shape, device)
    res: dict = {"shape": shape.name, "modules": modules, "clients": CLIENTS, "rank": shape.r, "m": shape.m,
                 "n": shape.n, "adapter_bytes": adapter_bytes(shape, modules), "repeats": repeats}
    if "fedpower-factored" in names and "fedpower-dense" in names:
        fac = fns["fedpower-factored"]()
        res["equality"] = compare_releases(fac, fns["fedpower-dense"]())
        if "fedpower-naive-dense" in names and len(groups) == 1:
            B_n, A_n = fns["fedpower-naive-dense"]()[0]
            g = groups[0]
            naive = type(fac)(A={nm: A_n[j] for j, nm in enumerate(g.names)}, B={nm: B_n[j] for j, nm in enumerate(g.names)})
            res["equality_naive"] = compare_releases(fac, naive)
        del fac
    log(f"  {shape.name}: {modules} modules x {CLIENTS} clients, timing {', '.join(names)} ({repeats} repeats, interleaved)")
    times = interleaved({k: fns[k] for k in names}, repeats=repeats, device=device)
    res["seconds"] = {k: median(v) for k, v in times.items()}
    res["all_seconds"] = times
    del ups, fns
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res


# ----------------------------------------------------------------------------------------------
# Peak memory (one fresh process per case)
# ----------------------------------------------------------------------------------------------
def memory_case(case: str, shape_name: str, modules: int, device_name: str) -> dict:
    """Run in a fresh process: peak memory of one release above the post-import baseline."""
    import torch

    device = resolve_device(device_name)
    shape = SHAPES[shape_name]
    # Warm up torch/BLAS/LAPACK on tiny inputs so their one-time allocations are in the baseline.
    tiny_ups, tiny_groups = make_updates(Shape("tiny", 1, ("q",), 64, 64, 4), 1)
    case_fns(tiny_ups, tiny_groups, Shape("tiny", 1, ("q",), 64, 64, 4), device)[case]()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base_dev = torch.cuda.memory_allocated()
    base = current_rss_bytes()
    reset_ok = reset_peak_rss()
    ups, groups = make_updates(shape, modules)
    if device.type == "cuda":  # the received adapters live on the device for a GPU server
        ups = [type(u)(A={k: v.to(device) for k, v in u.A.items()}, B={k: v.to(device) for k, v in u.B.items()})
               for u in ups]
    after_inputs = current_rss_bytes()
    out = case_fns(ups, groups, shape, device)[case]()
    if device.type == "cuda":
        torch.cuda.synchronize()
    peak = peak_rss_bytes()
    res = {
        "case": case, "shape": shape_name, "modules": modules, "device": str(device),
        "adapter_bytes": adapter_bytes(shape, modules),
        "baseline_rss": base, "inputs_rss_delta": after_inputs - base,
        "peak_rss_delta": peak - base, "peak_reset_ok": reset_ok,
    }
    if device.type == "cuda":
        res["peak_device_delta"] = torch.cuda.max_memory_allocated() - base_dev
    res["peak_over_adapters"] = (res.get("peak_device_delta") or res["peak_rss_delta"]) / res["adapter_bytes"]
    del out
    return res


def measure_memory(case: str, shape: Shape, modules: int, device) -> dict:
    return run_json_subprocess(["benchmarks.server", "--mem", case, "--shape", shape.name, "--modules", str(modules),
                                "--device", str(device)])


# ----------------------------------------------------------------------------------------------
# Suite
# ----------------------------------------------------------------------------------------------
def run(*, large: bool, device, repeats: int, log=print) -> tuple[list[Row], dict]:
    rob, llama = SHAPES["roberta-large"], SHAPES["llama-2-7b"]
    dense_subset = 8 if large else 4
    data: dict = {"clients": CLIENTS, "power_iters": POWER_ITERS, "clip": CLIP, "noise_std": NOISE_STD}
    rows: list[Row] = []

    log("[server] target 1: factored vs dense FedPower release")
    r1 = time_cases(rob, rob.total_modules, ["fedpower-dense", "fedpower-factored", "fedpower-naive-dense"], repeats, device, log)
    data["roberta_full"] = r1
    s = r1["seconds"]
    def _diff(r, key="equality"):
        e = r.get(key) or {}
        return max(e.get("max_rel_diff_A", float("nan")), e.get("max_rel_diff_B", float("nan")))

    for r, shape, label, goal, thr in (
        (r1, rob, f"{rob.name}: {rob.total_modules} x {rob.m}x{rob.n}, r={rob.r}, {CLIENTS} clients", ">= 10x", 10),
    ):
        s = r["seconds"]
        rows.append(Row("1", label, "dense A: paper as written (B_i A_i per client, dense clip, dense PowerDP)",
                        "factored release", s["fedpower-naive-dense"], s["fedpower-factored"],
                        s["fedpower-naive-dense"] / s["fedpower-factored"], "speed-up", goal,
                        s["fedpower-naive-dense"] / s["fedpower-factored"] >= thr,
                        note=f"outputs max rel. diff {_diff(r, 'equality_naive'):.1e}"))
        rows.append(Row("1", label, "dense B: library factored=False (factored norms, one W per module)",
                        "factored release", s["fedpower-dense"], s["fedpower-factored"],
                        s["fedpower-dense"] / s["fedpower-factored"], "speed-up", goal,
                        s["fedpower-dense"] / s["fedpower-factored"] >= thr,
                        note=f"outputs max rel. diff {_diff(r):.1e}"))

    r2 = time_cases(llama, dense_subset, ["fedpower-dense", "fedpower-factored", "fedpower-naive-dense"],
                    max(3, repeats - 2), device, log)
    data["llama_subset"] = r2
    s2 = r2["seconds"]
    label = f"{llama.name}: SUBSET {dense_subset} of {llama.total_modules} x {llama.m}x{llama.n}, r={llama.r} (measured)"
    for key, base, eq in (("fedpower-naive-dense", "dense A: paper as written", "equality_naive"),
                          ("fedpower-dense", "dense B: library factored=False", "equality")):
        rows.append(Row("1", label, base, "factored release", s2[key], s2["fedpower-factored"],
                        s2[key] / s2["fedpower-factored"], "speed-up", ">= 100x", s2[key] / s2["fedpower-factored"] >= 100,
                        note=f"outputs max rel. diff {_diff(r2, eq):.1e}"))

    log("[server] target 2: FedPower (factored) vs FedLoRA release, all modules")
    r3 = time_cases(rob, rob.total_modules, ["fedlora", "fedpower-factored"], repeats, device, log)
    r4 = time_cases(llama, llama.total_modules, ["fedlora", "fedpower-factored"], repeats, device, log)
    data["roberta_vs_fedlora"], data["llama_full_vs_fedlora"] = r3, r4
    for r, shape in ((r3, rob), (r4, llama)):
        s = r["seconds"]
        ratio = s["fedpower-factored"] / s["fedlora"]
        rows.append(Row("2", f"{shape.name}: all {shape.total_modules} modules", "FedLoRA release", "FedPower release",
                        s["fedlora"], s["fedpower-factored"], ratio, "slow-down", "<= 3x", ratio <= 3))

    # Extrapolated full-Llama dense time: per-module cost of the measured subset x 128 (labelled).
    fac_full = r4["seconds"]["fedpower-factored"]
    for key, base in (("fedpower-naive-dense", "dense A (EXTRAPOLATED)"), ("fedpower-dense", "dense B (EXTRAPOLATED)")):
        est = s2[key] * llama.total_modules / dense_subset
        rows.append(Row("1", f"{llama.name}: all {llama.total_modules} modules", base, "factored release (measured, 128 modules)",
                        est, fac_full, est / fac_full, "speed-up", ">= 100x", est / fac_full >= 100,
                        note=f"dense = {dense_subset}-module median x {llama.total_modules}/{dense_subset} (linear in modules); "
                             f"dense W alone would be {llama.total_modules * llama.m * llama.n * 4 / 2**30:.1f} GiB"))

    log("[server] peak memory (fresh subprocess per case)")
    mem = {}
    for case, shape, mods in (("fedpower-factored", rob, rob.total_modules), ("fedpower-dense", rob, rob.total_modules),
                              ("fedpower-factored", llama, llama.total_modules), ("fedpower-dense", llama, dense_subset),
                              ("fedlora", llama, llama.total_modules)):
        key = f"{case}/{shape.name}/{mods}"
        try:
            mem[key] = measure_memory(case, shape, mods, device)
            log(f"  {key}: peak {mem[key]['peak_rss_delta'] / 2**20:.0f} MiB above baseline = "
                f"{mem[key]['peak_over_adapters']:.2f}x the received adapters ({mem[key]['adapter_bytes'] / 2**20:.0f} MiB)")
        except Exception as exc:  # report, do not abort the suite
            mem[key] = {"error": str(exc)[-500:]}
            log(f"  {key}: FAILED {exc}")
    data["memory"] = mem
    m_fac = mem.get(f"fedpower-factored/{llama.name}/{llama.total_modules}", {})
    if "peak_over_adapters" in m_fac:
        m_den = mem.get(f"fedpower-dense/{llama.name}/{dense_subset}", {})
        rows.append(Row("1", f"{llama.name}: server peak memory, all {llama.total_modules} modules", "received adapters",
                        "peak during release", None, None, m_fac["peak_over_adapters"], "x adapter bytes", "<= 3x",
                        m_fac["peak_over_adapters"] <= 3,
                        note=f"adapters {m_fac['adapter_bytes'] / 2**20:.0f} MiB, peak +{m_fac['peak_rss_delta'] / 2**20:.0f} MiB"
                             + (f"; dense on {dense_subset} modules: {m_den['peak_over_adapters']:.1f}x" if "peak_over_adapters" in m_den else "")))
    return rows, data


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mem", help="internal: measure the peak memory of one case in this process")
    p.add_argument("--shape", default="llama-2-7b", choices=sorted(SHAPES))
    p.add_argument("--modules", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--large", action="store_true")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    if args.mem:
        print(json.dumps(memory_case(args.mem, args.shape, args.modules or SHAPES[args.shape].total_modules, args.device)))
        return 0
    from .common import table

    rows, data = run(large=args.large, device=resolve_device(args.device), repeats=args.repeats)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
