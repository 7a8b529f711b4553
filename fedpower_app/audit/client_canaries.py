"""One-run audit of client-level DP with canary clients (Andrew et al., "One-shot empirical privacy
estimation for federated learning").

m canary clients join the population; each exists by a fair coin of the audit's own generator (a
client that does not exist never answers). An existing canary, when the round samples it, sends the
global adapters moved along its own random unit direction u_j, at 10× the clip norm, so the
product's clipping must cut it to C. Everything else is the product's round: the round engine
(``strategies.engine``) with the server's client-level privacy layer (calibrated from (ε, δ),
fixed denominator m = q_c N over the public population size), the method's delta release and its
noise. The other clients send random deltas (the audit is of the mechanism, not of training).

Threat model: the adversary sees every round's released global adapters. Canary j's score is the
sum over rounds of the released delta's projection on u_j; the scores go to Steinke's one-run
bound (and its Gaussian-DP form). Positive controls: ``no-noise``, ``tenth-noise`` (the planned
stds / 10), ``no-clip`` (the server's clip off) and ``non-private`` (both off).

Methods:
* FedLoRA and FFA-LoRA (linear delta releases): u_j is a random unit vector over the trained
  coordinates (A, B and the head; FFA-LoRA: B and the head); the score reads the released change
  of those coordinates.
* FedPower (PowerDP-L; the spec's §3.2, docs/privacy.md §10.2): the server clips each client's *merged* change
  dW_i = B_i A_i - B_g A_g, so a canary's direction lives in the merged space. A reply is rank-r
  factors, so canary j moves B only: B_i = B_g + s X_j, A_i = A_g, head + s h_j, i.e.
  dW_i = s X_j A_g, with X_j (m x r per module) and h_j drawn once, and s set each round so that
  ||(X_j A_g, h_j)|| s = 10 C. Its round-t direction U_j^t = (X_j A_g^t, h_j) / ||.|| is fixed by
  public information before the round; the score is the sum over rounds of
  <B' A' - B_g A_g, X_j A_g> + <dhead, h_j>, normalised, read from the released factors (B', A')
  without forming any m x n matrix. The one-run bound holds for any score fixed before the coins
  are seen; this one is what PowerDP-L keeps (the new A is warm-started from A_g).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from .white_box import CONTROLS, NO_CLIP, NO_NOISE, WhiteBoxReport, run_controls, score_report

METHODS = ("fedlora", "ffa-lora", "fedpower")


def _initial_state(modules: int, rank: int, dim: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    state = {}
    for i in range(modules):
        state[f"layer{i}.lora_A.weight"] = torch.randn(rank, dim, generator=gen) / math.sqrt(dim)
        state[f"layer{i}.lora_B.weight"] = torch.zeros(dim, rank)
    state["classifier.weight"] = torch.zeros(2, dim)
    return state


def _trained_keys(state: dict, method: str) -> list[str]:
    """The coordinates a client of ``method`` moves: A, B and the head (FFA-LoRA: B and the head)."""
    return [k for k in sorted(state) if not (method == "ffa-lora" and k.endswith(".lora_A.weight"))]


class LinearCanaries:
    """FedLoRA / FFA-LoRA: canary j is a random unit vector u_j over the trained coordinates."""

    def __init__(self, state: dict, method: str, count: int, rng: np.random.Generator) -> None:
        self.keys = _trained_keys(state, method)
        self.shapes = {k: state[k].shape for k in self.keys}
        self.sizes = [state[k].numel() for k in self.keys]
        directions = rng.normal(size=(count, sum(self.sizes)))
        directions /= np.linalg.norm(directions, axis=1, keepdims=True)
        self.directions = torch.as_tensor(directions, dtype=torch.float32)

    def flat(self, st: dict) -> torch.Tensor:
        return torch.cat([st[k].reshape(-1).float() for k in self.keys])

    def moved(self, glob: dict, move: torch.Tensor) -> dict:
        out, start = {k: v.clone() for k, v in glob.items()}, 0
        for k, n in zip(self.keys, self.sizes):
            out[k] = glob[k] + move[start:start + n].view(self.shapes[k])
            start += n
        return out

    def canary_reply(self, j: int, glob: dict, length: float) -> dict:
        return self.moved(glob, self.directions[j] * length)

    def scores(self, before: dict, after: dict) -> np.ndarray:
        return (self.directions @ (self.flat(after) - self.flat(before))).double().numpy()


class ProductCanaries(LinearCanaries):
    """FedPower: canary j moves B only, B_g + s X_j (its merged change s X_j A_g), and the head by
    s h_j; the score reads the released merged change along (X_j A_g, h_j), factored."""

    def __init__(self, state: dict, count: int, rng: np.random.Generator) -> None:
        super().__init__(state, "fedlora", 0, rng)  # flat(): every trained coordinate (random clients)
        self.modules = sorted(k[: -len(".lora_A.weight")] for k in state if k.endswith(".lora_A.weight"))
        self.heads = sorted(k for k in state if ".lora_" not in k)
        self.X = {mod: torch.as_tensor(rng.normal(size=(count, *state[f"{mod}.lora_B.weight"].shape)),
                                       dtype=torch.float64) for mod in self.modules}
        self.h = {k: torch.as_tensor(rng.normal(size=(count, state[k].numel())), dtype=torch.float64)
                  for k in self.heads}

    def _norms(self, glob: dict) -> torch.Tensor:
        """||(X_j A_g, h_j)|| for every canary (through the r x r Gram matrix of A_g)."""
        sq = sum((h * h).sum(1) for h in self.h.values())
        for mod, X in self.X.items():
            A = glob[f"{mod}.lora_A.weight"].double()
            sq = sq + ((X @ (A @ A.T)) * X).sum((1, 2))
        return sq.sqrt()

    def canary_reply(self, j: int, glob: dict, length: float) -> dict:
        s = length / float(self._norms(glob)[j])
        out = {k: v.clone() for k, v in glob.items()}
        for mod, X in self.X.items():
            key = f"{mod}.lora_B.weight"
            out[key] = glob[key] + (s * X[j]).to(glob[key].dtype)
        for k, h in self.h.items():
            out[k] = glob[k] + (s * h[j]).view_as(glob[k]).to(glob[k].dtype)
        return out

    def scores(self, before: dict, after: dict) -> np.ndarray:
        total = torch.zeros(len(next(iter(self.X.values()))), dtype=torch.float64)
        for mod, X in self.X.items():
            A_g, B_g = before[f"{mod}.lora_A.weight"].double(), before[f"{mod}.lora_B.weight"].double()
            A_n, B_n = after[f"{mod}.lora_A.weight"].double(), after[f"{mod}.lora_B.weight"].double()
            G = B_n @ (A_n @ A_g.T) - B_g @ (A_g @ A_g.T)  # (B'A' - B_g A_g) A_g^T: m x r
            total += (X * G).sum((1, 2))
        for k, h in self.h.items():
            total += h @ (after[k] - before[k]).reshape(-1).double()
        return (total / self._norms(before)).numpy()


def run_client_canary_audit(*, method: str = "fedlora", epsilon: float = 2.0, delta: float = 1e-5,
                            clients: int = 200, canaries: int = 1000, client_rate: float = 0.5,
                            rounds: int = 10, clip: float = 1.0, control: str = "none", seed: int = 0,
                            modules: int = 2, rank: int = 4, dim: int = 64,
                            guess_fraction: float = 0.1, distributed: bool = False) -> WhiteBoxReport:
    """``distributed``: the release of distributed DP (``secagg.enabled``, every client every round,
    each adding its discrete Gaussian share to its own clipped delta; the sums taken by
    ``session.direct_sum``, which releases what the secure sum releases). A canary that does not
    exist then answers with a zero delta and its share (zero-out: the neighbouring relation)."""
    from server_app.app import engine_for
    from strategies.engine import RoundReport

    from ..config import parse_config

    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if control not in CONTROLS:
        raise ValueError(f"control must be one of {CONTROLS}, got {control!r}")
    population = clients + canaries
    if distributed and client_rate != 1.0:
        raise ValueError("distributed DP runs every client every round: client_rate must be 1")
    cfg = parse_config({"strategy.name": method, "dp.level": "client", "dp.epsilon": epsilon, "dp.delta": delta,
                        "dp.clip": clip, "strategy.client-rate": client_rate, "num-server-rounds": rounds,
                        "lora.rank": rank, "seed": seed, "dp.noise": "seeded", "model.train-head": True,
                        "secagg.enabled": distributed})
    gen = torch.Generator().manual_seed(seed)
    state = _initial_state(modules, rank, dim, gen)
    engine = engine_for(cfg, state, client_sizes=[1] * population)
    rng = np.random.default_rng([seed, 34035])  # the audit's own randomness: coins and directions
    exists = rng.random(canaries) < 0.5
    kind = ProductCanaries(state, canaries, rng) if method == "fedpower" else LinearCanaries(state, method, canaries, rng)
    width = sum(kind.sizes)
    scores = np.zeros(canaries)

    if distributed:
        return _distributed_audit(engine, kind, exists, gen, clients=clients, rounds=rounds, clip=clip,
                                  control=control, epsilon=epsilon, delta=delta, guess_fraction=guess_fraction)
    if control in NO_CLIP:
        engine.ctx = dataclasses.replace(engine.ctx, clip=math.inf)
    for t in range(1, rounds + 1):
        plan = engine.plan_for(t, list(range(population)))
        if control in NO_NOISE or control == "tenth-noise":
            factor = 0.0 if control in NO_NOISE else 0.1
            engine._plan = dataclasses.replace(plan, noise_stds=tuple(s * factor for s in plan.noise_stds))
        before = {k: v.clone() for k, v in engine.global_state.items()}
        updates = []
        for node in plan.admitted:
            if node >= clients and not exists[node - clients]:
                continue  # a canary that does not exist never answers
            if node >= clients:
                moved = kind.canary_reply(node - clients, before, 10.0 * clip)
            else:
                move = torch.randn(width, generator=gen)
                moved = kind.moved(before, move * ((0.5 * clip) / move.norm()))
            reply = {k: moved[k] for k in engine.expected_reply_shapes()}
            updates.append(engine.update_from_state(reply))
        engine.release_updates(RoundReport(t, plan.round_type, sampled=len(plan.admitted)), updates)
        scores += kind.scores(before, engine.global_state)
    return score_report(scores, exists, control=control, epsilon=epsilon, delta=delta,
                        epsilon_at=engine.privacy.ledger.epsilon_at, guess_fraction=guess_fraction,
                        noise_multiplier=float(plan.noise_stds[0]) if plan.noise_stds else 0.0,
                        sample_rate=client_rate, steps=rounds)


def _distributed_audit(engine, kind, exists, gen, *, clients, rounds, clip, control, epsilon, delta,
                       guess_fraction) -> WhiteBoxReport:
    """The canary audit of distributed DP: every client's vector is the product's (``silo_vector``),
    encoded with its noise share as a silo encodes it, and the round released by the product's
    secure-round code (``strategies.secure_release``)."""
    from strategies.engine import RoundReport
    from strategies.secure_release import release_secure_round
    from strategies.secure_sum.contributions import silo_vector
    from strategies.secure_sum.session import direct_sum

    population = clients + len(exists)
    width = sum(kind.sizes)
    scores = np.zeros(len(exists))
    for t in range(1, rounds + 1):
        plan = engine.plan_for(t, list(range(population)))
        sr = engine._secure_round
        noise = dict(sr.noise)
        if control in NO_NOISE:
            noise["local-std"] = 0.5  # the least the sampler takes: 1/2 integer unit, nothing at this scale
        elif control == "tenth-noise":
            noise["local-std"] = max(0.5, noise["local-std"] / 10)
        if control in NO_CLIP:
            noise["clip"] = 1e6 * clip  # the silos' clip off
        sr.noise = noise
        before = {k: v.clone() for k, v in engine.global_state.items()}
        trained = {}
        for node in plan.admitted:
            if node >= clients:
                j = node - clients
                trained[node] = kind.canary_reply(j, before, 10.0 * clip) if exists[j] else before
            else:
                move = torch.randn(width, generator=gen)
                trained[node] = kind.moved(before, move * ((0.5 * clip) / move.norm()))
        sr.sum_fn = lambda config, request: direct_sum(
            config, sr.settings.quantizer(len(config.nodes)),
            {u: silo_vector(request, trained[u], before) for u in config.nodes}, noise=request["config"]["noise"])
        release_secure_round(engine, RoundReport(t, plan.round_type, sampled=len(plan.admitted)), sr, None, {})
        scores += kind.scores(before, engine.global_state)
    return score_report(scores, exists, control=control, epsilon=epsilon, delta=delta,
                        epsilon_at=engine.privacy.epsilon_at, guess_fraction=guess_fraction,
                        noise_multiplier=float(engine.privacy.calibration.noise_multiplier), sample_rate=1.0,
                        steps=rounds)


def main(argv=None) -> int:
    """``fedpower-audit client-canaries``: the correct release and every positive control; exit 1
    if the correct release is refuted or a broken one is not."""
    import argparse

    ap = argparse.ArgumentParser(prog="fedpower-audit client-canaries", description=__doc__.split("\n")[0])
    ap.add_argument("--method", choices=METHODS, default="fedlora")
    ap.add_argument("--epsilon", type=float, default=2.0)
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--canaries", type=int, default=4000)
    ap.add_argument("--client-rate", type=float, default=0.5)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--dim", type=int, default=512, help="adapter width (coordinates grow with it)")
    ap.add_argument("--control", choices=CONTROLS + ("all",), default="all")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--distributed", action="store_true",
                    help="audit distributed DP (secure aggregation; every client every round: --client-rate 1)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    return run_controls(
        lambda control: run_client_canary_audit(method=a.method, epsilon=a.epsilon, delta=a.delta, clients=a.clients,
                                                canaries=a.canaries, client_rate=a.client_rate, rounds=a.rounds,
                                                control=control, seed=a.seed, dim=a.dim,
                                                distributed=a.distributed),
        a.control, as_json=a.json, label="client-level canary audit")


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
