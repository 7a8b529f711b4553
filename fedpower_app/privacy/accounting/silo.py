"""Per-silo accounting of DP-SGD on the silos (sample-level DP, noise added where the data is).

A silo's examples are touched only in the rounds that silo trains. Each such round is L steps of
the Poisson-subsampled Gaussian mechanism on that silo's data, at rate q_k = b / n_k with noise
multiplier σ (add/remove one example). So after T_k trained rounds

    ε_k = ε( SGM(q_k, σ) composed L·T_k times, δ )

and the run's ε is max_k ε_k: every silo's data enjoys (ε_k, δ)-DP, and no silo's more than the
maximum. Other silos' data, client sampling and the server's merge/average/refactorization are
post-processing of the silos' noisy steps, so they cost nothing. No amplification by the secrecy
of client sampling is claimed.

Both the server and every silo keep such a ledger: the server's to plan and to stop sending rounds
to a silo at its budget, the silo's own (in Flower's ``Context.state``) so that its ε never
depends on the server telling the truth.

A ledger is priced through the same ``Accountant`` interface as the server's ledger: a DP-SGD
step is one more event type (``interface.dp_sgd_step``), RDP by opacus' analysis and PLD by
dp-accounting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .interface import dp_sgd_step, make_accountant
from .pld import DEFAULT_PLD_INTERVAL


def dp_sgd_epsilon(events, delta: float, accountant: str = "rdp",
                   pld_interval: float = DEFAULT_PLD_INTERVAL) -> float:
    """ε of a composition of DP-SGD runs ``events = [(q, σ, steps), ...]`` at ``delta``: each
    step is the accountant interface's :func:`dp_sgd_step` event, composed in the given order."""
    events = tuple((float(q), float(s), int(n)) for q, s, n in events if n > 0)
    if not events:
        return 0.0
    if any(s <= 0 for _, s, _ in events):
        return math.inf
    acc = make_accountant(accountant, value_discretization_interval=pld_interval)
    for q, s, n in events:
        if q > 0 and s != math.inf:
            acc.compose(dp_sgd_step(q, s), n)
    return acc.epsilon(delta)


def calibrate_noise_multiplier(sample_rate: float, steps: int, epsilon: float, delta: float,
                               accountant: str = "rdp", rel_tol: float = 1e-4) -> float:
    """The smallest σ (to ``rel_tol``) with ε(SGM(sample_rate, σ)^steps, δ) <= epsilon."""
    if not (epsilon > 0 and 0 < delta < 1 and 0 < sample_rate <= 1 and steps >= 1):
        raise ValueError(f"cannot calibrate: epsilon={epsilon}, delta={delta}, q={sample_rate}, steps={steps}")

    def eps(sigma: float) -> float:
        return dp_sgd_epsilon([(sample_rate, sigma, steps)], delta, accountant)

    lo, hi = 0.05, 1.0
    while eps(hi) > epsilon:
        lo, hi = hi, hi * 2
        if hi > 1e6:
            raise ValueError("no noise multiplier below 1e6 reaches the target epsilon")
    while eps(lo) <= epsilon and lo > 1e-3:
        lo /= 2
    while hi / lo > 1 + rel_tol:
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if eps(mid) <= epsilon else (mid, hi)
    return hi


@dataclass
class SiloLedger:
    """Everything one silo released: DP-SGD rounds, a list of (q, σ, steps) entries merged when
    equal, and noise shares of secure sums (distributed DP), (C, s, σ_share, d, k) entries merged
    when equal. One ledger, so the two kinds of release compose: while it holds no noise share it is
    priced by its accountant; with any, every release is composed in RDP at the orders of the
    distributed discrete Gaussian (``accounting.distributed``), DP-SGD steps by opacus' analysis."""

    delta: float
    accountant: str = "rdp"
    entries: list = field(default_factory=list)  # [[q, sigma, steps, rounds], ...]
    shares: list = field(default_factory=list)   # [[clip, scale, local_std, dimension, k, releases], ...]

    def record(self, sample_rate: float, noise_multiplier: float, steps: int) -> None:
        for entry in self.entries:
            if entry[0] == sample_rate and entry[1] == noise_multiplier:
                entry[2] += int(steps)
                entry[3] += 1
                return
        self.entries.append([float(sample_rate), float(noise_multiplier), int(steps), 1])

    def record_share(self, share: tuple) -> None:
        """One more noise share released: ``share = (clip, scale, local_std, dimension, k)``."""
        key = _share_key(share)
        for entry in self.shares:
            if tuple(entry[:5]) == key:
                entry[5] += 1
                return
        self.shares.append([*key, 1])

    @property
    def rounds(self) -> int:
        return sum(e[3] for e in self.entries)

    def events(self, extra: tuple | None = None) -> list:
        out = [(q, s, n) for q, s, n, _ in self.entries]
        return out + ([extra] if extra else [])

    def _epsilon(self, extra_event: tuple | None = None, extra_share: tuple | None = None) -> float:
        shares = [(tuple(e[:5]), int(e[5])) for e in self.shares] + ([(_share_key(extra_share), 1)] if extra_share else [])
        if not shares:
            return dp_sgd_epsilon(self.events(extra_event), self.delta, self.accountant)
        from . import distributed as DA

        acc = make_accountant("rdp", orders=DA.ORDERS)
        for q, sigma, steps in self.events(extra_event):
            if steps > 0 and q > 0:
                if sigma <= 0:
                    return math.inf
                acc.compose(dp_sgd_step(q, sigma), steps)
        for (clip, scale, local_std, dimension, k), count in shares:
            acc.compose_curve(DA.release_rdp(clip=clip, scale=scale, local_std=local_std, dimension=dimension,
                                             contributors=k), count)
        return acc.epsilon(self.delta)

    def epsilon(self) -> float:
        return self._epsilon()

    def epsilon_if(self, sample_rate: float, noise_multiplier: float, steps: int) -> float:
        """ε after one more DP-SGD round with these parameters (nothing is recorded)."""
        return self._epsilon(extra_event=(sample_rate, noise_multiplier, steps))

    def epsilon_if_share(self, share: tuple) -> float:
        """ε after one more noise share ``(clip, scale, local_std, dimension, k)`` (nothing is recorded)."""
        return self._epsilon(extra_share=share)

    def state_dict(self) -> dict:
        return {"delta": self.delta, "accountant": self.accountant, "entries": [list(e) for e in self.entries],
                "shares": [list(e) for e in self.shares]}

    @classmethod
    def from_state_dict(cls, state: dict) -> "SiloLedger":
        return cls(delta=float(state["delta"]), accountant=str(state["accountant"]),
                   entries=[[float(q), float(s), int(n), int(r)] for q, s, n, r in state["entries"]],
                   shares=[[*_share_key(e[:5]), int(e[5])] for e in state.get("shares", [])])


def _share_key(share) -> tuple:
    clip, scale, local_std, dimension, k = share
    return float(clip), float(scale), float(local_std), int(dimension), int(k)


class SiloRefusal(RuntimeError):
    """A silo refuses a train round; the ClientApp turns it into an error reply that the server
    drops and counts. The message says why."""


def _checked_rate(params, num_examples: int) -> float:
    """The DP parameters a silo was sent, checked (missing, invalid or noiseless: refused); q = b / n."""
    if params is None:
        raise SiloRefusal("refused: the train message carries no DP-SGD parameters, and this silo "
                          "trains only with DP-SGD")
    problems = params.problems()
    if problems:
        raise SiloRefusal("refused: invalid DP-SGD parameters: " + "; ".join(problems))
    if params.noise_multiplier <= 0:
        raise SiloRefusal("refused: noise multiplier 0 gives no privacy")
    return params.sample_rate(num_examples)


def silo_admits(ledger: SiloLedger, params, num_examples: int, *, max_epsilon: float) -> float:
    """The silo's own check of a DP-SGD round before it touches its data; returns q = b / n.

    ``params`` are the DP parameters the server sent (``DPSGDParams``, or None when it sent none).
    Raises ``SiloRefusal`` if they are missing or unusable, or if training would take this silo's
    own ledger past ``max_epsilon``. The silo trusts only its own ledger and its own n."""
    return _within_budget(ledger, params, _checked_rate(params, num_examples), max_epsilon)


def _within_budget(ledger: SiloLedger, params, q: float, max_epsilon: float) -> float:
    after = ledger.epsilon_if(q, params.noise_multiplier, params.local_steps)
    if after > max_epsilon * (1 + 1e-9):
        raise SiloRefusal(f"refused: this round would take the silo to epsilon {after:.3f} > its budget "
                          f"{max_epsilon:g} (delta {ledger.delta:g}; {ledger.rounds} rounds trained so far)")
    return q


#: δ of a silo that sets a budget (node config ``dp-max-epsilon``) but no ``dp-delta``. Fixed here, never
#: taken from the run config: a server that sent δ = 0.1 would otherwise buy itself ~60x the rounds.
SILO_DEFAULT_DELTA = 1e-5


def paid_params(params, sample_rate: float) -> list:
    """What a paid release is recorded with: the DP parameters it ran with and the rate it drew at (and
    the head's noise ratio when it splits the noise: older ledgers, written without it, stay valid)."""
    out = [float(params.noise_multiplier), float(params.clip), int(params.batch_size), int(params.local_steps),
           float(params.head_clip), float(sample_rate)]
    return out + [float(params.head_noise_ratio)] if params.head_noise_ratio else out


def silo_gate(ledger: SiloLedger, paid: list, key: str | None, params, num_examples: int, *,
              max_epsilon: float, inputs: str | None = None) -> tuple[float, bool]:
    """The silo's whole decision on a DP-SGD train round, before it touches its data: returns
    ``(q, charge)``; raises ``SiloRefusal`` to refuse.

    Every round's parameters are checked, replays included (a replay with σ = 0 is refused like any
    round). ``key`` names a seeded round (its draws follow from the run config and the round); a key
    this silo already paid for is the same release again, and is not charged again, only if it
    carries exactly the DP parameters it was paid with (``paid`` holds ``{"key", "params"}``
    entries). A replay with other parameters is refused: it would be a new release at no charge.
    So is one whose ``inputs`` (a digest of the arrays the silo received and of the optimizer state
    it starts from) differ from those it was paid with: the same draws on other inputs are another
    release. Anything else must fit in the silo's own budget."""
    q = _checked_rate(params, num_examples)
    if key is not None:
        for entry in paid:
            if isinstance(entry, dict) and entry.get("key") == key:
                if entry.get("params") != paid_params(params, q):
                    raise SiloRefusal(f"refused: round {key.rsplit(':', 1)[-1]} was already trained and paid with "
                                      f"DP parameters {entry.get('params')}; a replay must carry the same, got "
                                      f"{paid_params(params, q)}")
                if entry.get("inputs") is not None and entry.get("inputs") != inputs:
                    raise SiloRefusal(f"refused: round {key.rsplit(':', 1)[-1]} was already trained and paid on other "
                                      "arrays or another optimizer state; a replay must receive the same, or its "
                                      "identical noise would release a second update at no charge")
                return q, False  # the same seeded release again: already charged
    return _within_budget(ledger, params, q, max_epsilon), True  # parameters checked above
