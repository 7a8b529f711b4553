"""FedPower vs FedLoRA release time for one source tree (used to compare two commits).

    git worktree add /tmp/fedpower-old 0ec4093
    python benchmarks/release_pair.py /tmp/fedpower-old llama-2-7b 128
    python benchmarks/release_pair.py . llama-2-7b 128

Imports ``strategies`` (and this benchmark's input generator) from the given tree, runs one
warm-up and 3 interleaved timed repeats of each release at 1 thread, and prints the times and
the ratio of the medians. Run both trees back to back: the ratio, not the absolute time, is the
comparable figure on a shared machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tree", help="source tree to import strategies/ and benchmarks/ from")
    p.add_argument("shape", choices=["roberta-large", "llama-2-7b"])
    p.add_argument("modules", type=int)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    sys.path.insert(0, os.path.abspath(a.tree))
    import torch

    torch.set_num_threads(1)
    from benchmarks.common import median as med
    from benchmarks.server import SHAPES, gen, make_ctx, make_updates
    from strategies import fedlora_release, fedpower_release

    shape = SHAPES[a.shape]
    ups, groups = make_updates(shape, a.modules)
    ctx = make_ctx(groups, shape, factored=True, device=torch.device("cpu"))
    fp, fl = [], []
    for i in range(a.repeats + 1):  # the first pair is a warm-up
        t0 = time.perf_counter()
        fedpower_release(ups, ctx, 1e-3, gen("cpu"))
        t1 = time.perf_counter()
        fedlora_release(ups, ctx, 1e-3, 1e-3, gen("cpu"))
        t2 = time.perf_counter()
        if i:
            fp.append(t1 - t0)
            fl.append(t2 - t1)
    print(f"{a.tree} {shape.name} x{a.modules}: FedPower {med(fp):.3f} s, FedLoRA {med(fl):.3f} s, "
          f"ratio {med(fp) / med(fl):.2f}  (all: {[round(x, 3) for x in fp]} / {[round(x, 3) for x in fl]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
