"""What a client puts into a secure sum, and how the server reads the sum back (Flower-free).

A secure sum adds vectors, so every round of a strategy under secure aggregation is written as a few
sums of flat vectors that each client computes from its own trained adapters:

* ``"trained"``: the client's whole reply (A and B of every module as it trained them, and the head),
  flattened in the server's key order. The sum divided by the number of survivors is the average a
  FedLoRA, FFA-LoRA or FedSVD round releases.
* ``"power-right"``: B_i (A_i Q^T) per module (m x r), with the server's basis Q (r x n, orthonormal
  rows), optionally followed by the head: one half-step of FedPower's power iteration on the merge
  W = (1/k) sum_i B_i A_i without forming W (strategies/secure_sum/power.py).
* ``"power-left"``: (P^T B_i) A_i per module (r x n), with the server's basis P (m x r).

At client level (distributed DP) the same on the silo's round delta against the global it received:
``"delta"`` (trained minus global), ``"power-right-delta"`` (dW_i Q^T, dW_i = B_i A_i - B_g A_g, and
the head's change) and ``"power-left-delta"`` (P^T dW_i), each scaled by the one factor
min(1, C / ||(dW_i, dhead_i)||) that clips the silo's whole change to C, so every product of the
round has norm <= C (the bases are orthonormal).

Every vector ends with one more coordinate, the fraction of the client's coordinates that fell
outside the quantizer's range and were clamped: the server learns only the total over the survivors
and warns when it is not zero (raise ``secagg.clip-range``).
"""

from __future__ import annotations

import numpy as np
import torch

LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"
INPUT_KINDS = ("trained", "power-right", "power-left", "delta", "power-right-delta", "power-left-delta")


def flatten(state: dict[str, torch.Tensor], keys: list[str]) -> np.ndarray:
    """The tensors of ``keys`` (in that order) as one float64 vector."""
    missing = [k for k in keys if k not in state]
    if missing:
        raise ValueError(f"the trained state lacks {missing[:3]}{'...' if len(missing) > 3 else ''}")
    if not keys:
        return np.zeros(0)
    return np.concatenate([state[k].detach().to("cpu", torch.float64).reshape(-1).numpy() for k in keys])


def unflatten(vector: np.ndarray, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """A flat vector back into float32 tensors of ``shapes`` (in that dict's order)."""
    out, at = {}, 0
    for key, shape in shapes.items():
        size = int(np.prod(shape)) if shape else 1
        out[key] = torch.as_tensor(np.asarray(vector[at: at + size], dtype=np.float32)).reshape(shape)
        at += size
    if at != len(vector):
        raise ValueError(f"a vector of {len(vector)} values does not fill shapes totalling {at}")
    return out


def vector_size(kind: str, shapes: dict[str, tuple[int, ...]], modules: list[str], rank: int,
                extras: list[str] = ()) -> int:
    """The length of a ``kind`` contribution (without the clamp coordinate)."""
    if kind in ("trained", "delta"):
        return sum(int(np.prod(s)) for s in shapes.values())
    if kind not in INPUT_KINDS:
        raise ValueError(f"unknown secure-sum input {kind!r}; valid choices: {list(INPUT_KINDS)}")
    side = 0 if kind.startswith("power-right") else 1  # m x r from B's rows, or r x n from A's columns
    size = sum(shapes[m + (LORA_B if side == 0 else LORA_A)][side] * rank for m in modules)
    return size + sum(int(np.prod(shapes[k])) for k in extras)


def merged_delta_scale(state, glob, modules, extras, clip: float) -> float:
    """min(1, C / ||(dW over every module, dhead)||_F), dW = B A - B_g A_g (float64, dense on the silo)."""
    sq = 0.0
    for name in modules:
        dW = (state[name + LORA_B].double() @ state[name + LORA_A].double()
              - glob[name + LORA_B].double() @ glob[name + LORA_A].double())
        sq += float((dW * dW).sum())
    for k in extras:
        d = state[k].double() - glob[k].double()
        sq += float((d * d).sum())
    norm = sq ** 0.5
    return 1.0 if norm <= clip else clip / norm


def contribution(kind: str, state: dict[str, torch.Tensor], *, keys: list[str], modules: list[str],
                 basis: dict[str, torch.Tensor] | None = None, extras: list[str] = (),
                 glob: dict[str, torch.Tensor] | None = None, clip: float | None = None) -> np.ndarray:
    """A client's vector for one secure sum, from its trained ``state``.

    ``keys``: the reply's keys in the server's order (``"trained"``); ``basis``: Q per module (r x n,
    ``"power-right"``) or P per module (m x r, ``"power-left"``); ``extras``: head tensors appended
    after a power product (the first sum of a FedPower round carries the head's average too)."""
    if kind == "trained":
        return flatten(state, keys)
    if kind not in INPUT_KINDS:
        raise ValueError(f"unknown secure-sum input {kind!r}; valid choices: {list(INPUT_KINDS)}")
    if kind.endswith("delta"):
        if glob is None:
            raise ValueError(f"a {kind} sum needs the global adapters the silo received")
        if kind == "delta":
            return flatten(state, keys) - flatten(glob, keys)
        if clip is None:
            raise ValueError(f"a {kind} sum needs the clip C")
        head = list(extras) if kind == "power-right-delta" else []
        scale = merged_delta_scale(state, glob, modules, list(extras_all(state, modules)), clip)
        return scale * _delta_products(kind, state, glob, modules, basis, head)
    if basis is None or set(basis) != set(modules):
        raise ValueError(f"a {kind} sum needs the server's basis for every module")
    parts = []
    for name in modules:
        B = state[name + LORA_B].detach().to("cpu", torch.float64)
        A = state[name + LORA_A].detach().to("cpu", torch.float64)
        U = basis[name].detach().to("cpu", torch.float64)
        if kind == "power-right":  # U = Q (r x n): B (A Q^T), m x r
            if U.shape[1] != A.shape[1]:
                raise ValueError(f"module {name}: basis {tuple(U.shape)} does not match A {tuple(A.shape)}")
            parts.append((B @ (A @ U.T)).reshape(-1).numpy())
        else:  # U = P (m x r): (P^T B) A, r x n
            if U.shape[0] != B.shape[0]:
                raise ValueError(f"module {name}: basis {tuple(U.shape)} does not match B {tuple(B.shape)}")
            parts.append(((U.T @ B) @ A).reshape(-1).numpy())
    if extras:
        parts.append(flatten(state, list(extras)))
    return np.concatenate(parts)


def extras_all(state, modules) -> list[str]:
    """The non-adapter tensors of a state (the head), in sorted order."""
    adapters = {m + LORA_A for m in modules} | {m + LORA_B for m in modules}
    return sorted(k for k in state if k not in adapters)


def _delta_products(kind, state, glob, modules, basis, head) -> np.ndarray:
    if basis is None or set(basis) != set(modules):
        raise ValueError(f"a {kind} sum needs the server's basis for every module")
    parts = []
    for name in modules:
        dW = (state[name + LORA_B].double() @ state[name + LORA_A].double()
              - glob[name + LORA_B].double() @ glob[name + LORA_A].double())
        U = basis[name].detach().to("cpu", torch.float64)
        if U.shape[1 if kind == "power-right-delta" else 0] != dW.shape[1 if kind == "power-right-delta" else 0]:
            raise ValueError(f"module {name}: basis {tuple(U.shape)} does not match the adapter")
        parts.append((dW @ U.T if kind == "power-right-delta" else U.T @ dW).reshape(-1).numpy())
    if head:
        parts.append(flatten(state, head) - flatten(glob, head))
    return np.concatenate(parts)


def check_basis(kind: str, basis: dict[str, torch.Tensor], tol: float = 1e-3) -> None:
    """A client's check of the server's basis: orthonormal rows (Q) or columns (P). With it, a
    client's product moves by at most its own ||B_i A_i||_F: the server cannot scale a client's
    contribution up, or pick out single coordinates, through the basis."""
    for name, U in basis.items():
        U = U.detach().to("cpu", torch.float64)
        if U.ndim != 2 or not torch.isfinite(U).all():
            raise ValueError(f"module {name}: the basis must be a finite matrix")
        G = U @ U.T if kind.startswith("power-right") else U.T @ U
        if (G - torch.eye(G.shape[0], dtype=G.dtype)).abs().max() > tol:
            raise ValueError(f"module {name}: the server's basis is not orthonormal")


def silo_vector(request: dict, trained: dict[str, torch.Tensor], glob: dict[str, torch.Tensor] | None) -> np.ndarray:
    """A silo's vector for the masked-input stage of ``request`` (its ``input`` kind, the server's
    basis, the keys, modules and head, and the public config with any noise parameters), from the
    adapters it trained and the global it received. Checks what the server sent first: noise shares
    only on round deltas, and an orthonormal basis."""
    kind = request.get("input")
    noise = request["config"].get("noise")
    if noise is not None and not str(kind).endswith("delta"):
        raise ValueError(f"noise shares are defined on round deltas, not on {kind!r}")
    if noise is None and str(kind).endswith("delta") and kind != "delta":
        raise ValueError(f"a {kind} sum needs the noise parameters (its clip)")
    basis = None
    if str(kind).startswith("power"):
        basis = {m: torch.as_tensor(np.asarray(b)) for m, b in dict(request["basis"]).items()}
        check_basis(kind, basis)
    return contribution(kind, trained, keys=list(request.get("keys", [])), modules=list(request.get("modules", [])),
                        basis=basis, extras=list(request.get("extras", [])), glob=glob,
                        clip=float(noise["clip"]) if noise is not None else None)
