"""FedSVD (Lee et al., NeurIPS 2025; public code seanie12/fed-svd): pure torch, no Flower.

The silos train only B, with the round's global A frozen (as FFA-LoRA); the server averages the
B_i, so the average of the silos' products is exactly B̄·A_g, and refactorizes it by SVD into a new
orthonormal A every round: B̄ A_g = U S Vᵀ, A ← Vᵀ (r × n), B ← U S. A therefore tracks the
principal directions of what the silos learned, instead of staying at its random start.

Under DP-SGD on the silos the whole server step is post-processing of the silos' noised replies:
no clipping, no noise here. Server-side noise (the paper's mechanisms, client level) is not
defined for FedSVD; the config refuses it.

The SVD is exact and factored (never the m × n product): B̄ = Q R (thin QR, m × r and r × r), then
the r × n matrix R A_g = U' S Vᵀ, so B̄ A_g = (Q U') S Vᵀ. float64 inside.
"""

from __future__ import annotations

import torch

from .aggregation import AdapterUpdate, stack_group, weighted_sum


def svd_refactorize(B: torch.Tensor, A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(U S, Vᵀ) of the exact SVD of B A, batched over leading dims: B (..., m, r), A (..., r, n).

    The new A has orthonormal rows and B_new A_new == B A (to float64 rounding, cast back). Signs
    are fixed so that the largest-magnitude entry of every row of Vᵀ is positive (a deterministic
    choice: SVD is unique only up to the sign of each singular pair)."""
    dtype = B.dtype
    Q, R = torch.linalg.qr(B.double(), mode="reduced")
    U, S, Vh = torch.linalg.svd(R @ A.double(), full_matrices=False)
    idx = Vh.abs().argmax(dim=-1, keepdim=True)
    signs = torch.sign(torch.gather(Vh, -1, idx))
    signs = torch.where(signs == 0, torch.ones_like(signs), signs)
    Vh = Vh * signs
    U = U * signs.transpose(-1, -2)
    return ((Q @ U) * S.unsqueeze(-2)).to(dtype), Vh.to(dtype)


def fedsvd_release(updates: list[AdapterUpdate], ctx, glob: tuple, generator=None):
    """The FedSVD server step: average the B_i (and the head deltas), refactorize B̄·A_g by SVD.

    ``glob`` = (A_g, B_g) by module: the public global of the round, whose A every silo trained
    with. With no reply the global stays as it is (nothing to average; no noise to release)."""
    from .releases import Release, _finish  # the one Release type (releases imports nothing from here)

    A_g, B_g = glob
    k = len(updates)
    out = Release()
    if not k:
        return _finish(out, torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.float64), 0)
    weights = torch.full((k,), 1.0 / k, dtype=torch.float64)
    for g in ctx.groups:
        B = (stack_group([u.B for u in updates], g).double() * weights.view(-1, 1, 1, 1)).sum(0)  # (M, m, r)
        A = torch.stack([A_g[name] for name in g.names]).double()  # (M, r, n)
        B_new, A_new = svd_refactorize(B, A)
        for j, name in enumerate(g.names):
            out.B[name] = B_new[j].to(ctx.device, ctx.dtype)
            out.A[name] = A_new[j].to(ctx.device, ctx.dtype)
    names = sorted(ctx.extra_shapes)
    if names:
        avg = weighted_sum([u.extra for u in updates], weights, names)
        out.extra_delta = {n: avg[n].to(ctx.device, ctx.dtype) for n in names}
    # no clipping here (DP-SGD clipped every example on the silos): no norms, no clip scales
    return _finish(out, torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.float64), k)
