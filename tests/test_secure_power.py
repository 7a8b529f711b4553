"""FedPower's factored power iteration through secure sums equals the dense one on the plain sum."""

import numpy as np
import pytest
import torch

from strategies.powerdp import powerdp_l
from strategies.secure_sum.field import FieldQuantizer
from strategies.secure_sum.power import plain_sum, quantized_secure_sum, secure_power_iteration


def _clients(k=4, m=12, n=9, r=2, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(m, r)) / 3, rng.normal(size=(r, n)) / 3) for _ in range(k)], rng.normal(size=(r, n))


def _dense(factors, a_prev, iters):
    W = torch.as_tensor(sum(B @ A for B, A in factors))[None]
    B, A = powerdp_l(W, a_prev=torch.as_tensor(a_prev)[None], iters=iters, noise_std=0.0,
                     generator=torch.Generator().manual_seed(0))
    return B[0].numpy(), A[0].numpy()


def test_factored_iteration_with_plain_sums_equals_the_dense_iteration():
    factors, a_prev = _clients()
    B, A = secure_power_iteration(factors, a_prev, 3, plain_sum)
    Bd, Ad = _dense(factors, a_prev, 3)
    assert np.allclose(A, Ad, atol=1e-10) and np.allclose(B, Bd, atol=1e-10)


def test_factored_iteration_through_secure_aggregation_is_within_quantization_error():
    factors, a_prev = _clients(seed=1)
    q = FieldQuantizer(bits=40, clip_range=4.0, num_clients=len(factors))
    B, A = secure_power_iteration(factors, a_prev, 2, quantized_secure_sum(q, threshold=3, rng=np.random.default_rng(2)))
    Bd, Ad = _dense(factors, a_prev, 2)
    # each sum is exact to k / s ~ 1.5e-10 per entry; the iteration is well conditioned here
    assert q.error_bound() < 1e-9
    assert np.abs(B @ A - Bd @ Ad).max() < 1e-6
    assert np.abs(B @ A - Bd @ Ad).max() > 0  # it did go through the quantizer


def test_bad_factors_are_refused():
    factors, a_prev = _clients()
    with pytest.raises(ValueError, match="a_prev"):
        secure_power_iteration(factors, a_prev[:, :3], 1)
    with pytest.raises(ValueError, match="client factors"):
        secure_power_iteration(factors + [(np.ones((5, 2)), np.ones((2, 9)))], a_prev, 1)
    with pytest.raises(ValueError, match="iters"):
        secure_power_iteration(factors, a_prev, 0)


def test_clipping_and_the_public_part_match_the_dense_iteration_on_the_client_level_merge():
    factors, a_prev = _clients(seed=3)
    rng = np.random.default_rng(4)
    Bg, Ag = rng.normal(size=(12, 2)), rng.normal(size=(2, 9))
    C, m = 0.5, 5.0
    B, A = secure_power_iteration(factors, a_prev, 2, clip=C, public=(Bg, Ag), denominator=m)
    clipped = [(B_i * min(1, C / np.linalg.norm(B_i @ A_i)), A_i) for B_i, A_i in factors]
    merged = [(Bg, Ag)] + [(B_i / m, A_i) for B_i, A_i in clipped]
    Bd, Ad = _dense(merged, a_prev, 2)
    assert np.allclose(B @ A, Bd @ Ad, atol=1e-10)


def test_the_iteration_carries_distributed_noise_of_the_calibrated_size():
    from strategies.secure_sum.distributed_dp import DistributedDiscreteGaussian
    from strategies.secure_sum.power import noisy_secure_sum

    factors, a_prev = _clients(k=5, m=40, n=30, seed=5)

    def mech(size):
        return DistributedDiscreteGaussian(clip=1.0, scale=200.0, local_std=40.0, dimension=size, bits=40,
                                           num_clients=5, min_contributors=4)

    noisy = noisy_secure_sum(mech, threshold=4, rng=np.random.default_rng(6), drop={3: "unmask"})
    Y = noisy([B @ (A @ np.linalg.qr(a_prev.T)[0]) for B, A in factors])
    clipped = [B * min(1, 1.0 / np.linalg.norm(B @ A)) @ (A @ np.linalg.qr(a_prev.T)[0]) for B, A in factors]
    resid = Y - np.sum(clipped, axis=0)
    target = mech(Y.size).sum_std(5)  # unmask dropout: all five masked inputs are in the sum
    assert 0.7 * target < resid.std() < 1.3 * target
    B, A = secure_power_iteration(factors, a_prev, 1, noisy, clip=1.0)
    assert np.allclose(A @ A.T, np.eye(2), atol=1e-10)
