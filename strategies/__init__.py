"""fedpower server math and Flower strategies.

The math (``powerdp``, ``aggregation``, ``releases``, ``noise``) is pure torch and importable
without Flower::

    from strategies import power_iteration, NoiseSource, fedpower_release
    from strategies.powerdp import powerdp   # (strategies.powerdp is the module of that name)

The Flower strategy adapters live in ``strategies.flower`` (imported lazily, so that the math
stays usable on machines without Flower).
"""

# The names below are imported at their first use (PEP 562): importing ``strategies.mechanisms`` or
# ``strategies.privacy_contract`` (which the torch-free accounting package reads) imports no torch.
_HOME = {
    **dict.fromkeys(("AdapterUpdate", "ModuleGroup", "clip_scales", "dense_clipped_average", "group_modules",
                     "merged_sq_norms", "product_sq_norms", "weighted_factor_stack"), ".aggregation"),
    "NoiseSource": ".noise",
    **dict.fromkeys(("input_perturbation", "orthonormalize_columns", "orthonormalize_rows", "output_perturbation",
                     "power_iteration", "powerdp_l"), ".powerdp"),
    **dict.fromkeys(("Release", "ReleaseContext", "fedlora_release", "fedpower_release", "ffa_release",
                     "input_perturbation_release", "output_perturbation_release"), ".releases"),
}


def __getattr__(name: str):
    if name in _HOME:
        import importlib

        return getattr(importlib.import_module(_HOME[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AdapterUpdate", "ModuleGroup", "NoiseSource", "Release", "ReleaseContext",
    "clip_scales", "dense_clipped_average", "group_modules", "merged_sq_norms", "product_sq_norms",
    "weighted_factor_stack", "input_perturbation", "orthonormalize_columns", "orthonormalize_rows",
    "output_perturbation", "power_iteration", "powerdp_l", "fedlora_release", "fedpower_release",
    "ffa_release", "input_perturbation_release", "output_perturbation_release",
]
