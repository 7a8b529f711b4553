"""Target 6: one silo's DP-SGD round (``fedpower_app.training.dp_sgd.dp_sgd_train_local``: Opacus
per-example gradients, per-example clipping, noise) against the non-private round
(``fedpower_app.training.train_local``) on the same Poisson batches.

Both use the same model object, initial adapters, sampling generator (so the same batches) and
dropout seed; the trainable set is the default run's (LoRA A and B and the head). Time per step is
the median of interleaved repeats. Peak memory is the rise of the process' peak RSS over the RSS
before each case (Linux ``clear_refs``), measured once per case after a warm-up; on CUDA it is
``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import torch

from .common import Row, current_rss_bytes, interleaved, median, peak_rss_bytes, reset_peak_rss


def _peak_rise(fn, device) -> int | None:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated() - base)
    if not reset_peak_rss():
        return None
    base = current_rss_bytes()
    fn()
    return peak_rss_bytes() - base


def run(*, device, steps: int = 5, repeats: int = 5, batch_size: int = 0, log=print) -> tuple[list[Row], dict]:
    from fedpower_app import data as D
    from fedpower_app import model as M
    from fedpower_app.config import parse_config
    from fedpower_app.training.dp_sgd import DPSGDParams, dp_sgd_train_local
    from fedpower_app.training import train_local

    dev = "cuda" if device.type == "cuda" else "cpu"
    cfg = parse_config({"device": dev})
    task = D.load_task(cfg)
    model = M.build_model(cfg, task.num_labels, device=device)
    shard = D.client_shard(cfg, M.load_tokenizer(cfg["model.name"]), 0, 6)
    init = M.adapter_state(model)
    bs = batch_size or cfg["train.batch-size"]
    params = DPSGDParams(noise_multiplier=1.0, clip=cfg["dp.clip"], batch_size=bs, local_steps=steps)
    lr, seed = cfg["train.lr"], 1234
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log(f"[dp-sgd] {steps} steps, Poisson batch {bs} of {len(shard)} examples, {trainable} trainable parameters "
        f"(LoRA r={cfg['lora.rank']}{' + head' if cfg['model.train-head'] else ''}), {repeats} interleaved repeats")

    def plain():
        M.load_adapter_state(model, init)
        train_local(model, shard, steps=steps, batch_size=bs, lr=lr, generator=torch.Generator().manual_seed(seed),
                    poisson=True, device=device, dropout_seed=0)

    def dp_sgd():
        M.load_adapter_state(model, init)
        dp_sgd_train_local(model, shard, params=params, lr=lr, sampling_generator=torch.Generator().manual_seed(seed),
                           noise_generator=torch.Generator(device=device).manual_seed(1), device=device, dropout_seed=0)

    dp_sgd()  # builds the per-process Opacus wrapper (once, as in a silo)
    plain()
    memory = {"plain": _peak_rise(plain, device), "dp_sgd": _peak_rise(dp_sgd, device)}
    times = interleaved({"plain": plain, "dp_sgd": dp_sgd}, repeats=repeats, device=device)
    per_step = {k: median(v) / steps for k, v in times.items()}
    ratio = per_step["dp_sgd"] / per_step["plain"]
    mem_note = ", ".join(f"{k} +{v / 1e6:.0f} MB" for k, v in memory.items() if v is not None) or "n/a"
    rows = [Row("6", f"silo DP-SGD step, MiniLM, batch {bs}", "train_local (non-private)", "dp_sgd_train_local",
                per_step["plain"], per_step["dp_sgd"], ratio, "time ratio", "<= 1.30", ratio <= 1.30,
                note=f"per step; peak memory rise {mem_note}")]
    data = {"steps": steps, "repeats": repeats, "batch_size": bs, "per_step_seconds": per_step,
            "all_seconds": times, "peak_memory_rise_bytes": memory, "trainable_parameters": trainable}
    return rows, data
