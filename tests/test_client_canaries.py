"""Issue #34: canary clients audit client-level DP through the product's round engine and privacy
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


def test_fedpower_audit_runs_the_client_canaries(capsys):
    from fedpower_app.audit.membership import main

    assert main(["client-canaries", "--canaries", "2000", "--clients", "100", "--dim", "256",
                 "--control", "no-noise"]) == 0  # a broken release caught: the control did its job
    assert "refutes the claim" in capsys.readouterr().out
