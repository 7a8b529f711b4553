"""What per-example clipping does to the head's objective, on silo 0's shard.

The head is a linear classifier on the mean of the last layer, x -> W x + c. One example's head
gradient is (p - y) [x, 1]^T, of norm |p - y| * sqrt(|x|^2 + 1). When that norm is above the head's
clip C_h for (nearly) every example, DP-SGD sums (p_i - y_i) / |p_i - y_i| * C_h / sqrt(|x_i|^2 + 1):
each example pushes with the same force whatever its fit, so the bias c is driven by the *count*
of examples on each side, not by the residual. Its fixed point is not cross-entropy's (where the
mean predicted probability equals the label frequency): at cross-entropy's fixed point the clipped
bias gradient still points to the majority class, and it stops only once the majority's examples
fall under the clip, (1 - p) sqrt(|x|^2 + 1) < C_h, i.e. at very confident predictions.

This script measures it at the initial model (one forward pass, the rest in closed form):
the quantiles of the head's per-example gradient norm, the fraction clipped at C_h, and the mean
bias gradient (logit of class 1 minus class 0), unclipped and clipped, as the bias offset moves
from 0 through cross-entropy's fixed point.

    python -m research.dp_sgd_clip_bias --threads 1 --set task.name='"sst2"' \\
        --set task.data-dir='"/path/to/glue/SST-2"' --set strategy.name='"fedlora"' \\
        --set model.target-modules='"query,key,value,dense"' --set model.train-head=true \\
        --set model.pooling='"mean"' --set lora.top-layers=3 --set dp.head-clip=0.05
"""

from __future__ import annotations

import argparse
import json

import torch


def bias_gradients(z: torch.Tensor, y: torch.Tensor, xnorm: torch.Tensor, clip: float, offset: float) -> dict:
    """Mean d(loss)/d(logit margin) over examples, unclipped and clipped at ``clip``, with the
    logit margin z (class 1 minus class 0) shifted by ``offset``. Pure function (tested)."""
    p = torch.sigmoid(z + offset)  # P(class 1)
    r = p - y.double()  # residual on the margin; the head's per-example gradient is sqrt(2)*|r| * |[x, 1]|
    norm = (2.0 ** 0.5) * r.abs() * torch.sqrt(xnorm.double() ** 2 + 1.0)
    f = (clip / norm.clamp_min(1e-12)).clamp(max=1.0)
    return {"offset": offset, "mean_p1": float(p.mean()), "label_freq1": float(y.double().mean()),
            "grad_unclipped": float(r.mean()), "grad_clipped_over_C": float((f * r).mean() / clip),
            "clipped_frac": float((f < 1).double().mean())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--examples", type=int, default=1024)
    ap.add_argument("--silos", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    from benchmarks.common import silo_zero_setup

    cfg, _tok, model, shard = silo_zero_setup(a.set, silos=a.silos, threads=a.threads)
    clip = cfg["dp.head-clip"] or cfg["dp.clip"]
    n = min(a.examples, len(shard))
    idx_all = torch.randperm(len(shard), generator=torch.Generator().manual_seed(5))[:n]
    head = dict(model.named_modules())[[k for k, _ in model.named_modules() if k.endswith("classifier")][-1]]
    feats = []
    hook = head.register_forward_hook(lambda m, inp, out: feats.append(inp[0].detach()))
    zs, ys = [], []
    model.eval()
    with torch.no_grad():
        for start in range(0, n, 128):
            idx = idx_all[start:start + 128]
            batch = shard.batch(idx, "cpu")
            logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
            zs.append((logits[:, 1] - logits[:, 0]).double())
            ys.append(batch["labels"])
    hook.remove()
    z, y, x = torch.cat(zs), torch.cat(ys), torch.cat(feats)
    xnorm = x.norm(dim=1)
    # cross-entropy's fixed point for the bias: mean P(class 1) = label frequency (bisection)
    lo, hi = -20.0, 20.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if torch.sigmoid(z + mid).mean() < y.double().mean() else (lo, mid)
    ce_fixed = (lo + hi) / 2
    rows = [bias_gradients(z, y, xnorm, clip, o) for o in (0.0, ce_fixed, ce_fixed + 2, ce_fixed + 4, ce_fixed + 6)]
    head_norm = (2.0 ** 0.5) * (torch.sigmoid(z) - y.double()).abs() * torch.sqrt(xnorm.double() ** 2 + 1)
    q = torch.quantile(head_norm, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64))
    out = {"n": n, "head_clip": clip, "feature_norm_median": round(float(xnorm.median()), 3),
           "head_grad_norm_q10_50_90": [round(float(v), 4) for v in q],
           "ce_fixed_point_offset": round(ce_fixed, 4), "rows": rows}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
