"""Every privacy mechanism of a round, one object each (pure python/torch, no Flower).

A :class:`Mechanism` is what one round releases, with everything the rest of the project needs
to know about it: its name (the round type written to results.json), where the noise is added
(``"server"`` or ``"silo"``), the levels it is valid at, its released blocks, the L2 sensitivity
of each block, whether that sensitivity depends on the number k of aggregated silos, and the
release function (the math in ``releases.py`` / ``client_delta.py``). The accountant
(``fedpower_app.privacy.accounting.plan``) reads sensitivities and k-dependence from here, the strategy
(``strategies/flower.py``) calls ``release`` from here, and :func:`round_type` is the one round
schedule both use. Adding a mechanism is one entry in :data:`MECHANISMS` (and its math); adding a method, one
entry in :data:`METHODS`.

DP-SGD on the silos is the mechanism ``"dp-sgd"``: the noise is added in every silo's local steps
(``fedpower_app.training.dp_sgd``); the server's average, merge and refactorization of the noised replies
are then post-processing (the ``fedpower``/``fedlora``/``ffa`` releases with zero noise).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import importlib


class _Lazy:
    """A module of release math, imported at its first use: the mechanisms' metadata (names,
    sensitivities, schedule) stays importable without torch, so the accounting package that reads
    it imports no torch (fedpower_app/privacy/accounting/__init__.py)."""

    def __init__(self, name: str) -> None:
        self._name, self._module = name, None

    def __getattr__(self, attr: str):
        if self._module is None:
            self._module = importlib.import_module(self._name, __package__)
        return getattr(self._module, attr)


CD = _Lazy(".client_delta")
SVD = _Lazy(".fedsvd")
R = _Lazy(".releases")


@dataclass(frozen=True)
class SensitivityArgs:
    """Inputs of a sensitivity formula: clip C, level, realised k (None = worst case), rank r,
    number of LoRA modules M, fixed denominator m = q_c N (client-level deltas), power iterations,
    and the DP-SGD head clip C_h."""

    clip: float
    level: str
    k: Optional[int] = None
    rank: int = 8
    num_modules: int = 1
    denominator: Optional[float] = None
    iters: int = 1
    head_clip: float = 0.0


@dataclass(frozen=True)
class ReleaseArgs:
    """What a release needs besides the updates, the context, the stds and the generator."""

    glob: tuple = field(default=({}, {}))  # (A_g, B_g) by module: the public global (client-level deltas)
    # The fixed m = q_c N of a server-noised average (client-level deltas; sample-level k-dependent
    # releases). None: the mean over the realised k (no server noise: DP-SGD, or non-private).
    denominator: Optional[float] = None


@dataclass(frozen=True)
class Mechanism:
    name: str
    noise_at: str                 # "server" | "silo"
    levels: tuple                 # privacy levels at which it is a valid release
    blocks: tuple                 # released blocks (per power iteration for powerdp-l)
    sensitivity: Callable[[SensitivityArgs], list]
    k_dependent: bool             # sample level: an average whose sensitivity scales with 1/k; with server noise
                                  # it averages over the fixed m = q_c N (ReleaseArgs.denominator), never the realised k
    release: Optional[Callable] = None  # (updates, ctx, stds, generator, ReleaseArgs) -> Release
    doc: str = ""

    def sensitivities(self, args: SensitivityArgs) -> list:
        if args.level not in self.levels:
            raise ValueError(f"round type {self.name!r} is a {'/'.join(self.levels)}-level release"
                             + (" of round deltas" if self.name in DELTA_MECHANISMS else "")
                             + f", not {args.level}")
        return [float(d) for d in self.sensitivity(args)]


def _linear(args: SensitivityArgs) -> float:
    """A linear average of clipped whole adapters: 2C/k given k (sample), C (client, random k)."""
    if args.level == "sample":
        k = 1 if not args.k else args.k
        return 2.0 * args.clip / k
    return args.clip


def _fixed(args: SensitivityArgs) -> float:
    """A client-level average of clipped round deltas over the fixed denominator m: C/m."""
    m = args.denominator
    if m is None or not (math.isfinite(float(m)) and float(m) > 0):
        raise ValueError(f"needs the fixed denominator m = q_c N > 0, got {m!r}")
    return args.clip / float(m)


def _powerdp_diameter(args: SensitivityArgs) -> list:
    """The paper's PowerDP: each released factor is normalised, its sensitivity its diameter 2C
    (the input average has norm <= C: whole adapters, or a delta averaged over the replies)."""
    return [2.0 * args.clip, 2.0 * args.clip]


def _output_diameters(args: SensitivityArgs) -> list:
    """Output perturbation: A (orthonormal rows of M modules, rank r) and B (norm <= C) by diameter."""
    return [2.0 * math.sqrt(args.num_modules * args.rank), 2.0 * args.clip]


def _iters(args: SensitivityArgs) -> int:
    if not isinstance(args.iters, int) or args.iters <= 0:
        raise ValueError(f"iters must be a positive integer, got {args.iters!r}")
    return args.iters


def dp_sgd_sensitivity(clip: float, head_clip: float = 0.0) -> float:
    """One example's clipped gradient: C, or sqrt(C^2 + C_h^2) when a trained head is clipped apart."""
    return math.sqrt(clip * clip + head_clip * head_clip) if head_clip else float(clip)


def dp_sgd_phase_clips(what: str, clip: float, head_clip: float = 0.0) -> dict[str, float]:
    """Each phase's per-example clip when the silos train the head on frozen features
    (``train.what``): a head round clips the head to C_h (C when C_h = 0), an adapter round of
    head-then-adapters the adapters to C (the head frozen). Every round adds N(0, (σ·its clip)²):
    the Gaussian mechanism of multiplier σ in each phase. Empty for ``adapters`` runs."""
    if what == "adapters":
        return {}
    return {"head rounds": float(head_clip or clip),
            **({"adapter rounds": float(clip)} if what == "head-then-adapters" else {})}


def head_noise_ratio_problem(ratio: float, head_clip: float) -> Optional[str]:
    """Why ``ratio`` (``dp.head-noise-ratio``) is unusable with this head clip, or None."""
    if not (math.isfinite(ratio) and (ratio == 0 or ratio > 1)):
        return f"head noise ratio must be 0 or > 1 (0: one noise for both groups), got {ratio!r}"
    if ratio > 0 and not head_clip > 0:
        return "a head noise ratio > 0 needs the head clipped apart (head clip > 0)"
    return None


def dp_sgd_group_multipliers(sigma: float, clip: float, head_clip: float = 0.0,
                             head_noise_ratio: float = 0.0) -> tuple[float, float]:
    """The noise multipliers (sigma_a, sigma_h) of the adapters' and the head's clipped sums.

    A DP-SGD step releases the adapters' clipped sum + N(0, (sigma_a C)^2) and the head's + N(0,
    (sigma_h C_h)^2). Scaling group g by 1 / (sigma_g C_g), an invertible map, gives one Gaussian
    mechanism with unit noise and sensitivity sqrt(1/sigma_a^2 + 1/sigma_h^2); so the step is
    exactly the subsampled Gaussian of noise multiplier sigma (what the accountant counts) whenever
    1/sigma_a^2 + 1/sigma_h^2 = 1/sigma^2 (docs/privacy.md §0.1). Two ways to split it:

    * ``head_noise_ratio = 0`` (one noise): std sigma * sqrt(C^2 + C_h^2) on every coordinate, i.e.
      sigma_a = sigma Delta / C, sigma_h = sigma Delta / C_h;
    * ``head_noise_ratio = rho > 1``: sigma_h = rho sigma, sigma_a = sigma / sqrt(1 - 1/rho^2). A head
      whose gradients are large and few (770 coordinates for MiniLM) takes more noise per unit of its
      clip, so its clip can match its gradients without raising the adapters' noise: at rho = 4 the
      adapters carry 1.033 sigma, against sqrt(2) sigma with one noise and C_h = C.

    Without a head clipped apart (``head_clip = 0``): (sigma, 0), one group."""
    problem = head_noise_ratio_problem(head_noise_ratio, head_clip)
    if problem:
        raise ValueError(problem)
    if not head_clip:
        return float(sigma), 0.0
    if not head_noise_ratio:
        delta = dp_sgd_sensitivity(clip, head_clip)
        return sigma * delta / clip, sigma * delta / head_clip
    rho = float(head_noise_ratio)
    return sigma / math.sqrt(1.0 - 1.0 / (rho * rho)), rho * sigma


def dp_sgd_noise_stds(sigma: float, clip: float, head_clip: float = 0.0,
                      head_noise_ratio: float = 0.0) -> tuple[float, float]:
    """The noise std on the adapters' and on the head's clipped sum of a step: (sigma_a C, sigma_h C_h)."""
    sigma_a, sigma_h = dp_sgd_group_multipliers(sigma, clip, head_clip, head_noise_ratio)
    return sigma_a * clip, sigma_h * head_clip


BOTH = ("sample", "client")

MECHANISMS: dict[str, Mechanism] = {m.name: m for m in (
    # -- the paper's mechanisms on the silos' whole clipped adapters (server-side noise) ----------
    Mechanism("powerdp", "server", BOTH, ("B_tilde", "A_tilde"), _powerdp_diameter, False,
              lambda u, ctx, s, g, x: R.fedpower_release(u, ctx, s[0], g),
              "PowerDP (paper Alg. 1): diameter 2C per released factor"),
    Mechanism("fedlora", "server", BOTH, ("A_avg", "B_avg"), lambda a: [_linear(a)] * 2, True,
              lambda u, ctx, s, g, x: R.fedlora_release(u, ctx, s[0], s[1], g, x.denominator), "FedLoRA: A and B averaged"),
    Mechanism("ffa", "server", BOTH, ("B_avg",), lambda a: [_linear(a)], True,
              lambda u, ctx, s, g, x: R.ffa_release(u, ctx, s[0], g, x.denominator), "FFA-LoRA: B averaged, A frozen"),
    Mechanism("input", "server", BOTH, ("W",), lambda a: [_linear(a)], True,
              lambda u, ctx, s, g, x: R.input_perturbation_release(u, ctx, s[0], g, x.denominator), "input perturbation"),
    Mechanism("output", "server", BOTH, ("A", "B"),
              _output_diameters, False,
              lambda u, ctx, s, g, x: R.output_perturbation_release(u, ctx, s[0], s[1], g), "output perturbation"),
    # -- client level, on round deltas, fixed denominator (strategies/client_delta.py) -------------
    Mechanism("powerdp-l", "server", ("client",), ("Y", "X"), lambda a: [_fixed(a)] * (2 * _iters(a)), False,
              lambda u, ctx, s, g, x: CD.powerdp_l_release(u, ctx, x.glob, s[0], g, x.denominator),
              "PowerDP-L: noise inside the warm-started power iteration (spec 3.2)"),
    Mechanism("fedlora-delta", "server", ("client",), ("dAB",), lambda a: [_fixed(a)], False,
              lambda u, ctx, s, g, x: CD.fedlora_delta_release(u, ctx, x.glob, s[0], g, x.denominator),
              "FedLoRA on (dA, dB, dhead) jointly clipped"),
    Mechanism("ffa-delta", "server", ("client",), ("dB",), lambda a: [_fixed(a)], False,
              lambda u, ctx, s, g, x: CD.ffa_delta_release(u, ctx, x.glob, s[0], g, x.denominator),
              "FFA-LoRA on (dB, dhead)"),
    Mechanism("input-delta", "server", ("client",), ("dW",), lambda a: [_fixed(a)], False,
              lambda u, ctx, s, g, x: CD.input_delta_release(u, ctx, x.glob, s[0], g, x.denominator),
              "input perturbation of B_g A_g + average delta"),
    # the paper's factor-noise releases on the round's averaged delta (ablations; random
    # denominator, so the average has norm <= C and their diameter sensitivities hold unchanged)
    Mechanism("powerdp-delta", "server", ("client",), ("B_tilde", "A_tilde"), _powerdp_diameter,
              False, lambda u, ctx, s, g, x: CD.powerdp_delta_release(u, ctx, x.glob, s[0], g),
              "the paper's PowerDP on the averaged round delta: diameter 2C per released factor"),
    Mechanism("output-delta", "server", ("client",), ("A", "B"),
              _output_diameters, False,
              lambda u, ctx, s, g, x: CD.output_delta_release(u, ctx, x.glob, s[0], s[1], g),
              "output perturbation on the averaged round delta"),
    # -- FedSVD (strategies/fedsvd.py): post-processing of the silos' DP-SGD replies (or non-private) ----
    Mechanism("fedsvd", "silo", ("sample",), ("B_avg A_g, refactorized by SVD",), lambda a: [], False,
              lambda u, ctx, s, g, x: SVD.fedsvd_release(u, ctx, x.glob),
              "FedSVD: B averaged, B_avg A_g refactorized by SVD into a new orthonormal A (no server noise)"),
    # -- DP-SGD inside every silo (fedpower_app.training.dp_sgd): the server's release is post-processing ---
    Mechanism("dp-sgd", "silo", ("sample",), ("clipped per-example gradient sum",),
              lambda a: [dp_sgd_sensitivity(a.clip, a.head_clip)], False, None,
              "DP-SGD: per-example clip C (head C_h), Gaussian noise on each step's sum (dp_sgd_noise_stds)"),
)}

#: The paper's releases of whole clipped adapters, and the client-level releases of round deltas.
WHOLE_ADAPTER_MECHANISMS = ("powerdp", "fedlora", "ffa", "input", "output")
DELTA_MECHANISMS = ("powerdp-l", "fedlora-delta", "ffa-delta", "input-delta", "powerdp-delta", "output-delta")

# -- the methods (strategy.name) ------------------------------------------------------------------
@dataclass(frozen=True)
class Method:
    """A server strategy: what its rounds release and what its silos train. One entry in
    :data:`METHODS` (and its release math) is all a new method needs: the config's choices
    (``fedpower_app.choices.STRATEGIES``), the round engine and the Flower strategy read it here."""

    name: str
    release: str                 # the release of a round that does not refactorize (a MECHANISMS key)
    trains: str = "AB"           # what a silo trains and sends back: "AB", or "B" against the global A
    family: str = ""             # the engine it runs on (FedPower's ablations are FedPower); default: itself
    silo_noise_only: bool = False  # defined only with DP-SGD on the silos, or without DP (no server noise)
    needs_global: bool = False   # the release reads the round's public global factors
    accounted: bool = True       # the server-side accountant can plan it (server noise / client level)

    @property
    def engine(self) -> str:
        return self.family or self.name


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("fedpower", "fedlora", family="fedpower"),  # refactorizes with PowerDP every F-th round
    Method("fedlora", "fedlora"),
    Method("ffa-lora", "ffa", trains="B"),
    Method("fedsvd", "fedsvd", trains="B", silo_noise_only=True, needs_global=True, accounted=False),
    Method("input-perturbation", "input", family="fedpower"),
    Method("output-perturbation", "output", family="fedpower"),
)}

# -- the round schedule --------------------------------------------------------------------------
#: Each method's release when it does not refactorize (FedPower refactorizes every F-th round).
METHOD_RELEASE = {name: m.release for name, m in METHODS.items() if name != "fedpower"}
#: Client level: the delta release of each whole-adapter release.
CLIENT_RELEASE = {"fedlora": "fedlora-delta", "ffa": "ffa-delta", "input": "input-delta", "output": "output-delta"}
#: Client level: FedPower's refactorization (strategy.client-refactorization) -> its delta release.
CLIENT_REFACTORIZATION = {"powerdp-l": "powerdp-l", "powerdp": "powerdp-delta"}


def round_type(method: str, server_round: int, *, refactor_every: int = 1, level: str = "sample",
               refactorization: str = "powerdp-l") -> str:
    """What ``method`` releases in round t (the one schedule the strategy and the accountant use).

    FedPower refactorizes with PowerDP when t % F == 0 (every round for F = 1) and releases as
    FedLoRA otherwise. At client level every release is the method's delta release, and FedPower
    refactorizes with ``refactorization`` (PowerDP-L, or the paper's PowerDP as an ablation)."""
    if method == "fedpower":
        base = "powerdp" if (refactor_every == 1 or server_round % refactor_every == 0) else "fedlora"
    elif method in METHOD_RELEASE:
        base = METHOD_RELEASE[method]
    else:
        raise ValueError(f"unknown method {method!r}")
    if level != "client":
        return base
    if base == "powerdp":
        try:
            return CLIENT_REFACTORIZATION[refactorization]
        except KeyError:
            raise ValueError(f"unknown client-level refactorization {refactorization!r}; valid choices: "
                             f"{list(CLIENT_REFACTORIZATION)}") from None
    return CLIENT_RELEASE[base]


def get(name: str) -> Mechanism:
    try:
        return MECHANISMS[name]
    except KeyError:
        raise ValueError(f"unknown round type {name!r}; valid choices: {list(MECHANISMS)}") from None


# -- the server's round step (the strategy and the benchmarks both call this) ----------------------
LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"


def apply_release(global_state: dict, release) -> None:
    """Write a release into the global adapters (float32, CPU): new A and B, head deltas added."""
    import torch

    for name, A in release.A.items():
        global_state[name + LORA_A] = A.detach().to("cpu", torch.float32)
    for name, B in release.B.items():
        global_state[name + LORA_B] = B.detach().to("cpu", torch.float32)
    for key, delta in release.extra_delta.items():
        global_state[key] = global_state[key] + delta.detach().to("cpu", torch.float32)


def release_round(round_type: str, updates: list, *, ctx, stds, noise, server_round: int, global_state: dict,
                  extra: ReleaseArgs | None = None):
    """One round's release: the mechanism's release at the planned noise ``stds`` (the privacy
    layer's ``RoundPlan.noise_stds``), drawn from the round's generator, applied to
    ``global_state``. The strategy then commits the round to the privacy layer. Returns the release."""
    gen = noise.generator("release", server_round)  # a CPU generator: the same release on any device
    release = get(round_type).release(updates, ctx, list(stds), gen, extra or ReleaseArgs())
    apply_release(global_state, release)
    return release
