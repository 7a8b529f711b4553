"""FedPower vs FedLoRA server release at MiniLM shapes (12 x 384^2, r = 8, K = 3), alone and
beside another process that keeps both cores busy (a 2-thread matmul loop), with 2 and 1 intra-op
threads. Shows why per-round server times measured on a shared machine spike (RESULTS.md, Table 3
supplement).

    python -m benchmarks.contention
"""
import statistics
import subprocess
import sys
import time

import torch

from benchmarks.server import Shape, case_fns, make_updates
shape = Shape("minilm", 6, ("query", "value"), 384, 384, 8)
ups, groups = make_updates(shape, 12)
fns = case_fns(ups, groups, shape, torch.device("cpu"))

def med(fn, n=40):
    fn(); ts = []
    for _ in range(n):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3, max(ts) * 1e3

HOG = "import torch; torch.set_num_threads(2); a=torch.randn(1500,1500)\nwhile True: a@a"
for threads in (2, 1):
    torch.set_num_threads(threads)
    for hog in (False, True):
        p = subprocess.Popen([sys.executable, "-c", HOG]) if hog else None
        if p: time.sleep(2)
        fp, fl = med(fns["fedpower-factored"]), med(fns["fedlora"])
        if p: p.kill(); p.wait()
        print(f"threads={threads} hog={hog}: fedpower median {fp[0]:.1f} ms (max {fp[1]:.0f}), fedlora median {fl[0]:.1f} ms (max {fl[1]:.0f}), ratio {fp[0]/fl[0]:.2f}", flush=True)
