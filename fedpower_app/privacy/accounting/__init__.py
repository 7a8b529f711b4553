"""Privacy accounting for fedpower (sample- and client-level DP of federated LoRA fine-tuning).

This package implements the *corrected* accounting of the project's privacy spec (not the paper's
closed form). Summary of the model:

* Server-side noise: every round the server releases noisy blocks computed from the clipped
  replies of the clients sampled in that round (Poisson client sampling, rate ``q_c``), each reply
  clipped with ONE norm ``C`` over all modules: the client's WHOLE update at sample level, its
  round DELTA against the public global at client level (averaged over the fixed expected cohort
  ``m = q_c N``; docs/privacy.md §12). DP-SGD on the silos is accounted per silo (``silo``).
* The accountant works with the *effective noise multiplier* ``z = (sum_j (Delta_j/s_j)^2)^-1/2`` of
  everything released in a round (``Delta_j`` = L2 sensitivity of block ``j``, ``s_j`` = its noise
  std per entry). See :func:`block_sensitivities` for the per-round-type sensitivities.
* Client level: each round is a Poisson sampled Gaussian mechanism (SGM) with rate ``q_c``.
* Sample level: an example is used in a round with probability ``q_c * pi`` where
  ``pi = 1 - (1 - q_s)^L`` (``L`` local steps, ``q_s = b/n_i``, largest over clients). All of a
  client's examples share one client coin, so the rigorous bound is the "two-stage" mixture
  ``(1-q_c) * identity + q_c * SGM(pi, z)``. The "product" bound ``SGM(q_c*pi, z)`` is what the
  paper and most DP-FL code use; it is labelled paper-comparable, not a proven guarantee.
* RDP (default) uses opacus' exact SGM RDP (``compute_rdp`` / ``get_privacy_spent``); PLD (option)
  uses dp_accounting's privacy-loss distributions. No privacy math is re-implemented here beyond
  combining library outputs (mixtures, sums, effective multipliers).

Rigorous mode ("rigorous"): at sample level the linear releases average over the fixed expected
cohort ``m = q_c N`` and their noise is scaled to it (never to the replies that arrived),
so every round has the SAME effective ``z`` and the calibration is one scalar. Paper mode ("paper"): ``sigma_alg = q*sqrt(2T ln(1.25/delta))/eps`` with
per-entry noise ``sigma_alg*C`` on every block; we then report the TRUE epsilon of that noise. It
is NOT a valid DP guarantee for the target epsilon.

Modules (each importable on its own; the names listed are re-exported here):

* ``rdp``: RDP math (opacus SGM RDP, two-stage and k-mixtures, RDP -> epsilon, ``ORDERS``);
* ``pld``: PLD math (dp_accounting PLDs of a round, k-mixtures, epsilon, memory guards);
* ``interface``: ``RoundEvent`` and the ``Accountant`` interface (compose / epsilon /
  state_dict), ``RdpAccountant``, ``PldAccountant``, ``make_accountant``;
* ``plan``: ``PrivacyPlan``, round schedule, block sensitivities, noise stds, effective z;
* ``calibration``: ``Calibration``, ``calibrate``, epsilon of a fixed z or of the paper's sigma;
* ``ledger``: ``PrivacyLedger`` (the server's per-round ledger), ``PrivacyBudgetExceeded``;
* ``silo``: DP-SGD on the silos: ``SiloLedger`` (one silo's ledger, kept by the server and by the
  silo itself), ``calibrate_noise_multiplier``, ``dp_sgd_epsilon``, the silo's own check
  ``silo_admits`` and ``SiloRefusal`` (import from ``fedpower_app.privacy.accounting.silo``).

Pure python + numpy + opacus + dp_accounting (no torch, no flwr): importing this package does not
import torch (``rdp`` loads opacus' RDP analysis file directly).
"""

from ._common import (
    ACCOUNTANTS,
    CALIBRATIONS,
    LEVELS,
    METHODS,
    ROUND_TYPES,
    SAMPLE_MODES,
    _norm_name,  # used by fedpower_app.privacy.cli
)
from .calibration import (
    PAPER_LABEL,
    PRODUCT_LABEL,
    RIGOROUS_LABEL,
    Calibration,
    calibrate,
    epsilon_for_noise_multiplier,
    epsilon_for_sigma_alg,
    paper_sigma_alg,
)
from .interface import (
    Accountant,
    PldAccountant,
    RdpAccountant,
    RoundEvent,
    make_accountant,
)
from .ledger import PrivacyBudgetExceeded, PrivacyLedger
from .pld import (
    DEFAULT_PLD_INTERVAL,
    DEFAULT_PLD_MAX_POINTS,
    pld_epsilon,
    pld_grid_points,
    round_pld,
    round_pld_k_mixture,
    safe_discretization_interval,
)
from .plan import (
    BLOCK_NAMES,
    METHOD_ROUND_TYPE,
    PrivacyPlan,
    block_sensitivities,
    effective_z,
    inclusion_probability,
    noise_stds,
    round_event,
    round_schedule,
    sample_rate_pi,
)
from .rdp import ORDERS, rdp_sgm, rdp_to_epsilon, round_rdp, round_rdp_k_mixture

__all__ = [
    "ORDERS",
    "METHODS",
    "ROUND_TYPES",
    "LEVELS",
    "SAMPLE_MODES",
    "ACCOUNTANTS",
    "CALIBRATIONS",
    "METHOD_ROUND_TYPE",
    "BLOCK_NAMES",
    "PAPER_LABEL",
    "DEFAULT_PLD_INTERVAL",
    "DEFAULT_PLD_MAX_POINTS",
    "PrivacyBudgetExceeded",
    "inclusion_probability",
    "sample_rate_pi",
    "round_schedule",
    "block_sensitivities",
    "noise_stds",
    "effective_z",
    "rdp_sgm",
    "round_rdp",
    "round_rdp_k_mixture",
    "rdp_to_epsilon",
    "pld_grid_points",
    "safe_discretization_interval",
    "round_pld",
    "round_pld_k_mixture",
    "pld_epsilon",
    "paper_sigma_alg",
    "PrivacyPlan",
    "Calibration",
    "calibrate",
    "epsilon_for_noise_multiplier",
    "epsilon_for_sigma_alg",
    "PrivacyLedger",
    "RoundEvent",
    "round_event",
    "Accountant",
    "RdpAccountant",
    "PldAccountant",
    "make_accountant",
]
