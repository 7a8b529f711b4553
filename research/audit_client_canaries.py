"""Canary clients (fedpower_app.audit.client_canaries) at client level, every control.

    python -m research.audit_client_canaries METHODS EPSILONS CANARIES CLIENTS ROUNDS DIM
    python -m research.audit_client_canaries fedlora,ffa-lora,fedpower 2,8 2000 100 10 256
"""
import sys
import time

import torch

from fedpower_app.audit.client_canaries import run_client_canary_audit
from fedpower_app.audit.white_box import CONTROLS

torch.set_num_threads(1)
for method in sys.argv[1].split(","):
    for eps in [float(e) for e in sys.argv[2].split(",")]:
        for control in CONTROLS:
            t = time.time()
            r = run_client_canary_audit(method=method, epsilon=eps, canaries=int(sys.argv[3]), clients=int(sys.argv[4]),
                                        rounds=int(sys.argv[5]), control=control, dim=int(sys.argv[6]))
            print(method, r.line().replace("white-box DP-SGD audit, ", ""), f"{time.time() - t:.1f}s", flush=True)
