"""Data layer: pick a task source, split it across silos (IID or label-skewed), tokenise once and cache on disk.

Sources are pluggable: the generated ``synthetic`` task (default, offline), GLUE from a local
directory (``task.data-dir``) or from the Hugging Face hub (``fedpower_app.data.glue``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from ..config import RunConfig
from .types import TaskData, TextExamples

log = logging.getLogger("fedpower")


def load_task(cfg: RunConfig) -> TaskData:
    """The configured task's train and evaluation splits (cached per process)."""
    if cfg["task.name"] == "text":
        from .text_files import text_spec

        return _load_text_cached(text_spec(cfg), cfg["task.data-dir"], cfg["task.dataset"], cfg["task.dataset-subset"],
                                 cfg["task.dataset-eval-split"], cfg["task.max-train"], cfg["task.max-eval"],
                                 cfg["seed"], cfg["task.train-rows"], cfg["task.validation-rows"])
    return _load_task_cached(
        cfg["task.name"], cfg["task.data-dir"], cfg["task.max-train"], cfg["task.max-eval"],
        cfg["task.synthetic-train-size"], cfg["task.synthetic-eval-size"], cfg["seed"], cfg["task.train-rows"],
        cfg["task.validation-rows"],
    )


#: The seed of the validation rows carved from the train split (``task.validation-rows``): fixed, not
#: the run seed, so every tuning run of every method and seed is scored on the same rows.
VALIDATION_SEED = 0x7A11D
VALIDATION_SPLIT = "validation-from-train"


def carve_validation(task: TaskData, rows: int) -> TaskData:
    """The task with ``rows`` train examples moved to a validation split of their own, placed first
    among the evaluation splits (it drives the per-round accuracy). Settings are chosen on it,
    never on the dev split that the result tables report (docs/privacy.md, "Tuning")."""
    n = len(task.train)
    if not 0 < rows < n:
        raise ValueError(f"task.validation-rows = {rows} must be in 1..{n - 1} (the train split has {n} rows)")
    import numpy as np

    perm = np.random.default_rng(VALIDATION_SEED).permutation(n)
    held, kept = sorted(perm[:rows].tolist()), sorted(perm[rows:].tolist())
    return dataclasses.replace(task, train=task.train.select(kept),
                               eval_splits={VALIDATION_SPLIT: task.train.select(held), **task.eval_splits})


@lru_cache(maxsize=4)
def _load_task_cached(name, data_dir, max_train, max_eval, syn_train, syn_eval, seed, train_rows="",
                      validation_rows=0) -> TaskData:
    task = _load_source(name, data_dir, max_train, max_eval, syn_train, syn_eval, seed, train_rows)
    return carve_validation(task, validation_rows) if validation_rows else task


@lru_cache(maxsize=4)
def _load_text_cached(spec, data_dir, dataset, subset, eval_split, max_train, max_eval, seed, train_rows,
                      validation_rows) -> TaskData:
    """The generic text task: local files (``text_files``) or a dataset through flwr-datasets (``text_hub``)."""
    if dataset:
        from .text_hub import load_text_hub

        task = load_text_hub(spec, dataset, subset, eval_split)
    elif data_dir:
        from .text_files import read_text_dir

        task = read_text_dir(data_dir, spec, need_eval=True)
    else:
        raise ValueError("task.name = 'text' reads its rows from task.data-dir (local files) or task.dataset (a Hugging "
                         "Face dataset); both are empty")
    if max_train or max_eval:
        from .glue import subsample_examples

        task = dataclasses.replace(
            task, train=subsample_examples(task.train, max_train or None, seed, "train") if len(task.train) else task.train,
            eval_splits={s: subsample_examples(e, max_eval or None, seed, s) for s, e in task.eval_splits.items()})
    if train_rows:
        task = select_train_rows(task, train_rows)
    return carve_validation(task, validation_rows) if validation_rows else task


def text_task_key(cfg: RunConfig) -> dict:
    """What identifies the rows of a ``text`` task beyond ``task.data-dir`` (token cache keys)."""
    if cfg["task.name"] != "text":
        return {}
    return {k: cfg[k] for k in ("task.text-column", "task.text-pair-column", "task.label-column", "task.labels",
                                "task.dataset", "task.dataset-subset", "task.dataset-eval-split")}


def _load_source(name, data_dir, max_train, max_eval, syn_train, syn_eval, seed, train_rows="") -> TaskData:
    if name == "synthetic":
        from .synthetic import load_synthetic

        task = load_synthetic(syn_train, syn_eval, seed)
    else:
        from .glue import load_glue

        task = load_glue(name, data_dir or None, max_train=max_train or None, max_eval=max_eval or None, seed=seed)
    return select_train_rows(task, train_rows) if train_rows else task


def train_rows_layout(path: str, n_rows: int, num_partitions: int) -> tuple[list[int], list[int]] | None:
    """The silo of every row and every silo's declared size, when ``task.train-rows`` gives them
    (``partitions`` and ``declared_sizes``; a membership audit does); None otherwise."""
    if not path:
        return None
    spec = json.loads(Path(path).read_text())
    if "partitions" not in spec:
        return None
    partitions, declared = [int(p) for p in spec["partitions"]], [int(d) for d in spec.get("declared_sizes", [])]
    if len(partitions) != n_rows:
        raise ValueError(f"task.train-rows: {path} places {len(partitions)} rows but lists {n_rows}")
    if len(declared) != num_partitions or any(not 0 <= p < num_partitions for p in partitions):
        raise ValueError(f"task.train-rows: {path} is laid out for {len(declared)} silos, this run has {num_partitions}")
    counts = [partitions.count(i) for i in range(num_partitions)]
    if any(c > d for c, d in zip(counts, declared)):
        raise ValueError(f"task.train-rows: a silo holds more rows than its declared size ({counts} > {declared})")
    return partitions, declared


def select_train_rows(task: TaskData, path: str) -> TaskData:
    """The task with its train split replaced by the rows (and labels) listed in ``path``.

    This is how a membership audit decides, per run, which examples are members: the evaluation
    splits are untouched, and a label may differ from the split's (a label-flipped canary)."""
    try:
        spec = json.loads(Path(path).read_text())
        rows, labels = [int(r) for r in spec["rows"]], [int(y) for y in spec["labels"]]
    except OSError as exc:
        raise ValueError(f"task.train-rows: cannot read {path}: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"task.train-rows: {path} is not a JSON object with integer lists 'rows' and 'labels' ({exc})") from None
    n = len(task.train)
    if len(rows) != len(labels):
        raise ValueError(f"task.train-rows: {path} lists {len(rows)} rows but {len(labels)} labels")
    if not rows:
        raise ValueError(f"task.train-rows: {path} lists no rows")
    bad = [r for r in rows if not 0 <= r < n]
    if bad:
        raise ValueError(f"task.train-rows: row {bad[0]} is outside the train split (0..{n - 1})")
    if not all(0 <= y < task.num_labels for y in labels):
        raise ValueError(f"task.train-rows: labels in {path} must lie in 0..{task.num_labels - 1}")
    picked = task.train.select(rows)
    train = TextExamples(text_a=picked.text_a, labels=labels, text_b=picked.text_b)
    return dataclasses.replace(task, train=train)


def shard_sizes(num_examples: int, num_silos: int) -> list[int]:
    """Every silo's shard size, IID or Dirichlet alike: the first ``num_examples % num_silos`` hold
    one example more (as ``glue.iid_partition_indices`` cuts them)."""
    size, extra = divmod(num_examples, num_silos)
    return [size + (i < extra) for i in range(num_silos)]


def shard_size_problem(num_examples: int, num_silos: int, batch_size: int, sizes: list[int] | None = None) -> str | None:
    """Why these silos cannot train with this batch size, or None. A shard smaller than the batch
    cannot give the configured batch (and DP-SGD's sampling rate b/n would exceed 1)."""
    sizes = sizes if sizes is not None else shard_sizes(num_examples, num_silos)
    small = [n for n in sizes if n < batch_size]
    if not small:
        return None
    return (f"{len(small)} silo(s) hold fewer training examples ({min(small)}) than config key 'train.batch-size' = "
            f"{batch_size} ({num_examples} examples over {len(sizes)} silos): lower train.batch-size, use fewer "
            f"silos or more data")


def partition_indices(num_examples: int, num_partitions: int, partition_id: int, seed: int, *,
                      labels=None, dirichlet_alpha: float = 0.0) -> list[int]:
    """A silo's shard of a split. Sizes differ by at most one and sum to the split, in both schemes:
    IID (``dirichlet_alpha`` 0, the default), or label-skewed (``dirichlet_alpha`` > 0, needs the
    split's ``labels``; :func:`dirichlet_partition_indices`)."""
    if dirichlet_alpha:
        if labels is None or len(labels) != num_examples:
            raise ValueError("a Dirichlet partition needs the split's labels (one per example)")
        return dirichlet_partition_indices(labels, num_partitions, partition_id, seed, dirichlet_alpha)
    from .glue import iid_partition_indices

    return iid_partition_indices(num_examples, num_partitions, partition_id, seed)


def dirichlet_partition_indices(labels, num_partitions: int, partition_id: int, seed: int, alpha: float) -> list[int]:
    """Shard ``partition_id`` of a label-skewed (non-IID) split: each silo keeps its IID shard size,
    but its label mix is drawn from a Dirichlet distribution (Hsu et al. 2019, "Measuring the
    effects of non-identical data distribution for federated visual classification").

    Silo i's mix is q_i ~ Dir(alpha * K * p), with p the split's label frequencies and K the number
    of labels: the expected mix is the split's own, the concentration per label is alpha when the
    labels are balanced, small alpha gives silos of nearly one label, large alpha tends to IID.
    Silos are filled in a seeded random order, each taking round(n_i q_i) examples of each label
    (largest remainders) from that label's shuffled pool; when a pool runs dry the shortfall comes
    from the labels with the most examples left, so shards are disjoint, cover the split, and have
    exactly the IID sizes (the DP-SGD sampling rates and the shard-size checks do not change).

    Why not ``flwr_datasets``' DirichletPartitioner: it splits each label's pool over all silos, so
    shard sizes vary widely. At 1,000 silos on SST-2 with alpha 0.5 it leaves ~22 % of the shards
    below a batch of 16 examples and some empty (its min-partition-size retry then fails).
    """
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not (math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"dirichlet alpha must be a finite number > 0, got {alpha!r}")
    y = np.asarray(labels, dtype=np.int64)
    n = len(y)
    if not (isinstance(num_partitions, int) and 1 <= num_partitions <= n):
        raise ValueError(f"cannot split {n} example(s) into {num_partitions} non-empty partitions")
    if not (isinstance(partition_id, int) and 0 <= partition_id < num_partitions):
        raise ValueError(f"partition_id must be in [0, {num_partitions - 1}], got {partition_id!r}")
    return list(_dirichlet_shards(y.tobytes(), n, num_partitions, int(seed), float(alpha))[partition_id])


@lru_cache(maxsize=4)
def _dirichlet_shards(label_bytes: bytes, n: int, num_partitions: int, seed: int, alpha: float) -> tuple:
    """Every silo's shard (computed once per split and settings, then cached: each silo asks)."""
    y = np.frombuffer(label_bytes, dtype=np.int64)
    classes, counts = np.unique(y, return_counts=True)
    rng = np.random.default_rng([seed & 0xFFFFFFFF, 0xD1C0])  # its own stream: IID shards are unchanged
    pools = [rng.permutation(np.nonzero(y == c)[0]) for c in classes]
    taken = np.zeros(len(classes), dtype=np.int64)  # how much of each pool is used
    concentration = alpha * len(classes) * counts / n
    mixes = rng.dirichlet(concentration, size=num_partitions)
    sizes = shard_sizes(n, num_partitions)
    shards: list = [None] * num_partitions
    for i in rng.permutation(num_partitions):
        n_i = sizes[i]
        want = mixes[i] * n_i
        take = np.floor(want).astype(np.int64)
        for c in np.argsort(-(want - take), kind="stable")[: n_i - int(take.sum())]:
            take[c] += 1
        left = counts - taken
        take = np.minimum(take, left)
        short = n_i - int(take.sum())
        for c in np.argsort(-(left - take), kind="stable"):  # a dry pool: the fullest labels fill in
            if short <= 0:
                break
            extra_c = min(short, int(left[c] - take[c]))
            take[c] += extra_c
            short -= extra_c
        shards[i] = tuple(int(j) for c in range(len(classes)) for j in pools[c][taken[c]:taken[c] + take[c]])
        taken += take
    return tuple(shards)


class SiloRows:
    """What sampling and accounting read of a silo's training rows, whatever form they take
    (tokens here, cached hidden states in ``training.frozen_prefix``): how many there are, and the
    n of the sampling rate q = b / n."""

    labels: torch.Tensor
    declared_size: int | None

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def dp_size(self) -> int:
        """n in the silo's sampling rate q = b / n (and in its size reply)."""
        return max(len(self), int(self.declared_size or 0))


@dataclass
class TokenizedSplit(SiloRows):
    """Pre-tokenised examples, padded to max_length; batches are trimmed to their longest row."""

    input_ids: torch.Tensor  # (N, L) int64
    attention_mask: torch.Tensor  # (N, L) int64
    labels: torch.Tensor  # (N,) int64
    token_type_ids: torch.Tensor | None = None
    # The size a silo accounts and samples with, when it is fixed in advance (a membership audit:
    # its candidates, all of them in): q = b / declared_size, the same whichever candidates are in.
    declared_size: int | None = None

    def batch(self, idx: torch.Tensor, device) -> dict[str, torch.Tensor]:
        mask = self.attention_mask[idx]
        width = max(int(mask.sum(dim=1).max().item()), 1) if len(idx) else 1
        out = {
            "input_ids": self.input_ids[idx, :width].to(device),
            "attention_mask": mask[:, :width].to(device),
            "labels": self.labels[idx].to(device),
        }
        if self.token_type_ids is not None:
            out["token_type_ids"] = self.token_type_ids[idx, :width].to(device)
        return out


def cache_dir(cfg: RunConfig) -> Path:
    raw = cfg["task.cache-dir"] or os.environ.get("FEDPOWER_CACHE") or str(Path.home() / ".cache" / "fedpower")
    return Path(raw).expanduser()


def tokenize(examples: TextExamples, tokenizer, max_length: int) -> TokenizedSplit:
    enc = tokenizer(
        examples.text_a,
        examples.text_b,
        truncation=True,
        max_length=max_length,
        padding="max_length",
        return_tensors="pt",
    )
    return TokenizedSplit(
        input_ids=enc["input_ids"].long(),
        attention_mask=enc["attention_mask"].long(),
        labels=torch.tensor(examples.labels, dtype=torch.long),
        token_type_ids=enc["token_type_ids"].long() if "token_type_ids" in enc else None,
    )


def tokenized_cached(examples: TextExamples, tokenizer, max_length: int, cache_root: Path, key_parts: dict) -> TokenizedSplit:
    """Tokenise once per (data, tokenizer, max length); later calls load the tensors from disk."""
    fingerprint = hashlib.sha256()
    fingerprint.update(json.dumps(key_parts, sort_keys=True).encode())
    fingerprint.update(str(getattr(tokenizer, "name_or_path", "")).encode())
    fingerprint.update(str(len(examples)).encode())
    # Content hash over a sample of rows guards against a changed file under the same name.
    step = max(1, len(examples) // 64)
    for i in range(0, len(examples), step):
        fingerprint.update(examples.text_a[i].encode())
        fingerprint.update(str(examples.labels[i]).encode())
    path = cache_root / f"tok-{fingerprint.hexdigest()[:24]}.pt"
    if path.exists():
        try:
            return TokenizedSplit(**torch.load(path, weights_only=True))
        except Exception as exc:  # a truncated cache file must not break a run
            log.warning("ignoring unreadable token cache %s (%s)", path, exc)
    split = tokenize(examples, tokenizer, max_length)
    cache_root.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save(split.__dict__, tmp)
    os.replace(tmp, path)  # atomic: concurrent clients never read a half-written file
    return split


def _file_digest(path: str) -> str:
    """Content hash of a small file (the token cache must change when the listed rows do)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16] if path else ""


def client_shard(cfg: RunConfig, tokenizer, partition_id: int, num_partitions: int) -> TokenizedSplit:
    """The tokenised training shard of one silo."""
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition-id {partition_id} is outside [0, {num_partitions})")
    task = load_task(cfg)
    alpha = cfg["task.dirichlet-alpha"]
    layout = train_rows_layout(cfg["task.train-rows"], len(task.train), num_partitions)
    if layout is not None:  # the rows file places every row (a membership audit): no re-split
        partitions, declared = layout
        idx = [i for i, p in enumerate(partitions) if p == partition_id]
        shard = tokenized_cached(task.train.select(idx), tokenizer, cfg["task.max-length"], cache_dir(cfg),
                                 {"task": task.name, "split": "train", "part": partition_id, "of": num_partitions,
                                  "max_len": cfg["task.max-length"], "data": cfg["task.data-dir"],
                                  "rows": _file_digest(cfg["task.train-rows"]), "layout": "explicit"})
        return dataclasses.replace(shard, declared_size=int(declared[partition_id]))
    if cfg["task.partitioner"] == "fedpower":
        idx = partition_indices(len(task.train), num_partitions, partition_id, cfg["seed"],
                                labels=task.train.labels, dirichlet_alpha=alpha)
    else:  # flwr-datasets' IidPartitioner or DirichletPartitioner
        from .text_hub import flwr_partition_indices

        idx = flwr_partition_indices(task.train.labels, num_partitions, partition_id, cfg["seed"],
                                     cfg["task.partitioner"], alpha)
    key = {"task": task.name, "split": "train", "part": partition_id, "of": num_partitions,
           "seed": cfg["seed"], "max_len": cfg["task.max-length"], "data": cfg["task.data-dir"],
           "max_train": cfg["task.max-train"], "syn": cfg["task.synthetic-train-size"],
           "rows": _file_digest(cfg["task.train-rows"])}
    if cfg["task.validation-rows"]:  # (keys without it stay those of earlier caches)
        key["validation_rows"] = cfg["task.validation-rows"]
    if alpha:  # (IID shards keep their old cache keys)
        key["dirichlet_alpha"] = alpha
    if cfg["task.partitioner"] != "fedpower":
        key["partitioner"] = cfg["task.partitioner"]
    key.update(text_task_key(cfg))
    return tokenized_cached(task.train.select(idx), tokenizer, cfg["task.max-length"], cache_dir(cfg), key)


def eval_splits(cfg: RunConfig, tokenizer) -> dict[str, TokenizedSplit]:
    """All tokenised evaluation splits of the task (first = primary)."""
    task = load_task(cfg)
    out = {}
    for name, examples in task.eval_splits.items():
        key = {"task": task.name, "split": name, "seed": cfg["seed"], "max_len": cfg["task.max-length"],
               "data": cfg["task.data-dir"], "max_eval": cfg["task.max-eval"], "syn": cfg["task.synthetic-eval-size"]}
        key.update(text_task_key(cfg))
        if name == VALIDATION_SPLIT:
            key.update(validation_rows=cfg["task.validation-rows"], max_train=cfg["task.max-train"],
                       syn_train=cfg["task.synthetic-train-size"])
        out[name] = tokenized_cached(examples, tokenizer, cfg["task.max-length"], cache_dir(cfg), key)
    return out
