"""Factored clipping and averaging of client LoRA updates (pure torch, no Flower).

A client's FedPower update is u_i = {B_ij A_ij}_j over all adapted modules j (plus optional
dense extras such as a trainable classifier-head delta). It is clipped with ONE Frobenius norm
over everything it contains, so the privacy sensitivities hold for the whole release.

Norms are computed from the factors: ||B A||_F^2 = sum((B^T B) * (A A^T)), two r x r Gram
matrices, in float64 (privacy-accounting spec §8). The clipped average sum_i c_i B_i A_i / k is kept as stacked
factors [c_1 B_1, ..., c_k B_k] / k and [A_1; ...; A_k] (rank <= k r), never as an m x n matrix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# The accountant's sensitivities assume ||u_i|| <= C exactly and ||Q||_2 <= 1 for the orthonormal
# projections. float32 rounding in the scaling and in QR (orthogonality error ~1e-6..1e-5 for
# m ~ 1e3..1e4) could exceed that, so we clip to C / (1 + CLIP_MARGIN) (privacy-accounting spec §3.1 "numerical
# safety"); the utility cost is negligible.
CLIP_MARGIN = 1e-4


@dataclass
class AdapterUpdate:
    """One client's validated reply.

    A[name] is (r, n) and B[name] is (m, r) for every adapted module ``name``. ``extra`` holds
    dense trainable tensors other than LoRA factors (e.g. a classifier-head delta). FFA-LoRA
    replies carry an empty ``A``.
    """

    A: dict[str, torch.Tensor]
    B: dict[str, torch.Tensor]
    extra: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class ModuleGroup:
    """Adapted modules that share one shape; processed as one batch."""

    names: tuple[str, ...]
    m: int
    n: int
    r: int


def group_modules(shapes: dict[str, tuple[int, int, int]]) -> list[ModuleGroup]:
    """Group module names by (m, n, r), in a deterministic order."""
    by_shape: dict[tuple[int, int, int], list[str]] = {}
    for name in sorted(shapes):
        by_shape.setdefault(tuple(shapes[name]), []).append(name)
    return [ModuleGroup(tuple(names), *shape) for shape, names in sorted(by_shape.items())]


def stack_group(tensors: list[dict[str, torch.Tensor]], group: ModuleGroup) -> torch.Tensor:
    """(K, M, *shape) tensor of one group's matrices for K clients."""
    return torch.stack([torch.stack([t[name] for name in group.names]) for t in tensors])


def product_sq_norms(B: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """||B @ A||_F^2 over the last two dims, from the factors, in float64. B (..., m, r), A (..., r, n)."""
    B64, A64 = B.double(), A.double()
    gram_b = B64.transpose(-1, -2) @ B64  # (..., r, r)
    gram_a = A64 @ A64.transpose(-1, -2)  # (..., r, r)
    return (gram_b * gram_a).sum(dim=(-1, -2)).clamp_min(0.0)


def sq_norms(tensors: list[dict[str, torch.Tensor]], names=None) -> torch.Tensor:
    """Per-client sum of squared Frobenius norms of the listed tensors, float64, shape (K,)."""
    out = torch.zeros(len(tensors), dtype=torch.float64)
    for i, t in enumerate(tensors):
        for name in (names if names is not None else sorted(t)):
            out[i] += t[name].double().pow(2).sum()
    return out


def clip_scales(sq_norm: torch.Tensor, clip: float) -> torch.Tensor:
    """min(1, C / ||u_i||) per client in float64 (norm 0 -> scale 1)."""
    if clip <= 0:
        raise ValueError(f"clip norm must be > 0, got {clip}")
    norms = sq_norm.double().sqrt()
    target = clip / (1.0 + CLIP_MARGIN)
    return torch.where(norms > target, target / norms.clamp_min(1e-300), torch.ones_like(norms))


def merged_sq_norms(updates: list[AdapterUpdate], groups: list[ModuleGroup]) -> torch.Tensor:
    """Whole-update squared norm per client: sum_j ||B_j A_j||^2 + ||extra||^2 (factored)."""
    total = sq_norms([u.extra for u in updates])
    for g in groups:
        B = stack_group([u.B for u in updates], g)
        A = stack_group([u.A for u in updates], g)
        total += product_sq_norms(B, A).sum(dim=1)
    return total


def weighted_factor_stack(B: torch.Tensor, A: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Factors of sum_k w_k B_k A_k: Bs (M, m, K r) and As (M, K r, n) from B (K,M,m,r), A (K,M,r,n)."""
    K, M, m, r = B.shape
    n = A.shape[-1]
    w = weights.to(B.dtype).view(K, 1, 1, 1)
    Bs = (B * w).permute(1, 2, 0, 3).reshape(M, m, K * r)
    As = A.permute(1, 0, 2, 3).reshape(M, K * r, n)
    return Bs, As


def weighted_sum(tensors: list[dict[str, torch.Tensor]], weights: torch.Tensor, names) -> dict[str, torch.Tensor]:
    """sum_k w_k t_k[name] for each name (weights in float64, result in the tensors' dtype)."""
    out = {}
    for name in names:
        acc = torch.zeros_like(tensors[0][name], dtype=torch.float64)
        for w, t in zip(weights.tolist(), tensors):
            acc += w * t[name].double()
        out[name] = acc.to(tensors[0][name].dtype)
    return out


# ----------------------------------------------------------------------------------------------
# Dense references (tests and benchmarks only): materialise every m x n update.
# ----------------------------------------------------------------------------------------------
def dense_merged_updates(updates: list[AdapterUpdate], group: ModuleGroup) -> torch.Tensor:
    """(K, M, m, n) dense products B_ij A_ij."""
    return stack_group([u.B for u in updates], group) @ stack_group([u.A for u in updates], group)


def dense_clipped_average(updates: list[AdapterUpdate], groups: list[ModuleGroup], clip: float):
    """Reference: materialise, clip each client's whole update to C, average. Returns (W per group, scales)."""
    dense = [dense_merged_updates(updates, g) for g in groups]
    sq = sq_norms([u.extra for u in updates])
    for W in dense:
        sq += W.double().pow(2).sum(dim=(1, 2, 3))
    scales = clip_scales(sq, clip)
    k = len(updates)
    avgs = [(W * (scales / k).to(W.dtype).view(-1, 1, 1, 1)).sum(dim=0) for W in dense]
    return avgs, scales
