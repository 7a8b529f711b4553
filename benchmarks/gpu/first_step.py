"""The device session's fail-fast stage: the image's versions, then the product's code once on the
device, in about 20-30 s on a GPU. If this fails, the tests, the probe and the run would too.

It prints the versions of Python, torch (and its CUDA), transformers and peft, then runs, with the
product's own functions and the preset's settings:

1. ``fedpower_app.model.build_model``: the preset's model on the device;
2. ``fedpower_app.training.frozen_prefix.build_prefix_cache`` on the first ``--rows`` rows of silo 0
   (when the preset sets ``train.cache-frozen``);
3. ``fedpower_app.training.dp_sgd.dp_sgd_train_local``: one DP-SGD step (Poisson batch, per-example
   clip, noise, the optimizer) with the forward in bf16 autocast (``train.precision = "bf16"``;
   the clip, noise and optimizer stay float32);
4. ``fedpower_app.training.loops.evaluate`` on the first ``--rows`` rows of the primary evaluation
   split, at the same precision.

Each part's seconds, the step's loss and the evaluation's accuracy go to stdout and to ``--json``.
Exit 0 when every part ran and its numbers are finite, 1 otherwise (the part that failed is named).

    python -m benchmarks.gpu.first_step --preset conf/sst2-dp-gpu.toml --set task.data-dir='"DIR"' \\
        --set model.name='"MODEL_DIR"' --device cuda --json first_step.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
import time
import traceback


def versions() -> dict:
    """The versions of what the product's training runs on, as this image has them."""
    out = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers", "peft", "opacus", "flwr"):
        try:
            out[name] = getattr(importlib.import_module(name), "__version__", "?")
        except Exception as exc:  # reported, and the parts below fail on it where they need it
            out[name] = f"NOT IMPORTABLE: {exc}"
    try:
        import torch

        out["torch_cuda"] = torch.version.cuda
        out["cuda_available"] = torch.cuda.is_available()
    except Exception:
        pass
    return out


def first_rows(split, rows: int):
    """The first ``rows`` rows of a tokenised split, as the same kind of split."""
    import dataclasses

    n = min(rows, len(split))
    cut = {f.name: getattr(split, f.name)[:n] for f in dataclasses.fields(split)
           if f.name in ("input_ids", "attention_mask", "labels", "token_type_ids") and getattr(split, f.name) is not None}
    return dataclasses.replace(split, **cut, declared_size=None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", required=True)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--device", default="cuda", help="cuda (default), cpu or auto")
    ap.add_argument("--silos", type=int, default=6, help="the rows come from silo 0 of this many IID shards")
    ap.add_argument("--rows", type=int, default=256, help="rows for the cache, the step and the evaluation")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)

    report = {"check": "first-step", "preset": a.preset, "set": a.set, "rows": a.rows, "versions": versions()}
    print("first_step: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()), flush=True)
    parts = report["parts"] = {}

    def save() -> None:
        if a.json:
            with open(a.json, "w") as fh:
                json.dump(report, fh, indent=1)

    def part(name: str, fn):
        t0 = time.perf_counter()
        value = fn()
        if report.get("device", "").startswith("cuda"):
            import torch

            torch.cuda.synchronize()
        parts[name] = round(time.perf_counter() - t0, 3)
        return value

    current = "imports"
    try:
        import torch

        if a.threads:
            torch.set_num_threads(a.threads)
        from fedpower_app import data as D
        from fedpower_app import model as M
        from fedpower_app.config import load_preset, parse_config, with_method_preset
        from fedpower_app.launcher import parse_set
        from fedpower_app.training.dp_sgd import DPSGDParams, dp_sgd_train_local
        from fedpower_app.training.frozen_prefix import build_prefix_cache
        from fedpower_app.training.loops import evaluate, uses_bf16

        current = "config"
        sets = parse_set(a.set)
        overrides, _, _ = with_method_preset({**load_preset(a.preset), **sets}, explicit=set(sets))  # as the run
        overrides["device"] = a.device
        cfg = parse_config(overrides)
        device = M.resolve_device(cfg["device"])
        report["device"] = str(device)
        report["device_name"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        precision = "bf16"
        report["forward"] = "bf16 autocast" if uses_bf16(device, precision) else "float32"

        current = "task"
        task, tok = part("task", lambda: (D.load_task(cfg), M.load_tokenizer(cfg["model.name"])))

        current = "model"
        model = part("model", lambda: M.build_model(cfg, task.num_labels, device=device))
        M.set_trainable(model, train_a=True, train_b=True)
        report["trainable_parameters"] = M.count_trainable(model)

        current = "data"
        rows = part("data", lambda: first_rows(D.client_shard(cfg, tok, 0, a.silos), a.rows))
        eval_name, eval_split = next(iter(D.eval_splits(cfg, tok).items()))
        eval_rows = first_rows(eval_split, a.rows)

        current = "frozen-prefix cache"
        cached = cfg["train.cache-frozen"]
        data = part("cache", lambda: build_prefix_cache(model, rows, device=device)) if cached else rows
        report["cache"] = {"rows": len(data), "device": str(data.hidden.device)} if cached else "train.cache-frozen is off"

        current = "DP-SGD step"
        before = [p.detach().clone() for p in model.parameters() if p.requires_grad]
        b = max(1, min(cfg["train.batch-size"], len(data) // 2))  # q = 1/2 of the rows
        params = DPSGDParams(noise_multiplier=1.0, clip=cfg["dp.clip"], batch_size=b, local_steps=1,
                             head_clip=cfg["dp.head-clip"], head_noise_ratio=cfg["dp.head-noise-ratio"])
        stats = part("dp_sgd_step", lambda: dp_sgd_train_local(
            model, data, params=params, lr=cfg["train.lr"], sampling_generator=torch.Generator().manual_seed(0),
            noise_generator=torch.Generator(device=device).manual_seed(1), device=device,
            optimizer=cfg["train.optimizer"], adam_eps=cfg["train.adam-eps"],
            head_lr_scale=cfg["train.head-lr-scale"], precision=precision))
        after = [p.detach() for p in model.parameters() if p.requires_grad]
        moved = sum(int(not torch.equal(x, y)) for x, y in zip(before, after))
        finite = all(bool(torch.isfinite(y).all()) for y in after)
        report["step"] = {"batch_size": b, "loss": stats.loss, "examples": stats.examples_seen,
                          "tensors_moved": moved, "tensors": len(after), "finite": finite}
        if not (math.isfinite(stats.loss) and finite and moved):
            raise RuntimeError(f"the step's numbers are wrong: loss {stats.loss}, {moved}/{len(after)} trainable "
                               f"tensors moved, all finite: {finite}")

        current = "evaluation"
        metrics = part("evaluate", lambda: evaluate(model, eval_rows, batch_size=cfg["eval.batch-size"], device=device,
                                                    precision=precision))
        report["evaluation"] = {"split": eval_name, "rows": len(eval_rows), "accuracy": metrics.get("accuracy"),
                                "loss": metrics.get("loss")}
        if not all(math.isfinite(float(metrics.get(k, math.nan))) for k in ("accuracy", "loss")):
            raise RuntimeError(f"the evaluation's numbers are not finite: {metrics}")
    except Exception as exc:
        report["failed"] = {"part": current, "error": f"{type(exc).__name__}: {exc}",
                            "traceback": traceback.format_exc()}
        save()
        print(f"first_step: FAILED at {current}: {type(exc).__name__}: {exc}", flush=True)
        traceback.print_exc()
        return 1
    save()
    print(f"first_step: ok on {report['device']} ({report['device_name']}), forward in {report['forward']}; "
          f"{report['trainable_parameters']:,} trainable; step b {b}: loss {stats.loss:.4f}, "
          f"{moved}/{len(after)} tensors moved; {eval_name} on {len(eval_rows)} rows: accuracy "
          f"{report['evaluation']['accuracy']:.3f}; seconds " + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()),
          flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
