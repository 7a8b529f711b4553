"""Probes: non-private ceilings and DP-SGD pilots on a validation split carved from TRAIN.

Settings are chosen on ``val`` (``--val-size`` rows of the train split, seeded, never trained on);
the dev split is only reported. The rest of the train split is cut into ``--silos`` IID shards and
the run trains on the first ``--use-silos`` of them concatenated (1: the single-silo proxy of
``research.dp_sgd_proxy``; ``--silos``: central training on all the remaining rows).

Modes
* ``plain``: non-private, one optimizer (Adam) for the whole run, ``--steps`` steps of batch
  ``train.batch-size``, cosine (or constant) decay over the steps after ``--warmup`` steps,
  evaluation every ``--eval-every`` steps.
* ``dp``: the product's ``dp_sgd_train_local`` (Poisson batches of expected size b, per-example clip
  C, fresh Adam every round, L = ``train.local-steps`` steps per round, T = ``num-server-rounds``),
  σ calibrated for (q = b/n, L·T steps, ε, δ) as the server does; the noise multiplier used is
  σ/√``--noise-avg`` (the average of that many silos' noise; 1 = one silo's own noise).
  ``--probe-rounds K``: a private linear probe first, the head alone for K rounds, then LoRA.

Every evaluation logs val and dev accuracy and the adapters' scale (RMS of A and B entries and
the norm of the merged update s·B·A summed over modules), one JSON line per evaluation to
``--out``.

    python -m research.dp_sgd_probe --mode dp --use-silos 1 --noise-avg 6 \\
        --set task.name='"sst2"' --set task.data-dir='"/work/shared/glue/SST-2"' \\
        --set strategy.name='"ffa-lora"' --set train.lr=0.02 --out /tmp/ffa.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch


def subset(split, idx):
    from fedpower_app.data import TokenizedSplit

    idx = torch.as_tensor(idx, dtype=torch.long)
    return TokenizedSplit(split.input_ids[idx], split.attention_mask[idx], split.labels[idx],
                          None if split.token_type_ids is None else split.token_type_ids[idx])


def length_sorted(split):
    """The same rows sorted by length: evaluation pads each batch to its longest row."""
    return subset(split, torch.argsort(split.attention_mask.sum(1), stable=True))


def adapter_scale(model, scaling: float) -> dict:
    a2 = b2 = na = nb = 0
    dw = 0.0
    mods = {}
    for name, p in model.named_parameters():
        if "lora_A" in name:
            a2 += float(p.detach().pow(2).sum()); na += p.numel()
            mods.setdefault(name.split(".lora_A")[0], {})["A"] = p.detach()
        elif "lora_B" in name:
            b2 += float(p.detach().pow(2).sum()); nb += p.numel()
            mods.setdefault(name.split(".lora_B")[0], {})["B"] = p.detach()
    for m in mods.values():
        dw += float((scaling * m["B"] @ m["A"]).pow(2).sum())
    return {"rms_A": math.sqrt(a2 / max(na, 1)), "rms_B": math.sqrt(b2 / max(nb, 1)), "norm_dW": math.sqrt(dw)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=("plain", "dp"), required=True)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--silos", type=int, default=6)
    ap.add_argument("--use-silos", type=int, default=1)
    ap.add_argument("--noise-avg", type=int, default=6, help="dp: noise multiplier sigma/sqrt(this)")
    ap.add_argument("--val-size", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=500, help="plain: optimizer steps")
    ap.add_argument("--warmup", type=int, default=0, help="plain: linear warmup steps")
    ap.add_argument("--eval-every", type=int, default=100, help="plain: steps between evaluations")
    ap.add_argument("--group-by-length", action="store_true", help="plain: length-grouped batches")
    ap.add_argument("--no-dev", action="store_true", help="skip the dev evaluation")
    ap.add_argument("--a-init-scale", type=float, default=1.0, help="multiply the initial LoRA A by this")
    ap.add_argument("--persist-optimizer", action="store_true",
                    help="dp: the silo keeps its optimizer state across rounds (train.optimizer-state = run)")
    ap.add_argument("--probe-rounds", type=int, default=0,
                    help="dp: the first K of the T rounds train the head only (a private linear probe), "
                         "then the adapters join; sigma is calibrated for all T rounds as before")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)

    from benchmarks.common import silo_zero_setup  # noqa: F401 (same imports as the proxy)
    from fedpower_app import model as M
    from fedpower_app.config import parse_config
    from fedpower_app.data import eval_splits, load_task, tokenized_cached, cache_dir
    from fedpower_app.launcher import parse_set
    from fedpower_app.training import evaluate, round_lr, physical_chunks
    from strategies.engine import trained_lora_factors

    cfg = parse_config(parse_set(a.set))
    tok = M.load_tokenizer(cfg["model.name"])
    task = load_task(cfg)
    full = tokenized_cached(task.train, tok, cfg["task.max-length"], cache_dir(cfg),
                            {"task": task.name, "split": "train-all", "max_len": cfg["task.max-length"],
                             "data": cfg["task.data-dir"]})
    perm = torch.randperm(len(full), generator=torch.Generator().manual_seed(32032))
    val_idx, rest = perm[: a.val_size], perm[a.val_size:]
    shards = torch.tensor_split(rest, a.silos)
    train = subset(full, torch.cat(shards[: a.use_silos]))
    val = length_sorted(subset(full, val_idx))
    dev = length_sorted(next(iter(eval_splits(cfg, tok).values())))

    model = M.build_model(cfg, task.num_labels)
    train_a = "A" in trained_lora_factors(cfg["strategy.name"])
    M.set_trainable(model, train_a=train_a, train_b=True)
    if a.a_init_scale != 1.0:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_A" in name:
                    p.mul_(a.a_init_scale)
    scaling = M.lora_scaling(cfg)
    cpu = torch.device("cpu")
    out = open(a.out, "a") if a.out else None
    header = {"argv": argv if argv is not None else __import__("sys").argv[1:], "n_train": len(train),
              "n_val": len(val), "trainable": M.count_trainable(model), "train_a": train_a}

    def log(rec):
        print(json.dumps(rec), flush=True)
        if out:
            out.write(json.dumps(rec) + "\n"); out.flush()

    def do_eval(rec):
        rec["val"] = round(evaluate(model, val, batch_size=256, device=cpu)["accuracy"], 4)
        if not a.no_dev:
            rec["dev"] = round(evaluate(model, dev, batch_size=256, device=cpu)["accuracy"], 4)
        rec.update({k: round(v, 5) for k, v in adapter_scale(model, scaling).items()})
        rec["s"] = round(time.perf_counter() - t0, 1)
        log(rec)

    from fedpower_app.training.frozen_prefix import build_prefix_cache, forward_context

    if cfg["train.cache-frozen"]:  # train on the frozen layers' cached output (same step, faster)
        train = build_prefix_cache(model, train, device=cpu)
    t0 = time.perf_counter()
    if a.mode == "dp":
        from fedpower_app.privacy.accounting.silo import calibrate_noise_multiplier
        from fedpower_app.training.dp_sgd import DPSGDParams, dp_sgd_train_local

        b, L, T = cfg["train.batch-size"], cfg["train.local-steps"], cfg["num-server-rounds"]
        q = min(1.0, b / len(train))
        sigma = calibrate_noise_multiplier(q, L * T, cfg["dp.epsilon"], cfg["dp.delta"], cfg["dp.accountant"])
        head_clip = cfg["dp.head-clip"] if cfg["model.train-head"] else 0.0
        params = DPSGDParams(sigma / math.sqrt(a.noise_avg), cfg["dp.clip"], b, L, head_clip=head_clip,
                         head_noise_ratio=cfg["dp.head-noise-ratio"] if head_clip else 0.0)
        header.update(q=q, sigma=sigma, noise_multiplier=params.noise_multiplier, steps=L * T)
        log(header)
        sampling, noise = torch.Generator().manual_seed(cfg["seed"]), torch.Generator().manual_seed(cfg["seed"] + 1)
        do_eval({"round": 0})
        carry = {} if a.persist_optimizer else None
        if a.probe_rounds:
            if not cfg["model.train-head"] or not 0 < a.probe_rounds < T:
                raise SystemExit("--probe-rounds needs model.train-head = true and 0 < K < T")
            M.set_trainable(model, train_a=False, train_b=False)  # rounds 1..K: the head alone
        for r in range(1, T + 1):
            if a.probe_rounds and r == a.probe_rounds + 1:
                M.set_trainable(model, train_a=train_a, train_b=True)  # the adapters join
            lr = round_lr(cfg["train.lr"], cfg["train.lr-schedule"], r, T)
            st = dp_sgd_train_local(model, train, params=params, lr=lr, sampling_generator=sampling,
                                    noise_generator=noise, device=cpu, optimizer=cfg["train.optimizer"],
                                    optimizer_carry=carry, adam_eps=cfg["train.adam-eps"],
                                    head_lr_scale=cfg["train.head-lr-scale"])
            if r % max(1, a.eval_every) == 0 or r == T or r == a.probe_rounds:
                do_eval({"round": r, "lr": round(lr, 6), "loss": round(st.loss, 4)})
    else:
        log(header)
        params_t = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.Adam(params_t, lr=cfg["train.lr"])
        sched_kind = cfg["train.lr-schedule"]

        def lr_at(step):  # step 0-based
            if step < a.warmup:
                return cfg["train.lr"] * (step + 1) / a.warmup
            if sched_kind == "constant":
                return cfg["train.lr"]
            t = (step - a.warmup) / max(1, a.steps - a.warmup)
            return cfg["train.lr"] * 0.5 * (1 + math.cos(math.pi * t))

        gen = torch.Generator().manual_seed(cfg["seed"])
        b = cfg["train.batch-size"]
        lengths = train.attention_mask.sum(1)

        def epoch_order():
            """A shuffled epoch; with --group-by-length, megabatches of 50 batches sorted by length,
            cut into batches whose order is shuffled (less padding, same examples per epoch)."""
            order = torch.randperm(len(train), generator=gen)
            if not a.group_by_length:
                return order
            mega = [m[torch.argsort(lengths[m], stable=True)] for m in order.split(50 * b)]
            batches = [bt for m in mega for bt in m.split(b) if len(bt) == b]
            perm = torch.randperm(len(batches), generator=gen)
            return torch.cat([batches[i] for i in perm])

        order, pos, losses = epoch_order(), 0, []
        do_eval({"step": 0})
        model.train()
        for step in range(a.steps):
            if pos + b > len(order):
                order, pos = epoch_order(), 0
            idx = order[pos: pos + b]; pos += b
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            opt.zero_grad(set_to_none=True)
            bl = 0.0
            for chunk in physical_chunks(train, idx, 128):
                with forward_context(model, train):
                    outp = model(**train.batch(chunk, cpu))
                (outp.loss * (len(chunk) / len(idx))).backward()
                bl += float(outp.loss.detach()) * len(chunk) / len(idx)
            opt.step()
            losses.append(bl)
            if (step + 1) % a.eval_every == 0 or step + 1 == a.steps:
                do_eval({"step": step + 1, "epoch": round((step + 1) * b / len(train), 3),
                         "lr": round(lr_at(step), 6), "loss": round(sum(losses) / len(losses), 4)})
                losses = []
                model.train()
    if out:
        out.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
