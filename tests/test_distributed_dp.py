"""Distributed discrete Gaussian (strategies/secure_sum/distributed_dp): the sampler's moments, the
variance of the sum through the secure sum (with dropouts), and the accounting against known cases."""

import math

import dp_accounting
import numpy as np
import pytest

from strategies.secure_sum.distributed_dp import (
    DistributedDiscreteGaussian, calibrate_local_std, discrete_gaussian_variance, rounded_norm_bound,
    sample_discrete_gaussian, tau)
from strategies.secure_sum.protocol import SecureSumConfig, simulate


@pytest.mark.parametrize("sigma", [0.6, 2.0, 7.5])
def test_discrete_gaussian_sampler_moments(sigma):
    z = sample_discrete_gaussian(200_000, sigma, np.random.default_rng(5))
    var = discrete_gaussian_variance(sigma)
    assert z.dtype == np.int64
    assert abs(z.mean()) < 5 * math.sqrt(var / z.size)
    assert abs(z.var() / var - 1) < 5 * math.sqrt(2 / z.size) * 1.5  # kurtosis ~3: se of var ~ var sqrt(2/N)
    grid = np.arange(-3, 4)
    pmf = np.exp(-grid ** 2 / (2 * sigma ** 2)) / np.exp(-np.arange(-400, 401) ** 2 / (2 * sigma ** 2)).sum()
    freq = np.array([(z == g).mean() for g in grid])
    assert np.all(np.abs(freq - pmf) < 5 * np.sqrt(pmf / z.size) + 1e-4)


def test_discrete_gaussian_variance_is_close_to_sigma_squared():
    assert abs(discrete_gaussian_variance(3.0) - 9.0) < 1e-9
    assert discrete_gaussian_variance(0.5) < 0.25


def test_sum_through_secure_aggregation_carries_the_calibrated_noise_with_dropouts():
    nodes, d = tuple(range(6)), 4000
    mech = DistributedDiscreteGaussian(clip=1.0, scale=64.0, local_std=20.0, dimension=d, bits=32,
                                       num_clients=6, min_contributors=4)
    assert mech.wrap_probability() < 1e-12
    rng = np.random.default_rng(6)
    xs = {u: rng.normal(size=d) for u in nodes}
    xs = {u: x / np.linalg.norm(x) * 0.8 for u, x in xs.items()}  # inside the clip
    enc = {u: mech.encode(x, rng) for u, x in xs.items()}
    total, survivors = simulate(SecureSumConfig(nodes=nodes, size=d, bits=32, threshold=4), enc,
                                drop={2: "masked_input", 5: "masked_input"})
    assert len(survivors) == 4
    resid = mech.decode_sum(total) - sum(xs[u] for u in survivors)
    target = mech.sum_std(4)  # four shares of noise: the calibration's k
    assert abs(resid.mean()) < 5 * target / math.sqrt(d)
    # the residual is noise plus rounding (variance <= 1/4 per client per coordinate, in integer units)
    rounding_var = 4 * 0.25 / mech.scale ** 2
    assert target ** 2 * (1 - 0.1) < resid.var() < (target ** 2 + rounding_var) * (1 + 0.1)


def test_accounting_reduces_to_the_gaussian_mechanism_when_tau_vanishes():
    mech = DistributedDiscreteGaussian(clip=1.0, scale=100.0, local_std=300.0, dimension=50, bits=40,
                                       num_clients=8, min_contributors=5, beta=0.0)
    assert tau(300.0, 5) == 0.0
    z = math.sqrt(5) * 300.0 / mech.norm_bound
    acc = dp_accounting.rdp.RdpAccountant(list(range(2, 129)) + [256])
    acc.compose(dp_accounting.GaussianDpEvent(z), 20)
    assert mech.epsilon(20, 1e-5) == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)


def test_accounting_inputs_and_bounds():
    assert rounded_norm_bound(10.0, 100, 0.0) == 20.0
    assert rounded_norm_bound(10.0, 100, math.exp(-0.5)) < 20.0
    assert tau(0.5, 1) == 0.0 and tau(0.5, 10) > tau(0.5, 2) > 0
    small = DistributedDiscreteGaussian(1.0, 10.0, 0.5, 1000, 20, 10, 10)
    # tau d dominates at a small local std: the bound is worse than the Gaussian with the same sum std
    assert small.rdp([2])[0] > 2 / 2 * (small.norm_bound / (math.sqrt(10) * 0.5)) ** 2
    with pytest.raises(ValueError, match="min_contributors"):
        DistributedDiscreteGaussian(1.0, 10.0, 2.0, 10, 20, 5, 6)
    with pytest.raises(ValueError, match="local_std"):
        DistributedDiscreteGaussian(1.0, 10.0, 0.2, 10, 20, 5, 5)
    assert DistributedDiscreteGaussian(1.0, 1e6, 1.0, 10, 16, 5, 5).wrap_probability() == 1.0


def test_calibration_meets_the_target_and_scales_the_shares_for_dropouts():
    common = dict(clip=1.0, scale=50.0, dimension=200, bits=32, num_clients=10)
    full = calibrate_local_std(2.0, 1e-5, 10, min_contributors=10, **common)
    with_dropouts = calibrate_local_std(2.0, 1e-5, 10, min_contributors=7, **common)
    for mech in (full, with_dropouts):
        assert mech.epsilon(10, 1e-5) <= 2.0
        assert mech.epsilon(10, 1e-5) > 1.99
    # each share is scaled up so that 7 of them carry what 10 carried
    assert with_dropouts.local_std == pytest.approx(full.local_std * math.sqrt(10 / 7), rel=0.01)
