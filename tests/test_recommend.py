"""Private settings that transfer: the public rules' plan for given shard sizes, ε, δ and a compute
budget (``fedpower_app.privacy.recommend``), ``fedpower-privacy --recommend``, its refusal of an ε
too small for the budget (with what would fit), and ``train.auto`` in ``fedpower-run``."""

from __future__ import annotations

import json
import math

import pytest

from fedpower_app.config import parse_config
from fedpower_app.privacy.accounting.silo import dp_sgd_epsilon
from fedpower_app.privacy.recommend import (CLIP, MAX_NOISE_MULTIPLIER, RECIPE_NOISE_RATIO, PlanRefused,
                                            auto_settings, epochs_for_minutes, recommend)


def test_the_sst2_sizes_give_back_the_sst2_recipe():
    plan = recommend([11225] * 6, 8.0, 1e-5)
    assert (plan.batch_size, plan.local_steps, plan.rounds) == (1010, 4, 14)  # the recipe: b 1,000, L 4, T 14
    assert plan.noise_multiplier == pytest.approx(0.845, abs=0.02) and plan.lr == pytest.approx(0.0175, rel=0.01)
    assert plan.clip == CLIP
    ratio = plan.noise_multiplier / (plan.batch_size * math.sqrt(6))
    assert ratio == pytest.approx(RECIPE_NOISE_RATIO, rel=0.05)  # the noise rule's anchor is the recipe itself
    assert not any("raised" in r for r in plan.reasons)


def test_small_silos_raise_the_batch_to_bring_the_noise_per_step_towards_the_recipes():
    sizes = [1667, 1667, 1667, 1667, 1666, 1666]
    plan = recommend(sizes, 8.0, 1e-5, what="adapters")
    assert plan.batch_size == 833 and plan.sample_rate == pytest.approx(0.5)  # b0 = 167 had 6x the noise
    ratio = plan.noise_multiplier / (plan.batch_size * math.sqrt(6))
    assert 1.5 * RECIPE_NOISE_RATIO < ratio < 2.5 * RECIPE_NOISE_RATIO
    said = " ".join(plan.reasons)
    assert "b0 = 167" in said and "raised from b0" in said and "expect a gap" in said
    # more silos of the same size: less noise in their average, so a smaller raise that meets the recipe's
    many = recommend([1666] * 60, 8.0, 1e-5, what="adapters")
    assert 167 < many.batch_size < 833
    assert many.noise_multiplier / (many.batch_size * math.sqrt(60)) <= 1.1 * RECIPE_NOISE_RATIO
    assert "expect a gap" not in " ".join(many.reasons)
    # a raise is never taken where it would need more noise than the rules allow
    tight = recommend(sizes, 1.0, 1e-5, what="adapters")
    assert tight.noise_multiplier <= MAX_NOISE_MULTIPLIER


def test_small_silos_keep_the_epochs_and_a_summed_batch_in_the_thousands():
    sizes = [1667, 1667, 1667, 1667, 1666, 1666]  # the MNLI / QQP samples: 10,000 rows over 6 silos
    plan = recommend(sizes, 8.0, 1e-5, what="adapters")
    q = plan.batch_size / min(sizes)
    assert plan.summed_batch == 6 * plan.batch_size >= 1000 and q == pytest.approx(plan.sample_rate)
    epochs = plan.local_steps * plan.rounds * q
    assert 5.0 <= epochs < 5.0 + plan.local_steps * q  # E epochs, rounded up to whole rounds
    assert plan.lr == pytest.approx(0.0175 * math.sqrt(plan.summed_batch / 6000), rel=1e-4)
    # sigma is the accountant's: the plan spends exactly the target
    eps = dp_sgd_epsilon([(q, plan.noise_multiplier, plan.local_steps * plan.rounds)], 1e-5)
    assert eps == pytest.approx(8.0, rel=2e-3) and eps <= 8.0 * (1 + 1e-9)
    # more epochs: more steps at the same rate
    longer = recommend(sizes, 8.0, 1e-5, epochs=10, what="adapters")
    assert longer.batch_size == plan.batch_size and longer.rounds > plan.rounds
    assert longer.noise_multiplier > plan.noise_multiplier


def test_a_budget_in_minutes():
    assert epochs_for_minutes(10, 20, [2000, 4000]) == pytest.approx(10 * 60 * 20 / 2000)
    with pytest.raises(ValueError):
        epochs_for_minutes(0, 20, [100])


def test_an_epsilon_too_small_for_the_budget_is_refused_with_what_would_fit():
    with pytest.raises(PlanRefused) as info:
        recommend([1667] * 6, 0.2, 1e-5, what="adapters")
    message = str(info.value)
    assert "epsilon 0.2 is too small for 5 epochs" in message and f"> {MAX_NOISE_MULTIPLIER:g}" in message
    fit = float(message.split("epsilon >= ")[1].split(" ")[0])
    assert fit > 0.2
    assert recommend([1667] * 6, fit * 1.01, 1e-5, what="adapters").noise_multiplier <= MAX_NOISE_MULTIPLIER  # it does fit
    most = message.split(", or ")[1]
    assert most.startswith("at most") and "epochs at epsilon 0.2" in most
    epochs = float(most.split()[2])
    assert recommend([1667] * 6, 0.2, 1e-5, epochs=epochs * 0.95, what="adapters").noise_multiplier <= MAX_NOISE_MULTIPLIER
    for bad in ([], [1, 5]):
        with pytest.raises(ValueError):
            recommend(bad, 8.0, 1e-5)


def test_fedpower_privacy_recommend(capsys):
    from fedpower_app.privacy.cli import main

    assert main(["--recommend", "--client-sizes", "1667,1667,1667,1667,1666,1666", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # rows this few a silo: the head on frozen features (rule 0), q = 0.25
    assert out["what"] == "head" and out["batch_size"] == 417 and out["overrides"]["train.batch-size"] == 417
    assert out["overrides"]["train.what"] == "head" and out["sizes"][0] == 1667
    assert main(["--recommend", "--client-sizes", "900,1200", "--epsilon", "3", "--epochs", "2"]) == 0
    text = capsys.readouterr().out
    assert "recommended (epsilon 3, delta 1e-05" in text and "why:" in text and "train.auto=true" in text
    assert main(["--recommend", "--client-sizes", "1667,1667", "--epsilon", "0.05"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedpower-privacy: refused: epsilon 0.05 is too small") and "what would fit" in err
    assert main(["--recommend", "--client-sizes", "1667,1667", "--minutes", "5"]) == 2
    assert "--minutes needs --rows-per-second" in capsys.readouterr().err


def test_train_auto_fills_the_plan_and_keeps_what_was_set(tmp_path, capsys):
    from fedpower_app.launcher.cli import resolve_auto

    from .test_text_task import review_rows, write

    data = tmp_path / "data"
    write(data / "train.csv", review_rows(600))
    write(data / "validation.csv", review_rows(50, 2))
    base = {"task.name": "text", "task.data-dir": str(data), "task.text-column": "review",
            "task.label-column": "sentiment", "task.labels": "negative,positive", "train.auto": True,
            "dp.noise-at": "silo", "train.lr": 0.5}
    out = resolve_auto(dict(base), {"train.lr"}, app_dir=tmp_path, num_supernodes=3)
    plan = recommend([200, 200, 200], 8.0, 1e-5)
    assert out["train.batch-size"] == plan.batch_size and out["num-server-rounds"] == plan.rounds
    assert out["train.lr"] == 0.5  # set by hand: kept
    said = capsys.readouterr().out
    assert "fedpower-run: train.auto: train.what=head, train.batch-size=" in said and "kept as set: train.lr=0.5" in said
    parse_config(out)
    assert resolve_auto({"train.lr": 0.1}, set(), app_dir=tmp_path, num_supernodes=3) == {"train.lr": 0.1}
    cfg = parse_config({**base, "dp.level": "none"})  # non-private: the same compute as the private plan
    settings, lines = auto_settings(cfg, [200, 200, 200])
    assert settings["train.batch-size"] == plan.batch_size and "the epochs of the private plan" in lines[0]
    # silos small enough for the noise rule: the non-private run keeps b0, at the private plan's epochs
    small = [1666] * 6
    private = recommend(small, 8.0, 1e-5, what="adapters")
    non_private = recommend(small, 8.0, 1e-5, private=False, what="adapters")
    assert (private.batch_size, non_private.batch_size) == (833, 167)
    assert non_private.epochs == private.epochs and "b0 kept" in " ".join(non_private.reasons)
    settings, _ = auto_settings(cfg, small, explicit={"train.what"})  # adapters, set by hand
    assert settings["train.batch-size"] == 167 and settings["num-server-rounds"] == non_private.rounds
    # chosen by the rules: the head, at the private plan's schedule
    settings, _ = auto_settings(cfg, small)
    head = recommend(small, 8.0, 1e-5)
    assert settings["train.what"] == "head" and settings["train.batch-size"] == head.batch_size
    with pytest.raises(ValueError, match="DP-SGD on the silos"):
        auto_settings(parse_config({**base, "dp.noise-at": "server"}), [200, 200, 200])


def test_train_auto_is_resolved_by_every_launcher_and_refused_unresolved_by_the_server(tmp_path, capsys):
    """The in-process runner (benchmarks.inprocess_run, the grid's child) plans as fedpower-run does,
    and the run config it hands to the ServerApp holds the plan with train.auto = false; a ServerApp
    that still receives train.auto = true (a bare flwr run) refuses the run with one line."""
    from fedpower_app.config import ConfigError
    from fedpower_app.runs.auto import refuse_unresolved, resolve_train_auto

    from .test_text_task import review_rows, write

    data = tmp_path / "data"
    write(data / "train.csv", review_rows(600))
    write(data / "validation.csv", review_rows(50, 2))
    base = {"task.name": "text", "task.data-dir": str(data), "task.text-column": "review",
            "task.label-column": "sentiment", "task.labels": "negative,positive", "train.auto": True,
            "train.batch-size": 7}
    out, lines = resolve_train_auto(dict(base), set(), 3)
    plan = recommend([200, 200, 200], 8.0, 1e-5)
    assert out["train.auto"] is False and out["train.batch-size"] == plan.batch_size  # a preset's key gives way
    assert out["num-server-rounds"] == plan.rounds and lines[0].startswith("train.auto: train.what=head, train.batch-size=")
    again, more = resolve_train_auto(out, set(), 3)
    assert again == out and more == []  # resolved once: a resume never plans again
    kept, _ = resolve_train_auto(dict(base), {"train.batch-size"}, 3)
    assert kept["train.batch-size"] == 7
    refuse_unresolved(parse_config(out))
    with pytest.raises(ConfigError, match="train.auto is resolved when a run is launched"):
        refuse_unresolved(parse_config(base))


def test_a_lead_metric_other_than_accuracy_asks_for_the_declared_class_shares():
    base = {"dp.noise-at": "silo", "task.metric": "macro-f1"}
    _, lines = auto_settings(parse_config(base), [1000] * 6)
    assert any("no train.class-prior" in line for line in lines)
    _, lines = auto_settings(parse_config({**base, "train.class-prior": "0.85,0.15"}), [1000] * 6)
    assert any("each class weighs the same in the head's loss" in line for line in lines)
    _, lines = auto_settings(parse_config({"dp.noise-at": "silo"}), [1000] * 6)
    assert not any("class-prior" in line for line in lines)
