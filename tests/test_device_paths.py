"""The device-dependent code paths, checked on the CPU (CI has no GPU): where each random draw is
made, which precision evaluation takes, and that the checks the ``gpu`` suite runs on CUDA work."""

import pytest
import torch

from fedpower_app import model as M
from fedpower_app.config import ConfigError, parse_config
from fedpower_app.training import loops
from strategies.noise import NoiseSource
from tests.device_checks import dp_sgd_step, random_updates, release_on

METHOD_SETTINGS = [
    {"strategy.name": "fedpower", "dp.noise-at": "server"},
    {"strategy.name": "fedlora", "dp.noise-at": "server"},
    {"strategy.name": "ffa-lora", "dp.noise-at": "server"},
    {"strategy.name": "fedsvd"},
    {"strategy.name": "fedpower", "dp.level": "client", "strategy.client-rate": 0.5},
    {"strategy.name": "fedlora", "dp.level": "client", "strategy.client-rate": 0.5},
]


@pytest.mark.parametrize("overrides", METHOD_SETTINGS, ids=lambda o: "-".join(str(v) for v in o.values()))
def test_a_release_is_a_function_of_the_inputs_and_the_seed(overrides):
    """The check the gpu suite runs against CUDA, here CPU against CPU: two engines on the same
    updates and seed release the same adapters, and the release moved them."""
    initial, states = random_updates(4)
    a = release_on("cpu", overrides, initial, states)
    b = release_on("cpu", overrides, initial, states)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.allclose(a[k], initial[k]) for k in a)


def test_the_server_draws_its_noise_on_a_cpu_generator_whatever_its_device():
    """The same seed gives the same noise wherever the release is computed: the draw is made on
    the generator's device and moved."""
    noise = NoiseSource(3, "seeded")
    gen = noise.generator("release", 1)
    assert gen.device.type == "cpu"
    x = noise.gaussian((5, 4), 2.0, gen, device="cpu")
    y = noise.gaussian((5, 4), 2.0, noise.generator("release", 1), device=torch.device("cpu"))
    assert torch.equal(x, y) and x.dtype == torch.float32


def test_a_silos_dp_noise_generator_is_made_on_its_gradients_device():
    streams = loops.silo_randomness(NoiseSource(0, "seeded"), 2, 5, torch.device("cpu"))
    assert streams.dp_noise.device.type == "cpu" and streams.sampling.device.type == "cpu"
    again = loops.silo_randomness(NoiseSource(0, "seeded"), 2, 5)
    assert torch.equal(torch.randn(8, generator=streams.dp_noise), torch.randn(8, generator=again.dp_noise))


def test_one_dp_sgd_step_clips_every_example_and_adds_the_calibrated_noise():
    sigma, clip = 1.0, 0.01
    per_example, clipped_sum, noise = dp_sgd_step("cpu", sigma=sigma, clip=clip)
    factors = (clip / (per_example.norm(dim=1) + 1e-6)).clamp(max=1.0)
    assert (per_example.norm(dim=1) > clip).all()  # every example is clipped at this C
    torch.testing.assert_close(clipped_sum, (factors[:, None] * per_example).sum(0), rtol=1e-5, atol=1e-7)
    assert noise.std().item() == pytest.approx(sigma * clip, rel=0.1)  # 2,306 coordinates
    assert abs(noise.mean().item()) < 0.1 * sigma * clip


def test_the_float32_norm_optimizer_is_opacus_own_step_on_float32_gradients():
    """The product's DPOptimizer (its per-example gradients upcast once) takes Opacus' step bit for
    bit when the gradients are float32."""
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    from fedpower_app.training.dp_sgd import DPSGDParams, dp_optimizer

    grads = []
    for product in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        gsm = GradSampleModule(model, batch_first=True, loss_reduction="mean", strict=True)
        base = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(7)
        if product:
            opt = dp_optimizer(base, list(model.named_parameters()), DPSGDParams(0.8, 0.05, 32, 1), generator=gen)
        else:
            opt = DPOptimizer(base, noise_multiplier=0.8, max_grad_norm=0.05, expected_batch_size=32,
                              loss_reduction="mean", generator=gen)
        x, y = torch.randn(32, 16, generator=torch.Generator().manual_seed(1)), torch.arange(32) % 2
        torch.nn.functional.cross_entropy(gsm(x), y).backward()
        opt.step()
        grads.append([p.detach().clone() for p in model.parameters()])
        gsm._close()
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_bf16_autocast_only_where_it_is_asked_for_or_native(monkeypatch):
    """The "auto" precision follows the CUDA device's compute capability, mocked here: the real one
    is read even where the conftest hides CUDA, so the test holds on a host with or without a GPU."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not loops.uses_bf16(cpu, "auto") and loops.uses_bf16(cpu, "bf16") and not loops.uses_bf16(cpu, "fp32")
    assert not loops.uses_bf16(cuda, "fp32") and loops.uses_bf16(cuda, "bf16")
    with pytest.raises(ValueError, match="precision"):
        loops.uses_bf16(cpu, "fp16")

    def no_device(device=None):
        raise RuntimeError("no CUDA device")

    try:
        for capability, native in ((no_device, False), ((7, 5), False), ((8, 0), True), ((9, 0), True)):
            read = capability if callable(capability) else (lambda device=None, c=capability: c)
            monkeypatch.setattr(torch.cuda, "get_device_capability", read)
            loops.cuda_has_native_bf16.cache_clear()
            assert loops.uses_bf16(cuda, "auto") is native, capability  # never emulated below 8.0
    finally:
        loops.cuda_has_native_bf16.cache_clear()  # no mocked answer stays cached for later tests


def test_evaluation_takes_the_runs_precision(monkeypatch):
    """Central and silo evaluation run at train.precision, not bf16 whatever it says."""
    import contextlib

    from fedpower_app.data import TokenizedSplit

    seen = []

    @contextlib.contextmanager
    def recorder(device, precision="auto"):
        seen.append(precision)
        yield

    monkeypatch.setattr(loops, "_autocast", recorder)

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Linear(4, 2)

        def forward(self, input_ids, attention_mask, labels, **_):
            logits = self.w(torch.nn.functional.one_hot(input_ids[:, 0] % 4, 4).float())
            return type("Out", (), {"logits": logits})()

    data = TokenizedSplit(torch.arange(12).view(6, 2), torch.ones(6, 2, dtype=torch.long), torch.arange(6) % 2)
    res = loops.evaluate(Tiny(), data, batch_size=4, precision="fp32")
    assert seen == ["fp32", "fp32"] and res["num-examples"] == 6 and 0 <= res["accuracy"] <= 1


def test_devices_in_the_configuration():
    assert parse_config({"device": "cuda:1", "server-device": "cpu"})["device"] == "cuda:1"
    for bad in ({"device": "gpu"}, {"server-device": "cuda:x"}):
        with pytest.raises(ConfigError, match="device"):
            parse_config(bad)
    cfg = parse_config({})
    assert M.server_config(cfg) is cfg  # auto: the server shares the silos' model in one process
    assert M.server_config(parse_config({"server-device": "cpu"}))["device"] == "cpu"
    with pytest.raises(RuntimeError, match="no CUDA device is visible"):
        M.resolve_device("cuda:0")
    assert M.resolve_device("auto").type == "cpu"  # tests/conftest.py hides any GPU


def test_a_supernode_chooses_its_own_device():
    from types import SimpleNamespace

    from client_app.app import silo_run_config

    run_config = {"device": "auto", "seed": 0}
    ctx = SimpleNamespace(run_config=run_config, node_config={"device": "cuda:1", "partition-id": 0})
    assert silo_run_config(ctx)["device"] == "cuda:1"
    assert silo_run_config(SimpleNamespace(run_config=run_config, node_config={}))["device"] == "auto"


def test_the_frozen_prefix_batch_is_one_gather_that_matches_the_rows(tmp_path):
    from fedpower_app.training.frozen_prefix import CachedPrefixSplit

    lengths = torch.tensor([3, 1, 4, 2])
    offsets = torch.zeros(5, dtype=torch.long)
    offsets[1:] = torch.cumsum(lengths, 0)
    hidden = torch.randn(int(offsets[-1]), 5)
    mask = (torch.arange(6) < lengths[:, None]).long()
    split = CachedPrefixSplit(hidden, offsets, mask, torch.tensor([0, 1, 0, 1]), layer=1)
    idx = torch.tensor([2, 1, 3])
    batch = split.batch(idx, torch.device("cpu"))
    assert batch["inputs_embeds"].shape == (3, 4, 5)
    for row, i in enumerate(idx.tolist()):
        n = int(lengths[i])
        assert torch.equal(batch["inputs_embeds"][row, :n], hidden[offsets[i]:offsets[i] + n])
        assert (batch["inputs_embeds"][row, n:] == 0).all()
    assert torch.equal(batch["attention_mask"], mask[idx, :4]) and batch["labels"].tolist() == [0, 1, 1]


def test_a_checkpoint_loads_onto_the_cpu(tmp_path):
    from fedpower_app.runs import checkpoint as CK

    cfg = {"seed": 0}
    CK.save_checkpoint(tmp_path, {"round": 1, "strategy": "fedlora", "fingerprint": CK.config_fingerprint(cfg),
                                  "global_state": {"a": torch.ones(2)}})
    payload = CK.load_checkpoint(tmp_path, config=cfg, strategy="fedlora")
    assert payload["global_state"]["a"].device.type == "cpu"


def test_a_simulation_says_where_its_silos_will_train():
    from fedpower_app.runs.spec import gpu_placement

    refusal, _ = gpu_placement("cuda", 0.0)
    assert refusal and "--gpus-per-client > 0" in refusal
    refusal, _ = gpu_placement("auto", 0.25, cuda_visible=False)
    assert refusal and "never schedule" in refusal
    _, warning = gpu_placement("auto", 0.0, cuda_visible=True)
    assert warning and "every silo trains on the CPU" in warning and "server runs on the GPU" in warning
    assert gpu_placement("auto", 0.25, cuda_visible=True) == (None, None)
    assert gpu_placement("cpu", 0.0) == (None, None)


def test_a_gpu_grid_asks_ray_for_gpus_and_is_refused_where_there_are_none(tmp_path):
    from fedpower_app.config import PROJECT_ROOT
    from fedpower_app.experiment.cli import build_spec, make_parser
    from fedpower_app.experiment.spec import GridError, check_gpu_placement

    args = make_parser().parse_args(["--grid", str(PROJECT_ROOT / "conf/grids/paper.toml"), "--table", "1",
                                     "--out", str(tmp_path)])
    spec, _out = build_spec(args)
    assert spec.gpus_per_client == 0.25 and spec.to_dict()["gpus_per_client"] == 0.25
    with pytest.raises(GridError, match="no CUDA GPU"):
        check_gpu_placement(spec)  # this machine has none (tests/conftest.py hides any)
    args = make_parser().parse_args(["--grid", str(PROJECT_ROOT / "conf/grids/paper.toml"), "--table", "1",
                                     "--out", str(tmp_path), "--gpus-per-client", "0"])
    assert build_spec(args)[0].gpus_per_client == 0.0
