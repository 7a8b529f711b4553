"""A server that deviates on purpose: the attacks of the hostile-server tests, as the server's side.

Each attack drives real protocol clients (``strategies.secure_sum``) exactly as a malicious server
would, and returns what it recovered of a target silo's input, or raises ``SecureSumRefused`` when
an honest client refuses. The tests run every attack twice: against the product's clients, where it
must recover nothing, and against a deliberately weakened client (no signing keys, no round guard),
where it must succeed (the positive control that shows the attack is real).
"""

from __future__ import annotations

import numpy as np

from strategies.secure_sum import masking as MK
from strategies.secure_sum.field import sub_mod
from strategies.secure_sum.identity import SiloIdentity, TrustedSilos
from strategies.secure_sum.protocol import SecureSumClient, SecureSumConfig
from strategies.secure_sum.session import threshold_for


def cohort_config(nodes, size: int = 8, bits: int = 32, label: str = "1/trained/0") -> SecureSumConfig:
    """The complete graph at the default threshold fraction, as a run would set it."""
    nodes = tuple(nodes)
    return SecureSumConfig(nodes=nodes, size=size, bits=bits, threshold=threshold_for(len(nodes), 0.6),
                           graph_seed=b"public-seed", label=label)


def silos(nodes, config: SecureSumConfig, *, signed: bool) -> dict[int, SecureSumClient]:
    """Honest clients; ``signed``: each with its own key, all trusting each other (a PKI)."""
    if not signed:
        return {u: SecureSumClient(u, config) for u in nodes}
    keys = {u: SiloIdentity.generate() for u in nodes}
    trusted = TrustedSilos([k.public for k in keys.values()])
    return {u: SecureSumClient(u, config, identity=keys[u], trusted=trusted) for u in nodes}


def _server_played(nodes, config: SecureSumConfig, *, signed: bool) -> dict[int, SecureSumClient]:
    """Clients the server runs itself (sybils, or shadows of real ids): with keys of its own, which no
    honest silo trusts."""
    if not signed:
        return {u: SecureSumClient(u, config) for u in nodes}
    mine = {u: SiloIdentity.generate() for u in nodes}
    trusted = TrustedSilos([k.public for k in mine.values()])
    return {u: SecureSumClient(u, config, identity=mine[u], trusted=trusted) for u in nodes}


def _keys_for(replies: dict, u: int, among) -> dict:
    return {v: tuple(r[k] for k in ("channel_key", "mask_key", "identity", "signature") if k in r)
            for v, r in replies.items() if v != u and v in among}


def _remove_pairwise(y, node: int, mask_public: bytes, partners: dict[int, bytes], config: SecureSumConfig):
    """y less the pairwise masks ``node`` added with each partner whose mask secret the server knows."""
    for v, secret in partners.items():
        pairwise = MK.mask(MK.agreed_seed(secret, mask_public), config.size, config.bits, b"pair")
        y = sub_mod(y, pairwise, config.bits) if node > v else (y + pairwise) & ((1 << config.bits) - 1)
    return y


def padded_survivors_attack(honest: dict[int, SecureSumClient], sybil_ids, target: int,
                            inputs: dict[int, np.ndarray], *, signed: bool) -> np.ndarray:
    """The server adds ids of its own to the cohort, then tells each honest holder "the survivors are
    you, the target and my ids": each reveals its share of the target's self-mask seed and its shares
    of every other honest client's mask key. Returns the target's input as the server rebuilds it."""
    config = next(iter(honest.values())).config
    sybils = _server_played(sybil_ids, config, signed=signed)
    everyone = {**honest, **sybils}
    adverts = {u: c.advertise_keys() for u, c in everyone.items()}
    sealed = {u: c.share_keys(_keys_for(adverts, u, everyone))["sealed_shares"] for u, c in everyone.items()}
    masked = {}
    for u, c in everyone.items():
        mine = {v: s[u] for v, s in sealed.items() if u in s}
        x = inputs.get(u, np.zeros(config.size, dtype=np.int64))
        masked[u] = c.masked_input(mine, x)["masked"]
    t = config.threshold
    seed_shares = [s._seed_shares[target] for s in sybils.values()]
    key_shares = {v: [s._key_shares[v] for s in sybils.values()] for v in honest if v != target}
    for h, client in honest.items():
        if h == target:
            continue
        survivors = sorted({h, target, *sybils})
        if signed:  # the signed protocol wants a consistency round first: sign it with what the server holds
            client.consistency(survivors)
        reply = client.unmask(survivors)
        seed_shares.append(reply["seed_shares"][target])
        for v, share in reply["key_shares"].items():
            key_shares[v].append(share)
    b_target = MK.combine_secret(seed_shares[:t])
    y = sub_mod(masked[target], MK.mask(b_target, config.size, config.bits, b"self"), config.bits)
    partners = {v: MK.combine_secret(shares[:t]) for v, shares in key_shares.items()}
    partners.update({s: c._mask_keys.secret for s, c in sybils.items()})
    return _remove_pairwise(y, target, adverts[target]["mask_key"], partners, config)


def substituted_keys_attack(target_client: SecureSumClient, others, x: np.ndarray, *, signed: bool) -> np.ndarray:
    """The server relays keys of its own in place of every other silo's to the target (a man in the
    middle): the target seals its shares for keys the server holds and masks with them. Returns the
    target's input as the server rebuilds it."""
    config = target_client.config
    shadows = _server_played(others, config, signed=signed)
    target = target_client.node
    advert = target_client.advertise_keys()
    shadow_adverts = {v: c.advertise_keys() for v, c in shadows.items()}
    sealed_by_target = target_client.share_keys(_keys_for(shadow_adverts, target, shadows))["sealed_shares"]
    everyone_adverts = {**shadow_adverts, target: advert}
    sealed = {v: c.share_keys(_keys_for(everyone_adverts, v, everyone_adverts))["sealed_shares"]
              for v, c in shadows.items()}
    masked = target_client.masked_input({v: s[target] for v, s in sealed.items()}, x)["masked"]
    for v, c in shadows.items():  # each shadow opens what the target sealed for it
        c.masked_input({target: sealed_by_target[v], **{u: s[v] for u, s in sealed.items() if v in s}},
                       np.zeros(config.size, dtype=np.int64))
    b_target = MK.combine_secret([c._seed_shares[target] for c in shadows.values()][:config.threshold])
    y = sub_mod(masked, MK.mask(b_target, config.size, config.bits, b"self"), config.bits)
    return _remove_pairwise(y, target, advert["mask_key"],
                            {v: c._mask_keys.secret for v, c in shadows.items()}, config)
