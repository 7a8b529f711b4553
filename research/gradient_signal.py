"""How much signal does one DP-SGD step carry? The mean per-example gradient against the noise.

For a configuration (pyproject defaults + ``--set``), at the initial adapters, on silo 0's shard:

* ``ratio`` = |E g| / sqrt(E |g|^2): the true mean gradient relative to a typical example's
  gradient. |E g|^2 is estimated without the sampling bias by a split-half inner product
  <mean of half 1, mean of half 2>; a plain |mean| would add |g|^2 / N of pure sampling noise.
* the trainable set is the strategy's (FFA-LoRA: B only), and the noise lands on all of it: at
  the start B = 0, so A has no gradient yet but gets the full noise.
* ``noise/signal`` of one step on one silo, with every example clipped (C below the per-example
  norms, the default regime): the clipped mean has norm ~ ratio * C and the noise on the mean
  gradient has norm sigma * C * sqrt(d) / b, so noise/signal = sigma * sqrt(d) / (b * ratio).
  The server's average over k silos divides the noise by sqrt(k).

    python -m research.gradient_signal                       # the default run
    python -m research.gradient_signal --set model.target-modules='"value"' --set lora.rank=2

It reports per module group so that a user can see where the signal is dense. Figures in RESULTS.md.
"""

from __future__ import annotations

import argparse
import math
from collections import defaultdict

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (TOML value)")
    ap.add_argument("--examples", type=int, default=2048, help="examples of silo 0 to average over (even)")
    ap.add_argument("--silos", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    from benchmarks.common import silo_zero_setup
    from fedpower_app.privacy.accounting.silo import calibrate_noise_multiplier
    from fedpower_app.training.dp_sgd import grad_sample_module

    cfg, _tok, model, shard = silo_zero_setup(a.set, silos=a.silos, threads=a.threads)
    n = min(a.examples, len(shard)) // 2 * 2
    gsm = grad_sample_module(model)
    gsm.enable_hooks()
    gsm.train()
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    halves = {name: [torch.zeros(p.numel(), dtype=torch.float64) for _ in range(2)] for name, p in named}
    sq = defaultdict(float)
    chunk = 128
    for start in range(0, n, chunk):
        idx = torch.arange(start, min(start + chunk, n))
        gsm(**shard.batch(idx, "cpu")).loss.backward()
        half = torch.as_tensor(idx >= n // 2, dtype=torch.long)
        for name, p in named:
            g = p.grad_sample.reshape(len(idx), -1).double()
            for h in (0, 1):
                halves[name][h] += g[half == h].sum(0)
            sq[name] += float(g.pow(2).sum())
            p.grad_sample, p.grad = None, None
    gsm.disable_hooks()

    def group(name: str) -> str:
        module = name.split(".lora_")[0].split(".")[-1] if "lora_" in name else "head"
        part = "B" if "lora_B" in name else "A" if "lora_A" in name else ""
        return f"{module}.{part}" if part else module

    rows = defaultdict(lambda: [0, 0.0, 0.0])
    for name, p in named:
        signal2 = float(halves[name][0] @ halves[name][1]) / (n // 2) ** 2
        row = rows[group(name)]
        row[0] += p.numel(); row[1] += signal2; row[2] += sq[name] / n
    print(f"{'group':16s} {'d':>8s} {'|g| typical':>12s} {'ratio |Eg|/|g|':>15s}")
    total = [0, 0.0, 0.0]
    for key, (d, s2, e2) in sorted(rows.items()):
        total[0] += d; total[1] += s2; total[2] += e2
        print(f"{key:16s} {d:8d} {math.sqrt(e2):12.4g} {math.sqrt(max(s2, 0.0) / e2) if e2 else 0.0:15.4f}")
    d, s2, e2 = total
    ratio = math.sqrt(max(s2, 0.0) / e2)
    b, steps = cfg["train.batch-size"], cfg["train.local-steps"] * cfg["num-server-rounds"]
    q = min(1.0, b / len(shard))
    sigma = calibrate_noise_multiplier(q, steps, cfg["dp.epsilon"], cfg["dp.delta"], cfg["dp.accountant"])
    err = 1 / math.sqrt(n)  # the split-half estimate's resolution for the ratio
    resolved = ratio > 2 * err
    bound = ratio if resolved else 2 * err  # unresolved: ratio below ~2 errors, noise/signal at least this
    per_step = sigma * math.sqrt(d) / (b * bound)
    print(f"all trainable: d={d}, ratio={ratio:.4f} (from {n} examples; sampling error ~{err:.3f}"
          + ("" if resolved else "; NOT resolved: below 2 sampling errors, bounds use 2 errors") + ")")
    print(f"one step on one silo: b={b}, q={q:.4f}, sigma={sigma:.3f} (eps={cfg['dp.epsilon']:g} over {steps} steps): "
          f"noise/signal {'=' if resolved else '>='} {per_step:.2f}; after the average over {a.silos} silos "
          f"{per_step / math.sqrt(a.silos):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
