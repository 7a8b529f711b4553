"""Classification metrics of an evaluation, and the majority-class baseline beside them (pure
python and torch: no Flower).

Real labels are often imbalanced, and there accuracy flatters a model that always answers the
majority class. So every evaluation reports, besides accuracy:

* ``macro-f1``: the mean of the per-class F1 scores, over the classes that occur in the labels or
  the predictions (scikit-learn's ``f1_score(average="macro")``);
* ``balanced-accuracy``: the mean of the per-class recalls over the classes that occur in the labels
  (scikit-learn's ``balanced_accuracy_score``);
* ``majority-accuracy`` and ``majority-macro-f1``: the same for a constant answer, the split's most
  frequent label (its balanced accuracy is 1/K for K classes present, so it is not repeated).
"""

from __future__ import annotations

import torch

def confusion(predictions: torch.Tensor, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """(K, K) counts: row = true label, column = prediction."""
    idx = labels.long().cpu() * num_classes + predictions.long().cpu()
    return torch.bincount(idx, minlength=num_classes * num_classes).reshape(num_classes, num_classes)


def scores(matrix: torch.Tensor) -> dict[str, float]:
    """Accuracy, macro-F1 and balanced accuracy of a confusion matrix, and the majority baseline."""
    m = matrix.double()
    n = float(m.sum())
    if n == 0:
        return {"accuracy": 0.0, "macro-f1": 0.0, "balanced-accuracy": 0.0, "majority-accuracy": 0.0,
                "majority-macro-f1": 0.0}
    true, pred, hit = m.sum(1), m.sum(0), m.diag()
    seen = (true > 0) | (pred > 0)
    f1 = torch.where(true + pred > 0, 2 * hit / (true + pred).clamp(min=1), torch.zeros_like(hit))
    present = true > 0
    recall = hit[present] / true[present]
    majority = float(true.max()) / n
    classes = int(present.sum())
    return {
        "accuracy": float(hit.sum()) / n,
        "macro-f1": float(f1[seen].mean()),
        "balanced-accuracy": float(recall.mean()),
        "majority-accuracy": majority,
        # a constant answer c: F1_c = 2p / (1 + p), every other present class 0
        "majority-macro-f1": (2 * majority / (1 + majority)) / classes,
    }


#: A final lead metric within this of the majority answer's is "at the majority baseline": it has
#: learned nothing a constant answer does not give (QQP's private adapters ended exactly there).
AT_MAJORITY_MARGIN = 0.005


def baseline_verdict(metrics: dict, lead: str = "accuracy") -> str:
    """The words a final line puts beside the lead metric: ``"; <lead> 0.652 = the majority
    baseline 0.652: the model learned nothing a constant answer does not give"`` when it ends at
    (or under) the majority answer's figure, else ``"; majority baseline 0.652"``; empty when the
    evaluation gave no baseline. ``lead``: accuracy, macro-f1 or balanced-accuracy (``task.metric``),
    each compared with a constant answer's figure of the same metric."""
    value = metrics.get(lead)
    if value is None:
        return ""
    if lead == "accuracy":
        base = metrics.get("majority-accuracy")
    elif lead == "macro-f1":
        base = metrics.get("majority-macro-f1")
    else:
        f1, acc = metrics.get("majority-macro-f1"), metrics.get("majority-accuracy")
        # a constant answer's balanced accuracy is 1/K, K the classes present (read off its macro-F1)
        base = None if not f1 or not acc else 1.0 / max(1, round((2 * acc / (1 + acc)) / f1))
    if base is None:
        return ""
    if value <= base + AT_MAJORITY_MARGIN:
        return (f"; {lead} {value:.4f} is AT THE MAJORITY BASELINE {base:.4f}: the model learned nothing a constant "
                "answer does not give")
    return f"; majority baseline {base:.4f}"


def final_baseline(results: dict) -> str:
    """The words for a run's final line: its last evaluated round beside the majority answer's figure
    (:func:`baseline_verdict`), led by the run's ``task.metric``; ``results`` is results.json's content."""
    evals = [r for r in results.get("rounds", []) if r.get("accuracy") is not None]
    if not evals:
        return ""
    lead = str(results.get("config", {}).get("task.metric", "accuracy"))
    return baseline_verdict(evals[-1], lead)
