"""FedSVD: silos train B with the global A frozen; the server averages B and
refactorizes B_avg A_g by SVD into a new orthonormal A, exactly and without forming B A."""

import pytest
import torch

from fedpower_app.config import ConfigError, parse_config
from strategies.fedsvd import svd_refactorize
from strategies.flower import FedSVDStrategy, build_strategy, trained_lora_factors
from strategies.noise import NoiseSource

from .test_strategies import M_NAMES, fake_client, initial_state, r, run


def test_svd_refactorize_is_the_exact_factored_svd():
    g = torch.Generator().manual_seed(0)
    B, A = torch.randn(3, 40, 4, generator=g), torch.randn(3, 4, 30, generator=g)
    B_new, A_new = svd_refactorize(B, A)
    assert torch.allclose(B_new @ A_new, B @ A, atol=1e-5)
    assert torch.allclose(A_new @ A_new.transpose(-1, -2), torch.eye(4).expand(3, 4, 4), atol=1e-6)
    # B_new's columns are U S: orthogonal, norms = the singular values of B A, in descending order
    dense_s = torch.linalg.svdvals((B @ A).double())
    gram = (B_new.transpose(-1, -2) @ B_new).double()
    assert torch.allclose(torch.diagonal(gram, dim1=-2, dim2=-1).sqrt(), dense_s[..., :4], rtol=1e-5)
    assert torch.allclose(gram - torch.diag_embed(torch.diagonal(gram, dim1=-2, dim2=-1)),
                          torch.zeros_like(gram), atol=1e-6 * float(gram.abs().max()))


def test_fedsvd_round_is_average_of_b_times_global_a_refactorized():
    s = build_strategy("fedsvd", initial_state=initial_state(), rank=r, client_rate=1.0, noise=NoiseSource(0))
    assert isinstance(s, FedSVDStrategy) and trained_lora_factors("fedsvd") == "B"
    A_g = {nm: s.global_state[nm + ".lora_A.weight"].clone() for nm in M_NAMES}
    grid, _ = run(s, fake_client(send_a=False), rounds=1)
    replies = [fake_client(send_a=False)(msg, grid._contexts[msg.metadata.dst_node_id]) for msg in grid.sent]
    states = [rep.content["arrays"].to_torch_state_dict() for rep in replies]
    for nm in M_NAMES:
        B_avg = torch.stack([st[nm + ".lora_B.weight"] for st in states]).double().mean(0)
        want = B_avg @ A_g[nm].double()
        A_new, B_new = s.global_state[nm + ".lora_A.weight"], s.global_state[nm + ".lora_B.weight"]
        assert torch.allclose((B_new @ A_new).double(), want, atol=1e-5)
        assert torch.allclose(A_new @ A_new.T, torch.eye(r), atol=1e-5)  # a new orthonormal A
        assert not torch.allclose(A_new, A_g[nm])
    assert s.reports[0].round_type == "fedsvd" and s.reports[0].aggregated == 4


def test_fedsvd_is_refused_with_server_side_noise():
    with pytest.raises(ConfigError, match="fedsvd"):
        parse_config({"strategy.name": "fedsvd", "dp.noise-at": "server"})
    with pytest.raises(ConfigError, match="fedsvd"):
        parse_config({"strategy.name": "fedsvd", "dp.level": "client"})
    assert parse_config({"strategy.name": "fedsvd"})["dp.noise-at"] == "silo"
    assert parse_config({"strategy.name": "fedsvd", "dp.level": "none"})["strategy.name"] == "fedsvd"


def test_fedsvd_trains_through_the_real_apps_with_dp_sgd(tmp_path):
    from .test_app_inprocess import run_inprocess

    res, run_dir = run_inprocess(tmp_path, **{"num-server-rounds": 2, "strategy.name": "fedsvd",
                                              "dp.noise-at": "silo", "dp.diagnostics": "released"})
    assert res["status"] == "completed" and [r_["round_type"] for r_ in res["rounds"]] == ["fedsvd", "fedsvd"]
    assert all(r_["aggregated"] == 2 for r_ in res["rounds"])
    from safetensors.torch import load_file

    saved = load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))
    a = [v for k, v in saved.items() if k.endswith("lora_A.weight")]
    assert a and all(torch.allclose(x @ x.T, torch.eye(x.shape[0]), atol=1e-4) for x in a)


def test_validation_rows_are_carved_from_train_and_evaluated_first(tmp_path):
    from fedpower_app import data as D

    base = {"task.synthetic-train-size": 300, "task.synthetic-eval-size": 50}
    whole = D.load_task(parse_config(base))
    cfg = parse_config({**base, "task.validation-rows": 40})
    task = D.load_task(cfg)
    assert list(task.eval_splits)[0] == D.VALIDATION_SPLIT and len(task.eval_splits[D.VALIDATION_SPLIT]) == 40
    assert len(task.train) == 260 and len(task.eval_splits["validation"]) == 50
    held = set(zip(task.eval_splits[D.VALIDATION_SPLIT].text_a, task.eval_splits[D.VALIDATION_SPLIT].labels))
    kept = set(zip(task.train.text_a, task.train.labels))
    assert not held & kept and held | kept <= set(zip(whole.train.text_a, whole.train.labels))
    # the same rows whatever the run seed (every tuning run is scored on the same rows)
    other = D.load_task(parse_config({**base, "task.validation-rows": 40, "seed": 5}))
    assert other.eval_splits[D.VALIDATION_SPLIT].text_a == task.eval_splits[D.VALIDATION_SPLIT].text_a or \
        whole.train.text_a != D.load_task(parse_config({**base, "seed": 5})).train.text_a
    with pytest.raises(ConfigError, match="exclusive"):
        parse_config({"task.validation-rows": 5, "task.train-rows": "x.json"})
