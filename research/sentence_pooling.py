"""Which sentence representation of the frozen MiniLM a linear head can use best.

For ``--train-rows`` random SST-2 train rows and the whole dev split, it computes three frozen
features of the pretrained model (no LoRA): BERT's pooler output (what the classifier of
``*ForSequenceClassification`` reads), the [CLS] hidden state, and the mean of the last layer over
the real tokens (the sentence embedding all-MiniLM-L6-v2 was trained for, ``model.pooling =
"mean"``), and fits a logistic regression (scikit-learn, C = 1) on each. Non-private; it only ranks
the representations.

    python -m research.sentence_pooling --data-dir /path/to/glue/SST-2 --train-rows 6000 --threads 1
"""

from __future__ import annotations

import argparse
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--train-rows", type=int, default=6000)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)

    import numpy as np
    import torch
    from sklearn.linear_model import LogisticRegression

    from fedpower_app import model as M
    from fedpower_app.config import parse_config
    from fedpower_app.data import load_task, tokenize

    torch.set_num_threads(a.threads)
    cfg = parse_config({"task.name": "sst2", "task.data-dir": a.data_dir})
    task, tok = load_task(cfg), M.load_tokenizer(cfg["model.name"])
    bert = M.build_model(cfg, 2).eval().base_model.model.bert

    def features(examples, rows: int):
        idx = torch.randperm(len(examples), generator=torch.Generator().manual_seed(0))[:rows].tolist() if rows \
            else list(range(len(examples)))
        sub = examples.select(idx)
        split = tokenize(sub, tok, cfg["task.max-length"])
        out = {"pooler": [], "cls": [], "mean": []}
        with torch.no_grad():
            for start in range(0, len(split), 256):
                b = split.batch(torch.arange(start, min(len(split), start + 256)), "cpu")
                o = bert(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                         token_type_ids=b.get("token_type_ids"))
                h, m = o.last_hidden_state, b["attention_mask"].unsqueeze(-1).float()
                out["pooler"].append(o.pooler_output)
                out["cls"].append(h[:, 0])
                out["mean"].append((h * m).sum(1) / m.sum(1))
        return {k: torch.cat(v).numpy() for k, v in out.items()}, np.array(sub.labels)

    t0 = time.perf_counter()
    train, y_train = features(task.train, a.train_rows)
    dev, y_dev = features(next(iter(task.eval_splits.values())), 0)
    for name in train:
        clf = LogisticRegression(max_iter=2000, C=1.0).fit(train[name], y_train)
        print(f"{name:>7}: dev accuracy {clf.score(dev[name], y_dev):.4f}")
    print(f"{time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
