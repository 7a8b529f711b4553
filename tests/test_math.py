"""Factorization math: power iteration, PowerDP, perturbation variants, factored clipping."""

import math

import pytest
import torch

from strategies.aggregation import CLIP_MARGIN
from strategies.powerdp import powerdp
from strategies import (
    AdapterUpdate,
    NoiseSource,
    ReleaseContext,
    clip_scales,
    dense_clipped_average,
    fedpower_release,
    group_modules,
    input_perturbation,
    merged_sq_norms,
    orthonormalize_rows,
    output_perturbation,
    power_iteration,
    product_sq_norms,
    weighted_factor_stack,
)


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def planted(M=2, m=40, n=30, r=3, gap=10.0, noise=1e-3, seed=0, dtype=torch.float64):
    """W = U diag(s) V^T + small noise with a clear spectral gap after r."""
    g = gen(seed)
    U = torch.linalg.qr(torch.randn(M, m, r, generator=g, dtype=dtype))[0]
    V = torch.linalg.qr(torch.randn(M, n, r, generator=g, dtype=dtype))[0]
    s = torch.linspace(gap, gap / 2, r, dtype=dtype)
    W = U @ torch.diag_embed(s.expand(M, r)) @ V.transpose(-1, -2)
    return W + noise * torch.randn(M, m, n, generator=g, dtype=dtype), U, V


def random_updates(K=3, M=4, m=24, n=16, r=2, seed=0, scale=1.0, extra=False):
    g = gen(seed)
    ups = []
    for _ in range(K):
        A = {f"mod{j}": scale * torch.randn(r, n, generator=g) for j in range(M)}
        B = {f"mod{j}": scale * torch.randn(m, r, generator=g) for j in range(M)}
        X = {"head.weight": scale * torch.randn(2, 5, generator=g)} if extra else {}
        ups.append(AdapterUpdate(A=A, B=B, extra=X))
    groups = group_modules({f"mod{j}": (m, n, r) for j in range(M)})
    return ups, groups


def subspace_distance(V_hat_rows, V):
    """sin(theta_max) between row space of A (r x n) and columns of V (n x r)."""
    Q = orthonormalize_rows(V_hat_rows).transpose(-1, -2)
    proj = V @ V.transpose(-1, -2)
    resid = Q - proj @ Q
    return torch.linalg.matrix_norm(resid, ord=2).max().item()


def test_power_iteration_recovers_planted_subspace():
    W, U, V = planted()
    B, A = power_iteration(W, rank=3, iters=5, generator=gen(1))
    top_r = torch.linalg.svd(W).Vh[:, :3, :].transpose(-1, -2)  # exact top-3 right singular vectors
    assert subspace_distance(A, top_r) < 1e-6
    assert subspace_distance(A, V) < 1e-2  # and the planted one, up to the planted noise
    # Rows of A orthonormal, and B A is the best rank-3 approximation up to the planted noise.
    eye = torch.eye(3, dtype=W.dtype).expand(2, 3, 3)
    assert torch.allclose(A @ A.transpose(-1, -2), eye, atol=1e-10)
    best = torch.linalg.svd(W)
    approx_err = torch.linalg.matrix_norm(W - B @ A)
    opt_err = best.S[:, 3:].pow(2).sum(-1).sqrt()
    assert torch.all(approx_err <= opt_err * 1.001 + 1e-9)


def test_powerdp_zero_noise_equals_power_iteration_subspace():
    W, _, _ = planted()
    B_pi, A_pi = power_iteration(W, rank=3, iters=4, generator=gen(7))
    B_dp, A_dp = powerdp(W, rank=3, iters=4, noise_std=0.0, generator=gen(7))
    # Same subspace and same product B A (the sign/rotation convention may differ).
    assert torch.allclose(B_dp @ A_dp, B_pi @ A_pi, atol=1e-8)


@pytest.mark.parametrize("fn", ["powerdp", "power_iteration", "output", "input"])
def test_factored_equals_dense_same_generator(fn):
    g = gen(3)
    M, m, n, R, r = 3, 50, 40, 6, 2
    Bs = torch.randn(M, m, R, generator=g, dtype=torch.float64)
    As = torch.randn(M, R, n, generator=g, dtype=torch.float64)
    W = Bs @ As
    kw = dict(rank=r, iters=3)
    if fn == "powerdp":
        d = powerdp(W, noise_std=0.3, generator=gen(11), **kw)
        f = powerdp(factors=(Bs, As), noise_std=0.3, generator=gen(11), **kw)
    elif fn == "power_iteration":
        d = power_iteration(W, generator=gen(11), **kw)
        f = power_iteration(factors=(Bs, As), generator=gen(11), **kw)
    elif fn == "output":
        d = output_perturbation(W, noise_std_a=0.1, noise_std_b=0.2, generator=gen(11), **kw)
        f = output_perturbation(factors=(Bs, As), noise_std_a=0.1, noise_std_b=0.2, generator=gen(11), **kw)
    else:
        d = input_perturbation(W, noise_std=0.1, generator=gen(11), **kw)
        f = input_perturbation(factors=(Bs, As), noise_std=0.1, generator=gen(11), **kw)
    for a, b in zip(d, f):
        assert torch.allclose(a, b, atol=1e-9, rtol=1e-9)


def test_powerdp_output_rows_orthonormal_float32():
    W, _, _ = planted(dtype=torch.float32)
    B, A = powerdp(W, rank=3, iters=2, noise_std=5.0, generator=gen(2))
    eye = torch.eye(3).expand(2, 3, 3)
    assert torch.allclose(A @ A.transpose(-1, -2), eye, atol=1e-5)
    assert B.shape == (2, 40, 3) and A.shape == (2, 3, 30)


def test_powerdp_noise_reaches_both_factors():
    W, _, _ = planted()
    B0, A0 = powerdp(W, rank=3, iters=2, noise_std=0.0, generator=gen(5))
    B1, A1 = powerdp(W, rank=3, iters=2, noise_std=0.5, generator=gen(5))
    assert (B1 - B0).abs().max() > 0.1
    assert (A1 - A0).abs().max() > 1e-3


def test_product_norms_match_dense():
    g = gen(4)
    B = torch.randn(5, 3, 30, 4, generator=g)
    A = torch.randn(5, 3, 4, 20, generator=g)
    dense = (B.double() @ A.double()).pow(2).sum(dim=(-1, -2))
    assert torch.allclose(product_sq_norms(B, A), dense, rtol=1e-10)


@pytest.mark.parametrize("scale", [0.01, 1.0, 100.0])
def test_clipping_bounds_whole_update_norm_float64(scale):
    ups, groups = random_updates(K=4, scale=scale, extra=True)
    sq = merged_sq_norms(ups, groups)
    scales = clip_scales(sq, clip=2.0)
    for i, (u, c) in enumerate(zip(ups, scales.tolist())):
        total = sum(((c * u.B[k].double()) @ u.A[k].double()).pow(2).sum() for k in u.A)
        total += sum((c * x.double()).pow(2).sum() for x in u.extra.values())
        assert math.sqrt(total) <= 2.0 * (1 + 1e-9)
        if math.sqrt(sq[i]) <= 2.0 / (1 + CLIP_MARGIN):
            assert c == 1.0  # small updates are not clipped


def test_factored_clipped_average_equals_dense():
    ups, groups = random_updates(K=3, scale=2.0)
    avgs, scales = dense_clipped_average(ups, groups, clip=2.0)
    sq = merged_sq_norms(ups, groups)
    assert torch.allclose(clip_scales(sq, 2.0), scales, rtol=1e-12)
    g = groups[0]
    B = torch.stack([torch.stack([u.B[nm] for nm in g.names]) for u in ups])
    A = torch.stack([torch.stack([u.A[nm] for nm in g.names]) for u in ups])
    Bs, As = weighted_factor_stack(B, A, scales / 3)
    assert Bs.shape[-1] == 3 * g.r  # rank <= k r: never an m x n matrix
    assert torch.allclose(Bs @ As, avgs[0], atol=1e-5)


def test_fedpower_release_factored_equals_dense():
    ups, groups = random_updates(K=3, M=5, m=32, n=20, r=2)
    kw = dict(groups=groups, extra_shapes={}, clip=2.0, rank=2, power_iters=3)
    fac = fedpower_release(ups, ReleaseContext(**kw, factored=True), 0.2, gen(9))
    den = fedpower_release(ups, ReleaseContext(**kw, factored=False), 0.2, gen(9))
    for name in fac.A:
        assert torch.allclose(fac.A[name], den.A[name], atol=1e-4)
        assert torch.allclose(fac.B[name], den.B[name], atol=1e-4)


def test_empty_round_still_releases_noise():
    _, groups = random_updates(K=1)
    ctx = ReleaseContext(groups=groups, extra_shapes={}, clip=2.0, rank=2, power_iters=2)
    rel = fedpower_release([], ctx, 1.0, gen(0))
    assert rel.num_clients == 0
    assert all(b.abs().sum() > 0 for b in rel.B.values())


def test_hardened_noise_scale_and_fresh_seed():
    src = NoiseSource(mode="hardened")
    a = src.gaussian((200_000,), 3.0, src.generator("release", 1))
    b = src.gaussian((200_000,), 3.0, src.generator("release", 1))
    assert abs(a.std().item() - 3.0) < 0.03
    assert not torch.equal(a, b)  # re-seeded from OS entropy each time
    seeded = NoiseSource(seed=5)
    assert torch.equal(seeded.gaussian((10,), 1.0, seeded.generator("x", 2)),
                       seeded.gaussian((10,), 1.0, seeded.generator("x", 2)))
    assert not torch.equal(seeded.gaussian((10,), 1.0, seeded.generator("x", 2)),
                           seeded.gaussian((10,), 1.0, seeded.generator("x", 3)))


def test_rejects_half_precision_and_bad_rank():
    with pytest.raises(ValueError):
        NoiseSource().gaussian((3,), 1.0, gen(), dtype=torch.float16)
    with pytest.raises(ValueError):
        power_iteration(torch.zeros(1, 4, 4), rank=5, iters=1, generator=gen())


# ---- Gram-space route (factored inputs) ------------------------------------------------------
def _powerdp_module():
    import importlib

    return importlib.import_module("strategies.powerdp")  # the package re-exports a function of that name


def test_gram_route_is_taken_and_matches_dense(monkeypatch):
    """Well-conditioned factored input: the Gram route runs (the tall route is never called) and
    its release equals the dense reference from the same generator state."""
    mod = _powerdp_module()
    g = gen(21)
    Bs, As = torch.randn(3, 50, 12, generator=g), torch.randn(3, 12, 40, generator=g)

    def no_tall(*a, **k):
        raise AssertionError("tall route used for a well-conditioned factored input")

    monkeypatch.setattr(mod, "_tall_iteration", no_tall)
    f = powerdp(factors=(Bs, As), rank=4, iters=3, noise_std=0.2, generator=gen(4))
    monkeypatch.undo()
    d = powerdp(Bs @ As, rank=4, iters=3, noise_std=0.2, generator=gen(4))
    for x, y in zip(f, d):
        assert torch.allclose(x, y, atol=2e-5, rtol=1e-4)
    Bp, Ap = power_iteration(factors=(Bs, As), rank=4, iters=3, generator=gen(5))
    Bd, Ad = power_iteration(Bs @ As, rank=4, iters=3, generator=gen(5))
    assert torch.allclose(Ap, Ad, atol=2e-5) and torch.allclose(Bp, Bd, atol=1e-4, rtol=1e-4)
    eye = torch.eye(4)
    assert torch.allclose(Ap @ Ap.transpose(-1, -2), eye.expand(3, 4, 4), atol=1e-5)


@pytest.mark.parametrize("case", ["rank-deficient", "zero", "ill-conditioned"])
def test_gram_route_falls_back_when_inaccurate(case):
    """W of rank < r (or zero, or with a huge spread of singular values) cannot be orthonormalised
    accurately through r x r Grams; the result must still equal the dense reference and be finite."""
    g = gen(22)
    Bs, As = torch.randn(2, 30, 9, generator=g, dtype=torch.float64), torch.randn(2, 9, 25, generator=g, dtype=torch.float64)
    if case == "rank-deficient":
        Bs[..., 2:] = 0.0  # rank 2 < r = 4
    elif case == "zero":
        Bs.zero_()
    else:
        Bs = Bs * torch.logspace(0, -12, 9, dtype=torch.float64)  # sigma_1 / sigma_4 ~ 1e5
    f = powerdp(factors=(Bs, As), rank=4, iters=2, noise_std=0.1, generator=gen(8))
    d = powerdp(Bs @ As, rank=4, iters=2, noise_std=0.1, generator=gen(8))
    assert all(torch.isfinite(x).all() for x in f)
    if case == "ill-conditioned":
        for x, y in zip(f, d):
            assert torch.allclose(x, y, atol=1e-8, rtol=1e-6)
    else:  # only the top-rank directions are defined; compare what is: B~ A~ spans and B
        assert torch.allclose(f[0], d[0], atol=1e-8)


def test_fedpower_release_norms_from_grams_equal_dense_norms():
    ups, groups = random_updates(K=3, M=4, m=24, n=16, r=2, scale=1.5, extra=True)
    ctx = ReleaseContext(groups=groups, extra_shapes={"head.weight": (2, 5)}, clip=2.0, rank=2, power_iters=2)
    rel = fedpower_release(ups, ctx, 0.1, gen(3))
    _, dense_scales = dense_clipped_average(ups, groups, clip=2.0)
    dense_sq = merged_sq_norms(ups, groups)
    assert torch.allclose(torch.tensor(rel.update_norms, dtype=torch.float64), dense_sq.sqrt(), rtol=1e-10)
    assert torch.allclose(torch.tensor(rel.clip_scales, dtype=torch.float64), dense_scales, rtol=1e-10)
