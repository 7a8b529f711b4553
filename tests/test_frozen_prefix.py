"""The frozen-prefix cache (``train.cache-frozen``, ``lora.top-layers``): training on the cached
hidden states of the layers below the lowest adapter is the same computation as training the whole
model (with their dropout off), for plain training and for DP-SGD."""

import pytest
import torch

from fedpower_app import data as D
from fedpower_app import model as M
from fedpower_app.config import parse_config
from fedpower_app.training.dp_sgd import DPSGDParams, dp_sgd_train_local
from fedpower_app.training.frozen_prefix import (CachedPrefixSplit, build_prefix_cache, lowest_adapted_layer,
                                        prefix_skipped)
from fedpower_app.training import train_local

from .tiny_bert import save_tiny_bert

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny3_dir(tmp_path_factory):
    """A 3-layer BERT (hidden 64, no dropout) with MiniLM's tokenizer, saved as a local model."""
    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert-3"), num_layers=3)


def setup(model_dir, **overrides):
    cfg = parse_config({"model.name": model_dir, "lora.rank": 4, "lora.dropout": 0.0, "task.max-length": 16,
                        "task.synthetic-train-size": 96, "task.synthetic-eval-size": 16, "lora.top-layers": 1,
                        "model.train-head": True, **overrides})
    model = M.build_model(cfg, 2)
    with torch.no_grad():  # B = 0 at init would hide a wrong layer: give every adapter an effect
        gen = torch.Generator().manual_seed(5)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    shard = D.client_shard(cfg, M.load_tokenizer(model_dir), 0, 1)
    return cfg, model, shard


def test_top_layers_put_lora_only_on_the_top_layers(tiny3_dir):
    _, model, _ = setup(tiny3_dir)
    adapted = {n.split(".encoder.layer.")[1].split(".")[0] for n, _ in model.named_parameters()
               if "lora_" in n}
    assert adapted == {"2"}
    assert not any("pooler" in n and "lora_" in n for n, _ in model.named_parameters())
    assert lowest_adapted_layer(model) == 2
    _, model2, _ = setup(tiny3_dir, **{"lora.top-layers": 2})
    assert lowest_adapted_layer(model2) == 1
    _, model_all, _ = setup(tiny3_dir, **{"lora.top-layers": 0})
    assert lowest_adapted_layer(model_all) == 0


def test_more_top_layers_than_the_model_has_is_refused(tiny3_dir):
    with pytest.raises(ValueError, match="lora.top-layers = 4 but the model has 3 layers"):
        setup(tiny3_dir, **{"lora.top-layers": 4})


def test_cached_logits_equal_the_full_models(tiny3_dir):
    _, model, shard = setup(tiny3_dir)
    cache = build_prefix_cache(model, shard, device=CPU, batch_size=7)
    assert isinstance(cache, CachedPrefixSplit) and len(cache) == len(shard) and cache.layer == 2
    assert cache.hidden.shape[0] == int(shard.attention_mask.sum())  # padding is not stored
    model.eval()
    idx = torch.arange(len(shard))[torch.randperm(len(shard), generator=torch.Generator().manual_seed(1))][:40]
    with torch.no_grad():
        full = model(**shard.batch(idx, CPU)).logits
        with prefix_skipped(model, cache.layer):
            cached = model(**cache.batch(idx, CPU)).logits
    torch.testing.assert_close(cached, full, rtol=1e-5, atol=1e-5)
    # the swap is undone: the model is whole again
    with torch.no_grad():
        torch.testing.assert_close(model(**shard.batch(idx, CPU)).logits, full)


def _adapters(model):
    return {k: v.clone() for k, v in M.adapter_state(model).items()}


def test_a_dp_sgd_round_on_the_cache_equals_one_on_the_tokens(tiny3_dir):
    params = DPSGDParams(noise_multiplier=0.7, clip=0.05, batch_size=24, local_steps=3, head_clip=0.05)
    results = []
    for cached in (False, True):
        _, model, shard = setup(tiny3_dir)
        data = build_prefix_cache(model, shard, device=CPU) if cached else shard
        stats = dp_sgd_train_local(model, data, params=params, lr=0.01,
                                   sampling_generator=torch.Generator().manual_seed(3),
                                   noise_generator=torch.Generator().manual_seed(4), device=CPU)
        results.append((stats, _adapters(model)))
    (s_tok, a_tok), (s_cache, a_cache) = results
    assert s_tok.examples_seen == s_cache.examples_seen > 0
    assert abs(s_tok.loss - s_cache.loss) < 1e-5
    for k in a_tok:
        torch.testing.assert_close(a_cache[k], a_tok[k], rtol=1e-4, atol=1e-6)
    _, fresh, _ = setup(tiny3_dir)
    assert any(not torch.equal(a_tok[k], v) for k, v in M.adapter_state(fresh).items())  # it trained


def test_a_plain_round_on_the_cache_equals_one_on_the_tokens(tiny3_dir):
    results = []
    for cached in (False, True):
        _, model, shard = setup(tiny3_dir)
        data = build_prefix_cache(model, shard, device=CPU) if cached else shard
        train_local(model, data, steps=2, batch_size=32, lr=0.01, generator=torch.Generator().manual_seed(3),
                    poisson=False, device=CPU)
        results.append(_adapters(model))
    for k in results[0]:
        torch.testing.assert_close(results[1][k], results[0][k], rtol=1e-4, atol=1e-6)


def test_the_silo_builds_its_cache_once_and_trains_on_it(tiny3_dir):
    from client_app import app as client

    cfg, model, _ = setup(tiny3_dir, **{"train.cache-frozen": True})
    first = client._training_split(cfg, 0, 2, model)
    assert isinstance(first, CachedPrefixSplit)
    assert client._training_split(cfg, 0, 2, model) is first  # reused, not rebuilt
    other = client._training_split(cfg, 1, 2, model)
    assert other is not first and client._training_split(cfg, 0, 2, model) is first  # silos side by side
    plain = parse_config({**cfg.values, "train.cache-frozen": False})
    assert not isinstance(client._training_split(plain, 0, 2, model), CachedPrefixSplit)


def test_a_silo_can_carry_its_adam_state_across_rounds(tiny3_dir):
    """train.optimizer-state = "run": round 2 resumes round 1's Adam moments and step count."""
    params = DPSGDParams(noise_multiplier=0.7, clip=0.05, batch_size=24, local_steps=2)
    outcomes = []
    for carry in (None, {}):
        _, model, shard = setup(tiny3_dir)
        for r in range(2):
            dp_sgd_train_local(model, shard, params=params, lr=0.01, sampling_generator=torch.Generator().manual_seed(r),
                               noise_generator=torch.Generator().manual_seed(10 + r), device=CPU, optimizer_carry=carry)
        outcomes.append((carry, _adapters(model)))
    (_, fresh), (carry, carried) = outcomes
    steps = {int(s["step"]) for s in carry["state"]["state"].values()}
    assert steps == {4}  # 2 rounds x 2 steps, one Adam
    assert any(not torch.allclose(fresh[k], carried[k]) for k in fresh)  # the moments changed round 2
    # another trainable set (FFA-LoRA freezes A) ignores a state that does not fit
    _, model, shard = setup(tiny3_dir)
    M.set_trainable(model, train_a=False, train_b=True)
    dp_sgd_train_local(model, shard, params=params, lr=0.01, sampling_generator=torch.Generator().manual_seed(0),
                       noise_generator=torch.Generator().manual_seed(1), device=CPU, optimizer_carry=carry)
    assert {int(s["step"]) for s in carry["state"]["state"].values()} == {2}


def test_mean_pooling_reads_the_masked_mean_of_the_last_layer(tiny3_dir):
    """model.pooling = "mean": the head sees the mean over the real tokens, whatever the padding,
    and the cached-prefix forward pools the same rows the same way."""
    _, model, shard = setup(tiny3_dir, **{"model.pooling": "mean"})
    model.eval()
    idx = torch.arange(12)
    batch = shard.batch(idx, CPU)
    with torch.no_grad():
        out = model(**batch, output_hidden_states=True)
        h = out.hidden_states[-1]
        m = batch["attention_mask"].unsqueeze(-1).float()
        pooled = (h * m).sum(1) / m.sum(1)
        head = model.base_model.model.classifier  # PEFT's wrapper of the trained head: calls the active copy
        torch.testing.assert_close(out.logits, head(pooled), rtol=1e-5, atol=1e-5)
        # padding does not move the pooled row: row 0 alone, padded to the batch's width or not
        alone = model(**shard.batch(idx[:1], CPU)).logits
        torch.testing.assert_close(alone, out.logits[:1], rtol=1e-4, atol=1e-5)
        cache = build_prefix_cache(model, shard, device=CPU)
        with prefix_skipped(model, cache.layer):
            cached = model(**cache.batch(idx, CPU)).logits
        torch.testing.assert_close(cached, out.logits, rtol=1e-5, atol=1e-5)
    _, pooler_model, _ = setup(tiny3_dir)
    with torch.no_grad():
        assert not torch.allclose(pooler_model.eval()(**batch).logits, out.logits)  # it changes the head's input


def test_a_released_mean_pooling_model_reloads_with_its_pooling(tiny3_dir, tmp_path):
    from fedpower_app.released import load_released, save_released

    cfg, model, shard = setup(tiny3_dir, **{"model.pooling": "mean"})
    model.eval()
    batch = shard.batch(torch.arange(8), CPU)
    with torch.no_grad():
        want = model(**batch).logits
    save_released(model, tmp_path / "adapter", base_model=tiny3_dir, num_labels=2, pooling="mean")
    loaded, _ = load_released(tmp_path / "adapter")
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch).logits, want, rtol=1e-5, atol=1e-5)


def test_model_dropout_sets_every_rate_of_the_pretrained_model(tiny3_dir):
    """model.dropout = 0: the train-mode forward is the eval-mode forward (LoRA's own dropout is
    0 here too); a rate above 0 reaches every dropout, so train mode then differs; -1 keeps the
    checkpoint's own rates."""
    _, model, shard = setup(tiny3_dir, **{"model.dropout": 0.0})
    assert all(m.p == 0.0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
    batch = shard.batch(torch.arange(8), CPU)
    with torch.no_grad():
        model.train()
        train_logits = model(**batch).logits
        model.eval()
        torch.testing.assert_close(train_logits, model(**batch).logits)
    _, noisy, _ = setup(tiny3_dir, **{"model.dropout": 0.3})
    rates = [m.p for m in noisy.base_model.model.modules() if isinstance(m, torch.nn.Dropout)]
    assert len(rates) >= 3 and all(p == 0.3 for p in rates)  # embeddings, attention, hidden, head
    with torch.no_grad():
        noisy.train()
        torch.manual_seed(0)
        train_logits = noisy(**batch).logits
        noisy.eval()
        assert not torch.allclose(train_logits, noisy(**batch).logits)
    _, kept, _ = setup(tiny3_dir)
    hidden = kept.base_model.model.config.hidden_dropout_prob
    assert kept.base_model.model.bert.embeddings.dropout.p == hidden
