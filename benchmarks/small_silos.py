"""The head on frozen features at many silo sizes, in seconds: the product's own head training
(``training.features``: ``dp_sgd_head`` / ``train_head``, the silo's sampling and noise streams,
the accountant's σ) over N silos with the server's average of the head, without Flower.

What it leaves out of a ``benchmarks.inprocess_run`` run: the messages, the ledger's checks and
the strategy object (whose head step is the same average: the head is an extra, averaged by
every strategy). The features come from ``--features FILE``: ``{"train": (X, y), "dev": (X, y)}``
as ``training.features.compute_features`` returns them for a whole split (``--extract`` writes
one). What it is for: measuring the rule of ``privacy/recommend.py`` (what to train, and the
head's b, L, T, lr) against the rows a silo holds, on several tasks, with seeds, in minutes.

    python -m benchmarks.small_silos --extract qqp.pt --preset conf/text-dp.toml --set task.data-dir='"DIR"' ...
    python -m benchmarks.small_silos --features qqp.pt --rows 500,1667 --seeds 3 --out results/small-silos/qqp.json

``--carve 1000`` holds out that many train rows (a seeded draw) and reports on them instead of the
evaluation split, so that settings are chosen without reading the split the results report;
``--plan grid`` runs every (q, steps, lr) of ``--grid-rates``, ``--grid-steps`` and ``--grid-lrs``
against the rule's own setting (the check of the head's constants in RESULTS.md, "Small silos").
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch


class _HeadOnly(torch.nn.Module):
    """A stand-in model holding only a trained head (named as PEFT names a saved module)."""

    def __init__(self, dim: int, num_labels: int) -> None:
        super().__init__()
        self.modules_to_save = torch.nn.Linear(dim, num_labels)
        torch.nn.init.zeros_(self.modules_to_save.weight)
        torch.nn.init.zeros_(self.modules_to_save.bias)


def silo_subsets(n_train: int, rows_per_silo: int, silos: int, seed: int) -> list[torch.Tensor]:
    """``silos`` disjoint IID shards of ``rows_per_silo`` rows of the train split (a seeded
    sample, split as the product splits a task: ``data.partition_indices``)."""
    from fedpower_app.data import partition_indices

    total = rows_per_silo * silos
    if total > n_train:
        raise ValueError(f"{rows_per_silo} rows x {silos} silos > {n_train} train rows")
    picked = torch.randperm(n_train, generator=torch.Generator().manual_seed(10_000 + seed))[:total]
    return [picked[torch.tensor(partition_indices(total, silos, k, seed), dtype=torch.long)] for k in range(silos)]


def run_head(train, dev, *, rows_per_silo: int, silos: int, epsilon: float, delta: float, batch_size: int,
             local_steps: int, rounds: int, lr: float, clip: float, seed: int, private: bool = True,
             optimizer: str = "adam", schedule: str = "cosine", class_weight=None, noise_multiplier: float | None = None):
    """One federated run of the head; returns the final global head's dev figures and σ."""
    from strategies.noise import NoiseSource

    from fedpower_app.privacy.accounting.silo import calibrate_noise_multiplier
    from fedpower_app.training.dp_sgd import DPSGDParams
    from fedpower_app.training.features import FeatureSplit, dp_sgd_head, train_head
    from fedpower_app.training.loops import _evaluate_logits, round_lr, silo_randomness

    x, y = train
    shards = [FeatureSplit(x[idx], y[idx]) for idx in silo_subsets(len(y), rows_per_silo, silos, seed)]
    num_labels = int(max(int(y.max()), int(dev[1].max())) + 1)
    n_min = min(len(s) for s in shards)
    sigma = 0.0
    if private:
        sigma = noise_multiplier if noise_multiplier is not None else calibrate_noise_multiplier(
            batch_size / n_min, local_steps * rounds, epsilon, delta, "rdp")
    params = DPSGDParams(sigma, clip, batch_size, local_steps)
    glob = _HeadOnly(x.shape[1], num_labels)
    noise = NoiseSource(seed, "seeded")
    for r in range(1, rounds + 1):
        lr_r = round_lr(lr, schedule, r, rounds)
        states = []
        for k, shard in enumerate(shards):
            local = _HeadOnly(x.shape[1], num_labels)
            local.load_state_dict(glob.state_dict())
            streams = silo_randomness(noise, k, r, "cpu")
            if private:
                dp_sgd_head(local, shard, params=params, lr=lr_r, sampling_generator=streams.sampling,
                            noise_generator=streams.dp_noise, optimizer=optimizer, class_weight=class_weight)
            else:
                train_head(local, shard, steps=local_steps, batch_size=batch_size, lr=lr_r,
                           generator=streams.sampling, poisson=True, optimizer=optimizer, class_weight=class_weight)
            states.append(local.state_dict())
        glob.load_state_dict({key: sum(s[key] for s in states) / len(states) for key in states[0]})
    with torch.no_grad():
        w, b = glob.modules_to_save.weight, glob.modules_to_save.bias
        res = _evaluate_logits(dev[0] @ w.t() + b, dev[1], logits_out=None, batch_size=1024)
    res["sigma"] = sigma
    return res


def carve(train, rows: int, seed: int = 123):
    """(the train split less ``rows`` rows, those rows): a seeded draw, the product's row order kept."""
    x, y = train
    if not 0 < rows < len(y):
        raise ValueError(f"--carve {rows}: need 0 < rows < {len(y)} (the train split's rows)")
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    held, rest = order[:rows].sort().values, order[rows:].sort().values
    return (x[rest], y[rest]), (x[held], y[held])


def extract(argv) -> int:
    """``--extract OUT``: the whole train and first evaluation split's features of a preset's task."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--extract", required=True)
    ap.add_argument("--preset", default="")
    ap.add_argument("--set", action="append", default=[])
    a = ap.parse_args(argv)
    from fedpower_app import data as D
    from fedpower_app import model as M
    from fedpower_app.config import load_preset, parse_config
    from fedpower_app.data.pipeline import tokenize
    from fedpower_app.launcher import parse_set
    from fedpower_app.training.features import compute_features

    overrides = load_preset(a.preset) if a.preset else {}
    overrides.update(parse_set(a.set))
    overrides["train.what"] = "head"
    overrides["train.auto"] = False
    cfg = parse_config(overrides)
    task = D.load_task(cfg)
    model = M.cached_model(cfg, task.num_labels)
    tok = M.load_tokenizer(cfg["model.name"])
    out = {}
    for split, ex in (("dev", next(iter(task.eval_splits.values()))), ("train", task.train)):
        f = compute_features(model, tokenize(ex, tok, cfg["task.max-length"]), device="cpu")
        out[split] = (f.features, f.labels)
    torch.save(out, a.extract)
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--extract" in argv:
        return extract(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--features", required=True)
    ap.add_argument("--rows", default="500,1667", help="rows per silo, comma-separated")
    ap.add_argument("--silos", type=int, default=6)
    ap.add_argument("--epsilon", type=float, default=8.0)
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--plan", choices=("rule", "fixed", "grid"), default="rule",
                    help="rule: b, L, T, lr and the clip of recommend.head_plan; fixed: the flags below; "
                         "grid: every setting of the --grid-* lists, then the rule's")
    ap.add_argument("--grid-rates", default="0.1,0.25,0.5")
    ap.add_argument("--grid-steps", default="50,100,200")
    ap.add_argument("--grid-lrs", default="0.02,0.05,0.1")
    ap.add_argument("--carve", type=int, default=0,
                    help="report on this many rows held out of train (a seeded draw), not the evaluation split")
    ap.add_argument("--rate", type=float, default=0.5)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--local-steps", type=int, default=4)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--optimizer", default="adam")
    ap.add_argument("--nonprivate", action="store_true", help="also the same schedule without clip and noise")
    ap.add_argument("--class-prior", default="", help="declared class shares (train.class-prior)")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    from fedpower_app.privacy.recommend import head_plan

    data = torch.load(a.features)
    weights = None
    if a.class_prior:
        from fedpower_app.training.features import parse_class_prior

        prior = parse_class_prior(a.class_prior)
        weights = torch.tensor([1.0 / (len(prior) * p) for p in prior])
    train, dev = data["train"], data["dev"]
    if a.carve:
        train, dev = carve(train, a.carve)
    rows_out = []

    grid = ([(q, st, lr) for q in map(float, a.grid_rates.split(",")) for st in map(int, a.grid_steps.split(","))
             for lr in map(float, a.grid_lrs.split(","))] if a.plan == "grid" else [])

    def settings(rows: int):
        """(setting, b, L, T, lr, C) of each run at ``rows`` a silo."""
        if a.plan == "fixed":
            local = min(a.local_steps, a.steps)
            return [("fixed", max(1, round(a.rate * rows)), local, math.ceil(a.steps / local), a.lr, a.clip)]
        out = [(f"q={q:g} steps={st} lr={lr:g}", max(1, math.ceil(q * rows)), min(a.local_steps, st),
                math.ceil(st / min(a.local_steps, st)), lr, a.clip) for q, st, lr in grid]
        plan = head_plan([rows] * a.silos, a.epsilon, a.delta)
        return out + [("rule", plan.batch_size, plan.local_steps, plan.rounds, plan.lr, plan.clip)]

    for rows, (setting, b, local, rounds, lr, clip) in [(r, s) for r in map(int, a.rows.split(",")) for s in settings(r)]:
        for private in ((True, False) if a.nonprivate else (True,)):
            accs, f1s, t0 = [], [], time.perf_counter()
            for seed in range(a.seeds):
                res = run_head(train, dev, rows_per_silo=rows, silos=a.silos, epsilon=a.epsilon,
                               delta=a.delta, batch_size=b, local_steps=local, rounds=rounds, lr=lr, clip=clip,
                               seed=seed, private=private, optimizer=a.optimizer, class_weight=weights)
                accs.append(res["accuracy"])
                f1s.append(res.get("macro-f1", float("nan")))
            row = {"rows_per_silo": rows, "setting": setting, "private": private, "batch_size": b, "local_steps": local, "rounds": rounds,
                   "lr": lr, "clip": clip, "sigma": res["sigma"], "optimizer": a.optimizer,
                   "accuracy_mean": float(torch.tensor(accs).mean()), "accuracy_std": float(torch.tensor(accs).std()) if len(accs) > 1 else 0.0,
                   "macro_f1_mean": float(torch.tensor(f1s).mean()), "accuracies": accs,
                   "majority_accuracy": res.get("majority-accuracy"), "seconds": time.perf_counter() - t0}
            rows_out.append(row)
            print(json.dumps(row), flush=True)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump({"features": a.features, "evaluated_on": f"{a.carve} rows carved from train" if a.carve
                       else "the evaluation split", "epsilon": a.epsilon, "delta": a.delta, "silos": a.silos,
                       "rows": rows_out}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
