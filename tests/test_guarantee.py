"""The printed guarantee holds for everything a run releases.

Each test failed on the code before the fix: a private run's results.json carried unnoised
statistics, a seeded run printed a valid guarantee, a silo took its δ from the server and paid a
replay with other DP parameters nothing, a release could leave before its charge was durable, the
server's noise depended on how many replies arrived, and the audit's canaries were no neighbours.
"""

import json
import logging

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict

from client_app import app as C
from fedpower_app.privacy.accounting.silo import SILO_DEFAULT_DELTA, SiloLedger, SiloRefusal, silo_gate
from fedpower_app.config import parse_config
from fedpower_app.training.dp_sgd import DPSGDParams
from fedpower_app.privacy import build_privacy, guarantee
from server_app import app as server_app
from strategies.privacy_contract import Disclosure

from .test_app_inprocess import TINY, run_inprocess

# What a private round row may carry: the covered fields, the central evaluation (on the server's
# own evaluation split: accuracy, loss, macro-F1, balanced accuracy, the majority baseline), wall time.
COVERED = (set(Disclosure.COVERED_ROUND_FIELDS) | {"accuracy", "loss", "wall_seconds"}
           | set(server_app.EVALUATION_METRICS))
UNCOVERED = ("update_norm_mean", "clipped_fraction", "train_loss", "aggregated", "replied", "dropped", "missing",
             "bytes_up", "aggregation_seconds")


def _eval_keys(row):
    return {k for k in row if k.endswith("-accuracy") or k.endswith("-loss")}


# -- 1. nothing data-dependent leaves without noise ---------------------------------------------------

def test_a_private_dp_sgd_run_releases_no_uncovered_statistic(tmp_path, caplog):
    def broken(msg, context):  # a silo whose training fails: its node id and reason are private
        if msg.metadata.message_type == "train":
            raise RuntimeError("disk full on the silo")
        return C.app(msg, context)

    with caplog.at_level(logging.INFO, logger="fedpower"):
        res, _ = run_inprocess(tmp_path, num_nodes=3, handlers={102: broken},
                               **{"num-server-rounds": 2, "dp.noise-at": "silo", "dp.noise": "seeded"})
    assert res["status"] == "completed"
    for row in res["rounds"]:
        assert set(row) - _eval_keys(row) <= COVERED | set(Disclosure.SCHEDULE_FIELDS), row
        assert not any(k in row for k in UNCOVERED)
    assert "not covered" not in res["diagnostics"] and res["diagnostics"].startswith("covered only")
    text = caplog.text
    assert "disk full" not in text and "dropped reply" not in text and "train-loss" not in text
    assert "replies withheld" in text


def test_a_client_level_run_hides_its_cohort(tmp_path):
    res, _ = run_inprocess(tmp_path, num_nodes=4, **{"num-server-rounds": 2, "dp.level": "client",
                                                     "strategy.client-rate": 0.5, "dp.noise": "seeded"})
    for row in res["rounds"]:
        assert set(row) - _eval_keys(row) <= COVERED, row  # not even the number sampled
    history = res["privacy_final"]["ledger"]["history"]
    assert history and all(h.get("clients_sampled") is None for h in history)


def test_released_diagnostics_are_shown_and_marked_not_covered(tmp_path):
    res, _ = run_inprocess(tmp_path, **{"num-server-rounds": 1, "dp.noise-at": "silo", "dp.noise": "seeded",
                                        "dp.diagnostics": "released"})
    row = res["rounds"][0]
    assert row["aggregated"] == 2 and row["train_loss"] is not None  # the silos sent their loss
    assert "NOT covered" in res["diagnostics"]


def test_silos_send_no_training_metrics_under_dp_unless_told():
    from fedpower_app.privacy.silo_policy import simulation_engine

    ctx = Context(run_id=1, node_id=5, node_config={}, state=RecordDict(), run_config={})
    private = parse_config({"dp.level": "sample"})
    with simulation_engine():  # a partition the simulation engine made: the run config speaks for its owner
        assert C._sends_train_metrics(ctx, private) is False
        assert C._sends_train_metrics(ctx, parse_config({"dp.level": "none"})) is True
        assert C._sends_train_metrics(ctx, parse_config({"dp.diagnostics": "released"})) is True
        ctx.node_config["send-metrics"] = "false"  # the silo's own word wins
        assert C._sends_train_metrics(ctx, parse_config({"dp.diagnostics": "released"})) is False


# -- 2. a printed guarantee is a valid one ---------------------------------------------------------

def test_the_default_private_run_draws_its_noise_from_secrets_and_says_so():
    cfg = parse_config({})
    assert cfg["dp.noise"] == "hardened"
    claim = guarantee(cfg)
    assert claim == {**claim, "mode": "secret", "valid": True}
    hook = build_privacy(cfg, client_sizes=[1000] * 3, num_modules=4)
    assert hook.describe()["is_valid_guarantee"] and hook.final_report()["is_valid_guarantee"]


@pytest.mark.parametrize("extra", [{"dp.noise-at": "silo"}, {"dp.noise-at": "server"}, {"dp.level": "client"}])
def test_a_seeded_run_never_prints_a_valid_guarantee(extra):
    cfg = parse_config({"dp.noise": "seeded", "seed": 3, **extra})
    hook = build_privacy(cfg, client_sizes=[1000] * 3, num_modules=4)
    described = hook.describe()
    valid = described.get("is_valid_guarantee", described.get("calibration", {}).get("is_valid_guarantee"))
    assert valid is False and hook.final_report()["is_valid_guarantee"] is False
    assert "reproducible mode: not a guarantee against whoever holds the seed" in guarantee(cfg)["statement"]


def test_a_seeded_run_says_reproducible_mode_in_results_and_console(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="fedpower"):
        res, _ = run_inprocess(tmp_path, **{"num-server-rounds": 1, "dp.noise-at": "silo", "dp.noise": "seeded"})
    assert res["guarantee"]["mode"] == "reproducible" and res["guarantee"]["valid"] is False
    assert res["privacy_final"]["is_valid_guarantee"] is False
    final = [r.getMessage() for r in caplog.records if "final accuracy" in r.getMessage()][-1]
    assert "reproducible mode: not a guarantee against whoever holds the seed" in final


# -- 3. a silo's own budget cannot be steered by the server ----------------------------------------

def test_a_silo_with_a_budget_keeps_its_own_delta():
    raised = parse_config({"dp.delta": 0.1})
    required, eps, delta = C.silo_policy(raised, {"dp-max-epsilon": 8.0, "ledger-file": "memory"})
    assert required and eps == 8.0 and delta == SILO_DEFAULT_DELTA == 1e-5
    assert C.silo_policy(raised, {"dp-max-epsilon": 8.0, "dp-delta": 1e-6, "ledger-file": "memory"})[2] == 1e-6
    # The numbers: n_k 50,000, b 500, L 2, sigma 0.444. At delta 0.1 a silo would admit
    # hundreds of rounds; at its own 1e-5 it admits 8.
    params = DPSGDParams(0.444, 0.05, 500, 2)

    def admitted(delta, cap=40):
        ledger = SiloLedger(delta)
        for t in range(cap):
            try:
                q, charge = silo_gate(ledger, [], None, params, 50_000, max_epsilon=8.0)
            except SiloRefusal:
                return t
            ledger.record(q, params.noise_multiplier, params.local_steps)
        return cap

    assert admitted(delta) == 8
    assert admitted(0.1) == 40  # what the server could have bought


def test_a_replay_must_carry_the_parameters_it_was_paid_with():
    params = DPSGDParams(1.0, 0.05, 50, 2)
    ledger, paid = SiloLedger(1e-5), []
    q, charge = silo_gate(ledger, paid, "run:3", params, 1000, max_epsilon=8.0)
    assert charge
    ledger.record(q, params.noise_multiplier, params.local_steps)
    paid.append({"key": "run:3", "params": C.paid_params(params, q)})
    # the same seeded round again, same parameters: the same release, not charged again
    assert silo_gate(ledger, paid, "run:3", params, 1000, max_epsilon=8.0) == (q, False)
    for other in (DPSGDParams(0.5, 0.05, 50, 2), DPSGDParams(1.0, 0.5, 50, 2), DPSGDParams(1.0, 0.05, 500, 2),
                  DPSGDParams(1.0, 0.05, 50, 20)):
        with pytest.raises(SiloRefusal, match="replay must carry the same"):
            silo_gate(ledger, paid, "run:3", other, 1000, max_epsilon=8.0)
    with pytest.raises(SiloRefusal, match="noise multiplier 0"):
        silo_gate(ledger, paid, "run:3", DPSGDParams(0.0, 0.05, 50, 2), 1000, max_epsilon=8.0)
    # an entry of an older ledger file (a bare key) is charged again, never trusted
    assert silo_gate(ledger, ["run:3"], "run:3", params, 1000, max_epsilon=8.0)[1] is True


def _train_message(params: DPSGDParams, server_round: int, arrays):
    config = ConfigRecord({"server-round": server_round, "train-lora": "AB",
                           "dp-sgd.noise-multiplier": params.noise_multiplier, "dp-sgd.clip": params.clip,
                           "dp-sgd.batch-size": params.batch_size, "dp-sgd.local-steps": params.local_steps,
                           "dp-sgd.head-clip": params.head_clip})
    return Message(RecordDict({"arrays": arrays, "config": config}), dst_node_id=7, message_type=MessageType.TRAIN)


def test_the_client_app_refuses_a_replay_with_sigma_zero(tmp_path):
    from fedpower_app import model as M

    run_config = parse_config({**TINY, "dp.noise": "seeded"}).to_dict()
    ledger_file = tmp_path / "ledger.json"
    ctx = Context(run_id=1, node_id=7, node_config={"partition-id": 0, "num-partitions": 2, "dp-noise": "seeded",
                                                     "ledger-file": str(ledger_file), "dp-max-epsilon": 8.0},
                  state=RecordDict(), run_config=run_config)
    cfg = parse_config(run_config)
    arrays = ArrayRecord(M.initial_adapter_state(cfg, 2))
    reply = C.app(_train_message(DPSGDParams(1.0, 0.05, 16, 1), 1, arrays), ctx)
    assert not reply.has_error()
    saved = json.loads(ledger_file.read_text())
    assert saved["ledger"]["entries"][0][3] == 1 and saved["paid"][0]["params"][0] == 1.0
    # (an exception in the ClientApp is the error reply the runtime sends and the server drops)
    with pytest.raises(SiloRefusal, match="noise multiplier 0"):
        C.app(_train_message(DPSGDParams(0.0, 0.05, 16, 1), 1, arrays), ctx)
    with pytest.raises(SiloRefusal, match="replay must carry the same"):
        C.app(_train_message(DPSGDParams(0.2, 0.05, 16, 1), 1, arrays), ctx)
    assert json.loads(ledger_file.read_text())["ledger"]["entries"][0][3] == 1  # nothing was trained or paid


def test_a_silo_without_a_ledger_file_says_so_at_start(caplog):
    cfg = parse_config({"dp.noise-at": "silo"})
    from fedpower_app.privacy.silo_policy import simulation_engine

    ctx = Context(run_id=424242, node_id=3, node_config={}, state=RecordDict(), run_config={})
    with caplog.at_level(logging.WARNING, logger="fedpower"), simulation_engine():
        C._warn_if_ledger_is_per_run(ctx, cfg)
        C._warn_if_ledger_is_per_run(ctx, cfg)
    warnings = [r for r in caplog.records if "ledger lives in this run's state only" in r.getMessage()]
    assert len(warnings) == 1 and "ledger-file" in warnings[0].getMessage()
    caplog.clear()
    ctx2 = Context(run_id=424243, node_id=3, node_config={"ledger-file": "/tmp/x.json"}, state=RecordDict(),
                   run_config={})
    with simulation_engine():
        C._warn_if_ledger_is_per_run(ctx2, cfg)
    assert not caplog.records


# -- 5. the noise does not depend on who answered ----------------------------------------------------

@pytest.mark.parametrize("method", ["fedlora", "ffa-lora", "input-perturbation", "fedpower"])
def test_server_noise_is_the_same_whatever_the_number_of_accepted_replies(method):
    cfg = parse_config({"dp.noise-at": "server", "strategy.name": method, "strategy.client-rate": 0.5})
    hook = build_privacy(cfg, client_sizes=[400] * 6, num_modules=4)
    rt = {"fedlora": "fedlora", "ffa-lora": "ffa", "input-perturbation": "input", "fedpower": "powerdp"}[method]
    stds = [hook.noise_stds(rt, k) for k in range(0, 7)]
    assert all(s == stds[0] for s in stds) and stds[0][0] > 0


def test_a_nan_reply_moves_neither_the_noise_nor_the_denominator():
    from .test_strategies import M_NAMES, fake_client, initial_state, make, run
    from strategies.flower import FedLoRAStrategy

    cfg = parse_config({"dp.noise-at": "server", "strategy.name": "fedlora", "strategy.client-rate": 1.0})
    hook = build_privacy(cfg, client_sizes=[400] * 4, num_modules=len(M_NAMES))

    def nan_client(msg, context):
        reply = fake_client()(msg, context)
        state = reply.content["arrays"].to_torch_state_dict()
        state[next(iter(state))] = state[next(iter(state))] * float("nan")
        return Message(RecordDict({"arrays": ArrayRecord(state)}), reply_to=msg)

    clean = make(FedLoRAStrategy, privacy=hook, initial_state=initial_state())
    run(clean, fake_client(), rounds=1)
    hook2 = build_privacy(cfg, client_sizes=[400] * 4, num_modules=len(M_NAMES))
    dropped = make(FedLoRAStrategy, privacy=hook2, initial_state=initial_state())
    run(dropped, fake_client(), rounds=1, handlers={101: nan_client})
    assert clean.reports[0].aggregated == 4 and dropped.reports[0].aggregated == 3
    assert clean.reports[0].noise_stds == dropped.reports[0].noise_stds
    assert dropped._release_args().denominator == clean._release_args().denominator == 4.0


# -- 6. the neighbouring relation as implemented ----------------------------------------------------

def test_the_client_level_relation_is_stated_as_zero_out_with_a_public_population():
    hook = build_privacy(parse_config({"dp.level": "client"}), client_sizes=[100] * 10, num_modules=4)
    relation = hook.describe()["neighbouring"]
    assert relation.startswith("zero-out") and "public" in relation and "C/m" in relation
    assert hook.plan.denominator == hook.plan.expected_cohort == 10.0


# -- 7. the audit's own claims ----------------------------------------------------------------------

def test_the_audit_ceilings_quoted_are_those_of_its_guesses():
    from fedpower_app.audit.bounds import steinke_ceiling

    assert steinke_ceiling(1000, 1e-5, guesses=200) == pytest.approx(4.17, abs=0.005)
    assert steinke_ceiling(5000, 1e-5, guesses=1000) == pytest.approx(5.67, abs=0.005)
    text = (C.Path(__file__).resolve().parents[1] / "docs" / "privacy.md").read_text()
    assert "4.17" in text and "5.67" in text and "5.78 at" not in text


def test_canary_in_and_out_differ_by_exactly_the_canary():
    from fedpower_app.audit.membership import AuditPlan

    plan = AuditPlan(overrides={}, runs=4, seed=3, num_labels=2, pool=list(range(0, 40)), pool_labels=[0] * 40,
                     population=[], population_labels=[], canaries=list(range(100, 110)), canary_labels=[1] * 10,
                     background=list(range(200, 230)), background_labels=[0] * 30, supernodes=3)
    keep, inc = plan.coins(0)
    for j in range(len(inc)):
        a_inc, b_inc = inc.copy(), inc.copy()
        a_inc[j], b_inc[j] = True, False
        a, b = plan.rows_for(keep, a_inc), plan.rows_for(keep, b_inc)
        assert a["declared_sizes"] == b["declared_sizes"]  # the same sampling rate in and out
        shards_a = [[r for r, p in zip(a["rows"], a["partitions"]) if p == s] for s in range(3)]
        shards_b = [[r for r, p in zip(b["rows"], b["partitions"]) if p == s] for s in range(3)]
        diff = [(sa, sb) for sa, sb in zip(shards_a, shards_b) if sa != sb]
        assert len(diff) == 1 and [r for r in diff[0][0] if r not in diff[0][1]] == [plan.canaries[j]]
        assert [r for r in diff[0][0] if r != plan.canaries[j]] == diff[0][1]  # same order otherwise


def test_a_laid_out_rows_file_gives_each_silo_its_rows_and_declared_rate(tmp_path):
    from fedpower_app import data as D
    from fedpower_app.model import load_tokenizer

    spec = {"rows": [0, 1, 2, 3, 4], "labels": [0, 1, 0, 1, 0], "partitions": [1, 0, 1, 1, 0],
            "declared_sizes": [4, 5]}
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(spec))
    cfg = parse_config({**TINY, "task.train-rows": str(path), "task.synthetic-train-size": 50,
                        "task.cache-dir": str(tmp_path / "cache")})
    tok = load_tokenizer(cfg["model.name"])
    s0, s1 = D.client_shard(cfg, tok, 0, 2), D.client_shard(cfg, tok, 1, 2)
    assert (len(s0), len(s1)) == (2, 3) and (s0.dp_size, s1.dp_size) == (4, 5)
    assert s0.labels.tolist() == [1, 0] and s1.labels.tolist() == [0, 0, 1]
    from fedpower_app.training import batch_indices

    g = torch.Generator().manual_seed(0)
    counts = sum(len(i) for i in batch_indices(2, 1, 4000, g, True, rate_size=4))
    assert counts / (4000 * 2) == pytest.approx(0.25, abs=0.02)  # q = b / declared size
