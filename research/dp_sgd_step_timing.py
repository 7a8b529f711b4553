"""Where the time of one DP-SGD step goes on SST-2, and what caching the frozen layers saves.

Where the time of one DP-SGD step goes, on SST-2 lengths, and what caching the frozen layers below
the lowest adapter could save.

One Poisson batch of expected size b from the whole SST-2 train split, in the product's
length-sorted physical chunks of 128. For each LoRA placement (all 6 layers, or only the top k)
it times, per logical batch (median of ``--repeats``):

* ``fwd_nograd``: a forward pass without autograd (evaluation cost);
* ``plain_fwd_bwd``: forward + backward without per-example gradients (non-private step cost);
* ``dp_fwd`` / ``dp_bwd`` / ``dp_clip``: the DP-SGD step of ``dp_sgd_train_local`` split into
  the forward through the Opacus GradSampleModule (activations captured), the backward (gradients
  and per-example gradients by hooks), and Opacus' per-example clip and accumulate (the skip step);
  ``dp_noise_step``: the last chunk's noise draw and the Adam step;
* ``lower_fwd``: the forward through the embeddings and layers 0..(6-k-1) under no_grad, i.e. what a
  cache of the frozen lower layers' output would save per step (an upper bound of the gain:
  reading the cache is not free).

    python -m research.dp_sgd_step_timing --batch 1000 --top 6 3 --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


class _Stop(Exception):
    pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--top", type=int, nargs="+", default=[6, 3])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--targets", default="query,value")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)

    from fedpower_app import model as M
    from fedpower_app.config import parse_config
    from fedpower_app.data import cache_dir, load_task, tokenized_cached
    from fedpower_app.training.dp_sgd import grad_sample_module
    from fedpower_app.training import physical_chunks
    from opacus.optimizers import DPOptimizer

    base_set = {"task.name": "sst2", "task.data-dir": "/work/shared/glue/SST-2"}
    cfg0 = parse_config(base_set)
    tok = M.load_tokenizer(cfg0["model.name"])
    task = load_task(cfg0)
    full = tokenized_cached(task.train, tok, cfg0["task.max-length"], cache_dir(cfg0),
                            {"task": task.name, "split": "train-all", "max_len": cfg0["task.max-length"],
                             "data": cfg0["task.data-dir"]})
    g = torch.Generator().manual_seed(0)
    idx = torch.nonzero(torch.rand(len(full), generator=g) < a.batch / len(full)).flatten()
    chunks = physical_chunks(full, idx, 128)
    lengths = full.attention_mask[idx].sum(1).float()
    padded = sum(int(full.attention_mask[c].sum(1).max()) * len(c) for c in chunks)
    info = {"b": len(idx), "chunks": len(chunks), "mean_len": round(float(lengths.mean()), 1),
            "real_tokens": int(lengths.sum()), "padded_tokens": padded, "threads": a.threads}
    print(json.dumps(info), flush=True)
    cpu = torch.device("cpu")
    results = []
    targets = [t.strip() for t in a.targets.split(",")]
    for top in a.top:
        layers = list(range(6 - top, 6))
        mods = ",".join(f"layer.{i}.attention.self.{t}" if t in ("query", "key", "value") else f"layer.{i}.{t}"
                        for i in layers for t in targets)
        cfg = parse_config({**base_set, "model.target-modules": mods})
        model = M.build_model(cfg, 2)
        trainable = [p for p in model.parameters() if p.requires_grad]
        batches = [full.batch(c, cpu) for c in chunks]
        t = {k: [] for k in ("fwd_nograd", "plain_fwd_bwd", "dp_fwd", "dp_bwd", "dp_clip", "dp_noise_step", "lower_fwd")}
        gsm = grad_sample_module(model)
        for rep in range(a.repeats + 1):  # first repeat is a warm-up
            rec = {k: 0.0 for k in t}
            gsm.disable_hooks(); model.train()
            with torch.no_grad():
                s = time.perf_counter()
                for bt in batches:
                    model(**bt)
                rec["fwd_nograd"] = time.perf_counter() - s
            s = time.perf_counter()
            for bt in batches:
                model(**bt).loss.backward()
            rec["plain_fwd_bwd"] = time.perf_counter() - s
            for p in trainable:
                p.grad = None
            # the lower, frozen part of the forward: embeddings + layers below the lowest adapter
            if top < 6:
                stop_layer = model.base_model.model.bert.encoder.layer[5 - top]

                def hook(*_):
                    raise _Stop

                h = stop_layer.register_forward_hook(hook)
                with torch.no_grad():
                    s = time.perf_counter()
                    for bt in batches:
                        try:
                            model(**bt)
                        except _Stop:
                            pass
                    rec["lower_fwd"] = time.perf_counter() - s
                h.remove()
            gsm.enable_hooks(); gsm.train()
            opt = DPOptimizer(torch.optim.Adam(trainable, lr=1e-3), noise_multiplier=0.7, max_grad_norm=0.05,
                              expected_batch_size=a.batch, loss_reduction="mean")
            opt.zero_grad(set_to_none=True)
            for i, bt in enumerate(batches):
                s = time.perf_counter()
                out = gsm(**bt)
                rec["dp_fwd"] += time.perf_counter() - s
                s = time.perf_counter()
                out.loss.backward()
                rec["dp_bwd"] += time.perf_counter() - s
                if i < len(batches) - 1:
                    s = time.perf_counter()
                    opt.signal_skip_step(do_skip=True)
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    rec["dp_clip"] += time.perf_counter() - s
            s = time.perf_counter()
            opt.step()
            rec["dp_noise_step"] = time.perf_counter() - s
            opt.zero_grad(set_to_none=True)
            gsm.disable_hooks()
            if rep:
                for k in t:
                    t[k].append(rec[k])
        med = {k: round(statistics.median(v), 3) for k, v in t.items()}
        med["dp_total"] = round(med["dp_fwd"] + med["dp_bwd"] + med["dp_clip"] + med["dp_noise_step"], 3)
        row = {"lora_layers": layers, "targets": targets, "trainable": len(torch.cat([p.flatten() for p in trainable])),
               **med}
        results.append(row)
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
