"""Validation of client replies (pure python/torch; no Flower import).

A reply is accepted only if it carries exactly the expected adapter keys, with the expected
shapes, a floating dtype of at least 32 bits, and finite values. Anything else is dropped with a
reason the server logs and counts; a bad reply never crashes the round.
"""

from __future__ import annotations

import torch

ACCEPTED_DTYPES = (torch.float32, torch.float64)


class InvalidReply(ValueError):
    """A client reply that must be dropped; the message says why."""


# Serialized bytes allowed per array beyond its float64 payload (the .npy header is ~128 bytes).
HEADER_ALLOWANCE = 4096
_DTYPE_NAMES = {"float32": 4, "float64": 8}


def _check_keys(got, expected) -> None:
    missing = sorted(set(expected) - set(got))
    if missing:
        raise InvalidReply(f"missing {len(missing)} key(s), e.g. {missing[0]!r}")
    unexpected = sorted(set(got) - set(expected))
    if unexpected:
        raise InvalidReply(f"{len(unexpected)} unexpected key(s), e.g. {unexpected[0]!r}")


def check_declared_arrays(declared: dict[str, tuple[str, tuple[int, ...], int]],
                          expected: dict[str, tuple[int, ...]]) -> None:
    """Check a reply from its metadata only, before any tensor is decoded or allocated: the keys,
    each array's declared dtype and shape, and its serialized size against the most a float64
    array of the expected shape can need. ``declared`` maps key -> (dtype name, shape, bytes)."""
    _check_keys(declared, expected)
    for key, shape in expected.items():
        dtype, got_shape, nbytes = declared[key]
        if str(dtype) not in _DTYPE_NAMES:
            raise InvalidReply(f"{key!r} has dtype {dtype}, expected float32 or float64")
        if tuple(got_shape) != tuple(shape):
            raise InvalidReply(f"{key!r} has shape {tuple(got_shape)}, expected {tuple(shape)}")
        limit = 8 * int(torch.tensor(shape).prod().item() if shape else 1) + HEADER_ALLOWANCE
        if nbytes > limit:
            raise InvalidReply(f"{key!r} is {nbytes} bytes, more than the {limit} its shape allows")


def validate_tensors(tensors: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Check keys, shapes, dtypes and finiteness; return float32 copies or raise InvalidReply."""
    _check_keys(tensors, expected)
    out = {}
    for key, shape in expected.items():
        t = tensors[key]
        if not isinstance(t, torch.Tensor):
            raise InvalidReply(f"{key!r} is not a tensor")
        if tuple(t.shape) != tuple(shape):
            raise InvalidReply(f"{key!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
        if t.dtype not in ACCEPTED_DTYPES:
            raise InvalidReply(f"{key!r} has dtype {t.dtype}, expected float32 or float64")
        if not bool(torch.isfinite(t).all()):
            raise InvalidReply(f"{key!r} contains NaN or Inf")
        out[key] = t.to(torch.float32)
    return out
