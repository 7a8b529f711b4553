"""Secure summation (strategies/secure_sum): quantization error bound, masks that cancel, dropouts up to
the threshold, refusal past it, and what a server that records everything it receives can learn."""

import numpy as np
import pytest
from scipy import stats

from strategies.secure_sum import masking as MK
from strategies.secure_sum.field import FieldQuantizer, centered, to_field
from strategies.secure_sum.protocol import (
    Recorder, SecureSumClient, SecureSumConfig, SecureSumRefused, SecureSumServer, simulate)

NODES = (11, 12, 13, 14, 15, 16)


def _inputs(q, nodes, size, seed=0, spread=1.0):
    rng = np.random.default_rng(seed)
    xs = {u: rng.uniform(-spread, spread, size) for u in nodes}
    return xs, {u: q.encode(x, rng)[0] for u, x in xs.items()}


# -- quantization -----------------------------------------------------------------------------------
@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_decoded_sum_is_within_the_stated_error_bound(rounding):
    q = FieldQuantizer(bits=16, clip_range=2.0, num_clients=5, rounding=rounding)
    rng = np.random.default_rng(1)
    xs = [rng.uniform(-2, 2, 2000) for _ in range(5)]
    total = np.zeros(2000, dtype=np.int64)
    for x in xs:
        total = (total + q.encode(x, rng)[0]) & (q.modulus - 1)
    err = np.abs(q.decode_sum(total, 5) - np.sum(xs, axis=0))
    assert err.max() <= q.error_bound(5)
    assert err.max() > 0.2 * q.error_bound(5)  # the bound is not vacuous at 16 bits


def test_the_sum_of_n_extreme_vectors_does_not_wrap():
    q = FieldQuantizer(bits=8, clip_range=1.0, num_clients=7)
    total = np.zeros(3, dtype=np.int64)
    for _ in range(7):
        total = (total + q.encode(np.array([5.0, -5.0, 1.0]))[0]) & (q.modulus - 1)  # clamped to +-1
    assert np.allclose(q.decode_sum(total, 7), [7.0, -7.0, 7.0], atol=q.error_bound(7))


def test_stochastic_rounding_is_unbiased():
    q = FieldQuantizer(bits=10, clip_range=1.0, num_clients=1)
    x = np.full(200_000, 0.3 / q.scale + 0.1)  # a third of a level above a grid point
    dec = q.decode_sum(q.encode(x, np.random.default_rng(2))[0], 1)
    assert abs(dec.mean() - x[0]) < 4 * (0.5 / q.scale) / np.sqrt(x.size)


def test_quantizer_reports_clamped_coordinates_and_rejects_bad_input():
    q = FieldQuantizer(bits=12, clip_range=1.0, num_clients=2)
    assert q.encode(np.array([0.5, 1.5, -3.0]))[1] == 2
    with pytest.raises(ValueError, match="NaN"):
        q.encode(np.array([np.nan]))
    with pytest.raises(ValueError, match="clip range"):
        FieldQuantizer(bits=12, clip_range=0.0, num_clients=2)  # flwr's quantizer divides by zero here
    with pytest.raises(ValueError, match="without wrapping"):
        FieldQuantizer(bits=8, clip_range=1.0, num_clients=100)
    with pytest.raises(ValueError, match="bits"):
        FieldQuantizer(bits=63, clip_range=1.0, num_clients=2)
    with pytest.raises(ValueError, match="outside"):
        q.error_bound(3)


def test_centered_lift_inverts_to_field():
    v = np.array([-5, 0, 7, -128, 127])
    assert np.array_equal(centered(to_field(v, 8), 8), v)


# -- masks and graph --------------------------------------------------------------------------------
def test_pairwise_seeds_agree_and_masks_are_uniform_and_distinct():
    a, b = MK.new_key_pair(), MK.new_key_pair()
    seed = MK.agreed_seed(a.secret, b.public)
    assert seed == MK.agreed_seed(b.secret, a.public) and len(seed) == 32
    m = MK.mask(seed, 40_000, 12, b"pair")
    assert np.array_equal(m, MK.mask(seed, 40_000, 12, b"pair"))
    assert not np.array_equal(m, MK.mask(seed, 40_000, 12, b"self"))
    assert m.min() >= 0 and m.max() == (1 << 12) - 1  # flwr's pseudo_rand_gen never draws M - 1
    counts = np.bincount(m >> 8, minlength=16)
    assert stats.chisquare(counts).pvalue > 1e-4


def test_neighbour_graph_is_a_symmetric_regular_graph():
    nodes = list(range(100, 130))
    g = MK.neighbour_graph(nodes, 6, b"round seed")
    assert all(len(v) == 6 and u not in v for u, v in g.items())
    assert all(u in g[v] for u in g for v in g[u])
    assert g != MK.neighbour_graph(nodes, 6, b"another seed")
    assert all(len(v) == 29 for v in MK.neighbour_graph(nodes, 40, b"").values())  # complete
    with pytest.raises(ValueError, match="even"):
        MK.neighbour_graph(nodes, 5, b"")


def test_config_validates_threshold_and_degree():
    with pytest.raises(ValueError, match="strict majority"):
        SecureSumConfig(nodes=NODES, size=4, bits=16, threshold=3)  # 3 of 6 holders is not a majority
    with pytest.raises(ValueError, match="strict majority"):
        SecureSumConfig(nodes=NODES, size=4, bits=16, threshold=7)
    with pytest.raises(ValueError, match="even"):
        SecureSumConfig(nodes=tuple(range(20)), size=4, bits=16, threshold=3, degree=3)
    with pytest.raises(ValueError, match="distinct"):
        SecureSumConfig(nodes=(1, 1, 2), size=4, bits=16, threshold=2)
    assert SecureSumConfig(nodes=NODES, size=4, bits=16, threshold=4).max_dropouts == 2


# -- the protocol -----------------------------------------------------------------------------------
def test_masks_cancel_exactly_without_dropouts():
    cfg = SecureSumConfig(nodes=NODES, size=300, bits=20, threshold=4)
    q = FieldQuantizer(20, 1.0, len(NODES))
    xs, enc = _inputs(q, NODES, 300)
    total, survivors = simulate(cfg, enc)
    assert survivors == list(NODES)
    plain = np.zeros(300, dtype=np.int64)
    for v in enc.values():
        plain = (plain + v) & (q.modulus - 1)
    assert np.array_equal(total, plain)
    assert np.abs(q.decode_sum(total, 6) - sum(xs.values())).max() <= q.error_bound(6)


@pytest.mark.parametrize("drop", [
    {12: "advertise_keys", 13: "share_keys"},   # before sharing: they are simply not in the sum
    {12: "masked_input", 15: "masked_input"},   # after sharing: their pairwise masks are rebuilt
    {12: "masked_input", 15: "unmask"},         # a survivor that drops before unmasking
    {11: "unmask", 16: "unmask"},
])
def test_dropouts_up_to_the_threshold_leave_the_sum_of_the_survivors(drop):
    cfg = SecureSumConfig(nodes=NODES, size=200, bits=24, threshold=4)
    q = FieldQuantizer(24, 1.0, len(NODES))
    xs, enc = _inputs(q, NODES, 200, seed=3)
    total, survivors = simulate(cfg, enc, drop=drop)
    sent = [u for u in NODES if drop.get(u) not in ("advertise_keys", "share_keys", "masked_input")]
    assert survivors == sent
    err = np.abs(q.decode_sum(total, len(survivors)) - sum(xs[u] for u in survivors))
    assert err.max() <= q.error_bound(len(survivors))


@pytest.mark.parametrize("drop,reason", [
    ({11: "share_keys", 12: "share_keys", 13: "share_keys"}, "3 clients shared keys, fewer than the threshold t = 4"),
    ({11: "masked_input", 12: "masked_input", 13: "masked_input"}, "3 clients sent masked inputs"),
    ({11: "masked_input", 12: "unmask", 13: "unmask"}, "3 clients answered the unmask stage"),
])
def test_past_the_threshold_the_round_is_refused_with_its_reason(drop, reason):
    cfg = SecureSumConfig(nodes=NODES, size=20, bits=16, threshold=4)
    q = FieldQuantizer(16, 1.0, len(NODES))
    _, enc = _inputs(q, NODES, 20)
    with pytest.raises(SecureSumRefused, match=reason):
        simulate(cfg, enc, drop=drop)


def test_sparse_graph_recovers_with_dropouts_and_refuses_when_a_clients_holders_are_gone():
    nodes = tuple(range(40, 60))
    cfg = SecureSumConfig(nodes=nodes, size=64, bits=28, threshold=4, degree=6, graph_seed=b"public coin")
    q = FieldQuantizer(28, 1.0, len(nodes))
    xs, enc = _inputs(q, nodes, 64, seed=4)
    drop = {41: "masked_input", 42: "share_keys", 47: "unmask"}
    total, survivors = simulate(cfg, enc, drop=drop)
    assert survivors == [u for u in nodes if u not in (41, 42)]
    assert np.abs(q.decode_sum(total, len(survivors)) - sum(xs[u] for u in survivors)).max() <= q.error_bound(len(survivors))
    # 4 of client u's 7 holders (itself included) gone: 3 shares remain of the 4 needed
    u = nodes[5]
    holders = cfg.graph()[u]
    with pytest.raises(SecureSumRefused, match=rf"client {u}'s self-mask seed has 3 shares, the threshold is 4"):
        simulate(cfg, enc, drop={h: "unmask" for h in holders[:4]})


def test_a_recording_server_cannot_recover_any_single_update():
    """The server's whole view: masked vectors uniform even once it removes the self-masks it may
    rebuild; never t shares of both a client's self-mask seed and its mask key; shares only sealed."""
    bits, size = 16, 8192
    cfg = SecureSumConfig(nodes=NODES, size=size, bits=bits, threshold=4)
    q = FieldQuantizer(bits, 1.0, len(NODES))
    enc = {u: q.encode(np.zeros(size) if u == 11 else np.full(size, 0.5))[0] for u in NODES}  # known, constant inputs
    rec = Recorder()
    total, survivors = simulate(cfg, enc, drop={16: "masked_input"}, recorder=rec)
    seed_shares, key_shares, masked = {}, {}, {}
    for stage, sender, payload in rec.received:
        if stage == "masked_input":
            masked[sender] = payload["masked"]
        if stage == "unmask":
            for u, s in payload["seed_shares"].items():
                seed_shares.setdefault(u, []).append(s)
            for u, s in payload["key_shares"].items():
                key_shares.setdefault(u, []).append(s)
    t = cfg.threshold
    for u in NODES:
        assert len(seed_shares.get(u, [])) < t or len(key_shares.get(u, [])) < t
    assert set(key_shares) == {16} and set(masked) == set(survivors)
    for u, y in masked.items():
        assert stats.chisquare(np.bincount(y >> (bits - 4), minlength=16)).pvalue > 1e-4
        b_u = MK.combine_secret(seed_shares[u][:t])  # the server can rebuild a survivor's self-mask...
        without_self = (y - MK.mask(b_u, size, bits, b"self")) & (q.modulus - 1)
        # ...and what is left is still uniform: the pairwise masks with the other survivors hide x_u
        assert stats.chisquare(np.bincount(without_self >> (bits - 4), minlength=16)).pvalue > 1e-4
    # the shares the server saw in stage 2 were sealed: no share it later received appears in them
    sealed_bytes = b"".join(c for stage, _, p in rec.received if stage == "share_keys"
                            for c in p["sealed_shares"].values())
    for shares in seed_shares.values():
        assert all(s[4:] not in sealed_bytes for s in shares)


def test_a_client_answers_one_consistent_unmask_request_only():
    cfg = SecureSumConfig(nodes=NODES[:3], size=4, bits=16, threshold=2)
    clients = {u: SecureSumClient(u, cfg) for u in cfg.nodes}
    server = SecureSumServer(cfg)
    keys = server.receive_keys({u: c.advertise_keys() for u, c in clients.items()})
    sealed = server.receive_shares({u: clients[u].share_keys(keys[u]) for u in clients})
    for u in clients:
        clients[u].masked_input(sealed[u], np.zeros(4, dtype=np.int64))
    a, b, c = cfg.nodes
    with pytest.raises(SecureSumRefused, match="both survivor and dropped"):
        clients[a].unmask([a, b], [b, c])
    with pytest.raises(SecureSumRefused, match="after stage 4"):  # one request per round, however it ended
        clients[a].unmask([a, b], [c])
    clients[b].unmask([a, b], [c])
    with pytest.raises(SecureSumRefused, match="after stage 4"):
        clients[b].unmask([a, b, c], [])
    fresh = SecureSumClient(a, cfg)
    with pytest.raises(SecureSumRefused, match="stage 3 requested after stage 0"):
        fresh.masked_input({}, np.zeros(4, dtype=np.int64))
