"""Memory sizes, and how many ClientApps of a memory plan fit a GPU (Ray's ``num-gpus`` fraction)."""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from .plan import MemoryPlan

GIB = 2 ** 30
MIB = 2 ** 20
DEFAULT_HEADROOM = 0.20  # the caching allocator's reserved-but-unallocated slack and fragmentation
DEFAULT_CUDA_CONTEXT = 512 * MIB  # CUDA context, cuBLAS/cuDNN handles of one process (lazy module loading)

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b?|b)?\s*$", re.I)
_UNITS = {"": GIB, "b": 1, "k": 1000, "kb": 1000, "kib": 2 ** 10, "m": 10 ** 6, "mb": 10 ** 6, "mib": MIB,
          "g": 10 ** 9, "gb": 10 ** 9, "gib": GIB, "t": 10 ** 12, "tb": 10 ** 12, "tib": 2 ** 40,
          "ki": 2 ** 10, "mi": MIB, "gi": GIB, "ti": 2 ** 40}


def parse_size(text: str, *, allow_zero: bool = False) -> int:
    """``"24GiB"``, ``"16 GB"``, ``"512MiB"``, ``"24"`` (GiB) -> bytes."""
    m = _SIZE.match(str(text))
    if not m or (m.group(2) or "").lower() not in _UNITS:
        raise ValueError(f"not a memory size: {text!r} (use e.g. 24GiB, 16GB, 512MiB; a bare number is GiB)")
    value = float(m.group(1)) * _UNITS[(m.group(2) or "").lower()]
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"a memory size must be > 0, got {text!r}")
    return int(value)


def fmt(n: float) -> str:
    """Bytes in binary units (KiB, MiB, GiB)."""
    n = float(n)
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", 2 ** 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}" if unit == "GiB" else f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"



# ------------------------------------------------------------------------------------------------
# fitting a GPU: the Ray num-gpus fraction
# ------------------------------------------------------------------------------------------------
def server_need(plan: MemoryPlan, headroom: float = DEFAULT_HEADROOM,
                cuda_context: int = DEFAULT_CUDA_CONTEXT) -> float:
    """The ServerApp's share of the GPU it sits on (``server-device`` not ``cpu``): its copy of the
    model and a central evaluation's no-gradient pass (its merge and refactorization work on the
    thin factors, far smaller), with the same headroom and CUDA context as a ClientApp. It runs
    outside Ray, so Ray's ``num-gpus`` does not count it: the fit leaves it room on the first GPU."""
    return (plan.weights + plan.no_grad_peak) * (1 + headroom) + cuda_context


def gpu_fit(plan: MemoryPlan, gpu_memory: int, *, headroom: float = DEFAULT_HEADROOM,
            cuda_context: int = DEFAULT_CUDA_CONTEXT, reserve: float = 0.0) -> dict[str, Any]:
    """How many ClientApps of ``plan`` fit a GPU of ``gpu_memory`` bytes, and the ``num-gpus``
    fraction that makes Ray place that many: 1/k, truncated to Ray's 4 decimals so that k of them
    still sum to <= 1. ``reserve``: bytes already taken on that GPU (the ServerApp's,
    ``server_need``). Raises ValueError when not even one example fits."""
    total = gpu_memory
    gpu_memory = int(max(0.0, gpu_memory - reserve))
    need = plan.gpu_need(headroom, cuda_context)
    one = need if need <= gpu_memory else plan.gpu_need(headroom, cuda_context, chunk=1)
    if one > gpu_memory:
        raise ValueError(f"a GPU of {fmt(gpu_memory)} is too small for even one example: a ClientApp of "
                         f"{plan.model!r} needs {fmt(one)} at a chunk of 1 example x {plan.tokens} tokens "
                         f"(weights {fmt(plan.weights)}, CUDA context {fmt(cuda_context)}, "
                         f"{headroom:.0%} headroom)")
    per_gpu = int(gpu_memory // need)
    out: dict[str, Any] = {"gpu_memory": total, "need": need, "headroom": headroom, "reserved": reserve,
                           "cuda_context": cuda_context, "fits": per_gpu >= 1}
    if per_gpu >= 1:
        fraction = math.floor(10000 / per_gpu) / 10000
        out.update(per_gpu=per_gpu, num_gpus=fraction, used=per_gpu * need)
    else:
        largest = 1
        while largest < plan.chunk and plan.gpu_need(headroom, cuda_context, chunk=largest + 1) <= gpu_memory:
            largest += 1
        out.update(per_gpu=0, num_gpus=None, largest_chunk=largest)
    return out
