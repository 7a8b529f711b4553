"""Tests of fedpower_app.privacy.accounting against the privacy spec's test vectors.

Spec: docs/privacy-accounting.md of the shared project docs (sections 6.1, 6.2, 6.3).
Settings of the paper: N = 6, q_c = 0.5, T = 200, delta = 1e-5, b = 128, SST-2 n = 67349 split
equally (n_i = 11225 gives q_s = 0.0114031, spec 0.011403).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from fedpower_app.privacy import accounting as A

DELTA = 1e-5
SST2_SIZES = [11225] * 6
OPACUS_DEFAULT_ALPHAS = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def client_plan(**kw) -> A.PrivacyPlan:
    args = dict(method="fedpower", level="client", epsilon=3.0, delta=DELTA, num_rounds=200,
                client_rate=0.5, num_clients=6, clip=1.0)
    args.update(kw)
    return A.PrivacyPlan(**args)


def sample_plan(**kw) -> A.PrivacyPlan:
    args = dict(method="fedpower", level="sample", epsilon=3.0, delta=DELTA, num_rounds=200,
                client_rate=0.5, num_clients=6, client_sizes=SST2_SIZES, batch_size=128,
                local_steps=1, clip=1.0)
    args.update(kw)
    return A.PrivacyPlan(**args)


@pytest.fixture(scope="module")
def client_cal() -> A.Calibration:
    return A.calibrate(client_plan())


# ------------------------------------------------------------------------------------------
# Spec 6.3: library-level vectors
# ------------------------------------------------------------------------------------------


def test_orders_are_dp_accounting_defaults():
    from dp_accounting.rdp import rdp_privacy_accountant as r

    assert list(A.ORDERS) == [1 + x / 10.0 for x in range(1, 100)] + list(range(11, 64)) + [128, 256, 512, 1024]
    assert list(A.ORDERS) == list(r.DEFAULT_RDP_ORDERS)


@pytest.mark.parametrize(
    "q,z,order,expected",
    [
        (0.01, 1.0, 2, 1.7181342207453428e-04),
        (0.01, 1.0, 8, 8.936439076060279e-04),
        (0.01, 1.0, 32, 11.246275937048072),
        (0.5, 2.0, 4, 0.1573682031940248),
        (0.5, 2.0, 16.5, 1.3475688649442261),
        (1.0, 2.0, 10, 1.25),
    ],
)
def test_compute_rdp_vectors(q, z, order, expected):
    assert A.rdp_sgm(q, z, orders=[order])[0] == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize(
    "z,q,T,eps_rdp,order",
    [
        (1.0, 0.01, 1000, 2.1013652716430564, 7.8),
        (5.0, 1.0, 10, 2.8136532471298397, None),
        (10.0, 0.5, 200, 3.2189553062355967, None),
        (4.0, 0.5, 200, 9.500248359439215, None),
        (0.8, 0.0057, 200, 1.8316068183989984, None),
        (1.1, 0.000256, 2000, 0.4230681320766597, None),
    ],
)
def test_rdp_accountant_histories(z, q, T, eps_rdp, order):
    # opacus RDPAccountant == get_privacy_spent(T * compute_rdp) over opacus' default alphas
    e, a = A.rdp_to_epsilon(T * A.rdp_sgm(q, z, OPACUS_DEFAULT_ALPHAS), DELTA, OPACUS_DEFAULT_ALPHAS)
    assert e == pytest.approx(eps_rdp, rel=1e-9)
    if order is not None:
        assert a == order
    # the longer dp_accounting order list can only help
    e2, _ = A.rdp_to_epsilon(T * A.rdp_sgm(q, z), DELTA)
    assert e2 <= e * (1 + 1e-12)


@pytest.mark.parametrize(
    "z,q,T,expected",
    [(1.0, 0.01, 1000, 2.101366525), (10.0, 0.5, 200, 3.219205), (4.0, 0.5, 200, 9.673422)],
)
def test_dp_accounting_rdp_vectors(z, q, T, expected):
    import dp_accounting as dpa

    acc = dpa.rdp.RdpAccountant()
    acc.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)), T))
    assert acc.get_epsilon(DELTA) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize(
    "z,q,T,expected,interval",
    [
        (1.0, 0.01, 1000, 1.828244, 1e-3),
        (5.0, 1.0, 10, 2.594383, 1e-3),
        (10.0, 0.5, 200, 2.967774, 1e-3),
        (4.0, 0.5, 200, 8.819434, 1e-3),
        (0.8, 0.0057, 200, 1.111787, 1e-3),
        (1.1, 0.000256, 2000, 0.038946, 1e-4),  # tiny epsilon: needs the spec's 1e-4 grid
    ],
)
def test_pld_vectors(z, q, T, expected, interval):
    pld = A.round_pld("client", z, q_c=q, value_discretization_interval=interval).self_compose(T)
    eps = A.pld_epsilon(pld, DELTA)
    assert eps == pytest.approx(expected, rel=1e-2)
    assert eps >= expected * (1 - 1e-4)  # pessimistic discretisation: never below the fine value


@pytest.mark.parametrize(
    "sigma,expected",
    [(5 / math.sqrt(10), 2.5943833805), (2.0, 1.99309), (1.0, 4.37718), (0.5, 9.99726)],
)
def test_exact_gaussian_vectors(sigma, expected):
    import dp_accounting as dpa

    assert dpa.get_epsilon_gaussian(sigma, DELTA) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize(
    "q_c,pi,z,rdp2,pld2,prod",
    [
        (0.5, 0.0114, 0.8, 2.3374724736570385, 1.679464, 1.831607),
        (0.5, 0.056, 1.0, 4.520156, 3.940481, 3.031262),
        (0.5, 1.0, 10.0, 4.805945, 4.431846, 3.218955),
    ],
)
def test_two_stage_vectors(q_c, pi, z, rdp2, pld2, prod):
    T = 200
    e2, _ = A.rdp_to_epsilon(T * A.round_rdp("sample", z, q_c=q_c, pi=pi), DELTA)
    assert e2 == pytest.approx(rdp2, rel=1e-6)
    ep, _ = A.rdp_to_epsilon(T * A.round_rdp("sample", z, q_c=q_c, pi=pi, sample_mode="product"), DELTA)
    assert ep == pytest.approx(prod, rel=1e-6)
    pld = A.round_pld("sample", z, q_c=q_c, pi=pi).self_compose(T)
    assert A.pld_epsilon(pld, DELTA) == pytest.approx(pld2, rel=1e-2)


def test_two_stage_equals_client_sgm_when_pi_is_one():
    # product with pi = 1 is the client-level SGM(q = .5)
    a = A.round_rdp("sample", 10.0, q_c=0.5, pi=1.0, sample_mode="product")
    b = A.round_rdp("client", 10.0, q_c=0.5)
    np.testing.assert_allclose(a, b, rtol=0, atol=0)


def test_calibrate_client_level_vector(client_cal):
    assert client_cal.z == pytest.approx(10.641, rel=2e-4)
    assert client_cal.epsilon <= 3.0
    assert client_cal.epsilon == pytest.approx(3.0, rel=1e-4)
    assert client_cal.is_valid_guarantee


def test_inclusion_probability_vector():
    assert A.inclusion_probability(128 / (67349 / 6), 5) == pytest.approx(0.0557308310526925, rel=1e-12)
    assert A.inclusion_probability(0.3, 1) == pytest.approx(0.3)
    assert A.inclusion_probability(1.0, 3) == 1.0
    assert A.inclusion_probability(0.0, 3) == 0.0


def test_effective_z_two_blocks_vector():
    assert A.effective_z([1.0, 1.0], [2.0, 2.0]) == pytest.approx(math.sqrt(2), rel=1e-12)
    assert A.effective_z([1.0], [0.0]) == 0.0
    assert A.effective_z([0.0], [1.0]) == math.inf


# ------------------------------------------------------------------------------------------
# Spec 6.1: calibrated z in the paper's settings
# ------------------------------------------------------------------------------------------


def test_client_level_z_table(client_cal):
    assert client_cal.z == pytest.approx(10.6421, rel=1e-3)


@pytest.mark.parametrize(
    "L,mode,expected",
    [(1, "two-stage", 0.7301), (1, "product", 0.6705), (5, "two-stage", 1.2283), (5, "product", 1.0027)],
)
def test_sample_level_z_table(L, mode, expected):
    cal = A.calibrate(sample_plan(local_steps=L, sample_mode=mode))
    assert cal.z == pytest.approx(expected, rel=1e-3)
    assert cal.epsilon <= 3.0
    assert cal.is_valid_guarantee == (mode == "two-stage")


def test_sample_level_pld_two_stage():
    # spec 6.1: two-stage PLD z = 0.6671 (SST-2, L = 1, eps = 3). The full PLD calibration (with
    # its round-by-round trajectory) is exercised on a short run in test_ledger_stops_before_crossing.
    pi = sample_plan().pi

    def eps(z):
        return A.pld_epsilon(A.round_pld("sample", z, q_c=0.5, pi=pi).self_compose(200), DELTA)

    assert eps(0.6671 * 1.002) <= 3.0 < eps(0.6671 * 0.998)
    # PLD is tighter than RDP at the same z
    assert A.rdp_to_epsilon(200 * A.round_rdp("sample", 0.6671, q_c=0.5, pi=pi), DELTA)[0] > 3.0


def test_pi_values():
    assert sample_plan().pi == pytest.approx(0.01140, rel=1e-3)
    assert sample_plan(local_steps=5).pi == pytest.approx(0.05573, rel=1e-3)
    assert sample_plan(local_steps=88).pi == pytest.approx(0.6355, rel=1e-3)
    # unequal sizes: the smallest client determines pi
    assert A.sample_rate_pi([1000, 128 * 4], 128, 1) == pytest.approx(0.25)


# ------------------------------------------------------------------------------------------
# Spec 6.2: trajectories
# ------------------------------------------------------------------------------------------


def test_client_trajectory(client_cal):
    tr = client_cal.trajectory
    assert len(tr) == 200
    assert tr[0] == pytest.approx(0.184, abs=1.5e-3)
    assert tr[9] == pytest.approx(0.595, abs=1.5e-3)
    assert tr[49] == pytest.approx(1.404, abs=1.5e-3)
    assert tr[99] == pytest.approx(2.046, abs=1.5e-3)
    assert tr[199] == pytest.approx(3.000, abs=1.5e-3)
    assert all(b >= a for a, b in zip(tr, tr[1:]))


@pytest.mark.parametrize(
    "L,z,points",
    [
        (1, 0.730, {1: 1.946, 10: 2.222, 50: 2.528, 100: 2.724, 200: 3.000}),
        (5, 1.228, {1: 1.037, 10: 1.305, 50: 1.833, 100: 2.290, 200: 3.000}),
    ],
)
def test_sample_trajectories(L, z, points):
    cal = A.epsilon_for_noise_multiplier(sample_plan(local_steps=L), z)
    for t, e in points.items():
        assert cal.trajectory[t - 1] == pytest.approx(e, abs=3e-3)
    assert cal.mode == "fixed-z" and cal.is_valid_guarantee


def test_client_pld_first_round():
    cal = A.epsilon_for_noise_multiplier(client_plan(accountant="pld", num_rounds=1), 10.641)
    assert cal.epsilon == pytest.approx(0.162, abs=2e-3)


# ------------------------------------------------------------------------------------------
# Sensitivities, noise, schedule
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("round_type", A.ROUND_TYPES)
@pytest.mark.parametrize("level", A.LEVELS)
@pytest.mark.parametrize("k", [None, 0, 1, 3, 6])
def test_noise_stds_give_target_z(round_type, level, k):
    for z in (0.37, 1.0, 10.641):
        for clip in (0.5, 2.0):
            sens = A.block_sensitivities(round_type, level, clip, k=k, rank=4, num_modules=7)
            stds = A.noise_stds(round_type, level, z, clip, k=k, rank=4, num_modules=7)
            assert len(sens) == len(stds) == len(A.BLOCK_NAMES[round_type])
            assert A.effective_z(sens, stds) == pytest.approx(z, rel=1e-12)


def test_sensitivity_table():
    C = 2.0
    assert A.block_sensitivities("powerdp", "sample", C) == [4.0, 4.0]
    assert A.block_sensitivities("powerdp", "client", C, k=5) == [4.0, 4.0]
    assert A.block_sensitivities("fedlora", "sample", C, k=4) == [1.0, 1.0]
    assert A.block_sensitivities("fedlora", "sample", C) == [4.0, 4.0]  # worst case k = 1
    assert A.block_sensitivities("fedlora", "sample", C, k=0) == [4.0, 4.0]  # empty round
    assert A.block_sensitivities("fedlora", "client", C, k=4) == [2.0, 2.0]  # no k at client level
    assert A.block_sensitivities("ffa", "sample", C, k=2) == [2.0]
    assert A.block_sensitivities("input", "client", C) == [2.0]
    assert A.block_sensitivities("output", "sample", C, rank=8, num_modules=2) == [8.0, 4.0]
    # output perturbation: budget split equally
    z = 1.3
    sA, sB = A.noise_stds("output", "client", z, C, rank=8, num_modules=2)
    assert sA == pytest.approx(math.sqrt(2) * z * 8.0)
    assert sB == pytest.approx(math.sqrt(2) * z * 4.0)
    # PowerDP: s = z * 2 * sqrt(2) * C per block
    assert A.noise_stds("powerdp", "sample", z, C) == pytest.approx([2 * math.sqrt(2) * z * C] * 2)
    # k-scaled noise at sample level, fixed at client level
    assert A.noise_stds("ffa", "sample", z, C, k=4) == pytest.approx([z * 2 * C / 4])
    assert A.noise_stds("ffa", "sample", z, C, k=0) == A.noise_stds("ffa", "sample", z, C, k=1)
    assert A.noise_stds("ffa", "client", z, C, k=4) == A.noise_stds("ffa", "client", z, C, k=1)


def test_round_schedule():
    assert A.round_schedule("fedpower", 4) == ["powerdp"] * 4
    assert A.round_schedule("fedpower", 7, refactor_every=3) == [
        "fedlora", "fedlora", "powerdp", "fedlora", "fedlora", "powerdp", "fedlora"]
    assert A.round_schedule("ffa-lora", 2, refactor_every=3) == ["ffa", "ffa"]
    assert A.round_schedule("input-perturbation", 1) == ["input"]
    assert A.round_schedule("output-perturbation", 1) == ["output"]
    assert A.round_schedule("fedlora", 1) == ["fedlora"]


def test_rdp_sgm_edge_cases():
    assert np.all(A.rdp_sgm(0.5, 0.0) == np.inf)
    assert np.all(A.rdp_sgm(0.5, math.inf) == 0)
    assert np.all(A.rdp_sgm(0.0, 1.0) == 0)
    assert A.rdp_to_epsilon(A.rdp_sgm(0.5, 0.0), DELTA)[0] == math.inf


def test_k_mixture_constant_z_equals_two_stage():
    a = A.round_rdp_k_mixture([0.9] * 6, q_c=0.5, pi=0.0114, num_clients=6)
    b = A.round_rdp("sample", 0.9, q_c=0.5, pi=0.0114)
    np.testing.assert_allclose(a, b, rtol=1e-10)
    # more noise for larger k can only help
    c = A.round_rdp_k_mixture(lambda k: 0.9 * k, q_c=0.5, pi=0.0114, num_clients=6)
    assert np.all(c <= b + 1e-15)


def test_refactor_every_calibration():
    cal = A.calibrate(sample_plan(refactor_every=5, clip=2.0))
    # rigorous: every round type has the same z, so z equals the F = 1 value
    assert cal.z == pytest.approx(0.7301, rel=1e-3)
    assert cal.schedule_counts == {"fedlora": 160, "powerdp": 40}
    assert cal.z_per_round_type == {"fedlora": cal.z, "powerdp": cal.z}
    assert cal.noise_std["powerdp"] == pytest.approx([2 * math.sqrt(2) * cal.z * 2.0] * 2)
    assert cal.noise_std["fedlora"] == pytest.approx([2 * math.sqrt(2) * cal.z * 2.0] * 2)  # at k = 1


# ------------------------------------------------------------------------------------------
# Paper mode and the paper's sigma table
# ------------------------------------------------------------------------------------------


def test_paper_mode_sample_level_is_not_a_guarantee():
    cal = A.calibrate(sample_plan(calibration="paper"))
    assert cal.sigma_alg == pytest.approx(0.1302, rel=1e-3)  # spec 6.1 "paper q sqrt" column
    assert cal.is_valid_guarantee is False
    assert cal.label == A.PAPER_LABEL
    assert cal.mode == "paper"
    assert cal.z_per_round_type["powerdp"] == pytest.approx(cal.sigma_alg / (2 * math.sqrt(2)))
    assert cal.true_epsilon == cal.epsilon
    assert cal.true_epsilon > 100  # spec 2.5: hundreds or more (PLD ~1870)
    assert cal.noise_std["powerdp"] == pytest.approx([cal.sigma_alg * 1.0] * 2)
    json.dumps(cal.to_dict(), allow_nan=False)


def test_paper_mode_client_level():
    # Client level releases round deltas averaged over the fixed m = q_c N = 3: Delta = C/m, so the
    # paper's sigma (std sigma C per entry) is an effective multiplier sigma m: very conservative.
    cal = A.calibrate(client_plan(method="ffa-lora", calibration="paper"))
    assert cal.sigma_alg == pytest.approx(11.4193, rel=1e-4)
    assert cal.z_per_round_type == {"ffa-delta": pytest.approx(3 * 11.4193, rel=1e-4)}
    assert cal.is_valid_guarantee is False
    assert cal.true_epsilon < 1.0


def test_paper_sigma_table_sample_level():
    # spec 6.1: sigma_alg (s = sigma_alg * C) that gives epsilon = 3, SST-2 L = 1, two-stage RDP
    e = A.epsilon_for_sigma_alg(sample_plan(), 2.065).epsilon  # PowerDP = 2 sqrt 2 z
    assert e == pytest.approx(3.0, rel=2e-3)
    e = A.epsilon_for_sigma_alg(sample_plan(method="fedlora"), 1.797).epsilon  # k-mixture
    assert e == pytest.approx(3.0, rel=2e-3)


def test_paper_sigma_table_client_level():
    # The paper's PowerDP on the averaged delta (the ablation): z = sigma / (2 sqrt 2), spec 6.1.
    e1 = A.epsilon_for_sigma_alg(client_plan(refactorization="powerdp"), 30.10).epsilon
    assert e1 == pytest.approx(3.0, rel=2e-3)
    # FedLoRA on round deltas with the fixed m = q_c N = 3 and a joint clip: Delta = C/m, one block,
    # so the same per-entry std is z = 3 sigma: the same epsilon at a third of the noise.
    e2 = A.epsilon_for_sigma_alg(client_plan(method="fedlora"), 10.64 / 3).epsilon
    assert e2 == pytest.approx(e1, rel=2e-3)


# ------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(client_rate=1.5), "client_rate must be in (0, 1], got 1.5"),
        (dict(client_rate=0), "client_rate"),
        (dict(epsilon=-1), "epsilon"),
        (dict(delta=1.0), "delta"),
        (dict(num_rounds=0), "num_rounds"),
        (dict(num_clients=2.5), "num_clients"),
        (dict(local_steps=0), "local_steps"),
        (dict(batch_size=0), "batch_size"),
        (dict(clip=None), "clip"),
        (dict(clip=-1.0), "clip"),
        (dict(rank=0), "rank"),
        (dict(num_modules=0), "num_modules"),
        (dict(refactor_every=0), "refactor_every"),
        (dict(client_sizes=[]), "client_sizes"),
        (dict(client_sizes=[100, 0, 1, 1, 1, 1]), "client_sizes[1]"),
        (dict(client_sizes=[100, 100]), "num_clients"),
        (dict(client_sizes=None), "client_sizes is required"),
        (dict(method="fedavg"), "valid choices"),
        (dict(level="user"), "valid choices"),
        (dict(sample_mode="exact"), "two-stage"),
        (dict(accountant="prv"), "pld"),
        (dict(calibration="heuristic"), "rigorous"),
    ],
)
def test_plan_validation(kw, msg):
    with pytest.raises(ValueError) as ei:
        sample_plan(**kw)
    assert msg in str(ei.value)


def test_helper_validation():
    with pytest.raises(ValueError, match="client_sizes"):
        A.sample_rate_pi([], 128, 1)
    with pytest.raises(ValueError, match="client_sizes\\[0\\]"):
        A.sample_rate_pi([0], 128, 1)
    with pytest.raises(ValueError, match="batch_size"):
        A.sample_rate_pi([10], 0, 1)
    with pytest.raises(ValueError, match="local_steps"):
        A.sample_rate_pi([10], 1, 0)
    with pytest.raises(ValueError, match="valid choices"):
        A.block_sensitivities("powerdp-x", "sample", 1.0)
    with pytest.raises(ValueError, match="client-level release of round deltas"):
        A.block_sensitivities("powerdp-l", "sample", 1.0)
    with pytest.raises(ValueError, match="fixed denominator"):
        A.block_sensitivities("powerdp-l", "client", 1.0)
    with pytest.raises(ValueError, match="pi"):
        A.round_rdp("sample", 1.0, q_c=0.5)
    with pytest.raises(ValueError, match="max_grid_points"):
        A.round_pld("client", 0.01, q_c=0.5)  # memory guard: tiny z
    assert A.safe_discretization_interval(0.01, 1e-3) > 1e-3


def test_aliases_are_normalised():
    p = sample_plan(method="FFA_LoRA", sample_mode="two_stage")
    assert p.method == "ffa-lora" and p.sample_mode == "two-stage"


# ------------------------------------------------------------------------------------------
# Ledger
# ------------------------------------------------------------------------------------------


def _run(ledger: A.PrivacyLedger, schedule):
    for t, rt in enumerate(schedule, 1):
        vec = ledger.rdp_for_round(rt)
        if ledger.would_exceed(vec, round_type=rt):
            return t, ledger.exceed_message(rt, t)
        ledger.record(rt, ledger.z_for_round(rt), vec, t, clients_sampled=3)
    return None, None


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_ledger_stops_before_crossing(accountant):
    # coarse PLD grid: this test is about the ledger logic, not PLD accuracy
    plan = sample_plan(num_rounds=20, refactor_every=3, accountant=accountant, pld_interval=5e-3)
    cal = A.calibrate(plan)
    assert cal.epsilon <= plan.epsilon and cal.trajectory_accountant == accountant
    ledger = A.PrivacyLedger(plan, cal)
    extended = plan.schedule + ["powerdp", "fedlora", "fedlora"]
    stopped, msg = _run(ledger, extended)
    assert stopped == 21  # all planned rounds run, the first extra one is refused
    assert "privacy budget exhausted" in msg and "round 21" in msg
    assert ledger.rounds_recorded == 20
    assert ledger.epsilon() <= plan.epsilon
    assert ledger.epsilon() == pytest.approx(cal.epsilon, rel=1e-9)
    assert [e["epsilon"] for e in ledger.history] == pytest.approx(cal.trajectory, rel=1e-9)
    with pytest.raises(A.PrivacyBudgetExceeded):
        ledger.assert_can_release("powerdp", 21)


def test_ledger_state_dict_round_trip():
    plan = sample_plan(num_rounds=10)
    cal = A.calibrate(plan)
    ledger = A.PrivacyLedger(plan, cal)
    for t in range(1, 6):
        vec = ledger.assert_can_release("powerdp", t)
        ledger.record("powerdp", cal.z, vec, t, clients_sampled=t % 4)
    state = json.loads(json.dumps(ledger.state_dict(), allow_nan=False))
    restored = A.PrivacyLedger.from_state_dict(state)
    assert restored.epsilon() == ledger.epsilon()
    assert restored.history == ledger.history
    assert restored.calibration.z == cal.z
    # same continuation: 5 more rounds fit, the 11th does not
    stopped, _ = _run_from(restored, 6, ["powerdp"] * 6)
    assert stopped == 11
    # resuming into a ledger of a different plan is refused
    other = A.PrivacyLedger(sample_plan(num_rounds=11), cal)
    with pytest.raises(ValueError, match="different PrivacyPlan"):
        other.load_state_dict(state)


def _run_from(ledger, start, schedule):
    for t, rt in enumerate(schedule, start):
        vec = ledger.rdp_for_round(rt)
        if ledger.would_exceed(vec, round_type=rt):
            return t, None
        ledger.record(rt, ledger.z_for_round(rt), vec, t)
    return None, None


def test_ledger_paper_mode_budget_is_true_epsilon():
    plan = sample_plan(num_rounds=5, calibration="paper")
    ledger = A.PrivacyLedger(plan)
    stopped, _ = _run(ledger, plan.schedule + ["powerdp"])
    assert stopped == 6
    assert ledger.epsilon() == pytest.approx(ledger.calibration.true_epsilon, rel=1e-9)
    assert ledger.noise_stds_for_round("powerdp") == pytest.approx([ledger.calibration.sigma_alg] * 2)


def test_ledger_noise_for_realised_k():
    plan = sample_plan(method="ffa-lora", num_rounds=10, clip=2.0)
    ledger = A.PrivacyLedger(plan)
    z = ledger.calibration.z
    assert ledger.noise_stds_for_round("ffa", k=4) == pytest.approx([z * 2 * 2.0 / 4])
    assert ledger.noise_stds_for_round("ffa", k=0) == pytest.approx([z * 2 * 2.0])


# The fedpower-privacy CLI is tested in tests/test_privacy_cli.py.


def test_pld_epsilon_overflow_fallback():
    # dp_accounting's get_epsilon_for_delta overflows to inf for epsilon > ~700 on some mixtures;
    # pld_epsilon then bisects on get_delta_for_epsilon (monotone) instead.
    class FakePLD:
        def get_epsilon_for_delta(self, delta):
            return math.inf

        def get_delta_for_epsilon(self, eps):
            return math.exp(-(eps - 700.0)) * 1e-5 if eps > 700.0 else 1.0

    assert A.pld_epsilon(FakePLD(), 1e-5) == pytest.approx(700.0, rel=1e-8)


def test_the_accounting_package_imports_no_torch():
    """Its docstring says so: the planner and the accountants load without torch."""
    import subprocess
    import sys

    code = "import sys, fedpower_app.privacy.accounting, strategies.mechanisms; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


def test_a_dp_sgd_step_is_one_more_event_of_the_accountant_interface():
    """The silo's ledger is priced through the same Accountant interface as the
    server's; a DP-SGD step is the event SGM(q = b/n, sigma), composed L times per round."""
    from opacus.accountants import RDPAccountant as OpacusRDP

    from fedpower_app.privacy.accounting.interface import dp_sgd_step, make_accountant
    from fedpower_app.privacy.accounting.silo import SiloLedger

    ledger = SiloLedger(delta=1e-5, accountant="rdp")
    for _ in range(3):
        ledger.record(0.05, 1.1, 4)
    ledger.record(0.05, 0.9, 4)
    for name in ("rdp", "pld"):
        acc = make_accountant(name)
        acc.compose(dp_sgd_step(0.05, 1.1), 12)
        acc.compose(dp_sgd_step(0.05, 0.9), 4)
        ledger.accountant = name
        assert ledger.epsilon() == pytest.approx(acc.epsilon(1e-5), rel=1e-9)
        assert acc.epsilon_after(dp_sgd_step(0.05, 0.9), 1e-5) > acc.epsilon(1e-5)
    # and it prices a step as opacus' own DP-SGD accountant does (same analysis, other orders)
    ref = OpacusRDP()
    ref.history = [(1.1, 0.05, 12), (0.9, 0.05, 4)]
    ledger.accountant = "rdp"
    assert ledger.epsilon() == pytest.approx(ref.get_epsilon(1e-5), rel=0.03)
