"""What a run releases: the privacy plan, its round schedule, per-block sensitivities and noise.

* :class:`PrivacyPlan`: everything the accountant needs about a run (validated, names normalised);
* sampling rates: :func:`inclusion_probability`, :func:`sample_rate_pi`;
* :func:`round_schedule`: the round type released in each round (FedPower refactorises every F rounds);
* :func:`block_sensitivities`, :func:`noise_stds`, :func:`effective_z`: the Gaussian blocks of a
  round and the single effective noise multiplier the accountants work with;
* :func:`round_event`: a round type under a noise specification, as an accountant's
  :class:`~fedpower_app.privacy.accounting.interface.RoundEvent`.

A *noise specification* is ``("z", z)``: rigorous, every round has effective multiplier z (the
noise of the linear releases scaled to the realised k at sample level), or ``("sigma", sigma_alg)``:
the paper's convention, a fixed per-entry std ``sigma_alg * C`` on every block of every round.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

from ._common import (
    ACCOUNTANTS,
    CALIBRATIONS,
    LEVELS,
    METHODS,
    SAMPLE_MODES,
    _check_level,
    _check_prob,
    CLIENT_REFACTORIZATIONS,
    DELTA_ROUND_TYPES,
    _check_round_type,
    _is_int,
    _norm_name,
)
from strategies.privacy_contract import sample_rate
from strategies import mechanisms as MECH  # each mechanism's blocks, sensitivities and schedule: one home

from .interface import RoundEvent
from .pld import DEFAULT_PLD_INTERVAL

#: Round type released every round by the non-FedPower methods (whole adapters).
METHOD_ROUND_TYPE = dict(MECH.METHOD_RELEASE)

#: Names of the released blocks per round type (same order as block_sensitivities / noise_stds).
BLOCK_NAMES = {name: m.blocks for name, m in MECH.MECHANISMS.items()}

#: Round types whose released blocks have a sensitivity that does not depend on k.
_K_INDEPENDENT = tuple(name for name, m in MECH.MECHANISMS.items() if not m.k_dependent)


# --------------------------------------------------------------------------------------------
# Sampling rates and schedule
# --------------------------------------------------------------------------------------------


def inclusion_probability(q_s: float, local_steps: int) -> float:
    """Probability that an example is used at least once in ``L`` Poisson batches of rate ``q_s``.

    ``pi = 1 - (1 - q_s)^L`` (computed stably). Spec test vector:
    ``inclusion_probability(128/(67349/6), 5) = 0.0557308310526925``.
    """
    q = _check_prob(q_s, "q_s", allow_zero=True)
    if not _is_int(local_steps) or int(local_steps) <= 0:
        raise ValueError(f"local_steps must be a positive integer, got {local_steps!r}")
    if q == 1.0:
        return 1.0
    return float(-math.expm1(int(local_steps) * math.log1p(-q)))


def sample_rate_pi(client_sizes: Sequence[int], batch_size: int, local_steps: int) -> float:
    """Per-round inclusion probability of an example given its client participates.

    ``pi = max_i [1 - (1 - min(1, b/n_i))^L]``: the smallest client determines it.
    """
    if client_sizes is None or len(client_sizes) == 0:
        raise ValueError("client_sizes must be a non-empty list of client dataset sizes")
    if not _is_int(batch_size) or int(batch_size) <= 0:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if not _is_int(local_steps) or int(local_steps) <= 0:
        raise ValueError(f"local_steps must be a positive integer, got {local_steps!r}")
    best = 0.0
    for i, n in enumerate(client_sizes):
        try:
            nv = float(n)
        except (TypeError, ValueError):
            raise ValueError(f"client_sizes[{i}] must be a positive number, got {n!r}")
        if not (math.isfinite(nv) and nv > 0):
            raise ValueError(f"client_sizes[{i}] must be > 0, got {n!r}")
        q_s = sample_rate(int(batch_size), nv)
        best = max(best, inclusion_probability(q_s, int(local_steps)))
    return best


def round_schedule(method: str, num_rounds: int, refactor_every: int = 1, level: str = "sample",
                   refactorization: str = "powerdp-l") -> list:
    """Round type released in each round t = 1..T (``strategies.mechanisms.round_type``, the
    schedule the strategy itself follows).

    ``fedpower``: PowerDP on rounds with ``t % F == 0`` (every round when F == 1), FedLoRA release
    otherwise. Other methods release the same round type every round (``refactor_every`` ignored).
    At client level every release is of the round's delta; FedPower refactorizes with
    ``refactorization`` (PowerDP-L, or the paper's PowerDP as an ablation).
    """
    m = _norm_name(method, METHODS, "method")
    lvl = _check_level(level)
    ref = _norm_name(refactorization, CLIENT_REFACTORIZATIONS, "client refactorization")
    if not _is_int(num_rounds) or int(num_rounds) <= 0:
        raise ValueError(f"num_rounds must be a positive integer, got {num_rounds!r}")
    if not _is_int(refactor_every) or int(refactor_every) <= 0:
        raise ValueError(f"refactor_every must be a positive integer, got {refactor_every!r}")
    F = int(refactor_every) if m == "fedpower" else 1
    return [MECH.round_type(m, t, refactor_every=F, level=lvl, refactorization=ref)
            for t in range(1, int(num_rounds) + 1)]


def _schedule_counts(schedule: Sequence[str]) -> dict:
    """Number of rounds of each type, types in sorted order (a deterministic composition order)."""
    counts: dict = {}
    for rt in schedule:
        counts[rt] = counts.get(rt, 0) + 1
    return {rt: counts[rt] for rt in sorted(counts)}


# --------------------------------------------------------------------------------------------
# Sensitivities and noise
# --------------------------------------------------------------------------------------------


def _check_k(k) -> Optional[float]:
    """k: a count of aggregated clients (non-negative integer) or the fixed denominator m = q_c N
    (a positive real) that the server-noised sample-level averages divide by."""
    if k is None:
        return None
    if _is_int(k) and int(k) >= 0:
        return int(k)
    if isinstance(k, float) and math.isfinite(k) and k > 0:
        return k
    raise ValueError(f"k (number of aggregated clients, or the fixed m = q_c N) must be a non-negative integer "
                     f"or a positive number, got {k!r}")


def block_sensitivities(
    round_type: str,
    level: str,
    clip: float,
    *,
    k: Optional[int] = None,
    rank: int = 8,
    num_modules: int = 1,
    denominator: Optional[float] = None,
    iters: int = 1,
) -> list:
    """L2 sensitivity of each released block of a round (add/remove adjacency).

    Client-level delta releases (``DELTA_ROUND_TYPES``) average clipped round deltas with the fixed
    ``denominator`` m = q_c N, so one client moves the average by at most C/m:
    ``powerdp-l`` releases 2 blocks (Y, X) per power iteration (``iters``), each C/m (adaptive
    composition of 1-Lipschitz Gaussian releases, privacy-accounting spec §3.2); ``fedlora-delta`` one block (the
    jointly clipped (dA, dB, head)), ``ffa-delta`` and ``input-delta`` one block, each C/m.

    ========== ============================== ==========================
    round type sample level                   client level
    ========== ============================== ==========================
    powerdp    [2C, 2C] (diameter)            [2C, 2C]
    fedlora    [2C/k, 2C/k]                   [C, C] (random denominator)
    ffa        [2C/k]                         [C]
    input      [2C/k]                         [C]
    output     [2*sqrt(M*r), 2C]              [2*sqrt(M*r), 2C]
    ========== ============================== ==========================

    ``k`` is the number of clients whose reply was aggregated; ``None`` (worst case) and ``0``
    (empty round, noise still released) both use ``k = 1`` at sample level. ``k`` is ignored at
    client level (fixed noise, random denominator: do NOT scale the noise by k there).
    """
    rt = _check_round_type(round_type)
    lvl = _check_level(level)
    C = float(clip)
    if not (math.isfinite(C) and C > 0):
        raise ValueError(f"clip must be a positive finite number, got {clip!r}")
    kk = _check_k(k)
    if not _is_int(rank) or int(rank) <= 0:
        raise ValueError(f"rank must be a positive integer, got {rank!r}")
    if not _is_int(num_modules) or int(num_modules) <= 0:
        raise ValueError(f"num_modules must be a positive integer, got {num_modules!r}")
    return MECH.get(rt).sensitivities(MECH.SensitivityArgs(
        clip=C, level=lvl, k=kk, rank=int(rank), num_modules=int(num_modules), denominator=denominator,
        iters=int(iters) if _is_int(iters) else iters))


def noise_stds(
    round_type: str,
    level: str,
    z: float,
    clip: float,
    *,
    k: Optional[int] = None,
    rank: int = 8,
    num_modules: int = 1,
    denominator: Optional[float] = None,
    iters: int = 1,
) -> list:
    """Per-entry noise std of each block so that the round's effective multiplier equals ``z``.

    Equal z-share per block: ``s_j = sqrt(n_blocks) * z * Delta_j``. At sample level pass the
    realised ``k`` (linear releases scale with 1/k; ``k=0`` uses ``k=1``); at client level the
    value does not depend on k.
    """
    zz = float(z)
    if not (zz > 0) or math.isnan(zz):
        raise ValueError(f"z (noise multiplier) must be > 0, got {z!r}")
    sens = block_sensitivities(round_type, level, clip, k=k, rank=rank, num_modules=num_modules,
                               denominator=denominator, iters=iters)
    n = len(sens)
    return [math.sqrt(n) * zz * d for d in sens]


def effective_z(sensitivities: Sequence[float], stds: Sequence[float]) -> float:
    """Effective noise multiplier of several Gaussian blocks: ``(sum_j (Delta_j/s_j)^2)^(-1/2)``."""
    sens = [float(d) for d in sensitivities]
    sd = [float(s) for s in stds]
    if len(sens) != len(sd) or not sens:
        raise ValueError(
            f"sensitivities and stds must be non-empty and of equal length, got {len(sens)} and {len(sd)}"
        )
    total = 0.0
    for d, s in zip(sens, sd):
        if d < 0 or s < 0 or math.isnan(d) or math.isnan(s):
            raise ValueError(f"sensitivities and stds must be >= 0, got Delta={d}, s={s}")
        if d == 0:
            continue
        if s == 0:
            return 0.0
        total += (d / s) ** 2
    if total == 0:
        return math.inf
    return 1.0 / math.sqrt(total)


# --------------------------------------------------------------------------------------------
# Plan
# --------------------------------------------------------------------------------------------


@dataclass
class PrivacyPlan:
    """Everything the accountant needs about a run.

    ``client_sizes`` (one size per client), ``batch_size`` and ``local_steps`` are needed at sample
    level only. ``clip`` (server-side clip norm C of a client's whole update) only scales the noise
    stds, never epsilon. ``rank``/``num_modules`` matter for output perturbation only.
    """

    method: str
    level: str
    epsilon: float
    delta: float
    num_rounds: int
    client_rate: float
    num_clients: int
    client_sizes: Optional[list] = None
    batch_size: Optional[int] = None
    local_steps: int = 1
    clip: Optional[float] = None
    rank: int = 8
    num_modules: int = 1
    refactor_every: int = 1
    refactorization: str = "powerdp-l"  # client level, FedPower: "powerdp-l" or the paper's "powerdp"
    power_iters: int = 1  # power iterations per PowerDP-L release (each adds 2 noisy blocks)
    sample_mode: str = "two-stage"
    accountant: str = "rdp"
    calibration: str = "rigorous"
    pld_interval: float = DEFAULT_PLD_INTERVAL

    def __post_init__(self) -> None:
        self.method = _norm_name(self.method, METHODS, "method")
        self.level = _norm_name(self.level, LEVELS, "level")
        self.sample_mode = _norm_name(self.sample_mode, SAMPLE_MODES, "sample_mode")
        self.accountant = _norm_name(self.accountant, ACCOUNTANTS, "accountant")
        self.calibration = _norm_name(self.calibration, CALIBRATIONS, "calibration")

        def num(name: str, *, lo_open: float = 0.0) -> float:
            v = getattr(self, name)
            try:
                f = float(v)
            except (TypeError, ValueError):
                raise ValueError(f"{name} must be a number > {lo_open:g}, got {v!r}")
            if isinstance(v, bool) or not math.isfinite(f) or not f > lo_open:
                raise ValueError(f"{name} must be a finite number > {lo_open:g}, got {v!r}")
            return f

        def posint(name: str) -> int:
            v = getattr(self, name)
            if not _is_int(v) or int(v) <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
            return int(v)

        self.epsilon = num("epsilon")
        d = self.delta
        try:
            df = float(d)
        except (TypeError, ValueError):
            raise ValueError(f"delta must be in (0, 1), got {d!r}")
        if isinstance(d, bool) or not (0 < df < 1):
            raise ValueError(f"delta must be in (0, 1), got {d!r}")
        self.delta = df
        self.num_rounds = posint("num_rounds")
        c = self.client_rate
        try:
            cf = float(c)
        except (TypeError, ValueError):
            raise ValueError(f"client_rate must be in (0, 1], got {c!r}")
        if isinstance(c, bool) or not (math.isfinite(cf) and 0 < cf <= 1):
            raise ValueError(f"client_rate must be in (0, 1], got {c!r}")
        self.client_rate = cf
        self.num_clients = posint("num_clients")
        self.local_steps = posint("local_steps")
        if self.clip is None:
            raise ValueError("clip must be given (server clip norm C > 0), got None")
        self.clip = num("clip")
        self.rank = posint("rank")
        self.num_modules = posint("num_modules")
        self.refactor_every = posint("refactor_every")
        self.power_iters = posint("power_iters")
        self.refactorization = _norm_name(self.refactorization, CLIENT_REFACTORIZATIONS, "refactorization")
        self.pld_interval = num("pld_interval")
        if self.batch_size is not None:
            self.batch_size = posint("batch_size")
        if self.client_sizes is not None:
            sizes = list(self.client_sizes)
            if not sizes:
                raise ValueError("client_sizes must be a non-empty list of positive integers, got []")
            for i, n in enumerate(sizes):
                if not _is_int(n) or int(n) <= 0:
                    raise ValueError(f"client_sizes[{i}] must be a positive integer, got {n!r}")
            if len(sizes) != self.num_clients:
                raise ValueError(
                    f"client_sizes has {len(sizes)} entries but num_clients is {self.num_clients}"
                )
            self.client_sizes = [int(n) for n in sizes]
        if self.level == "sample":
            if self.client_sizes is None:
                raise ValueError("client_sizes is required at sample level (the server needs q_s = b/n_i)")
            if self.batch_size is None:
                raise ValueError("batch_size is required at sample level")

    @property
    def pi(self) -> Optional[float]:
        """Per-round inclusion probability of an example given its client participates (sample level)."""
        if self.level != "sample":
            return None
        return sample_rate_pi(self.client_sizes, self.batch_size, self.local_steps)

    @property
    def q_s(self) -> Optional[float]:
        """Largest per-step example sampling rate ``min(1, b/min n_i)`` (sample level)."""
        if self.level != "sample":
            return None
        return sample_rate(self.batch_size, min(self.client_sizes))

    @property
    def schedule(self) -> list:
        return round_schedule(self.method, self.num_rounds, self.refactor_every, self.level, self.refactorization)

    @property
    def denominator(self) -> Optional[float]:
        """The fixed denominator m = q_c N of the client-level delta averages (None at sample level)."""
        return self.client_rate * self.num_clients if self.level == "client" else None

    @property
    def expected_cohort(self) -> float:
        """m = q_c N, fixed before any round: the denominator of every server-noised average, at
        both levels, so that no noise std depends on how many replies arrived (docs/privacy.md §1.2)."""
        return self.client_rate * self.num_clients

    def sensitivities(self, round_type: str, k: Optional[int] = None) -> list:
        """``block_sensitivities`` of a round type of this plan."""
        return block_sensitivities(round_type, self.level, self.clip, k=k, rank=self.rank,
                                   num_modules=self.num_modules, denominator=self.denominator,
                                   iters=self.power_iters)

    def stds(self, round_type: str, z: float, k: Optional[int] = None) -> list:
        """``noise_stds`` of a round type of this plan at effective multiplier ``z``."""
        return noise_stds(round_type, self.level, z, self.clip, k=k, rank=self.rank, num_modules=self.num_modules,
                          denominator=self.denominator, iters=self.power_iters)

    def paper_q(self) -> float:
        """The paper's sampling rate in its sigma formula: q_c (client) or q_c * b/mean(n_i) (sample)."""
        if self.level == "client":
            return self.client_rate
        from strategies.privacy_contract import sample_rate

        qs = sample_rate(self.batch_size, sum(self.client_sizes) / len(self.client_sizes))
        return self.client_rate * qs

    def to_dict(self) -> dict:
        return asdict(self)


# --------------------------------------------------------------------------------------------
# A round type under a noise specification
# --------------------------------------------------------------------------------------------


def _fixed_noise_z(plan: PrivacyPlan, round_type: str, std: float, k: Optional[int]) -> float:
    sens = plan.sensitivities(round_type, k)
    return effective_z(sens, [std] * len(sens))


def _k_dependent(plan: PrivacyPlan, round_type: str) -> bool:
    return plan.level == "sample" and round_type not in _K_INDEPENDENT


def _type_z(plan: PrivacyPlan, round_type: str, noise: tuple) -> float:
    """Effective z of a round type (worst case k = 1 for fixed noise at sample level)."""
    kind, val = noise
    if kind == "z":
        return float(val)
    return _fixed_noise_z(plan, round_type, float(val) * plan.clip, 1)


def round_event(plan: PrivacyPlan, round_type: str, noise: tuple) -> RoundEvent:
    """The accountants' view of one round of ``round_type`` under ``noise``.

    Fixed noise at sample level makes a k-dependent round's z depend on the random number k of
    aggregated clients: a k-mixture over k = 1..N. Otherwise the round has one effective z.
    """
    kind, val = noise
    sampling = dict(level=plan.level, q_c=plan.client_rate, pi=plan.pi, sample_mode=plan.sample_mode)
    if kind == "sigma" and _k_dependent(plan, round_type):
        std = float(val) * plan.clip
        zs = tuple(_fixed_noise_z(plan, round_type, std, k) for k in range(1, plan.num_clients + 1))
        return RoundEvent(**sampling, z_of_k=zs)
    return RoundEvent(**sampling, z=_type_z(plan, round_type, noise))
