"""How much of a clipped client delta survives averaging (client-level DP diagnostic, not a target).

K clients each train one round from the same initial adapters (the product's ``train_local`` on
their own shard of N partitions). With all deltas clipped to the same norm, the average's norm is
C·a with a = ||mean_i d_i/||d_i|| ||; the noise on the average is z·C/m per entry whatever the
deltas. So a, against z·sqrt(d)/m, says whether a cohort's signal can beat its noise. Also
prints the mean pairwise cosine (a^2 ~ cos + (1 - cos)/K).

    python -m research.client_delta_alignment --data-dir /path/to/glue/SST-2 --clients 1000 -K 16 \\
        --variant adam:0.003:4:16 --variant sgd:100:1:64 [--set lora.rank=2]

Each ``--variant`` is optimizer:lr:local-steps:batch-size. Starts from conf/cross-device-sst2.toml.
"""

from __future__ import annotations

import argparse
import time


def alignment(cfg, num_partitions: int, k: int, optimizer: str, lr: float, steps: int, batch_size: int) -> dict:
    import torch

    from fedpower_app import data as D
    from fedpower_app import model as M
    from fedpower_app.training import train_local

    task = D.load_task(cfg)
    model = M.build_model(cfg, task.num_labels)
    tokenizer = M.load_tokenizer(cfg["model.name"])
    init = {name: t.clone() for name, t in M.adapter_state(model).items()}
    deltas, shard_sizes = [], []
    for pid in range(k):
        M.load_adapter_state(model, init)
        shard = D.client_shard(cfg, tokenizer, pid, num_partitions)
        shard_sizes.append(len(shard))
        train_local(model, shard, steps=steps, batch_size=batch_size, lr=lr,
                    generator=torch.Generator().manual_seed(pid), poisson=False,
                    device=torch.device("cpu"), optimizer=optimizer)
        state = M.adapter_state(model)
        deltas.append(torch.cat([(state[n] - init[n]).flatten().double() for n in sorted(state)]))
    d = torch.stack(deltas)
    norms = d.norm(dim=1)
    units = d / norms[:, None]
    off_diag = ~torch.eye(k, dtype=torch.bool)
    return {"d": d.shape[1], "shard_mean": sum(shard_sizes) / k, "norm_mean": float(norms.mean()),
            "a": float(units.mean(0).norm()), "cos": float((units @ units.T)[off_diag].mean())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--clients", type=int, default=1000, help="N partitions of the train split")
    ap.add_argument("-K", type=int, default=16, help="clients to train")
    ap.add_argument("--variant", action="append", required=True, metavar="OPT:LR:STEPS:BATCH")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    import torch

    from fedpower_app.config import load_preset, parse_config
    from fedpower_app.launcher import parse_set

    torch.set_num_threads(a.threads)
    over = {**load_preset("conf/cross-device-sst2.toml"), "task.data-dir": a.data_dir, **parse_set(a.set)}
    cfg = parse_config(over)
    for spec in a.variant:
        try:
            opt, lr, steps, bs = spec.split(":")
            lr, steps, bs = float(lr), int(steps), int(bs)
        except ValueError:
            ap.error(f"--variant {spec!r}: expected optimizer:lr:steps:batch, e.g. adam:0.003:4:16")
        t0 = time.time()
        r = alignment(cfg, a.clients, a.K, opt, lr, steps, bs)
        print(f"{spec} (N {a.clients}, K {a.K}, rank {cfg['lora.rank']}): d = {r['d']}, shard ~{r['shard_mean']:.0f}, "
              f"mean ||delta|| {r['norm_mean']:.3f}, a = {r['a']:.3f} (1/sqrt(K) = {a.K ** -0.5:.3f}), "
              f"mean pairwise cosine {r['cos']:.3f} ({time.time() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
