"""SecAgg+ (Bell et al. 2020; SecAgg, Bonawitz et al. 2017) as plain objects: a client and a server
that exchange plain dicts in four stages, with no transport. A Flower adapter only has to carry
these dicts in messages; ``simulate`` carries them in-process (tests, benchmarks).

Stages (U1 ⊇ U2 ⊇ U3 ⊇ U4 are the clients still answering at each stage):

1. **advertise keys**: each client makes two ECDH key pairs (one to encrypt shares, one for masks)
   and sends both public keys. The server lays the public neighbour graph over the round's nodes.
2. **share keys**: a client u that got its neighbours' keys draws a 32-byte self-mask seed b_u and
   Shamir-shares b_u and its mask secret key among its holders (its neighbours in U1 and itself),
   threshold t, each pair of shares encrypted for its holder. The server forwards the ciphertexts.
3. **masked input**: u sends y_u = x_u + PRG(b_u) + sum_{v in N(u) ∩ U2} ±PRG(s_uv) mod M, where
   s_uv is the ECDH seed of u and v (+ if u > v, − if u < v), so pairwise masks cancel in a sum.
4. **unmask**: the server names the survivors U3 and the dropped U2 \\ U3. A holder sends its share
   of b_u for each survivor u and its share of the mask secret key for each dropped neighbour,
   never both for the same client, and answers one unmask request only. The server rebuilds each b_u
   (removes the self-masks) and each dropped client's key (recomputes the pairwise masks the
   survivors still carry), and outputs sum_{u in U3} x_u mod M.

**Dropouts and the threshold.** The sum is recovered when every secret the server needs has at least
t shares among the holders that answer stage 4; with the complete graph that is "at least t clients
answer the unmask stage", i.e. up to n − t dropouts. Otherwise the server refuses (``SecureSumRefused``)
and says which secret lacks how many shares. t must be a strict majority of a client's holders, so
that a server which named two different dropped sets to real clients could not gather t shares of
both secrets from disjoint holders (a server that plays clients of its own can: see below).

**Trust.** A semi-honest server colluding with fewer than t clients learns nothing about a client's
x_u beyond the sum of the survivors' inputs: without b_u a masked y_u is uniform, and a client's
holders reveal either b_u or its key, never both.

**Against a server that deviates** (Bonawitz et al. 2017 §6, the active-adversary variant), a client
that holds a signing key and the public keys of the silos it trusts (``identity``) runs the *signed*
protocol: it signs its advertised keys (bound to the sum's config, so a signature cannot be replayed
into another sum), accepts only peer keys signed by silos it trusts, and before it unmasks, a
**consistency stage**: every survivor signs the survivor set U3 it was sent, and a client unmasks
only when it holds at least t valid signatures of the same U3 by distinct trusted members of U3.
An honest client signs one U3 per sum; with t > (n + c) / 2 two different survivor sets cannot both
gather t signatures, so the server cannot tell different holders different survivor sets. In both
modes a client computes the dropped set itself (its neighbours that sent it shares, less U3),
unmasks only for ids that sent it shares, and answers one unmask request per sum. Without signing
keys the protocol is for a **semi-honest server only**: a server that plays clients of its own
(sybils) can make a holder reveal a target's self-mask seed and every other key.
"""

from __future__ import annotations

import base64
import json
import os
from dataclasses import dataclass, field

import numpy as np

from . import masking as MK
from .field import add_mod, check_bits, sub_mod
from .identity import digest


class SecureSumRefused(RuntimeError):
    """The round cannot be unmasked (too many dropouts, or a check failed); nothing was released."""


@dataclass(frozen=True)
class SecureSumConfig:
    """One round's public parameters (the server chooses them and sends them in stage 1)."""

    nodes: tuple               # node ids of the round's cohort
    size: int                  # length of each client's vector of residues
    bits: int                  # the ring Z_{2^bits}
    threshold: int             # t: shares needed to rebuild a client's secret
    degree: int = 0            # neighbours per client; 0: the complete graph (SecAgg)
    graph_seed: bytes = b""    # public randomness for the graph (SecAgg+)
    label: str = ""            # the sum's identity in its run: "<round>/<kind>/<index>" (a client answers each once)

    def __post_init__(self):
        nodes = tuple(int(x) for x in self.nodes)
        object.__setattr__(self, "nodes", nodes)
        check_bits(self.bits)
        if len(set(nodes)) != len(nodes) or len(nodes) < 2:
            raise ValueError(f"a secure sum needs at least 2 distinct nodes, got {list(nodes)}")
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"vector size must be a positive integer, got {self.size!r}")
        degree = self.effective_degree
        holders = degree + 1
        t = self.threshold
        if isinstance(t, bool) or not isinstance(t, int) or not holders // 2 < t <= holders:
            raise ValueError(f"threshold must be an integer with {holders} // 2 < t <= {holders} (a strict majority "
                             f"of a client's {holders} share holders: its {degree} neighbours and itself), got {t!r}")

    @property
    def effective_degree(self) -> int:
        n = len(self.nodes)
        if self.degree in (0, None) or self.degree >= n - 1:
            return n - 1
        if isinstance(self.degree, bool) or not isinstance(self.degree, int) or self.degree < 2 or self.degree % 2:
            raise ValueError(f"graph degree must be 0 (complete) or an even integer >= 2, got {self.degree!r}")
        return self.degree

    @property
    def max_dropouts(self) -> int:
        """With the complete graph, the most clients that may drop after sharing keys: n − t."""
        return len(self.nodes) - self.threshold

    def graph(self) -> dict[int, tuple[int, ...]]:
        return MK.neighbour_graph(list(self.nodes), self.effective_degree, self.graph_seed)

    def to_dict(self) -> dict:
        """The config as plain values (a message's ConfigRecord carries it)."""
        return {"nodes": list(self.nodes), "size": self.size, "bits": self.bits, "threshold": self.threshold,
                "degree": self.degree, "graph-seed": bytes(self.graph_seed), "label": self.label}

    def fingerprint(self) -> bytes:
        """What a signature binds a message to: every public parameter of this one sum (the graph seed
        is fresh randomness per sum, so a signature made for one sum is worthless in any other)."""
        return digest("config", sorted(self.nodes), self.size, self.bits, self.threshold, self.degree,
                      bytes(self.graph_seed), self.label)

    @classmethod
    def from_dict(cls, d) -> "SecureSumConfig":
        try:
            return cls(nodes=tuple(int(x) for x in d["nodes"]), size=int(d["size"]), bits=int(d["bits"]),
                       threshold=int(d["threshold"]), degree=int(d["degree"]), graph_seed=bytes(d["graph-seed"]),
                       label=str(d.get("label", "")))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed secure-sum config: {exc!r}") from None


# -- the client -----------------------------------------------------------------------------------
def advertise_message(config: SecureSumConfig, node: int, channel_key: bytes, mask_key: bytes) -> bytes:
    return digest("advertise", config.fingerprint(), int(node), bytes(channel_key), bytes(mask_key))


def verify_own(identity, message: bytes, signature: bytes) -> bool:
    from .identity import TrustedSilos

    return TrustedSilos([identity.public]).verify(identity.public, message, signature)


def survivors_message(config: SecureSumConfig, survivors) -> bytes:
    return digest("survivors", config.fingerprint(), ",".join(str(int(u)) for u in sorted(survivors)))


class SecureSumClient:
    """One client's side of one round. Each method is one stage; call them in order.

    ``identity`` (a ``SiloIdentity``) and ``trusted`` (a ``TrustedSilos``) make it run the signed
    protocol (see the module docstring); without them it runs the semi-honest one."""

    def __init__(self, node: int, config: SecureSumConfig, *, identity=None, trusted=None) -> None:
        if int(node) not in config.nodes:
            raise ValueError(f"node {node} is not in the round's cohort")
        if (identity is None) != (trusted is None):
            raise ValueError("a signed secure sum needs both a signing key and the trusted silos' public keys")
        if trusted is not None and config.effective_degree < len(config.nodes) - 1:
            raise SecureSumRefused(f"client {node}: a sparse graph (degree {config.effective_degree}) in a signed sum: "
                                   "the signed protocol runs on the complete graph (a sparse graph's seed is the "
                                   "server's, so it is for a semi-honest server only)")
        self.node, self.config = int(node), config
        self.identity, self.trusted = identity, trusted
        self.neighbours = config.graph()[self.node]
        self._stage = 0
        self._channel = self._mask_keys = None
        self._peer_keys: dict[int, tuple[bytes, bytes]] = {}
        self._peer_ids: dict[int, str] = {}       # signed mode: the trusted identity behind each peer's keys
        self._self_seed = b""
        self._seed_shares: dict[int, bytes] = {}  # shares I hold, of b_u per client u
        self._key_shares: dict[int, bytes] = {}   # shares I hold, of u's mask secret key
        self._masked_with: tuple[int, ...] = ()
        self._signed_survivors: tuple[int, ...] | None = None

    @property
    def signed(self) -> bool:
        return self.trusted is not None

    # -- persistence between messages (a ClientApp keeps it in its Context.state) -------------------
    def state_dict(self) -> str:
        """This client's secrets and progress as a JSON string: what it must keep between stages."""
        b64 = lambda b: base64.b64encode(bytes(b)).decode()  # noqa: E731
        return json.dumps({
            "node": self.node, "stage": self._stage,
            "channel": None if self._channel is None else [b64(self._channel.secret), b64(self._channel.public)],
            "mask_keys": None if self._mask_keys is None else [b64(self._mask_keys.secret), b64(self._mask_keys.public)],
            "peer_keys": {str(v): [b64(c), b64(m)] for v, (c, m) in self._peer_keys.items()},
            "peer_ids": {str(v): i for v, i in self._peer_ids.items()},
            "self_seed": b64(self._self_seed),
            "seed_shares": {str(u): b64(s) for u, s in self._seed_shares.items()},
            "key_shares": {str(u): b64(s) for u, s in self._key_shares.items()},
            "masked_with": list(self._masked_with),
            "signed_survivors": None if self._signed_survivors is None else list(self._signed_survivors),
        })

    @classmethod
    def from_state_dict(cls, config: SecureSumConfig, state: str, *, identity=None, trusted=None) -> "SecureSumClient":
        d = json.loads(state)
        unb = base64.b64decode
        client = cls(int(d["node"]), config, identity=identity, trusted=trusted)
        client._stage = int(d["stage"])
        if d["channel"] is not None:
            client._channel = MK.KeyPair(unb(d["channel"][0]), unb(d["channel"][1]))
        if d["mask_keys"] is not None:
            client._mask_keys = MK.KeyPair(unb(d["mask_keys"][0]), unb(d["mask_keys"][1]))
        client._peer_keys = {int(v): (unb(c), unb(m)) for v, (c, m) in d["peer_keys"].items()}
        client._peer_ids = {int(v): str(i) for v, i in d.get("peer_ids", {}).items()}
        client._self_seed = unb(d["self_seed"])
        client._seed_shares = {int(u): unb(s) for u, s in d["seed_shares"].items()}
        client._key_shares = {int(u): unb(s) for u, s in d["key_shares"].items()}
        client._masked_with = tuple(int(v) for v in d["masked_with"])
        signed = d.get("signed_survivors")
        client._signed_survivors = None if signed is None else tuple(int(u) for u in signed)
        return client

    @property
    def stage(self) -> int:
        return self._stage

    def _advance(self, stage: int, after: int | None = None) -> None:
        if self._stage != (stage - 1 if after is None else after):
            raise SecureSumRefused(f"client {self.node}: stage {stage} requested after stage {self._stage}")
        self._stage = stage

    def advertise_keys(self) -> dict:
        self._advance(1)
        self._channel, self._mask_keys = MK.new_key_pair(), MK.new_key_pair()
        reply = {"channel_key": self._channel.public, "mask_key": self._mask_keys.public}
        if self.signed:
            reply["identity"] = self.identity.public
            reply["signature"] = self.identity.sign(advertise_message(self.config, self.node, self._channel.public,
                                                                      self._mask_keys.public))
        return reply

    def _check_signed_peers(self, peer_keys: dict) -> dict[int, str]:
        """Signed mode: every peer's keys signed, for this sum and this node id, by a distinct trusted
        silo other than this one. Returns {peer: identity}; refuses otherwise."""
        ids: dict[int, str] = {}
        for v, entry in peer_keys.items():
            if not (isinstance(entry, (list, tuple)) and len(entry) == 4):
                raise SecureSumRefused(f"client {self.node}: the keys of node {v} carry no signature")
            channel, mask_key, identity, signature = entry
            identity = str(identity)
            if identity not in self.trusted:
                raise SecureSumRefused(f"client {self.node}: the keys of node {v} are signed by a key this silo does "
                                       "not trust (not in its secagg-peers)")
            if not self.trusted.verify(identity, advertise_message(self.config, int(v), bytes(channel), bytes(mask_key)),
                                       bytes(signature)):
                raise SecureSumRefused(f"client {self.node}: the signature on the keys of node {v} does not verify "
                                       "(keys substituted, or signed for another sum)")
            ids[int(v)] = " ".join(identity.split()[:2])
        own = " ".join(self.identity.public.split()[:2])
        everyone = list(ids.values()) + [own]
        if len(set(everyone)) != len(everyone):
            raise SecureSumRefused(f"client {self.node}: one silo's identity signs the keys of two nodes of the sum")
        return ids

    def share_keys(self, peer_keys: dict) -> dict:
        """``peer_keys``: (channel key, mask key) of this client's neighbours that advertised keys, each
        followed by (identity, signature) in the signed protocol."""
        self._advance(2)
        t = self.config.threshold
        if not set(int(v) for v in peer_keys) <= set(self.neighbours):
            raise SecureSumRefused(f"client {self.node}: keys of non-neighbours "
                                   f"{sorted(set(int(v) for v in peer_keys) - set(self.neighbours))}")
        if self.signed:
            self._peer_ids = self._check_signed_peers(peer_keys)
        peers = {int(v): (bytes(e[0]), bytes(e[1])) for v, e in peer_keys.items()}
        if len(peers) + 1 < t:
            raise SecureSumRefused(f"client {self.node}: {len(peers)} neighbours + itself hold its shares, fewer than "
                                   f"the threshold {t}")
        everyone = [k for pair in peers.values() for k in pair] + [self._channel.public, self._mask_keys.public]
        if len(set(everyone)) != len(everyone):
            raise SecureSumRefused(f"client {self.node}: two advertised public keys are identical")
        self._peer_keys = peers
        self._self_seed = os.urandom(MK.SEED_BYTES)
        holders = sorted(peers) + [self.node]
        seed_shares = MK.share_secret(self._self_seed, t, len(holders))
        key_shares = MK.share_secret(self._mask_keys.secret, t, len(holders))
        sealed = {}
        for holder, s_share, k_share in zip(holders, seed_shares, key_shares):
            if holder == self.node:
                self._seed_shares[self.node], self._key_shares[self.node] = s_share, k_share
            else:
                key = MK.agreed_channel_key(self._channel.secret, peers[holder][0])
                sealed[holder] = MK.seal_shares(key, self.node, holder, s_share, k_share)
        return {"sealed_shares": sealed}

    def masked_input(self, sealed_for_me: dict[int, bytes], vector: np.ndarray) -> dict:
        """``sealed_for_me``: the shares each neighbour that finished stage 2 sealed for this client;
        ``vector``: this client's input, residues mod 2^bits of length ``size``."""
        self._advance(3)
        cfg = self.config
        x = np.asarray(vector)
        if x.shape != (cfg.size,) or x.dtype.kind not in "iu":
            raise ValueError(f"client {self.node}: input must be {cfg.size} integers, got {x.dtype} {x.shape}")
        x = x.astype(np.int64)
        if x.min(initial=0) < 0 or x.max(initial=0) >= (1 << cfg.bits):
            raise ValueError(f"client {self.node}: input residues must lie in [0, 2^{cfg.bits})")
        sources = {int(v) for v in sealed_for_me}
        if not sources <= set(self._peer_keys):
            raise SecureSumRefused(f"client {self.node}: shares from clients it has no keys of")
        if len(sources) + 1 < cfg.threshold:
            raise SecureSumRefused(f"client {self.node}: only {len(sources)} neighbours shared keys, fewer than "
                                   f"the threshold {cfg.threshold} less itself")
        for src, ct in sealed_for_me.items():
            key = MK.agreed_channel_key(self._channel.secret, self._peer_keys[int(src)][0])
            self._seed_shares[int(src)], self._key_shares[int(src)] = MK.open_shares(key, ct, int(src), self.node)
        y = add_mod(x, MK.mask(self._self_seed, cfg.size, cfg.bits, b"self"), cfg.bits)
        for v in sorted(sources):
            pairwise = MK.mask(MK.agreed_seed(self._mask_keys.secret, self._peer_keys[v][1]), cfg.size, cfg.bits, b"pair")
            y = add_mod(y, pairwise, cfg.bits) if self.node > v else sub_mod(y, pairwise, cfg.bits)
        self._masked_with = tuple(sorted(sources))
        self._self_seed = b""  # only its shares remain
        return {"masked": y}

    def _check_survivors(self, survivors) -> set[int]:
        """The survivor set U3 a client accepts: ids of the cohort, itself among them, no neighbour that
        never sent it shares (so never masked with it), and at least t of its own share holders.
        Returns U3 restricted to this client's holders (the only ones it holds shares of)."""
        alive = {int(v) for v in survivors}
        t = self.config.threshold
        if not alive <= set(self.config.nodes):
            raise SecureSumRefused(f"client {self.node}: survivors {sorted(alive - set(self.config.nodes))} are not "
                                   "in the sum's cohort")
        if self.node not in alive:
            raise SecureSumRefused(f"client {self.node}: asked to unmask but not named a survivor")
        strangers = (alive & set(self.neighbours)) - set(self._masked_with)
        if strangers:
            raise SecureSumRefused(f"client {self.node}: survivors {sorted(strangers)} never sent it shares")
        local = alive & (set(self._masked_with) | {self.node})
        if len(local) < t:
            raise SecureSumRefused(f"client {self.node}: {len(local)} of its share holders survive, fewer than the "
                                   f"threshold {t}")
        return alive

    def consistency(self, survivors: list[int]) -> dict:
        """Signed protocol only: sign the survivor set this client was sent (once per sum)."""
        if not self.signed:
            raise SecureSumRefused(f"client {self.node}: a consistency stage in a sum it joined unsigned")
        self._advance(4)
        alive = self._check_survivors(survivors)
        self._signed_survivors = tuple(sorted(alive))
        return {"signature": self.identity.sign(survivors_message(self.config, alive))}

    def unmask(self, survivors: list[int], dropped: list[int] | None = None, signatures: dict | None = None) -> dict:
        """Shares of b_u for the survivors and of the mask key for the dropped, of the clients whose
        shares this client holds; refuses an inconsistent request or a second one. The dropped set is
        the client's own: its neighbours that sent it shares and are not survivors. In the signed
        protocol ``signatures`` must hold t valid signatures of this same survivor set."""
        if self.signed:
            self._advance(5, after=4)
        else:
            self._advance(4)
        alive = {int(v) for v in survivors}
        if dropped is not None and alive & {int(v) for v in dropped}:
            raise SecureSumRefused(f"client {self.node}: clients {sorted(alive & {int(v) for v in dropped})} named "
                                   "both survivor and dropped")
        alive = self._check_survivors(alive)
        gone = set(self._masked_with) - alive
        if dropped is not None and {int(v) for v in dropped} & set(self._masked_with) != gone:
            raise SecureSumRefused(f"client {self.node}: the dropped set it was sent is not its neighbours less the "
                                   "survivors")
        if self.signed:
            if self._signed_survivors != tuple(sorted(alive)):
                raise SecureSumRefused(f"client {self.node}: the survivor set to unmask differs from the one it signed")
            message = survivors_message(self.config, alive)
            valid = set()
            for u, sig in (signatures or {}).items():
                u = int(u)
                if u not in alive or not isinstance(sig, (bytes, bytearray)):
                    continue
                if u == self.node:
                    ok = verify_own(self.identity, message, bytes(sig))
                else:
                    ok = u in self._peer_ids and self.trusted.verify(self._peer_ids[u], message, bytes(sig))
                if ok:
                    valid.add(u)
            if len(valid) < self.config.threshold:
                raise SecureSumRefused(f"client {self.node}: {len(valid)} valid signatures of the survivor set, fewer "
                                       f"than the threshold {self.config.threshold}")
        held = set(self._seed_shares)
        return {"seed_shares": {u: self._seed_shares[u] for u in sorted(alive & held)},
                "key_shares": {u: self._key_shares[u] for u in sorted(gone & held)}}


# -- the server ------------------------------------------------------------------------------------
@dataclass
class Recorder:
    """Every message the server receives, as (stage, sender, payload), and its size in bytes."""

    received: list = field(default_factory=list)

    def record(self, stage: str, sender: int, payload: dict) -> None:
        self.received.append((stage, int(sender), payload))

    def bytes_from(self, sender: int) -> int:
        return sum(_nbytes(p) for _, s, p in self.received if s == sender)


def _nbytes(obj) -> int:
    if isinstance(obj, (bytes, bytearray)):
        return len(obj)
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 8


class SecureSumServer:
    """The server's side of one round: routes keys and shares, sums masked inputs, unmasks."""

    def __init__(self, config: SecureSumConfig, recorder: Recorder | None = None) -> None:
        self.config = config
        self.graph = config.graph()
        self.recorder = recorder
        self.keys: dict[int, tuple[bytes, bytes]] = {}
        self.sealed: dict[int, dict[int, bytes]] = {}
        self.masked: dict[int, np.ndarray] = {}
        self.signed = False
        self.identities: dict[int, tuple[str, bytes]] = {}
        self.signatures: dict[int, bytes] = {}

    def _record(self, stage, node, payload):
        if self.recorder is not None:
            self.recorder.record(stage, node, payload)

    def _need(self, count: int, what: str) -> None:
        if count < self.config.threshold:
            raise SecureSumRefused(f"{count} clients {what}, fewer than the threshold t = {self.config.threshold} "
                                   f"(at most n - t = {self.config.max_dropouts} of {len(self.config.nodes)} may drop)")

    def receive_keys(self, replies: dict[int, dict]) -> dict[int, dict[int, tuple]]:
        """Stage 1 replies -> each answering client's neighbours' keys (stage 2 requests). When the
        clients sign their keys (the signed protocol), each key pair travels with its identity and
        signature, and an unsigned reply counts as a dropout."""
        self.signed = any(isinstance(r, dict) and "signature" in r for r in replies.values())
        for u, r in replies.items():
            self._record("advertise_keys", u, r)
            if int(u) not in self.graph:
                raise SecureSumRefused(f"keys from node {u}, not in the cohort")
            if self.signed and not ("signature" in r and "identity" in r):
                continue
            self.keys[int(u)] = (bytes(r["channel_key"]), bytes(r["mask_key"]))
            if self.signed:
                self.identities[int(u)] = (str(r["identity"]), bytes(r["signature"]))
        self._need(len(self.keys), "advertised keys")
        return {u: {v: self.keys[v] + self.identities.get(v, ()) for v in self.graph[u] if v in self.keys}
                for u in self.keys}

    def receive_shares(self, replies: dict[int, dict]) -> dict[int, dict[int, bytes]]:
        """Stage 2 replies -> the sealed shares addressed to each client (stage 3 requests)."""
        for u, r in replies.items():
            self._record("share_keys", u, r)
            u = int(u)
            if u not in self.keys:
                raise SecureSumRefused(f"shares from node {u}, which advertised no keys")
            dsts = {int(v) for v in r["sealed_shares"]}
            expected = {v for v in self.graph[u] if v in self.keys}
            if dsts != expected:
                raise SecureSumRefused(f"node {u} sealed shares for {sorted(dsts)}, expected its neighbours {sorted(expected)}")
            self.sealed[u] = {int(v): bytes(c) for v, c in r["sealed_shares"].items()}
        self._need(len(self.sealed), "shared keys")
        return {v: {u: self.sealed[u][v] for u in self.sealed if v in self.sealed[u]} for v in self.sealed}

    def receive_masked(self, replies: dict[int, dict]) -> dict[int, dict]:
        """Stage 3 replies -> the unmask request to every survivor (stage 4 requests)."""
        cfg = self.config
        for u, r in replies.items():
            self._record("masked_input", u, r)
            u = int(u)
            if u not in self.sealed:
                raise SecureSumRefused(f"a masked input from node {u}, which shared no keys")
            y = np.asarray(r["masked"])
            if y.shape != (cfg.size,) or y.dtype != np.int64 or y.min() < 0 or y.max() >= (1 << cfg.bits):
                raise SecureSumRefused(f"node {u}'s masked input is not {cfg.size} residues mod 2^{cfg.bits}")
            self.masked[u] = y
        self._need(len(self.masked), "sent masked inputs")
        survivors = sorted(self.masked)
        if self.signed:  # the consistency stage: every survivor signs the survivor set
            return {u: {"survivors": survivors} for u in survivors}
        dropped = sorted(set(self.sealed) - set(self.masked))
        return {u: {"survivors": survivors, "dropped": dropped} for u in survivors}

    def receive_consistency(self, replies: dict[int, dict]) -> dict[int, dict]:
        """Signed protocol, consistency stage replies -> the unmask requests, which carry every
        survivor's signature of the survivor set."""
        for u, r in replies.items():
            self._record("consistency", u, r)
            if int(u) not in self.masked:
                raise SecureSumRefused(f"a signature of the survivor set from node {u}, not a survivor")
            self.signatures[int(u)] = bytes(r["signature"])
        self._need(len(self.signatures), "signed the survivor set")
        survivors = sorted(self.masked)
        dropped = sorted(set(self.sealed) - set(self.masked))
        return {u: {"survivors": survivors, "dropped": dropped, "signatures": dict(self.signatures)}
                for u in sorted(self.signatures)}

    def unmask(self, replies: dict[int, dict]) -> tuple[np.ndarray, list[int]]:
        """Stage 4 replies -> (the sum of the survivors' inputs mod 2^bits, the survivors)."""
        cfg = self.config
        survivors, dropped = sorted(self.masked), sorted(set(self.sealed) - set(self.masked))
        seed_shares = {u: [] for u in survivors}
        key_shares = {v: [] for v in dropped}
        for h, r in replies.items():
            self._record("unmask", h, r)
            h = int(h)
            if h not in self.masked:
                raise SecureSumRefused(f"unmask shares from node {h}, not a survivor")
            for u, s in r.get("seed_shares", {}).items():
                if int(u) in seed_shares and (h == int(u) or h in self.graph[int(u)]):
                    seed_shares[int(u)].append(bytes(s))
            for v, s in r.get("key_shares", {}).items():
                if int(v) in key_shares and h in self.graph[int(v)]:
                    key_shares[int(v)].append(bytes(s))
        self._need(len(replies), "answered the unmask stage")
        t = cfg.threshold
        total = np.zeros(cfg.size, dtype=np.int64)
        for u in survivors:
            if len(seed_shares[u]) < t:
                raise SecureSumRefused(f"client {u}'s self-mask seed has {len(seed_shares[u])} shares, the threshold is "
                                       f"{t}: too many of its holders dropped")
            b_u = MK.combine_secret(seed_shares[u][:t])
            total = add_mod(total, sub_mod(self.masked[u], MK.mask(b_u, cfg.size, cfg.bits, b"self"), cfg.bits), cfg.bits)
        for v in dropped:
            partners = [u for u in self.graph[v] if u in self.masked]
            if not partners:
                continue
            if len(key_shares[v]) < t:
                raise SecureSumRefused(f"dropped client {v}'s mask key has {len(key_shares[v])} shares, the threshold "
                                       f"is {t}: its pairwise masks cannot be removed")
            sk_v = MK.combine_secret(key_shares[v][:t])
            for u in partners:
                pairwise = MK.mask(MK.agreed_seed(sk_v, self.keys[u][1]), cfg.size, cfg.bits, b"pair")
                # u added +PRG(s_uv) if u > v, -PRG(s_uv) if u < v: remove it
                total = sub_mod(total, pairwise, cfg.bits) if u > v else add_mod(total, pairwise, cfg.bits)
        return total, survivors


# -- an in-process run -----------------------------------------------------------------------------
STAGES = ("advertise_keys", "share_keys", "masked_input", "consistency", "unmask")


def simulate(config: SecureSumConfig, inputs: dict[int, np.ndarray], *, drop: dict[int, str] | None = None,
             recorder: Recorder | None = None, identities: dict | None = None, trusted=None
             ) -> tuple[np.ndarray, list[int]]:
    """One secure-sum round in-process. ``drop[node] = stage`` makes that client vanish before
    answering that stage (one of ``STAGES``). ``identities`` ({node: SiloIdentity}) and ``trusted``
    run the signed protocol. Returns the server's (sum mod 2^bits, survivors)."""
    drop = dict(drop or {})
    for node, stage in drop.items():
        if stage not in STAGES:
            raise ValueError(f"drop stage must be one of {STAGES}, got {stage!r}")
    if set(inputs) != set(config.nodes):
        raise ValueError("one input per node of the cohort")
    clients = {u: SecureSumClient(u, config, identity=(identities or {}).get(u),
                                  trusted=trusted if identities else None) for u in config.nodes}
    server = SecureSumServer(config, recorder)

    def alive(stage, nodes):
        return [u for u in nodes if drop.get(u) not in STAGES[: STAGES.index(stage) + 1]]

    keys = server.receive_keys({u: clients[u].advertise_keys() for u in alive("advertise_keys", clients)})
    sealed = server.receive_shares({u: clients[u].share_keys(keys[u]) for u in alive("share_keys", keys)})
    requests = server.receive_masked({u: clients[u].masked_input(sealed[u], inputs[u])
                                      for u in alive("masked_input", sealed)})
    if server.signed:
        requests = server.receive_consistency({u: clients[u].consistency(**requests[u])
                                               for u in alive("consistency", requests)})
    return server.unmask({u: clients[u].unmask(**requests[u]) for u in alive("unmask", requests)})
