"""Strategy round logic with an in-process Grid (no Ray): sampling, aggregation, bad replies."""

from collections import OrderedDict

import pytest
import torch
from flwr.app import ArrayRecord, Error, Message, MetricRecord, RecordDict

from strategies.privacy_contract import ServerSideDefaults
from strategies.flower import BudgetExhausted, FedLoRAStrategy, FedPowerStrategy, FFALoRAStrategy, build_strategy
from strategies.noise import NoiseSource
from fedpower_app.runs.inprocess_grid import InProcessGrid

M_NAMES = [f"layer.{i}.query" for i in range(2)] + [f"layer.{i}.value" for i in range(2)]
m, n, r = 12, 10, 2


def initial_state(seed=0, head=False):
    g = torch.Generator().manual_seed(seed)
    st = OrderedDict()
    for name in M_NAMES:
        st[name + ".lora_A.weight"] = torch.randn(r, n, generator=g) * 0.1
        st[name + ".lora_B.weight"] = torch.zeros(m, r)
    if head:
        st["classifier.weight"] = torch.randn(2, n, generator=g)
    return st


def fake_client(delta_scale=0.5, send_a=True):
    """A ClientApp stand-in: global adapters + a deterministic per-node change."""

    def app(msg: Message, context):
        state = msg.content["arrays"].to_torch_state_dict()
        g = torch.Generator().manual_seed(context.node_id * 1000 + int(msg.content["config"]["server-round"]))
        out = OrderedDict()
        for k, v in state.items():
            if k.endswith("lora_A.weight") and not send_a:
                continue
            out[k] = v + delta_scale * torch.randn(v.shape, generator=g)
        return Message(RecordDict({"arrays": ArrayRecord(out),
                                   "metrics": MetricRecord({"num-examples": 10, "train-loss": 0.5})}), reply_to=msg)

    return app


class FixedPrivacy(ServerSideDefaults):
    """A privacy hook with fixed stds (tests the strategy plumbing, not the accountant)."""

    enabled = True
    noise_at = "server"

    def __init__(self, clip=1.0, std=0.0, budget_rounds=None):
        self.clip, self.std, self.budget_rounds, self.recorded = clip, std, budget_rounds, []

    def noise_stds(self, round_type, k):
        return [self.std, self.std]

    def check(self, round_type, server_round):
        if self.budget_rounds is not None and len(self.recorded) >= self.budget_rounds:
            raise BudgetExhausted(f"budget allows {self.budget_rounds} rounds")

    def record(self, round_type, server_round, num_sampled, num_aggregated):
        self.recorded.append((round_type, server_round, num_sampled, num_aggregated))

    def epsilon(self):
        return float(len(self.recorded))


def run(strategy, client_app, num_nodes=4, rounds=3, handlers=None):
    grid = InProcessGrid(client_app, num_nodes, handlers=handlers)
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(strategy.global_state), num_rounds=rounds)
    return grid, result


def make(cls, **kw):
    base = dict(initial_state=initial_state(), rank=r, client_rate=1.0, noise=NoiseSource(0))
    base.update(kw)
    return cls(**base)


def test_poisson_client_sampling_rate_and_reproducibility():
    s = make(FedLoRAStrategy, client_rate=0.3)
    nodes = list(range(50))
    counts = [len(s.sample_clients(t, nodes)) for t in range(1, 201)]
    assert abs(sum(counts) / (200 * 50) - 0.3) < 0.02
    assert s.sample_clients(7, nodes) == make(FedLoRAStrategy, client_rate=0.3).sample_clients(7, nodes)
    assert any(c == 0 for c in [len(make(FedLoRAStrategy, client_rate=0.05).sample_clients(t, list(range(3)))) for t in range(1, 60)])


def test_fedlora_nonprivate_is_plain_average():
    s = make(FedLoRAStrategy)
    grid, result = run(s, fake_client(), rounds=1)
    replies = [fake_client()(msg, grid._contexts[msg.metadata.dst_node_id]) for msg in grid.sent]
    states = [rep.content["arrays"].to_torch_state_dict() for rep in replies]
    for k in s.global_state:
        expected = torch.stack([st[k] for st in states]).mean(0)
        assert torch.allclose(s.global_state[k], expected, atol=1e-6)
    assert s.reports[0].aggregated == 4 and s.reports[0].dropped == []


def test_fedpower_nonprivate_is_rank_r_refactorization_of_average():
    s = make(FedPowerStrategy, power_iters=30)
    grid, _ = run(s, fake_client(), rounds=1)
    replies = [fake_client()(msg, grid._contexts[msg.metadata.dst_node_id]) for msg in grid.sent]
    states = [rep.content["arrays"].to_torch_state_dict() for rep in replies]
    for name in M_NAMES:
        W = torch.stack([st[name + ".lora_B.weight"] @ st[name + ".lora_A.weight"] for st in states]).mean(0)
        U, S, Vh = torch.linalg.svd(W.double())
        best = (U[:, :r] * S[:r]) @ Vh[:r]
        got = s.global_state[name + ".lora_B.weight"] @ s.global_state[name + ".lora_A.weight"]
        assert torch.allclose(got.double(), best, atol=1e-3)
        A = s.global_state[name + ".lora_A.weight"]
        assert torch.allclose(A @ A.T, torch.eye(r), atol=1e-5)


def test_fedpower_private_clips_whole_update():
    priv = FixedPrivacy(clip=0.5, std=0.0)
    s = make(FedPowerStrategy, privacy=priv, power_iters=30)
    run(s, fake_client(delta_scale=3.0), rounds=1)
    W_norm_sq = sum((s.global_state[nm + ".lora_B.weight"] @ s.global_state[nm + ".lora_A.weight"]).double().pow(2).sum() for nm in M_NAMES)
    assert W_norm_sq.sqrt() <= 0.5 * (1 + 1e-5)  # average of clipped updates, projected: norm <= C
    assert s.reports[0].clipped_fraction == 1.0
    assert priv.recorded == [("powerdp", 1, 4, 4)]


def test_ffa_lora_never_changes_a():
    s = make(FFALoRAStrategy, privacy=FixedPrivacy(clip=1.0, std=0.1))
    a_before = {k: v.clone() for k, v in s.global_state.items() if "lora_A" in k}
    run(s, fake_client(send_a=False), rounds=3)
    for k, v in a_before.items():
        assert torch.equal(s.global_state[k], v)
    assert any((s.global_state[k] != 0).any() for k in s.global_state if "lora_B" in k)
    assert all(rep.aggregated == 4 for rep in s.reports)


def test_ffa_lora_drops_replies_that_send_a():
    s = make(FFALoRAStrategy)
    run(s, fake_client(send_a=True), rounds=1)
    assert s.reports[0].aggregated == 0 and len(s.reports[0].dropped) == 4
    assert "unexpected key" in s.reports[0].dropped[0]["reason"]


def bad_handlers(base_app):
    def nan_reply(msg, ctx):
        rep = base_app(msg, ctx)
        st = rep.content["arrays"].to_torch_state_dict()
        k = next(iter(st))
        st[k][0, 0] = float("nan")
        return Message(RecordDict({"arrays": ArrayRecord(st), "metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)

    def wrong_shape(msg, ctx):
        st = base_app(msg, ctx).content["arrays"].to_torch_state_dict()
        k = next(iter(st))
        st[k] = torch.zeros(3, 3)
        return Message(RecordDict({"arrays": ArrayRecord(st)}), reply_to=msg)

    def missing_key(msg, ctx):
        st = base_app(msg, ctx).content["arrays"].to_torch_state_dict()
        st.pop(next(iter(st)))
        return Message(RecordDict({"arrays": ArrayRecord(st)}), reply_to=msg)

    def error_reply(msg, ctx):
        return Message(Error(code=2, reason="client crashed"), reply_to=msg)

    def raises(msg, ctx):
        raise RuntimeError("boom")

    return [nan_reply, wrong_shape, missing_key, error_reply, raises]


def hostile_handlers(base_app):
    """Replies whose problem shows in the metadata: they must be dropped before any decoding."""
    from flwr.app import Array

    def arrays_of(msg, ctx):
        return dict(base_app(msg, ctx).content["arrays"].items())

    def half_precision(msg, ctx):
        st = base_app(msg, ctx).content["arrays"].to_torch_state_dict()
        k = next(iter(st))
        st[k] = st[k].half()
        return Message(RecordDict({"arrays": ArrayRecord(st)}), reply_to=msg)

    def oversized(msg, ctx):  # right shape and dtype declared, 50 MB of payload
        arrs = arrays_of(msg, ctx)
        k = next(iter(arrs))
        a = arrs[k]
        arrs[k] = Array(dtype=a.dtype, shape=tuple(a.shape), stype=a.stype, data=b"\0" * 50_000_000)
        return Message(RecordDict({"arrays": ArrayRecord(arrs)}), reply_to=msg)

    def garbage_payload(msg, ctx):  # declared right, bytes undecodable
        arrs = arrays_of(msg, ctx)
        k = next(iter(arrs))
        a = arrs[k]
        arrs[k] = Array(dtype=a.dtype, shape=tuple(a.shape), stype=a.stype, data=b"not an array")
        return Message(RecordDict({"arrays": ArrayRecord(arrs)}), reply_to=msg)

    def integer(msg, ctx):
        st = base_app(msg, ctx).content["arrays"].to_torch_state_dict()
        k = next(iter(st))
        st[k] = torch.zeros_like(st[k], dtype=torch.int64)
        return Message(RecordDict({"arrays": ArrayRecord(st)}), reply_to=msg)

    return [half_precision, oversized, garbage_payload, integer]


@pytest.mark.parametrize("cls", [FedPowerStrategy, FedLoRAStrategy])
def test_hostile_replies_are_dropped_from_their_metadata(cls, monkeypatch):
    import strategies.flower as F

    base = fake_client()
    handlers = {100 + i: h for i, h in enumerate(hostile_handlers(base))}
    decoded = []
    original = F.ArrayRecord.to_torch_state_dict
    monkeypatch.setattr(F.ArrayRecord, "to_torch_state_dict",
                        lambda self, *a, **k: decoded.append(self.count_bytes()) or original(self, *a, **k))
    s = make(cls, privacy=FixedPrivacy(clip=1.0, std=0.01))
    run(s, base, num_nodes=6, rounds=1, handlers=handlers)
    rep = s.reports[0]
    assert rep.sampled == 6 and rep.aggregated == 2 and len(rep.dropped) == 4
    reasons = [d["reason"] for d in rep.dropped]
    assert "dtype float16" in reasons[0] and "more than the" in reasons[1]
    assert "could not be decoded" in reasons[2] and "dtype int64" in reasons[3]
    assert max(decoded) < 50_000_000  # the 50 MB reply was never decoded
    assert all(torch.isfinite(v).all() for v in s.global_state.values())


@pytest.mark.parametrize("cls", [FedPowerStrategy, FedLoRAStrategy])
def test_bad_replies_dropped_and_counted(cls):
    base = fake_client()
    handlers = {100 + i: h for i, h in enumerate(bad_handlers(base))}
    s = make(cls, privacy=FixedPrivacy(clip=1.0, std=0.01))
    grid, result = run(s, base, num_nodes=7, rounds=2, handlers=handlers)
    for rep in s.reports:
        assert rep.sampled == 7 and rep.aggregated == 2 and len(rep.dropped) == 5
        reasons = " | ".join(d["reason"] for d in rep.dropped)
        for needle in ("NaN", "shape", "missing", "client crashed", "boom"):
            assert needle in reasons
    assert all(torch.isfinite(v).all() for v in s.global_state.values())


def test_budget_stops_before_crossing_round():
    priv = FixedPrivacy(clip=1.0, std=0.1, budget_rounds=2)
    s = make(FedLoRAStrategy, privacy=priv)
    grid, _ = run(s, fake_client(), rounds=5)
    assert len(priv.recorded) == 2 and len(s.reports) == 2
    assert "budget" in s.stopped_reason
    assert {m.metadata.message_type for m in grid.sent} == {"train"} and len(grid.sent) == 8  # no 3rd round sent


def test_empty_round_releases_noise_under_dp_and_keeps_model_without_dp():
    priv = FixedPrivacy(clip=1.0, std=0.5)
    s = make(FedLoRAStrategy, privacy=priv, client_rate=1e-9)
    run(s, fake_client(), rounds=1)
    assert s.reports[0].sampled == 0 and priv.recorded == [("fedlora", 1, 0, 0)]
    assert all(v.abs().sum() > 0 for k, v in s.global_state.items() if "lora_B" in k)
    s2 = make(FedLoRAStrategy, client_rate=1e-9)
    before = {k: v.clone() for k, v in s2.global_state.items()}
    run(s2, fake_client(), rounds=1)
    assert all(torch.equal(before[k], s2.global_state[k]) for k in before)


def test_refactor_every_schedule_and_head_aggregated():
    s = build_strategy("fedpower", initial_state=initial_state(head=True), rank=r, client_rate=1.0,
                       refactor_every=3, privacy=FixedPrivacy(clip=1.0, std=0.0))
    assert [s.round_type(t) for t in range(1, 7)] == ["fedlora", "fedlora", "powerdp", "fedlora", "fedlora", "powerdp"]
    head_before = s.global_state["classifier.weight"].clone()
    run(s, fake_client(delta_scale=0.01), rounds=3)
    assert not torch.equal(head_before, s.global_state["classifier.weight"])
    # Head deltas are clipped together with the rest: the mean delta is small.
    assert (s.global_state["classifier.weight"] - head_before).norm() <= 1.0 + 1e-5


def test_build_strategy_rejects_unknown():
    with pytest.raises(ValueError, match="unknown strategy"):
        build_strategy("fedavg", initial_state=initial_state(), rank=r, client_rate=1.0)
    with pytest.raises(ValueError, match="client_rate"):
        make(FedLoRAStrategy, client_rate=1.5)


class ReversedGrid(InProcessGrid):
    """Delivers replies in the opposite order, as a network may."""

    def pull_messages(self, message_ids):
        return list(reversed(super().pull_messages(message_ids)))


@pytest.mark.parametrize("cls", [FedLoRAStrategy, FedPowerStrategy])
def test_aggregation_does_not_depend_on_reply_arrival_order(cls):
    results = []
    for grid_cls in (InProcessGrid, ReversedGrid):
        s = make(cls, privacy=FixedPrivacy(clip=5.0, std=0.01))
        s.start(grid=grid_cls(fake_client(), 5), initial_arrays=ArrayRecord(s.global_state), num_rounds=2)
        results.append(s.global_state)
    assert results[0].keys() == results[1].keys()
    for k in results[0]:
        assert torch.equal(results[0][k], results[1][k]), k  # bit-for-bit: same summation order


def test_sampling_coins_follow_the_given_population_order():
    # Same seed, same coins: the k-th coin decides the k-th node of the population, whatever its id.
    a = make(FedLoRAStrategy, client_rate=0.5, population=[100, 101, 102, 103, 104, 105])
    b = make(FedLoRAStrategy, client_rate=0.5, population=[9, 4, 7, 1, 8, 2])
    for rnd in range(1, 6):
        pos_a = [a.population.index(n) for n in a.sample_clients(rnd, a.population)]
        pos_b = [b.population.index(n) for n in b.sample_clients(rnd, b.population)]
        assert pos_a == pos_b
    with pytest.raises(ValueError, match="more than once"):
        make(FedLoRAStrategy, population=[1, 2, 1])
