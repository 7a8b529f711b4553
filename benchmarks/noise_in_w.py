"""Where client-level noise goes: the noise each method's release puts into the merged weights W = B·A.

A diagnostic for issue #14 (not a speed target). It calibrates a run config with the product's
accountant (``build_privacy``: z, and each round type's per-block stds), then calls each method's
own client-level release (``strategies.mechanisms``) on an empty round, so that the release is the
public global plus noise only, and measures per LoRA module ||B'A' - B_g A_g||_F, the noise norm
that reaches W in one round. The signal is the same for every method (the clipped deltas averaged
over m), so these norms compare the methods' signal-to-noise directly.

The global is PEFT's initial adapter (A kaiming-uniform, variance 1/(3n); B = 0), as in round 1,
or with ``--b-std`` a B with entries of that std (FedLoRA's noise on A enters W through B).

    python -m benchmarks.noise_in_w --preset conf/cross-device-sst2.toml --clients 1000 --draws 8
"""

from __future__ import annotations

import argparse
import math
import statistics


def measure(overrides: dict, clients: int, draws: int, b_std: float, modules: int, ffa_clip: float,
            seed: int = 0) -> list[dict]:
    import torch

    from fedpower_app.config import parse_config
    from fedpower_app.privacy import build_privacy
    from strategies import NoiseSource
    from strategies import mechanisms as MECH
    from strategies.aggregation import group_modules
    from strategies.releases import ReleaseContext

    methods = {  # the grid's cells (conf/grids/cross-device-sst2.toml), FFA-LoRA with its own clip
        "fedlora": {"strategy.name": "fedlora"},
        "ffa-lora": {"strategy.name": "ffa-lora", "dp.clip": ffa_clip},
        "fedpower": {"strategy.name": "fedpower", "strategy.client-refactorization": "powerdp-l"},
        "fedpower-powerdp": {"strategy.name": "fedpower", "strategy.client-refactorization": "powerdp"},
    }
    g = torch.Generator().manual_seed(seed)
    rows = []
    for method, ov in methods.items():
        cfg = parse_config({**overrides, **ov, "dp.level": "client"})
        d, r = 384, int(cfg["lora.rank"])  # MiniLM's q/v: 384 x 384
        shapes = {f"m{i}": (d, d, r) for i in range(modules)}
        if not rows:  # one global for every method
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
                     "z": privacy.describe()["calibration"]["z"], "epsilon": cfg["dp.epsilon"],
                     "noise_in_W": statistics.mean(norms), "sd": statistics.stdev(norms) if len(norms) > 1 else 0.0})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="conf/cross-device-sst2.toml")
    ap.add_argument("--clients", type=int, default=1000)
    ap.add_argument("--draws", type=int, default=8)
    ap.add_argument("--modules", type=int, default=2, help="LoRA modules per draw (each is one sample)")
    ap.add_argument("--b-std", type=float, default=0.0, help="std of the global B's entries (0: round 1)")
    ap.add_argument("--ffa-clip", type=float, default=20.0, help="FFA-LoRA's clip (the grid's method override)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    import torch

    from fedpower_app.config import load_preset, parse_config
    from fedpower_app.launcher import parse_set

    torch.set_num_threads(a.threads)
    ov = {**load_preset(a.preset), **parse_set(a.set)}
    cfg = parse_config({**ov, "dp.level": "client"})
    rows = measure(ov, a.clients, a.draws, a.b_std, a.modules, a.ffa_clip)
    ref = rows[0]["noise_in_W"]
    print(f"client level: delta {cfg['dp.delta']:g}, q_c {cfg['strategy.client-rate']:g}, N {a.clients}, "
          f"T {cfg['num-server-rounds']}, global B std {a.b_std:g}; {a.draws} draws x {a.modules} modules")
    print("| method | round type | ε | z | clip | noise std per block | noise norm in W per module (± sd) | vs FedLoRA |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        stds = ", ".join(f"{s:.4g}" for s in row["stds"])
        print(f"| {row['method']} | {row['round_type']} | {row['epsilon']:g} | {row['z']:.3f} | {row['clip']:g} | {stds} | "
              f"{row['noise_in_W']:.4g} ± {row['sd']:.2g} | {row['noise_in_W'] / ref:.2f}× |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
