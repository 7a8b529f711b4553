"""Private settings for a new task, by public rules (no tuning, no privacy spent).

Input: the silos' shard sizes n_1..n_N (public: the size query answers them, or ``fedpower-privacy
--client-sizes``), the target (ε, δ), and a compute budget in epochs (or minutes at a measured
rate). Output: the batch b per silo, the local steps L, the rounds T, the noise multiplier σ, the
clip C and the learning rate, for DP-SGD on the silos. The rules read only those inputs: they see no
row and no statistic of one, so choosing by them spends no privacy.

The rules, and the SST-2 measurements they come from (RESULTS.md, the private SST-2 recipe; it is
``conf/sst2-dp.toml``: 6 silos of 11,000 rows, b = 1,000, L = 4, T = 14, lr 0.0175, ε 8 → σ 0.845):

1. **A fixed number of epochs** E (default 5, the recipe's 5.1). More epochs at the same ε buy
   more steps with more noise each; the recipe's 5 epochs beat its 1- and 17-epoch pilots.
2. **Sampling rate q = b / n_min near the recipe's 0.09, and the batch summed over silos in the
   thousands** (N·b ≥ 1,000): the recipe learned at N·b = 6,000, the small-batch pilots (b = 250)
   trailed it. So b₀ = max(round(0.09 · n_min), ⌈1,000 / N⌉).
   **Then no more noise per step than the recipe's**: each coordinate of the averaged update carries
   noise of std σ·C / (b·√N) against a signal of at most C, so the ratio σ / (b·√N) is what the
   noise costs a step. The recipe's is 0.845 / (1,000·√6) = 3.45·10⁻⁴. Where b₀'s ratio is above it
   (by more than 10 %), b is raised to the smallest sampling rate on the grid 0.1, 0.125, 0.15, 0.2,
   …, 0.5 whose ratio meets it (σ recalibrated at each), at most n_min / 2 (q ≤ 0.5: a step must
   leave most of the shard out, or subsampling amplifies nothing). Small silos need this: at 1,666
   rows a silo, b₀ = 167 has 6.1× the recipe's ratio; on a 10,000-row SST-2 sample its private run
   sat at the majority class for four rounds and ended at 0.769, where q = 0.5 (b = 833, 1.9×)
   ended at 0.786, and on MNLI the raise took 0.453 to 0.502 (RESULTS.md, "Other tasks"). A raise
   that would need σ above :data:`MAX_NOISE_MULTIPLIER` is not taken. Where even q = 0.5 stays
   above the recipe's ratio, the plan says by how much: expect a gap to the non-private run, which
   more rows per silo or more silos close. A larger ε lowers the noise but not the few steps that
   q = 0.5 leaves (MNLI at ε = 32: 0.516 against 0.618).
3. **Steps from the epochs**: the smallest silo sees E epochs in S = ⌈E / q⌉ steps, L = 4 local
   steps a round (the recipe's; fewer when S is small), T = ⌈S / L⌉ rounds.
4. **σ** is calibrated by the silo accountant (RDP) for (q, L·T, ε, δ): the same function the run uses.
5. **The clip at or below the median per-example norm**: at the initial adapters (MiniLM, LoRA
   r = 8) the per-example gradient norms bunch at 0.031 / 0.037 / 0.044 (10/50/90 %), clipping
   lower changed nothing measurable; C = 0.035 (and the head's clip the same when it trains). The
   norms are those of the public model at its public initialisation, not of private rows.
6. **The learning rate scaled with the batch**: Adam's square-root rule (Malladi et al. 2022, "On
   the SDEs and scaling rules for adaptive gradient algorithms"), lr = 0.0175 · √(N·b / 6,000)
   from the recipe's rate at its summed batch.

Refusal: a plan whose σ exceeds :data:`MAX_NOISE_MULTIPLIER` is refused, with what would fit: the
smallest ε at these epochs, and the most epochs at this ε.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .accounting.silo import calibrate_noise_multiplier

#: The SST-2 recipe the rules are anchored on (conf/sst2-dp.toml).
RECIPE_EPOCHS = 5.0
RECIPE_RATE = 0.09  # b / n = 1,000 / 11,000
RECIPE_LOCAL_STEPS = 4
RECIPE_LR = 0.0175
RECIPE_SILOS = 6
RECIPE_BATCH = 1000
RECIPE_SIGMA = 0.845  # calibrated for the recipe at epsilon 8, delta 1e-5
RECIPE_SUMMED_BATCH = RECIPE_SILOS * RECIPE_BATCH
MIN_SUMMED_BATCH = 1000
MAX_RATE = 0.5
#: The recipe's noise per coordinate of the averaged update, relative to the clip: σ / (b·√N).
RECIPE_NOISE_RATIO = RECIPE_SIGMA / (RECIPE_BATCH * math.sqrt(RECIPE_SILOS))
#: A plan whose ratio is at most this (the recipe's, 10 % of slack) is not raised.
NOISE_RATIO_LIMIT = 1.1 * RECIPE_NOISE_RATIO
#: The sampling rates tried, in order, when b₀'s noise ratio is above the recipe's.
RATE_GRID = (0.1, 0.125, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5)
#: The median per-example gradient norm at the initial adapters, rounded down (RESULTS.md).
CLIP = 0.035
#: Above this noise multiplier each step adds the noise of many clipped gradients per example in
#: the batch; the recipe learned at 0.845. Plans above it are refused as out of reach.
MAX_NOISE_MULTIPLIER = 4.0


class PlanRefused(ValueError):
    """No plan within the rules; the message says what would fit."""


@dataclass(frozen=True)
class Recommendation:
    batch_size: int
    local_steps: int
    rounds: int
    noise_multiplier: float
    clip: float
    lr: float
    sample_rate: float
    epochs: float
    summed_batch: int
    epsilon: float
    delta: float
    reasons: tuple[str, ...]
    what: str = "adapters"  # train.what: "adapters" or "head" (a linear head on frozen features)

    def overrides(self, *, train_head: bool = False) -> dict:
        """The run-config keys that carry the plan. σ is not among them: the run calibrates it from
        dp.epsilon with the same accountant (and a non-private run at the same compute ignores it)."""
        out = {"train.what": self.what, "train.batch-size": self.batch_size, "train.local-steps": self.local_steps,
               "num-server-rounds": self.rounds, "train.lr": self.lr, "dp.clip": self.clip}
        if self.what == "head":
            out["dp.head-clip"] = 0.0  # the head is all that trains: one clip, C, bounds its gradient
        elif train_head:
            out["dp.head-clip"] = self.clip
        return out

    def to_dict(self) -> dict:
        return asdict(self)


def epochs_for_minutes(minutes: float, rows_per_second: float, sizes: list[int]) -> float:
    """Epochs of the smallest silo that ``minutes`` of training buy, each silo processing
    ``rows_per_second`` (silos train in parallel; every silo draws the same b per step)."""
    if not (minutes > 0 and rows_per_second > 0):
        raise ValueError(f"minutes and rows per second must be > 0, got {minutes}, {rows_per_second}")
    return minutes * 60.0 * rows_per_second / min(sizes)


def _steps(epochs: float, q: float) -> tuple[int, int, int]:
    steps = max(1, math.ceil(epochs / q - 1e-9))
    local = min(RECIPE_LOCAL_STEPS, steps)
    rounds = math.ceil(steps / local)
    return steps, local, rounds


def recommend(sizes: list[int], epsilon: float, delta: float, *, epochs: float = RECIPE_EPOCHS,
              accountant: str = "rdp", private: bool = True, what: str = "auto") -> Recommendation:
    """The plan of the rules for silos of ``sizes``: what to train (``what = "auto"``: rule 0, the
    head's rules H1-H4 when it chooses the head), then its b, L, T, σ, clip and lr; raises
    :class:`PlanRefused`. ``what = "adapters"`` or ``"head"`` plans that choice. ``private=False``
    plans the non-private run at the same compute: the private plan's choice and epochs, without
    the noise rule's raise of b (it answers the noise, and there is none)."""
    if what not in ("auto", "adapters", "head"):
        raise ValueError(f"what must be 'auto', 'adapters' or 'head', got {what!r}")
    if what == "adapters":
        return adapter_plan(sizes, epsilon, delta, epochs=epochs, accountant=accountant, private=private)
    if what == "head":
        return head_plan(sizes, epsilon, delta, accountant=accountant, private=private)
    return choose_what(sizes, epsilon, delta, epochs=epochs, accountant=accountant, private=private)


def adapter_plan(sizes: list[int], epsilon: float, delta: float, *, epochs: float = RECIPE_EPOCHS,
                 accountant: str = "rdp", private: bool = True) -> Recommendation:
    """The adapters' plan (rules 1-6 of the module docstring); raises :class:`PlanRefused`."""
    sizes = [int(n) for n in sizes]
    if not sizes or any(n < 2 for n in sizes):
        raise ValueError(f"every silo needs at least 2 rows, got sizes {sizes}")
    if not (epsilon > 0 and 0 < delta < 1 and epochs > 0):
        raise ValueError(f"need epsilon > 0, 0 < delta < 1 and epochs > 0, got {epsilon}, {delta}, {epochs}")
    n_min, silos = min(sizes), len(sizes)
    b_rate = round(RECIPE_RATE * n_min)
    b_sum = math.ceil(MIN_SUMMED_BATCH / silos)
    b_cap = max(1, int(MAX_RATE * n_min))  # q <= 0.5
    b0 = max(1, min(max(b_rate, b_sum), b_cap))

    def plan_at(b: int):
        steps, local, rounds = _steps(epochs, b / n_min)
        sigma = calibrate_noise_multiplier(b / n_min, local * rounds, epsilon, delta, accountant)
        return steps, local, rounds, sigma, sigma / (b * math.sqrt(silos))

    b = b0
    steps, local, rounds, sigma, ratio = plan_at(b)
    ratio0 = ratio
    for rate in RATE_GRID if private else ():
        if ratio <= NOISE_RATIO_LIMIT:
            break
        candidate = min(b_cap, round(rate * n_min))
        if candidate <= b:
            continue
        raised = plan_at(candidate)
        if raised[3] > MAX_NOISE_MULTIPLIER:  # sigma: a raise never turns a feasible plan into a refused one
            break
        b, (steps, local, rounds, sigma, ratio) = candidate, raised
    q = b / n_min
    reasons = [
        f"epochs E = {epochs:g} of the smallest silo ({n_min} rows)",
        f"b0 = {b0}: max(0.09 x n_min = {b_rate}, 1,000 summed over {silos} silos = {b_sum}), at most n_min/2; "
        f"its noise per step sigma/(b sqrt N) = {ratio0:.3g}, {ratio0 / RECIPE_NOISE_RATIO:.2g}x the SST-2 recipe's",
        (f"b = {b}: q = b/n_min = {q:.4f}, summed batch {silos * b}"
         + ("" if b == b0 else f", raised from b0 to bring the noise per step to {ratio:.3g} "
            f"({ratio / RECIPE_NOISE_RATIO:.2g}x the recipe's)")
         + ("" if private else "; b0 kept: the noise rule answers the noise, and a non-private run has none")
         + ("" if ratio <= NOISE_RATIO_LIMIT or not private else
            "; still above the recipe's at q = 0.5: expect a gap to the non-private run at the same compute "
            "(more rows per silo or more silos close it; a larger epsilon lowers the noise but not the few steps q = 0.5 "
            "leaves: RESULTS.md, \"Other tasks\")")),
        f"S = ceil(E/q) = {steps} steps: L = {local} local steps x T = {rounds} rounds",
        f"sigma = {sigma:.4f}: calibrated for q, L*T = {local * rounds} steps, epsilon {epsilon:g}, delta {delta:g} ({accountant})",
        f"clip C = {CLIP}: at or below the median per-example norm at the initial adapters (0.037 on SST-2)",
        f"lr = 0.0175 x sqrt({silos * b} / 6000) = {RECIPE_LR * math.sqrt(silos * b / RECIPE_SUMMED_BATCH):.4g} "
        "(Adam's square-root rule from the SST-2 recipe)",
    ]
    if sigma > MAX_NOISE_MULTIPLIER:
        raise PlanRefused(_refusal(sizes, epsilon, delta, epochs, q, sigma, accountant))
    return Recommendation(batch_size=b, local_steps=local, rounds=rounds, noise_multiplier=sigma, clip=CLIP,
                          lr=round(RECIPE_LR * math.sqrt(silos * b / RECIPE_SUMMED_BATCH), 6), sample_rate=q,
                          epochs=epochs, summed_batch=silos * b, epsilon=epsilon, delta=delta,
                          reasons=tuple(reasons))


#: The head on frozen features (``train.what = "head"``; rules H1-H4 in :func:`head_plan`), measured
#: on the MNLI, QQP and SST-2 samples at 250 to 11,224 rows a silo (RESULTS.md, "Small silos").
HEAD_RATE = 0.25
HEAD_STEPS = 100
HEAD_LOCAL_STEPS = 4
HEAD_LR = 0.1
HEAD_CLIP = 1.0
#: Rule 0: the adapters are chosen only where the recipe's shape of plan (b0, E epochs: rules 1-4
#: without the raise) puts at most this many times the ε = 8 recipe's noise on a step, over at
#: least MIN_ADAPTER_STEPS steps; elsewhere the head. Measured: at 1.0x (ε 8, 11,224 rows a silo)
#: and 1.64x (ε 3, the same silos) the adapters beat the head's non-private ceiling (0.829, 0.822
#: against 0.809 on SST-2); at 2.2x (ε 8, 5,000 rows) 0.807 against the head's 0.800 on SST-2; at
#: 6.1x (ε 8, 1,666 rows) a tie on SST-2 (0.786 / 0.791) and 5-15 points behind on MNLI and QQP.
#: 2x is a margin above the measured successes: the one nearer measurement is SST-2's, the task on
#: which the head's features are weakest, and MNLI and QQP have no rows to measure there.
ADAPTER_NOISE_LIMIT = 2.0
MIN_ADAPTER_STEPS = 48


def head_plan(sizes: list[int], epsilon: float, delta: float, *, accountant: str = "rdp",
              private: bool = True) -> Recommendation:
    """The plan for a linear head on the frozen sentence features (training/features.py):

    H1. **q = 0.25**: b = ⌈0.25·n_min⌉ (at least 1); a convex model with F·K coordinates learns from
        a quarter of the silo per step, and its noise per coordinate σC/b stays far below its
        gradient's (b in the hundreds where the adapters need thousands).
    H2. **S = 100 steps**, L = 4 local steps, T = 25 rounds; halved (down to 12) while σ would
        exceed :data:`MAX_NOISE_MULTIPLIER`. Compute: one encoder pass per row (the features,
        computed once per silo), then 100 steps of a matrix product: seconds, within any epochs
        budget of at least one epoch.
    H3. **C = 1**: at or below every example's gradient norm at the zero-initialised head, whatever
        the rows: the features are L2-normalised (pairs: [u, v, |u−v|, u·v] of unit u, v), so
        ‖g_i‖ = ‖p_i − y_i‖·√(‖x_i‖² + 1) ≥ √(1 − 1/K)·√2 ≥ 1 for every class count K ≥ 2.
    H4. **Adam at lr 0.1**, cosine over the rounds: Adam's steps do not scale with C or b.

    Chosen on rows the results do not report (RESULTS.md, "Small silos"): 1,000 rows carved from
    each task's train split (MNLI, QQP and SST-2 samples; ``benchmarks.small_silos --carve 1000
    --plan grid``), 27 settings (q 0.1 / 0.25 / 0.5, S 50 / 100 / 200, lr 0.02 / 0.05 / 0.1), 2
    seeds: q = 0.25, S = 100 at lr 0.1 is within 0.5 points of each task's best setting (at lr
    0.05, the rule before, within 1.15); no setting is best on every task."""
    sizes = [int(n) for n in sizes]
    if not sizes or any(n < 2 for n in sizes):
        raise ValueError(f"every silo needs at least 2 rows, got sizes {sizes}")
    if not (epsilon > 0 and 0 < delta < 1):
        raise ValueError(f"need epsilon > 0 and 0 < delta < 1, got {epsilon}, {delta}")
    n_min, silos = min(sizes), len(sizes)
    b = max(1, math.ceil(HEAD_RATE * n_min))
    q = b / n_min
    steps = HEAD_STEPS
    while True:
        local = min(HEAD_LOCAL_STEPS, steps)
        rounds = math.ceil(steps / local)
        sigma = calibrate_noise_multiplier(q, local * rounds, epsilon, delta, accountant)
        if sigma <= MAX_NOISE_MULTIPLIER or steps <= 12:
            break
        steps //= 2
    if private and sigma > MAX_NOISE_MULTIPLIER:
        from .accounting.silo import dp_sgd_epsilon

        fit = dp_sgd_epsilon([(q, MAX_NOISE_MULTIPLIER, local * rounds)], delta, accountant)
        raise PlanRefused(f"epsilon {epsilon:g} is too small for the head on silos of {n_min}..{max(sizes)} rows: "
                          f"{local * rounds} steps at q = {q:.3g} need sigma {sigma:.2f} > {MAX_NOISE_MULTIPLIER:g}; "
                          f"what would fit: epsilon >= {fit:.3g}")
    reasons = [
        f"b = ceil(0.25 x n_min = {n_min}) = {b}: q = {q:.4f}, summed batch {silos * b}",
        f"S = {local * rounds} steps: L = {local} local steps x T = {rounds} rounds"
        + ("" if steps == HEAD_STEPS else f" (halved from {HEAD_STEPS} to keep sigma <= {MAX_NOISE_MULTIPLIER:g})"),
        f"sigma = {sigma:.4f}: calibrated for q, {local * rounds} steps, epsilon {epsilon:g}, delta {delta:g} ({accountant})"
        + ("" if private else "; not applied: a non-private run at the same compute"),
        f"clip C = {HEAD_CLIP:g}: at or below every example's gradient norm at the zero head (unit-norm features)",
        f"lr = {HEAD_LR:g} (Adam, cosine over the rounds)",
        "compute: one encoder pass per row (its features, cached per silo), then the head's steps (seconds)",
    ]
    return Recommendation(batch_size=b, local_steps=local, rounds=rounds, noise_multiplier=sigma, clip=HEAD_CLIP,
                          lr=HEAD_LR, sample_rate=q, epochs=local * rounds * q, summed_batch=silos * b,
                          epsilon=epsilon, delta=delta, reasons=tuple(reasons), what="head")


def choose_what(sizes: list[int], epsilon: float, delta: float, *, epochs: float = RECIPE_EPOCHS,
                accountant: str = "rdp", private: bool = True) -> Recommendation:
    """Rule 0, what to train: **the adapters** where the recipe's shape of plan for them (b0 and E
    epochs: rules 1-4 before the noise rule's raise) puts at most :data:`ADAPTER_NOISE_LIMIT` times
    the ε = 8 SST-2 recipe's noise on a step (σ/(b√N)) over at least :data:`MIN_ADAPTER_STEPS`
    steps, as the recipe did at 11,224 rows a silo at ε 8 (1.0x: 0.829) and ε 3 (1.64x: 0.822),
    above the head's non-private 0.809 on SST-2; **the head on frozen features** otherwise: at
    1,500-1,667 rows a silo (6.1x at ε 8) the adapters fell behind the head or tied it (MNLI 0.502
    against the head's 0.557, QQP 0.652 (the majority) against 0.797, SST-2 0.786 against 0.787;
    RESULTS.md, "Small silos"). The rule reads the shard sizes, N, ε, δ and the
    epochs, nothing of the rows. The non-private plan (``private=False``) follows the private one's
    choice."""
    silos = len(sizes)
    try:
        shape = adapter_plan(sizes, epsilon, delta, epochs=epochs, accountant=accountant, private=False)
        ratio = shape.noise_multiplier / (shape.batch_size * math.sqrt(silos))
        steps = shape.local_steps * shape.rounds
        meets = ratio <= ADAPTER_NOISE_LIMIT * RECIPE_NOISE_RATIO and steps >= MIN_ADAPTER_STEPS
        why = (f"the adapters' plan at b0 = {shape.batch_size} has {steps} steps at {ratio / RECIPE_NOISE_RATIO:.2g}x the "
               f"SST-2 recipe's noise per step (sigma/(b sqrt N)); the adapters need at most "
               f"{ADAPTER_NOISE_LIMIT:g}x over at least {MIN_ADAPTER_STEPS} steps")
    except PlanRefused:
        meets, why = False, "the adapters' plan is refused at this epsilon (sigma above the rules' limit)"
    if meets:
        plan = adapter_plan(sizes, epsilon, delta, epochs=epochs, accountant=accountant, private=private)
        head = ("train.what = adapters: " + why + ": met (on smaller silos, or at a smaller epsilon, the head on "
                "frozen features is chosen)")
    else:
        plan = head_plan(sizes, epsilon, delta, accountant=accountant, private=private)
        head = ("train.what = head (a linear head on the encoder's frozen sentence features): " + why
                + ": not met, so the adapters would trail the head (RESULTS.md, \"Small silos\")")
    return Recommendation(**{**plan.to_dict(), "reasons": (head, *plan.reasons)})


def _refusal(sizes, epsilon, delta, epochs, q, sigma, accountant) -> str:
    from .accounting.silo import dp_sgd_epsilon

    _, local, rounds = _steps(epochs, q)
    eps_fit = dp_sgd_epsilon([(q, MAX_NOISE_MULTIPLIER, local * rounds)], delta, accountant)
    lo, hi = 0.0, epochs  # the most epochs at this epsilon: bisection on sigma(E) <= MAX
    for _ in range(30):
        mid = (lo + hi) / 2
        _, lm, rm = _steps(mid, q) if mid > 0 else (1, 1, 1)
        if mid > 0 and dp_sgd_epsilon([(q, MAX_NOISE_MULTIPLIER, lm * rm)], delta, accountant) <= epsilon:
            lo = mid
        else:
            hi = mid
    fits = f"at most {lo:.2g} epochs at epsilon {epsilon:g}" if lo * 1 / q >= 1 else "no epochs at this epsilon"
    return (f"epsilon {epsilon:g} is too small for {epochs:g} epochs on silos of {min(sizes)}..{max(sizes)} rows: it "
            f"needs sigma {sigma:.2f} > {MAX_NOISE_MULTIPLIER:g}; what would fit: epsilon >= {eps_fit:.3g} at "
            f"{epochs:g} epochs, or {fits}")


def render(rec: Recommendation) -> str:
    lines = [f"recommended (epsilon {rec.epsilon:g}, delta {rec.delta:g}; public rules, no privacy spent):",
             f"  train.what = {rec.what}",
             f"  train.batch-size = {rec.batch_size}   train.local-steps = {rec.local_steps}   "
             f"num-server-rounds = {rec.rounds}",
             f"  noise multiplier sigma = {rec.noise_multiplier:.4f}   dp.clip = {rec.clip}   train.lr = {rec.lr:g}",
             "why:"] + [f"  - {r}" for r in rec.reasons]
    sets = " ".join(f"--set {k}={v!r}" if isinstance(v, str) else f"--set {k}={v}"
                    for k, v in rec.overrides().items() if k.startswith(("train.", "num-", "dp.clip", "dp.head-clip")))
    lines.append(f"run it: fedpower-run --set train.auto=true (or {sets})")
    return "\n".join(lines)


def auto_settings(cfg, sizes: list[int], explicit=()) -> tuple[dict, list[str]]:
    """``train.auto``: the plan's run-config keys for a run of ``cfg`` over silos of ``sizes`` (a key
    in ``explicit``, set by hand, is kept), and the lines that say what was chosen and why. A
    non-private run gets the same compute as the private one at dp.epsilon would: the same epochs,
    at the batch b0 (the rules without the noise rule; its L, T and lr follow from b0)."""
    if cfg.dp_enabled and not (cfg["dp.level"] == "sample" and cfg["dp.noise-at"] == "silo"):
        raise ValueError("train.auto plans DP-SGD on the silos: it needs dp.level = 'sample' and dp.noise-at = 'silo' "
                         "(or dp.level = 'none' for the non-private run at the same compute)")
    what = cfg["train.what"] if "train.what" in explicit else "auto"
    if what == "head-then-adapters":
        raise ValueError("train.auto plans train.what = 'adapters' or 'head' (or chooses between them); "
                         "head-then-adapters takes its keys by hand")
    plan = recommend(sizes, cfg["dp.epsilon"], cfg["dp.delta"], epochs=cfg["train.epochs"],
                     accountant=cfg["dp.accountant"], private=cfg.dp_enabled, what=what)
    chosen = plan.overrides(train_head=cfg["model.train-head"])
    kept = {k: cfg[k] for k in chosen if k in explicit}
    settings = {k: v for k, v in chosen.items() if k not in explicit}
    lines = [f"train.auto: {', '.join(f'{k}={v}' for k, v in settings.items())}"
             + (f" (kept as set: {', '.join(f'{k}={v}' for k, v in kept.items())})" if kept else "")
             + ("" if cfg.dp_enabled else f" -- the epochs of the private plan at epsilon {cfg['dp.epsilon']:g}, "
                "at the batch b0 (the noise rule does not apply without noise)")]
    lines += [f"train.auto: {r}" for r in plan.reasons]
    lines += [f"train.auto: {line}" for line in imbalance_notes(cfg, settings.get("train.what", cfg["train.what"]))]
    return settings, lines


def imbalance_notes(cfg, what: str) -> list[str]:
    """What the plan says when the lead metric (``task.metric``) is macro-F1 or balanced accuracy:
    a loss that counts examples rewards the majority answer, and the rules read no label count of a
    silo, so the classes' shares must be declared (``train.class-prior``, public)."""
    if cfg["task.metric"] == "accuracy":
        return []
    if not cfg["train.class-prior"].strip():
        return [f"task.metric = {cfg['task.metric']} but no train.class-prior: the loss counts examples, so a rare class "
                "weighs little and the majority answer is rewarded; declare the classes' public shares "
                "(train.class-prior = \"0.85,0.15\") for a loss in which every class weighs the same"]
    if what != "head":
        return [f"train.class-prior weighs the head's rounds only; train.what = {what} trains the adapters with the "
                "plain loss"]
    return [f"train.class-prior = {cfg['train.class-prior']}: each class weighs the same in the head's loss (weights "
            "applied after the clip, at most 1: no privacy cost)"]
