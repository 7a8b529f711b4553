"""Label-skewed (Dirichlet) shards: `task.dirichlet-alpha` > 0 gives every silo its IID shard size
but a label mix drawn from Dir(alpha K p). The shards are disjoint and cover the split, the skew
follows alpha, the run's token cache and checkpoints tell the schemes apart, and alpha 0 is the IID
split unchanged."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fedpower_app.runs import checkpoint as CK
from fedpower_app import data as D
from fedpower_app.config import ConfigError, parse_config
from fedpower_app.data.glue import iid_partition_indices, load_glue

from .test_glue import _shared

# SST-2's train split has 55.8 % positive labels; these stand-in labels have the same balance.
N_SST2, P_SST2 = 67_349, 0.5578


def _labels(n=N_SST2, p=P_SST2, seed=0):
    return (np.random.default_rng(seed).random(n) < p).astype(int).tolist()


def _shards(labels, k, alpha, seed=0):
    return [D.partition_indices(len(labels), k, i, seed, labels=labels, dirichlet_alpha=alpha) for i in range(k)]


def _positive_fractions(labels, shards):
    y = np.asarray(labels)
    return np.array([y[s].mean() for s in shards])


@pytest.mark.parametrize(("n", "k", "alpha"), [(50, 1, 0.5), (10, 3, 0.1), (101, 10, 0.5), (1_000, 7, 5.0), (N_SST2, 1_000, 0.5)])
def test_dirichlet_shards_are_disjoint_cover_the_split_and_keep_the_iid_sizes(n, k, alpha):
    labels = _labels(n)
    shards = _shards(labels, k, alpha)
    assert sorted(i for s in shards for i in s) == list(range(n))
    assert [len(s) for s in shards] == [len(iid_partition_indices(n, k, i, 0)) for i in range(k)]
    assert all(isinstance(i, int) for i in shards[0])


def test_the_label_skew_follows_alpha():
    """At 1,000 silos of ~67 examples: alpha 0.1 gives silos of nearly one label; alpha 1000 gives
    each silo the split's own mix, rounded to whole examples (closer to it than random IID shards,
    whose mix has a binomial std of sqrt(p(1-p)/67) = 0.061)."""
    labels = _labels()
    spread = {}
    for alpha in (0.1, 0.5, 1.0, 1000.0):
        frac = _positive_fractions(labels, _shards(labels, 1_000, alpha))
        spread[alpha] = float(np.mean(np.abs(frac - P_SST2)))
        if alpha == 0.1:
            assert np.mean((frac <= 0.1) | (frac >= 0.9)) > 0.7  # most silos hold >= 90 % one label
        if alpha == 1000.0:
            # rounding to whole examples; the last silos filled take what the pools have left
            # (q's own std is sqrt(p(1-p)/(alpha K + 1)) = 0.011, one example is 0.015)
            assert np.quantile(np.abs(frac - np.mean(labels)), 0.99) < 0.05
    assert spread[0.1] > spread[0.5] > spread[1.0] > spread[1000.0]
    iid = _positive_fractions(labels, [iid_partition_indices(N_SST2, 1_000, i, 0) for i in range(1_000)])
    assert spread[1000.0] < 0.5 * float(np.mean(np.abs(iid - P_SST2))) < spread[1.0]


def test_dirichlet_shards_on_the_real_sst2_labels():
    data = load_glue("sst2", _shared("SST-2"))
    labels = list(data.train.labels)
    shards = _shards(labels, 1_000, 0.5)
    frac = _positive_fractions(labels, shards)
    assert sorted(i for s in shards for i in s) == list(range(len(labels)))
    assert {len(s) for s in shards} == {67, 68}
    assert np.mean((frac <= 0.1) | (frac >= 0.9)) > 0.4  # far from the IID shards' mix
    assert frac.mean() == pytest.approx(np.mean(labels), abs=1e-3)  # every example is placed once


def test_dirichlet_shards_are_deterministic_and_alpha_zero_is_the_iid_split():
    labels = _labels(2_000)
    a = D.partition_indices(2_000, 20, 3, 7, labels=labels, dirichlet_alpha=0.5)
    assert a == D.partition_indices(2_000, 20, 3, 7, labels=list(labels), dirichlet_alpha=0.5)
    assert a != D.partition_indices(2_000, 20, 3, 8, labels=labels, dirichlet_alpha=0.5)
    assert a != D.partition_indices(2_000, 20, 3, 7, labels=labels, dirichlet_alpha=0.6)
    assert D.partition_indices(2_000, 20, 3, 7, labels=labels) == iid_partition_indices(2_000, 20, 3, 7)


def test_more_than_two_labels_and_a_label_no_silo_wants():
    """MNLI-like three labels, one of them rare: every example still lands in exactly one shard."""
    rng = np.random.default_rng(1)
    labels = rng.choice(3, size=3_001, p=[0.49, 0.49, 0.02]).tolist()
    shards = _shards(labels, 50, 0.05)
    assert sorted(i for s in shards for i in s) == list(range(3_001))
    per_label = [sum(np.asarray(labels)[s].tolist().count(c) for s in shards) for c in range(3)]
    assert per_label == [labels.count(c) for c in range(3)]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"alpha": -1.0}, "finite number > 0"),
    ({"alpha": float("nan")}, "finite number > 0"),
    ({"alpha": float("inf")}, "finite number > 0"),
    ({"k": 11}, "non-empty partitions"),
    ({"pid": 5}, "partition_id"),
])
def test_dirichlet_partition_rejects_bad_arguments(kwargs, message):
    args = {"alpha": 0.5, "k": 5, "pid": 0, **kwargs}
    with pytest.raises(ValueError, match=message):
        D.dirichlet_partition_indices(_labels(10), args["k"], args["pid"], 0, args["alpha"])


def test_a_dirichlet_partition_needs_the_labels():
    with pytest.raises(ValueError, match="needs the split's labels"):
        D.partition_indices(10, 2, 0, 0, dirichlet_alpha=0.5)
    with pytest.raises(ValueError, match="needs the split's labels"):
        D.partition_indices(10, 2, 0, 0, labels=[0, 1], dirichlet_alpha=0.5)


@pytest.mark.parametrize("bad", [-0.5, float("nan"), float("inf"), "x"])
def test_a_bad_alpha_fails_at_config_time_naming_the_key(bad):
    with pytest.raises(ConfigError, match="task.dirichlet-alpha"):
        parse_config({"task.dirichlet-alpha": bad})


def test_a_silo_trains_on_its_label_skewed_shard(tmp_path):
    """client_shard, the one entry every client and benchmark uses: with alpha > 0 the shard has
    the Dirichlet rows and labels, and does not reuse the IID shard's token cache."""
    from fedpower_app import model as M

    base = {"task.max-length": 16, "task.synthetic-train-size": 400,
            "task.synthetic-eval-size": 16, "task.cache-dir": str(tmp_path)}
    tok = M.load_tokenizer("minilm")
    iid_cfg, skew_cfg = parse_config(base), parse_config({**base, "task.dirichlet-alpha": 0.05})
    labels = D.load_task(skew_cfg).train.labels
    expected = _shards(labels, 8, 0.05)
    skewed = [D.client_shard(skew_cfg, tok, i, 8) for i in range(8)]
    iid = D.client_shard(iid_cfg, tok, 0, 8)
    for i, shard in enumerate(skewed):
        assert shard.labels.tolist() == [labels[j] for j in expected[i]]
    assert len(list(tmp_path.glob("tok-*.pt"))) == 9  # 8 skewed shards + 1 IID, none shared
    assert torch.equal(iid.labels, torch.tensor([labels[j] for j in iid_partition_indices(400, 8, 0, 0)]))
    majority = [max(s.labels.float().mean().item(), 1 - s.labels.float().mean().item()) for s in skewed]
    assert np.mean(majority) > 0.85  # alpha 0.05: silos of (nearly) one label


def test_a_checkpoint_written_before_the_partition_key_existed_still_resumes(tmp_path):
    """task.dirichlet-alpha = 0 (IID, the default) is how every earlier run split its data, so a
    checkpoint of a config without the key resumes; a skewed run is refused, naming the key."""
    cfg = parse_config({"num-server-rounds": 3}).to_dict()
    old = {k: v for k, v in cfg.items() if k != "task.dirichlet-alpha"}
    CK.save_checkpoint(tmp_path, {"round": 1, "strategy": cfg["strategy.name"], "fingerprint": CK.config_fingerprint(old),
                                  "config_json": json.dumps(old), "global_state": {}, "privacy": {}, "results": {}})
    assert CK.load_checkpoint(tmp_path, config=cfg, strategy=cfg["strategy.name"])["round"] == 1
    with pytest.raises(CK.CheckpointError, match=r"differs in: task.dirichlet-alpha"):
        CK.load_checkpoint(tmp_path, config={**cfg, "task.dirichlet-alpha": 0.5}, strategy=cfg["strategy.name"])
