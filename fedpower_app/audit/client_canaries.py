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
stds / 10) and ``no-clip`` (the server's clip off). Methods: FedLoRA and FFA-LoRA (linear delta
releases); FedPower's PowerDP-L releases refactorized factors, which this score does not yet read.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from .white_box import CONTROLS, WhiteBoxReport, run_controls

METHODS = ("fedlora", "ffa-lora")


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


def run_client_canary_audit(*, method: str = "fedlora", epsilon: float = 2.0, delta: float = 1e-5,
                            clients: int = 200, canaries: int = 1000, client_rate: float = 0.5,
                            rounds: int = 10, clip: float = 1.0, control: str = "none", seed: int = 0,
                            modules: int = 2, rank: int = 4, dim: int = 64,
                            guess_fraction: float = 0.1) -> WhiteBoxReport:
    from server_app.app import engine_for
    from strategies.engine import RoundReport

    from ..config import parse_config
    from .bounds import canary_audit, steinke_gdp_lower_bound

    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if control not in CONTROLS:
        raise ValueError(f"control must be one of {CONTROLS}, got {control!r}")
    population = clients + canaries
    cfg = parse_config({"strategy.name": method, "dp.level": "client", "dp.epsilon": epsilon, "dp.delta": delta,
                        "dp.clip": clip, "strategy.client-rate": client_rate, "num-server-rounds": rounds,
                        "lora.rank": rank, "seed": seed, "dp.noise": "seeded", "model.train-head": True})
    gen = torch.Generator().manual_seed(seed)
    state = _initial_state(modules, rank, dim, gen)
    engine = engine_for(cfg, state, client_sizes=[1] * population)
    keys = _trained_keys(state, method)
    sizes = [state[k].numel() for k in keys]
    rng = np.random.default_rng([seed, 34035])  # the audit's own randomness: coins and directions
    exists = rng.random(canaries) < 0.5
    directions = rng.normal(size=(canaries, sum(sizes)))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    directions_t = torch.as_tensor(directions, dtype=torch.float32)
    scores = np.zeros(canaries)

    def flat(st):
        return torch.cat([st[k].reshape(-1).float() for k in keys])

    def unflat(vec):
        out, start = {}, 0
        for k, n in zip(keys, sizes):
            out[k] = vec[start:start + n].view_as(state[k])
            start += n
        return out

    if control == "no-clip":
        engine.ctx = dataclasses.replace(engine.ctx, clip=math.inf)
    for t in range(1, rounds + 1):
        plan = engine.plan_for(t, list(range(population)))
        if control != "none" and control != "no-clip":
            factor = 0.0 if control == "no-noise" else 0.1
            engine._plan = dataclasses.replace(plan, noise_stds=tuple(s * factor for s in plan.noise_stds))
        before = flat(engine.global_state)
        updates = []
        for node in plan.admitted:
            if node >= clients and not exists[node - clients]:
                continue  # a canary that does not exist never answers
            if node >= clients:
                move = directions_t[node - clients] * (10.0 * clip)
            else:
                move = torch.randn(sum(sizes), generator=gen)
                move *= (0.5 * clip) / move.norm()
            moved = {k: v.clone() for k, v in engine.global_state.items()}
            moved.update({k: engine.global_state[k] + d for k, d in unflat(move).items()})
            reply = {k: moved[k] for k in engine.expected_reply_shapes()}
            updates.append(engine.update_from_state(reply))
        engine.release_updates(RoundReport(t, plan.round_type, sampled=len(plan.admitted)), updates)
        released = flat(engine.global_state) - before
        scores += (directions_t @ released).double().numpy()
    result = canary_audit(scores, exists, delta=delta, guess_fraction=guess_fraction, claimed_epsilon=epsilon)
    eps_hat = float(result.epsilon_lower_bound)
    guesses = int(result.guesses_in + result.guesses_out)
    return WhiteBoxReport(control=control, canaries=canaries, claimed_epsilon=epsilon, delta=delta,
                          noise_multiplier=float(plan.noise_stds[0]) if plan.noise_stds else 0.0,
                          sample_rate=client_rate, steps=rounds, epsilon_lower_bound=eps_hat,
                          mu_lower_bound=steinke_gdp_lower_bound(guesses, int(result.correct), canaries),
                          ceiling=float(result.ceiling), correct=int(result.correct), guesses=guesses,
                          passed=not (eps_hat > epsilon * (1 + 1e-9)))


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
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    return run_controls(
        lambda control: run_client_canary_audit(method=a.method, epsilon=a.epsilon, delta=a.delta, clients=a.clients,
                                                canaries=a.canaries, client_rate=a.client_rate, rounds=a.rounds,
                                                control=control, seed=a.seed, dim=a.dim),
        a.control, as_json=a.json, label="client-level canary audit")


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
