"""Write a float16 copy of a safetensors checkpoint (floating tensors only; integer buffers as they are).

    python benchmarks/gpu/half_weights.py SRC/model.safetensors DST/model.safetensors

The product loads weights with ``torch_dtype=float32`` (``fedpower_app/model.py``), so a float16
file is upcast on load: only the rounding to float16 remains (relative error <= 2**-11 for every
weight in float16's normal range). It refuses a checkpoint with a value outside float16's range,
and reports how many nonzero weights fall below float16's smallest normal (they lose precision).
"""

from __future__ import annotations

import sys

import torch
from safetensors.torch import load_file, save_file

FP16_MAX = float(torch.finfo(torch.float16).max)
FP16_TINY = float(torch.finfo(torch.float16).tiny)  # smallest normal


def half_copy(src: str, dst: str) -> dict:
    state = load_file(src)
    out, total, subnormal = {}, 0, 0
    for name, t in state.items():
        if not t.is_floating_point():
            out[name] = t.contiguous()
            continue
        peak = float(t.abs().max()) if t.numel() else 0.0
        if peak > FP16_MAX:
            raise SystemExit(f"half_weights: {name} has |value| {peak:g} > float16's max {FP16_MAX:g}")
        total += t.numel()
        subnormal += int(((t != 0) & (t.abs() < FP16_TINY)).sum())
        out[name] = t.to(torch.float16).contiguous()
    save_file(out, dst, metadata={"format": "pt"})
    return {"tensors": len(state), "floating_values": total, "below_fp16_normal": subnormal}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        raise SystemExit("usage: python benchmarks/gpu/half_weights.py SRC.safetensors DST.safetensors")
    info = half_copy(*argv)
    print(f"half_weights: {info['tensors']} tensors, {info['floating_values']:,} floating values in float16 "
          f"({info['below_fp16_normal']:,} nonzero below float16's smallest normal) -> {argv[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
