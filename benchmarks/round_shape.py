"""One silo's DP-SGD round of the default run at two shapes with the same examples per round: the
old default's b = 500, L = 2 against more, smaller steps (default here: b = 125, L = 8).

Why: the default run is kept under 5 minutes, and smaller Poisson batches pay a
fixed cost per step (Opacus' clipping and noise over every trainable tensor, the optimizer step)
and, in one chunk, are padded to their longest row. Every case calls
``fedpower_app.training.dp_sgd.dp_sgd_train_local`` on the same model, initial adapters and silo
shard (silo 0 of 6 of the generated task); only ``batch_size``, ``local_steps`` and the physical
chunk size differ. The third case is the small shape in the GPU's chunks (``PHYSICAL_BATCH_SIZE``,
what a CPU trained in before 2026-11-27: one unsorted chunk for b <= 128), against the CPU's
length-sorted chunks (``physical_batch_size_for``). Time per round is the median of interleaved
repeats, so load on a shared machine hits every case alike and the ratios hold.

    python -m benchmarks.round_shape [--batch-size 125 --local-steps 8] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import sys

import torch

from .common import interleaved, median, write_json


def run(*, batch_size: int, local_steps: int, base_batch: int = 500, base_steps: int = 2, repeats: int = 3,
        log=print) -> dict:
    from fedpower_app import data as D
    from fedpower_app import model as M
    from fedpower_app.config import parse_config
    from fedpower_app.training import dp_sgd as DPS
    from fedpower_app.training.loops import PHYSICAL_BATCH_SIZE, physical_batch_size_for

    cfg = parse_config({})  # the default run's model, task and clip
    device = torch.device("cpu")
    task = D.load_task(cfg)
    model = M.build_model(cfg, task.num_labels, device=device)
    shard = D.client_shard(cfg, M.load_tokenizer(cfg["model.name"]), 0, 6)
    init = M.adapter_state(model)

    def case(b: int, steps: int, chunk: int | None = None):
        params = DPS.DPSGDParams(noise_multiplier=0.5, clip=cfg["dp.clip"], batch_size=b, local_steps=steps)

        def go():
            M.load_adapter_state(model, init)
            DPS.dp_sgd_train_local(model, shard, params=params, lr=cfg["train.lr"],
                                   sampling_generator=torch.Generator().manual_seed(1234),
                                   noise_generator=torch.Generator(device=device).manual_seed(1), device=device, dropout_seed=0,
                                   physical_batch_size=chunk)
        return go

    chunk = physical_batch_size_for(device)
    base, new = f"b{base_batch}_L{base_steps}", f"b{batch_size}_L{local_steps}"
    old_chunks = f"{new}_chunks{PHYSICAL_BATCH_SIZE}"
    cases = {base: case(base_batch, base_steps), new: case(batch_size, local_steps),
             old_chunks: case(batch_size, local_steps, PHYSICAL_BATCH_SIZE)}
    log(f"[round-shape] generated task, silo 0 of 6 ({len(shard)} rows): {base} against {new} "
        f"({base_batch * base_steps} and {batch_size * local_steps} expected examples per round), in chunks of "
        f"{chunk}; and {new} in chunks of {PHYSICAL_BATCH_SIZE}")
    times = interleaved(cases, repeats=repeats, device=device, warmup=1)
    per_round = {k: median(v) for k, v in times.items()}
    ratio = per_round[new] / per_round[base]
    chunk_speedup = per_round[old_chunks] / per_round[new]
    log(f"[round-shape] per round: {base} {per_round[base]:.2f} s, {new} {per_round[new]:.2f} s -> {ratio:.2f}x the time; "
        f"{new} in chunks of {PHYSICAL_BATCH_SIZE} {per_round[old_chunks]:.2f} s -> chunks of {chunk} are "
        f"{chunk_speedup:.2f}x faster")
    return {"rows": len(shard), "cases": {base: [base_batch, base_steps], new: [batch_size, local_steps],
                                          old_chunks: [batch_size, local_steps]},
            "chunk_size": chunk, "per_round_seconds": per_round, "all_seconds": times, "ratio": ratio,
            "chunk_speedup": chunk_speedup, "threads": torch.get_num_threads(), "repeats": repeats}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.round_shape", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-size", type=int, default=125)
    p.add_argument("--local-steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (1 when another job holds a core)")
    p.add_argument("--json", default="", help="write the figures here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = run(batch_size=args.batch_size, local_steps=args.local_steps, repeats=args.repeats)
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
