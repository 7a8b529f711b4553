"""fedpower server math and Flower strategies.

The math (``powerdp``, ``aggregation``, ``releases``, ``noise``) is pure torch and importable
without Flower::

    from strategies import powerdp, power_iteration, NoiseSource, fedpower_release

The Flower strategy adapters live in ``strategies.flower`` (imported lazily, so that the math
stays usable on machines without Flower).
"""

from .aggregation import (
    AdapterUpdate,
    ModuleGroup,
    clip_scales,
    dense_clipped_average,
    group_modules,
    merged_sq_norms,
    product_sq_norms,
    weighted_factor_stack,
)
from .noise import NoiseSource
from .powerdp import (
    input_perturbation,
    orthonormalize_columns,
    orthonormalize_rows,
    output_perturbation,
    power_iteration,
    powerdp,
    powerdp_l,
)
from .releases import (
    Release,
    ReleaseContext,
    fedlora_release,
    fedpower_release,
    ffa_release,
    input_perturbation_release,
    output_perturbation_release,
)

__all__ = [
    "AdapterUpdate", "ModuleGroup", "NoiseSource", "Release", "ReleaseContext",
    "clip_scales", "dense_clipped_average", "group_modules", "merged_sq_norms", "product_sq_norms",
    "weighted_factor_stack", "input_perturbation", "orthonormalize_columns", "orthonormalize_rows",
    "output_perturbation", "power_iteration", "powerdp", "powerdp_l", "fedlora_release", "fedpower_release",
    "ffa_release", "input_perturbation_release", "output_perturbation_release",
]
