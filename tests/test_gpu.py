"""The product on a CUDA GPU: the server's releases, DP-SGD, whole runs of every method and a
deployment whose SuperNodes share the GPU. Skipped without CUDA (CI has none);
``benchmarks/gpu/run.sh`` runs them on a GPU machine, the slow one last:
``python -m pytest -m "gpu and not slow" tests/test_gpu.py``, then ``-m "gpu and slow"``."""

import json

import pytest
import torch

from tests.device_checks import dp_sgd_step, random_updates, release_on
from tests.test_device_paths import METHOD_SETTINGS

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("overrides", METHOD_SETTINGS, ids=lambda o: "-".join(str(v) for v in o.values()))
def test_each_strategys_release_on_cuda_equals_the_cpus(overrides):
    """Same updates, same seed: the server's merge, clip, noise (drawn on a CPU generator) and
    refactorization give the same adapters on the GPU as on the CPU, within float tolerance."""
    initial, states = random_updates(4)
    cpu = release_on("cpu", overrides, initial, states)
    gpu = release_on("cuda", overrides, initial, states)
    for key in cpu:
        torch.testing.assert_close(gpu[key], cpu[key], rtol=1e-4, atol=1e-5, msg=key)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_one_dp_sgd_step_on_cuda_clips_and_adds_the_calibrated_noise(precision):
    sigma, clip = 1.0, 0.01
    per_example, clipped_sum, noise = dp_sgd_step("cuda", precision=precision, sigma=sigma, clip=clip)
    norms = per_example.norm(dim=1)
    factors = (clip / (norms + 1e-6)).clamp(max=1.0)
    torch.testing.assert_close(clipped_sum, (factors[:, None] * per_example).sum(0), rtol=1e-4, atol=1e-6)
    assert ((factors * norms) <= clip * (1 + 1e-5)).all()  # no example's share exceeds C, bf16 included
    assert noise.std().item() == pytest.approx(sigma * clip, rel=0.1)
    assert noise.dtype == torch.float32


def test_the_frozen_prefix_cache_lives_on_the_gpu_and_matches_the_cpus(tmp_path):
    from fedpower_app.training.frozen_prefix import build_prefix_cache
    from tests.test_frozen_prefix import setup
    from tests.tiny_bert import save_tiny_bert

    model_dir = save_tiny_bert(tmp_path / "tiny-bert-3", num_layers=3)
    for device in ("cpu", "cuda"):
        _cfg, model, data = setup(model_dir, device=device)
        cache = build_prefix_cache(model, data, device=torch.device(device))
        assert cache.hidden.device.type == device
        batch = cache.batch(torch.arange(min(8, len(data))), torch.device(device))
        assert batch["inputs_embeds"].device.type == device
        if device == "cpu":
            ref = cache.hidden.clone()
        else:
            torch.testing.assert_close(cache.hidden.cpu(), ref, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("method,level", [(m, "sample") for m in ("fedpower", "fedlora", "ffa-lora", "fedsvd")]
                         + [(m, "client") for m in ("fedpower", "fedlora", "ffa-lora")])  # FedSVD: sample level only
def test_a_whole_run_on_cuda(tmp_path, method, level):
    """The real ServerApp and ClientApp in one process on the GPU: silos, server and evaluation."""
    from tests.test_app_inprocess import run_inprocess

    overrides = {"strategy.name": method, "num-server-rounds": 2, "device": "cuda", "dp.level": level}
    if level == "client":
        overrides["strategy.client-rate"] = 1.0
    res, run_dir = run_inprocess(tmp_path, num_nodes=3, **overrides)
    assert res["status"] == "completed", res.get("error")
    assert len(res["rounds"]) == 2 and 0.0 <= res["rounds"][-1]["accuracy"] <= 1.0
    assert res["privacy_final"]["epsilon_spent"] <= 8.0 * (1 + 1e-6)
    # the released adapter loads on a CPU and gives the logits the run evaluated
    from fedpower_app.released import load_released

    model, _tok = load_released(run_dir / "adapter", device="cpu")
    assert next(model.parameters()).device.type == "cpu"


def test_a_run_saved_on_the_gpu_resumes_on_the_cpu(tmp_path):
    from fedpower_app.runs import checkpoint as CK
    from tests.test_app_inprocess import run_inprocess

    res, run_dir = run_inprocess(tmp_path, num_nodes=2, **{"num-server-rounds": 1, "device": "cuda"})
    assert res["status"] == "completed"
    cfg = json.loads((run_dir / "results.json").read_text())["config"]
    payload = CK.load_checkpoint(run_dir, config=cfg, strategy=cfg["strategy.name"])
    assert all(v.device.type == "cpu" for v in payload["global_state"].values())


@pytest.mark.slow
def test_a_superlink_and_two_supernodes_share_the_gpu(tmp_path):
    from tests.test_deployment import run_two_supernode_deployment

    results = run_two_supernode_deployment(tmp_path, node_config='device="cuda"',
                                           run_overrides={"device": "cuda"})
    assert results["status"] == "completed" and results["rounds"][0]["aggregated"] == 2
