"""Any Hugging Face encoder (``model.name`` = a hub id or a local path): the LoRA targets of each
architecture, whole runs on tiny encoders made locally with random weights (RoBERTa, DistilBERT,
ELECTRA, DeBERTa-v2: the strategies, DP-SGD, the frozen-prefix cache and the released adapter),
and an unknown architecture refused at start, naming the modules it has."""

from __future__ import annotations

import pytest
import torch

from fedpower_app import model as M
from fedpower_app.config import parse_config

from .tiny_bert import TINY_ARCHITECTURES, save_tiny_encoder

EXPECTED_TARGETS = {"roberta": ["query", "value"], "distilbert": ["q_lin", "v_lin"], "electra": ["query", "value"],
                    "deberta-v2": ["query_proj", "value_proj"]}


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    root = tmp_path_factory.mktemp("encoders")
    return {kind: save_tiny_encoder(root / kind, kind) for kind in TINY_ARCHITECTURES}


@pytest.mark.parametrize("kind", TINY_ARCHITECTURES)
def test_each_architecture_gets_its_lora_targets_and_trains(encoders, kind):
    from fedpower_app.training.frozen_prefix import build_prefix_cache, forward_context

    cfg = parse_config({"model.name": encoders[kind], "lora.rank": 2, "lora.top-layers": 1, "seed": 3})
    model = M.build_model(cfg, 3)
    lora = sorted({n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in model.named_parameters() if "lora_A" in n})
    assert lora == sorted(EXPECTED_TARGETS[kind])
    tok = M.load_tokenizer(encoders[kind])
    from fedpower_app.data.pipeline import tokenize
    from fedpower_app.data.types import TextExamples

    split = tokenize(TextExamples(["a fine film", "dull", "so so"], [0, 1, 2], ["yes", "no", "maybe"]), tok, 16)
    batch = split.batch(torch.arange(3), "cpu")
    model.eval()
    with torch.no_grad():
        full = model(**batch).logits
    cache = build_prefix_cache(model, split, device=torch.device("cpu"))  # the frozen bottom layer, once
    assert cache.layer == 1
    with torch.no_grad(), forward_context(model, cache):
        cached = model(**cache.batch(torch.arange(3), "cpu")).logits
    assert torch.allclose(full, cached, atol=1e-5), kind


def test_an_unknown_architecture_fails_naming_its_modules():
    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn_in = torch.nn.Linear(4, 12)
            self.mix = torch.nn.Linear(4, 4)

    with pytest.raises(ValueError) as info:
        M.target_modules_for("oddformer", [], Odd())
    message = str(info.value)
    assert "'oddformer'" in message and "attn_in, mix" in message and "model.target-modules" in message
    assert M.target_modules_for("oddformer", ["attn_in"], Odd()) == ["attn_in"]

    class Known(torch.nn.Module):  # an unlisted architecture with common projection names
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(4, 4) for _ in range(3))

    assert M.target_modules_for("newformer", [], Known()) == ["q_proj", "v_proj"]


@pytest.mark.parametrize("kind,strategy,cache", [("roberta", "fedpower", True), ("distilbert", "fedlora", True),
                                                 ("deberta-v2", "ffa-lora", False), ("electra", "fedpower", False)])
def test_a_whole_private_run_on_another_architecture(tmp_path, encoders, kind, strategy, cache):
    """DP-SGD on the silos, the strategy's rounds, the frozen-prefix cache, and the released adapter
    that reloads to the logits the run evaluated."""
    from fedpower_app.released import load_released

    from .test_app_inprocess import run_inprocess

    res, run_dir = run_inprocess(tmp_path, **{"model.name": encoders[kind], "strategy.name": strategy,
                                              "num-server-rounds": 2, "lora.rank": 2, "dp.noise-at": "silo",
                                              "train.cache-frozen": cache, "lora.top-layers": 1 if cache else 0,
                                              "task.max-length": 16, "task.cache-dir": str(tmp_path / "c"),
                                              "dp.diagnostics": "released"})
    assert res["status"] == "completed" and all(r["aggregated"] == 2 for r in res["rounds"])
    assert 0 < res["totals"]["final_epsilon"] <= 8.0 * (1 + 1e-6)
    assert res["rounds"][-1]["update_norm_mean"] > 0
    loaded, tokenizer = load_released(run_dir / "adapter")
    from fedpower_app import data as D

    cfg = parse_config({**res["config"]})
    split = next(iter(D.eval_splits(cfg, tokenizer).values()))
    from fedpower_app.training import evaluate

    logits: list = []
    evaluate(loaded, split, batch_size=64, logits_out=logits)
    assert torch.allclose(torch.cat(logits), torch.load(run_dir / "final-eval-logits.pt"), atol=1e-4)
