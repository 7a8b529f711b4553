"""Client-level DP on round deltas (DP-FedAvg style), per method (pure torch, no Flower).

Every silo returns its locally trained adapters; the server turns each reply into the silo's
*change* in the round against the public global adapters it sent, clips that change to C (the
whole change, jointly over every module and the head), sums, divides by the **fixed** expected
cohort m = q_c N (never by the realised number of replies, which is not private at client level),
adds Gaussian noise and adds the public global back. Releases (docs/privacy.md §12):

* ``fedlora_delta_release``: (dA_i, dB_i, dhead_i) jointly clipped; global + sum/m + N(0, s^2).
* ``ffa_delta_release``: (dB_i, dhead_i) clipped; A stays frozen.
* ``powerdp_l_release`` (FedPower): dW_i = B_i A_i - B_g A_g, kept factored as
  [B_i, -B_g][A_i; A_g] (rank 2r); W = B_g A_g + sum_i w_i dW_i is refactorized to rank r by
  PowerDP-L warm-started from the public A_g: noise inside the power iteration.
* ``input_delta_release``: W~ = W + N (full rank), then power iteration (post-processing).
* ``powerdp_delta_release`` / ``output_delta_release``: the paper's PowerDP / output
  perturbation on the averaged delta (random denominator k: they rely on ||average|| <= C), then
  the public global is added back and refactorized without noise (post-processing). Ablations.

Noise is drawn from one generator in a fixed order (groups in sorted order; B before A; extras
last). An empty round (no reply) still releases noise (fixed denominator: 0/m + noise).

Precision: the clip bounds a client's contribution only as far as the arithmetic that forms it is
exact. Deltas, norms, weighted sums and the merged W = B_g A_g + sum_i w_i dW_i (whose terms
B_i A_i and B_g A_g can be far larger than C) are therefore computed in float64, and a release is
cast to the run's dtype only once its noise is in (post-processing). The noise itself is drawn at
the run's dtype, so PowerDP-L and the linear releases draw the same noise as a float32 computation
would (the paper's ablations also draw a random start for their power iteration, in float64).
"""

from __future__ import annotations

import torch

from .aggregation import AdapterUpdate, ModuleGroup, clip_scales, product_sq_norms, sq_norms, stack_group, weighted_sum
from .powerdp import input_perturbation, output_perturbation, power_iteration, powerdp, powerdp_l
from .releases import Release, ReleaseContext, _finish, _noisy_average, _with_noise

GlobalFactors = tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]  # (A_g by module, B_g by module)


def _factor_deltas(updates: list[AdapterUpdate], g: ModuleGroup, glob: GlobalFactors, device):
    """Per client, stacked factors of dW_i = B_i A_i - B_g A_g: (K, M, m, 2r) and (K, M, 2r, n)."""
    A_g = torch.stack([glob[0][n] for n in g.names]).to(device)
    B_g = torch.stack([glob[1][n] for n in g.names]).to(device)
    B = stack_group([u.B for u in updates], g).to(device)
    A = stack_group([u.A for u in updates], g).to(device)
    K = B.shape[0]
    Bd = torch.cat([B, -B_g.expand(K, *B_g.shape)], dim=-1)
    Ad = torch.cat([A, A_g.expand(K, *A_g.shape)], dim=-2)
    return Bd, Ad, B, A, B_g, A_g


def product_delta_sq_norms(updates, groups, glob, device="cpu") -> torch.Tensor:
    """Per client ||(dW_i over all modules, dhead_i)||^2 in float64, from the factors (never m x n)."""
    total = sq_norms([u.extra for u in updates])
    for g in groups:
        Bd, Ad, *_ = _factor_deltas(updates, g, glob, device)
        total += product_sq_norms(Bd, Ad).sum(dim=1).cpu()
    return total


def _weights(sq: torch.Tensor, clip: float, denominator: float):
    scales = clip_scales(sq, clip)
    return sq.sqrt(), scales, scales / float(denominator)


def _clipped_delta_weights(updates, ctx, glob, denominator):
    """(pre-clip norms, clip scales, weights scale_i / denominator) of the silos' whole changes."""
    sq = product_delta_sq_norms(updates, ctx.groups, glob, ctx.device) if updates else torch.zeros(0, dtype=torch.float64)
    return _weights(sq, ctx.clip, denominator)


def _group_new_w_factors(updates, g, glob, w, device, dtype):
    """Factors of W = B_g A_g + sum_i w_i (B_i A_i - B_g A_g) = sum_i w_i B_i A_i + (1 - sum w) B_g A_g."""
    A_g = torch.stack([glob[0][n] for n in g.names]).to(device, dtype)
    B_g = torch.stack([glob[1][n] for n in g.names]).to(device, dtype)
    rest = float(1.0 - w.sum()) if len(w) else 1.0
    Bs, As = [B_g * rest], [A_g]
    if updates:
        B = stack_group([u.B for u in updates], g).to(device, dtype)
        A = stack_group([u.A for u in updates], g).to(device, dtype)
        ww = w.to(device=device, dtype=dtype).view(-1, 1, 1, 1)
        Bs = list((B * ww).unbind(0)) + Bs
        As = list(A.unbind(0)) + As
    return torch.cat(Bs, dim=-1), torch.cat(As, dim=-2), A_g


F64 = torch.float64


def _sampler_at_run_dtype(ctx: ReleaseContext):
    """The noise source's sampler for float64 work: draws at the run's dtype (the same stream as a
    float32 run), returned as a fresh float64 tensor."""
    def sample(shape, std, generator, *, dtype, device):
        return ctx.noise.gaussian(shape, std, generator, dtype=ctx.dtype, device=device).to(dtype)
    return sample


def _set_factors(out: Release, g, B, A, dtype) -> None:
    for j, name in enumerate(g.names):
        out.A[name], out.B[name] = A[j].to(dtype), B[j].to(dtype)


def _extras_delta(updates, weights, std, generator, ctx):
    names = sorted(ctx.extra_shapes)
    if not names:
        return {}
    return _noisy_average([u.extra for u in updates], weights, names, ctx.extra_shapes, std, generator, ctx)


def powerdp_l_release(updates, ctx: ReleaseContext, glob: GlobalFactors, noise_std: float, generator,
                      denominator: float) -> Release:
    """FedPower at client level: clip each silo's dW_i (and head change), average over the fixed m,
    add the public B_g A_g back (factored), refactorize with PowerDP-L warm-started from A_g."""
    k = len(updates)
    norms, scales, w = _clipped_delta_weights(updates, ctx, glob, denominator)
    out = Release()
    for g in ctx.groups:
        Bs, As, A_g = _group_new_w_factors(updates, g, glob, w, ctx.device, F64)
        B, A = powerdp_l(factors=(Bs, As), a_prev=A_g, iters=ctx.power_iters, noise_std=noise_std,
                         generator=generator, sampler=_sampler_at_run_dtype(ctx))
        _set_factors(out, g, B, A, ctx.dtype)
    out.extra_delta = _extras_delta(updates, w, noise_std, generator, ctx)
    return _finish(out, norms, scales, k)


def input_delta_release(updates, ctx: ReleaseContext, glob: GlobalFactors, noise_std: float, generator,
                        denominator: float) -> Release:
    """Input perturbation at client level: noise on the full-rank W = B_g A_g + average delta (the
    public part changes nothing), then non-private power iteration."""
    k = len(updates)
    norms, scales, w = _clipped_delta_weights(updates, ctx, glob, denominator)
    out = Release()
    for g in ctx.groups:
        Bs, As, _ = _group_new_w_factors(updates, g, glob, w, ctx.device, F64)
        B, A = input_perturbation(factors=(Bs, As), rank=ctx.rank, iters=ctx.power_iters, noise_std=noise_std,
                                  generator=generator, sampler=_sampler_at_run_dtype(ctx))
        _set_factors(out, g, B, A, ctx.dtype)
    out.extra_delta = _extras_delta(updates, w, noise_std, generator, ctx)
    return _finish(out, norms, scales, k)


def _noisy_delta_then_refactor(updates, ctx, glob, generator, release_fn):
    """The paper's factor-noise mechanisms on the averaged delta (random denominator: the average
    has norm <= C, which their diameter sensitivities need), then B_g A_g + B~ A~ refactorized to
    rank r without noise (post-processing of public and released factors)."""
    k = len(updates)
    norms, scales, w = _clipped_delta_weights(updates, ctx, glob, max(k, 1))
    out = Release()
    for g in ctx.groups:
        A_g = torch.stack([glob[0][n] for n in g.names]).to(ctx.device, F64)
        B_g = torch.stack([glob[1][n] for n in g.names]).to(ctx.device, F64)
        if k:
            Bd, Ad, *_ = _factor_deltas(updates, g, glob, ctx.device)
            ww = w.to(device=ctx.device, dtype=F64).view(-1, 1, 1, 1)
            Bs = torch.cat(list((Bd.to(F64) * ww).unbind(0)), dim=-1)
            As = torch.cat(list(Ad.to(F64).unbind(0)), dim=-2)
        else:
            Bs = torch.zeros(len(g.names), g.m, g.r, dtype=F64, device=ctx.device)
            As = torch.zeros(len(g.names), g.r, g.n, dtype=F64, device=ctx.device)
        B_t, A_t = release_fn(Bs, As, _sampler_at_run_dtype(ctx))
        B, A = power_iteration(factors=(torch.cat([B_g, B_t], dim=-1), torch.cat([A_g, A_t], dim=-2)),
                               rank=ctx.rank, iters=max(ctx.power_iters, 2), generator=generator)
        _set_factors(out, g, B, A, ctx.dtype)
    return out, norms, scales, w, k


def powerdp_delta_release(updates, ctx: ReleaseContext, glob: GlobalFactors, noise_std: float, generator) -> Release:
    """The paper's PowerDP on the averaged round delta (client-level ablation; diameter sensitivity)."""
    def release(Bs, As, sampler):
        return powerdp(factors=(Bs, As), rank=ctx.rank, iters=ctx.power_iters, noise_std=noise_std,
                       generator=generator, sampler=sampler)

    out, norms, scales, w, k = _noisy_delta_then_refactor(updates, ctx, glob, generator, release)
    out.extra_delta = _extras_delta(updates, w, noise_std, generator, ctx)
    return _finish(out, norms, scales, k)


def output_delta_release(updates, ctx: ReleaseContext, glob: GlobalFactors, noise_std_a: float, noise_std_b: float,
                         generator) -> Release:
    """Output perturbation on the averaged round delta (client-level ablation)."""
    def release(Bs, As, sampler):
        return output_perturbation(factors=(Bs, As), rank=ctx.rank, iters=ctx.power_iters, noise_std_a=noise_std_a,
                                   noise_std_b=noise_std_b, generator=generator, sampler=sampler)

    out, norms, scales, w, k = _noisy_delta_then_refactor(updates, ctx, glob, generator, release)
    out.extra_delta = _extras_delta(updates, w, noise_std_b, generator, ctx)
    return _finish(out, norms, scales, k)


def linear_delta_average(updates, ctx: ReleaseContext, glob: GlobalFactors, denominator: float, *, with_a: bool):
    """The quantity the linear client-level releases noise: sum_i w_i (dB_i, dhead_i[, dA_i]) over
    the fixed m, in float64, as {"B::name" | "X::name" | "A::name": tensor} in the draw order (B,
    head, A); with the pre-clip norms and the clip scales."""
    names = [n for g in ctx.groups for n in g.names]
    deltas = []
    for u in updates:
        d = {f"B::{n}": u.B[n].to(F64) - glob[1][n].to(F64) for n in names}
        if with_a:
            d.update({f"A::{n}": u.A[n].to(F64) - glob[0][n].to(F64) for n in names})
        d.update({f"X::{n}": v.to(F64) for n, v in u.extra.items()})
        deltas.append(d)
    shapes = {**{f"B::{n}": tuple(glob[1][n].shape) for n in names},
              **{f"X::{n}": ctx.extra_shapes[n] for n in ctx.extra_shapes}}
    if with_a:
        shapes.update({f"A::{n}": tuple(glob[0][n].shape) for n in names})
    order = [f"B::{n}" for n in names] + [f"X::{n}" for n in sorted(ctx.extra_shapes)] + \
        ([f"A::{n}" for n in names] if with_a else [])  # fixed draw order: B, head, A
    sq = sq_norms(deltas, order) if deltas else torch.zeros(0, dtype=F64)
    norms, scales, w = _weights(sq, ctx.clip, denominator)
    avg = weighted_sum(deltas, w, order) if deltas else {n: torch.zeros(shapes[n], dtype=F64) for n in order}
    return avg, norms, scales


def _linear_delta_release(updates, ctx, glob, noise_std, generator, denominator, *, with_a: bool) -> Release:
    names = [n for g in ctx.groups for n in g.names]
    k = len(updates)
    avg, norms, scales = linear_delta_average(updates, ctx, glob, denominator, with_a=with_a)
    noisy = _with_noise(avg, list(avg), noise_std, generator, ctx)  # avg is in the draw order
    out = Release(B={n: glob[1][n].to(ctx.device, ctx.dtype) + noisy[f"B::{n}"] for n in names},
                  extra_delta={n: noisy[f"X::{n}"] for n in sorted(ctx.extra_shapes)})
    if with_a:
        out.A = {n: glob[0][n].to(ctx.device, ctx.dtype) + noisy[f"A::{n}"] for n in names}
    return _finish(out, norms, scales, k)


def fedlora_delta_release(updates, ctx: ReleaseContext, glob: GlobalFactors, noise_std: float, generator,
                          denominator: float) -> Release:
    """FedLoRA at client level: (dA, dB, dhead) of each silo jointly clipped to C; sum/m + noise."""
    return _linear_delta_release(updates, ctx, glob, noise_std, generator, denominator, with_a=True)


def ffa_delta_release(updates, ctx: ReleaseContext, glob: GlobalFactors, noise_std: float, generator,
                      denominator: float) -> Release:
    """FFA-LoRA at client level: (dB, dhead) clipped to C; sum/m + noise; A frozen."""
    return _linear_delta_release(updates, ctx, glob, noise_std, generator, denominator, with_a=False)
