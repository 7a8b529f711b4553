"""White-box audit of DP-SGD on a silo with gradient canaries (Steinke, Nasr & Jagielski 2023).

The audit runs the product's own DP-SGD round (``training.dp_sgd.dp_sgd_train_local``: Poisson
sampling, chunking, per-example clipping, Opacus' noise) with m *Dirac canaries*: canary j is a
per-example gradient with a single non-zero coordinate (its own coordinate of the adapters), of
norm ``scale`` times the clip norm, so that the product's clipping must cut it to C. Each canary is
in the silo's data with probability 1/2 (coins from the audit's own generator, apart from the run's
noise source) and, when in, is Poisson-sampled at every step at the silo's rate q = b/n, like any
example.

Threat model: the adversary sees every step's noisy clipped sum (white box, every step; the
DP-SGD guarantee covers these, the released adapters are post-processing of them). Canary j's
score is the sum over steps of that noisy sum's coordinate j, divided by C: an included canary adds
about q·L·T, the noise N(0, σ²(Δ/C)²·L·T). Scores go to Steinke's one-run bound
(``bounds.canary_audit``): the top and bottom ``guess_fraction`` are guessed IN and OUT.

Positive controls break the step on purpose while the claim stays the calibrated ε:
``no-noise`` (no noise added), ``tenth-noise`` (a tenth of the calibrated std), ``no-clip``
(canaries reach the sum unclipped) and ``non-private`` (both: what a non-private step shows). Each must give ε̂ above the claim, at a number of canaries
whose ceiling allows it. The canaries never reach a released model: the audit trains its own copy
of the model (``run_white_box_audit``: one silo; ``run_federated_white_box_audit``: a replay of a
federated configuration through the product's round engine, canaries in every silo), never a run's.

Verdict: the one-run f-DP test (``fdp_bound.profile_rejected``, Mahloujifar et al. 2025) of the
accountant's whole claimed profile eps(delta) at 95 %. Printed beside it: Steinke's (eps, delta)
bound eps_hat with its ceiling, and the Gaussian form mu_hat against the claim's mu.

    fedpower-audit white-box --preset conf/tiny.toml --silos 3 --canaries 4000 --control all
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import torch

from strategies import privacy_contract

CONTROLS = ("none", "no-noise", "tenth-noise", "no-clip", "non-private")
#: What each broken step removes (``non-private``: noise and clipping both, what a non-private run's
#: step shows the auditor, the reference beside the private runs).
NO_NOISE, NO_CLIP = ("no-noise", "non-private"), ("no-clip", "non-private")


class GradientCanaries:
    """Dirac canaries injected into the product's DP-SGD step and scored on every noisy sum.

    ``coords``: for canary j, (index of its trainable tensor, flat index in it); ``included``: the
    coins; ``sample_rate``: q; ``scale``: the canary's pre-clip norm in units of the clip."""

    def __init__(self, coords: list[tuple[int, int]], included: np.ndarray, *, sample_rate: float,
                 scale: float = 10.0, control: str = "none", generator: np.random.Generator | None = None) -> None:
        if control not in CONTROLS:
            raise ValueError(f"control must be one of {CONTROLS}, got {control!r}")
        self.coords = list(coords)
        self.included = np.asarray(included, dtype=bool)
        self.q = float(sample_rate)
        self.scale = float(scale)
        self.control = control
        self.rng = generator or np.random.default_rng()
        self.scores = np.zeros(len(self.coords))
        self.steps = 0
        tensor = np.array([t for t, _ in self.coords], dtype=np.int64)
        flat = np.array([i for _, i in self.coords], dtype=np.int64)
        # per trainable tensor: which canaries sit in it, and where (vectorised injection and scoring)
        self._by_tensor = {int(t): (np.flatnonzero(tensor == t), torch.as_tensor(flat[tensor == t]))
                           for t in np.unique(tensor)}
        self._flat = flat
        self._tensor = tensor
        self._sampled: np.ndarray | None = None  # the canaries in the current logical step

    def attach(self, dp_optimizer, params: list[torch.Tensor], clip: float) -> None:
        """Wrap the optimizer's clip-and-accumulate (inject) and add-noise (observe) steps."""
        self.params, self.clip = params, float(clip)
        clip_and_accumulate, add_noise = dp_optimizer.clip_and_accumulate, dp_optimizer.add_noise

        def clip_with_canaries():
            if self._sampled is None:  # the logical step's first chunk: draw which canaries take part
                self._sampled = np.flatnonzero(self.included & (self.rng.random(len(self.coords)) < self.q))
            rows = self._rows() if self.control not in NO_CLIP else None
            if rows is not None:  # canary rows go through the product's clipping with the real examples
                for p, extra in zip(self.params, rows):
                    p.grad_sample = torch.cat([p.grad_sample, extra.to(p.grad_sample.dtype)], dim=0)
                self._sampled = self._sampled[:0]  # injected once per logical step
            clip_and_accumulate()
            if self.control in NO_CLIP and len(self._sampled):  # the broken step: canaries unclipped
                for j in self._sampled:
                    t, i = self.coords[j]
                    self.params[t].summed_grad.view(-1)[i] += self.scale * self.clip
                self._sampled = self._sampled[:0]

        def noise_then_observe():
            if self.control in NO_NOISE:
                for p in dp_optimizer.params:
                    p.grad = p.summed_grad.view_as(p).clone()
                    p.summed_grad._processed = True
            elif self.control == "tenth-noise":
                sigma = dp_optimizer.noise_multiplier
                dp_optimizer.noise_multiplier = sigma / 10
                try:
                    add_noise()
                finally:
                    dp_optimizer.noise_multiplier = sigma
            else:
                add_noise()
            for t, (which, where) in self._by_tensor.items():
                values = self.params[t].grad.detach().reshape(-1)[where].double().cpu().numpy()
                self.scores[which] += values / self.clip
            self.steps += 1
            self._sampled = None

        dp_optimizer.clip_and_accumulate = clip_with_canaries
        dp_optimizer.add_noise = noise_then_observe

    def _rows(self) -> list[torch.Tensor] | None:
        if self._sampled is None or not len(self._sampled):
            return None
        k = len(self._sampled)
        rows = [torch.zeros((k, p.numel()), dtype=torch.float32, device=p.device) for p in self.params]
        tensor, flat = self._tensor[self._sampled], self._flat[self._sampled]
        for t in np.unique(tensor):
            r = np.flatnonzero(tensor == t)
            where = rows[int(t)].device
            rows[int(t)][torch.as_tensor(r, device=where), torch.as_tensor(flat[r], device=where)] = self.scale * self.clip
        return [row.view(k, *p.shape) for row, p in zip(rows, self.params)]


def dirac_coordinates(params: list[torch.Tensor], m: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    """m distinct coordinates of the trainable tensors, drawn uniformly (one per canary)."""
    sizes = np.array([p.numel() for p in params])
    if m > sizes.sum():
        raise ValueError(f"{m} Dirac canaries need {m} coordinates; the trainable set has {int(sizes.sum())}")
    flat = np.sort(rng.choice(int(sizes.sum()), size=m, replace=False))
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    tensor = np.searchsorted(starts, flat, side="right") - 1
    return [(int(t), int(f - starts[t])) for t, f in zip(tensor, flat)]


@dataclass
class WhiteBoxReport:
    """One audit's outcome. The verdict tests the accountant's whole claimed privacy profile with the
    one-run f-DP bound (``fdp_bound.profile_rejected``, 95 %); the (eps, delta) form (Steinke et al.)
    and the Gaussian form (mu_hat, Mahloujifar et al.) are the bounds printed beside the claim."""

    control: str
    canaries: int
    claimed_epsilon: float
    delta: float
    noise_multiplier: float
    sample_rate: float
    steps: int
    epsilon_lower_bound: float  # Steinke et al.'s one-run bound, (eps, delta) form, 95 %
    mu_lower_bound: float  # the one-run f-DP bound: the largest mu-GDP refuted, 95 %
    claimed_mu: float  # the mu whose Gaussian curve has the claimed eps at delta
    ceiling: float  # the largest eps_hat (Steinke) these canaries can certify
    correct: int
    guesses: int
    claim_refuted: bool  # the accountant's profile eps(delta) is refuted (fdp_bound.profile_rejected)
    passed: bool  # not claim_refuted

    def as_dict(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        verdict = "PASS" if self.passed else "FAIL: the audit refutes the claim"
        return (f"white-box DP-SGD audit, control {self.control}: eps_hat {self.epsilon_lower_bound:.3f} "
                f"(ceiling {self.ceiling:.3f}), mu_hat {self.mu_lower_bound:.3f} vs the claim's mu "
                f"{self.claimed_mu:.3f} ({self.correct}/{self.guesses} guesses right, {self.canaries} canaries) "
                f"vs claimed eps {self.claimed_epsilon:g} (delta {self.delta:g}; sigma {self.noise_multiplier:.3f}, "
                f"q {self.sample_rate:.3f}, {self.steps} steps; an included canary is sampled at least once "
                f"with probability {1 - (1 - self.sample_rate) ** self.steps:.2f}): {verdict}")


def score_report(scores, included, *, control: str, epsilon: float, delta: float, epsilon_at,
                 guess_fraction: float, **meta) -> WhiteBoxReport:
    """Turn canary scores into a report: guess the top and bottom ``guess_fraction`` IN and OUT,
    bound eps (Steinke) and mu (f-DP), and test the accountant's profile ``epsilon_at(delta)``."""
    from .bounds import canary_audit
    from .fdp_bound import fdp_gdp_lower_bound, gaussian_mu, profile_rejected

    result = canary_audit(scores, included, delta=delta, guess_fraction=guess_fraction, claimed_epsilon=epsilon)
    guesses, correct, m = int(result.guesses_in + result.guesses_out), int(result.correct), int(result.canaries)
    refuted = profile_rejected(epsilon_at, guesses, correct, m)
    return WhiteBoxReport(control=control, canaries=m, claimed_epsilon=epsilon, delta=delta,
                          epsilon_lower_bound=float(result.epsilon_lower_bound),
                          mu_lower_bound=fdp_gdp_lower_bound(guesses, correct, m),
                          claimed_mu=gaussian_mu(epsilon, delta), ceiling=float(result.ceiling), correct=correct,
                          guesses=guesses, claim_refuted=refuted, passed=not refuted, **meta)


def dp_sgd_profile(sample_rate: float, sigma: float, steps: int, accountant: str):
    """The accountant's claimed eps(delta) of ``steps`` DP-SGD steps at (q, sigma), for any delta."""
    from ..privacy.accounting.silo import dp_sgd_epsilon

    return lambda delta: dp_sgd_epsilon([(sample_rate, sigma, steps)], delta, accountant)


def run_white_box_audit(model, data, *, epsilon: float, delta: float, clip: float, batch_size: int,
                        local_steps: int, rounds: int, canaries: int, control: str = "none", seed: int = 0,
                        guess_fraction: float = 0.1, scale: float = 10.0, accountant: str = "rdp",
                        device: torch.device | None = None) -> WhiteBoxReport:
    """Calibrate σ for (ε, δ) over ``rounds`` rounds of ``local_steps`` DP-SGD steps at q = b/n, run
    them on ``model`` (its trainable set settled) with ``canaries`` Dirac canaries, and bound ε."""
    from ..privacy.accounting.silo import calibrate_noise_multiplier
    from ..training.dp_sgd import DPSGDParams, dp_sgd_train_local

    device = device or next(model.parameters()).device
    n = len(data)
    q = privacy_contract.sample_rate(batch_size, n)
    sigma = calibrate_noise_multiplier(q, local_steps * rounds, epsilon, delta, accountant)
    rng = np.random.default_rng([seed, 34034])  # the audit's own randomness (coins, canary sampling)
    trainable = [p for p in model.parameters() if p.requires_grad]
    coords = dirac_coordinates(trainable, canaries, rng)
    audit = GradientCanaries(coords, rng.random(canaries) < 0.5, sample_rate=q, scale=scale, control=control,
                             generator=rng)
    params = DPSGDParams(sigma, clip, batch_size, local_steps)
    sampling = torch.Generator().manual_seed(seed)
    noise = torch.Generator(device=device).manual_seed(seed + 1)  # on the gradients' device
    for _ in range(rounds):
        dp_sgd_train_local(model, data, params=params, lr=1e-3, sampling_generator=sampling, noise_generator=noise,
                           device=device, canaries=audit)
    return score_report(audit.scores, audit.included, control=control, epsilon=epsilon, delta=delta,
                        epsilon_at=dp_sgd_profile(q, sigma, audit.steps, accountant), guess_fraction=guess_fraction,
                        noise_multiplier=sigma, sample_rate=q, steps=audit.steps)


def run_federated_white_box_audit(cfg, *, silos: int, canaries: int, control: str = "none",
                                  guess_fraction: float = 0.1, scale: float = 10.0) -> WhiteBoxReport:
    """The white-box audit inside a federated run of the configuration ``cfg`` (DP-SGD on the silos):
    the product's round engine samples the silos and plans each round, every sampled silo trains
    with the product's round (``training.silo_round.train_round``) and its DP-SGD inserts its own
    ``canaries // silos`` Dirac canaries, each in with its own fair coin; the server releases as in
    a run. The auditor sees every step's noisy sum in every silo. Each canary belongs to one silo's
    data, and each silo's DP-SGD is (its ledger's) f-DP with respect to any one of its examples,
    so the pooled canaries are tested against the weakest silo's profile: max over silos of
    eps_k(delta), each from that silo's q_k = b/n_k and the steps it actually ran."""
    from client_app.app import dp_sgd_params, reply_state
    from server_app.app import engine_for
    from strategies.engine import RoundReport

    from .. import data as D
    from .. import model as M
    from ..training.silo_round import train_round

    if cfg["dp.level"] != "sample" or cfg["dp.noise-at"] != "silo":
        raise ValueError("the federated white-box audit needs DP-SGD on the silos (dp.level = \"sample\", "
                         "dp.noise-at = \"silo\")")
    if silos < 1 or canaries < silos:
        raise ValueError(f"need at least one silo and one canary per silo, got {silos} silos, {canaries} canaries")
    tok = M.load_tokenizer(cfg["model.name"])
    task = D.load_task(cfg)
    model = M.build_model(cfg, task.num_labels)
    shards = [D.client_shard(cfg, tok, pid, silos) for pid in range(silos)]
    engine = engine_for(cfg, M.adapter_state(model), client_sizes=[s.dp_size for s in shards])
    rng = np.random.default_rng([cfg["seed"], 34036])  # the audit's own randomness, apart from the run's
    M.set_trainable(model, train_a=engine.replies_a, train_b=True)  # what the method's silos train
    trainable = [p for p in model.parameters() if p.requires_grad]
    audits, per = [], canaries // silos
    for shard in shards:
        audits.append(GradientCanaries(dirac_coordinates(trainable, per, rng), rng.random(per) < 0.5,
                                       sample_rate=privacy_contract.sample_rate(cfg["train.batch-size"], shard.dp_size),
                                       scale=scale, control=control, generator=rng))
    params = None
    for rnd in range(1, cfg["num-server-rounds"] + 1):
        plan = engine.plan_for(rnd, list(range(silos)))
        config = engine.train_instructions(plan)
        params = dp_sgd_params(config)
        updates = []
        for pid in plan.admitted:
            M.load_adapter_state(model, engine.global_state)
            train_round(cfg, model, shards[pid], partition_id=pid, server_round=rnd,
                        train_lora=config["train-lora"], params=params, canaries=audits[pid])
            updates.append(engine.update_from_state(reply_state(model, config["train-lora"])))
        engine.release_updates(RoundReport(rnd, plan.round_type, sampled=len(plan.admitted)), updates)
    sigma = params.noise_multiplier
    profiles = [dp_sgd_profile(a.q, sigma, a.steps, cfg["dp.accountant"]) for a in audits if a.steps]
    return score_report(np.concatenate([a.scores for a in audits]), np.concatenate([a.included for a in audits]),
                        control=control, epsilon=cfg["dp.epsilon"], delta=cfg["dp.delta"],
                        epsilon_at=lambda delta: max(p(delta) for p in profiles), guess_fraction=guess_fraction,
                        noise_multiplier=sigma, sample_rate=max(a.q for a in audits),
                        steps=max(a.steps for a in audits))


#: What each audit's adversary sees (printed before its reports).
THREAT_MODELS = {
    "white-box DP-SGD audit": "every DP-SGD step's noisy clipped sum in every silo (the DP-SGD guarantee covers "
                              "them all; the released adapters are post-processing)",
    "client-level canary audit": "every round's released global adapters (client level: add or remove one client)",
}
VERDICT = ("verdict: the one-run f-DP test (Mahloujifar et al. 2025) of the accountant's whole profile eps(delta), "
           "95 %; beside it Steinke's (eps, delta) bound eps_hat and the Gaussian form mu_hat, 95 %")


def run_controls(audit, control: str, *, as_json: bool, label: str) -> int:
    """Run ``audit(control)`` for one control or all of them (``"all"``), print each report, and
    return 1 if the correct step is refuted or a broken one is not (its audit is the check)."""
    import json
    import sys

    if not as_json:
        print(f"{label}: the adversary sees {THREAT_MODELS.get(label, 'every release')}; {VERDICT}", flush=True)
    failed = False
    for c in (CONTROLS if control == "all" else (control,)):
        report = audit(c)
        print(json.dumps(report.as_dict()) if as_json else report.line().replace("white-box DP-SGD audit", label),
              flush=True)
        failed |= (c == "none") != report.passed
    if failed:
        print(f"{label}: a correct step was refuted, or a broken one was not caught", file=sys.stderr)
    return 1 if failed else 0


def main(argv=None) -> int:
    """``fedpower-audit white-box``: the audit inside a federated run of a configuration (its preset,
    its method's tuned settings and ``--set`` keys) with every positive control; exit 1 if the
    correct step is refuted or a broken one is not."""
    import argparse

    ap = argparse.ArgumentParser(prog="fedpower-audit white-box", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default=None, help="a conf/*.toml preset (the run to audit)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="run-config keys (model, task, method, LoRA, b, L, T, clip, epsilon, delta, accountant)")
    ap.add_argument("--silos", type=int, default=3, help="silos of the federated run (each inserts its canaries)")
    ap.add_argument("--canaries", type=int, default=4000, help="canaries in all, split evenly over the silos")
    ap.add_argument("--guess-fraction", type=float, default=0.1)
    ap.add_argument("--control", choices=CONTROLS + ("all",), default="all",
                    help="a broken step to catch (positive control), none, or all of them in turn")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)

    from ..config import load_preset, parse_config, with_method_preset
    from ..launcher import parse_set

    if a.silos < 1 or a.canaries < a.silos:
        ap.error(f"need --silos >= 1 and at least one canary per silo (--canaries >= --silos), got "
                 f"{a.silos} silos and {a.canaries} canaries")
    torch.set_num_threads(a.threads)
    explicit = parse_set(a.set)
    overrides, _, _ = with_method_preset({**(load_preset(a.preset) if a.preset else {}), **explicit}, explicit)
    cfg = parse_config({"dp.noise": "seeded", **overrides})  # the audit replays its run: seeded noise

    def audit(control: str) -> WhiteBoxReport:
        return run_federated_white_box_audit(cfg, silos=a.silos, canaries=a.canaries, control=control,
                                             guess_fraction=a.guess_fraction)

    return run_controls(audit, a.control, as_json=a.json, label="white-box DP-SGD audit")


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
