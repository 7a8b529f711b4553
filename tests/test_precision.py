"""train.precision: the forward under bf16 autocast (on a GPU by default, on a CPU when asked),
with the DP arithmetic in float32 so that the clip, and the sensitivity behind the printed ε, hold
whatever the precision of the per-example gradients."""

from __future__ import annotations

import math

import pytest
import torch

from fedpower_app import data as D
from fedpower_app import model as M
from fedpower_app.config import ConfigError, parse_config
from fedpower_app.training.dp_sgd import DPSGDParams, dp_optimizer, dp_sgd_train_local
from fedpower_app.training import loops
from fedpower_app.training.loops import _autocast, train_local

from .tiny_bert import save_tiny_bert

CPU = torch.device("cpu")


def _bf16_rows(n: int = 200, dim: int = 2000) -> torch.Tensor:
    """bf16 per-example gradients of norm ~45, far above the clips below."""
    return torch.randn(n, dim, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)


def _clipped_contribution(optimizer_for, named, grad_samples) -> float:
    """The norm of one example's clipped gradient as the optimizer sums it (float32)."""
    for (_, p), gs in zip(named, grad_samples):
        p.grad_sample = gs.unsqueeze(0)
        p.summed_grad = None
    opt = optimizer_for(named)
    opt.clip_and_accumulate()
    return math.sqrt(sum(float(p.summed_grad.double().pow(2).sum()) for _, p in named))


@pytest.mark.parametrize("head", [False, True])
def test_bf16_per_example_gradients_are_clipped_to_at_most_c(head):
    # Opacus takes the norm in the gradients' dtype and sums their float32 upcast: with bf16
    # gradients a norm rounded down lets the clipped example exceed C (the first assertion shows
    # the raw Opacus optimizer doing so). The product's optimizers take the norm in float32.
    from opacus.optimizers import DPOptimizer

    clip = 0.05
    a = torch.nn.Parameter(torch.zeros(2000))
    named = [("base_model.model.layer.lora_A.default.weight", a)]
    if head:
        h = torch.nn.Parameter(torch.zeros(8))
        named.append(("base_model.model.classifier.modules_to_save.default.weight", h))
    params = DPSGDParams(0.0, clip, 1, 1, head_clip=clip if head else 0.0)
    bound = params.sensitivity

    def product(nm):
        return dp_optimizer(torch.optim.SGD([p for _, p in nm], lr=1.0), nm, params)

    def raw_opacus(nm):
        return DPOptimizer(torch.optim.SGD([p for _, p in nm], lr=1.0), noise_multiplier=0.0, max_grad_norm=clip,
                           expected_batch_size=1)

    over = 0
    for row in _bf16_rows():
        grads = [row]
        if head:
            grads.append(torch.full((8,), 7.0, dtype=torch.bfloat16))
        ours = _clipped_contribution(product, named, grads)
        assert ours <= bound * (1 + 1e-6)
        assert ours == pytest.approx(bound, rel=1e-5)  # attained
        if not head:
            over += _clipped_contribution(raw_opacus, named, grads) > clip * (1 + 1e-3)
    if not head:
        assert over >= 10  # the raw optimizer lets some examples exceed C by more than 0.1%


def test_precision_is_validated():
    assert parse_config({})["train.precision"] == "auto"
    with pytest.raises(ConfigError, match="train.precision"):
        parse_config({"train.precision": "fp16"})
    with pytest.raises(ValueError, match="precision"):
        with _autocast(CPU, "half"):
            pass


def test_autocast_is_bf16_only_when_asked_on_a_cpu():
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    for precision, dtype in (("auto", torch.float32), ("fp32", torch.float32), ("bf16", torch.bfloat16)):
        with _autocast(CPU, precision):
            assert (x @ w).dtype == dtype


def test_bf16_is_announced_once_and_warned_where_the_cpu_emulates_it(monkeypatch, caplog):
    """A user who sets bf16 sees that it was taken, once per process, and is told where it will be
    slower than float32 (no AVX512-BF16 or AMX-BF16: torch emulates bf16)."""
    loops._announce_precision.cache_clear()
    monkeypatch.setattr(loops, "cpu_has_native_bf16", lambda: False)
    with caplog.at_level("INFO", logger=loops.log.name):
        for _ in range(3):
            with _autocast(CPU, "bf16"):
                pass
        with _autocast(CPU, "auto"):  # float32 on a CPU, as always: nothing to say
            pass
    said = [r for r in caplog.records if r.name == loops.log.name]
    assert [r.levelname for r in said] == ["INFO", "WARNING"]
    assert "bf16 autocast on cpu" in said[0].getMessage() and "float32" in said[0].getMessage()
    assert "without AVX512-BF16" in said[1].getMessage()
    loops._announce_precision.cache_clear()
    monkeypatch.setattr(loops, "cpu_has_native_bf16", lambda: True)
    caplog.clear()
    with caplog.at_level("INFO", logger=loops.log.name):
        with _autocast(CPU, "bf16"):
            pass
    assert [r.levelname for r in caplog.records if r.name == loops.log.name] == ["INFO"]
    loops._announce_precision.cache_clear()


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert-precision"), num_layers=2)


def _tiny(model_dir):
    cfg = parse_config({"model.name": model_dir, "lora.rank": 4, "lora.dropout": 0.0, "task.max-length": 16,
                        "task.synthetic-train-size": 64, "task.synthetic-eval-size": 16, "model.train-head": True})
    return M.build_model(cfg, 2), D.client_shard(cfg, M.load_tokenizer(model_dir), 0, 1)


def test_a_bf16_dp_step_clips_like_a_float32_one_and_moves_the_same_way(tiny_model_dir):
    # b = n = 1, no noise, SGD lr 1: the update is the clipped gradient, of norm exactly C in either
    # precision; the bf16 step points where the float32 one does.
    model, shard = _tiny(tiny_model_dir)
    one = D.TokenizedSplit(shard.input_ids[:1], shard.attention_mask[:1], shard.labels[:1],
                           None if shard.token_type_ids is None else shard.token_type_ids[:1])
    start = M.adapter_state(model)

    def update(precision, clip):
        M.load_adapter_state(model, start)
        before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        dp_sgd_train_local(model, one, params=DPSGDParams(0.0, clip, 1, 1), lr=1.0,
                           sampling_generator=torch.Generator().manual_seed(0),
                           noise_generator=torch.Generator().manual_seed(1), device=CPU, optimizer="sgd",
                           precision=precision)
        return torch.cat([(p.detach() - before[n]).flatten() for n, p in model.named_parameters() if p.requires_grad])

    full32, full16 = update("fp32", 1e9), update("bf16", 1e9)
    assert float(full32.norm()) > 1e-3
    cos = float(full32 @ full16 / (full32.norm() * full16.norm()))
    assert cos > 0.98 and float(full16.norm()) == pytest.approx(float(full32.norm()), rel=0.05)
    clip = float(full32.norm()) / 4
    assert float(update("bf16", clip).norm()) <= clip * (1 + 1e-6)
    assert float(update("bf16", clip).norm()) == pytest.approx(clip, rel=1e-4)


def test_plain_training_in_bf16_learns_what_float32_learns(tiny_model_dir):
    model, shard = _tiny(tiny_model_dir)
    start = M.adapter_state(model)
    moved = {}
    for precision in ("fp32", "bf16"):
        M.load_adapter_state(model, start)
        before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        train_local(model, shard, steps=2, batch_size=16, lr=1e-2, generator=torch.Generator().manual_seed(0),
                    poisson=False, device=CPU, optimizer="sgd", precision=precision)
        moved[precision] = torch.cat([(p.detach() - before[n]).flatten()
                                      for n, p in model.named_parameters() if p.requires_grad])
        assert all(p.dtype == torch.float32 for p in model.parameters())  # the weights stay float32
    a, b = moved["fp32"], moved["bf16"]
    assert float(a.norm()) > 0
    assert float(a @ b / (a.norm() * b.norm())) > 0.98
