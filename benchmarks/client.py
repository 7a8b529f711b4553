"""Target 5: client step throughput of ``fedpower_app.training.train_local`` vs a plain PEFT +
torch loop on identical batches (same model object, same initial adapters, same RNG seeds).

The plain loop gets the batches pre-built (the exact tensors ``train_local`` builds from the same
generator), so any per-step cost of ``train_local`` (batch indexing, trimming, loss sync,
autocast context) shows up in the ratio.
"""

from __future__ import annotations

import torch

from .common import Row, interleaved, median


def run(*, device, steps: int = 10, repeats: int = 7, log=print) -> tuple[list[Row], dict]:
    from fedpower_app import data as D
    from fedpower_app import model as M
    from fedpower_app.config import parse_config
    from fedpower_app.training import batch_indices, train_local

    dev = "cuda" if device.type == "cuda" else "cpu"
    cfg = parse_config({"device": dev})
    task = D.load_task(cfg)
    model = M.build_model(cfg, task.num_labels).to(device)  # a private model, not the process cache
    tok = M.load_tokenizer(cfg["model.name"])
    shard = D.client_shard(cfg, tok, 0, 6)
    init = M.adapter_state(model)
    bs, lr, poisson = cfg["train.batch-size"], cfg["train.lr"], cfg["dp.level"] == "sample"
    seed = 1234
    idxs = batch_indices(len(shard), bs, steps, torch.Generator().manual_seed(seed), poisson)
    batches = [shard.batch(i, device) for i in idxs if len(i)]
    log(f"[client] {steps} local steps, batch {bs} ({'Poisson' if poisson else 'fixed'}), MiniLM + LoRA r={cfg['lora.rank']}, "
        f"{repeats} interleaved repeats")

    def fedpower_loop():
        M.load_adapter_state(model, init)
        torch.manual_seed(0)  # dropout
        train_local(model, shard, steps=steps, batch_size=bs, lr=lr, generator=torch.Generator().manual_seed(seed),
                    poisson=poisson, device=device)

    def plain_loop():
        M.load_adapter_state(model, init)
        torch.manual_seed(0)
        model.train()
        opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
        for b in batches:
            opt.zero_grad(set_to_none=True)
            loss = model(**b).loss
            loss.backward()
            opt.step()

    # Same batches and seeds -> the same adapters after training (checks "identical batches").
    fedpower_loop()
    a = M.adapter_state(model)
    plain_loop()
    b = M.adapter_state(model)
    same = all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    times = interleaved({"plain": plain_loop, "train_local": fedpower_loop}, repeats=repeats, device=device)
    per_step = {k: median(v) / steps for k, v in times.items()}
    ratio = per_step["train_local"] / per_step["plain"]
    rows = [Row("5", f"client step, MiniLM, batch {bs}", "plain PEFT+torch loop", "fedpower train_local",
                per_step["plain"], per_step["train_local"], ratio, "time ratio", "<= 1.10", ratio <= 1.10,
                note=f"per step; identical resulting adapters: {same}")]
    data = {"steps": steps, "repeats": repeats, "batch_size": bs, "poisson": poisson, "per_step_seconds": per_step,
            "all_seconds": times, "identical_adapters": same, "examples_per_step": [len(i) for i in idxs]}
    return rows, data
