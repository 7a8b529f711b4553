"""Where client-level noise goes: the noise each method's release puts into the merged weights W = B·A.

A client-level DP diagnostic (not a speed target). It calibrates a run config with the product's
accountant (``build_privacy``: z, and each round type's per-block stds), then calls each method's
own client-level release (``strategies.mechanisms``) on an empty round, so that the release is the
public global plus noise only, and measures per LoRA module ||B'A' - B_g A_g||_F, the noise norm
that reaches W in one round. The signal is the same for every method (the clipped deltas averaged
over m), so these norms compare the methods' signal-to-noise directly.

The global is PEFT's initial adapter (A kaiming-uniform, variance 1/(3n); B = 0), as in round 1,
or with ``--b-std`` a B with entries of that std (FedLoRA's noise on A enters W through B).

    python -m research.noise_in_w --grid conf/grids/cross-device-sst2.toml      # the grid's cells
    python -m research.noise_in_w --preset conf/cross-device-sst2.toml --set dp.clip=2.0  # one setting for all
"""

from __future__ import annotations

import argparse
import math
import statistics


def method_configs(preset: str, *, grid: str | None = None, epsilon: float = 8.0, extra: dict | None = None) -> dict:
    """Each method's run config at client level: the grid's cell at ``epsilon`` (its preset and
    per-method overrides, ``fedpower_app.experiment.cell_overrides``), or the preset alone; ``extra``
    (--set) last."""
    from fedpower_app import experiment as X
    from fedpower_app.config import load_preset

    methods = ("fedlora", "ffa-lora", "fedpower", "fedpower-powerdp")
    if grid is None:
        base = {**load_preset(preset), **(extra or {}), "dp.level": "client", "dp.epsilon": float(epsilon)}
        return {m: {**base, **X.method_overrides(m)} for m in methods}
    spec, out = X.build_spec(X.make_parser().parse_args(["--grid", grid, "--epsilons", str(epsilon)]))
    configs = {m: {**X.cell_overrides(spec, X.Cell(spec.tasks[0], m, float(epsilon), 0), out), **(extra or {})}
               for m in methods}
    for m, ov in configs.items():
        if ov.get("dp.level") != "client":
            raise SystemExit(f"{grid}: the {m} cell runs at dp.level = {ov.get('dp.level')!r}; this measures "
                             "client-level releases (dp.level = \"client\")")
    return configs


def measure(configs: dict, clients: int, draws: int, b_std: float, modules: int, seed: int = 0) -> list[dict]:
    """Per method (name -> run-config overrides): one empty client-level round's noise in W."""
    import torch

    from fedpower_app.config import parse_config
    from fedpower_app.privacy import build_privacy
    from strategies import NoiseSource
    from strategies import mechanisms as MECH
    from strategies.aggregation import group_modules
    from strategies.releases import ReleaseContext

    rows = []
    for method, ov in configs.items():
        cfg = parse_config(ov)
        d, r = 384, int(cfg["lora.rank"])  # MiniLM's q/v: 384 x 384
        shapes = {f"m{i}": (d, d, r) for i in range(modules)}
        g = torch.Generator().manual_seed(seed)  # the same global for every method (of its rank)
        bound = 1.0 / math.sqrt(d)  # PEFT: kaiming_uniform_(a=sqrt(5)) on (r, n) is U(-1/sqrt(n), 1/sqrt(n))
        A_g = {n: (torch.rand(r, d, generator=g, dtype=torch.float64) * 2 - 1) * bound for n in shapes}
        B_g = {n: torch.randn(d, r, generator=g, dtype=torch.float64) * b_std for n in shapes}
        privacy = build_privacy(cfg, client_sizes=[64] * clients, num_modules=modules)
        rt = MECH.round_type(cfg["strategy.name"], 1, level="client",
                             refactorization=cfg["strategy.client-refactorization"])
        stds = privacy.noise_stds(rt, 0)  # client level: the stds do not depend on the replies
        ctx = ReleaseContext(groups=group_modules(shapes), extra_shapes={}, clip=float(cfg["dp.clip"]), rank=r,
                             power_iters=int(cfg["strategy.power-iters"]), noise=NoiseSource(seed),
                             dtype=torch.float64)
        mech = MECH.get(rt)
        norms = []
        for k in range(draws):
            rel = mech.release([], ctx, stds, torch.Generator().manual_seed(1000 + k),
                               MECH.ReleaseArgs(glob=(A_g, B_g), denominator=privacy.plan.denominator))
            for n in shapes:
                B, A = rel.B.get(n, B_g[n]), rel.A.get(n, A_g[n])
                norms.append(float((B @ A - B_g[n] @ A_g[n]).norm()))
        rows.append({"method": method, "round_type": rt, "clip": float(cfg["dp.clip"]), "stds": stds,
                     "iters": int(cfg["strategy.power-iters"]), "z": privacy.describe()["calibration"]["z"],
                     "epsilon": cfg["dp.epsilon"], "noise_in_W": statistics.mean(norms),
                     "sd": statistics.stdev(norms) if len(norms) > 1 else 0.0})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--grid", help="take each method's settings from this grid file's eps cells")
    ap.add_argument("--preset", default="conf/cross-device-sst2.toml", help="without --grid: the preset")
    ap.add_argument("--epsilon", type=float, default=8.0)
    ap.add_argument("--clients", type=int, help="N (default: the grid's supernodes, else 1000)")
    ap.add_argument("--draws", type=int, default=8)
    ap.add_argument("--modules", type=int, default=2, help="LoRA modules per draw (each is one sample)")
    ap.add_argument("--b-std", type=float, default=0.0, help="std of the global B's entries (0: round 1)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    import torch

    from fedpower_app.launcher import parse_set

    torch.set_num_threads(a.threads)
    configs = method_configs(a.preset, grid=a.grid, epsilon=a.epsilon, extra=parse_set(a.set))
    if a.clients is None:
        from fedpower_app import experiment as X

        a.clients = X.build_spec(X.make_parser().parse_args(["--grid", a.grid]))[0].supernodes if a.grid else 1000
    rows = measure(configs, a.clients, a.draws, a.b_std, a.modules)
    ref = rows[0]["noise_in_W"]
    print(f"client level, {a.grid or a.preset}: N {a.clients}, global B std {a.b_std:g}; "
          f"{a.draws} draws x {a.modules} modules of 384 x 384")
    print("| method | round type | ε | z | clip | power iters | noise std per block | noise norm in W per module (± sd) | vs FedLoRA |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        stds = ", ".join(f"{s:.4g}" for s in row["stds"])
        print(f"| {row['method']} | {row['round_type']} | {row['epsilon']:g} | {row['z']:.3f} | {row['clip']:g} | "
              f"{row['iters']} | {stds} | {row['noise_in_W']:.4g} ± {row['sd']:.2g} | {row['noise_in_W'] / ref:.2f}× |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
