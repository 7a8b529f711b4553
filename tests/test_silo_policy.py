"""A silo decides its own privacy: its node config sets its policy (fedpower_app.privacy.silo_policy),
and the run config, which the server writes, can ask but not overrule."""

import json
import logging

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.common import MessageType

from client_app import app as C
from fedpower_app import model as M
from fedpower_app.config import parse_config
from fedpower_app.privacy.accounting.silo import SiloRefusal
from fedpower_app.privacy.silo_policy import DEFAULT_LEDGER_NAME, SiloPolicy
from fedpower_app.training.dp_sgd import DPSGDParams
from tests.test_app_inprocess import TINY, run_inprocess
from tests.test_silo_data import HEADER, silo_dir, tsv_rows, tiny_model_dir  # noqa: F401 (fixture)


@pytest.fixture(autouse=True)
def _task_identity():
    """Messages made outside a Flower runtime need a task identity (the in-process grid sets one)."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1


def _train(params: DPSGDParams, server_round: int, arrays) -> Message:
    config = ConfigRecord({"server-round": server_round, "train-lora": "AB",
                           "dp-sgd.noise-multiplier": params.noise_multiplier, "dp-sgd.clip": params.clip,
                           "dp-sgd.batch-size": params.batch_size, "dp-sgd.local-steps": params.local_steps})
    return Message(RecordDict({"arrays": arrays, "config": config}), dst_node_id=7, message_type=MessageType.TRAIN)


def _evaluate(arrays) -> Message:
    return Message(RecordDict({"arrays": arrays, "config": ConfigRecord({"server-round": 1})}), dst_node_id=7,
                   message_type=MessageType.EVALUATE)


def _ctx(run_config: dict, node_config: dict, run_id: int = 1) -> Context:
    return Context(run_id=run_id, node_id=7, node_config=node_config, state=RecordDict(), run_config=run_config)


PARAMS = DPSGDParams(1.0, 0.05, 16, 1)
SIM = {"partition-id": 0, "num-partitions": 2}


def test_the_policy_defaults_are_safe_for_a_silo_of_its_own_and_follow_the_run_for_a_simulated_one(tmp_path):
    seeded_released = parse_config({"dp.noise": "seeded", "dp.diagnostics": "released"})
    own = SiloPolicy.from_node_config({"data-dir": str(tmp_path), "dp-max-epsilon": 4}, seeded_released)
    assert own.sovereign and own.requires_dp and own.max_epsilon == 4 and own.delta == 1e-5
    assert not own.reproducible and not own.sends_metrics and not own.evaluates
    assert own.ledger_file == tmp_path / DEFAULT_LEDGER_NAME
    simulated = SiloPolicy.from_node_config(SIM, seeded_released, simulated=True)
    assert not simulated.sovereign and simulated.reproducible and simulated.sends_metrics and simulated.evaluates
    assert simulated.ledger_file is None
    opted = SiloPolicy.from_node_config({"dp-max-epsilon": 4, "dp-noise": "seeded", "send-metrics": "true",
                                         "evaluate": "true", "evaluate-max": 2, "ledger-file": "memory"},
                                        seeded_released)
    assert opted.reproducible and opted.sends_metrics and opted.evaluates and opted.evaluate_max == 2
    assert opted.ledger_file is None and opted.ledger_in_memory_chosen
    assert "NOT covered" in opted.describe() and "ledger-file = \"memory\"" in opted.describe()
    with pytest.raises(SiloRefusal, match="not a boolean"):
        SiloPolicy.from_node_config({"send-metrics": "maybe"}, seeded_released, simulated=True)
    with pytest.raises(SiloRefusal, match="dp-noise"):
        SiloPolicy.from_node_config({"dp-noise": "weak"}, seeded_released, simulated=True)


def test_a_budgeted_silo_refuses_a_seeded_round_unless_its_node_config_opts_in(tmp_path):
    run_config = parse_config({**TINY, "dp.noise": "seeded"}).to_dict()
    arrays = ArrayRecord(M.initial_adapter_state(parse_config(run_config), 2))
    budgeted = {**SIM, "dp-max-epsilon": 8.0, "ledger-file": str(tmp_path / "ledger.json")}
    with pytest.raises(SiloRefusal, match="reproducible-mode noise"):
        C.app(_train(PARAMS, 1, arrays), _ctx(run_config, budgeted))
    assert not (tmp_path / "ledger.json").exists()  # refused before its data was touched or a charge written
    reply = C.app(_train(PARAMS, 1, arrays), _ctx(run_config, {**budgeted, "dp-noise": "seeded"}))
    assert not reply.has_error()
    hardened = parse_config({**TINY, "dp.noise": "hardened"}).to_dict()
    assert not C.app(_train(PARAMS, 2, arrays), _ctx(hardened, budgeted)).has_error()


def test_released_diagnostics_from_the_server_do_not_make_a_silo_send_metrics(tmp_path):
    run_config = parse_config({**TINY, "dp.noise": "hardened", "dp.diagnostics": "released"}).to_dict()
    arrays = ArrayRecord(M.initial_adapter_state(parse_config(run_config), 2))
    node = {**SIM, "dp-max-epsilon": 8.0, "ledger-file": "memory"}
    reply = C.app(_train(PARAMS, 1, arrays), _ctx(run_config, node))
    assert "metrics" not in reply.content.metric_records  # no loss, no examples seen, no timing
    reply = C.app(_train(PARAMS, 1, arrays), _ctx(run_config, {**node, "send-metrics": "true"}, run_id=2))
    assert "train-loss" in reply.content.metric_records["metrics"]  # only when the silo itself opts in


def test_a_budgeted_silo_refuses_evaluation_on_its_rows_unless_it_agreed_and_then_as_often_as_it_agreed(tmp_path):
    run_config = parse_config({**TINY, "dp.noise": "hardened"}).to_dict()
    arrays = ArrayRecord(M.initial_adapter_state(parse_config(run_config), 2))
    node = {**SIM, "dp-max-epsilon": 8.0, "ledger-file": "memory"}
    with pytest.raises(SiloRefusal, match="does not evaluate on its own rows"):
        C.app(_evaluate(arrays), _ctx(run_config, node))
    ctx = _ctx(run_config, {**node, "evaluate": "true", "evaluate-max": 1})
    reply = C.app(_evaluate(arrays), ctx)
    assert reply.content.metric_records["metrics"]["num-examples"] > 0
    with pytest.raises(SiloRefusal, match="at most 1 evaluate"):
        C.app(_evaluate(arrays), ctx)


def test_a_supernode_with_a_data_directory_keeps_its_ledger_across_runs_by_default(tmp_path, tiny_model_dir):
    silo = silo_dir(tmp_path, "silo", HEADER + tsv_rows(40, 1))
    run_config = parse_config({"task.name": "sst2", "model.name": tiny_model_dir, "task.max-length": 16,
                               "task.cache-dir": str(tmp_path / "cache"), "lora.rank": 4}).to_dict()
    arrays = ArrayRecord(M.initial_adapter_state(parse_config(run_config), 2))
    node = {"data-dir": str(silo), "dp-max-epsilon": 8.0}
    for run_id in (11, 12):  # two runs: a fresh Context.state each
        assert not C.app(_train(PARAMS, 1, arrays), _ctx(run_config, node, run_id=run_id)).has_error()
    saved = json.loads((silo / DEFAULT_LEDGER_NAME).read_text())
    assert saved["ledger"]["entries"][0][3] == 2  # both runs' rounds, in the silo's own data directory


def test_a_seeded_replay_on_other_arrays_is_refused(tmp_path):
    run_config = parse_config({**TINY, "dp.noise": "seeded"}).to_dict()
    state = M.initial_adapter_state(parse_config(run_config), 2)
    node = {**SIM, "dp-max-epsilon": 8.0, "dp-noise": "seeded", "ledger-file": str(tmp_path / "ledger.json")}
    assert not C.app(_train(PARAMS, 1, ArrayRecord(state)), _ctx(run_config, node)).has_error()
    # the same round again on the same arrays: the same release, not paid twice
    assert not C.app(_train(PARAMS, 1, ArrayRecord(state)), _ctx(run_config, node, run_id=2)).has_error()
    assert json.loads((tmp_path / "ledger.json").read_text())["ledger"]["entries"][0][3] == 1
    other = {k: v + 0.01 for k, v in state.items()}
    with pytest.raises(SiloRefusal, match="other arrays or another optimizer state"):
        C.app(_train(PARAMS, 1, ArrayRecord(other)), _ctx(run_config, node, run_id=3))
    assert json.loads((tmp_path / "ledger.json").read_text())["ledger"]["entries"][0][3] == 1


def test_a_client_level_private_run_shows_no_round_time_and_no_shard_size(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="fedpower"):
        res, run_dir = run_inprocess(tmp_path, num_nodes=3, **{"num-server-rounds": 2, "dp.level": "client",
                                                               "strategy.client-rate": 0.7, "dp.noise": "hardened"})
    assert res["status"] == "completed"
    assert all("wall_seconds" not in r for r in res["rounds"])
    assert res["clients"] == {"count": 3, "dataset_sizes": "withheld"}
    totals = res["totals"]
    assert totals["wall_seconds"] == totals["dropped_replies"] == totals["bytes_up"] == "withheld"
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "shard sizes withheld" in text and "| round " not in text and "elapsed" not in text.split("[round 1")[-1]
    assert "times withheld" in text
    for node_size in ("120",):  # each silo's shard: 360 rows over 3 silos
        assert f"shard sizes {node_size}" not in text
    from fedpower_app.runs import checkpoint as CK

    cfg = res["config"]
    payload = CK.load_checkpoint(run_dir, config=cfg, strategy=cfg["strategy.name"])
    assert set(payload["population_sizes"]) == {0}  # the silos never sent them
    assert "wall_seconds" not in json.dumps(payload["results"]["rounds"])
