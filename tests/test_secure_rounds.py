"""Secure aggregation on the Message API: every strategy's round through train.secagg messages on the
in-process grid, against the same round in the clear; dropouts, refusal, and what the server receives."""

from collections import OrderedDict

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

from client_app.app import begin_secure_round, secure_sum_stage
from fedpower_app.runs.inprocess_grid import InProcessGrid
from strategies.flower import build_strategy
from strategies.noise import NoiseSource
from strategies.secure_rounds import MESSAGE_TYPE
from strategies.secure_sum.session import SecureAggregation

M_NAMES = [f"layer.{i}.query" for i in range(2)] + [f"layer.{i}.value" for i in range(2)]
m, n, r = 12, 10, 2
SETTINGS = SecureAggregation(threshold=0.6, bits=40, clip_range=4.0)


def initial_state(seed=0):
    g = torch.Generator().manual_seed(seed)
    st = OrderedDict()
    for name in M_NAMES:
        st[name + ".lora_A.weight"] = torch.randn(r, n, generator=g) * 0.3
        st[name + ".lora_B.weight"] = torch.randn(m, r, generator=g) * 0.1
    st["classifier.weight"] = torch.randn(2, n, generator=g) * 0.1
    return st


def trained_state(msg, context, send_a):
    state = msg.content["arrays"].to_torch_state_dict()
    g = torch.Generator().manual_seed(context.node_id * 1000 + int(msg.content["config"]["server-round"]))
    return OrderedDict((k, v + 0.3 * torch.randn(v.shape, generator=g)) for k, v in state.items()
                       if send_a or not k.endswith("lora_A.weight"))


def client(fail=None):
    """A ClientApp stand-in: a deterministic 'training', then the product's secure-sum side.
    ``fail[node] = stage`` makes that node fail at that stage ("train" or a secure-sum stage)."""
    fail = dict(fail or {})

    def app(msg: Message, context):
        node = context.node_id
        if msg.metadata.message_type == MESSAGE_TYPE:
            from strategies.secure_rounds import unpack

            stage = unpack(msg.content)["stage"]
            if fail.get(node) == stage:
                raise RuntimeError(f"node {node} vanished at {stage}")
            return secure_sum_stage(msg, context)
        if fail.get(node) == "train":
            raise RuntimeError("training crashed")
        config = msg.content["config"]
        state = trained_state(msg, context, config["train-lora"] == "AB")
        metrics = MetricRecord({"num-examples": 10, "train-loss": 0.5})
        if "secagg.request" in config:
            content = begin_secure_round(context, int(config["server-round"]), state,
                                         msg.content["arrays"].to_torch_state_dict(), dp_sgd=False,
                                         json_request=str(config["secagg.request"]))
            content["metrics"] = metrics
            return Message(content, reply_to=msg)
        return Message(RecordDict({"arrays": ArrayRecord(state), "metrics": metrics}), reply_to=msg)

    return app


def make(name, secure, **kw):
    base = dict(initial_state=initial_state(), rank=r, client_rate=1.0, noise=NoiseSource(0),
                secure_aggregation=SETTINGS if secure else None)
    base.update(kw)
    return build_strategy(name, **base)


def run(strategy, app, nodes=6, rounds=1, node_config=None):
    # a non-private run config: the stand-in trains without DP-SGD, which a silo would otherwise refuse
    grid = InProcessGrid(app, nodes, run_config={"dp.level": "none"}, node_config=node_config)
    strategy.start(grid=grid, initial_arrays=ArrayRecord(strategy.global_state), num_rounds=rounds)
    return grid


@pytest.mark.parametrize("name", ["fedlora", "ffa-lora", "fedsvd"])
def test_sum_strategies_release_the_same_model_as_in_the_clear(name):
    plain, secure = make(name, False), make(name, True)
    run(plain, client())
    run(secure, client())
    bound = SETTINGS.error_bound(6) / 6
    for k in plain.global_state:
        assert torch.allclose(secure.global_state[k], plain.global_state[k], atol=max(1e-5, 10 * bound)), k
    rep = secure.reports[0]
    assert rep.released and rep.aggregated == 6 and rep.message_rounds == 4 and rep.secure_clamped == 0
    assert rep.bytes_up > 0 and rep.bytes_down > 0


@pytest.mark.parametrize("refactor_every", [1, 2])
def test_fedpower_releases_the_same_model_as_in_the_clear(refactor_every):
    # the same public start as the release in the clear: only the sums' quantization differs
    plain = make("fedpower", False, power_iters=1, refactor_every=refactor_every)
    secure = make("fedpower", True, power_iters=1, refactor_every=refactor_every)
    run(plain, client(), rounds=2)
    run(secure, client(), rounds=2)
    for k in plain.global_state:
        assert torch.allclose(secure.global_state[k], plain.global_state[k], atol=1e-4), k
    assert [r.round_type for r in secure.reports] == [r.round_type for r in plain.reports]


def test_no_message_to_the_server_holds_a_silo_update():
    received = []
    inner = client()

    def spy(msg, context):
        reply = inner(msg, context)
        received.append(reply)
        return reply

    s = make("fedlora", True)
    run(s, spy)
    sent = {k: v for k, v in s.global_state.items()}
    assert received
    for reply in received:
        assert "arrays" not in reply.content.array_records
        for name, record in reply.content.array_records.items():
            for key in record:
                a = record[key].numpy()
                assert a.dtype == np.int64  # only masked residues travel as arrays
    assert sent


def test_fedpower_secure_power_iteration_is_the_rank_r_approximation_of_the_merge():
    s = make("fedpower", True, power_iters=30)
    grid = InProcessGrid(client(), 6, run_config={"dp.level": "none"})
    s.start(grid=grid, initial_arrays=ArrayRecord(s.global_state), num_rounds=1)
    # the same round in the clear: the silos' states, the dense merge and its best rank-r approximation
    train_msgs = [msg for msg in grid.sent if msg.metadata.message_type == "train"]
    states = [trained_state(msg, grid._contexts[msg.metadata.dst_node_id], True) for msg in train_msgs]
    for name in M_NAMES:
        W = torch.stack([st[name + ".lora_B.weight"].double() @ st[name + ".lora_A.weight"].double()
                         for st in states]).mean(0)
        U, S, Vh = torch.linalg.svd(W)
        best = (U[:, :r] * S[:r]) @ Vh[:r]
        got = s.global_state[name + ".lora_B.weight"].double() @ s.global_state[name + ".lora_A.weight"].double()
        assert torch.allclose(got, best, atol=1e-4), name
        A = s.global_state[name + ".lora_A.weight"].double()
        assert torch.allclose(A @ A.T, torch.eye(r, dtype=torch.float64), atol=1e-5)
    head = torch.stack([st["classifier.weight"] for st in states]).mean(0)
    assert torch.allclose(s.global_state["classifier.weight"], head, atol=1e-5)
    rep = s.reports[0]
    assert rep.released and rep.aggregated == 6
    assert rep.message_rounds == 1 + 3 + 4 * (2 * 30)  # the first sum's keys ride on the train replies
    # no silo ever sent an m x n matrix: the largest array is one masked vector of thin products + head
    largest = max(a.numpy().size for msg in grid.sent for rec in msg.content.array_records.values()
                  for a in rec.values() if msg.metadata.message_type == MESSAGE_TYPE)
    assert largest <= len(M_NAMES) * max(m, n) * r


@pytest.mark.parametrize("stage", ["train", "share_keys", "masked_input", "unmask"])
def test_dropouts_up_to_the_threshold_still_release_the_survivors_average(stage):
    # 6 silos, threshold 0.6: t = 4 of each silo's 6 holders, so 2 may drop at any stage. A silo
    # that drops at the unmask stage already sent its masked input: it is in the sum.
    s = make("fedlora", True)
    dropped = {100: stage, 103: stage}
    grid = run(s, client(fail=dropped))
    rep = s.reports[0]
    in_sum = 6 if stage == "unmask" else 4
    assert rep.released and rep.aggregated == in_sum
    survivors = [msg for msg in grid.sent if msg.metadata.message_type == "train"
                 and (stage == "unmask" or msg.metadata.dst_node_id not in dropped)]
    states = [trained_state(msg, grid._contexts[msg.metadata.dst_node_id], True) for msg in survivors]
    for k in s.global_state:
        expected = torch.stack([st[k] for st in states]).mean(0)
        assert torch.allclose(s.global_state[k], expected, atol=1e-5), k


def test_past_the_threshold_the_round_is_refused_and_nothing_released():
    s = make("fedlora", True)
    before = {k: v.clone() for k, v in s.global_state.items()}
    run(s, client(fail={100: "masked_input", 101: "unmask", 102: "unmask"}))
    rep = s.reports[0]
    assert not rep.released and rep.aggregated == 0
    assert "threshold" in rep.secure_refused
    for k in before:
        assert torch.equal(s.global_state[k], before[k])


def test_a_round_with_one_silo_is_refused():
    s = make("fedlora", True)
    before = {k: v.clone() for k, v in s.global_state.items()}
    run(s, client(), nodes=1)
    assert not s.reports[0].released and "at least 2 silos" in s.reports[0].secure_refused
    assert all(torch.equal(s.global_state[k], before[k]) for k in before)


def test_silo_refuses_a_basis_that_is_not_orthonormal():
    from strategies.secure_sum import contributions as SC

    basis = {"layer.0.query": torch.eye(r, n) * 3}
    with pytest.raises(ValueError, match="orthonormal"):
        SC.check_basis("power-right", basis)
    SC.check_basis("power-right", {"layer.0.query": torch.eye(r, n)})


def test_secure_aggregation_refuses_server_side_noise():
    from strategies.privacy_contract import ServerSideDefaults

    class ServerNoise(ServerSideDefaults):
        enabled, noise_at, clip = True, "server", 1.0

    with pytest.raises(ValueError, match="secagg.enabled"):
        make("fedlora", True, privacy=ServerNoise())


# -- distributed DP at client level ---------------------------------------------------------------------
class SharesPrivacy:
    """A distributed-DP hook with fixed share parameters (tests the plumbing, not the calibration)."""

    enabled, noise_at, clip = True, "distributed", None

    def __init__(self, clip, scale, local_std, contributors, num_clients=6):
        from strategies.privacy_contract import ServerSideDefaults

        self.params = {"clip": clip, "scale": scale, "local-std": local_std, "contributors": contributors}
        self.denominator, self.recorded = float(num_clients), []
        self._base = ServerSideDefaults

    def noise_parameters(self):
        return dict(self.params)

    def plan_round(self, server_round, round_type, sampled):
        from strategies.privacy_contract import RoundPlan

        return RoundPlan(server_round, round_type, tuple(sampled), 0, {}, (0.0,))

    def commit_round(self, plan, num_aggregated, released):
        self.recorded.append((plan.round_type, num_aggregated, released))

    def epsilon(self):
        return 1.0


class ServerClip:
    """The same round in the clear: the server clips each delta to C, adds no noise (client level)."""

    enabled, noise_at = True, "server"

    def __init__(self, clip):
        self.clip = clip

    def plan_round(self, server_round, round_type, sampled):
        from strategies.privacy_contract import RoundPlan

        return RoundPlan(server_round, round_type, tuple(sampled), 0, {}, (0.0,) * 8)

    def commit_round(self, plan, num_aggregated, released):
        pass

    def epsilon(self):
        return 0.0


NO_BUDGET = {"dp-max-epsilon": 1e300, "ledger-file": "memory"}


def client_level(name, privacy, secure, **kw):
    return make(name, secure, privacy=privacy, client_level=True, denominator=6.0, **kw)


@pytest.mark.parametrize("name", ["fedlora", "ffa-lora", "fedpower"])
def test_distributed_dp_without_noise_equals_the_clipped_round_in_the_clear(name):
    # shares of std 1/2 integer unit at a scale of 1e6 per unit: noise below 1e-6, so the secure
    # round must equal the server-clipped round in the clear (clip 0.5 clips every silo's delta)
    plain = client_level(name, ServerClip(0.5), False, power_iters=2)
    secure = client_level(name, SharesPrivacy(0.5, 1e6, 0.5, 4), True, power_iters=2)
    run(plain, client(), rounds=2)
    run(secure, client(), rounds=2, node_config=NO_BUDGET)  # the silos accept shares this small
    assert [r.round_type for r in secure.reports] == [r.round_type for r in plain.reports]
    for k in plain.global_state:
        assert torch.allclose(secure.global_state[k], plain.global_state[k], atol=2e-4), k
    assert all(r.released for r in secure.reports)


def test_distributed_dp_sum_carries_the_shares_noise():
    # FedLoRA deltas: the release minus the clipped average is the sum of the 6 silos' shares / m
    sigma, scale, m_silos = 2000.0, 1000.0, 6
    plain = client_level("fedlora", ServerClip(0.5), False)
    secure = client_level("fedlora", SharesPrivacy(0.5, scale, sigma, 4), True)
    run(plain, client())
    run(secure, client(), node_config=NO_BUDGET)
    diff = torch.cat([(secure.global_state[k] - plain.global_state[k]).reshape(-1) for k in plain.global_state])
    expected = (m_silos ** 0.5) * sigma / scale / m_silos
    assert abs(float(diff.std()) / expected - 1) < 0.15, (float(diff.std()), expected)
    assert abs(float(diff.mean())) < 4 * expected / len(diff) ** 0.5


def test_silo_refuses_a_share_past_its_budget():
    # a share of std 1/2 at C s = 1e6: epsilon in the millions, far past any budget
    s = client_level("fedlora", SharesPrivacy(1.0, 1e6, 0.5, 4), True)
    grid = InProcessGrid(client(), 6, run_config=_run_config(), node_config={"dp-max-epsilon": 8, "ledger-file": "memory"})
    s.start(grid=grid, initial_arrays=ArrayRecord(s.global_state), num_rounds=1)
    rep = s.reports[0]
    assert not rep.released and "threshold" in rep.secure_refused
    assert any("budget" in d["reason"] for d in rep.dropped)


def _run_config():
    from fedpower_app.config import pyproject_defaults

    cfg = pyproject_defaults()
    cfg.update({"task.name": "synthetic", "dp.level": "client", "secagg.enabled": True, "strategy.name": "fedlora"})
    return cfg


def test_privacy_plan_of_a_distributed_dp_run(capsys):
    from fedpower_app.privacy.cli import main

    rc = main(["--preset", "conf/tiny.toml", "--set", "secagg.enabled=true", "--set", 'dp.level="client"',
               "--set", "strategy.client-rate=1.0", "--set", "secagg.colluders=1"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "client-level distributed DP" in out and "k = t - colluders = 3" in out and "VALID" in out


def test_distributed_dp_calibration_meets_its_target_and_silo_accounts_at_its_own_k():
    from fedpower_app.config import parse_config
    from fedpower_app.privacy.accounting import distributed as DA
    from fedpower_app.privacy.accounting.silo import SiloLedger
    from fedpower_app.privacy.silo_policy import SiloPolicy

    plan = DA.DistributedPlan(epsilon=4.0, delta=1e-5, num_rounds=5, clip=0.5, num_clients=6, min_contributors=4,
                              schedule=((1000,),) * 5, bits=32)
    cal = DA.calibrate(plan)
    assert 3.99 < cal.epsilon <= 4.0 and cal.wrap_probability < 1e-9

    def silo_epsilon(colluders):
        policy = SiloPolicy.from_node_config({"secagg-colluders": colluders}, parse_config({}), simulated=True)
        k = policy.noise_share_contributors(threshold=4, requested=4)
        ledger = SiloLedger(1e-5)
        for _ in range(5):
            ledger.record_share((0.5, cal.scale, cal.local_std, 1000, k))
        return ledger.epsilon()

    eps = silo_epsilon(0)
    assert eps == pytest.approx(cal.epsilon, rel=1e-6)  # the silo's ledger agrees with the server's plan
    # a silo assuming one colluder accounts at k = 3: more epsilon for the same shares
    assert silo_epsilon(1) > eps * 1.1
