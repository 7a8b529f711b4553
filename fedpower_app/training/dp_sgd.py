"""DP-SGD inside a silo (Opacus): sample-level DP where the data is.

Each of the L local steps of a round
1. samples a Poisson batch: every example of the silo independently with probability q = b / n
   (coins from the run's noise source, as the accountant assumes);
2. computes per-example gradients of the trainable tensors (Opacus ``GradSampleModule`` hooks:
   LoRA A and B, only B for FFA-LoRA, the head if it trains);
3. clips each example's whole gradient (one norm over all trainable tensors) to C;
4. adds N(0, (σ·C)²) to the sum, divides by the expected batch size b and takes an optimizer step.
   With a trained head clipped apart (C_h) each group draws its own noise (``dp_sgd_noise_stds``:
   one std σ·√(C² + C_h²), or the head at ρσ and the adapters at σ/√(1 − 1/ρ²)); the step is the
   same subsampled Gaussian of multiplier σ either way (docs/privacy.md §0.1).

An empty Poisson batch is a noise-only step, never a skipped one: skipping would make the number
of steps depend on the data's sampling, which the accountant does not model.

Everything the silo sends afterwards is post-processing of these noisy steps, so the server's
merge, average and refactorization need no noise of their own.

Opacus + PEFT pitfalls (opacus#820, peft#3409) handled here: the model is on its device before
``get_peft_model`` (``model.build_model``), ``requires_grad`` is settled before wrapping (one
wrapper per trainable set), the wrapper is built once per process and the adapters are loaded in
place every round, a fresh ``DPOptimizer`` is built per silo and round, and the model is never
switched to ``eval()`` while gradients are sampled.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from strategies.privacy_contract import sample_rate

from ..data import TokenizedSplit
from .frozen_prefix import forward_context
from ..model import is_head_parameter
from .loops import (LossSum, TrainStats, _autocast, _seeded_dropout, batch_indices, keep_optimizer, local_optimizer,
                    optimizer_groups, physical_batch_size_for, physical_chunks, resume_optimizer,
                    training_loss)


@dataclass(frozen=True)
class DPSGDParams:
    """The DP parameters of one silo's round, as sent by the server and checked by the silo."""

    noise_multiplier: float  # σ: noise std on each step's clipped sum is σ·sensitivity
    clip: float  # C: per-example clip norm of the adapters' gradient (of the whole one if head_clip = 0)
    batch_size: int  # b: expected Poisson batch size (q = b / n)
    local_steps: int  # L: exactly L steps per round
    head_clip: float = 0.0  # C_h > 0: the head's gradient is clipped apart, to C_h (0: jointly with C)
    head_noise_ratio: float = 0.0  # ρ > 1: the head's noise multiplier is ρσ (0: one noise std for both groups)

    @property
    def sensitivity(self) -> float:
        """The L2 bound on one example's clipped gradient (its share of a step's clipped sum): C with
        one joint clip, √(C² + C_h²) with the head clipped apart. The formula's home is the
        mechanism ``dp-sgd`` (strategies/mechanisms.py)."""
        from strategies.mechanisms import dp_sgd_sensitivity

        return dp_sgd_sensitivity(self.clip, self.head_clip)

    @property
    def noise_stds(self) -> tuple[float, float]:
        """The noise std on a step's clipped sum of the adapters and of the head (0 without a head
        clipped apart). Their home is the mechanism ``dp-sgd`` (strategies/mechanisms.py)."""
        from strategies.mechanisms import dp_sgd_noise_stds

        return dp_sgd_noise_stds(self.noise_multiplier, self.clip, self.head_clip, self.head_noise_ratio)

    def sample_rate(self, num_examples: int) -> float:
        return sample_rate(self.batch_size, num_examples)

    def problems(self) -> list[str]:
        """What makes these parameters unusable (empty if none)."""
        out = []
        if not (math.isfinite(self.noise_multiplier) and self.noise_multiplier >= 0):
            out.append(f"noise multiplier must be finite and >= 0, got {self.noise_multiplier!r}")
        if not (math.isfinite(self.clip) and self.clip > 0):
            out.append(f"clip must be finite and > 0, got {self.clip!r}")
        if not (math.isfinite(self.head_clip) and self.head_clip >= 0):
            out.append(f"head clip must be finite and >= 0, got {self.head_clip!r}")
        from strategies.mechanisms import head_noise_ratio_problem

        ratio_problem = head_noise_ratio_problem(self.head_noise_ratio, self.head_clip)
        if ratio_problem:
            out.append(ratio_problem)
        if self.batch_size < 1:
            out.append(f"batch size must be >= 1, got {self.batch_size!r}")
        if self.local_steps < 1:
            out.append(f"local steps must be >= 1, got {self.local_steps!r}")
        return out


_WRAPPED: dict[tuple, object] = {}


def _trainable_signature(model) -> tuple:
    return tuple(name for name, p in model.named_parameters() if p.requires_grad)


def grad_sample_module(model):
    """The model wrapped for per-example gradients, once per process and trainable set.

    Opacus registers hooks on the modules whose parameters require grad at wrap time, so a change
    of trainable set (FFA-LoRA freezes A) gets its own wrapper around the same model."""
    from opacus import GradSampleModule

    key = (id(model), _trainable_signature(model))
    if key not in _WRAPPED:
        for other in [k for k in _WRAPPED if k[0] == id(model)]:
            _WRAPPED.pop(other)._close()  # remove the old hooks: one wrapper per model at a time
        _WRAPPED[key] = GradSampleModule(model, batch_first=True, loss_reduction="mean", strict=True)
    return _WRAPPED[key]


def _float32_grad_samples(optimizer) -> list[torch.Tensor]:
    """The optimizer's flat per-example gradients, one tensor per parameter, in float32 (half
    precision upcast once; float32 as is)."""
    return [g.to(torch.float32) if g.dtype in (torch.bfloat16, torch.float16) else g
            for g in (optimizer._get_flat_grad_sample(p) for p in optimizer.params)]


def _clip_factors(grad_samples: list[torch.Tensor], clip: float) -> torch.Tensor:
    """min(1, C / (‖g_i‖ + 1e-6)) for each example i: Opacus' formula, on float32 gradients."""
    n = len(grad_samples[0])
    if n == 0:
        return torch.zeros((0,), device=grad_samples[0].device)
    norms = torch.stack([g.reshape(n, -1).norm(2, dim=-1) for g in grad_samples], dim=1).norm(2, dim=1)
    return (clip / (norms + 1e-6)).clamp(max=1.0)


@functools.lru_cache(maxsize=None)  # one class per process (opacus imported lazily), not one per round
def _float32_norm_optimizer_class():
    from opacus.optimizers import DPOptimizer
    from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed

    class Float32NormDPOptimizer(DPOptimizer):
        """Opacus' DPOptimizer with the per-example norms taken in float32.

        Why: under bf16 autocast (GPU, or ``train.precision = "bf16"``) the per-example gradients
        are bf16, and Opacus takes their norms in bf16 (rounded to 8 bits of mantissa) while it sums
        the float32 upcast of the same values. A norm rounded down lets that example's clipped
        gradient exceed C by up to ~0.3%, so the sensitivity, and the printed ε, would not hold.
        The float32 copies are built once per clip and serve both the norms and the sum (Opacus'
        own step reads its per-example gradients three times). For float32 gradients the step is
        Opacus' own, bit for bit (tests/test_dp_sgd.py)."""

        def clip_and_accumulate(self):
            grad_samples = _float32_grad_samples(self)
            factors = _clip_factors(grad_samples, self.max_grad_norm)
            for p, grad_sample in zip(self.params, grad_samples):
                _check_processed_flag(p.grad_sample)
                grad = torch.einsum("i,i...", factors.to(grad_sample.device, p.dtype), grad_sample.to(p.dtype))
                p.summed_grad = grad if p.summed_grad is None else p.summed_grad + grad
                _mark_as_processed(p.grad_sample)

    return Float32NormDPOptimizer


@functools.lru_cache(maxsize=None)  # one class per process (opacus imported lazily), not one per round
def _group_clipped_optimizer_class():
    from opacus.optimizers.optimizer import _check_processed_flag, _generate_noise, _mark_as_processed

    class GroupClippedDPOptimizer(_float32_norm_optimizer_class()):
        """Opacus' DPOptimizer (its per-example norms in float32) with the per-example gradient
        clipped in groups: group g to its own norm C_g. One example's clipped gradient then has norm at most √(Σ C_g²), which Opacus
        uses as ``max_grad_norm``. The noise: one std σ·√(Σ C_g²) on every coordinate, or, with
        ``group_noise_stds``, group g's own std (``dp_sgd_noise_stds``); the accountant is unchanged
        either way (docs/privacy.md §0.1).

        Why: a trained head's per-example gradient is ~25x the adapters' (0.9 vs 0.035 for MiniLM
        at init), so one joint clip spends nearly all of C on the head and the adapters' share of
        the signal falls far below the noise."""

        def __init__(self, optimizer, *, group_of, group_clips, group_noise_stds=None, **kwargs):
            self.group_of = group_of  # id(param) -> group index
            self.group_clips = list(group_clips)
            self.group_noise_stds = None if group_noise_stds is None else list(group_noise_stds)
            super().__init__(optimizer, max_grad_norm=math.sqrt(sum(c * c for c in group_clips)), **kwargs)

        def add_noise(self):
            if self.group_noise_stds is None:
                return super().add_noise()  # one std, sigma * max_grad_norm, on every coordinate
            for p in self.params:
                _check_processed_flag(p.summed_grad)
                noise = _generate_noise(std=self.group_noise_stds[self.group_of[id(p)]], reference=p.summed_grad,
                                        generator=self.generator, secure_mode=self.secure_mode)
                p.grad = (p.summed_grad + noise).view_as(p)
                _mark_as_processed(p.summed_grad)

        def clip_and_accumulate(self):
            groups = [self.group_of[id(p)] for p in self.params]
            grad_samples = _float32_grad_samples(self)  # built once, for the norms and the sum
            n = len(grad_samples[0])
            factors = []
            for g, clip in enumerate(self.group_clips):
                sq = [gs.reshape(n, -1).pow(2).sum(dim=1) for gs, gp in zip(grad_samples, groups) if gp == g]
                norms = (torch.stack(sq, dim=1).sum(dim=1).sqrt() if sq and n
                         else torch.zeros(n, device=grad_samples[0].device))
                factors.append((clip / (norms + 1e-6)).clamp(max=1.0))
            for p, g, grad_sample in zip(self.params, groups, grad_samples):
                _check_processed_flag(p.grad_sample)
                grad_sample = grad_sample.to(p.dtype)
                grad = torch.einsum("i,i...", factors[g].to(grad_sample.device, p.dtype), grad_sample)
                p.summed_grad = grad if p.summed_grad is None else p.summed_grad + grad
                _mark_as_processed(p.grad_sample)

    return GroupClippedDPOptimizer


def dp_optimizer(base, named, params: DPSGDParams, *, generator: torch.Generator | None = None,
                 secure_mode: bool = False):
    """Opacus' optimizer for ``params`` around ``base`` (``named``: the trainable (name, tensor) pairs):
    one joint clip C, or, with a trained head and C_h > 0, the head clipped apart
    (``GroupClippedDPOptimizer``), its noise one std or split by ``params.head_noise_ratio``."""
    from opacus.optimizers import DPOptimizer

    common = dict(noise_multiplier=params.noise_multiplier, expected_batch_size=params.batch_size,
                  loss_reduction="mean", generator=generator, secure_mode=secure_mode)
    if params.head_clip > 0 and any(is_head_parameter(name) for name, _ in named):
        group_of = {id(p): int(is_head_parameter(name)) for name, p in named}
        return _group_clipped_optimizer_class()(
            base, group_of=group_of, group_clips=[params.clip, params.head_clip],
            group_noise_stds=list(params.noise_stds) if params.head_noise_ratio else None, **common)
    return _float32_norm_optimizer_class()(base, max_grad_norm=params.clip, **common)


def _empty_grad_samples(params) -> None:
    for p in params:
        p.grad_sample = torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device)


def dp_sgd_train_local(model, data: TokenizedSplit, *, params: DPSGDParams, lr: float,
                       sampling_generator: torch.Generator, noise_generator: torch.Generator | None,
                       device: torch.device, secure_noise: bool = False,
                       dropout_seed: int | None = None, optimizer: str = "adam",
                       physical_batch_size: int | None = None, optimizer_carry: dict | None = None,
                       canaries=None, adam_eps: float = 1e-8, head_lr_scale: float = 1.0,
                       label_smoothing: float = 0.0, precision: str = "auto") -> TrainStats:
    """One silo's round of DP-SGD on ``model`` (a PEFT model whose trainable set is settled).

    ``noise_generator`` feeds Opacus' Gaussian noise (seeded runs repeat); ``secure_noise`` uses
    Opacus' secure mode (sum of draws), for the hardened noise source. ``optimizer_carry``: the
    silo's optimizer state from its previous round, loaded before and saved after (post-processing
    of the silo's own noisy steps: it costs no privacy). ``canaries``: the white-box audit's
    gradient canaries (``audit.white_box.GradientCanaries``), never set in a federated run."""
    from opacus.optimizers import DPOptimizer

    problems = params.problems()
    if problems:
        raise ValueError("invalid DP-SGD parameters: " + "; ".join(problems))
    if noise_generator is not None and noise_generator.device.type != torch.device(device).type:
        raise ValueError(f"the DP-SGD noise generator is on {noise_generator.device}, the gradients on {device}: "
                         "make it on the gradients' device (training.loops.silo_randomness)")
    gsm = grad_sample_module(model)
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    trainable = [p for _, p in named]
    if not trainable:
        raise ValueError("DP-SGD needs at least one trainable tensor")
    base = local_optimizer(optimizer_groups(named, head_lr_scale), lr=lr, kind=optimizer, adam_eps=adam_eps)
    resume_optimizer(base, trainable, lr=lr, kind=optimizer, carry=optimizer_carry)
    optimizer_dp = dp_optimizer(base, named, params, generator=noise_generator, secure_mode=secure_noise)
    if canaries is not None:
        canaries.attach(optimizer_dp, trainable, params.clip)
    gsm.enable_hooks()
    gsm.train()
    losses = LossSum(device)
    count, seen, empty = 0, 0, 0
    try:
        chunk_size = physical_batch_size or physical_batch_size_for(device)
        with _seeded_dropout(dropout_seed, device), forward_context(model, data):
            for idx in batch_indices(len(data), params.batch_size, params.local_steps, sampling_generator,
                                     poisson=True, rate_size=getattr(data, "dp_size", None)):
                optimizer_dp.zero_grad(set_to_none=True)
                if len(idx) == 0:
                    empty += 1
                    _empty_grad_samples(trainable)  # noise-only step
                else:
                    # One logical (Poisson) batch in physical chunks: every chunk but the last only
                    # clips and accumulates (Opacus' skip-step), the last adds the noise once and
                    # steps. Same result as one pass; peak memory set by the chunk, not by b.
                    chunks = physical_chunks(data, idx, chunk_size)
                    for i, chunk in enumerate(chunks):
                        batch = data.batch(chunk, device)
                        with _autocast(device, precision):
                            out = gsm(**batch)
                        loss = training_loss(out, batch, label_smoothing)
                        loss.backward()
                        losses.add(loss, len(chunk) / len(idx))
                        if i < len(chunks) - 1:
                            optimizer_dp.signal_skip_step(do_skip=True)
                            optimizer_dp.step()
                            optimizer_dp.zero_grad(set_to_none=True)  # keeps the accumulated clipped sum
                    count += 1
                    seen += len(idx)
                optimizer_dp.step()
    finally:
        optimizer_dp.zero_grad(set_to_none=True)  # no per-example buffers survive the round
        # The hooks stay registered (one wrapper per process) but idle: plain training and
        # evaluation of the same model compute no per-example gradients.
        gsm.disable_hooks()
    keep_optimizer(base, trainable, kind=optimizer, carry=optimizer_carry)
    return TrainStats(loss=losses.mean(count), steps=params.local_steps,
                      examples_seen=seen, empty_steps=empty)
