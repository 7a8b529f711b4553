"""Checks of the product's code on a given device, shared by the CPU suite (``cpu`` against ``cpu``,
so that the checks themselves are exercised in CI) and the ``gpu`` suite (``cuda`` against ``cpu``)."""

from __future__ import annotations

import torch

from fedpower_app.config import parse_config


def random_updates(num_silos: int, *, modules=("m0", "m1"), m: int = 24, n: int = 20, r: int = 4, seed: int = 0):
    """An initial adapter state and ``num_silos`` silos' trained states (LoRA A and B of each module)."""
    g = torch.Generator().manual_seed(seed)
    initial = {}
    for name in modules:
        initial[f"{name}.lora_A.weight"] = torch.randn(r, n, generator=g) / n ** 0.5
        initial[f"{name}.lora_B.weight"] = torch.zeros(m, r)
    states = [{k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in initial.items()} for _ in range(num_silos)]
    return initial, states


def release_on(device: str, overrides: dict, initial: dict, states: list[dict], rounds: int = 2) -> dict:
    """The global adapters after ``rounds`` rounds of the product's round engine on ``device`` (the
    ServerApp's merge, clip, noise and refactorization), every silo replying ``states`` each round."""
    from server_app.app import engine_for
    from strategies.engine import RoundReport

    cfg = parse_config({"dp.noise": "seeded", "lora.rank": next(iter(initial.values())).shape[0],
                        **overrides, "device": device, "server-device": device})
    engine = engine_for(cfg, initial, client_sizes=[1000] * len(states))
    for rnd in range(1, rounds + 1):
        plan = engine.plan_for(rnd, list(range(len(states))))
        reply_a = engine.replies_a
        updates = [engine.update_from_state({k: v for k, v in s.items() if reply_a or not k.endswith("lora_A.weight")})
                   for i, s in enumerate(states) if i in plan.admitted]
        engine.release_updates(RoundReport(rnd, plan.round_type, sampled=len(plan.admitted)), updates)
    return {k: v.detach().cpu() for k, v in engine.global_state.items()}


def dp_sgd_step(device: str, *, precision: str = "fp32", sigma: float = 1.0, clip: float = 0.01, seed: int = 0):
    """One DP-SGD step of the product's optimizer on a tiny LoRA model on ``device``: returns the
    per-example float32 gradients, the clipped sum the optimizer formed, and the noise it added
    (``p.grad`` times b minus the clipped sum), each flattened over the trainable tensors."""
    from opacus import GradSampleModule

    from fedpower_app.training.dp_sgd import DPSGDParams, dp_optimizer
    from fedpower_app.training.loops import _autocast, local_optimizer

    torch.manual_seed(seed)
    dev = torch.device(device)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 2)).to(dev)
    x = torch.randn(48, 32, device=dev)
    y = torch.randint(0, 2, (48,), device=dev)
    gsm = GradSampleModule(model, batch_first=True, loss_reduction="mean", strict=True)
    named = [(f"p{i}", p) for i, p in enumerate(model.parameters())]
    params = DPSGDParams(sigma, clip, batch_size=len(x), local_steps=1)
    base = local_optimizer([p for _, p in named], lr=0.0, kind="sgd")
    opt = dp_optimizer(base, named, params, generator=torch.Generator(device=dev).manual_seed(seed + 1))
    with _autocast(dev, precision):
        out = gsm(x)
    torch.nn.functional.cross_entropy(out.float(), y).backward()
    per_example = torch.cat([p.grad_sample.float().reshape(len(x), -1) for p in model.parameters()], dim=1)
    opt.pre_step()  # clip, accumulate, add noise, scale by 1/b
    clipped_sum = torch.cat([p.summed_grad.reshape(-1) for p in model.parameters()])
    noisy = torch.cat([p.grad.reshape(-1) for p in model.parameters()]) * len(x)
    gsm._close()
    return per_example.cpu(), clipped_sum.cpu(), (noisy - clipped_sum).cpu()
