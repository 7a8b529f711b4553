"""Faults during a run, through the real ServerApp and ClientApp (in-process grid): a silo whose
reply never comes (crashed or slow) is waited for only until the round timeout, counted, and still
charged under DP-SGD; a silo whose SuperNode restarts under a new node id rejoins with its ledger;
a node that is no known silo is not admitted."""

from __future__ import annotations

import time

import pytest
from flwr.app import Context, RecordDict

from client_app.app import app as client_app
from tests.test_app_inprocess import run_inprocess


def silent_in(rounds):
    """A ClientApp whose train reply is lost in the given rounds (a crash, or too slow)."""
    def handler(msg, context):
        cfg = msg.content.config_records.get("config") or {}
        if msg.metadata.message_type == "train" and int(cfg.get("server-round", 0)) in rounds:
            return None
        return client_app(msg, context)
    return handler


def test_a_silent_silo_misses_the_round_without_stalling_it(tmp_path):
    t0 = time.time()
    res, _ = run_inprocess(tmp_path, num_nodes=3, handlers={102: silent_in({2})},
                           **{"num-server-rounds": 3, "strategy.round-timeout": 4.0, "dp.noise-at": "silo",
                              "dp.diagnostics": "released"})
    rows = res["rounds"]
    assert [r["aggregated"] for r in rows] == [3, 2, 3]
    assert rows[1]["missing"] == [102] and rows[0]["missing"] == rows[2]["missing"] == []
    assert res["totals"]["missing_replies"] == 1 and res["status"] == "completed"
    # the round was sent, so silo 2 used its data: its ledger counts all 3 rounds, like the others
    assert [s["rounds_trained"] for s in res["privacy_final"]["silos"]] == [3, 3, 3]
    assert time.time() - t0 < 600  # waited for the timeout (4 s), not forever


def test_a_restarted_silo_rejoins_with_its_ledger_and_a_stranger_is_not_admitted(tmp_path):
    """Node 101 (partition 1) crashes during round 2 and comes back as node 555 (a restarted
    SuperNode gets a new id); node 777 claims a partition no silo has."""
    from fedpower_app.runs.inprocess_grid import InProcessGrid

    grids = []
    original_init = InProcessGrid.__init__

    def crash_and_restart(msg, context):
        cfg = msg.content.config_records.get("config") or {}
        if msg.metadata.message_type == "train" and int(cfg.get("server-round", 0)) == 2:
            grid = grids[0]
            grid.node_ids = [n for n in grid.node_ids if n != 101] + [555, 777]
            old = grid._contexts[101]
            grid._contexts[555] = Context(run_id=1, node_id=555, node_config=dict(old.node_config),
                                          state=RecordDict(), run_config=dict(old.run_config))
            grid._contexts[777] = Context(run_id=1, node_id=777, node_config={"partition-id": 7, "num-partitions": 8},
                                          state=RecordDict(), run_config=dict(old.run_config))
            return None
        return client_app(msg, context)

    def init(self, *a, **k):
        original_init(self, *a, **k)
        grids.append(self)

    InProcessGrid.__init__ = init
    try:
        res, _ = run_inprocess(tmp_path, num_nodes=2, handlers={101: crash_and_restart},
                               **{"num-server-rounds": 4, "strategy.round-timeout": 4.0, "dp.noise-at": "silo",
                              "dp.diagnostics": "released"})
    finally:
        InProcessGrid.__init__ = original_init
    rows = res["rounds"]
    assert [r["aggregated"] for r in rows] == [2, 1, 2, 2]
    assert rows[1]["missing"] == [101]
    events = res["roster_events"]
    assert {"round": 3, "node": 555, "silo": 1, "admitted": True, "replaces": 101} in events
    assert any(e["node"] == 777 and not e["admitted"] and "partition" in e["reason"] for e in events)
    silos = res["privacy_final"]["silos"]
    assert [s["node"] for s in silos] == [100, 555]
    assert [s["rounds_trained"] for s in silos] == [4, 4]  # the ledger followed the silo
