"""Per-example gradient norms, and the signal that survives clipping at C, on silo 0's shard.

At the initial adapters (or, with ``--adapter``, at a run's released ones).

For the strategy's trainable set (FFA-LoRA: B only), over ``--examples`` examples:

* quantiles of the per-example gradient norm |g_i| (is C above or below the median?);
* the fraction of examples clipped at C;
* the split-half estimate of |E clip_C(g)| (no sampling bias) for C = the configured clip and for
  C -> 0 (every example normalised: g_i/|g_i|, times C), and the resulting noise/signal of one
  step, sigma*C*sqrt(d) / (b*|E clip_C(g)|), with the configured sigma (eps, b, L, T).

    python -m research.dp_sgd_gradient_norms --set task.name='"sst2"' --set task.data-dir='"/work/shared/glue/SST-2"' \\
        --set strategy.name='"ffa-lora"'

``--adapter DIR`` measures at a run's released adapters (``outputs/<run>/adapter``) instead of the
initial ones, and prints the accuracy of those adapters on the measured examples (a check that they
loaded). With a trained head the quantiles are also given per group (adapters, head), against
``dp.clip`` and ``dp.head-clip``.
"""

from __future__ import annotations

import argparse
import json
import math

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--examples", type=int, default=2048)
    ap.add_argument("--silos", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clips", type=float, nargs="*", default=[])
    ap.add_argument("--adapter", default="", help="a run's released adapter directory (default: the initial adapters)")
    a = ap.parse_args(argv)
    from benchmarks.common import silo_zero_setup
    from fedpower_app.privacy.accounting.silo import calibrate_noise_multiplier
    from fedpower_app.training.dp_sgd import grad_sample_module

    cfg, _tok, model, shard = silo_zero_setup(a.set, silos=a.silos, threads=a.threads)
    if a.adapter:
        from pathlib import Path

        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        from fedpower_app.released import WEIGHTS_FILE

        set_peft_model_state_dict(model, load_file(str(Path(a.adapter) / WEIGHTS_FILE)))
    n = min(a.examples, len(shard)) // 2 * 2
    perm = torch.randperm(len(shard), generator=torch.Generator().manual_seed(5))[:n]
    gsm = grad_sample_module(model)
    gsm.enable_hooks(); gsm.train()
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    rows, correct = [], 0
    for start in range(0, n, 128):
        idx = perm[start:start + 128]
        batch = shard.batch(idx, "cpu")
        out = gsm(**batch)
        out.loss.backward()
        correct += int((out.logits.argmax(-1) == batch["labels"]).sum())
        rows.append(torch.cat([p.grad_sample.reshape(len(idx), -1).double() for _, p in named], dim=1))
        for _, p in named:
            p.grad_sample, p.grad = None, None
    gsm.disable_hooks()
    G = torch.cat(rows)  # (n, d)
    d = G.shape[1]
    norms = G.norm(dim=1)
    q = torch.quantile(norms, torch.tensor([0.1, 0.25, 0.5, 0.75, 0.9], dtype=torch.float64))
    b, steps = cfg["train.batch-size"], cfg["train.local-steps"] * cfg["num-server-rounds"]
    sigma = calibrate_noise_multiplier(min(1.0, b / len(shard)), steps, cfg["dp.epsilon"], cfg["dp.delta"],
                                       cfg["dp.accountant"])
    half = n // 2

    def signal(clip):
        f = (clip / (norms + 1e-12)).clamp(max=1.0) if clip is not None else torch.ones_like(norms)
        H = G * f[:, None]
        s2 = float(H[:half].mean(0) @ H[half:].mean(0))
        return math.sqrt(max(s2, 0.0)), float((f < 1).double().mean())

    from fedpower_app.model import is_head_parameter

    quantiles = torch.tensor([0.1, 0.25, 0.5, 0.75, 0.9], dtype=torch.float64)
    is_head = torch.cat([torch.full((p.numel(),), is_head_parameter(name)) for name, p in named])
    groups = {}
    if bool(is_head.any()):
        for label, mask, clip in (("adapters", ~is_head, cfg["dp.clip"]), ("head", is_head, cfg["dp.head-clip"] or cfg["dp.clip"])):
            gn = G[:, mask].norm(dim=1)
            groups[label] = {"norm_quantiles_10_25_50_75_90": [round(float(x), 5) for x in torch.quantile(gn, quantiles)],
                             "clip": clip, "clipped_frac": round(float((gn > clip).double().mean()), 3)}
    out = {"config": a.set, "adapter": a.adapter or "initial", "accuracy_on_these_examples": round(correct / n, 4),
           "d": d, "n": n, "sigma": round(sigma, 4), "b": b, "groups": groups,
           "norm_quantiles_10_25_50_75_90": [round(float(x), 5) for x in q],
           "resolution": round(float(norms.mean()) / math.sqrt(half), 6)}
    for clip in [cfg["dp.clip"], *a.clips, float(q[2]), 1e-9]:
        sig, frac = signal(clip)
        c_eff = clip
        nts = sigma * c_eff * math.sqrt(d) / (b * sig) if sig > 0 else float("inf")
        out[f"C={clip:.4g}"] = {"clipped_frac": round(frac, 3), "|E clip(g)|": f"{sig:.3e}",
                                "|E clip(g)|/C": round(sig / c_eff, 4), "noise/signal one silo-step": round(nts, 2)}
    sig_u, _ = signal(None)
    out["unclipped |E g| / rms|g|"] = round(sig_u / float(norms.pow(2).mean().sqrt()), 4)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
