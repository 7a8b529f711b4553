"""The head on frozen sentence features (``train.what = "head"``): the pair split, the model's
forward against the cached features, the closed-form per-example gradients, the DP-SGD step of the
head (clip, noise, empty batches), a silo's head round through ``train_round``, evaluation through
the cache, the class prior, and the plan that chooses what to train."""

from __future__ import annotations

import math

import pytest
import torch

from fedpower_app import model as M
from fedpower_app.config import ConfigError, parse_config
from fedpower_app.data.pipeline import TokenizedSplit
from fedpower_app.training.dp_sgd import DPSGDParams
from fedpower_app.training.features import (FeatureSplit, class_weights, dp_sgd_head, feature_logits, feature_spec,
                                            features_of, head_tensors, parse_class_prior,
                                            per_example_head_gradients, split_pair)

from .tiny_bert import save_tiny_bert

CPU = torch.device("cpu")
PAIRS = [("a cat sat on the mat", "the cat is sitting"), ("it rains", "the sun shines brightly today"),
         ("he plays chess", "chess is played by him"), ("birds fly south in winter", "no"),
         ("stocks fell sharply", "markets were down"), ("a b c d e f g h", "x")]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert-2"), num_layers=2)


def pair_cfg(model_dir, **extra):
    return parse_config({"model.name": model_dir, "lora.rank": 4, "task.max-length": 24, "task.name": "text",
                         "task.labels": "no,yes", "task.text-column": "s1", "task.text-pair-column": "s2",
                         "task.label-column": "y", "train.what": "head", "dp.noise": "seeded", **extra})


def pair_split(model_dir, max_length=24) -> TokenizedSplit:
    tok = M.load_tokenizer(model_dir)
    enc = tok([a for a, _ in PAIRS], [b for _, b in PAIRS], truncation=True, max_length=max_length,
              padding="max_length", return_tensors="pt")
    labels = torch.tensor([i % 2 for i in range(len(PAIRS))])
    return TokenizedSplit(enc["input_ids"], enc["attention_mask"], labels, enc["token_type_ids"])


def test_a_pair_is_split_into_its_two_sentences_each_as_encoded_alone(tiny_dir):
    tok = M.load_tokenizer(tiny_dir)
    split = pair_split(tiny_dir)
    (ids_a, mask_a), (ids_b, mask_b) = split_pair(split.input_ids, split.attention_mask, split.token_type_ids)
    for i, (a, b) in enumerate(PAIRS):
        alone_a = tok(a)["input_ids"]
        alone_b = tok(b)["input_ids"]
        assert ids_a[i][mask_a[i].bool()].tolist() == alone_a  # [CLS] a [SEP]
        assert ids_b[i][mask_b[i].bool()].tolist() == alone_b  # [CLS] b [SEP]
        assert mask_b[i][: len(alone_b)].all() and not mask_b[i][len(alone_b):].any()  # left-aligned


def test_the_models_forward_is_the_head_on_the_cached_features(tiny_dir):
    cfg = pair_cfg(tiny_dir)
    model = M.build_model(cfg, 2)
    spec = feature_spec(model)
    assert spec.pair and spec.dim == 4 * 64
    weight, bias = head_tensors(model)
    assert weight.shape == (2, 256) and not weight.any() and not bias.any()  # a zero head
    with torch.no_grad():
        weight.normal_(generator=torch.Generator().manual_seed(0))
        bias.fill_(0.3)
    split = pair_split(tiny_dir)
    model.eval()
    with torch.no_grad():
        forward = model(**split.batch(torch.arange(len(PAIRS)), CPU)).logits
    feats = features_of(model, split)
    assert features_of(model, split) is feats  # computed once per split
    torch.testing.assert_close(feature_logits(model, feats), forward, rtol=1e-4, atol=1e-5)
    u, v = feats.features[:, :64], feats.features[:, 64:128]
    torch.testing.assert_close(u.norm(dim=1), torch.ones(len(PAIRS)))  # unit sentence embeddings
    torch.testing.assert_close(feats.features[:, 128:192], (u - v).abs())
    # the state the server averages: LoRA (untouched) and the head, an extra
    state = M.adapter_state(model)
    _, extras = M.split_adapter_keys(state)
    assert sorted(extras) == ["base_model.model.classifier.bias", "base_model.model.classifier.weight"]


def test_closed_form_per_example_gradients_equal_autograd():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(7, 5, generator=gen)
    y = torch.tensor([0, 2, 1, 1, 0, 2, 2])
    w = torch.randn(3, 5, generator=gen, requires_grad=True)
    b = torch.randn(3, generator=gen, requires_grad=True)
    cw = torch.tensor([0.5, 1.0, 2.0])
    r, norms, loss = per_example_head_gradients(w.detach(), b.detach(), x, y, cw)
    for i in range(len(y)):
        li = cw[y[i]] * torch.nn.functional.cross_entropy((x[i:i + 1] @ w.t() + b), y[i:i + 1])
        gw, gb = torch.autograd.grad(li, (w, b))
        torch.testing.assert_close(torch.outer(r[i], x[i]), gw)
        torch.testing.assert_close(r[i], gb)
        torch.testing.assert_close(norms[i], torch.cat([gw.flatten(), gb]).norm())


class _Head(torch.nn.Module):
    def __init__(self, dim, k):
        super().__init__()
        self.modules_to_save = torch.nn.Linear(dim, k)
        torch.nn.init.zeros_(self.modules_to_save.weight)
        torch.nn.init.zeros_(self.modules_to_save.bias)


def _feature_data(n=64, dim=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 2, (n,), generator=gen)
    x = torch.nn.functional.normalize(torch.randn(n, dim, generator=gen) + 2.0 * y.unsqueeze(1).float(), dim=1)
    return FeatureSplit(x, y)


def test_a_noiseless_unclipped_dp_step_is_the_mean_gradient_step_over_b():
    data = _feature_data()
    head = _Head(6, 2)
    params = DPSGDParams(0.0, 1e6, len(data), 1)  # q = 1: every row in; no clip, no noise
    dp_sgd_head(head, data, params=params, lr=0.1, sampling_generator=torch.Generator().manual_seed(0),
                noise_generator=torch.Generator().manual_seed(0), optimizer="sgd")
    r, _, _ = per_example_head_gradients(torch.zeros(2, 6), torch.zeros(2), data.features, data.labels)
    torch.testing.assert_close(head.modules_to_save.weight, -0.1 * (r.t() @ data.features) / len(data))
    torch.testing.assert_close(head.modules_to_save.bias, -0.1 * r.sum(0) / len(data))


def test_each_example_is_clipped_to_the_sensitivity_and_the_noise_is_sigma_c_over_b():
    data = _feature_data(n=32)
    # clipped, no noise: one step's update is the sum of per-example gradients each of norm <= C
    head = _Head(6, 2)
    clip = 0.05
    dp_sgd_head(head, data, params=DPSGDParams(0.0, clip, 32, 1), lr=1.0,
                sampling_generator=torch.Generator().manual_seed(0), noise_generator=None, optimizer="sgd")
    r, norms, _ = per_example_head_gradients(torch.zeros(2, 6), torch.zeros(2), data.features, data.labels)
    assert (norms > clip).all()
    x1 = torch.cat([data.features, torch.ones(32, 1)], dim=1)
    want = sum(torch.outer(r[i], x1[i]) * clip / (norms[i] + 1e-6) for i in range(32)) / 32
    got = -torch.cat([head.modules_to_save.weight, head.modules_to_save.bias.unsqueeze(1)], dim=1)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    # head clipped apart: the head is all that trains, so its clip is the whole bound sqrt(C^2 + C_h^2)
    assert DPSGDParams(1.0, 0.3, 8, 1, head_clip=0.4).sensitivity == pytest.approx(0.5)
    # noise only (a Poisson batch that drew no row): the update's std is sigma * C / b
    empty = FeatureSplit(torch.ones(1, 6), torch.zeros(1, dtype=torch.long), declared_size=10 ** 9)
    head = _Head(6, 2)
    stats = dp_sgd_head(head, empty, params=DPSGDParams(2.0, 0.5, 10, 1), lr=1.0,
                        sampling_generator=torch.Generator().manual_seed(0),
                        noise_generator=torch.Generator().manual_seed(3), optimizer="sgd")
    assert stats.empty_steps == 1 and stats.examples_seen == 0  # a noise-only step, never a skipped one
    assert head.modules_to_save.weight.std().item() == pytest.approx(2.0 * 0.5 / 10, rel=0.5)


def test_a_head_round_trains_the_head_only_and_evaluation_uses_the_features(tiny_dir):
    from fedpower_app.training import evaluate
    from fedpower_app.training.silo_round import train_round

    cfg = pair_cfg(tiny_dir, **{"train.lr": 0.1})
    model = M.build_model(cfg, 2)
    split = pair_split(tiny_dir)
    before = M.adapter_state(model)
    params = DPSGDParams(1.0, 1.0, 3, 4)
    stats = train_round(cfg, model, split, partition_id=0, server_round=1, train_lora="AB", params=params)
    assert stats.steps == 4
    after = M.adapter_state(model)
    for key in before:
        moved = not torch.equal(before[key], after[key])
        assert moved == ("classifier" in key), key  # LoRA untouched, the head trained
    model.eval()
    res = evaluate(model, split, batch_size=4)
    with torch.no_grad():
        logits = model(**split.batch(torch.arange(len(PAIRS)), CPU)).logits
    assert res["accuracy"] == pytest.approx((logits.argmax(-1) == split.labels).float().mean().item())
    assert res["loss"] == pytest.approx(torch.nn.functional.cross_entropy(logits, split.labels).item(), rel=1e-4)


def test_the_frozen_prefix_cache_of_a_head_run_is_its_features(tiny_dir):
    from fedpower_app.training.frozen_prefix import build_prefix_cache

    cfg = pair_cfg(tiny_dir, **{"train.cache-frozen": True})
    model = M.build_model(cfg, 2)
    split = pair_split(tiny_dir)
    cached = build_prefix_cache(model, split, device=CPU)
    assert isinstance(cached, FeatureSplit) and cached.features.shape == (len(PAIRS), 256)


def test_config_keys_of_what_to_train():
    assert parse_config({"train.what": "head"})["train.what"] == "head"
    with pytest.raises(ConfigError, match="train.what"):
        parse_config({"train.what": "everything"})
    with pytest.raises(ConfigError, match="train.head-rounds"):
        parse_config({"train.what": "head-then-adapters", "num-server-rounds": 4, "train.head-rounds": 4})
    with pytest.raises(ConfigError, match="DP-SGD on the silos"):
        parse_config({"train.what": "head", "dp.noise-at": "server"})
    with pytest.raises(ConfigError, match="train.class-prior"):
        parse_config({"train.class-prior": "0.5,0.6"})
    assert parse_class_prior("0.85, 0.15") == [0.85, 0.15]
    weights = class_weights(parse_config({"train.class-prior": "0.8,0.2"}), 2)
    torch.testing.assert_close(weights, torch.tensor([1 / 1.6, 1 / 0.4]))  # each class weighs the same in all
    assert class_weights(parse_config({}), 2) is None


def test_the_plan_chooses_the_head_on_small_silos_and_the_adapters_on_the_recipes():
    from fedpower_app.privacy.recommend import HEAD_CLIP, MIN_ADAPTER_STEPS, recommend, render

    small = recommend([1666] * 6, 8.0, 1e-5)
    assert small.what == "head" and small.clip == HEAD_CLIP and small.batch_size == 417
    assert small.local_steps * small.rounds == 100 and small.overrides()["train.what"] == "head"
    assert small.overrides(train_head=True)["dp.head-clip"] == 0.0
    assert "train.what = head" in small.reasons[0] and "6.1x" in small.reasons[0]
    assert "train.what = head" in render(small)
    large = recommend([11224] * 6, 8.0, 1e-5)
    assert large.what == "adapters" and large.local_steps * large.rounds >= MIN_ADAPTER_STEPS
    assert "train.what = adapters" in large.reasons[0]
    # the non-private comparator trains what the private plan chose, at its compute
    nonprivate = recommend([1666] * 6, 8.0, 1e-5, private=False)
    assert nonprivate.what == "head" and nonprivate.batch_size == small.batch_size
    # the recipe's silos at epsilon 3 (1.64x its noise, measured 0.822) keep the adapters; at epsilon 1
    # (3.6x) the head is chosen up to larger silos
    assert recommend([11224] * 6, 3.0, 1e-5).what == "adapters"
    assert recommend([11224] * 6, 1.0, 1e-5).what == "head"
    assert recommend([5000] * 6, 8.0, 1e-5).what == "head" and recommend([7000] * 6, 8.0, 1e-5).what == "adapters"
    # the head's sigma is the accountant's for its q and steps
    from fedpower_app.privacy.accounting.silo import dp_sgd_epsilon

    eps = dp_sgd_epsilon([(small.sample_rate, small.noise_multiplier, 100)], 1e-5)
    assert eps == pytest.approx(8.0, rel=2e-3) and math.isfinite(eps)


def test_the_adapter_rounds_of_head_then_adapters_train_through_the_feature_map(tiny_dir):
    """LP-FT: the head's rounds leave LoRA alone; later rounds train the adapters through the
    same forward (each sentence of a pair encoded apart: two passes through the LoRA layers), and
    Opacus' per-example gradients, summed unclipped and noiseless, are the batch's gradient."""
    from fedpower_app.training.silo_round import head_phase, train_round

    cfg = pair_cfg(tiny_dir, **{"train.what": "head-then-adapters", "num-server-rounds": 3, "train.head-rounds": 1,
                                "model.train-head": True, "train.lr": 0.01})
    assert head_phase(cfg, 1) and not head_phase(cfg, 2)
    split = pair_split(tiny_dir)
    states = []
    for params in (DPSGDParams(0.0, 1e6, 10 ** 6, 1), None):  # q = 1 (every row), no clip, no noise; plain
        model = M.build_model(cfg, 2)
        train_round(cfg, model, split, partition_id=0, server_round=1, train_lora="AB", params=DPSGDParams(1.0, 1.0, 3, 2))
        head = {k: v for k, v in M.adapter_state(model).items() if "classifier" in k}
        assert all(not v.any() for k, v in M.adapter_state(model).items() if "lora_B" in k)  # head round: B = 0
        data = split if params is None else TokenizedSplit(split.input_ids, split.attention_mask, split.labels,
                                                           split.token_type_ids)
        cfg2 = cfg if params is not None else parse_config({**cfg.values, "train.local-steps": 1,
                                                            "train.batch-size": len(PAIRS), "dp.level": "none"})
        if params is not None:
            params = DPSGDParams(0.0, 1e6, len(PAIRS), 1)
            data.declared_size = None
        torch.manual_seed(0)
        train_round(cfg2, model, data, partition_id=0, server_round=2, train_lora="AB", params=params)
        states.append(M.adapter_state(model))
        assert any(v.any() for k, v in states[-1].items() if "lora_B" in k)  # the adapters moved
        assert head.keys() <= states[-1].keys()
    for key in states[0]:
        torch.testing.assert_close(states[0][key], states[1][key], rtol=1e-4, atol=1e-6)


def test_the_final_line_says_when_a_model_ends_at_the_majority_baseline():
    from fedpower_app.training.metrics import baseline_verdict

    at = baseline_verdict({"accuracy": 0.652, "majority-accuracy": 0.652}, "accuracy")
    assert "AT THE MAJORITY BASELINE 0.6520" in at
    assert baseline_verdict({"accuracy": 0.80, "majority-accuracy": 0.652}) == "; majority baseline 0.6520"
    f1 = baseline_verdict({"macro-f1": 0.47, "majority-macro-f1": 0.468, "majority-accuracy": 0.881}, "macro-f1")
    assert "AT THE MAJORITY BASELINE" in f1
    bal = baseline_verdict({"balanced-accuracy": 0.5, "majority-macro-f1": 0.468, "majority-accuracy": 0.881},
                           "balanced-accuracy")
    assert "AT THE MAJORITY BASELINE 0.5000" in bal  # a constant answer's balanced accuracy: 1/K
    assert baseline_verdict({"accuracy": 0.8}) == ""


def test_class_weights_act_after_the_clip_and_keep_each_example_within_it():
    data = _feature_data(n=40, seed=2)
    weights = torch.tensor([0.5, 2.0])  # 1 / (K pi) for pi = (1.0, 0.25) (unnormalised here on purpose)
    head = _Head(6, 2)
    clip = 0.1
    dp_sgd_head(head, data, params=DPSGDParams(0.0, clip, 40, 1), lr=1.0, optimizer="sgd",
                sampling_generator=torch.Generator().manual_seed(0), noise_generator=None, class_weight=weights)
    r, norms, _ = per_example_head_gradients(torch.zeros(2, 6), torch.zeros(2), data.features, data.labels)
    x1 = torch.cat([data.features, torch.ones(40, 1)], dim=1)
    scale = (weights / weights.max())[data.labels]  # the rare class at 1, the other at 1/4
    want = sum(torch.outer(r[i], x1[i]) * min(1.0, clip / (norms[i] + 1e-6)) * scale[i] for i in range(40)) / 40
    got = -torch.cat([head.modules_to_save.weight, head.modules_to_save.bias.unsqueeze(1)], dim=1)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_a_saved_head_model_reloads_as_the_model_it_evaluated(tiny_dir, tmp_path):
    from fedpower_app.released import load_released, save_released

    cfg = pair_cfg(tiny_dir)
    model = M.build_model(cfg, 2)
    weight, bias = head_tensors(model)
    with torch.no_grad():
        weight.normal_(generator=torch.Generator().manual_seed(1))
        bias.fill_(-0.2)
    split = pair_split(tiny_dir)
    batch = split.batch(torch.arange(len(PAIRS)), CPU)
    model.eval()
    with torch.no_grad():
        expected = model(**batch).logits
    save_released(model, tmp_path / "adapter", base_model=tiny_dir, num_labels=2)
    reloaded, _tok = load_released(tmp_path / "adapter")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch).logits, expected, rtol=1e-5, atol=1e-6)


def test_each_phase_of_head_then_adapters_clips_to_its_own_bound(tiny_dir, monkeypatch):
    """LP-FT: a head round clips the head's gradient to dp.head-clip, an adapter round the adapters'
    to dp.clip under the head the probe left (frozen); sigma, b and L are the message's in both, so
    the ledger's charge is the one the message states. At one shared clip the adapters' C = 0.035
    clips every head gradient (norms near 1) to the same force, and the measured probe ended at the
    majority class (RESULTS.md, "Small silos")."""
    from fedpower_app.training import silo_round
    from fedpower_app.training.silo_round import phase_params, train_round

    cfg = pair_cfg(tiny_dir, **{"train.what": "head-then-adapters", "num-server-rounds": 3, "train.head-rounds": 1,
                                "model.train-head": True, "train.lr": 0.01})
    sent = DPSGDParams(1.3, 0.035, 4, 2, head_clip=1.0)
    head_round, adapter_round = phase_params(cfg, sent, 1), phase_params(cfg, sent, 2)
    assert (head_round.clip, head_round.head_clip, head_round.sensitivity) == (1.0, 0.0, 1.0)
    assert (adapter_round.clip, adapter_round.head_clip, adapter_round.sensitivity) == (0.035, 0.0, 0.035)
    for derived in (head_round, adapter_round):
        assert (derived.noise_multiplier, derived.batch_size, derived.local_steps) == (1.3, 4, 2)
    # without dp.head-clip the head's rounds clip to dp.clip; an adapters run applies what it is sent
    assert phase_params(cfg, DPSGDParams(1.3, 0.5, 4, 2), 1).clip == 0.5
    adapters_cfg = pair_cfg(tiny_dir, **{"train.what": "adapters", "model.train-head": True})
    assert phase_params(adapters_cfg, sent, 1) is sent
    assert phase_params(cfg, None, 1) is None

    # the head round's DP-SGD runs at the head's clip
    seen = []
    real = silo_round._train_head_round
    monkeypatch.setattr(silo_round, "_train_head_round",
                        lambda *a, **k: (seen.append(k["params"]), real(*a, **k))[1])
    model = M.build_model(cfg, 2)
    split = pair_split(tiny_dir)
    train_round(cfg, model, split, partition_id=0, server_round=1, train_lora="AB", params=sent)
    assert seen == [head_round]
    head = {k: v.clone() for k, v in M.adapter_state(model).items() if "classifier" in k}
    assert any(v.any() for v in head.values())
    # the adapter round moves LoRA and leaves the head as the head round left it
    train_round(cfg, model, split, partition_id=0, server_round=2, train_lora="AB",
                params=DPSGDParams(0.0, 1e6, len(PAIRS), 1))
    after = M.adapter_state(model)
    assert any(v.any() for k, v in after.items() if "lora_B" in k)
    for key, value in head.items():
        torch.testing.assert_close(after[key], value)


def test_the_small_silos_benchmark_reports_on_carved_rows_and_runs_a_grid_beside_the_rule(tmp_path):
    """``benchmarks.small_silos --carve N``: the settings are checked on rows held out of train (a
    seeded draw, disjoint from the silos' rows), never on the split the results report."""
    import json

    from benchmarks.small_silos import carve, main

    g = torch.Generator().manual_seed(0)
    x = torch.nn.functional.normalize(torch.randn(400, 8, generator=g), dim=1)
    y = (x[:, 0] > 0).long()
    (xr, yr), (xh, yh) = carve((x, y), 100)
    assert len(yh) == 100 and len(yr) == 300
    rest, held = {tuple(r.tolist()) for r in xr}, {tuple(r.tolist()) for r in xh}
    assert not rest & held and len(rest | held) == 400
    assert torch.equal(carve((x, y), 100)[1][0], xh)  # seeded: the same rows every time
    with pytest.raises(ValueError, match="--carve"):
        carve((x, y), 400)
    features = tmp_path / "f.pt"
    torch.save({"train": (x, y), "dev": (x[:10], 1 - y[:10])}, features)  # a dev split that reads wrong
    out = tmp_path / "grid.json"
    assert main(["--features", str(features), "--carve", "100", "--rows", "40", "--seeds", "1", "--plan", "grid",
                 "--grid-rates", "0.5", "--grid-steps", "8", "--grid-lrs", "0.1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["evaluated_on"] == "100 rows carved from train"
    assert [r["setting"] for r in report["rows"]] == ["q=0.5 steps=8 lr=0.1", "rule"]
    assert all(r["accuracy_mean"] > 0.5 for r in report["rows"])  # scored on carved rows, not the flipped dev
