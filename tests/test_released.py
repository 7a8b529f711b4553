"""What a user takes away is what was evaluated: the saved model, reloaded in a fresh process with
the README's snippet, gives bit-identical logits to the run's final evaluation."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.test_app_inprocess import run_inprocess

CASES = [(strategy, head) for strategy in ("fedpower", "fedlora", "ffa-lora") for head in (False, True)]

# Runs in a fresh interpreter: nothing cached from the run (model, head, tokenizer) can leak in.
RELOAD = textwrap.dedent("""
    import json, sys
    import torch
    torch.set_num_threads(1)
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification
    from fedpower_app.model import resolve_model_path
    from fedpower_app.released import load_released
    from fedpower_app.config import parse_config
    from fedpower_app import data as D
    from fedpower_app.training import evaluate

    out = {}
    for run_dir in sys.argv[1:]:
        cfg = parse_config(json.load(open(run_dir + "/results.json"))["config"])
        meta = json.load(open(run_dir + "/adapter/fedpower.json"))
        # 1. the plain-PEFT snippet of docs/using.md ("Loading the released model")
        base = AutoModelForSequenceClassification.from_pretrained(resolve_model_path(meta["base_model"]),
                                                                  num_labels=meta["num_labels"])
        plain = PeftModel.from_pretrained(base, run_dir + "/adapter").eval()
        # 2. the one-call loader
        model, tokenizer = load_released(run_dir + "/adapter")
        split = next(iter(D.eval_splits(cfg, tokenizer).values()))
        expected = torch.load(run_dir + "/final-eval-logits.pt")
        res = {}
        for name, m in (("plain", plain), ("loader", model)):
            logits = []
            evaluate(m, split, batch_size=cfg["eval.batch-size"], device=torch.device("cpu"), logits_out=logits)
            got = torch.cat(logits)
            res[name] = {"equal": bool(torch.equal(got, expected)),
                         "max_abs": float((got - expected).abs().max())}
        out[run_dir] = res
    print("RESULT" + json.dumps(out))
""")


def test_reload_in_fresh_process_gives_the_evaluated_logits(tmp_path):
    torch.set_num_threads(1)
    run_dirs = []
    for strategy, head in CASES:
        res, run_dir = run_inprocess(tmp_path / f"{strategy}-{head}", **{
            "num-server-rounds": 1, "strategy.name": strategy, "model.train-head": head,
            "dp.level": "none", "task.synthetic-eval-size": 64})
        assert res["status"] == "completed"
        config = json.loads((run_dir / "adapter" / "adapter_config.json").read_text())
        # portable: the configured name, not a path inside this machine's site-packages
        assert config["base_model_name_or_path"] == "minilm"
        assert "classifier" in config["modules_to_save"]
        run_dirs.append(str(run_dir))
    proc = subprocess.run([sys.executable, "-c", RELOAD, *run_dirs], capture_output=True, text=True, timeout=600,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT", 1)[1])
    for run_dir in run_dirs:
        for loader in ("plain", "loader"):
            assert result[run_dir][loader]["equal"], (run_dir, loader, result[run_dir][loader])


def test_trained_head_is_saved_as_trained_and_frozen_head_as_initialised(tmp_path):
    from safetensors.torch import load_file

    from fedpower_app import model as M
    from fedpower_app.config import parse_config
    from tests.test_app_inprocess import TINY

    torch.set_num_threads(1)
    key = "base_model.model.classifier.weight"
    initial = M.build_model(parse_config(TINY), 2).get_base_model().state_dict()["classifier.weight"]
    for head in (False, True):
        _, run_dir = run_inprocess(tmp_path / str(head), **{"num-server-rounds": 1, "strategy.name": "fedlora",
                                                              "model.train-head": head, "dp.level": "none"})
        saved = load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))[key]
        assert torch.equal(saved, initial) != head  # frozen: the seeded init; trained: it moved


def test_loader_refuses_a_directory_without_metadata(tmp_path):
    from fedpower_app.released import load_released

    with pytest.raises(FileNotFoundError, match="not a fedpower adapter directory"):
        load_released(tmp_path)
