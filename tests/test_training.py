"""Client-side sampling matches the accountant; local training and evaluation work on a real model."""

import math

import pytest
import torch

from fedpower_app.training import batch_indices


def test_poisson_batches_have_binomial_sizes():
    g = torch.Generator().manual_seed(0)
    sizes = torch.tensor([len(b) for b in batch_indices(1000, 50, 2000, g, poisson=True)], dtype=torch.float64)
    assert abs(sizes.mean().item() - 50) < 1.0  # E = n q = 50
    assert abs(sizes.var().item() - 1000 * 0.05 * 0.95) < 6.0  # Var = n q (1 - q)
    assert sizes.min() < 40 and sizes.max() > 60  # sizes really vary (not fixed-size batches)


def test_poisson_inclusion_is_independent_per_example():
    g = torch.Generator().manual_seed(1)
    counts = torch.zeros(200)
    for b in batch_indices(200, 20, 5000, g, poisson=True):
        counts[b] += 1
    assert abs(counts.mean().item() / 5000 - 0.1) < 0.003
    assert counts.std().item() / 5000 < 0.01  # every example has the same rate


def test_shuffled_batches_fixed_size_without_replacement():
    g = torch.Generator().manual_seed(0)
    batches = batch_indices(100, 10, 10, g, poisson=False)
    assert all(len(b) == 10 for b in batches)
    assert len(torch.cat(batches).unique()) == 100  # one epoch, no repeats


class _DropoutNet(torch.nn.Module):
    """Smallest model with dropout: the loss depends on the global-RNG dropout mask."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 2)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x, labels):
        logits = self.lin(self.drop(x))
        return type("Out", (), {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits})()


class _Split:
    def __init__(self, n=32):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randint(0, 2, (n,), generator=g)

    def __len__(self):
        return len(self.y)

    def batch(self, idx, device):
        return {"x": self.x[idx].to(device), "labels": self.y[idx].to(device)}


def _trained_weights(dropout_seed, global_seed):
    from fedpower_app.training import train_local

    torch.manual_seed(global_seed)  # whatever ran before in the worker process
    model = _DropoutNet()
    with torch.no_grad():
        model.lin.weight.fill_(0.1)
        model.lin.bias.zero_()
    before = torch.get_rng_state()
    train_local(model, _Split(), steps=5, batch_size=8, lr=0.1, generator=torch.Generator().manual_seed(1),
                poisson=False, device=torch.device("cpu"), dropout_seed=dropout_seed)
    return model.lin.weight.detach().clone(), torch.equal(before, torch.get_rng_state())


def test_dropout_seed_makes_local_training_reproducible_and_leaves_global_rng_alone():
    w1, untouched = _trained_weights(dropout_seed=7, global_seed=1)
    w2, _ = _trained_weights(dropout_seed=7, global_seed=2)
    w3, _ = _trained_weights(dropout_seed=8, global_seed=1)
    assert torch.equal(w1, w2)  # same silo/round seed: same masks whatever the process did before
    assert not torch.equal(w1, w3)  # the seed does drive the masks
    assert untouched  # the caller's RNG stream is not consumed


def test_stream_seed_is_deterministic_when_seeded_and_fresh_when_hardened():
    from strategies.noise import NoiseSource, derive_seed

    assert NoiseSource(3).stream_seed("dropout/1", 4) == derive_seed(3, "dropout/1", 4)
    assert NoiseSource(3).stream_seed("dropout/1", 4) != NoiseSource(3).stream_seed("dropout/2", 4)
    hardened = NoiseSource(3, "hardened")
    assert hardened.stream_seed("dropout/1", 4) != hardened.stream_seed("dropout/1", 4)


def test_round_lr_constant_and_cosine():
    from fedpower_app.training import round_lr

    assert [round_lr(0.01, "constant", t, 8) for t in (1, 5, 8)] == [0.01, 0.01, 0.01]
    cos = [round_lr(0.02, "cosine", t, 8) for t in range(1, 9)]
    assert cos[0] == 0.02 and cos[4] == pytest.approx(0.01)  # full rate first, half way at T/2
    assert all(a > b > 0 for a, b in zip(cos, cos[1:]))  # strictly decaying, never zero in a planned round
    assert cos[-1] == pytest.approx(0.02 * 0.5 * (1 + math.cos(math.pi * 7 / 8)))
    with pytest.raises(ValueError):
        round_lr(0.01, "linear", 1, 8)


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_local_optimizer_choice_sets_the_step(kind):
    """train.optimizer = sgd: one full-batch step is exactly -lr * gradient (a client's round delta
    then follows its gradient); adam's first step is about -lr * sign(gradient)."""
    from fedpower_app.training import train_local

    split = _Split(n=8)
    model = _DropoutNet()
    model.drop.p = 0.0
    with torch.no_grad():
        model.lin.weight.fill_(0.1)
        model.lin.bias.zero_()
    w0 = model.lin.weight.detach().clone()
    model.lin.weight.grad = None
    loss = model(**split.batch(torch.arange(8), "cpu")).loss
    (grad,) = torch.autograd.grad(loss, [model.lin.weight])
    train_local(model, split, steps=1, batch_size=8, lr=0.5, generator=torch.Generator().manual_seed(0),
                poisson=False, device=torch.device("cpu"), optimizer=kind)
    step = model.lin.weight.detach() - w0
    expected = -0.5 * grad if kind == "sgd" else -0.5 * torch.sign(grad)
    assert torch.allclose(step, expected, atol=1e-5 if kind == "sgd" else 1e-3)


class _BodyAndHead(torch.nn.Module):
    """A body and a head named as PEFT names a trained head (``modules_to_save``)."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(8, 8, bias=False)
        self.head = torch.nn.ModuleDict({"modules_to_save": torch.nn.Linear(8, 2)})
        with torch.no_grad():
            self.body.weight.copy_(torch.eye(8))
            self.head["modules_to_save"].weight.copy_(torch.linspace(-1, 1, 16).reshape(2, 8))

    def forward(self, x, labels):
        logits = self.head["modules_to_save"](self.body(x))
        return type("Out", (), {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits})()


@pytest.mark.parametrize("scale", [1.0, 0.1])
def test_head_lr_scale_gives_the_head_its_own_rate(scale):
    """train.head-lr-scale: a fresh Adam's first step moves the head's coordinates by lr·scale and
    the body's by lr (sign-like steps); scale 1 is the old single-group optimizer."""
    from fedpower_app.training import train_local

    model = _BodyAndHead()
    body0, head0 = model.body.weight.detach().clone(), model.head["modules_to_save"].weight.detach().clone()
    train_local(model, _Split(n=8), steps=1, batch_size=8, lr=0.01, generator=torch.Generator().manual_seed(0),
                poisson=False, device=torch.device("cpu"), head_lr_scale=scale)
    body_step = (model.body.weight.detach() - body0).abs()
    head_step = (model.head["modules_to_save"].weight.detach() - head0).abs()
    assert body_step.max() == pytest.approx(0.01, rel=1e-3)
    assert head_step.max() == pytest.approx(0.01 * scale, rel=1e-3)


def test_head_lr_scale_reaches_dp_sgd_and_survives_a_carried_state():
    """DP-SGD builds its optimizer from the same groups; a state carried to the next round keeps
    the head's scale under the new round's rate."""
    from fedpower_app.training.dp_sgd import DPSGDParams, dp_sgd_train_local

    model = _BodyAndHead()
    params = DPSGDParams(noise_multiplier=0.0, clip=1.0, batch_size=8, local_steps=1)
    carry: dict = {}
    for lr in (0.01, 0.004):
        body0 = model.body.weight.detach().clone()
        head0 = model.head["modules_to_save"].weight.detach().clone()
        dp_sgd_train_local(model, _Split(n=8), params=params, lr=lr, sampling_generator=torch.Generator().manual_seed(0),
                           noise_generator=torch.Generator().manual_seed(1), device=torch.device("cpu"),
                           optimizer_carry=carry, head_lr_scale=0.25)
        # Adam's step per coordinate is about lr (exactly lr·sign on a fresh first step; a carried
        # state's m/sqrt(v) can exceed 1 a little): the head's stays well under the body's rate.
        assert (model.head["modules_to_save"].weight.detach() - head0).abs().max() <= 0.25 * lr * 1.5
        assert (model.body.weight.detach() - body0).abs().max() > 0.5 * lr
    assert [g["lr"] for g in carry["state"]["param_groups"]] == pytest.approx([0.004, 0.001])
