"""FedPower vs FedLoRA server release at MiniLM shapes (12 x 384^2, r = 8, K = 3), alone and
beside another process that keeps both cores busy (a 2-thread matmul loop), with 2 and 1 intra-op
threads. Shows why per-round server times measured on a shared machine spike (RESULTS.md, Table 3
supplement).

    python -m benchmarks.contention
"""

from __future__ import annotations

import subprocess
import sys
import time

# A second process that keeps both cores busy with 2-thread matmuls until it is killed.
_BUSY_LOOP = "import torch; torch.set_num_threads(2); a = torch.randn(1500, 1500)\nwhile True: a @ a"


def main(repeats: int = 40) -> int:
    import torch

    from benchmarks.common import interleaved, median
    from benchmarks.server import Shape, case_fns, make_updates

    shape = Shape("minilm", 6, ("query", "value"), 384, 384, 8)
    ups, groups = make_updates(shape, shape.total_modules)
    fns = case_fns(ups, groups, shape, torch.device("cpu"))
    cases = {"fedpower": fns["fedpower-factored"], "fedlora": fns["fedlora"]}
    for threads in (2, 1):
        torch.set_num_threads(threads)
        for busy in (False, True):
            neighbour = subprocess.Popen([sys.executable, "-c", _BUSY_LOOP]) if busy else None
            try:
                if neighbour:
                    time.sleep(2)  # let it start and occupy the cores
                times = interleaved(cases, repeats=repeats, device=torch.device("cpu"))
            finally:
                if neighbour:
                    neighbour.kill()
                    neighbour.wait()
            fp, fl = (median(times[c]) * 1e3 for c in cases)
            print(f"threads={threads} busy neighbour={busy}: fedpower median {fp:.1f} ms "
                  f"(max {max(times['fedpower']) * 1e3:.0f}), fedlora median {fl:.1f} ms "
                  f"(max {max(times['fedlora']) * 1e3:.0f}), ratio {fp / fl:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
