"""research/issue32_clip_bias.py: the closed-form bias gradient of a linear head under per-example
clipping (RESULTS.md, "Clipping, not the noise")."""

import torch

from research.issue32_clip_bias import bias_gradients


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
