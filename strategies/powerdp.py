"""Power iteration and PowerDP: the FedPower paper's refactorization (Alg. 1 and App. Alg. 5).

Everything here is batched over a leading "module" dimension M so that all adapted matrices of
one shape are processed by one batched matmul/QR (not a Python loop per module).

Shapes (per batch entry): W is m x n, the rank is r, the low-rank factors are B (m x r) and
A (r x n), and the update is W = B @ A.

Two equivalent ways to give W:

* **dense**: ``W`` of shape (M, m, n). Reference implementation, used by tests.
* **factored**: ``W = Bs @ As`` with ``Bs`` (M, m, R) and ``As`` (M, R, n), R = (clients x r).
  The server never forms W: every product is taken right-to-left through the factors, so time and
  memory are O(M (m + n) R r) instead of O(M m n).

For the same generator state the two give the same result up to float rounding: the random
start ``Q0`` and the noise are drawn in the same order and shapes.

With factors, the iteration itself runs in **Gram space**: every iterate lies in the column space
of Bs (left) or the row space of As (right), so it is kept as R x r coefficients, and the only
inputs it needs are the float64 Gram matrices Gb = Bs^T Bs and Ga = As As^T (R x R). Orthonormal
bases come from Cholesky factors of r x r Grams, which is Gram-Schmidt, i.e. exactly the QR basis
with a non-negative diagonal that the dense path uses. Only the start (As Q0^T) and the two
outputs touch m- or n-long vectors: 3 thin GEMMs per module instead of 2 per half-iteration plus
a tall QR each. If the Gram route is not accurate enough (W of rank < r, or ill-conditioned
iterates; checked by the orthogonality of the result in float64), the tall route is used instead.

PowerDP (paper Alg. 1) with noise std ``s``::

    Q <- Gaussian (r x n)
    repeat k times:  P <- orth_cols(W Q^T);  A <- P^T W;  Q <- orth_rows(A)
    B~ <- W Q^T + N(0, s^2);   A~ <- orth_rows(A + N(0, s^2))

The privacy analysis is *not* the paper's: both B~ and A~ depend on W through data-dependent
projections, so the valid sensitivity is the diameter 2*sqrt(2)*C of the released pair (see
docs/privacy.md). This file only does the math; noise stds come from ``fedpower_app.privacy.accounting``.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from .noise import draw_device

# A Gaussian sampler: (shape, std, generator) -> a fresh tensor the caller may consume (it is
# written into). ``NoiseSource.gaussian`` fits.
GaussianSampler = Callable[..., torch.Tensor]


def _default_sampler(shape, std, generator, *, dtype=torch.float32, device="cpu"):
    at = draw_device(generator, device)  # on the generator's device, then moved
    return torch.randn(shape, generator=generator, dtype=dtype, device=at).mul_(float(std)).to(device)


# --------------------------------------------------------------------------------------------
# Orthonormalisation (Gram-Schmidt semantics: QR with a non-negative diagonal of R)
# --------------------------------------------------------------------------------------------
def orthonormalize_columns(P: torch.Tensor) -> torch.Tensor:
    """Orthonormal basis of the columns of ``P`` (..., m, r), signs fixed so diag(R) >= 0."""
    Q, R = torch.linalg.qr(P, mode="reduced")
    signs = torch.sign(torch.diagonal(R, dim1=-2, dim2=-1))
    signs = torch.where(signs == 0, torch.ones_like(signs), signs)
    return Q.mul_(signs.unsqueeze(-2))  # Q is a fresh output of qr: scale in place


def orthonormalize_rows(A: torch.Tensor) -> torch.Tensor:
    """Orthonormal rows spanning the rows of ``A`` (..., r, n)."""
    return orthonormalize_columns(A.transpose(-1, -2)).transpose(-1, -2)


# --------------------------------------------------------------------------------------------
# Operators: W Q^T and P^T W, dense or through the factors
# --------------------------------------------------------------------------------------------
class _Dense:
    def __init__(self, W: torch.Tensor) -> None:
        self.W = W
        self.shape = W.shape  # (M, m, n)

    def right(self, Qt: torch.Tensor) -> torch.Tensor:  # W @ Qt, Qt (M, n, r)
        return self.W @ Qt

    def right_rows(self, Q: torch.Tensor) -> torch.Tensor:  # (W @ Q^T)^T as a (M, r, m) view
        return (self.W @ Q.transpose(-1, -2)).transpose(-1, -2)

    def left(self, Pt: torch.Tensor) -> torch.Tensor:  # Pt @ W, Pt (M, r, m)
        return Pt @ self.W


class _Factored:
    def __init__(self, Bs: torch.Tensor, As: torch.Tensor) -> None:
        if Bs.shape[-1] != As.shape[-2] or Bs.shape[:-2] != As.shape[:-2]:
            raise ValueError(f"factor shapes do not chain: B {tuple(Bs.shape)} vs A {tuple(As.shape)}")
        self.Bs, self.As = Bs, As
        self.shape = (*Bs.shape[:-1], As.shape[-1])  # (M, m, n)

    # Products are taken in "row" form: every batched GEMM has a short side of r or R and a long
    # output side of m or n, the layout MKL/cuBLAS handle fastest (a tall m x r output from
    # (m x R) @ (R x r) is several times slower on CPU). Same values, different association.
    def right(self, Qt: torch.Tensor) -> torch.Tensor:
        return self.right_rows(Qt.transpose(-1, -2)).transpose(-1, -2)

    def right_rows(self, Q: torch.Tensor) -> torch.Tensor:  # Q W^T = (Q As^T) Bs^T, (M, r, m)
        return (Q @ self.As.transpose(-1, -2)) @ self.Bs.transpose(-1, -2)

    def left(self, Pt: torch.Tensor) -> torch.Tensor:  # P^T W = (P^T Bs) As, (M, r, n)
        return (Pt @ self.Bs) @ self.As


# --------------------------------------------------------------------------------------------
# Gram-space route for factored inputs
# --------------------------------------------------------------------------------------------
# Float64 Gram matrices are built this many float32 entries at a time, so the float64 copies
# stay ~8 MB (the server's peak memory stays ~2x the received adapters).
_GRAM_CHUNK_ELEMS = 1 << 20
# Largest orthogonality error (max |Q Q^T - I| in float64) the Gram route may leave. Cholesky-QR
# loses accuracy as cond(iterate)^2; past this the tall QR route is used. The clipping margin
# (aggregation.CLIP_MARGIN = 1e-4) covers ||Q||_2 <= 1 + 1e-6 with room to spare.
_GRAM_ORTH_TOL = 1e-6


def factor_grams(BsT: torch.Tensor, As: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 Grams ``(Bs^T Bs, As As^T)``, each (M, R, R), of ``BsT`` (M, R, m) and ``As`` (M, R, n)."""
    M, R = As.shape[0], As.shape[-2]
    per = min(M, max(1, _GRAM_CHUNK_ELEMS // max(1, R * max(BsT.shape[-1], As.shape[-1]))))
    gb = torch.empty((M, R, R), dtype=torch.float64, device=As.device)
    ga = torch.empty_like(gb)
    # One float64 staging buffer, reused for every chunk: a fresh buffer per chunk would be a fresh
    # mmap each time, and its page faults cost more than the conversion itself.
    buf = torch.empty((per, R, max(BsT.shape[-1], As.shape[-1])), dtype=torch.float64, device=As.device)
    for src, gram in ((BsT, gb), (As, ga)):
        d = src.shape[-1]
        for s in range(0, M, per):
            c = min(per, M - s)
            x = buf[:c, :, :d]
            x.copy_(src[s : s + c])
            torch.matmul(x, x.transpose(-1, -2), out=gram[s : s + c])
    return gb, ga


def _chol_orth_rows(X: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """Gram-Schmidt in coefficients. The rows of ``X`` (M, r, R) stand for vectors X F, where
    F (R x d) has Gram F F^T = ``gram``. Returns L^{-1} X with L L^T = X G X^T (Cholesky, positive
    diagonal): the coefficients of orth_rows(X F), the same basis as QR with diag(R) >= 0."""
    S = X @ gram @ X.transpose(-1, -2)
    L, info = torch.linalg.cholesky_ex(S)
    if bool((info != 0).any()):
        raise _GramRouteFailed
    return torch.linalg.solve_triangular(L, X, upper=False)


class _GramRouteFailed(Exception):
    """The Gram route cannot give an accurate orthonormal basis here (rank < r or too ill-conditioned)."""


def _gram_iteration(y: torch.Tensor, grams, iters: int, *, lift_q: bool):
    """Power iteration on W = Bs As through its Grams, from the start Q0 W^T = y Bs^T.

    Returns the float64 coefficients ``(x, y)``: the rows x As are Q (orthonormal, if ``lift_q``)
    or the last half-step P^T W (otherwise), and B = W Q^T = Bs y^T.

    Coefficient bookkeeping (row form, every array (M, r, R), float64):
      Q W^T = y Bs^T,   P^T = p Bs^T,   P^T W = a As,   Q = q As
    with  p = orth(y; Gb),  a = p Gb,  q = orth(a; Ga),  next y = q Ga.
    """
    gb, ga = grams
    for _ in range(iters):
        p = _chol_orth_rows(y, gb)
        a = p @ gb
        q = _chol_orth_rows(a, ga)
        y = q @ ga
    # The last P and Q must be orthonormal to float accuracy: the sensitivity bound uses ||Q||_2 <= 1.
    eye = torch.eye(q.shape[-2], dtype=torch.float64, device=q.device)
    orth_err = max(float((p @ gb @ p.transpose(-1, -2) - eye).abs().max()),
                   float((q @ ga @ q.transpose(-1, -2) - eye).abs().max()))
    if not math.isfinite(orth_err) or orth_err > _GRAM_ORTH_TOL:
        raise _GramRouteFailed
    return (q if lift_q else a), y


def _tall_iteration(op, Q, iters, *, lift_q: bool):
    """Power iteration with m- and n-long iterates and tall QRs (dense W, or the Gram fallback)."""
    A = None
    for _ in range(iters):
        Pt = orthonormalize_rows(op.right_rows(Q))  # = orth_cols(W Q^T)^T
        A = op.left(Pt)
        del Pt  # free (M, r, m) before the QR below allocates: keeps the server peak low
        Q = orthonormalize_rows(A)
    return (Q if lift_q else A), op.right_rows(Q).transpose(-1, -2).contiguous()


def _subspace(W, factors, grams, rank, iters, generator, *, lift_q: bool):
    """Random start, then ``iters`` power iterations: returns (Q or P^T W, B = W Q^T); see above."""
    op = _operator(W, factors)
    _check(op.shape, rank, iters)
    dtype, device = _dtype_device(W, factors)
    Q0 = _random_start(op.shape, rank, generator, dtype, device)
    if factors is not None:
        BsT, As = factors[0].transpose(-1, -2), factors[1]
        try:
            x, y = _gram_iteration((Q0 @ As.transpose(-1, -2)).double(),  # Q0 W^T = (Q0 As^T) Bs^T
                                   grams if grams is not None else factor_grams(BsT, As),
                                   iters, lift_q=lift_q)
        except _GramRouteFailed:
            return _tall_iteration(op, Q0, iters, lift_q=lift_q)
        del Q0  # before the two lifts allocate: keeps the server peak low
        # B = Bs y^T is computed column-major so it comes out (M, m, r) contiguous (a row-form
        # product plus a transposing copy costs ~1.6x as much).
        return x.to(dtype) @ As, factors[0] @ y.to(dtype).transpose(-1, -2)
    return _tall_iteration(op, Q0, iters, lift_q=lift_q)


def _operator(W=None, factors=None):
    if (W is None) == (factors is None):
        raise ValueError("give exactly one of W (dense) or factors=(Bs, As)")
    return _Dense(W) if W is not None else _Factored(*factors)


def _add_noise(X: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """X + noise, written into ``noise``: the sampler's output is consumed (each draw is used
    exactly once, privacy-accounting spec §8), and a sampler must return a fresh tensor it does not keep. Adding into
    the fresh draw saves an allocation the size of the release."""
    if noise.shape != X.shape or not noise.is_contiguous():
        return (X + noise).contiguous()
    return noise.add_(X)


def _random_start(shape, rank, generator, dtype, device) -> torch.Tensor:
    """Gaussian Q0 (M, r, n): data-independent, drawn first so dense and factored agree."""
    *batch, _, n = shape
    at = draw_device(generator, device)  # on the generator's device, then moved
    return torch.randn((*batch, rank, n), generator=generator, dtype=dtype, device=at).to(device)


def _check(shape, rank, iters):
    m, n = shape[-2], shape[-1]
    if rank < 1 or rank > min(m, n):
        raise ValueError(f"rank must be in [1, min(m, n) = {min(m, n)}], got {rank}")
    if iters < 1:
        raise ValueError(f"power iterations must be >= 1, got {iters}")


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------
def power_iteration(
    W: torch.Tensor | None = None,
    *,
    factors: tuple[torch.Tensor, torch.Tensor] | None = None,
    grams: tuple[torch.Tensor, torch.Tensor] | None = None,
    rank: int,
    iters: int,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-private simultaneous power iteration (paper App. Alg. 5).

    Returns ``(B, A)`` with ``A`` (M, r, n) having orthonormal rows and ``B = W A^T`` (M, m, r),
    so ``B @ A`` is the rank-r approximation of W on the computed row space. ``grams`` (optional,
    factored only) are ``factor_grams`` of the factors, if the caller already has them.
    """
    A, B = _subspace(W, factors, grams, rank, iters, generator, lift_q=True)
    return B, A


def powerdp(
    W: torch.Tensor | None = None,
    *,
    factors: tuple[torch.Tensor, torch.Tensor] | None = None,
    grams: tuple[torch.Tensor, torch.Tensor] | None = None,
    rank: int,
    iters: int,
    noise_std: float,
    generator: torch.Generator,
    sampler: GaussianSampler | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PowerDP (paper Alg. 1): power iteration with Gaussian noise on the final B~ and A~.

    Returns ``(B_tilde, A_tilde)``: B~ = W Q^T + N (M, m, r) and A~ = orth_rows(P^T W + N)
    (M, r, n). With ``noise_std == 0`` this is power iteration's subspace with B = W Q^T.
    The noise std is per entry; the caller derives it from the accountant (z * Delta).
    """
    dtype, device = _dtype_device(W, factors)
    sample = sampler or _default_sampler
    A, B = _subspace(W, factors, grams, rank, iters, generator, lift_q=False)
    # Fresh noise for each released block, drawn in a fixed order: B~ first, then A~.
    B_tilde = _add_noise(B, sample(tuple(B.shape), noise_std, generator, dtype=dtype, device=device))
    A_noisy = _add_noise(A, sample(tuple(A.shape), noise_std, generator, dtype=dtype, device=device))
    return B_tilde, orthonormalize_rows(A_noisy)


def powerdp_l(
    W: torch.Tensor | None = None,
    *,
    factors: tuple[torch.Tensor, torch.Tensor] | None = None,
    a_prev: torch.Tensor,
    iters: int = 1,
    noise_std: float,
    generator: torch.Generator,
    sampler: GaussianSampler | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PowerDP-L (privacy-accounting privacy-accounting spec §3.2): a noisy power method warm-started from the previous round's
    public A (``a_prev`` (M, r, n), rows orthonormalised here), noise inside every iteration::

        Q <- orth_rows(a_prev)
        repeat iters times:
            Y <- W Q^T + N(0, s^2)        (M, m, r)   Lipschitz: ||(W - W') Q^T|| <= ||W - W'||_F
            P <- orth_cols(Y)
            X <- P^T W + N(0, s^2)        (M, r, n)   Lipschitz given the released Y
            Q <- orth_rows(X)
        A <- Q;  B <- P (X A^T)           so B A = P X A^T A, the noisy rank-r approximation

    Every release is a Gaussian mechanism on a 1-Lipschitz function of W, so 2*iters adaptive
    releases with sensitivity Delta_W give the effective multiplier z = s / (sqrt(2 iters) Delta_W)
    (fedpower_app.privacy.accounting.plan). With ``noise_std == 0`` it is the warm-started power iteration.
    Factored input (W = Bs @ As) is never formed: O(M (m + n) R r) per iteration.
    """
    op = _operator(W, factors)
    m, n = op.shape[-2], op.shape[-1]
    rank = a_prev.shape[-2]
    _check(op.shape, rank, iters)
    if tuple(a_prev.shape[-1:]) != (n,) or a_prev.shape[:-2] != op.shape[:-2]:
        raise ValueError(f"a_prev has shape {tuple(a_prev.shape)}, expected (..., {rank}, {n}) for W {tuple(op.shape)}")
    dtype, device = _dtype_device(W, factors)
    sample = sampler or _default_sampler
    Q = orthonormalize_rows(a_prev.to(dtype=dtype, device=device))
    P = X = None
    for _ in range(iters):
        # Y and X are the released (noisy) quantities; drawn in a fixed order: Y, then X, per iteration.
        Y = _add_noise(op.right(Q.transpose(-1, -2)), sample((*op.shape[:-2], m, rank), noise_std, generator,
                                                              dtype=dtype, device=device))
        P = orthonormalize_columns(Y)
        X = _add_noise(op.left(P.transpose(-1, -2)), sample((*op.shape[:-2], rank, n), noise_std, generator,
                                                             dtype=dtype, device=device))
        Q = orthonormalize_rows(X)
    B = P @ (X @ Q.transpose(-1, -2))
    return B, Q


def input_perturbation(
    W: torch.Tensor | None = None,
    *,
    factors: tuple[torch.Tensor, torch.Tensor] | None = None,
    rank: int,
    iters: int,
    noise_std: float,
    generator: torch.Generator,
    sampler: GaussianSampler | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Input perturbation (paper §6.3): W~ = W + N(0, s^2 I_{m x n}), then power iteration.

    The noise is full rank, so this ablation necessarily materialises one m x n matrix per module.
    Power iteration after the noise is post-processing.
    """
    op = _operator(W, factors)
    _check(op.shape, rank, iters)
    dtype, device = _dtype_device(W, factors)
    sample = sampler or _default_sampler
    dense = W if W is not None else factors[0] @ factors[1]
    noisy = dense + sample(tuple(dense.shape), noise_std, generator, dtype=dtype, device=device)
    return power_iteration(noisy, rank=rank, iters=iters, generator=generator)


def output_perturbation(
    W: torch.Tensor | None = None,
    *,
    factors: tuple[torch.Tensor, torch.Tensor] | None = None,
    grams: tuple[torch.Tensor, torch.Tensor] | None = None,
    rank: int,
    iters: int,
    noise_std_a: float,
    noise_std_b: float,
    generator: torch.Generator,
    sampler: GaussianSampler | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output perturbation (paper §6.3): non-private power iteration, then noise on B and A.

    A has orthonormal rows (its diameter is 2 sqrt(r) per module, independent of C) and
    B = W A^T (diameter 2C), hence two different noise stds.
    """
    B, A = power_iteration(W, factors=factors, grams=grams, rank=rank, iters=iters, generator=generator)
    dtype, device = B.dtype, B.device
    sample = sampler or _default_sampler
    B_noisy = B + sample(tuple(B.shape), noise_std_b, generator, dtype=dtype, device=device)
    A_noisy = A + sample(tuple(A.shape), noise_std_a, generator, dtype=dtype, device=device)
    return B_noisy, A_noisy


def _dtype_device(W, factors):
    ref = W if W is not None else factors[0]
    if ref.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"PowerDP math runs in float32 or float64, got {ref.dtype}")
    return ref.dtype, ref.device
