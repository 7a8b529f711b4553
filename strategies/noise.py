"""One pluggable, seedable source of every random draw that matters for privacy.

Gaussian noise, client sampling and example sampling all come from here (privacy-accounting spec §8):

* ``seeded`` (default, research): every stream is a ``torch.Generator`` derived from
  ``(seed, stream name, round)``. Runs are reproducible and audits can replay them. Anyone who
  knows the seed can subtract the noise, so this mode is **not** secure.
* ``hardened``: each stream is a torch generator seeded with 63 bits from the OS's CSPRNG
  (``secrets``) every time it is asked for (once per stream and round), and Gaussian noise uses
  the sum-of-draws mitigation of Holohan & Braghin (2021) as implemented by opacus
  ``secure_mode``: (g1 + g2 + g3 + g4) / 2 after discarding one draw. The draws themselves come
  from torch's generator, not from a CSPRNG stream, and the Gaussian is not an exact discrete one
  (``HARDENED_SOURCE``; docs/privacy.md).

Pure torch; no Flower import.
"""

from __future__ import annotations

import hashlib
import secrets

import torch

NOISE_MODES = ("hardened", "seeded")  # the same list as fedpower_app.choices.NOISE_MODES (tests/test_config.py checks)

#: What the hardened source is, said once (the guarantee's statement, the README and docs/privacy.md quote it).
HARDENED_SOURCE = ("every noise draw and sampling coin comes from a torch generator seeded, for each stream and "
                   "round, with 63 fresh bits of OS entropy where it is drawn (each silo's own, the server's own); "
                   "Gaussian noise is the sum of four draws (Opacus' secure mode); no output holds a seed")


def derive_seed(seed: int, stream: str, round_index: int) -> int:
    """A 63-bit seed that is a deterministic function of (seed, stream, round)."""
    digest = hashlib.sha256(f"{int(seed)}|{stream}|{int(round_index)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class NoiseSource:
    """Factory of generators and Gaussian/Bernoulli draws for one run.

    Args:
        seed: run seed (ignored in ``hardened`` mode).
        mode: ``"seeded"`` or ``"hardened"``.
    """

    def __init__(self, seed: int = 0, mode: str = "seeded") -> None:
        if mode not in NOISE_MODES:
            raise ValueError(f"noise mode must be one of {NOISE_MODES}, got {mode!r}")
        self.seed = int(seed)
        self.mode = mode

    @property
    def hardened(self) -> bool:
        return self.mode == "hardened"

    def stream_seed(self, stream: str, round_index: int = 0) -> int:
        """The 63-bit seed of one named stream in one round (OS entropy when hardened)."""
        if self.hardened:
            return secrets.randbits(63)
        return derive_seed(self.seed, stream, round_index)

    def generator(self, stream: str, round_index: int = 0, device: str | torch.device = "cpu") -> torch.Generator:
        """A fresh generator for one named stream in one round (never reused across rounds)."""
        gen = torch.Generator(device=device)
        gen.manual_seed(self.stream_seed(stream, round_index))
        return gen

    def gaussian(
        self,
        shape: tuple[int, ...] | torch.Size,
        std: float,
        generator: torch.Generator,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> torch.Tensor:
        """N(0, std^2) noise of ``shape``; float32 or wider (never half precision, privacy-accounting spec §8)."""
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"noise must be drawn in float32 or float64, got {dtype}")
        return gaussian(shape, std, generator, dtype=dtype, device=device, secure=self.hardened)

    def bernoulli(self, n: int, p: float, generator: torch.Generator) -> torch.Tensor:
        """``n`` independent coins with success probability ``p`` (Poisson sampling)."""
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"sampling probability must be in [0, 1], got {p}")
        return torch.rand(n, generator=generator, dtype=torch.float64) < p


def gaussian(
    shape,
    std: float,
    generator: torch.Generator,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    secure: bool = False,
) -> torch.Tensor:
    """Gaussian noise with the given std. ``secure`` applies the 4-draw sum (opacus secure_mode)."""
    std = float(std)
    if std < 0:
        raise ValueError(f"noise std must be >= 0, got {std}")
    if std == 0.0:
        return torch.zeros(shape, dtype=dtype, device=device)
    # Drawn where the generator lives, then moved: the server's generators are CPU ones, so the
    # same seed gives the same release on a CPU and on a GPU (a copy of the noise, the size of the
    # thin release, per round).
    at = draw_device(generator, device)
    if not secure:
        return torch.randn(shape, generator=generator, dtype=dtype, device=at).mul_(std).to(device)
    # Holohan & Braghin 2021 / opacus _generate_noise(secure_mode=True): discard one draw, then
    # (sum of 4 draws with std) / 2 has std `std` and hides the low-order bits of a single draw.
    torch.randn(shape, generator=generator, dtype=dtype, device=at)
    acc = torch.zeros(shape, dtype=dtype, device=at)
    for _ in range(4):
        acc.add_(torch.randn(shape, generator=generator, dtype=dtype, device=at), alpha=std)
    return acc.div_(2.0).to(device)


def draw_device(generator: torch.Generator | None, device: str | torch.device) -> torch.device:
    """Where a draw from ``generator`` must be made (torch draws only on the generator's device)."""
    return torch.device(device) if generator is None else generator.device
