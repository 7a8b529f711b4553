"""Client-level DP on round deltas (strategies/client_delta.py): the delta clipping bounds every
silo's contribution (float64), the factored delta norm equals the dense one, adding the public
global back is exact, the linear releases reduce to the clipped average with zero noise, and an
empty round still releases noise."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from strategies import NoiseSource
from strategies import client_delta as CD
from strategies.aggregation import AdapterUpdate, group_modules
from strategies.releases import ReleaseContext

F64 = torch.float64
SHAPES = {"l0.q": (12, 10, 2), "l0.v": (12, 10, 2), "l1.q": (8, 6, 2)}


def gen(seed):
    return torch.Generator().manual_seed(seed)


def glob(seed=0):
    g = gen(seed)
    A = {n: torch.randn(r, k, generator=g, dtype=F64) for n, (m, k, r) in SHAPES.items()}
    B = {n: torch.randn(m, r, generator=g, dtype=F64) * 0.1 for n, (m, k, r) in SHAPES.items()}
    return A, B


def client(gl, seed, scale=1.0, head=True):
    g = gen(100 + seed)
    A = {n: gl[0][n] + scale * torch.randn(gl[0][n].shape, generator=g, dtype=F64) for n in SHAPES}
    B = {n: gl[1][n] + scale * torch.randn(gl[1][n].shape, generator=g, dtype=F64) for n in SHAPES}
    extra = {"head": scale * torch.randn(2, 4, generator=g, dtype=F64)} if head else {}
    return AdapterUpdate(A=A, B=B, extra=extra)


def ctx(clip=1.0, head=True, iters=2):
    return ReleaseContext(groups=group_modules(SHAPES), extra_shapes={"head": (2, 4)} if head else {}, clip=clip,
                          rank=2, power_iters=iters, noise=NoiseSource(0), dtype=F64)


def dense_delta(u, gl):
    return {n: u.B[n] @ u.A[n] - gl[1][n] @ gl[0][n] for n in SHAPES}


def test_factored_delta_norm_equals_dense_norm():
    gl = glob()
    ups = [client(gl, i, scale=0.5 * (i + 1)) for i in range(3)]
    sq = CD.product_delta_sq_norms(ups, group_modules(SHAPES), gl)
    for i, u in enumerate(ups):
        dense = sum(float(d.pow(2).sum()) for d in dense_delta(u, gl).values()) + float(u.extra["head"].pow(2).sum())
        assert float(sq[i]) == pytest.approx(dense, rel=1e-12)


@pytest.mark.parametrize("scale", [1e-3, 1.0, 30.0])
def test_delta_clipping_bounds_each_contribution_float64(scale):
    gl = glob()
    ups = [client(gl, i, scale=scale) for i in range(4)]
    c = ctx(clip=0.7)
    sq = CD.product_delta_sq_norms(ups, c.groups, gl)
    norms, scales, w = CD._weights(sq, c.clip, 4.0)
    for i, u in enumerate(ups):
        d = dense_delta(u, gl)
        contribution = (sum(float((scales[i] * x).pow(2).sum()) for x in d.values())
                        + float((scales[i] * u.extra["head"]).pow(2).sum())) ** 0.5
        assert contribution <= 0.7 * (1 + 1e-9)
        if float(norms[i]) <= 0.7 / (1 + 1e-4):
            assert float(scales[i]) == 1.0  # small changes are not touched
    assert torch.allclose(w, scales / 4.0)


def test_adding_the_public_global_back_is_exact():
    gl = glob()
    ups = [client(gl, i, scale=0.3) for i in range(3)]
    w = torch.tensor([0.2, 0.05, 0.1], dtype=F64)
    for g in group_modules(SHAPES):
        Bs, As, _ = CD._group_new_w_factors(ups, g, gl, w, "cpu", F64)
        for j, n in enumerate(g.names):
            want = gl[1][n] @ gl[0][n] + sum(float(w[i]) * dense_delta(u, gl)[n] for i, u in enumerate(ups))
            assert torch.allclose(Bs[j] @ As[j], want, atol=1e-12, rtol=0)
    # no reply: W is the public global itself
    for g in group_modules(SHAPES):
        Bs, As, _ = CD._group_new_w_factors([], g, gl, torch.zeros(0, dtype=F64), "cpu", F64)
        for j, n in enumerate(g.names):
            assert torch.allclose(Bs[j] @ As[j], gl[1][n] @ gl[0][n], atol=1e-14)


def test_linear_releases_are_the_clipped_average_over_the_fixed_denominator():
    gl = glob()
    ups = [client(gl, i, scale=1e-3) for i in range(2)]  # below the clip: scale 1
    rel = CD.fedlora_delta_release(ups, ctx(clip=10.0), gl, 0.0, gen(1), denominator=4.0)
    for n in SHAPES:
        want_a = gl[0][n] + sum(u.A[n] - gl[0][n] for u in ups) / 4.0  # divided by m = 4, not by k = 2
        want_b = gl[1][n] + sum(u.B[n] - gl[1][n] for u in ups) / 4.0
        assert torch.allclose(rel.A[n], want_a, atol=1e-14) and torch.allclose(rel.B[n], want_b, atol=1e-14)
    assert torch.allclose(rel.extra_delta["head"], sum(u.extra["head"] for u in ups) / 4.0, atol=1e-14)
    ffa = CD.ffa_delta_release(ups, ctx(clip=10.0), gl, 0.0, gen(1), denominator=4.0)
    assert not ffa.A and all(torch.allclose(ffa.B[n], rel.B[n], atol=1e-14) for n in SHAPES)


def test_powerdp_l_release_without_noise_refactorizes_the_new_global():
    from strategies import powerdp_l

    gl = glob()
    ups = [client(gl, i, scale=0.05) for i in range(3)]
    c = ctx(clip=100.0, iters=3)
    rel = CD.powerdp_l_release(ups, c, gl, 0.0, gen(2), denominator=3.0)
    for g in c.groups:
        W = torch.stack([gl[1][n] @ gl[0][n] + sum(dense_delta(u, gl)[n] for u in ups) / 3.0 for n in g.names])
        B, A = powerdp_l(W, a_prev=torch.stack([gl[0][n] for n in g.names]), iters=3, noise_std=0.0, generator=gen(0))
        for j, n in enumerate(g.names):
            assert torch.allclose(rel.B[n] @ rel.A[n], B[j] @ A[j], atol=1e-10)


@pytest.mark.parametrize("round_type", ["powerdp-delta", "output-delta"])
def test_the_papers_factor_noise_releases_at_client_level_act_on_the_delta(round_type):
    """The paper's PowerDP (and output perturbation) at client level clip and noise each silo's
    round delta, not its whole adapter: against a public global far larger than C, silos that
    changed nothing contribute nothing (none clipped) and, without noise, the global comes back."""
    from strategies import mechanisms as MECH

    A_g, B_g = glob()
    B_g = {n: b * 1e3 for n, b in B_g.items()}  # ||B_g A_g|| >> C: a whole-adapter clip would cut it
    gl = (A_g, B_g)
    same = [AdapterUpdate(A=dict(A_g), B=dict(B_g), extra={"head": torch.zeros(2, 4, dtype=F64)}) for _ in range(3)]
    c = ctx(clip=1.0, iters=3)
    mech = MECH.get(round_type)
    rel = mech.release(same, c, [0.0] * len(mech.blocks), gen(4), MECH.ReleaseArgs(glob=gl, denominator=3.0))
    assert rel.num_clients == 3 and max(rel.update_norms) == 0.0 and min(rel.clip_scales) == 1.0
    for n in SHAPES:
        want = B_g[n] @ A_g[n]
        assert torch.allclose(rel.B[n] @ rel.A[n], want, atol=1e-8 * want.norm())
    # one silo's change moves the release by its clipped delta, averaged over the replies
    moved = same[:2] + [client(gl, 7, scale=1e-4)]
    rel = mech.release(moved, c, [0.0] * len(mech.blocks), gen(4), MECH.ReleaseArgs(glob=gl, denominator=3.0))
    assert min(rel.clip_scales) == 1.0 and 0 < max(rel.update_norms) < 1.0


@pytest.mark.parametrize("round_type, inner", [("powerdp-delta", "powerdp"), ("output-delta", "output_perturbation")])
def test_the_papers_releases_on_the_delta_noise_the_clipped_delta_average_over_the_replies(monkeypatch, round_type,
                                                                                            inner):
    """What the paper's mechanism receives at client level is the average over the k replies (not
    the fixed m: its diameter sensitivity needs a norm <= C) of the clipped deltas B_i A_i - B_g A_g,
    and it gets the calibrated stds; the public global is added back afterwards."""
    from strategies import mechanisms as MECH

    seen = []
    real = getattr(CD, inner)

    def spy(*, factors, **kw):
        seen.append((factors, kw))
        return real(factors=factors, **kw)

    monkeypatch.setattr(CD, inner, spy)
    gl = glob()
    ups = [client(gl, i, scale=s) for i, s in enumerate([0.01, 1.0, 5.0])]  # the last two are clipped
    c = ctx(clip=1.0)
    mech = MECH.get(round_type)
    stds = [0.3, 0.3] if round_type == "powerdp-delta" else [0.3, 0.7]  # PowerDP: equal sensitivities, one std
    rel = mech.release(ups, c, stds, gen(5), MECH.ReleaseArgs(glob=gl, denominator=7.0))  # m = 7, k = 3
    sq = sum(sum(float(d.pow(2).sum()) for d in dense_delta(u, gl).values()) + float(u.extra["head"].pow(2).sum())
             for u in ups[1:2])
    from strategies.aggregation import CLIP_MARGIN

    # the server clips to C / (1 + margin) so that float rounding cannot exceed C
    assert rel.clip_scales[0] == 1.0
    assert rel.clip_scales[1] == pytest.approx(1.0 / (1 + CLIP_MARGIN) / math.sqrt(sq), rel=1e-9)
    total = 0.0
    for (factors, kw), g in zip(seen, c.groups):
        Bs, As = factors
        want = torch.stack([sum(sc * dense_delta(u, gl)[n] for sc, u in zip(rel.clip_scales, ups)) / 3.0
                            for n in g.names])
        assert torch.allclose(Bs @ As, want, atol=1e-12)
        total += float(want.pow(2).sum())
        got = [kw["noise_std"]] * 2 if "noise_std" in kw else [kw["noise_std_a"], kw["noise_std_b"]]
        assert got == stds
    assert math.sqrt(total) <= 1.0 + 1e-9  # the average over the replies stays within C


def test_an_empty_round_still_releases_noise():
    from strategies import mechanisms as MECH

    gl = glob()
    for fn in (CD.fedlora_delta_release, CD.ffa_delta_release, CD.powerdp_l_release):
        rel = fn([], ctx(), gl, 0.5, gen(3), denominator=5.0)
        assert rel.num_clients == 0
        assert any(not torch.allclose(rel.B[n], gl[1][n]) for n in SHAPES)  # noise, not a skipped round
        assert rel.extra_delta["head"].abs().sum() > 0
    for rt in ("powerdp-delta", "output-delta"):
        mech = MECH.get(rt)
        args = MECH.ReleaseArgs(glob=gl, denominator=5.0)
        rel = mech.release([], ctx(iters=3), [0.5] * len(mech.blocks), gen(3), args)
        assert rel.num_clients == 0 and rel.extra_delta["head"].abs().sum() > 0
        assert any(not torch.allclose(rel.B[n] @ rel.A[n], gl[1][n] @ gl[0][n]) for n in SHAPES)
        rel = mech.release([], ctx(iters=3), [0.0] * len(mech.blocks), gen(3), args)  # no noise: the global
        assert all(torch.allclose(rel.B[n] @ rel.A[n], gl[1][n] @ gl[0][n], atol=1e-9) for n in SHAPES)


def test_the_config_accepts_exactly_the_client_refactorizations():
    from fedpower_app.config import ConfigError, parse_config
    from strategies import mechanisms as MECH

    for name in MECH.CLIENT_REFACTORIZATION:
        assert parse_config({"strategy.client-refactorization": name})["strategy.client-refactorization"] == name
    with pytest.raises(ConfigError):
        parse_config({"strategy.client-refactorization": "powerdp-delta"})


@pytest.mark.parametrize("name, extra, round_type, blocks", [
    ("fedpower", {}, "powerdp-l", 4), ("fedlora", {}, "fedlora-delta", 1), ("ffa-lora", {}, "ffa-delta", 1),
    ("fedpower", {"strategy.client-refactorization": "powerdp"}, "powerdp-delta", 2),
    ("output-perturbation", {}, "output-delta", 2), ("input-perturbation", {}, "input-delta", 1),
])
def test_client_level_runs_release_deltas_through_the_real_apps(tmp_path, name, extra, round_type, blocks):
    """In-process ServerApp + ClientApp at dp.level = client: the round type, the stds of the
    calibration (fixed denominator m = q_c N = 3), and the budget."""
    from tests.test_app_inprocess import run_inprocess

    res, _ = run_inprocess(tmp_path, num_nodes=3, **{"num-server-rounds": 2, "dp.level": "client",
                                                     "strategy.name": name, "dp.clip": 0.5, **extra,
                                                     "dp.noise": "hardened", "dp.diagnostics": "released"})
    cal = res["privacy"]["calibration"]
    assert res["status"] == "completed" and cal["is_valid_guarantee"] and cal["level"] == "client"
    for row in res["rounds"]:
        assert row["round_type"] == round_type and row["aggregated"] == 3
        assert row["noise_stds"] == pytest.approx(cal["noise_std"][round_type])
        assert len(row["noise_stds"]) == blocks
    assert 0 < res["rounds"][0]["epsilon"] < res["rounds"][1]["epsilon"] <= 8.0 * (1 + 1e-6)


def test_noise_reaching_w_matches_the_derivation_in_results():
    """research/noise_in_w.py (RESULTS.md, "Where FedPower's noise goes"): at round 1 (B_g = 0,
    A_g PEFT's init with A A^T ~ I/3) FedLoRA's noise reaches W as s*sqrt(m*||A||^2) = 32 s, and
    PowerDP-L's as its block std * sqrt(r n), 2 sqrt(3) ~ 3.46 times more at the same z, C, m."""
    from research.noise_in_w import measure, method_configs
    from fedpower_app.config import PROJECT_ROOT

    configs = method_configs(str(PROJECT_ROOT / "conf/cross-device-sst2.toml"))  # C 2, 2 power iterations for all
    configs["ffa-lora"]["dp.clip"] = 20.0
    rows = {r["method"]: r for r in measure(configs, 1000, draws=2, b_std=0.0, modules=2)}
    s = rows["fedlora"]["stds"][0]
    assert rows["fedlora"]["noise_in_W"] == pytest.approx(32 * s, rel=0.05)
    assert rows["fedpower"]["noise_in_W"] == pytest.approx(rows["fedpower"]["stds"][-1] * (8 * 384) ** 0.5, rel=0.03)
    assert rows["fedpower"]["noise_in_W"] / rows["fedlora"]["noise_in_W"] == pytest.approx(2 * 3 ** 0.5, rel=0.06)
    assert rows["ffa-lora"]["noise_in_W"] == pytest.approx(10 * rows["fedlora"]["noise_in_W"], rel=0.06)  # C 20 vs 2
    # the paper's PowerDP on an empty round: B~ = N_B (std s), A~ orthonormal rows, so ||N_B A~|| = s sqrt(m r)
    powerdp = rows["fedpower-powerdp"]
    assert powerdp["round_type"] == "powerdp-delta"
    assert powerdp["noise_in_W"] == pytest.approx(powerdp["stds"][0] * (384 * 8) ** 0.5, rel=0.03)


def _pre_noise_release(round_type, updates, c, gl, m):
    """What each client-level round type puts its noise on, computed by the product's own code:
    the joint (dA, dB, dhead) / (dB, dhead) average for the linear releases, W = B_g A_g + sum_i w_i dW_i and the head average for PowerDP-L and input
    perturbation, and the clipped delta averaged over the replies for the paper's factor-noise
    releases. Returned as one flat float64 vector."""
    if round_type in ("fedlora-delta", "ffa-delta"):
        avg, _, _ = CD.linear_delta_average(updates, c, gl, m, with_a=round_type == "fedlora-delta")
        return torch.cat([v.flatten() for v in avg.values()])
    k = len(updates)
    denominator = m if round_type in ("powerdp-l", "input-delta") else max(k, 1)  # the ablations: over the replies
    _, _, w = CD._clipped_delta_weights(updates, c, gl, denominator)
    parts = []
    for g in c.groups:
        Bs, As, _ = CD._group_new_w_factors(updates, g, gl, w, "cpu", CD.F64)  # the releases' working precision
        parts.append((Bs.double() @ As.double()).flatten())
    if round_type in ("powerdp-delta", "output-delta"):  # the delta itself: subtract the public global
        parts = [p - torch.stack([gl[1][n].double() @ gl[0][n].double() for n in g.names]).flatten()
                 for p, g in zip(parts, c.groups)]
    head = sum((float(wi) * u.extra["head"].double() for wi, u in zip(w, updates)), torch.zeros(2, 4, dtype=F64))
    return torch.cat(parts + [head.flatten()])


@pytest.mark.parametrize("global_scale", [1.0, 1e4])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("round_type", ["fedlora-delta", "ffa-delta", "powerdp-l", "input-delta", "powerdp-delta",
                                        "output-delta"])
def test_adding_or_removing_one_client_moves_every_delta_release_within_its_sensitivity(round_type, dtype,
                                                                                      global_scale):
    """Client level, add/remove one client (docs/privacy.md §12): with the fixed denominator m the
    noised quantity moves by at most C/m (the stated sensitivity of the linear releases and of
    every PowerDP-L block, a 1-Lipschitz function of W); for the paper's releases on the delta,
    averaged over the replies, it always has norm <= C (their diameter sensitivities are 2C). Random
    client sets of 0-5 others, changes from far below to 30x the clip, replies in float64 and
    float32 (what silos send), and a public global of norm ~3e4 C (B_g A_g and B_i A_i far larger
    than the deltas: the merged W is formed in float64, so its rounding stays inside the clip's
    margin; in float32 this case exceeded C/m by 3.5e-4)."""
    rng = np.random.default_rng(7)
    C, m = 0.7, 4.0
    c = dataclasses.replace(ctx(clip=C), dtype=dtype)
    gl = glob()
    gl = (gl[0], {n: b * global_scale for n, b in gl[1].items()})
    if dtype == torch.float32:
        gl = ({n: a.float() for n, a in gl[0].items()}, {n: b.float() for n, b in gl[1].items()})

    def cast(u):
        return AdapterUpdate(A={n: a.to(dtype) for n, a in u.A.items()}, B={n: b.to(dtype) for n, b in u.B.items()},
                             extra={n: x.to(dtype) for n, x in u.extra.items()})

    tol = 1e-9 if dtype == torch.float64 else 1e-5
    worst = 0.0
    for trial in range(20):
        k = int(rng.integers(0, 6))
        others = [cast(client(gl, 10 * trial + i, scale=float(rng.choice([1e-3, 0.3, 3.0, 30.0])))) for i in range(k)]
        x = cast(client(gl, 10 * trial + 9, scale=float(rng.choice([0.3, 3.0, 30.0]))))
        with_x = _pre_noise_release(round_type, others + [x], c, gl, m)
        if round_type in ("powerdp-delta", "output-delta"):
            assert float(with_x.norm()) <= C * (1 + tol)
            worst = max(worst, float(with_x.norm()) / C)
            continue
        moved = float((with_x - _pre_noise_release(round_type, others, c, gl, m)).norm())
        assert moved <= C / m * (1 + tol), (trial, k, moved)
        worst = max(worst, moved / (C / m))
    assert worst > 0.99  # clipped clients reach the bound: the test is not trivially loose
