"""Canary clients audit client-level DP through the product's round engine and privacy
layer; the correct release passes with eps_hat above 0, every positive control is refuted."""

import pytest

from fedpower_app.audit.client_canaries import run_client_canary_audit

EPS = 2.0
SIZE = dict(canaries=2000, clients=100, rounds=10, dim=256)


def test_the_correct_client_level_release_passes_with_power():
    report = run_client_canary_audit(method="fedlora", epsilon=EPS, **SIZE)
    assert report.passed and 0.15 * EPS < report.epsilon_lower_bound <= EPS
    assert report.ceiling > 2 * EPS


@pytest.mark.parametrize("control", ["no-noise", "tenth-noise", "no-clip"])
def test_every_positive_control_is_refuted_at_client_level(control):
    report = run_client_canary_audit(method="fedlora", epsilon=EPS, control=control, **SIZE)
    assert not report.passed and report.epsilon_lower_bound > EPS, report.line()


@pytest.mark.slow
@pytest.mark.parametrize("control", ["none", "no-noise", "tenth-noise", "no-clip"])
def test_ffa_lora_client_level_audit(control):
    report = run_client_canary_audit(method="ffa-lora", epsilon=EPS, control=control, **SIZE)
    assert report.passed == (control == "none"), report.line()


@pytest.mark.slow
@pytest.mark.parametrize("control", ["none", "no-noise"])
def test_fedpower_powerdp_l_client_level_audit(control):
    """FedPower's canary clients move B only (dW = s X_j A_g) and are scored on the released
    factors; the correct PowerDP-L release passes, the release without noise is refuted."""
    report = run_client_canary_audit(method="fedpower", epsilon=EPS, control=control, **SIZE)
    assert report.passed == (control == "none"), report.line()
    if control == "none":
        assert report.mu_lower_bound <= report.claimed_mu


def test_fedpower_canaries_move_the_merged_weights_along_their_direction():
    """A FedPower canary's reply changes B only, and its merged change B_i A_i - B_g A_g has the
    length asked for, along X_j A_g."""
    import numpy as np
    import torch

    from fedpower_app.audit.client_canaries import ProductCanaries, _initial_state

    state = _initial_state(2, 4, 32, torch.Generator().manual_seed(0))
    state["layer0.lora_B.weight"] = torch.randn(32, 4)  # a trained global
    kind = ProductCanaries(state, 5, np.random.default_rng(0))
    reply = kind.canary_reply(3, state, 10.0)
    sq = 0.0
    for i in range(2):
        A, B = f"layer{i}.lora_A.weight", f"layer{i}.lora_B.weight"
        assert torch.equal(reply[A], state[A])
        dW = reply[B].double() @ state[A].double() - state[B].double() @ state[A].double()
        sq += float((dW ** 2).sum())
        direction = kind.X[f"layer{i}"][3] @ state[A].double()
        cos = float((dW * direction).sum() / (dW.norm() * direction.norm()))
        assert cos == pytest.approx(1.0, abs=1e-6)
    sq += float(((reply["classifier.weight"] - state["classifier.weight"]).double() ** 2).sum())
    assert sq ** 0.5 == pytest.approx(10.0, rel=1e-5)


def test_fedpower_audit_runs_the_client_canaries(capsys):
    from fedpower_app.audit.membership import main

    assert main(["client-canaries", "--canaries", "2000", "--clients", "100", "--dim", "256",
                 "--control", "no-noise"]) == 0  # a broken release caught: the control did its job
    assert "refutes the claim" in capsys.readouterr().out


# -- distributed DP: each client adds its share inside the secure sum -----------------------------------
DISTRIBUTED = dict(canaries=1000, clients=50, rounds=5, dim=64, client_rate=1.0, distributed=True)


@pytest.mark.parametrize("control", ["none", "no-noise", "tenth-noise", "no-clip"])
def test_distributed_dp_release_passes_and_its_positive_controls_are_refuted(control):
    """The clients' own clip and discrete Gaussian shares, summed as the secure sum releases them:
    the calibrated release passes, each broken one (no shares, a tenth of them, no clip) is refuted."""
    report = run_client_canary_audit(method="fedlora", epsilon=EPS, control=control, **DISTRIBUTED)
    assert report.passed == (control == "none"), report.line()
    if control == "none":
        assert report.epsilon_lower_bound <= EPS
    else:
        assert report.epsilon_lower_bound > EPS


@pytest.mark.slow
@pytest.mark.parametrize("method,control", [("ffa-lora", "none"), ("ffa-lora", "no-noise"), ("ffa-lora", "no-clip"),
                                            ("fedpower", "none"), ("fedpower", "no-noise")])
def test_distributed_dp_audit_of_ffa_lora_and_fedpower(method, control):
    report = run_client_canary_audit(method=method, epsilon=EPS, control=control, **DISTRIBUTED)
    assert report.passed == (control == "none"), report.line()
