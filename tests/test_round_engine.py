"""One round engine: the Flower strategies and the benchmarks' bare loop run the same
Flower-free round (strategies.engine) and the same silo training (training.silo_round), so the
bare loop of benchmarks/e2e.py reproduces a Flower run bit for bit."""

import pytest
import torch

from fedpower_app.runs import checkpoint as CK
from fedpower_app.config import parse_config
from strategies import engine as E
from strategies import flower as F
from tests.test_app_inprocess import TINY, run_inprocess


def _state():
    return {"m.lora_A.weight": torch.randn(2, 4), "m.lora_B.weight": torch.zeros(3, 2)}


def test_the_flower_strategies_are_the_engines():
    for name, cls in F.STRATEGY_CLASSES.items():
        family = E.METHOD_FAMILY[name]
        assert issubclass(cls, E.ENGINES[family]) and issubclass(cls, F.Strategy)
        assert F.trained_lora_factors(name) == ("B" if family in ("ffa-lora", "fedsvd") else "AB")
        strategy = F.build_strategy(name, initial_state=_state(), rank=2, client_rate=1.0)
        assert strategy.replies_a == (F.trained_lora_factors(name) == "AB")
    with pytest.raises(ValueError, match="unknown strategy"):
        E.build_engine("nope")


@pytest.mark.parametrize("overrides", [
    {"strategy.name": "fedpower"},  # the defaults: DP-SGD on the silos
    {"strategy.name": "ffa-lora"},  # B only: the bare loop must not train A
    {"strategy.name": "fedpower", "dp.noise-at": "server", "strategy.refactor-every": 2, "strategy.client-rate": 0.5,
     "dp.diagnostics": "released"},  # rows then show what was sampled
])
def test_the_bare_loop_reproduces_a_flower_run(tmp_path, overrides):
    from benchmarks import e2e

    ov = {**TINY, "num-server-rounds": 2, **overrides}
    _res, run_dir = run_inprocess(tmp_path, num_nodes=e2e.NUM_SUPERNODES, **ov)
    flower_state = CK.load_checkpoint(run_dir, config=parse_config({**ov, "output-dir": str(tmp_path),
                                                                    "run-name": "run"}).to_dict(),
                                      strategy=ov["strategy.name"])["global_state"]
    bare = e2e.BareRun(ov, "cpu")
    for rnd in (1, 2):
        bare.step(rnd)
    assert bare.sampled_n == [r["sampled"] for r in _res["rounds"]]
    assert [r.round_type for r in bare.engine.reports] == [r["round_type"] for r in _res["rounds"]]
    assert set(bare.engine.global_state) == set(flower_state)
    for key, value in flower_state.items():
        assert torch.equal(bare.engine.global_state[key], value), key


def test_a_new_method_is_one_entry_in_the_method_table(monkeypatch):
    """A method whose release exists needs no engine, strategy or config edit."""
    from fedpower_app import choices
    from strategies import mechanisms as MECH

    entry = MECH.Method("ffa-twin", "ffa", trains="B", silo_noise_only=True)
    monkeypatch.setitem(MECH.METHODS, "ffa-twin", entry)
    monkeypatch.setitem(MECH.METHOD_RELEASE, "ffa-twin", "ffa")
    monkeypatch.setitem(E.METHOD_FAMILY, "ffa-twin", "ffa-twin")
    strategy = F.build_strategy("ffa-twin", initial_state=_state(), rank=2, client_rate=1.0)
    assert strategy.method == "ffa-twin" and not strategy.replies_a and strategy.round_type(1) == "ffa"
    assert E.build_engine("ffa-twin", initial_state=_state(), rank=2, client_rate=1.0).method == "ffa-twin"
    assert set(choices.STRATEGIES) == set(MECH.METHODS) - {"ffa-twin"}  # the config's list is the table's
