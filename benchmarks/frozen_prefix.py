"""Time of one silo's DP-SGD step with the frozen-prefix cache, against today's step, in one process.

Cases (each one step of the product's ``dp_sgd_train_local``: a Poisson batch of expected size b
from silo 0's shard, length-sorted chunks, per-example clip, noise, Adam; interleaved repeats):

* ``all-layers``: LoRA on every layer, tokens in (the baseline: today's default placement);
* ``top-k``: LoRA on the top k layers only (``lora.top-layers``), tokens in;
* ``top-k cached``: the same model trained on its frozen-prefix cache (``train.cache-frozen``);
* ``top-k cached bf16`` (with ``--bf16``): the same, its forward under bf16 autocast
  (``train.precision = "bf16"``); the DP arithmetic stays float32.

The cache's build time (one eval-mode forward of the frozen layers over the shard, paid once per
silo and run) is reported per 1,000 rows.

    python -m benchmarks.frozen_prefix --threads 1 --set task.name='"sst2"' \\
        --set task.data-dir='"/path/to/glue/SST-2"' --set model.target-modules='"query,key,value,dense"' \\
        --set model.train-head=true --top 3
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks.common import environment, interleaved, median


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--top", type=int, default=3, help="LoRA on the top K layers in the top-k cases")
    ap.add_argument("--batch", type=int, default=1000, help="expected Poisson batch size b")
    ap.add_argument("--silos", type=int, default=6, help="silo 0 of this many IID shards")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--bf16", action="store_true", help="add the cached case under train.precision = bf16")
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)

    from fedpower_app import model as M
    from fedpower_app.config import parse_config
    from fedpower_app.data import client_shard
    from fedpower_app.training.dp_sgd import DPSGDParams, dp_sgd_train_local
    from fedpower_app.training.frozen_prefix import build_prefix_cache
    from fedpower_app.launcher import parse_set

    cpu = torch.device("cpu")
    base = parse_config(parse_set(a.set))
    tok = M.load_tokenizer(base["model.name"])
    shard = client_shard(base, tok, 0, a.silos)
    params = DPSGDParams(noise_multiplier=0.8, clip=0.05, batch_size=a.batch, local_steps=1,
                         head_clip=0.05 if base["model.train-head"] else 0.0)
    sampling = torch.Generator().manual_seed(0)

    def model_for(top: int):
        return M.build_model(parse_config({**base.values, "lora.top-layers": top}), 2)

    all_layers, top_k = model_for(0), model_for(a.top)
    t0 = time.perf_counter()
    cache = build_prefix_cache(top_k, shard, device=cpu)
    build_s = time.perf_counter() - t0

    def step(model, data, precision="fp32"):
        return lambda: dp_sgd_train_local(model, data, params=params, lr=1e-3, sampling_generator=sampling,
                                          noise_generator=torch.Generator().manual_seed(1), device=cpu,
                                          precision=precision)

    cases = {"all-layers": step(all_layers, shard), f"top-{a.top}": step(top_k, shard),
             f"top-{a.top} cached": step(top_k, cache)}
    if a.bf16:
        cases[f"top-{a.top} cached bf16"] = step(top_k, cache, "bf16")
    times = interleaved(cases, repeats=a.repeats, device=cpu)
    baseline = median(times["all-layers"])
    cached = median(times[f"top-{a.top} cached"])
    rows = {name: {"seconds": median(ts), "speedup_vs_all_layers": baseline / median(ts),
                   "speedup_vs_cached_fp32": cached / median(ts), "repeats": ts}
            for name, ts in times.items()}
    out = {"benchmark": "frozen_prefix", "rows": len(shard), "batch": a.batch, "top": a.top,
           "trainable": {"all-layers": M.count_trainable(all_layers), f"top-{a.top}": M.count_trainable(top_k)},
           "cache_build_seconds": build_s, "cache_build_seconds_per_1000_rows": 1000 * build_s / len(shard),
           "cache_mb": cache.hidden.numel() * 4 / 2**20, "cases": rows, "threads": a.threads,
           "set": a.set, "environment": environment(cpu)}
    print(f"silo 0 of {a.silos}: {len(shard)} rows; b = {a.batch}; {a.threads} thread(s)")
    print(f"cache: built in {build_s:.1f} s ({out['cache_build_seconds_per_1000_rows']:.2f} s per 1,000 rows), "
          f"{out['cache_mb']:.0f} MB")
    for name, r in rows.items():
        print(f"{name:>21}: {r['seconds']:.2f} s per step  ({r['speedup_vs_all_layers']:.2f}x all-layers, "
              f"{r['speedup_vs_cached_fp32']:.2f}x cached float32)")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
