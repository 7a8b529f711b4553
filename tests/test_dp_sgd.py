"""DP-SGD on the silos: Opacus per-example gradients through the production model factory, the
clipping and noise it applies, the per-silo accounting, and the silo's own refusals."""

import json
import math

import pytest
import torch

from fedpower_app import data as D
from fedpower_app import model as M
from fedpower_app.config import parse_config
from fedpower_app.training.dp_sgd import DPSGDParams, dp_sgd_train_local, grad_sample_module
from fedpower_app.privacy.accounting.silo import (
    SiloLedger,
    SiloRefusal,
    calibrate_noise_multiplier,
    dp_sgd_epsilon,
    silo_admits,
)

from .tiny_bert import save_tiny_bert

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A 2-layer BERT (hidden 64, no dropout) with MiniLM's tokenizer, saved as a local model."""
    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert"), num_layers=2)


def tiny_cfg(model_dir, **overrides):
    return parse_config({"model.name": model_dir, "lora.rank": 4, "lora.dropout": 0.0, "task.max-length": 16,
                         "task.synthetic-train-size": 64, "task.synthetic-eval-size": 16, **overrides})


def tiny(model_dir, *, double=False, **overrides):
    cfg = tiny_cfg(model_dir, **overrides)
    model = M.build_model(cfg, 2)
    if double:
        model = model.double()
    shard = D.client_shard(cfg, M.load_tokenizer(model_dir), 0, 1)
    return cfg, model, shard


def gens(seed=0):
    return torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1)


@pytest.mark.parametrize("train_head", [False, True])
def test_lora_weights_move_in_every_round_with_in_place_loads(tiny_model_dir, train_head):
    # opacus#820 / peft#3409: with the wrong order LoRA weights silently never move.
    cfg, model, shard = tiny(tiny_model_dir, **{"model.train-head": train_head})
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("lora_A" in n for n in trainable) and any("lora_B" in n for n in trainable)
    assert any("classifier" in n for n in trainable) == train_head
    params = DPSGDParams(noise_multiplier=1.0, clip=1.0, batch_size=16, local_steps=2)
    state = M.adapter_state(model)
    for round_index in range(2):
        M.load_adapter_state(model, state)  # in place, as the ClientApp does every round
        sampling, noise = gens(round_index)
        dp_sgd_train_local(model, shard, params=params, lr=1e-2, sampling_generator=sampling,
                           noise_generator=noise, device=CPU)
        new = M.adapter_state(model)
        assert new.keys() == state.keys()
        unchanged = [k for k in state if torch.equal(new[k], state[k])]
        assert not unchanged, f"round {round_index}: tensors did not move: {unchanged}"
        state = new


def test_every_trainable_parameter_gets_a_per_example_gradient(tiny_model_dir):
    cfg, model, shard = tiny(tiny_model_dir, **{"model.train-head": True})
    gsm = grad_sample_module(model)
    gsm.enable_hooks()
    gsm.train()  # Opacus samples gradients only in training mode
    try:
        batch = shard.batch(torch.arange(5), CPU)
        gsm(**batch).loss.backward()
        for name, p in model.named_parameters():
            if p.requires_grad:
                assert getattr(p, "grad_sample", None) is not None, name
                assert p.grad_sample.shape == (5, *p.shape), name
    finally:
        for p in model.parameters():
            p.grad, p.grad_sample = None, None
        gsm.disable_hooks()


def test_ffa_lora_trainable_set_gets_its_own_wrapper(tiny_model_dir):
    _, model, shard = tiny(tiny_model_dir)
    M.set_trainable(model, train_a=False, train_b=True)
    before = M.adapter_state(model)
    sampling, noise = gens()
    dp_sgd_train_local(model, shard, params=DPSGDParams(1.0, 1.0, 16, 2), lr=1e-2, sampling_generator=sampling,
                       noise_generator=noise, device=CPU)
    after = M.adapter_state(model)
    for k in before:
        assert torch.equal(before[k], after[k]) == k.endswith(M.LORA_A), k


def _exact_dp_and_plain_steps(model_dir, label_smoothing=0.0):
    """sigma = 0, huge C, q = 1 (b = n): one DP-SGD step and one plain SGD step on the batch's mean
    cross-entropy (smoothed by ``label_smoothing``) from the same adapters: (start, dp, plain)."""
    cfg, model, shard = tiny(model_dir, **{"model.train-head": True})
    n = len(shard)
    start = M.adapter_state(model)
    sampling, noise = gens()
    dp_sgd_train_local(model, shard, params=DPSGDParams(0.0, 1e9, n, 1), lr=0.1, sampling_generator=sampling,
                       noise_generator=noise, device=CPU, optimizer="sgd", label_smoothing=label_smoothing)
    dp = M.adapter_state(model)

    _, plain_model, _ = tiny(model_dir, **{"model.train-head": True})
    M.load_adapter_state(plain_model, start)
    plain_model.train()
    params = [p for p in plain_model.parameters() if p.requires_grad]
    batch = shard.batch(torch.arange(n), CPU)
    logits = plain_model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    torch.nn.functional.cross_entropy(logits, batch["labels"], label_smoothing=label_smoothing).backward()
    with torch.no_grad():
        for p in params:
            p -= 0.1 * p.grad
    return start, dp, M.adapter_state(plain_model)


def test_noise_free_unclipped_dp_step_equals_a_plain_mean_gradient_step(tiny_model_dir):
    # sigma = 0, huge C, q = 1 (b = n): the DP step is exactly SGD on the batch's mean gradient.
    start, dp, plain = _exact_dp_and_plain_steps(tiny_model_dir)
    moved = 0.0
    for k in start:
        torch.testing.assert_close(dp[k], plain[k], rtol=0, atol=1e-5)
        moved = max(moved, float((dp[k] - start[k]).abs().max()))
    assert moved > 1e-4  # the step did something


def test_label_smoothing_reaches_the_dp_step(tiny_model_dir):
    # The DP step with train.label-smoothing is SGD on the smoothed loss's mean gradient (Opacus'
    # per-example gradients of F.cross_entropy, not the model's own loss).
    start, dp, plain = _exact_dp_and_plain_steps(tiny_model_dir, label_smoothing=0.3)
    _, base, _ = _exact_dp_and_plain_steps(tiny_model_dir)
    differs = 0.0
    for k in start:
        torch.testing.assert_close(dp[k], plain[k], rtol=0, atol=1e-5)
        differs = max(differs, float((dp[k] - base[k]).abs().max()))
    assert differs > 1e-5  # the smoothing changed the step


def test_clipping_bounds_each_examples_contribution_float64(tiny_model_dir):
    # One example (b = n = 1), SGD lr 1, no noise: the update is -clip(g) / b, so ||update|| <= C,
    # and with a clip above ||g|| the update is the whole gradient.
    cfg, model, shard = tiny(tiny_model_dir, double=True, **{"model.train-head": True})
    one = D.TokenizedSplit(shard.input_ids[:1], shard.attention_mask[:1], shard.labels[:1],
                           None if shard.token_type_ids is None else shard.token_type_ids[:1])
    start = M.adapter_state(model)  # float32 copies of float64 weights: compare in float64 below

    def update_norm(clip):
        M.load_adapter_state(model, {k: v.double() for k, v in start.items()})
        before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        sampling, noise = gens()
        dp_sgd_train_local(model, one, params=DPSGDParams(0.0, clip, 1, 1), lr=1.0, sampling_generator=sampling,
                           noise_generator=noise, device=CPU, optimizer="sgd")
        sq = sum(float(((p.detach() - before[n]).double() ** 2).sum())
                 for n, p in model.named_parameters() if p.requires_grad)
        return math.sqrt(sq)

    full = update_norm(1e9)
    assert full > 1e-3
    for clip in (full / 10, full / 2):
        assert update_norm(clip) <= clip * (1 + 1e-9)
        assert update_norm(clip) == pytest.approx(clip, rel=1e-5)  # the bound is attained
    assert update_norm(full * 2) == pytest.approx(full, rel=1e-9)  # a loose clip changes nothing


def test_noise_std_matches_sigma_times_clip(tiny_model_dir):
    # SGD lr 1: update * b = -(sum of clipped grads + N(0, (sigma C)^2)). With C huge relative to the
    # gradients the update is essentially pure noise: its std over all entries must be sigma * C.
    cfg, model, shard = tiny(tiny_model_dir, **{"model.train-head": True, "lora.rank": 16})
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters() if p.requires_grad])
    sigma, clip, b = 0.7, 1000.0, 8
    sampling, noise = gens(3)
    dp_sgd_train_local(model, shard, params=DPSGDParams(sigma, clip, b, 1), lr=1.0, sampling_generator=sampling,
                       noise_generator=noise, device=CPU, optimizer="sgd")
    after = torch.cat([p.detach().flatten() for p in model.parameters() if p.requires_grad])
    scaled = ((after - before) * b).double()
    assert scaled.numel() > 4000
    assert float(scaled.std()) == pytest.approx(sigma * clip, rel=0.05)
    assert abs(float(scaled.mean())) < 4 * sigma * clip / math.sqrt(scaled.numel())


def test_group_clipping_bounds_the_head_and_the_adapters_apart_float64(tiny_model_dir):
    # dp.head-clip > 0: one example's head gradient is clipped to C_h and its adapters' gradient to
    # C, each attained when tight, so its whole contribution is at most sqrt(C^2 + C_h^2).
    from fedpower_app.model import is_head_parameter

    cfg, model, shard = tiny(tiny_model_dir, double=True, **{"model.train-head": True})
    one = D.TokenizedSplit(shard.input_ids[:1], shard.attention_mask[:1], shard.labels[:1],
                           None if shard.token_type_ids is None else shard.token_type_ids[:1])
    start = M.adapter_state(model)

    def update_norms(clip, head_clip):
        M.load_adapter_state(model, {k: v.double() for k, v in start.items()})
        before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        sampling, noise = gens()
        dp_sgd_train_local(model, one, params=DPSGDParams(0.0, clip, 1, 1, head_clip=head_clip), lr=1.0,
                           sampling_generator=sampling, noise_generator=noise, device=CPU, optimizer="sgd")
        sq = {True: 0.0, False: 0.0}
        for n, p in model.named_parameters():
            if p.requires_grad:
                sq[is_head_parameter(n)] += float(((p.detach() - before[n]).double() ** 2).sum())
        return math.sqrt(sq[False]), math.sqrt(sq[True])

    adapters, head = update_norms(1e9, 1e9)
    assert adapters > 1e-4 and head > 1e-4
    clipped_adapters, clipped_head = update_norms(adapters / 3, head / 5)
    assert clipped_adapters <= adapters / 3 and clipped_head <= head / 5
    # Attained up to Opacus' 1e-6 guard in C / (norm + 1e-6), relative to these small norms.
    assert clipped_adapters == pytest.approx(adapters / 3, rel=1e-3)
    assert clipped_head == pytest.approx(head / 5, rel=1e-3)
    # A tight head clip leaves the adapters' gradient whole (a joint clip would shrink both).
    assert update_norms(1e9, head / 5)[0] == pytest.approx(adapters, rel=1e-9)
    assert DPSGDParams(1.0, 3.0, 1, 1, head_clip=4.0).sensitivity == pytest.approx(5.0)


def test_group_clipped_noise_std_is_sigma_times_the_joint_sensitivity(tiny_model_dir):
    cfg, model, shard = tiny(tiny_model_dir, **{"model.train-head": True, "lora.rank": 16})
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters() if p.requires_grad])
    params = DPSGDParams(0.7, 600.0, 8, 1, head_clip=800.0)
    sampling, noise = gens(3)
    dp_sgd_train_local(model, shard, params=params, lr=1.0, sampling_generator=sampling,
                       noise_generator=noise, device=CPU, optimizer="sgd")
    after = torch.cat([p.detach().flatten() for p in model.parameters() if p.requires_grad])
    scaled = ((after - before) * params.batch_size).double()
    assert float(scaled.std()) == pytest.approx(0.7 * 1000.0, rel=0.05)


def test_split_noise_gives_each_group_its_own_std(tiny_model_dir):
    # dp.head-noise-ratio = 4: the adapters' noise std sigma/sqrt(1 - 1/16) * C, the head's 4 sigma * C_h
    # (strategies.mechanisms.dp_sgd_noise_stds). Clips far above the gradients: the update is the noise.
    from fedpower_app.model import is_head_parameter

    cfg, model, shard = tiny(tiny_model_dir, **{"model.train-head": True, "lora.rank": 16})
    start = M.adapter_state(model)
    params = DPSGDParams(0.7, 600.0, 8, 1, head_clip=800.0, head_noise_ratio=4.0)
    want = (0.7 / math.sqrt(1 - 1 / 16) * 600.0, 4 * 0.7 * 800.0)
    assert params.noise_stds == pytest.approx(want, rel=1e-12)
    moved = {False: [], True: []}
    for seed in range(4):
        M.load_adapter_state(model, start)
        before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        sampling, noise = gens(10 + 2 * seed)
        dp_sgd_train_local(model, shard, params=params, lr=1.0, sampling_generator=sampling,
                           noise_generator=noise, device=CPU, optimizer="sgd")
        for n, p in model.named_parameters():
            if p.requires_grad:
                moved[is_head_parameter(n)].append(((p.detach() - before[n]) * params.batch_size).double().flatten())
    adapters, head = torch.cat(moved[False]), torch.cat(moved[True])
    assert head.numel() >= 400 and adapters.numel() > 10 * head.numel()
    assert float(adapters.std()) == pytest.approx(want[0], rel=0.05)
    assert float(head.std()) == pytest.approx(want[1], rel=0.1)


def test_physical_chunks_give_the_same_step_as_one_pass(tiny_model_dir):
    # A logical Poisson batch processed in chunks of 3 (clip and accumulate, one noise draw at the
    # end) must equal one pass over the whole batch: same clipping, same noise, same update.
    cfg, model, shard = tiny(tiny_model_dir, double=True, **{"model.train-head": True})
    start = M.adapter_state(model)

    def after(physical, sigma):
        M.load_adapter_state(model, {k: v.double() for k, v in start.items()})
        sampling, noise = gens(5)
        stats = dp_sgd_train_local(model, shard, params=DPSGDParams(sigma, 0.01, 16, 3), lr=0.1,
                                   sampling_generator=sampling, noise_generator=noise, device=CPU,
                                   optimizer="sgd", physical_batch_size=physical)
        return torch.cat([p.detach().flatten().clone() for p in model.parameters() if p.requires_grad]), stats

    for sigma in (0.0, 0.5):
        whole, s_whole = after(1000, sigma)
        chunked, s_chunked = after(3, sigma)
        assert s_whole.examples_seen == s_chunked.examples_seen > 3 * 3  # several chunks per step
        assert torch.allclose(whole, chunked, rtol=0, atol=1e-9)
        assert s_chunked.loss == pytest.approx(s_whole.loss, rel=1e-6)  # the loss is summed in float32
    assert not torch.allclose(after(1000, 0.0)[0], after(1000, 0.5)[0])  # the noise is really there


def test_physical_chunks_cover_the_batch_once_shortest_rows_first(tiny_model_dir):
    # Padding is per chunk, so the chunks are length-sorted; they must still hold every sampled
    # example exactly once (duplicates or drops would change the DP-SGD sum and its sensitivity).
    from fedpower_app.training import physical_chunks

    _, _, shard = tiny(tiny_model_dir)
    lengths = shard.attention_mask.sum(dim=1)
    assert len(set(lengths.tolist())) > 1  # the test needs rows of different lengths
    idx = torch.randperm(len(shard), generator=torch.Generator().manual_seed(0))[:50]
    chunks = physical_chunks(shard, idx, 8)
    assert [len(c) for c in chunks] == [8] * 6 + [2]
    assert sorted(torch.cat(chunks).tolist()) == sorted(idx.tolist())
    flat = lengths[torch.cat(chunks)]
    assert torch.all(flat[1:] >= flat[:-1])
    padded = sum(int(lengths[c].max()) * len(c) for c in chunks)
    assert padded <= sum(int(lengths[c].max()) * len(c) for c in idx.split(8))
    assert [c.tolist() for c in physical_chunks(shard, idx[:8], 8)] == [idx[:8].tolist()]  # one chunk: as sampled


def test_a_cpu_round_trains_in_small_sorted_chunks_and_a_gpu_in_large_ones(tiny_model_dir, monkeypatch):
    # On a CPU a chunk of 32 sorted rows is padded far less than one chunk of a whole small Poisson
    # batch (1.37x faster at b = 125 on the generated task, BENCHMARKS.md); a GPU keeps 128.
    from fedpower_app.training import loops

    assert loops.physical_batch_size_for(torch.device("cuda")) == loops.PHYSICAL_BATCH_SIZE == 128
    assert loops.physical_batch_size_for(CPU) == loops.PHYSICAL_BATCH_SIZE_CPU == 32
    cfg, model, shard = tiny(tiny_model_dir, **{"task.synthetic-train-size": 400})
    seen = []
    real_batch = type(shard).batch
    monkeypatch.setattr(type(shard), "batch", lambda self, idx, device: seen.append(len(idx)) or real_batch(self, idx, device))
    sampling, noise = gens(2)
    stats = dp_sgd_train_local(model, shard, params=DPSGDParams(0.5, 0.01, 100, 1), lr=0.1,
                               sampling_generator=sampling, noise_generator=noise, device=CPU)
    assert sum(seen) == stats.examples_seen > 64 and max(seen) == 32 and len(seen) >= 3


def test_seeded_dp_sgd_repeats_and_hardened_differs(tiny_model_dir):
    cfg, model, shard = tiny(tiny_model_dir)
    start = M.adapter_state(model)

    def once(secure=False, noise_seed=1):
        M.load_adapter_state(model, start)
        dp_sgd_train_local(model, shard, params=DPSGDParams(1.0, 1.0, 16, 2), lr=1e-2,
                           sampling_generator=torch.Generator().manual_seed(0),
                           noise_generator=torch.Generator().manual_seed(noise_seed), device=CPU, secure_noise=secure)
        return M.adapter_state(model)

    a, b, c = once(), once(), once(noise_seed=2)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_invalid_parameters_are_rejected(tiny_model_dir):
    _, model, shard = tiny(tiny_model_dir)
    for bad in (DPSGDParams(-1.0, 1.0, 8, 1), DPSGDParams(1.0, 0.0, 8, 1), DPSGDParams(1.0, math.inf, 8, 1),
                DPSGDParams(1.0, 1.0, 0, 1), DPSGDParams(1.0, 1.0, 8, 0), DPSGDParams(math.nan, 1.0, 8, 1)):
        with pytest.raises(ValueError, match="invalid DP-SGD parameters"):
            dp_sgd_train_local(model, shard, params=bad, lr=1e-2, sampling_generator=torch.Generator(),
                               noise_generator=None, device=CPU)


# ------------------------------------------------------------------------------------------
# Accounting
# ------------------------------------------------------------------------------------------
def _dp_accounting_epsilon(q, sigma, steps, delta, kind):
    import dp_accounting

    if kind == "rdp":
        acc = dp_accounting.rdp.RdpAccountant()
    else:
        acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-3)
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    return acc.get_epsilon(delta)


@pytest.mark.parametrize("kind", ["rdp", "pld"])
def test_per_silo_epsilon_from_participation_matches_dp_accounting(kind):
    # Three silos of different sizes that trained 4, 7 and 0 of the rounds, L = 5 steps each.
    sigma, b, L, delta = 0.9, 64, 5, 1e-5
    for n, rounds in ((1000, 4), (1500, 7), (800, 0)):
        ledger = SiloLedger(delta, kind)
        for _ in range(rounds):
            ledger.record(b / n, sigma, L)
        assert ledger.rounds == rounds
        if rounds == 0:
            assert ledger.epsilon() == 0.0
            continue
        expected = _dp_accounting_epsilon(b / n, sigma, L * rounds, delta, kind)
        assert ledger.epsilon() == pytest.approx(expected, rel=1e-3 if kind == "rdp" else 1e-2)


def test_calibration_hits_the_target_from_below():
    sigma = calibrate_noise_multiplier(0.1, 50, 8.0, 1e-5)
    assert dp_sgd_epsilon([(0.1, sigma, 50)], 1e-5) <= 8.0
    assert dp_sgd_epsilon([(0.1, sigma * 0.999, 50)], 1e-5) > 8.0 * 0.999


def test_ledger_state_round_trips():
    ledger = SiloLedger(1e-5)
    ledger.record(0.1, 1.0, 5)
    ledger.record(0.1, 1.0, 5)
    ledger.record(0.1, 2.0, 5)
    again = SiloLedger.from_state_dict(json.loads(json.dumps(ledger.state_dict())))
    assert again.entries == ledger.entries == [[0.1, 1.0, 10, 2], [0.1, 2.0, 5, 1]]
    assert again.epsilon() == ledger.epsilon()


def test_server_never_sends_a_round_past_a_silos_budget():
    from fedpower_app.privacy import SiloDPSGD
    from strategies.privacy_contract import BudgetExhausted

    # sigma fixed so that the budget runs out after a few rounds; silo 1 is smaller (larger q).
    cfg = parse_config({"dp.noise-multiplier": 2.0, "dp.epsilon": 1.5, "train.batch-size": 50,
                        "train.local-steps": 5, "num-server-rounds": 300})
    hook = SiloDPSGD(cfg, {10: 1000, 11: 500})
    admitted_rounds = {10: 0, 11: 0}
    for server_round in range(1, 301):
        try:
            hook.check("fedlora", server_round)
        except BudgetExhausted:
            break
        nodes = hook.admit([10, 11], server_round)
        hook.record_sent(nodes, server_round)
        for node in nodes:
            admitted_rounds[node] += 1
        for ledger in hook.ledgers.values():
            assert ledger.epsilon() <= 1.5 * (1 + 1e-9)
    else:
        pytest.fail("the budget never stopped the run")
    assert 0 < admitted_rounds[11] < admitted_rounds[10]  # the smaller silo spends faster
    for node, ledger in hook.ledgers.items():  # one more round would cross
        assert ledger.epsilon_if(hook.rates[node], hook.sigma, 5) > 1.5
    assert hook.epsilon() == max(ledger.epsilon() for ledger in hook.ledgers.values())


def test_calibrated_hook_plans_every_silo_every_round():
    from fedpower_app.privacy import SiloDPSGD

    cfg = parse_config({"num-server-rounds": 10, "train.batch-size": 100, "train.local-steps": 4})
    hook = SiloDPSGD(cfg, {1: 2000, 2: 1000, 3: 1999})
    assert hook.planned_epsilon <= cfg["dp.epsilon"] * (1 + 1e-9)
    assert hook.planned_epsilon == pytest.approx(cfg["dp.epsilon"], rel=1e-3)
    for r in range(10):  # every silo in every round: never refused
        assert hook.admit([1, 2, 3], r + 1) == [1, 2, 3]
        hook.record_sent([1, 2, 3], r + 1)
    assert hook.epsilon() == pytest.approx(dp_sgd_epsilon([(0.1, hook.sigma, 40)], cfg["dp.delta"]))
    table = hook.silo_table()
    assert [row["rounds_trained"] for row in table] == [10, 10, 10]
    assert {"q", "sigma", "local_steps", "rounds_trained", "epsilon"} <= set(table[0])


# ------------------------------------------------------------------------------------------
# The silo's own checks
# ------------------------------------------------------------------------------------------
def test_silo_refuses_without_parameters_with_bad_ones_or_past_its_budget():
    ledger = SiloLedger(1e-5)
    with pytest.raises(SiloRefusal, match="no DP-SGD parameters"):
        silo_admits(ledger, None, 1000, max_epsilon=8.0)
    with pytest.raises(SiloRefusal, match="noise multiplier 0"):
        silo_admits(ledger, DPSGDParams(0.0, 1.0, 100, 5), 1000, max_epsilon=8.0)
    with pytest.raises(SiloRefusal, match="invalid"):
        silo_admits(ledger, DPSGDParams(1.0, -1.0, 100, 5), 1000, max_epsilon=8.0)
    params = DPSGDParams(3.0, 1.0, 100, 5)
    rounds = 0
    while True:
        try:
            q = silo_admits(ledger, params, 1000, max_epsilon=0.6)
        except SiloRefusal as exc:
            assert "budget" in str(exc)
            break
        assert q == 0.1
        ledger.record(q, params.noise_multiplier, params.local_steps)
        rounds += 1
    assert rounds >= 2 and ledger.epsilon() <= 0.6


def _run(tmp_path, node_config=None, **overrides):
    from client_app.app import app as client_app
    from fedpower_app.runs.inprocess_grid import InProcessGrid
    from fedpower_app.runs.results import ResultsWriter
    from server_app import app as server
    from tests.test_app_inprocess import TINY

    cfg = parse_config({**TINY, "output-dir": str(tmp_path), "run-name": "run", **overrides})
    grid = InProcessGrid(client_app, 2, cfg.to_dict(), node_config=node_config)
    run_dir = server.run_directory(cfg)
    server._run(grid, cfg, run_dir, ResultsWriter(run_dir, cfg.to_dict()))
    return json.loads((run_dir / "results.json").read_text()), grid


def test_silo_with_its_own_budget_refuses_a_non_private_run(tmp_path):
    # The server runs without DP; the silos demand DP-SGD (node config): every reply is a refusal.
    res, _ = _run(tmp_path, node_config={"dp-max-epsilon": 4.0, "ledger-file": "memory"}, **{"num-server-rounds": 1, "dp.level": "none"})  # non-private: all shown
    row = res["rounds"][0]
    assert row["sampled"] == 2 and row["aggregated"] == 0 and len(row["dropped"]) == 2
    assert all("no DP-SGD parameters" in d["reason"] for d in row["dropped"])


def test_silo_stops_at_its_own_budget_even_if_the_server_plans_more(tmp_path):
    # The server's budget is 8; each silo's own is smaller and it refuses once a round would cross.
    # n = 120, b = 16, L = 2, sigma = 2: eps 0.75 after one round, 1.03 after three.
    res, grid = _run(tmp_path, node_config={"dp-max-epsilon": 1.0, "dp-noise": "seeded", "ledger-file": "memory"},
                     **{"num-server-rounds": 3, "dp.noise-multiplier": 2.0, "dp.epsilon": 50.0,
                        "dp.diagnostics": "released"})
    aggregated = [r["aggregated"] for r in res["rounds"]]
    assert aggregated[0] == 2 and aggregated[-1] == 0
    reasons = [d["reason"] for r in res["rounds"] for d in r["dropped"]]
    assert reasons and all("budget" in reason for reason in reasons)
    for context in grid._contexts.values():  # the silo's own ledger, in Context.state
        state = json.loads(str(context.state.config_records["dp-sgd-ledger"]["state"]))
        assert SiloLedger.from_state_dict(state["ledger"]).epsilon() <= 1.0


def test_dp_sgd_run_reports_every_silo(tmp_path):
    res, _ = _run(tmp_path, **{"num-server-rounds": 2, "strategy.name": "fedpower", "dp.noise": "hardened"})
    final = res["privacy_final"]
    assert final["noise_at"] == "silo" and final["is_valid_guarantee"]
    assert [s["rounds_trained"] for s in final["silos"]] == [2, 2]
    assert final["epsilon_spent"] == pytest.approx(max(s["epsilon"] for s in final["silos"]))
    assert final["epsilon_spent"] <= 8.0 * (1 + 1e-9)
    assert res["rounds"][-1]["epsilon"] == pytest.approx(final["epsilon_spent"])
    assert all(r["noise_stds"] == [0.0, 0.0] for r in res["rounds"])  # no server noise


def test_plain_training_in_physical_chunks_equals_one_pass(tiny_model_dir):
    # The non-private path accumulates the batch's mean gradient over chunks: same Adam step.
    from fedpower_app.training import train_local

    cfg, model, shard = tiny(tiny_model_dir, double=True)
    start = M.adapter_state(model)

    def after(physical):
        M.load_adapter_state(model, {k: v.double() for k, v in start.items()})
        stats = train_local(model, shard, steps=3, batch_size=20, lr=0.01, generator=torch.Generator().manual_seed(2),
                            poisson=False, device=CPU, physical_batch_size=physical)
        return torch.cat([p.detach().flatten().clone() for p in model.parameters() if p.requires_grad]), stats

    whole, s_whole = after(1000)
    chunked, s_chunked = after(6)
    assert s_whole.examples_seen == s_chunked.examples_seen == 60
    # The loss is cast to float32 before backward, so gradients agree to ~1e-7 relative, and Adam's
    # per-coordinate normalisation turns that into at most ~1e-7 of parameter (3 steps of lr 0.01).
    assert torch.allclose(whole, chunked, rtol=0, atol=1e-6)
    assert not torch.allclose(whole, torch.cat([v.double().flatten() for v in start.values()])[: whole.numel()])
