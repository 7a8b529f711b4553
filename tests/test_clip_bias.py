"""research/dp_sgd_clip_bias.py: the closed-form bias gradient of a linear head under per-example
clipping (RESULTS.md, "Where the 6 points to the ceiling go")."""

import torch

from research.dp_sgd_clip_bias import bias_gradients


def _toy(n1=57, n0=43):
    y = torch.cat([torch.ones(n1), torch.zeros(n0)]).long()
    z = torch.zeros(n1 + n0, dtype=torch.float64)  # an uninformative head: every margin 0
    xnorm = torch.full((n1 + n0,), 5.0)
    return z, y, xnorm


def test_unclipped_gradient_vanishes_at_the_label_frequency():
    z, y, x = _toy()
    offset = float(torch.logit(torch.tensor(0.57, dtype=torch.float64)))
    row = bias_gradients(z, y, x, clip=1e9, offset=offset)
    assert abs(row["mean_p1"] - 0.57) < 1e-9
    assert abs(row["grad_unclipped"]) < 1e-12
    assert row["clipped_frac"] == 0.0


def test_clipped_gradient_counts_examples_and_keeps_pushing_past_the_frequency():
    z, y, x = _toy()
    # every example clipped: each pushes with C / (sqrt(2) sqrt(|x|^2 + 1)) toward its label
    unit = 1.0 / (2 ** 0.5 * (25.0 + 1.0) ** 0.5)
    for offset in (0.0, 0.28, 2.0, 4.0):
        row = bias_gradients(z, y, x, clip=0.05, offset=offset)
        assert row["clipped_frac"] == 1.0
        assert abs(row["grad_clipped_over_C"] - (-(0.57 - 0.43) * unit)) < 1e-9  # toward class 1, unchanged
    # far out, the majority's examples fall under the clip and the push turns
    row = bias_gradients(z, y, x, clip=0.05, offset=8.0)
    assert row["grad_clipped_over_C"] > 0


def test_training_loss_smoothing_turns_the_push_of_a_well_fitted_example():
    from types import SimpleNamespace

    from fedpower_app.training.loops import training_loss

    labels = torch.tensor([1, 1])
    logits = torch.tensor([[0.0, 1.0], [0.0, 4.0]], requires_grad=True)  # P(true) = 0.73 and 0.98
    out = SimpleNamespace(logits=logits, loss=torch.nn.functional.cross_entropy(logits, labels))
    batch = {"labels": labels}
    assert torch.equal(training_loss(out, batch, 0.0), out.loss)  # s = 0: the model's own loss
    loss = training_loss(out, batch, 0.1)  # true-class target 1 - s/2 = 0.95
    p = torch.softmax(logits.detach(), dim=1)
    expected = -(0.95 * p[:, 1].log() + 0.05 * p[:, 0].log()).mean()
    assert torch.allclose(loss, expected)
    loss.backward()
    # d loss / d true logit: negative (push up) below P = 0.95, positive (push down) above it
    assert logits.grad[0, 1] < 0 < logits.grad[1, 1]


def test_label_smoothing_is_validated():
    import pytest

    from fedpower_app.config import ConfigError, parse_config

    assert parse_config({"train.label-smoothing": 0.1})["train.label-smoothing"] == 0.1
    assert parse_config({})["train.label-smoothing"] == 0.0
    with pytest.raises(ConfigError, match="label-smoothing"):
        parse_config({"train.label-smoothing": 1.0})
