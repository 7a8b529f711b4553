"""One secure sum over any transport: the server's driver and the client's step, Flower-free.

``protocol`` has the SecAgg+ client and server as objects. Here they meet a transport:

* the server's :func:`run_secure_sum` sends each stage's requests through ``transport(stage,
  requests) -> replies`` (a Flower adapter carries them in messages: ``strategies/secure_rounds.py``;
  tests carry them in-process), drops a malformed reply with its reason (a dropout), and returns the
  decoded sum of the survivors' vectors, or raises ``SecureSumRefused`` with the reason;
* the client's :func:`client_step` answers one stage, keeping its secrets between stages in a JSON
  string the caller stores (a ClientApp keeps it in its ``Context.state``), and calls
  ``input_fn(request)`` for its float vector at the masked-input stage.

Payloads are plain dicts of ints, bytes, lists, dicts and numpy arrays; :func:`encode` and
:func:`decode` turn one into a JSON string plus named arrays, what a message can carry.

Every vector carries one more coordinate, the client's fraction of clamped coordinates (see
``contributions``): the server learns only the sum over the survivors.
"""

from __future__ import annotations

import base64
import json
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .field import FieldQuantizer, check_bits
from .protocol import STAGES, SecureSumClient, SecureSumConfig, SecureSumRefused, SecureSumServer


@dataclass(frozen=True)
class SecureAggregation:
    """The run's secure-aggregation settings (``secagg.*`` config keys)."""

    threshold: float = 0.6    # fraction of a client's share holders needed to rebuild its secrets
    bits: int = 32            # the ring Z_{2^bits}
    clip_range: float = 4.0   # every coordinate is clamped to [-r, r] before quantization
    degree: int = 0           # neighbours per client (SecAgg+); 0: the complete graph
    dropout_rate: float = 0.1  # the dropout rate a sparse graph is sized for
    colluders: int = 0        # silos that may collude with the server (the minimum degree and the statement)

    def __post_init__(self):
        check_bits(self.bits)
        if not (isinstance(self.threshold, (int, float)) and 0.5 < float(self.threshold) <= 1.0):
            raise ValueError(f"secagg threshold must be a fraction in (0.5, 1], got {self.threshold!r}")
        if not (math.isfinite(self.clip_range) and self.clip_range > 0):
            raise ValueError(f"secagg clip range must be a finite number > 0, got {self.clip_range!r}")
        if not (isinstance(self.degree, int) and (self.degree == 0 or (self.degree >= 2 and self.degree % 2 == 0))):
            raise ValueError(f"secagg degree must be 0 (complete graph) or an even integer >= 2, got {self.degree!r}")

    @classmethod
    def from_config(cls, cfg) -> "SecureAggregation | None":
        """The settings of a run config, or None when ``secagg.enabled`` is false."""
        if not cfg["secagg.enabled"]:
            return None
        return cls(threshold=float(cfg["secagg.threshold"]), bits=int(cfg["secagg.quantization-bits"]),
                   clip_range=float(cfg["secagg.clip-range"]), degree=int(cfg["secagg.degree"]),
                   dropout_rate=float(cfg["secagg.dropout-rate"]), colluders=int(cfg["secagg.colluders"]))

    def config_for(self, nodes: list[int], size: int, graph_seed: bytes, *, label: str = "") -> SecureSumConfig:
        """One sum's public parameters for a cohort: t = max(majority, ceil(threshold x holders)).
        A sparse graph below the minimum degree for the cohort (:func:`minimum_degree`) is refused."""
        n = len(nodes)
        degree = self.degree if 0 < self.degree < n - 1 else 0
        if degree:
            need, _ = minimum_degree(n, self.threshold, self.dropout_rate, self.colluders)
            if need == 0 or degree < need:
                raise ValueError(f"secagg.degree = {degree} is below the minimum degree for {n} silos at dropout rate "
                                 f"{self.dropout_rate:g} and {self.colluders} colluder(s) "
                                 + (f"({need})" if need else "(no sparse graph is safe: use 0, the complete graph)"))
        holders = (degree if degree else n - 1) + 1
        return SecureSumConfig(nodes=tuple(nodes), size=size + 1, bits=self.bits,
                               threshold=threshold_for(holders, self.threshold),
                               degree=degree, graph_seed=graph_seed, label=label)

    def quantizer(self, num_clients: int) -> FieldQuantizer:
        return FieldQuantizer(self.bits, float(self.clip_range), num_clients)

    def describe(self, num_silos: int) -> dict:
        """What a run's secure aggregation does and assumes (results.json, the start log)."""
        nodes = list(range(1, max(2, num_silos) + 1))
        cfg = self.config_for(nodes, 1, b"")
        holders = cfg.effective_degree + 1
        n = len(nodes)
        if cfg.effective_degree < n - 1:
            _, failure = minimum_degree(n, self.threshold, self.dropout_rate, self.colluders, degree=cfg.effective_degree)
            graph = (f"a sparse graph of degree {cfg.effective_degree}: probabilistic, it fails with probability at most "
                     f"{failure:.1e} per sum (union bound over the silos, at dropout rate {self.dropout_rate:g} and "
                     f"{self.colluders} colluder(s)); semi-honest server only")
            malicious = "a sparse graph is for a semi-honest server only"
        else:
            failure = 0.0
            graph = "the complete graph (every pair of silos masks)"
            malicious = ("against a server that deviates from the protocol it holds for silos that sign their keys "
                         "(node config silo-signing-key and secagg-peers: signed keys, a signed survivor set, "
                         "one sum per round, kind and index over one set of silos); silos without signing keys "
                         "are protected from a semi-honest server only")
        return {
            "protocol": "SecAgg+ (Bell et al. 2020) on Flower's Message API, with SecAgg's signed consistency "
                        "round when the silos sign (Bonawitz et al. 2017)",
            "threshold": cfg.threshold, "share_holders": holders, "max_dropouts": holders - cfg.threshold,
            "quantization_bits": self.bits, "clip_range": self.clip_range, "degree": cfg.effective_degree,
            "graph_failure_probability": failure,
            "error_bound_per_coordinate": self.error_bound(len(nodes)),
            "statement": (f"the server sees only sums over each round's silos, never one silo's reply; it holds "
                          f"if the server colludes with at most {cfg.threshold - 1} silos "
                          f"(t - 1, t = {cfg.threshold} of each silo's {holders} share holders), with {graph}; "
                          f"{malicious}; a round survives up to {holders - cfg.threshold} dropouts and is refused "
                          f"past them"),
        }

    def error_bound(self, num_clients: int) -> float:
        """The most the decoded sum of the cohort's vectors differs from the float sum, per coordinate."""
        return self.quantizer(num_clients).error_bound()


def threshold_for(holders: int, fraction: float) -> int:
    """t for ``holders`` share holders: a strict majority, at least ``fraction`` of them."""
    return min(holders, max(holders // 2 + 1, math.ceil(fraction * holders - 1e-9)))


#: The failure probability a sparse graph must stay under, per sum.
GRAPH_FAILURE = 2.0 ** -20


def minimum_degree(n: int, threshold: float, dropout_rate: float, colluders: int, *,
                   degree: int | None = None, failure: float = GRAPH_FAILURE) -> tuple[int, float]:
    """The smallest even degree k < n - 1 of a random k-regular neighbour graph over n silos whose
    failure probability per sum is at most ``failure``, and that probability; (0, p) when none is
    (the complete graph is needed). With ``degree``, the probability at that degree instead.

    A sum over a random graph fails if, for some honest silo u (a union bound over the n silos):
    at least t of its k neighbours collude with the server (they and the server would rebuild both
    of u's secrets); more than k + 1 - t of its holders drop (u's secrets are lost); or all of its
    neighbours collude or drop (its input is left alone in the sum: a real dropout and one colluder
    expose a survivor at degree 2). Neighbours are a uniform k-subset of the other n - 1 silos, so
    each count is hypergeometric, with ceil(dropout_rate n) dropped and ``colluders`` colluding."""
    from scipy.stats import hypergeom

    dropped = math.ceil(dropout_rate * n - 1e-9)

    def probability(k: int) -> float:
        t = threshold_for(k + 1, threshold)
        others = n - 1
        p_collude = hypergeom.sf(t - 1, others, min(colluders, others), k)
        p_lost = hypergeom.sf(k + 1 - t, others, min(dropped, others), k)
        p_alone = hypergeom.pmf(k, others, min(colluders + dropped, others), k)
        return float(min(1.0, n * (p_collude + p_lost + p_alone)))

    if degree is not None:
        return int(degree), probability(int(degree))
    best = 1.0
    for k in range(2, n - 1, 2):
        best = probability(k)
        if best <= failure:
            return k, best
    return 0, best


# -- payloads <-> a JSON string and named arrays ------------------------------------------------------
def encode(payload) -> tuple[str, dict[str, np.ndarray]]:
    arrays: dict[str, np.ndarray] = {}

    def enc(obj, path):
        if isinstance(obj, np.ndarray):
            arrays[path] = obj
            return {"__array__": path}
        if isinstance(obj, (bytes, bytearray)):
            return {"__b64__": base64.b64encode(bytes(obj)).decode()}
        if isinstance(obj, dict):
            return {str(k): enc(v, f"{path}/{k}") for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [enc(v, f"{path}/{i}") for i, v in enumerate(obj)]
        if isinstance(obj, (np.integer,)):
            return int(obj)
        if isinstance(obj, (np.floating,)):
            return float(obj)
        return obj

    return json.dumps(enc(payload, "")), arrays


def decode(text: str, arrays: dict[str, np.ndarray]):
    def dec(obj):
        if isinstance(obj, dict):
            if set(obj) == {"__array__"}:
                return arrays[obj["__array__"]]
            if set(obj) == {"__b64__"}:
                return base64.b64decode(obj["__b64__"])
            return {(int(k) if k.lstrip("-").isdigit() else k): dec(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [dec(v) for v in obj]
        return obj

    return dec(json.loads(text))


# -- the server's driver -------------------------------------------------------------------------------
Transport = Callable[[str, dict], dict]  # (stage, {node: request}) -> {node: reply or an Exception}


@dataclass
class SumOutcome:
    total: np.ndarray            # the decoded float sum of the survivors' vectors (clamp coordinate removed)
    survivors: list[int]
    clamped: float               # the survivors' clamped fractions, summed
    message_rounds: int
    bytes_up: int = 0            # what the clients sent, all stages together
    dropped: list[dict] = field(default_factory=list)  # {"node", "stage", "reason"}
    seconds: float = 0.0


def _payload_bytes(obj) -> int:
    from .protocol import _nbytes

    return _nbytes(obj)


def _valid(stage: str, reply, server: SecureSumServer, node: int) -> str | None:
    """Why a reply is unusable at ``stage`` (None: usable). Checked before the server reads it."""
    if isinstance(reply, Exception):
        return f"error reply: {reply}"
    if not isinstance(reply, dict):
        return "reply is not a payload"
    cfg = server.config
    try:
        if stage == "advertise_keys":
            if not (isinstance(reply.get("channel_key"), bytes) and isinstance(reply.get("mask_key"), bytes)):
                return "no public keys"
        elif stage == "share_keys":
            sealed = reply.get("sealed_shares")
            expected = {v for v in server.graph[node] if v in server.keys}
            if not isinstance(sealed, dict) or {int(v) for v in sealed} != expected:
                return "sealed shares not addressed to exactly its neighbours"
            if not all(isinstance(c, bytes) for c in sealed.values()):
                return "sealed shares are not bytes"
        elif stage == "masked_input":
            y = reply.get("masked")
            if isinstance(y, np.ndarray) and y.dtype == np.uint32 and cfg.bits <= 32:
                y = reply["masked"] = y.astype(np.int64)
            if not (isinstance(y, np.ndarray) and y.shape == (cfg.size,) and y.dtype == np.int64
                    and (y.size == 0 or (y.min() >= 0 and y.max() < (1 << cfg.bits)))):
                return f"masked input is not {cfg.size} residues mod 2^{cfg.bits}"
        elif stage == "consistency":
            if not isinstance(reply.get("signature"), bytes):
                return "no signature of the survivor set"
        elif stage == "unmask":
            for key in ("seed_shares", "key_shares"):
                part = reply.get(key, {})
                if not isinstance(part, dict) or not all(isinstance(s, bytes) for s in part.values()):
                    return f"{key} malformed"
    except Exception as exc:  # a reply that breaks the checks themselves
        return f"malformed reply: {exc!r}"
    return None


def noise_mechanism(config: SecureSumConfig, noise: dict):
    """The distributed discrete Gaussian of a sum whose public config carries noise parameters."""
    from .distributed_dp import DistributedDiscreteGaussian

    try:
        return DistributedDiscreteGaussian(float(noise["clip"]), float(noise["scale"]), float(noise["local-std"]),
                                           config.size, config.bits, len(config.nodes),
                                           min(int(noise["contributors"]), len(config.nodes)))
    except (KeyError, TypeError) as exc:
        raise ValueError(f"malformed noise parameters: {exc!r}") from None


def run_secure_sum(transport: Transport, config: SecureSumConfig, quantizer: FieldQuantizer, *,
                   masked_input_extra: dict | None = None, advertised: dict | None = None,
                   recorder=None, noise: dict | None = None, all_or_nothing: bool = False) -> SumOutcome:
    """One secure sum over ``transport``. ``advertised``: stage-1 replies already in hand (the train
    replies carry them); ``masked_input_extra``: what every client needs for its vector (the input
    kind, the server's basis), sent with the masked-input request. ``all_or_nothing``: a later sum of a
    round, which every silo of its cohort must answer (the silos refuse a smaller survivor set, so the
    server stops at the first dropout). Raises ``SecureSumRefused``."""
    t0 = time.perf_counter()
    server = SecureSumServer(config, recorder)
    dropped: list[dict] = []
    rounds = 0
    bytes_up = 0
    public = {**config.to_dict(), "clip-range": float(quantizer.clip_range)}
    if noise is not None:
        public["noise"] = dict(noise)

    def collect(stage, replies):
        nonlocal bytes_up
        good = {}
        for node, reply in replies.items():
            size = _payload_bytes(reply) if isinstance(reply, dict) else 0  # as sent, before any widening
            reason = _valid(stage, reply, server, int(node))
            if reason is None:
                good[int(node)] = reply
                bytes_up += size
            else:
                dropped.append({"node": int(node), "stage": stage, "reason": reason})
        return good

    def ask(stage, requests):
        nonlocal rounds
        rounds += 1
        good = collect(stage, transport(stage, {u: {"stage": stage, "config": public, **r} for u, r in requests.items()}))
        if all_or_nothing and set(good) != set(requests):
            raise SecureSumRefused(f"a later secure sum of the round lost silos {sorted(set(requests) - set(good))} at "
                                   f"{stage}: every sum of a round runs over the first sum's survivors, so the round is "
                                   "refused")
        return good

    try:
        if advertised is None:
            advertised = ask("advertise_keys", {u: {} for u in config.nodes})
        else:
            advertised = collect("advertise_keys", {u: r for u, r in advertised.items() if u in config.nodes})
        peer_keys = server.receive_keys(advertised)
        sealed = server.receive_shares(ask("share_keys", {u: {"peer_keys": peer_keys[u]} for u in peer_keys}))
        extra = dict(masked_input_extra or {})
        requests = server.receive_masked(ask("masked_input", {u: {"sealed": sealed[u], **extra} for u in sealed}))
        if server.signed:  # the signed protocol's consistency stage
            requests = server.receive_consistency(ask("consistency", requests))
        total, survivors = server.unmask(ask("unmask", requests))
    except SecureSumRefused as exc:  # the dropouts that led to it travel with the refusal
        exc.dropped = dropped
        raise
    if noise is not None:  # the last coordinate carries noise, not a count
        decoded = noise_mechanism(config, noise).decode_sum(total)
        decoded[-1] = 0.0
    else:
        decoded = quantizer.decode_sum(total, len(survivors))
    return SumOutcome(total=decoded[:-1], survivors=survivors, clamped=float(decoded[-1]), message_rounds=rounds,
                      bytes_up=bytes_up, dropped=dropped, seconds=time.perf_counter() - t0)


def direct_sum(config: SecureSumConfig, quantizer: FieldQuantizer, vectors: dict, *, noise: dict | None = None
               ) -> SumOutcome:
    """What a secure sum releases, without the protocol: each client's vector encoded exactly as
    ``client_step`` encodes it (noise share included), summed mod M and decoded. The masks cancel
    exactly in the protocol (tests/test_secure_sum.py), so this is the same release, for audits of
    the mechanism over thousands of clients."""
    total = np.zeros(config.size, dtype=np.int64)
    for node in config.nodes:
        x = np.asarray(vectors[node], dtype=np.float64).ravel()
        if noise is not None:
            residues = noise_mechanism(config, noise).encode(np.concatenate([x, [0.0]]))
        else:
            clamped = float(np.count_nonzero(np.abs(x) > quantizer.clip_range)) / max(1, x.size)
            residues, _ = quantizer.encode(np.concatenate([x, [clamped]]))
        total = (total + residues) & ((1 << config.bits) - 1)
    if noise is not None:
        decoded = noise_mechanism(config, noise).decode_sum(total)
        decoded[-1] = 0.0
    else:
        decoded = quantizer.decode_sum(total, len(config.nodes))
    return SumOutcome(total=decoded[:-1], survivors=list(config.nodes), clamped=float(decoded[-1]), message_rounds=0)


# -- the client's step ---------------------------------------------------------------------------------
class SumGuard:
    """What one client allows across the secure sums of its current trained round (the client keeps
    it between messages as JSON). Against a server that deviates:

    * a sum is named ``"<round>/<kind>/<index>"`` (``SecureSumConfig.label``); the client joins a name
      once, and only of the round it trained for (no replayed request, no second sum over the same
      trained state under the same name, no sums restarted until a graph suits the server);
    * every sum of a round after the first runs over exactly the first sum's survivors, at its
      threshold, and its survivor set must be that same set: all that a round releases is then a
      function of one sum over one set of silos (two sums over different cohorts could be subtracted).
    """

    def __init__(self, round: int | None = None, joined=(), cohort=None, threshold=None, survivors=None) -> None:
        self.round, self.joined = round, list(joined)
        self.cohort = None if cohort is None else sorted(int(u) for u in cohort)
        self.threshold = threshold
        self.survivors = None if survivors is None else sorted(int(u) for u in survivors)

    def start_round(self, server_round: int) -> None:
        """The client trained for ``server_round``: sums of earlier rounds are over."""
        self.__init__(int(server_round))

    def join(self, config: SecureSumConfig) -> None:
        parts = str(config.label).split("/")
        if len(parts) != 3 or not parts[0].isdigit():
            raise SecureSumRefused(f"a secure sum without a name '<round>/<kind>/<index>' (got {config.label!r})")
        if self.round is None or int(parts[0]) != self.round:
            raise SecureSumRefused(f"secure sum {config.label} is not of the round this client trained for "
                                   f"({self.round})")
        if config.label in self.joined:
            raise SecureSumRefused(f"secure sum {config.label} was already joined: one sum per name over one "
                                   "trained state")
        if self.cohort is None:
            self.cohort, self.threshold = sorted(config.nodes), int(config.threshold)
        else:
            if self.survivors is None:
                raise SecureSumRefused(f"secure sum {config.label} starts before the round's first sum ended")
            if sorted(config.nodes) != self.survivors or int(config.threshold) != self.threshold:
                raise SecureSumRefused(f"secure sum {config.label} runs over silos {sorted(config.nodes)} at t = "
                                       f"{config.threshold}; every later sum of a round runs over the first sum's "
                                       f"survivors {self.survivors} at t = {self.threshold}")
        self.joined.append(config.label)

    def unmask(self, survivors, *, record: bool = True) -> None:
        alive = sorted(int(u) for u in survivors)
        if self.survivors is None:
            if record:
                self.survivors = alive
        elif alive != self.survivors:
            raise SecureSumRefused(f"a later sum of the round names survivors {alive}, not the round's {self.survivors}: "
                                   "a sum with fewer survivors is refused")

    def to_json(self) -> str:
        return json.dumps({"round": self.round, "joined": self.joined, "cohort": self.cohort,
                           "threshold": self.threshold, "survivors": self.survivors})

    @classmethod
    def from_json(cls, text: str | None) -> "SumGuard":
        if not text:
            return cls()
        d = json.loads(text)
        return cls(d["round"], d["joined"], d["cohort"], d["threshold"], d["survivors"])


def client_step(node: int, request: dict, saved: str | None,
                input_fn: Callable[[dict], np.ndarray], *, identity=None, trusted=None,
                guard: SumGuard | None = None, colluders: int = 0) -> tuple[dict, str]:
    """Answer one stage of a secure sum. ``saved``: what this client stored after its previous stage
    of the same sum (None at the first); returns (reply, what to store now). ``input_fn(request)``
    gives the client's float vector at the masked-input stage. ``identity`` and ``trusted`` make the
    client run the signed protocol (and refuse an unsigned one); ``guard`` (updated in place) holds
    what it allows across the sums of its round. ``colluders``: the silos this client assumes collude
    with the server; a signed sum needs t > (n + colluders) / 2, or two survivor sets could each
    gather t signatures. Raises ``SecureSumRefused`` (or ``ValueError`` on a malformed request): the
    caller turns it into an error reply."""
    stage = request.get("stage")
    if stage not in STAGES:
        raise SecureSumRefused(f"unknown secure-sum stage {stage!r}")
    config = SecureSumConfig.from_dict(request["config"])
    if stage == "advertise_keys":
        if trusted is not None and 2 * config.threshold <= len(config.nodes) + colluders:
            raise SecureSumRefused(f"a signed sum of {len(config.nodes)} silos at t = {config.threshold} cannot keep two "
                                   f"survivor sets apart with {colluders} colluder(s): it needs t > (n + colluders) / 2")
        if guard is not None:
            guard.join(config)
        client = SecureSumClient(node, config, identity=identity, trusted=trusted)
        reply = client.advertise_keys()
    else:
        if saved is None:
            raise SecureSumRefused(f"stage {stage} of a secure sum this client never joined")
        state = json.loads(saved)
        if SecureSumConfig.from_dict(decode(state["config"], {})) != config:
            raise SecureSumRefused(f"stage {stage} names another secure sum than the one this client joined")
        client = SecureSumClient.from_state_dict(config, state["client"], identity=identity, trusted=trusted)
        if stage == "share_keys":
            reply = client.share_keys(request["peer_keys"])
        elif stage == "masked_input":
            x = np.asarray(input_fn(request), dtype=np.float64).ravel()
            if x.shape != (config.size - 1,):
                raise ValueError(f"this client's vector has {x.size} values, the sum expects {config.size - 1}")
            if request["config"].get("noise") is not None:
                # distributed DP: clip to C, scale, round conditionally, add this client's noise share
                residues = noise_mechanism(config, request["config"]["noise"]).encode(np.concatenate([x, [0.0]]))
            else:
                quantizer = FieldQuantizer(config.bits, float(request["config"]["clip-range"]), len(config.nodes))
                clamped = float(np.count_nonzero(np.abs(x) > quantizer.clip_range)) / max(1, x.size)
                residues, _ = quantizer.encode(np.concatenate([x, [clamped]]))
            reply = client.masked_input(request["sealed"], residues)
            if config.bits <= 32:  # residues below 2^32 travel in 4 bytes each, not 8
                reply = {"masked": reply["masked"].astype(np.uint32)}
        elif stage == "consistency":
            if guard is not None:
                guard.unmask(request["survivors"], record=False)
            reply = client.consistency(request["survivors"])
        else:
            if guard is not None:
                guard.unmask(request["survivors"])
            reply = client.unmask(request["survivors"], request.get("dropped"), request.get("signatures"))
    config_text, _ = encode(config.to_dict())
    return reply, json.dumps({"config": config_text, "client": client.state_dict()})


def in_process_transport(clients: dict[int, Callable[[dict], dict]]) -> Transport:
    """A transport that calls each client's handler in this process (tests, benchmarks), passing
    every payload through ``encode``/``decode`` like a message would."""
    def transport(stage, requests):
        out = {}
        for node, request in requests.items():
            text, arrays = encode(request)
            try:
                reply = clients[node](decode(text, arrays))
            except Exception as exc:  # the client refused: an error reply
                out[node] = exc
                continue
            if reply is not None:
                rtext, rarrays = encode(reply)
                out[node] = decode(rtext, rarrays)
        return out
    return transport
