"""FedPower's power iteration under secure aggregation, Flower-free.

The merge W = sum_i B_i A_i is not a sum of the factors, but the power iteration only multiplies W
by thin matrices, and each product is a sum over the clients of something each client computes on
its own factors:

    W Q^T = sum_i B_i (A_i Q^T)      (m x r: one secure sum per half-iteration)
    P^T W = sum_i (P^T B_i) A_i      (r x n: one secure sum per half-iteration)

So the warm-started iteration of PowerDP-L (``strategies.powerdp.powerdp_l``) runs with the server
seeing only these sums: 2 secure sums of an m x r and an r x n matrix per iteration instead of one
of m x n per client. With ``secure_sum`` adding each client's distributed discrete Gaussian share,
every sum is a release of the same form and sensitivity as PowerDP-L's noisy Y and X
(docs/secure-aggregation.md): a client's clipped dW_i moves W Q^T and P^T W by at most its norm.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from ..powerdp import orthonormalize_columns, orthonormalize_rows
from .distributed_dp import DistributedDiscreteGaussian
from .field import FieldQuantizer
from .protocol import SecureSumConfig, simulate

SecureSum = Callable[[list[np.ndarray]], np.ndarray]


def plain_sum(parts: list[np.ndarray]) -> np.ndarray:
    return np.sum(parts, axis=0)


def quantized_secure_sum(quantizer: FieldQuantizer, threshold: int, rng: np.random.Generator | None = None) -> SecureSum:
    """A ``SecureSum`` that quantizes each client's matrix and adds them with the in-process SecAgg+
    round (``protocol.simulate``): what the server would learn, within ``quantizer.error_bound``."""
    def secure_sum(parts: list[np.ndarray]) -> np.ndarray:
        shape = parts[0].shape
        if any(p.shape != shape for p in parts):
            raise ValueError("every client's part must have the same shape")
        nodes = tuple(range(1, len(parts) + 1))
        cfg = SecureSumConfig(nodes=nodes, size=int(np.prod(shape)), bits=quantizer.bits, threshold=threshold)
        total, survivors = simulate(cfg, {u: quantizer.encode(p, rng)[0] for u, p in zip(nodes, parts)})
        return quantizer.decode_sum(total, len(survivors)).reshape(shape)
    return secure_sum


def noisy_secure_sum(mechanism_for: Callable[[int], DistributedDiscreteGaussian], threshold: int,
                     rng: np.random.Generator | None = None, drop: dict | None = None) -> SecureSum:
    """A ``SecureSum`` where each client adds its distributed discrete Gaussian share
    (``mechanism_for(size)``: the mechanism for a part of ``size`` entries) before the SecAgg+ round."""
    def secure_sum(parts: list[np.ndarray]) -> np.ndarray:
        shape = parts[0].shape
        size = int(np.prod(shape))
        mech = mechanism_for(size)
        nodes = tuple(range(1, len(parts) + 1))
        cfg = SecureSumConfig(nodes=nodes, size=size, bits=mech.bits, threshold=threshold)
        total, _ = simulate(cfg, {u: mech.encode(p, rng) for u, p in zip(nodes, parts)}, drop=drop)
        return mech.decode_sum(total).reshape(shape)
    return secure_sum


def secure_power_iteration(factors: list[tuple[np.ndarray, np.ndarray]], a_prev: np.ndarray, iters: int,
                           secure_sum: SecureSum = plain_sum, *, clip: float | None = None,
                           public: tuple[np.ndarray, np.ndarray] | None = None,
                           denominator: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """The warm-started power iteration on W = B_g A_g + (1/m) sum_i clip_C(B_i A_i), with every
    product a secure sum of the clients' thin contributions. ``factors``: each client's
    (B_i (m x r_i), A_i (r_i x n)), at client level its factored round delta; ``clip``: C, each
    client scales its B_i so that ||B_i A_i||_F <= C (computed by the client); ``public``: the
    public (B_g, A_g), added by the server (default none); ``denominator``: m. ``a_prev``: the public
    start (r x n). Returns (B (m x r), A (r x n), orthonormal rows), the same as
    ``powerdp_l(W, a_prev=a_prev, iters=iters, noise_std=0)`` up to the sums' errors and noise."""
    if not factors:
        raise ValueError("no client factors")
    if not isinstance(iters, int) or iters < 1:
        raise ValueError(f"iters must be a positive integer, got {iters!r}")
    m, n = factors[0][0].shape[0], factors[0][1].shape[1]
    for B, A in factors:
        if B.ndim != 2 or A.ndim != 2 or B.shape[0] != m or A.shape[1] != n or B.shape[1] != A.shape[0]:
            raise ValueError(f"client factors must be (m x r_i, r_i x n) with m = {m}, n = {n}")
    if a_prev.ndim != 2 or a_prev.shape[1] != n or not 1 <= a_prev.shape[0] <= min(m, n):
        raise ValueError(f"a_prev must be r x {n} with 1 <= r <= {min(m, n)}, got {a_prev.shape}")

    if clip is not None:
        if not (np.isfinite(clip) and clip > 0):
            raise ValueError(f"clip must be a finite number > 0, got {clip!r}")
        norms = [float(np.sqrt(max(np.trace((B.T @ B) @ (A @ A.T)), 0.0))) for B, A in factors]
        factors = [(B * min(1.0, clip / nrm) if nrm > 0 else B, A) for (B, A), nrm in zip(factors, norms)]
    if not (np.isfinite(denominator) and denominator > 0):
        raise ValueError(f"denominator must be a finite number > 0, got {denominator!r}")
    Bg, Ag = public if public is not None else (np.zeros((m, 1)), np.zeros((1, n)))

    def t(x):
        return torch.as_tensor(np.asarray(x, dtype=np.float64))

    Q = orthonormalize_rows(t(a_prev)).numpy()
    P = X = None
    for _ in range(iters):
        Y = Bg @ (Ag @ Q.T) + secure_sum([B @ (A @ Q.T) for B, A in factors]) / denominator
        P = orthonormalize_columns(t(Y)).numpy()
        X = (P.T @ Bg) @ Ag + secure_sum([(P.T @ B) @ A for B, A in factors]) / denominator
        Q = orthonormalize_rows(t(X)).numpy()
    return P @ (X @ Q.T), Q


def refactorize_through_sums(sum_right: Callable, sum_left: Callable, q0: dict[str, torch.Tensor],
                             iters: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """FedPower's power iteration (``powerdp.power_iteration``, no noise) on the merge W of every
    module, with W reached only through averaged secure sums: ``sum_right(Q)`` returns W Q^T per
    module (m x r) for orthonormal-row bases Q (r x n), ``sum_left(P)`` returns P^T W (r x n) for
    orthonormal-column P (m x r). ``q0``: the public random start per module. 1 + 2 ``iters`` sums;
    returns (B = W Q^T, A = Q) per module, B A the rank-r approximation of W on the computed row
    space, as ``power_iteration`` from the same start (up to the sums' quantization error)."""
    if not isinstance(iters, int) or iters < 1:
        raise ValueError(f"iters must be a positive integer, got {iters!r}")
    Q = {m: orthonormalize_rows(q.to(torch.float64)) for m, q in q0.items()}
    Y = sum_right(Q)
    for _ in range(iters):
        P = {m: orthonormalize_columns(Y[m].to(torch.float64)) for m in Q}
        X = sum_left(P)
        Q = {m: orthonormalize_rows(X[m].to(torch.float64)) for m in Q}
        Y = sum_right(Q)
    return {m: Y[m] for m in Q}, Q


def powerdp_l_through_sums(sum_right: Callable, sum_left: Callable,
                           public: dict[str, tuple[torch.Tensor, torch.Tensor]],
                           iters: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """PowerDP-L (``powerdp.powerdp_l``) on W = B_g A_g + (average of the silos' clipped dW_i), warm-started
    from the public A_g, with the silos' part reached only through secure sums: ``sum_right(Q)``
    returns the averaged sum of dW_i Q^T per module (with the noise the silos added), ``sum_left(P)``
    that of P^T dW_i. The server adds the public parts B_g (A_g Q^T) and (P^T B_g) A_g. 2 ``iters``
    sums; returns (B = P X Q^T, A = Q) per module, as ``powerdp_l`` on the noisy iterates."""
    if not isinstance(iters, int) or iters < 1:
        raise ValueError(f"iters must be a positive integer, got {iters!r}")
    pub = {m: (B.to(torch.float64), A.to(torch.float64)) for m, (B, A) in public.items()}
    Q = {m: orthonormalize_rows(A) for m, (_, A) in pub.items()}
    P = X = None
    for _ in range(iters):
        dY = sum_right(Q)
        Y = {m: pub[m][0] @ (pub[m][1] @ Q[m].T) + dY[m].to(torch.float64) for m in Q}
        P = {m: orthonormalize_columns(Y[m]) for m in Q}
        dX = sum_left(P)
        X = {m: (P[m].T @ pub[m][0]) @ pub[m][1] + dX[m].to(torch.float64) for m in Q}
        Q = {m: orthonormalize_rows(X[m]) for m in Q}
    return {m: P[m] @ (X[m] @ Q[m].T) for m in Q}, Q
