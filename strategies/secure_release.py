"""A round under secure aggregation: the server learns only sums of the silos' vectors (Flower-free).

With ``secagg.enabled`` the round engine never receives a silo's adapters. Its train message asks each
silo to keep what it trained and to answer with the first stage of a secure sum (its public keys);
the rest of the round is secure sums over a transport (``session.run_secure_sum``; the Flower
adapter carries them in ``train.secagg`` messages, ``strategies/secure_rounds.py``):

* **FedLoRA, FFA-LoRA, FedSVD, and FedPower's FedLoRA rounds**: one sum of the silos' trained
  vectors (A and B, or B, and the head). The average is the sum over the k survivors divided by k,
  and the method's release runs on it as on one reply (the average of one reply is itself; FedSVD's
  SVD of B_avg A_g is post-processing of the average).
* **FedPower's refactorization**: the merge W = (1/k) sum_i B_i A_i is not a sum of the factors, but
  its power iteration needs only W Q^T = (1/k) sum_i B_i (A_i Q^T) and P^T W = (1/k) sum_i (P^T B_i) A_i
  (``secure_sum.power``): 1 + 2 ``strategy.power-iters`` secure sums of thin matrices, the head's
  average riding on the first. No silo sends an m x n matrix, and the server never forms W.

This path adds no noise on the server, so it runs where the server adds none: non-private runs,
and DP-SGD on the silos (``dp.level = "sample"``, ``dp.noise-at = "silo"``), where the average and
the refactorization are post-processing of the silos' private replies. Secure aggregation then hides
each silo's reply from the server (docs/secure-aggregation.md states what it assumes).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import numpy as np
import torch

from . import mechanisms as MECH
from .releases import Release
from .secure_sum import contributions as C
from .secure_sum.power import powerdp_l_through_sums, refactorize_through_sums
from .secure_sum.protocol import SecureSumRefused
from .secure_sum.session import SecureAggregation, SumOutcome, Transport, encode, run_secure_sum

log = logging.getLogger("fedpower")

#: Round types that are post-processing of sums (no server noise): what secure aggregation can carry.
SUM_RELEASES = ("fedlora", "ffa", "fedsvd")
POWER_RELEASES = ("powerdp",)
#: Client level with distributed DP: the silos clip their round deltas and add noise shares.
DELTA_RELEASES = ("fedlora-delta", "ffa-delta")
POWER_DELTA_RELEASES = ("powerdp-l",)


def unsupported_reason(engine) -> str | None:
    """Why secure aggregation cannot run this engine's rounds (None: it can)."""
    if engine.privacy.noise_at == "distributed":  # client level: the silos add the noise in the sums
        return None
    if engine.client_level or engine.privacy.noise_at == "server":
        return ("secure aggregation runs where the server adds no noise (non-private, or DP-SGD on the silos: "
                "dp.level = 'sample', dp.noise-at = 'silo'); with server-side noise the server would have to "
                "see each update to clip it")
    if engine.method_name in ("input-perturbation", "output-perturbation"):
        return f"{engine.method_name} is a server-side noise mechanism"
    return None


class SecureRound:
    """The secure sums of one round: the first is announced in the train message, the rest follow."""

    def __init__(self, engine, server_round: int, round_type: str, nodes: list[int]) -> None:
        self.engine, self.server_round, self.round_type = engine, server_round, round_type
        self.settings: SecureAggregation = engine.secure
        self.nodes = [int(n) for n in nodes]
        shapes = engine.expected_reply_shapes()
        self.keys = list(shapes)
        distributed = engine.privacy.noise_at == "distributed"
        self.noise = engine.privacy.noise_parameters() if distributed else None
        kinds = ({**dict.fromkeys(DELTA_RELEASES, "delta"), **dict.fromkeys(POWER_DELTA_RELEASES, "power-right-delta")}
                 if distributed else
                 {**dict.fromkeys(SUM_RELEASES, "trained"), **dict.fromkeys(POWER_RELEASES, "power-right")})
        if round_type not in kinds:
            raise ValueError(f"round type {round_type!r} cannot run under secure aggregation"
                             + (" with distributed DP" if distributed else ""))
        self.kind = kinds[round_type]
        size = C.vector_size(self.kind, shapes, engine.modules, engine.rank,
                             engine.extras if self.kind.startswith("power-right") else ())
        self.outcomes: list[SumOutcome] = []
        self.first = self._config(self.nodes, size) if len(self.nodes) >= 2 else None
        self.q0 = None
        if self.kind == "power-right":
            # The public random start of the power iteration: the same draws, in the same order, as
            # the release in the clear (powerdp._random_start per module group), so both agree.
            gen = engine.noise.generator("release", server_round)
            self.q0 = {}
            for g in engine.ctx.groups:
                draw = torch.randn((len(g.names), engine.rank, g.n), generator=gen, dtype=engine.ctx.dtype)
                self.q0.update({name: draw[j] for j, name in enumerate(g.names)})
        self.sum_fn = None  # (config, masked-input request) -> SumOutcome: replaces the protocol (audits)

    def _config(self, nodes, size):
        """The round's first sum: the cohort, t from its size, a fresh graph seed, the sum's name."""
        return self.settings.config_for(nodes, size, os.urandom(16), label=self._label())

    def _later_config(self, size):
        """A later sum of the round: over exactly the first sum's survivors, at the first sum's t (the
        silos refuse anything else: ``session.SumGuard``)."""
        return dataclasses.replace(self.first, nodes=tuple(self.outcomes[0].survivors), size=size + 1,
                                   graph_seed=os.urandom(16), label=self._label())

    def _label(self) -> str:
        return f"{self.server_round}/{self.kind}/{len(self.outcomes)}"

    def train_request(self) -> str | None:
        """The first sum's stage-1 request, carried in the train message's config (JSON)."""
        if self.first is None:
            return None
        public = {**self.first.to_dict(), "clip-range": float(self.settings.clip_range)}
        if self.noise is not None:
            public["noise"] = dict(self.noise)
        return encode({"stage": "advertise_keys", "config": public})[0]

    # -- the sums ------------------------------------------------------------------------------------
    def _sum(self, transport, config, extra, advertised=None) -> SumOutcome:
        if self.sum_fn is not None:  # the release without the protocol (audits)
            outcome = self.sum_fn(config, {"config": {**config.to_dict(), "noise": self.noise}, **extra})
            self.outcomes.append(outcome)
            return outcome
        outcome = run_secure_sum(transport, config, self.settings.quantizer(len(config.nodes)),
                                 masked_input_extra=extra, advertised=advertised, noise=self.noise,
                                 all_or_nothing=bool(self.outcomes))
        self.outcomes.append(outcome)
        return outcome

    def run(self, transport: Transport, advertised: dict) -> Release:
        """All the round's sums and the release made from them. Raises ``SecureSumRefused``."""
        if self.first is None:
            raise SecureSumRefused(f"a secure sum needs at least 2 silos in the round, got {len(self.nodes)}")
        engine = self.engine
        if self.kind == "delta":
            return self._delta_release(transport, advertised)
        if self.kind == "power-right-delta":
            return self._powerdp_l_release(transport, advertised)
        if self.kind == "trained":
            out = self._sum(transport, self.first, {"input": "trained", "keys": self.keys}, advertised)
            mean = C.unflatten(out.total / len(out.survivors), engine.expected_reply_shapes())
            update = engine.update_from_state(mean)  # checks shapes and finiteness; head as a delta
            gen = engine.noise.generator("release", self.server_round)
            release = MECH.get(self.round_type).release([update], engine.ctx, list(engine._plan.noise_stds), gen,
                                                        engine._release_args())
            release.num_clients = len(out.survivors)
            return release
        return self._power_release(transport, advertised)

    def _delta_release(self, transport, advertised) -> Release:
        """Client level: global + (sum of clipped deltas + the shares' noise) / m."""
        engine = self.engine
        out = self._sum(transport, self.first, {"input": "delta", "keys": self.keys}, advertised)
        shapes = engine.expected_reply_shapes()
        avg = C.unflatten(out.total / engine.denominator, shapes)
        for k, v in avg.items():
            if not torch.isfinite(v).all():
                raise SecureSumRefused(f"the secure sum of {k} is not finite")
        release = Release(extra_delta={k: avg[k] for k in engine.extras})
        for m in engine.modules:
            release.B[m] = engine.global_state[m + C.LORA_B] + avg[m + C.LORA_B]
            if m + C.LORA_A in avg:
                release.A[m] = engine.global_state[m + C.LORA_A] + avg[m + C.LORA_A]
        release.num_clients = len(out.survivors)
        return release

    def _thin_sums(self, transport, advertised, suffix: str, denominator):
        """(sum_right, sum_left, head): FedPower's averaged secure sums of thin products per module,
        ``suffix`` "" (the trained factors) or "-delta" (the clipped round delta, distributed DP);
        the first sum is announced in the train message and carries the head; later sums run over
        its survivors, all or nothing (``run_secure_sum``). ``denominator(outcome)``: what a sum is
        divided by."""
        engine = self.engine
        shapes = engine.expected_reply_shapes()
        head: dict = {}

        def averaged(kind, basis, extras):
            bases = {m: b.detach().numpy().astype(np.float32) for m, b in basis.items()}  # orthonormal to 1e-7
            extra = {"input": kind, "modules": engine.modules, "basis": bases, "extras": list(extras)}
            if not self.outcomes:
                out = self._sum(transport, self.first, extra, advertised)
            else:
                size = C.vector_size(kind, shapes, engine.modules, engine.rank, extras)
                out = self._sum(transport, self._later_config(size), extra)
            return out.total / denominator(out)

        def split(vec, rows_of):
            at, out = 0, {}
            for m in engine.modules:
                rows, cols = rows_of(m)
                out[m] = torch.as_tensor(vec[at: at + rows * cols]).reshape(rows, cols)
                at += rows * cols
            return out, at

        def sum_right(Q):
            extras = engine.extras if not self.outcomes else []
            vec = averaged("power-right" + suffix, Q, extras)
            out, at = split(vec, lambda m: (shapes[m + C.LORA_B][0], engine.rank))
            if extras:
                head.update(C.unflatten(vec[at:], {k: shapes[k] for k in extras}))
            return out

        def sum_left(P):
            return split(averaged("power-left" + suffix, P, []), lambda m: (engine.rank, shapes[m + C.LORA_A][1]))[0]

        return sum_right, sum_left, head

    def _powerdp_l_release(self, transport, advertised) -> Release:
        """Client level, FedPower: PowerDP-L warm-started from the public A_g, every product
        W Q^T = B_g A_g Q^T + (sum_i dW_i Q^T + noise) / m a secure sum with the silos' noise shares."""
        engine = self.engine
        sum_right, sum_left, head = self._thin_sums(transport, advertised, "-delta", lambda out: engine.denominator)
        public = {m: (engine.global_state[m + C.LORA_B], engine.global_state[m + C.LORA_A]) for m in engine.modules}
        B, A = powerdp_l_through_sums(sum_right, sum_left, public, engine.ctx.power_iters)
        return self._factor_release(B, A, {k: head[k] for k in engine.extras})

    def _power_release(self, transport, advertised) -> Release:
        """Sample level or non-private, FedPower: the power iteration on the average of B_i A_i."""
        engine = self.engine
        sum_right, sum_left, head = self._thin_sums(transport, advertised, "", lambda out: len(out.survivors))
        B, A = refactorize_through_sums(sum_right, sum_left, self.q0, engine.ctx.power_iters)
        return self._factor_release(B, A, {k: head[k] - engine.global_state[k] for k in engine.extras})

    def _factor_release(self, B, A, extra_delta) -> Release:
        release = Release(A={m: A[m].to(torch.float32) for m in A}, B={m: B[m].to(torch.float32) for m in B},
                          extra_delta=extra_delta)
        for k, v in list(release.A.items()) + list(release.B.items()) + list(release.extra_delta.items()):
            if not torch.isfinite(v).all():
                raise SecureSumRefused(f"the secure sums of the round are not finite ({k})")
        release.num_clients = len(self.outcomes[0].survivors)
        return release

    # -- what the round report shows ----------------------------------------------------------------
    @property
    def message_rounds(self) -> int:
        return 1 + sum(o.message_rounds for o in self.outcomes)  # the train exchange carried stage 1

    @property
    def bytes_up(self) -> int:
        return sum(o.bytes_up for o in self.outcomes)

    @property
    def clamped(self) -> float:
        """The fraction of clamped coordinates, averaged over the sums' survivors."""
        total = sum(o.clamped for o in self.outcomes)
        count = sum(len(o.survivors) for o in self.outcomes)
        return total / count if count else 0.0


def release_secure_round(engine, report, secure_round: SecureRound, transport: Transport, advertised: dict) -> bool:
    """Run ``secure_round``'s sums, apply the release and commit the round (as
    ``RoundEngine.release_updates``). A refused sum releases nothing; returns whether a model was
    released."""
    plan = engine._plan
    t0 = time.perf_counter()
    try:
        release = secure_round.run(transport, advertised)
    except (SecureSumRefused, ValueError) as exc:
        report.dropped.extend(getattr(exc, "dropped", []))
        report.released = False
        report.aggregated = 0
        report.secure_refused = str(exc) if engine.disclosure.full else "refused (reason withheld: dp.diagnostics)"
        log.warning("round %d: secure aggregation refused the round, nothing released: %s", report.server_round,
                    report.secure_refused)
        # a sum already unmasked was released to the server (FedPower's later sums refused): charged
        engine.privacy.commit_round(plan, 0, released=bool(secure_round.outcomes))
        _fill(report, secure_round)
        engine.finish_round(report)
        return False
    MECH.apply_release(engine.global_state, release)
    engine.privacy.commit_round(plan, release.num_clients, released=True)
    report.aggregated = release.num_clients
    report.aggregation_seconds = time.perf_counter() - t0
    report.noise_stds = [float(s) for s in plan.noise_stds]
    _fill(report, secure_round)
    if secure_round.clamped > 0:
        log.warning("round %d: %.3g%% of the secure sums' coordinates were clamped to +-%g; raise secagg.clip-range",
                    report.server_round, 100 * secure_round.clamped, engine.secure.clip_range)
    engine.finish_round(report)
    return True


def _fill(report, secure_round: SecureRound) -> None:
    report.message_rounds = secure_round.message_rounds
    report.bytes_up += secure_round.bytes_up
    report.secure_clamped = secure_round.clamped
    if secure_round.outcomes and report.dropped is not None:
        for o in secure_round.outcomes:
            report.dropped.extend(o.dropped)
