"""The white-box DP-SGD audit inside a federated replay, every method and every control.

``fedpower_app.audit.white_box.run_federated_white_box_audit``: 3 silos, canaries in every silo's DP-SGD, every method, the correct
step and every control, at several claimed epsilons.

    python -m research.audit_federated_white_box --methods fedpower,fedlora,ffa-lora,fedsvd --epsilons 3,8

A 2-layer BERT (hidden 64) with MiniLM's tokenizer, LoRA r = 8 on query,value, the generated task's
192 rows over 3 silos (64 each), b = 32 (q = 0.5), L = 5, T = 4 (20 DP-SGD steps), C = 1,
delta = 1e-5, seeded noise.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--methods", default="fedpower,fedlora,ffa-lora,fedsvd")
    ap.add_argument("--epsilons", default="3,8")
    ap.add_argument("--canaries", type=int, default=4000)
    ap.add_argument("--guess-fraction", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)

    from fedpower_app.audit.white_box import CONTROLS, run_federated_white_box_audit
    from fedpower_app.config import parse_config
    from tests.tiny_bert import save_tiny_bert

    model_dir = save_tiny_bert(tempfile.mkdtemp(prefix="tiny-bert-"), num_layers=2)
    for method in a.methods.split(","):
        for eps in (float(e) for e in a.epsilons.split(",")):
            for control in CONTROLS:
                cfg = parse_config({"model.name": model_dir, "lora.rank": 8, "model.target-modules": "query,value",
                                    "lora.dropout": 0.0, "task.max-length": 16, "task.synthetic-train-size": 192,
                                    "task.synthetic-eval-size": 16, "strategy.name": method, "dp.epsilon": eps,
                                    "dp.clip": 1.0, "train.batch-size": 32, "train.local-steps": 5,
                                    "num-server-rounds": 4, "dp.noise": "seeded"})
                t0 = time.perf_counter()
                report = run_federated_white_box_audit(cfg, silos=3, canaries=a.canaries, control=control,
                                                       guess_fraction=a.guess_fraction)
                print(method, report.line(), f"[{time.perf_counter() - t0:.1f} s]", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
