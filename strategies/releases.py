"""What the server releases each round, per method (pure torch, no Flower).

Each function takes the validated client updates of one round and returns the new global LoRA
factors. Noise stds are inputs: the accountant (``fedpower_app.privacy.accounting.noise_stds``) derives
them from the target noise multiplier and the method's sensitivity. Noise is drawn from one
generator in a fixed order (module groups in sorted order, B before A, then extras), so two
calls with the same generator state give the same release.

Methods and their released blocks (privacy-accounting spec §1):

* ``fedpower_release``: u_i = clip_C({B_ij A_ij}_j, extra_i); W = mean_i u_i; PowerDP per module.
* ``fedlora_release``: A-side (all A_ij) and B-side (all B_ij + extra_i) each clipped to C, averaged, noised.
* ``ffa_release``: B-side clipped, averaged, noised; A stays frozen (not released).
* ``input_perturbation_release``: W + N, then power iteration (post-processing).
* ``output_perturbation_release``: power iteration on W, then noise on A and B.

An empty round (no client) still releases noise around zero (privacy-accounting spec §2.4).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .aggregation import (
    AdapterUpdate,
    ModuleGroup,
    clip_scales,
    merged_sq_norms,
    sq_norms,
    stack_group,
    weighted_factor_stack,
    weighted_sum,
)
from .noise import NoiseSource
from .powerdp import factor_grams, input_perturbation, output_perturbation, powerdp


@dataclass
class Release:
    """A round's output: new global A/B per module (absent keys are unchanged) and extra deltas."""

    A: dict[str, torch.Tensor] = field(default_factory=dict)
    B: dict[str, torch.Tensor] = field(default_factory=dict)
    extra_delta: dict[str, torch.Tensor] = field(default_factory=dict)
    update_norms: list[float] = field(default_factory=list)  # pre-clip, float64
    clip_scales: list[float] = field(default_factory=list)
    num_clients: int = 0


@dataclass
class ReleaseContext:
    """Round-independent inputs of the release functions."""

    groups: list[ModuleGroup]
    extra_shapes: dict[str, tuple[int, ...]]
    clip: float
    rank: int
    power_iters: int = 1
    noise: NoiseSource = field(default_factory=NoiseSource)
    factored: bool = True
    dtype: torch.dtype = torch.float32
    device: str | torch.device = "cpu"


def _sampler(ctx: ReleaseContext):
    return ctx.noise.gaussian


def _zero_factors(g: ModuleGroup, ctx: ReleaseContext):
    z = dict(dtype=ctx.dtype, device=ctx.device)
    return torch.zeros(g.names.__len__(), g.m, g.r, **z), torch.zeros(len(g.names), g.r, g.n, **z)


def _group_factors(updates, weights, g, ctx):
    """Stacked factors of sum_i w_i B_i A_i for one group (zeros if no client)."""
    if not updates:
        return _zero_factors(g, ctx)
    B = stack_group([u.B for u in updates], g).to(ctx.device)
    A = stack_group([u.A for u in updates], g).to(ctx.device)
    return weighted_factor_stack(B, A, weights.to(ctx.device))


def _extras(updates, weights, std, generator, ctx) -> dict[str, torch.Tensor]:
    names = sorted(ctx.extra_shapes)
    if not names:
        return {}
    if updates:
        avg = weighted_sum([u.extra for u in updates], weights, names)
    else:
        avg = {n: torch.zeros(ctx.extra_shapes[n], dtype=ctx.dtype) for n in names}
    return {
        n: avg[n].to(ctx.device, ctx.dtype)
        + ctx.noise.gaussian(tuple(avg[n].shape), std, generator, dtype=ctx.dtype, device=ctx.device)
        for n in names
    }


def _merged_weights(updates, ctx, denominator: float | None = None):
    """Pre-clip norms, clip scales and averaging weights (scale / k, or scale / m for a fixed m)."""
    if not updates:
        return torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.float64)
    sq = merged_sq_norms(updates, ctx.groups)
    scales = clip_scales(sq, ctx.clip)
    return sq.sqrt(), scales, scales / _divisor(len(updates), denominator)


def _divisor(k: int, denominator: float | None) -> float:
    """The average's denominator: the fixed expected cohort m when the noise is scaled to it (server
    noise at sample level: the noise must not depend on who answered), else the realised k."""
    return float(denominator) if denominator else float(max(k, 1))


def _finish(release: Release, norms, scales, k) -> Release:
    release.update_norms = [float(x) for x in norms]
    release.clip_scales = [float(x) for x in scales]
    release.num_clients = k
    return release


def _dense_or_factors(Bs, As, ctx, grams=None):
    """PowerDP inputs: dense W (reference path) or the factors, with their Grams if already known."""
    return dict(W=Bs @ As) if not ctx.factored else dict(factors=(Bs, As), grams=grams)


def _stacked_rows(tensors: list[dict[str, torch.Tensor]], g: ModuleGroup, transpose: bool, device) -> torch.Tensor:
    """(M, K r, d): module j's rows k r..(k+1) r hold client k's factor (B^T if ``transpose``).

    One copy straight into the layout the power iteration uses (no permute/reshape copy).
    """
    K, M = len(tensors), len(g.names)
    d = g.m if transpose else g.n
    ref = tensors[0][g.names[0]]
    out = torch.empty((M, K * g.r, d), dtype=ref.dtype, device=device)
    view = out.view(M, K, g.r, d)
    for j, name in enumerate(g.names):
        for k, t in enumerate(tensors):
            x = t[name]
            view[j, k].copy_(x.transpose(-1, -2) if transpose else x)
    return out


def _client_sq_norms(grams: tuple[torch.Tensor, torch.Tensor], K: int, r: int) -> torch.Tensor:
    """Per-client sum_j ||B_kj A_kj||_F^2 in float64 from the diagonal r x r blocks of the Grams."""
    gb, ga = grams
    M = gb.shape[0]
    db = gb.view(M, K, r, K, r).diagonal(dim1=1, dim2=3)  # (M, r, r, K): client k's B^T B
    da = ga.view(M, K, r, K, r).diagonal(dim1=1, dim2=3)  # client k's A A^T
    return (db * da).sum(dim=(0, 1, 2)).clamp_min(0.0)


def _fedpower_stacks(updates, ctx: ReleaseContext):
    """Per group (BsT, As, grams) with the clip weights applied, plus pre-clip norms, clip scales
    and weights, in one pass over the data. The float64 Grams serve both the clipping norms and
    the Gram-space power iteration."""
    k = len(updates)
    if not k:
        norms, scales, weights = _merged_weights(updates, ctx)
        return [None] * len(ctx.groups), norms, scales, weights
    stacks = []
    sq = sq_norms([u.extra for u in updates]).to(ctx.device)
    for g in ctx.groups:
        BsT = _stacked_rows([u.B for u in updates], g, True, ctx.device)
        As = _stacked_rows([u.A for u in updates], g, False, ctx.device)
        grams = factor_grams(BsT, As)
        sq = sq + _client_sq_norms(grams, k, g.r)
        stacks.append((BsT, As, grams))
    sq = sq.cpu()
    scales = clip_scales(sq, ctx.clip)
    weights = scales / k
    w = weights.to(device=ctx.device, dtype=ctx.dtype)
    for (BsT, _As, (gb, _ga)), g in zip(stacks, ctx.groups):
        BsT.view(BsT.shape[0], k, g.r, -1).mul_(w.to(BsT.dtype).view(1, k, 1, 1))  # c_k / K on B_k
        w_rows = weights.to(ctx.device).repeat_interleave(g.r)
        gb.mul_(w_rows.view(1, -1, 1) * w_rows.view(1, 1, -1))  # Gram of the weighted Bs
    return stacks, sq.sqrt(), scales, weights


def fedpower_release(updates: list[AdapterUpdate], ctx: ReleaseContext, noise_std: float, generator: torch.Generator) -> Release:
    """FedPower round: merge, clip the whole update, average, PowerDP every module group."""
    stacks, norms, scales, weights = _fedpower_stacks(updates, ctx)
    out = Release()
    for i, g in enumerate(ctx.groups):
        grams = None
        if stacks[i] is None:
            Bs, As = _zero_factors(g, ctx)
        else:
            BsT, As, grams = stacks[i]
            stacks[i] = None  # release this group's stacks as soon as its PowerDP is done
            Bs = BsT.transpose(-1, -2)  # (M, m, K r) view; the factored products use BsT directly
            del BsT
        B_t, A_t = powerdp(**_dense_or_factors(Bs, As, ctx, grams), rank=ctx.rank, iters=ctx.power_iters,
                           noise_std=noise_std, generator=generator, sampler=_sampler(ctx))
        del Bs, As, grams
        for j, name in enumerate(g.names):
            out.A[name], out.B[name] = A_t[j], B_t[j]
    out.extra_delta = _extras(updates, weights, noise_std, generator, ctx)
    return _finish(out, norms, scales, len(updates))


def input_perturbation_release(updates, ctx: ReleaseContext, noise_std: float, generator,
                               denominator: float | None = None) -> Release:
    """Input perturbation: noise on the averaged full-rank W, then non-private power iteration."""
    norms, scales, weights = _merged_weights(updates, ctx, denominator)
    out = Release()
    for g in ctx.groups:
        Bs, As = _group_factors(updates, weights, g, ctx)
        B_t, A_t = input_perturbation(factors=(Bs, As), rank=ctx.rank, iters=ctx.power_iters,
                                      noise_std=noise_std, generator=generator, sampler=_sampler(ctx))
        for j, name in enumerate(g.names):
            out.A[name], out.B[name] = A_t[j], B_t[j]
    out.extra_delta = _extras(updates, weights, noise_std, generator, ctx)
    return _finish(out, norms, scales, len(updates))


def output_perturbation_release(updates, ctx: ReleaseContext, noise_std_a: float, noise_std_b: float, generator) -> Release:
    """Output perturbation: non-private power iteration, then noise on B (with extras) and on A."""
    norms, scales, weights = _merged_weights(updates, ctx)
    out = Release()
    for g in ctx.groups:
        Bs, As = _group_factors(updates, weights, g, ctx)
        B_t, A_t = output_perturbation(**_dense_or_factors(Bs, As, ctx), rank=ctx.rank, iters=ctx.power_iters,
                                       noise_std_a=noise_std_a, noise_std_b=noise_std_b,
                                       generator=generator, sampler=_sampler(ctx))
        for j, name in enumerate(g.names):
            out.A[name], out.B[name] = A_t[j], B_t[j]
    out.extra_delta = _extras(updates, weights, noise_std_b, generator, ctx)
    return _finish(out, norms, scales, len(updates))


def _noisy_average(tensors, weights, names, shapes, std, generator, ctx):
    if tensors:
        avg = weighted_sum(tensors, weights, names)
    else:
        avg = {n: torch.zeros(shapes[n], dtype=ctx.dtype) for n in names}
    return _with_noise(avg, names, std, generator, ctx)


def _with_noise(avg, names, std, generator, ctx):
    """avg[n] (cast to the run's dtype) + fresh N(0, std^2) for each name, drawn in the order of ``names``."""
    return {
        n: avg[n].to(ctx.device, ctx.dtype)
        + ctx.noise.gaussian(tuple(avg[n].shape), std, generator, dtype=ctx.dtype, device=ctx.device)
        for n in names
    }


def _b_side(updates):
    return [{**{f"B::{k}": v for k, v in u.B.items()}, **{f"X::{k}": v for k, v in u.extra.items()}} for u in updates]


def _module_shapes(ctx):
    a = {n: (g.r, g.n) for g in ctx.groups for n in g.names}
    b = {n: (g.m, g.r) for g in ctx.groups for n in g.names}
    return a, b


def fedlora_release(updates, ctx: ReleaseContext, noise_std_a: float, noise_std_b: float, generator,
                    denominator: float | None = None) -> Release:
    """FedLoRA (paper App. Alg. 6): A-side and B-side each clipped to C, averaged, noised."""
    names = [n for g in ctx.groups for n in g.names]
    a_shapes, b_shapes = _module_shapes(ctx)
    k = len(updates)
    out = Release()
    # B-side first (B factors + extras), then A-side: fixed draw order.
    b_side = _b_side(updates)
    b_names = [f"B::{n}" for n in names] + [f"X::{n}" for n in sorted(ctx.extra_shapes)]
    b_shapes_all = {**{f"B::{n}": b_shapes[n] for n in names}, **{f"X::{n}": ctx.extra_shapes[n] for n in ctx.extra_shapes}}
    sq_b = sq_norms(b_side, b_names) if k else torch.zeros(0, dtype=torch.float64)
    sq_a = sq_norms([u.A for u in updates], names) if k else torch.zeros(0, dtype=torch.float64)
    sc_b, sc_a = clip_scales(sq_b, ctx.clip), clip_scales(sq_a, ctx.clip)
    d = _divisor(k, denominator)
    new_b = _noisy_average(b_side, sc_b / d, b_names, b_shapes_all, noise_std_b, generator, ctx)
    new_a = _noisy_average([u.A for u in updates], sc_a / d, names, a_shapes, noise_std_a, generator, ctx)
    out.B = {n: new_b[f"B::{n}"] for n in names}
    out.extra_delta = {n: new_b[f"X::{n}"] for n in sorted(ctx.extra_shapes)}
    out.A = new_a
    norms = (sq_a + sq_b).sqrt()
    return _finish(out, norms, torch.minimum(sc_a, sc_b), k)


def ffa_release(updates, ctx: ReleaseContext, noise_std_b: float, generator,
                denominator: float | None = None) -> Release:
    """FFA-LoRA (paper App. Alg. 7): only the B-side is clipped, averaged and noised; A is frozen."""
    names = [n for g in ctx.groups for n in g.names]
    _, b_shapes = _module_shapes(ctx)
    k = len(updates)
    b_side = _b_side(updates)
    b_names = [f"B::{n}" for n in names] + [f"X::{n}" for n in sorted(ctx.extra_shapes)]
    shapes = {**{f"B::{n}": b_shapes[n] for n in names}, **{f"X::{n}": ctx.extra_shapes[n] for n in ctx.extra_shapes}}
    sq_b = sq_norms(b_side, b_names) if k else torch.zeros(0, dtype=torch.float64)
    sc_b = clip_scales(sq_b, ctx.clip)
    new_b = _noisy_average(b_side, sc_b / _divisor(k, denominator), b_names, shapes, noise_std_b, generator, ctx)
    out = Release(B={n: new_b[f"B::{n}"] for n in names},
                  extra_delta={n: new_b[f"X::{n}"] for n in sorted(ctx.extra_shapes)})
    return _finish(out, sq_b.sqrt(), sc_b, k)
