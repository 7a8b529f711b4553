"""Client-side sampling matches the accountant; local training and evaluation work on a real model."""

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
