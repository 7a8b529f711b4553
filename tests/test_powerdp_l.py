"""PowerDP-L (privacy-accounting privacy-accounting spec §3.2): the noisy power method warm-started from the previous public A.

* zero noise: exactly the warm-started power iteration (dense reference written here);
* factored input gives the dense result;
* the noise on every released block (Y and X of every iteration) has the calibrated std;
* a Monte-Carlo audit of one round on a worst-case neighbouring pair (the exact likelihood-ratio
  test on the released Y and X) stays below the claimed epsilon, and a negative control with half
  the noise exceeds it (the audit has the power to catch a wrong calibration);
* the same audit end to end, on neighbouring client sets through the product's release (its clip,
  fixed denominator, public add-back, head release and the real noise sampler): the GDP fit is
  1/z, and 2/z with half the noise.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedpower_app.audit import bounds as audit
from strategies import orthonormalize_columns, orthonormalize_rows, powerdp_l

F64 = torch.float64
DELTA = 1e-5


def gen(seed):
    return torch.Generator().manual_seed(seed)


def reference(W, a_prev, iters):
    """The warm-started power iteration, written out densely."""
    Q = orthonormalize_rows(a_prev)
    for _ in range(iters):
        P = orthonormalize_columns(W @ Q.transpose(-1, -2))
        X = P.transpose(-1, -2) @ W
        Q = orthonormalize_rows(X)
    return P @ (X @ Q.transpose(-1, -2)), Q


@pytest.mark.parametrize("iters", [1, 2, 3])
def test_zero_noise_is_the_warm_started_power_iteration(iters):
    W = torch.randn(3, 20, 12, generator=gen(0), dtype=F64)
    a_prev = torch.randn(3, 4, 12, generator=gen(1), dtype=F64)
    B, A = powerdp_l(W, a_prev=a_prev, iters=iters, noise_std=0.0, generator=gen(2))
    B_ref, A_ref = reference(W, a_prev, iters)
    assert torch.allclose(B, B_ref, atol=1e-12) and torch.allclose(A, A_ref, atol=1e-12)
    assert torch.allclose(A @ A.transpose(-1, -2), torch.eye(4, dtype=F64).expand(3, 4, 4), atol=1e-12)


def test_warm_start_converges_to_the_top_subspace():
    U = orthonormalize_columns(torch.randn(1, 30, 3, generator=gen(3), dtype=F64))
    V = orthonormalize_rows(torch.randn(1, 3, 25, generator=gen(4), dtype=F64))
    W = U @ torch.diag(torch.tensor([5.0, 3.0, 2.0], dtype=F64)) @ V + 1e-3 * torch.randn(1, 30, 25, generator=gen(5), dtype=F64)
    B, A = powerdp_l(W, a_prev=torch.randn(1, 3, 25, generator=gen(6), dtype=F64), iters=30, noise_std=0.0, generator=gen(7))
    U_, S_, Vh_ = torch.linalg.svd(W)
    best = U_[..., :3] @ torch.diag_embed(S_[..., :3]) @ Vh_[..., :3, :]  # the best rank-3 approximation
    assert torch.linalg.norm(B @ A - best) < 1e-8


def test_factored_input_equals_dense():
    Bs = torch.randn(2, 24, 10, generator=gen(8), dtype=F64)
    As = torch.randn(2, 10, 16, generator=gen(9), dtype=F64)
    a_prev = torch.randn(2, 4, 16, generator=gen(10), dtype=F64)
    d = powerdp_l(Bs @ As, a_prev=a_prev, iters=2, noise_std=0.3, generator=gen(11))
    f = powerdp_l(factors=(Bs, As), a_prev=a_prev, iters=2, noise_std=0.3, generator=gen(11))
    assert torch.allclose(d[0], f[0], atol=1e-10) and torch.allclose(d[1], f[1], atol=1e-10)


def test_every_released_block_gets_the_calibrated_noise():
    from fedpower_app.privacy.accounting.plan import noise_stds

    calls = []

    def sampler(shape, std, generator, *, dtype, device):
        calls.append((tuple(shape), float(std)))
        return torch.randn(shape, generator=generator, dtype=dtype, device=device).mul_(std)

    z, clip, m, iters = 1.3, 0.5, 7.5, 2
    stds = noise_stds("powerdp-l", "client", z, clip, denominator=m, iters=iters)
    assert len(stds) == 2 * iters and len(set(stds)) == 1
    assert stds[0] == pytest.approx(z * math.sqrt(2 * iters) * clip / m)
    W = torch.randn(1, 10, 8, generator=gen(12), dtype=F64)
    powerdp_l(W, a_prev=torch.randn(1, 2, 8, generator=gen(13), dtype=F64), iters=iters, noise_std=stds[0],
              generator=gen(14), sampler=sampler)
    assert calls == [((1, 10, 2), stds[0]), ((1, 2, 8), stds[0])] * iters  # Y, X per iteration
    # the empirical std of the draws, on a large block
    calls.clear()
    big = torch.zeros(1, 400, 300, dtype=F64)
    noise = []
    powerdp_l(big, a_prev=torch.randn(1, 8, 300, generator=gen(15), dtype=F64), iters=1, noise_std=0.7,
              generator=gen(16), sampler=lambda shape, std, g, **kw: noise.append(torch.randn(shape, generator=g, **kw) * std) or noise[-1].clone())
    assert float(torch.cat([n.flatten() for n in noise]).std()) == pytest.approx(0.7, rel=0.02)


def simulate_pair(noise_std, trials, seed, *, C=1.0, m=5.0, iters=1):
    """One round of PowerDP-L on neighbouring averages W0 and W1 = W0 + u/m, ||u|| = C, u in the
    row space of the public warm start and in the left space of the released P (the worst case
    for both releases). Exact log-likelihood-ratio score of the transcript (Y_1, X_1, ..., Y_k, X_k):
    each release is Gaussian given the earlier ones, so the log-LR is a sum of Gaussian terms."""
    rng = gen(seed)
    mdim, n, r = 6, 5, 2
    q = orthonormalize_rows(torch.randn(1, r, n, generator=gen(100), dtype=F64))
    e = torch.zeros(1, mdim, 1, dtype=F64)
    e[0, 0, 0] = 1.0
    # The public part dominates along e q1, so the released P keeps e in its span: then both the
    # Y and the X release see the whole difference ||u||/m (the worst case of the Lipschitz bound).
    W0 = 3.0 * e @ q[:, :1, :] + 0.05 * torch.randn(1, mdim, n, generator=gen(101), dtype=F64)
    u = C * e @ q[:, :1, :]  # rank one, ||u||_F = C, in the row space of the warm start
    Ws = (W0, W0 + u / m)
    scores = []
    for world in (0, 1):
        W = Ws[world].expand(trials, mdim, n)
        draws = []

        def sampler(shape, std, generator, *, dtype, device):
            x = torch.randn((trials, *shape[1:]), generator=generator, dtype=dtype, device=device).mul_(std)
            draws.append(x)
            return x.clone()

        powerdp_l(W, a_prev=q.expand(trials, r, n), iters=iters, noise_std=noise_std, generator=rng, sampler=sampler)
        # replay the transcript and score it
        Q = q.expand(trials, r, n)
        score = torch.zeros(trials, dtype=F64)
        for it in range(iters):
            NY, NX = draws[2 * it], draws[2 * it + 1]
            Y = W @ Q.transpose(-1, -2) + NY
            m0, m1 = Ws[0] @ Q.transpose(-1, -2), Ws[1] @ Q.transpose(-1, -2)
            score += ((Y - (m0 + m1) / 2) * (m1 - m0)).flatten(1).sum(1) / noise_std**2
            P = orthonormalize_columns(Y)
            X = P.transpose(-1, -2) @ W + NX
            x0, x1 = P.transpose(-1, -2) @ Ws[0], P.transpose(-1, -2) @ Ws[1]
            score += ((X - (x0 + x1) / 2) * (x1 - x0)).flatten(1).sum(1) / noise_std**2
            Q = orthonormalize_rows(X)
        scores.append(score.numpy())
    return scores


@pytest.mark.parametrize("iters", [1, 2])
def test_monte_carlo_audit_stays_below_the_claimed_epsilon(iters):
    """Calibrated noise for z = 1 (claimed one-round eps 4.38 at delta 1e-5): the exact-LR audit's
    lower bound stays below it; half the noise (true z = 0.5, eps 10.5) is caught above it."""
    import dp_accounting

    from fedpower_app.privacy.accounting.plan import noise_stds

    C, m, z = 1.0, 5.0, 1.0
    s = noise_stds("powerdp-l", "client", z, C, denominator=m, iters=iters)[0]
    eps_claim = dp_accounting.get_epsilon_gaussian(z, DELTA)
    scores = simulate_pair(s, 100_000, seed=1, C=C, m=m, iters=iters)
    res = audit.audit_scores(scores[0], scores[1], delta=DELTA, alpha=0.05, rng=np.random.default_rng(0))
    assert res.epsilon_lb <= eps_claim, res
    # the score of the worst case is Gaussian with mu <= 1/z: the calibration is tight, not loose
    assert audit.gdp_mu_estimate(*scores) == pytest.approx(1.0 / z, rel=0.05)
    scores = simulate_pair(s / 2, 100_000, seed=2, C=C, m=m, iters=iters)
    res = audit.audit_scores(scores[0], scores[1], delta=DELTA, alpha=0.05, rng=np.random.default_rng(1))
    assert res.epsilon_lb > eps_claim, res


# (method, strategy.client-refactorization, round type, the sensitivity of each released block
# written out from docs/privacy.md §12 for C = 0.8, m = q_c N = 20, 2 power iterations, r = 8, M = 12)
_C, _M, _R = 0.8, 20.0, 8
ACCOUNTED = [
    ("fedlora", "powerdp-l", "fedlora-delta", [_C / _M]),
    ("ffa-lora", "powerdp-l", "ffa-delta", [_C / _M]),
    ("input-perturbation", "powerdp-l", "input-delta", [_C / _M]),
    ("fedpower", "powerdp-l", "powerdp-l", [_C / _M] * 4),  # Y, X per power iteration
    ("fedpower", "powerdp", "powerdp-delta", [2 * _C, 2 * _C]),  # the paper's PowerDP: diameters
    ("output-perturbation", "powerdp-l", "output-delta", [2 * math.sqrt(12 * _R), 2 * _C]),
]


@pytest.mark.parametrize("method, refactorization, round_type, sensitivities", ACCOUNTED)
def test_client_level_accounting_matches_dp_accounting_with_the_fixed_denominator(method, refactorization, round_type,
                                                                                  sensitivities):
    """Client level: every round is a Poisson-subsampled Gaussian at rate q_c with the effective
    z = (sum_j (Delta_j / s_j)^2)^(-1/2) of its blocks: Delta = C/m for m = q_c N on the linear
    releases and on every PowerDP-L block, the diameters for the paper's releases on the delta.
    Recomputed here with dp-accounting directly, from the stds the server would use."""
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    from fedpower_app.privacy import accounting as A

    q_c, N, T, C, eps, delta = 0.1, 200, 40, _C, 8.0, 1e-5
    plan = A.PrivacyPlan(method=method, level="client", epsilon=eps, delta=delta, num_rounds=T, client_rate=q_c,
                         num_clients=N, clip=C, power_iters=2, rank=_R, num_modules=12,
                         refactorization=refactorization)
    assert plan.denominator == pytest.approx(_M) and set(plan.schedule) == {round_type}
    cal = A.calibrate(plan)
    stds = cal.noise_std[round_type]
    assert len(stds) == len(sensitivities)
    z_from_stds = 1.0 / math.sqrt(sum((d / s) ** 2 for d, s in zip(sensitivities, stds)))
    acc = RdpAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(q_c, dp_accounting.GaussianDpEvent(z_from_stds)), T)
    assert acc.get_epsilon(delta) == pytest.approx(cal.epsilon, rel=1e-3)
    assert cal.epsilon <= eps * (1 + 1e-6) and cal.epsilon > 0.99 * eps  # calibrated to the budget


# ------------------------------------------------------------------------------------------------
# The same audit end to end: the product's release (strategies.mechanisms "powerdp-l"), its clip,
# fixed denominator, public add-back, head release and the real NoiseSource sampler.
# ------------------------------------------------------------------------------------------------


def released_pair(noise_std, trials, seed, *, C=1.0, m=5.0, iters=1, check_replay=20):
    """Neighbouring client sets D and D + {x} through the real release. x's change ||dW_x|| = 50 C
    (clipped to C) lies along e q1, in the row space of the public warm start A_g = q and kept in the
    span of P by the public part (the worst case, as in ``simulate_pair``); x changes no head (with
    equal stds, the bound 2k||dW||^2 + ||dhead||^2 <= 2k C^2 is tightest then). The test recomputes
    each world's W densely with its own clipping, replays the release from the recorded draws
    (checked equal to the release's output) and scores the exact log-LR of the transcript."""
    from strategies import mechanisms as MECH
    from strategies.aggregation import CLIP_MARGIN, AdapterUpdate, group_modules
    from strategies.releases import ReleaseContext

    mdim, n, r = 6, 5, 2
    q = orthonormalize_rows(torch.randn(1, r, n, generator=gen(100), dtype=F64))[0]
    e = torch.zeros(mdim, dtype=F64)
    e[0] = 1.0
    A_g = {"q": q}
    B_g = {"q": torch.stack([3.0 * e, 0.05 * torch.randn(mdim, generator=gen(101), dtype=F64)], dim=1)}
    honest = [AdapterUpdate(A={"q": q + 0.02 * torch.randn(r, n, generator=gen(102 + i), dtype=F64)},
                            B={"q": B_g["q"] + 0.02 * torch.randn(mdim, r, generator=gen(110 + i), dtype=F64)},
                            extra={"head": 0.01 * torch.randn(2, generator=gen(120 + i), dtype=F64)}) for i in range(2)]
    x_B = B_g["q"].clone()
    x_B[:, 0] += 50.0 * C * e  # dW_x = 50 C e q1
    x = AdapterUpdate(A={"q": q.clone()}, B={"q": x_B}, extra={"head": torch.zeros(2, dtype=F64)})
    worlds = (honest, honest + [x])

    target = C / (1 + CLIP_MARGIN)  # the product clips a hair inside C (float rounding stays below it)

    def dense_w(updates):  # the threat model's W: public global + clipped changes / m (float64)
        W = B_g["q"] @ q
        for u in updates:
            d = u.B["q"] @ u.A["q"] - B_g["q"] @ q
            norm = math.sqrt(float(d.pow(2).sum() + u.extra["head"].pow(2).sum()))
            W = W + min(1.0, target / norm) * d / m
        return W

    Ws = [dense_w(w) for w in worlds]
    assert float(torch.linalg.norm(Ws[1] - Ws[0])) == pytest.approx(C / m, rel=2e-4)  # the full sensitivity
    mech = MECH.get("powerdp-l")
    from tests.test_privacy_audit import RecordingNoise  # the project's NoiseSource, recording every draw

    noise = RecordingNoise(0)
    ctx = ReleaseContext(groups=group_modules({"q": (mdim, n, r)}), extra_shapes={"head": (2,)}, clip=C, rank=r,
                         power_iters=iters, noise=noise, dtype=F64)
    args = MECH.ReleaseArgs(glob=(A_g, B_g), denominator=m)
    rng = gen(seed)
    scores, heads = [np.empty(trials), np.empty(trials)], []
    for world, updates in enumerate(worlds):
        for t in range(trials):
            noise.draws.clear()
            rel = mech.release(updates, ctx, [noise_std] * (2 * iters), rng, args)
            shapes = [d[0] for d in noise.draws]
            assert shapes == [(1, mdim, r), (1, r, n)] * iters + [(2,)]  # Y, X per iteration, then the head
            assert all(d[1] == noise_std for d in noise.draws)  # every released block at the calibrated std
            Q, score = q[None], 0.0
            for it in range(iters):
                NY, NX = noise.draws[2 * it][2], noise.draws[2 * it + 1][2]
                Y = Ws[world] @ Q.transpose(-1, -2) + NY
                m0, m1 = Ws[0] @ Q.transpose(-1, -2), Ws[1] @ Q.transpose(-1, -2)
                score += float(((Y - (m0 + m1) / 2) * (m1 - m0)).sum()) / noise_std**2
                P = orthonormalize_columns(Y)
                X = P.transpose(-1, -2) @ Ws[world] + NX
                x0, x1 = P.transpose(-1, -2) @ Ws[0], P.transpose(-1, -2) @ Ws[1]
                score += float(((X - (x0 + x1) / 2) * (x1 - x0)).sum()) / noise_std**2
                Q = orthonormalize_rows(X)
            if t < check_replay:  # the transcript scored is the one the release made
                assert torch.allclose(rel.A["q"], Q[0], atol=1e-9)
                assert torch.allclose(rel.B["q"], (P @ (X @ Q.transpose(-1, -2)))[0], atol=1e-9)
            scores[world][t] = score
            heads.append(noise.draws[-1][2])
    return scores, torch.stack(heads)


def test_the_products_powerdp_l_release_passes_the_audit_end_to_end():
    """Calibrated for z = 1 (plan.noise_stds): the worst-case pair through the real release gives a
    GDP fit mu = 1/z (the calibration is tight and covers clipping, the fixed denominator and the
    head), the Clopper-Pearson lower bound stays below the claimed eps, and with half the noise the
    fit is 2/z (the audit sees a wrong calibration)."""
    import dp_accounting

    from fedpower_app.privacy.accounting.plan import noise_stds

    C, m, z, iters, trials = 1.0, 5.0, 1.0, 1, 4000
    stds = noise_stds("powerdp-l", "client", z, C, denominator=m, iters=iters)
    assert stds == pytest.approx([math.sqrt(2 * iters) * z * C / m] * 2)
    eps_claim = dp_accounting.get_epsilon_gaussian(z, DELTA)
    scores, _ = released_pair(stds[0], trials, seed=3, C=C, m=m, iters=iters)
    # one Y and one X release, each seeing the whole C/m: mu = sqrt(2) (C/m) / s = 1/z
    assert audit.gdp_mu_estimate(*scores) == pytest.approx(1.0 / z, rel=0.06)
    res = audit.audit_scores(scores[0], scores[1], delta=DELTA, alpha=0.05, rng=np.random.default_rng(0))
    assert res.epsilon_lb <= eps_claim, res
    scores, _ = released_pair(stds[0] / 2, trials, seed=4, C=C, m=m, iters=iters, check_replay=0)
    assert audit.gdp_mu_estimate(*scores) == pytest.approx(2.0 / z, rel=0.06)


def test_the_released_head_and_factors_carry_the_calibrated_noise():
    """The real sampler's draws on the head (and every block) have the calibrated std."""
    s = 0.37
    _, heads = released_pair(s, 1500, seed=5, iters=2, check_replay=5)
    assert float(heads.std()) == pytest.approx(s, rel=0.05)  # 6,000 draws (2 worlds x 1,500 x 2 entries)
    assert abs(float(heads.mean())) < 4 * s / math.sqrt(heads.numel())
