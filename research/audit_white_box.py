"""The white-box DP-SGD audit on one silo, with the correct step and its positive controls.

``fedpower_app.audit.white_box`` on a tiny BERT, at several claimed epsilons, with the correct step
and the three positive controls.

    python -m research.audit_white_box --canaries 4000 --guess-fraction 0.1 --rank 8 \\
        --targets query,value --epsilons 2,8
    python -m research.audit_white_box --canaries 20000 --guess-fraction 0.5 --rank 16 \\
        --targets query,key,value,dense --epsilons 8,3

A 2-layer BERT (hidden 64) with MiniLM's tokenizer, LoRA on ``--targets``, the generated task's
64 rows on one silo, b = 32 (q = 0.5), L = 5, T = 4 (20 DP-SGD steps), C = 1, delta = 1e-5.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--canaries", type=int, default=4000)
    ap.add_argument("--guess-fraction", type=float, default=0.1)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--targets", default="query,value")
    ap.add_argument("--epsilons", default="2,8")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)

    from fedpower_app import data as D
    from fedpower_app import model as M
    from fedpower_app.audit.white_box import CONTROLS, run_white_box_audit
    from fedpower_app.config import parse_config
    from tests.tiny_bert import save_tiny_bert

    model_dir = save_tiny_bert(tempfile.mkdtemp(prefix="tiny-bert-"), num_layers=2)
    cfg = parse_config({"model.name": model_dir, "lora.rank": a.rank, "model.target-modules": a.targets,
                        "lora.dropout": 0.0, "task.max-length": 16, "task.synthetic-train-size": 64,
                        "task.synthetic-eval-size": 16})
    tok = M.load_tokenizer(model_dir)
    for eps in (float(e) for e in a.epsilons.split(",")):
        for control in CONTROLS:
            model = M.build_model(cfg, 2)
            shard = D.client_shard(cfg, tok, 0, 1)
            t0 = time.perf_counter()
            report = run_white_box_audit(model, shard, epsilon=eps, delta=1e-5, clip=1.0, batch_size=32,
                                         local_steps=5, rounds=4, canaries=a.canaries, control=control,
                                         guess_fraction=a.guess_fraction)
            print(report.line(), f"[{time.perf_counter() - t0:.1f} s]", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
