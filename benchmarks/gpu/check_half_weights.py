"""Does the float16 copy of MiniLM (.gpu-carry/minilm-fp16, made by prepare.sh) give the float32
weights' SST-2 dev accuracy? A check on the CPU.

Two comparisons on the SST-2 dev split (872 rows), with the GPU recipe's model
(conf/sst2-dp-gpu.toml: LoRA on the top 3 layers, the trained head on the mean of the last layer):

1. the same trained adapter (LoRA + head, trained once on the float32 weights) evaluated on each
   weight file: isolates what the weights' rounding does to a fixed model;
2. a same-seed short training on each weight file (the frozen-prefix cache of the same rows, the
   same batches, dropout seed and initial adapters), each evaluated on its own weights: what a run
   would see.

The training is non-private (plain Adam; DP-SGD's noise would only add the same draws to both)
on the first ``--rows`` train rows, ``--steps`` steps of batch ``--batch``. float32 forward on 1
thread. It fails (exit 1) when an accuracy differs by more than ``--tolerance`` points.

    python benchmarks/gpu/check_half_weights.py --half .gpu-carry/minilm-fp16 \\
        --data-dir /work/shared/glue/SST-2 --threads 1
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch


def unpacked_half(folder: Path, tmp: Path) -> Path:
    """The float16 model folder, with model.safetensors.xz unpacked into ``tmp`` if needed."""
    if (folder / "model.safetensors").is_file():
        return folder
    packed = folder / "model.safetensors.xz"
    if not packed.is_file():
        raise SystemExit(f"check_half_weights: {folder} holds neither model.safetensors nor model.safetensors.xz "
                         "(run benchmarks/gpu/prepare.sh)")
    out = tmp / "minilm-fp16"
    out.mkdir()
    for f in folder.iterdir():
        if f.is_file() and f.name not in ("model.safetensors.xz", "SHA256"):
            shutil.copy(f, out / f.name)
    with open(out / "model.safetensors", "wb") as fh:
        subprocess.run(["xz", "-dc", str(packed)], stdout=fh, check=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--half", default=".gpu-carry/minilm-fp16", help="the float16 model folder")
    ap.add_argument("--full", default="minilm", help="the float32 model (default: the MiniLM package)")
    ap.add_argument("--data-dir", default="/work/shared/glue/SST-2")
    ap.add_argument("--preset", default="conf/sst2-dp-gpu.toml")
    ap.add_argument("--rows", type=int, default=4000, help="train rows for the short training")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--tolerance", type=float, default=0.2, help="dev accuracy points")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)

    from fedpower_app import data as D
    from fedpower_app import model as M
    from fedpower_app.config import load_preset, parse_config, with_method_preset
    from fedpower_app.training.frozen_prefix import build_prefix_cache
    from fedpower_app.training.loops import evaluate, train_local

    cpu = torch.device("cpu")
    with tempfile.TemporaryDirectory() as tmpdir:
        half_dir = unpacked_half(Path(a.half), Path(tmpdir))
        base, _, _ = with_method_preset(load_preset(a.preset), explicit=set())
        base.update({"device": "cpu", "task.data-dir": a.data_dir, "task.max-train": a.rows,
                     "task.validation-rows": 0, "train.precision": "fp32", "dp.level": "none"})

        def setup(name: str):
            cfg = parse_config({**base, "model.name": name})
            task = D.load_task(cfg)
            tok = M.load_tokenizer(cfg["model.name"])
            model = M.build_model(cfg, task.num_labels, device=cpu)
            dev = D.eval_splits(cfg, tok)["validation"]
            shard = D.client_shard(cfg, tok, 0, 1)
            return cfg, model, shard, dev

        def dev_accuracy(model, dev, cfg) -> tuple[float, torch.Tensor]:
            logits: list = []
            acc = evaluate(model, dev, batch_size=cfg["eval.batch-size"], device=cpu, logits_out=logits,
                           precision="fp32")["accuracy"]
            model.train()
            return acc, torch.cat(logits)

        def short_training(model, shard, cfg, init):
            M.load_adapter_state(model, init)
            cache = build_prefix_cache(model, shard, device=cpu)
            train_local(model, cache, steps=a.steps, batch_size=a.batch, lr=a.lr,
                        generator=torch.Generator().manual_seed(0), poisson=False, device=cpu, dropout_seed=0,
                        precision="fp32")
            return M.adapter_state(model)

        t0 = time.perf_counter()
        cfg32, m32, shard32, dev32 = setup(a.full)
        cfg16, m16, shard16, dev16 = setup(str(half_dir))
        assert len(dev32) == len(dev16) and torch.equal(shard32.input_ids, shard16.input_ids), "different data"
        init = M.adapter_state(m32)  # the same initial adapters for both
        trained32 = short_training(m32, shard32, cfg32, init)
        trained16 = short_training(m16, shard16, cfg16, init)

        acc32, logits32 = dev_accuracy(m32, dev32, cfg32)           # float32 weights, own training
        acc16_own, logits16_own = dev_accuracy(m16, dev16, cfg16)  # float16 weights, own training
        M.load_adapter_state(m16, trained32)
        acc16_same, logits16_same = dev_accuracy(m16, dev16, cfg16)  # float16 weights, float32's adapter
        adapter_gap = max(float((trained32[k] - trained16[k]).abs().max()) for k in trained32)
        out = {
            "dev_rows": len(dev32), "train_rows": len(shard32), "steps": a.steps, "batch": a.batch, "lr": a.lr,
            "float32_weights_accuracy": acc32,
            "float16_weights_same_adapter_accuracy": acc16_same,
            "float16_weights_same_seed_training_accuracy": acc16_own,
            "same_adapter_prediction_agreement": float((logits32.argmax(1) == logits16_same.argmax(1)).float().mean()),
            "same_adapter_max_logit_difference": float((logits32 - logits16_same).abs().max()),
            "same_seed_prediction_agreement": float((logits32.argmax(1) == logits16_own.argmax(1)).float().mean()),
            "same_seed_max_adapter_difference": adapter_gap,
            "seconds": time.perf_counter() - t0,
        }
    gap_same = 100 * abs(acc16_same - acc32)
    gap_own = 100 * abs(acc16_own - acc32)
    print(f"check_half_weights: SST-2 dev ({out['dev_rows']} rows), the recipe's model after {a.steps} steps of "
          f"batch {a.batch} on {out['train_rows']} train rows:")
    print(f"  float32 weights                          {100 * acc32:.2f} %")
    print(f"  float16 weights, the same adapter        {100 * acc16_same:.2f} %  ({gap_same:.2f} points; "
          f"{100 * out['same_adapter_prediction_agreement']:.2f} % same predictions, max logit difference "
          f"{out['same_adapter_max_logit_difference']:.2e})")
    print(f"  float16 weights, same-seed training      {100 * acc16_own:.2f} %  ({gap_own:.2f} points; "
          f"{100 * out['same_seed_prediction_agreement']:.2f} % same predictions, max adapter difference "
          f"{adapter_gap:.2e})")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    if max(gap_same, gap_own) > a.tolerance:
        print(f"check_half_weights: FAILED: a gap over {a.tolerance} points")
        return 1
    print(f"check_half_weights: ok (within {a.tolerance} points), {out['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
