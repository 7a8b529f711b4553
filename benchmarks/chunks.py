"""Length-sorted physical chunks: one silo's DP-SGD round with the logical batch split shortest
rows first (``fedpower_app.training.physical_chunks``, what the product does) against the same
round with the chunks in sampled order (what it did before 2026-11-25).

Both call ``fedpower_app.training.dp_sgd.dp_sgd_train_local`` on the same model, initial adapters,
sampling generator (so the same Poisson batches), noise generator and dropout seed; the baseline
only swaps ``physical_chunks`` for a plain ``idx.split(size)``. The rows are a silo's shard of the
real task (SST-2 with ``--data-dir``; the generated task without it), padded as the product pads
(every chunk to its longest row). Time per step is the median of interleaved repeats. Also
reported: the padded tokens per step, which the sort is meant to cut, and the largest parameter
difference after the round with dropout off (the two orders give the same step up to float
summation order; with dropout on, other masks land on other examples, so two rounds differ like
two draws, and Adam's first steps, about lr * sign(g) per coordinate, make that visible).

    python -m benchmarks.chunks --data-dir /work/shared/glue/SST-2 [--batch-size 500] [--steps 2]
"""

from __future__ import annotations

import argparse
import sys

import torch

from .common import interleaved, median, write_json


def run(*, data_dir: str, batch_size: int, steps: int, repeats: int, log=print) -> dict:
    from fedpower_app import data as D
    from fedpower_app.training import dp_sgd as DPS
    from fedpower_app import model as M
    from fedpower_app.config import parse_config
    from fedpower_app.training import batch_indices, physical_batch_size_for

    overrides = {"train.batch-size": batch_size, "train.local-steps": steps}
    if data_dir:
        overrides.update({"task.name": "sst2", "task.data-dir": data_dir})
    cfg = parse_config(overrides)
    device = torch.device("cpu")
    chunk_size = physical_batch_size_for(device)  # what the product trains in on this device
    task = D.load_task(cfg)
    model = M.build_model(cfg, task.num_labels, device=device)
    shard = D.client_shard(cfg, M.load_tokenizer(cfg["model.name"]), 0, 6)
    init = M.adapter_state(model)
    params = DPS.DPSGDParams(noise_multiplier=0.5, clip=cfg["dp.clip"], batch_size=batch_size, local_steps=steps)
    seed = 1234
    sorted_chunks = DPS.physical_chunks

    def sampled_order(data, idx, size=chunk_size):  # the baseline: chunks in sampled order
        return list(idx.split(size))

    def padded_tokens(chunker) -> float:
        total = 0
        for idx in batch_indices(len(shard), batch_size, steps, torch.Generator().manual_seed(seed), True):
            for chunk in chunker(shard, idx, chunk_size):
                total += int(shard.attention_mask[chunk].sum(dim=1).max()) * len(chunk)
        return total / steps

    def one(chunker):
        def go():
            DPS.physical_chunks = chunker
            try:
                M.load_adapter_state(model, init)
                DPS.dp_sgd_train_local(model, shard, params=params, lr=cfg["train.lr"],
                                       sampling_generator=torch.Generator().manual_seed(seed),
                                       noise_generator=torch.Generator(device=device).manual_seed(1), device=device,
                                       dropout_seed=0)
            finally:
                DPS.physical_chunks = sorted_chunks
            return M.adapter_state(model)
        return go

    cases = {"sampled_order": one(sampled_order), "length_sorted": one(sorted_chunks)}
    real_tokens = sum(int(shard.attention_mask[idx].sum()) for idx in batch_indices(
        len(shard), batch_size, steps, torch.Generator().manual_seed(seed), True)) / steps
    tokens = {"sampled_order": padded_tokens(sampled_order), "length_sorted": padded_tokens(sorted_chunks)}
    log(f"[chunks] {cfg['task.name']} silo 0 of 6 ({len(shard)} rows), Poisson batch {batch_size}, {steps} steps, "
        f"chunks of {chunk_size}; real tokens/step {real_tokens:.0f}, padded tokens/step "
        f"{tokens['sampled_order']:.0f} (sampled order) vs {tokens['length_sorted']:.0f} (sorted)")
    # Warm-up (builds the Opacus wrapper), then the same round both ways with dropout off: the
    # two orders must give the same adapters up to float summation order.
    cases["sampled_order"]()
    dropouts = [(m, m.p) for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    for m, _ in dropouts:
        m.p = 0.0
    try:
        a, b = cases["sampled_order"](), cases["length_sorted"]()
    finally:
        for m, p in dropouts:
            m.p = p
    max_diff = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    times = interleaved(cases, repeats=repeats, device=device, warmup=0)
    per_step = {k: median(v) / steps for k, v in times.items()}
    ratio = per_step["sampled_order"] / per_step["length_sorted"]
    log(f"[chunks] per step: sampled order {per_step['sampled_order']:.2f} s, length-sorted "
        f"{per_step['length_sorted']:.2f} s -> speed-up {ratio:.2f}x; max |param diff| after the round, dropout off, {max_diff:.2e}")
    return {"task": cfg["task.name"], "rows": len(shard), "batch_size": batch_size, "steps": steps,
            "repeats": repeats, "physical_batch_size": chunk_size, "real_tokens_per_step": real_tokens,
            "padded_tokens_per_step": tokens, "per_step_seconds": per_step, "all_seconds": times,
            "speedup": ratio, "max_param_diff": max_diff, "threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.chunks", description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", default="", help="GLUE SST-2 folder (default: the generated task)")
    p.add_argument("--batch-size", type=int, default=500)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default="", help="write the figures here")
    args = p.parse_args(argv)
    out = run(data_dir=args.data_dir, batch_size=args.batch_size, steps=args.steps, repeats=args.repeats)
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
