"""A hostile server learns nothing the guarantee does not allow.

Every attack of ``tests/hostile_server.py`` runs against the product's silo side, where it must
recover nothing, and against a deliberately weakened silo (no signing keys, no round guard, a
per-run ledger, an operator-typed partition id believed), where the same attack succeeds: the
positive control that shows each test could fail. docs/privacy.md's threat model names these tests.
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from flwr.app import Context, RecordDict

from fedpower_app.config import parse_config
from fedpower_app.privacy.accounting.silo import SiloLedger, SiloRefusal
from fedpower_app.privacy.silo_policy import SiloPolicy, simulation_engine
from strategies.secure_sum.identity import IdentityError, SiloIdentity, TrustedSilos
from strategies.secure_sum.protocol import SecureSumRefused
from strategies.secure_sum.session import (
    SecureAggregation, SumGuard, client_step, in_process_transport, minimum_degree, run_secure_sum)
from tests.test_silo_data import tiny_model_dir  # noqa: F401 (fixture)
from tests.hostile_server import cohort_config, padded_survivors_attack, silos, substituted_keys_attack

RNG = np.random.default_rng(7)


def _inputs(nodes, size=8, bits=32):
    return {u: RNG.integers(0, 1 << bits, size=size, dtype=np.int64) for u in nodes}


# -- secure aggregation against a server that deviates ------------------------------------------------

def test_padded_survivor_lists_recover_a_target_from_unsigned_silos_and_nothing_from_signed_ones():
    honest, sybils, target = [1, 2, 3, 4, 5], [91, 92, 93], 3
    config = cohort_config(honest + sybils)
    inputs = _inputs(honest)
    # positive control: silos without signing keys (semi-honest protocol) give the target away
    recovered = padded_survivors_attack(silos(honest, config, signed=False), sybils, target, inputs, signed=False)
    assert np.array_equal(recovered, inputs[target])
    # the product's signed silos refuse keys no trusted silo signed: nothing is masked, nothing recovered
    with pytest.raises(SecureSumRefused, match="not trust"):
        padded_survivors_attack(silos(honest, config, signed=True), sybils, target, inputs, signed=True)


def test_substituted_keys_recover_a_target_from_an_unsigned_silo_and_nothing_from_a_signed_one():
    nodes, target = [1, 2, 3, 4, 5], 4
    config = cohort_config(nodes)
    x = _inputs([target])[target]
    weak = silos(nodes, config, signed=False)[target]
    assert np.array_equal(substituted_keys_attack(weak, [u for u in nodes if u != target], x, signed=False), x)
    strong = silos(nodes, config, signed=True)[target]
    with pytest.raises(SecureSumRefused, match="not trust"):
        substituted_keys_attack(strong, [u for u in nodes if u != target], x, signed=True)


def test_a_signature_for_one_sum_or_one_node_does_not_verify_in_another():
    nodes = [1, 2, 3, 4]
    config = cohort_config(nodes)
    clients = silos(nodes, config, signed=True)
    adverts = {u: c.advertise_keys() for u, c in clients.items()}
    other = cohort_config(nodes, label="2/trained/0")  # the next round's sum: a replayed signature is refused
    replay = silos(nodes, other, signed=True)[1]
    replay.trusted, replay.identity = clients[1].trusted, clients[1].identity
    replay.advertise_keys()
    keys = {v: tuple(adverts[v][k] for k in ("channel_key", "mask_key", "identity", "signature")) for v in (2, 3, 4)}
    with pytest.raises(SecureSumRefused, match="does not verify"):
        replay.share_keys(keys)
    swapped = dict(keys)  # node 2's signed keys relayed as node 3's
    swapped[3] = keys[2]
    with pytest.raises(SecureSumRefused, match="does not verify"):
        clients[1].share_keys(swapped)


def test_signed_silos_unmask_only_a_survivor_set_that_t_of_them_signed():
    nodes = [1, 2, 3, 4, 5]
    config = cohort_config(nodes)  # t = 3
    clients = silos(nodes, config, signed=True)
    adverts = {u: c.advertise_keys() for u, c in clients.items()}
    keys = {u: {v: tuple(adverts[v][k] for k in ("channel_key", "mask_key", "identity", "signature"))
                for v in nodes if v != u} for u in nodes}
    sealed = {u: clients[u].share_keys(keys[u])["sealed_shares"] for u in nodes}
    for u in nodes:
        clients[u].masked_input({v: s[u] for v, s in sealed.items() if u in s}, np.zeros(config.size, dtype=np.int64))
    # the server tells 1 and 2 that {1, 2, 3} survive, and 4 and 5 that {3, 4, 5} do (3 is the target)
    sig_a = {u: clients[u].consistency([1, 2, 3])["signature"] for u in (1, 2)}
    sig_b = {u: clients[u].consistency([3, 4, 5])["signature"] for u in (4, 5)}
    with pytest.raises(SecureSumRefused, match="2 valid signatures"):
        clients[1].unmask([1, 2, 3], signatures=sig_a)
    with pytest.raises(SecureSumRefused, match="valid signatures"):  # borrowed signatures are of another set
        clients[4].unmask([3, 4, 5], signatures={**sig_b, 1: sig_a[1]})
    with pytest.raises(SecureSumRefused, match="differs from the one it signed"):
        clients[2].unmask([1, 2, 3, 4], signatures=sig_a)


def test_survivors_that_never_sent_shares_are_refused_in_either_mode():
    nodes = [1, 2, 3]
    config = cohort_config(nodes)
    for signed in (False, True):
        clients = silos(nodes, config, signed=signed)
        adverts = {u: c.advertise_keys() for u, c in clients.items()}
        keys = {u: {v: tuple(adverts[v][k] for k in ("channel_key", "mask_key", "identity", "signature")
                             if k in adverts[v]) for v in nodes if v != u} for u in nodes}
        sealed = {u: clients[u].share_keys(keys[u])["sealed_shares"] for u in (1, 2)}  # 3 drops before sharing
        clients[1].masked_input({2: sealed[2][1]}, np.zeros(config.size, dtype=np.int64))
        step = clients[1].consistency if signed else clients[1].unmask
        with pytest.raises(SecureSumRefused, match="never sent it shares"):
            step([1, 2, 3])


def _guarded_sum(nodes, label, inputs, guards, *, threshold=None):
    """One secure sum over ``nodes`` named ``label``, each client stepping through ``client_step``
    with its guard (None: the weakened client, no guard)."""
    settings = SecureAggregation(threshold=0.6)
    config = settings.config_for(list(nodes), 4, b"seed", label=label)
    if threshold is not None:
        config = replace(config, threshold=threshold)
    saved = {u: None for u in nodes}

    def handler(u):
        def step(request):
            reply, saved[u] = client_step(u, request, saved[u], lambda req: inputs[u], guard=guards[u])
            return reply
        return step

    transport = in_process_transport({u: handler(u) for u in nodes})
    return run_secure_sum(transport, config, settings.quantizer(len(nodes))).total


def test_two_sums_over_different_cohorts_are_subtracted_without_the_guard_and_refused_with_it():
    nodes = [1, 2, 3, 4, 5]
    inputs = {u: RNG.normal(size=4).clip(-1, 1) for u in nodes}
    weak = {u: None for u in nodes}
    first = _guarded_sum(nodes, "1/power-right/0", inputs, weak)
    second = _guarded_sum(nodes[:4], "1/power-right/1", inputs, weak)  # the server "lost" silo 5
    bound = 2 * SecureAggregation().error_bound(5)
    assert np.allclose(first - second, inputs[5], atol=bound)  # silo 5's input, alone
    guards = {u: SumGuard(1) for u in nodes}
    _guarded_sum(nodes, "1/power-right/0", inputs, guards)
    with pytest.raises(SecureSumRefused, match="0 clients advertised keys"):
        _guarded_sum(nodes[:4], "1/power-right/1", inputs, guards)
    with pytest.raises(SecureSumRefused, match="advertised keys"):  # the same name again: refused
        _guarded_sum(nodes, "1/power-right/0", inputs, guards)
    with pytest.raises(SecureSumRefused, match="advertised keys"):  # a replayed request of an earlier round
        _guarded_sum(nodes, "0/power-right/0", inputs, guards)
    assert all(g.survivors == nodes for g in guards.values())


def test_a_later_sum_at_another_threshold_is_refused_and_the_server_keeps_t_for_the_round():
    nodes = [1, 2, 3, 4, 5, 6]
    inputs = {u: RNG.normal(size=4).clip(-1, 1) for u in nodes}
    guards = {u: SumGuard(1) for u in nodes}
    _guarded_sum(nodes, "1/power-right/0", inputs, guards)  # t = 4
    with pytest.raises(SecureSumRefused, match="advertised keys"):
        _guarded_sum(nodes, "1/power-left/1", inputs, guards, threshold=5)
    guard = SumGuard(1)
    guard.join(cohort_config(nodes, label="1/power-right/0"))
    guard.unmask(nodes)
    with pytest.raises(SecureSumRefused, match="at t = 4"):
        guard.join(replace(cohort_config(nodes, label="1/power-left/1"), threshold=5))
    with pytest.raises(SecureSumRefused, match="fewer survivors is refused"):
        guard.unmask(nodes[:5])


def test_a_sparse_graph_below_the_minimum_degree_is_refused():
    # degree 2: an honest server, one colluding silo and one real dropout expose a survivor
    k, p = minimum_degree(100, 0.6, 0.1, 1)
    assert k > 2 and p <= 2 ** -20
    _, p2 = minimum_degree(100, 0.6, 0.1, 1, degree=2)
    assert p2 > 0.01
    with pytest.raises(ValueError, match="below the minimum degree"):
        SecureAggregation(degree=2, colluders=1).config_for(list(range(1, 101)), 10, b"s")
    sparse = SecureAggregation(degree=k, colluders=1).config_for(list(range(1, 101)), 10, b"s", label="1/trained/0")
    with pytest.raises(SecureSumRefused, match="sparse graph"):  # a signed silo joins the complete graph only
        silos([1], sparse, signed=True)
    statement = SecureAggregation(degree=k, colluders=1).describe(100)["statement"]
    assert "probabilistic" in statement and "semi-honest server only" in statement
    complete = SecureAggregation().describe(6)["statement"]
    assert "sign their keys" in complete and "semi-honest server only" in complete


def test_identity_files_are_checked(tmp_path):
    key = SiloIdentity.generate()
    from cryptography.hazmat.primitives import serialization

    pem = key.private_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                        serialization.NoEncryption())
    (tmp_path / "silo").write_bytes(pem)
    assert SiloIdentity.from_file(tmp_path / "silo").public == key.public
    (tmp_path / "peers.pub").write_text(f"# silos of the consortium\n{key.public_line('silo0')}\n")
    assert key.public in TrustedSilos.from_file(tmp_path / "peers.pub")
    (tmp_path / "bad.pub").write_text("ssh-rsa garbage\n")
    with pytest.raises(IdentityError, match="line 1"):
        TrustedSilos.from_file(tmp_path / "bad.pub")
    with pytest.raises(IdentityError, match="cannot be read"):
        SiloIdentity.from_file(tmp_path / "missing")


# -- one ledger per silo, on its own disk ----------------------------------------------------------

SHARE = {"clip": 1.0, "scale": 100.0, "local-std": 120.0, "contributors": 6}


def signing_files(root, count: int = 1):
    """``count`` silos' signing keys and a peers file trusting all of them: [(key path)], peers path."""
    from cryptography.hazmat.primitives import serialization

    keys = [SiloIdentity.generate() for _ in range(count)]
    paths = []
    for i, key in enumerate(keys):
        path = root / f"silo{i}.key"
        path.write_bytes(key.private_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                                       serialization.NoEncryption()))
        paths.append(path)
    peers = root / "peers.pub"
    peers.write_text("".join(k.public_line(f"silo{i}") + "\n" for i, k in enumerate(keys)))
    return paths, peers


def _share_request(threshold=4, nodes=(1, 2, 3, 4, 5, 6), size=2000):
    cfg = cohort_config(nodes, size=size)
    return {"config": {**replace(cfg, threshold=threshold).to_dict(), "noise": dict(SHARE)}}


def _silo_ctx(node_config, run_id=1):
    return Context(run_id=run_id, node_id=1, node_config=node_config, state=RecordDict(),
                   run_config=parse_config({"dp.level": "client", "secagg.enabled": True,
                                            "strategy.client-rate": 1.0}).to_dict())


def test_the_noise_share_ledger_survives_a_new_run_and_composes_with_dp_sgd(tmp_path):
    from client_app import app as C

    ledger_file = tmp_path / "ledger.json"
    (key,), peers = signing_files(tmp_path)
    node = {"dp-max-epsilon": 3.0, "ledger-file": str(ledger_file), "silo-signing-key": str(key),
            "secagg-peers": str(peers)}
    with simulation_engine():
        C._charge_noise_share(_silo_ctx(node), _share_request())
        first = SiloLedger.from_state_dict(json.loads(ledger_file.read_text())["ledger"]).epsilon()
        assert 0 < first < 3.0
        # a new run (a fresh Context.state) starts from the silo's file, not from zero
        spent = 0
        for run_id in range(2, 40):
            try:
                C._charge_noise_share(_silo_ctx(node, run_id), _share_request())
                spent += 1
            except SiloRefusal as exc:
                assert "budget 3" in str(exc)
                break
        else:
            pytest.fail("the silo never refused")
        # positive control: a ledger kept per run (the weakened silo) starts every run from zero
        memory = {**node, "ledger-file": "memory"}
        for run_id in range(2, 2 + spent + 3):
            C._charge_noise_share(_silo_ctx(memory, run_id), _share_request())
    # DP-SGD rounds and noise shares are one ledger: a silo that spent its budget on DP-SGD refuses shares
    ledger = SiloLedger(1e-5, "rdp")
    ledger.record(0.5, 0.6, 40)
    assert ledger.epsilon() > 3.0
    ledger_file.write_text(json.dumps({"ledger": ledger.state_dict(), "paid": []}))
    with simulation_engine(), pytest.raises(SiloRefusal, match="budget 3"):
        C._charge_noise_share(_silo_ctx(node), _share_request())


def test_an_unsigned_sovereign_silo_charges_its_own_share_only_and_a_signed_one_what_t_proves(tmp_path):
    cfg = parse_config({})
    base = {"dp-max-epsilon": 8, "ledger-file": "memory"}
    unsigned = SiloPolicy.from_node_config(base, cfg, simulated=False)
    assert unsigned.noise_share_contributors(threshold=5, requested=5) == 1
    key = SiloIdentity.generate()
    from cryptography.hazmat.primitives import serialization

    (tmp_path / "k").write_bytes(key.private_key.private_bytes(serialization.Encoding.PEM,
                                                               serialization.PrivateFormat.OpenSSH,
                                                               serialization.NoEncryption()))
    (tmp_path / "peers").write_text(key.public_line() + "\n")
    signed = SiloPolicy.from_node_config({**base, "silo-signing-key": str(tmp_path / "k"),
                                          "secagg-peers": str(tmp_path / "peers"), "secagg-colluders": 1}, cfg,
                                         simulated=False)
    assert signed.noise_share_contributors(threshold=5, requested=5) == 4  # t - its own colluders
    assert signed.noise_share_contributors(threshold=5, requested=2) == 2  # never above the request
    capped = SiloPolicy.from_node_config({**base, "secagg-contributors": 2, "silo-signing-key": str(tmp_path / "k"),
                                          "secagg-peers": str(tmp_path / "peers")}, cfg, simulated=False)
    assert capped.noise_share_contributors(threshold=5, requested=5) == 2


def test_a_budgeted_silo_with_nowhere_to_keep_its_ledger_refuses_unless_its_operator_chose_memory():
    cfg = parse_config({})
    with pytest.raises(SiloRefusal, match="nowhere to keep its ledger"):
        SiloPolicy.from_node_config({"dp-max-epsilon": 8}, cfg, simulated=False)
    assert SiloPolicy.from_node_config({"dp-max-epsilon": 8, "ledger-file": "memory"}, cfg,
                                       simulated=False).ledger_in_memory_chosen


def test_the_accountant_and_the_evaluate_limit_are_the_silos_and_hold_across_runs(tmp_path):
    from client_app import app as C

    cfg = parse_config({"dp.accountant": "pld"})
    assert SiloPolicy.from_node_config({"dp-max-epsilon": 8, "ledger-file": "memory"}, cfg,
                                       simulated=False).accountant == "rdp"  # the run config cannot choose it
    node = {"dp-max-epsilon": 8, "ledger-file": str(tmp_path / "ledger.json"), "evaluate": "true", "evaluate-max": 1}
    ctx = _silo_ctx(node)
    C._save_ledger(ctx, SiloLedger(1e-5), [], parse_config(ctx.run_config), evaluate_answers=1)
    policy = SiloPolicy.from_node_config(node, cfg, simulated=False)
    saved = C._read_ledger_payload(_silo_ctx(node, run_id=9), parse_config(ctx.run_config))  # a new run
    with pytest.raises(SiloRefusal, match="at most 1 evaluate"):
        policy.check_evaluate(int(saved["evaluate-answers"]))


# -- safe defaults ---------------------------------------------------------------------------------

def test_a_partition_id_node_config_cannot_buy_simulated_mode_in_a_deployment():
    seeded = parse_config({"dp.noise": "seeded", "dp.diagnostics": "released", "dp.level": "none"})
    typed = {"partition-id": 0, "num-partitions": 6}
    # outside a simulation engine, an operator-typed partition id is a sovereign silo: no choice, no start
    with pytest.raises(SiloRefusal, match="no privacy choice"):
        SiloPolicy.from_node_config(typed, seeded, simulated=False)
    deployed = SiloPolicy.from_node_config({**typed, "dp-max-epsilon": 8, "ledger-file": "memory"}, seeded,
                                           simulated=False)
    assert deployed.sovereign and not deployed.reproducible and not deployed.sends_metrics
    assert not deployed.evaluates and not deployed.sends_shard_size
    # positive control: the same node config made by the simulation engine follows the run config
    with simulation_engine():
        simulated = SiloPolicy.from_node_config(typed, seeded)
    assert not simulated.sovereign and simulated.reproducible and simulated.sends_metrics and simulated.evaluates


def test_a_silo_that_trains_without_dp_says_so_in_writing():
    cfg = parse_config({"dp.level": "none"})
    with pytest.raises(SiloRefusal, match="reason in words"):
        SiloPolicy.from_node_config({"data-dir": "/data", "dp-opt-out": " "}, cfg, simulated=False)
    with pytest.raises(SiloRefusal, match="no privacy choice"):
        SiloPolicy.from_node_config({"data-dir": "/data"}, cfg, simulated=False)
    opted = SiloPolicy.from_node_config({"data-dir": "/data", "dp-opt-out": "public benchmark rows"}, cfg,
                                        simulated=False)
    assert not opted.requires_dp and "WITHOUT differential privacy" in opted.describe()
    assert "public benchmark rows" in opted.describe() and not opted.evaluates and not opted.sends_shard_size


def test_a_sovereign_silo_withholds_its_shard_size_unless_its_node_config_sends_it(tmp_path, tiny_model_dir):
    from tests.test_silo_data import HEADER, _query, silo_dir, tsv_rows

    run_config = parse_config({"task.name": "sst2", "model.name": tiny_model_dir, "task.max-length": 16,
                               "task.cache-dir": str(tmp_path / "cache")}).to_dict()
    node = {"data-dir": str(silo_dir(tmp_path, "silo", HEADER + tsv_rows(23, 4))), "dp-max-epsilon": 8}
    metrics = _query(run_config, node).content.metric_records["metrics"]
    assert "num-examples" not in metrics  # it computes its own q and keeps its own ledger
    metrics = _query(run_config, {**node, "send-shard-size": "true"}).content.metric_records["metrics"]
    assert metrics["num-examples"] == 23


# -- the signed protocol through the silo's ClientApp side ---------------------------------------

def _signed_grid(tmp_path, app, nodes=6):
    from fedpower_app.runs.inprocess_grid import InProcessGrid

    keys, peers = signing_files(tmp_path, nodes)
    configs = [{"dp-opt-out": "synthetic test rows", "silo-signing-key": str(k), "secagg-peers": str(peers)}
               for k in keys]
    return InProcessGrid(app, nodes, run_config={"dp.level": "none"}, node_configs=configs)


@pytest.mark.parametrize("name", ["fedlora", "fedpower"])
def test_signed_silos_release_the_same_model_as_in_the_clear_with_a_consistency_round(tmp_path, name):
    from flwr.app import ArrayRecord
    from tests.test_secure_rounds import client, make, run

    kw = {"power_iters": 1} if name == "fedpower" else {}
    plain, secure = make(name, False, **kw), make(name, True, **kw)
    run(plain, client())
    secure.start(grid=_signed_grid(tmp_path, client()), initial_arrays=ArrayRecord(secure.global_state), num_rounds=1)
    rep = secure.reports[0]
    assert rep.released and rep.aggregated == 6
    sums = 1 if name == "fedlora" else 1 + 2 * 1
    # the train exchange carries the first sum's keys; each sum has one stage more than unsigned: every
    # survivor signs the survivor set
    assert rep.message_rounds == 1 + 4 + 5 * (sums - 1)
    import torch

    for k in plain.global_state:
        assert torch.allclose(secure.global_state[k], plain.global_state[k], atol=1e-4), k


def test_a_silo_lost_in_a_later_sum_refuses_the_round_instead_of_shrinking_t(tmp_path):
    import torch
    from flwr.app import ArrayRecord
    from fedpower_app.runs.inprocess_grid import InProcessGrid
    from tests.test_secure_rounds import client, make

    s = make("fedpower", True, power_iters=2)
    before = {k: v.clone() for k, v in s.global_state.items()}
    calls = {"n": 0}
    inner = client()

    def app(msg, context):  # silo 105 answers the first sum, then vanishes at the second
        from strategies.secure_rounds import MESSAGE_TYPE, unpack

        if context.node_id == 105 and msg.metadata.message_type == MESSAGE_TYPE:
            request = unpack(msg.content)
            if not str(request["config"]["label"]).endswith("/0"):
                raise RuntimeError("silo 105 vanished")
        calls["n"] += 1
        return inner(msg, context)

    grid = InProcessGrid(app, 6, run_config={"dp.level": "none"})
    s.start(grid=grid, initial_arrays=ArrayRecord(s.global_state), num_rounds=1)
    rep = s.reports[0]
    assert not rep.released and "lost silos" in rep.secure_refused
    assert all(torch.equal(s.global_state[k], before[k]) for k in before)


def test_a_signed_silo_refuses_a_threshold_that_colluders_could_split():
    # 6 silos at t = 4: two survivor sets cannot both gather 4 signatures unless 2 colluders sign both
    config = cohort_config([1, 2, 3, 4, 5, 6])
    key = SiloIdentity.generate()
    request = {"stage": "advertise_keys", "config": config.to_dict()}
    signed = dict(identity=key, trusted=TrustedSilos([key.public]))
    client_step(1, request, None, lambda r: None, colluders=1, **signed)  # 8 > 7: joins
    with pytest.raises(SecureSumRefused, match=r"t > \(n \+ colluders\) / 2"):
        client_step(1, request, None, lambda r: None, colluders=2, **signed)

