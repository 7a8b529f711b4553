"""``fedpower-memory``: the memory one ClientApp needs for a run configuration, without training.

It reads the SAME configuration as ``fedpower-run`` (pyproject.toml defaults, ``--preset``,
``--set key=value``, the method's tuned settings) and prints, for one silo's training step:

* the weights (the whole model stays on the device, float32 as ``model.build_model`` loads it);
* the trainable state: LoRA A and B (only B for FFA-LoRA and FedSVD) and the head if it trains,
  their gradients, the clipped sum DP-SGD keeps across a batch's chunks, Adam's two moments;
* DP-SGD's per-example gradients: Opacus keeps a ``grad_sample`` of every trainable tensor for
  every example of a physical chunk, chunk x trainable parameters x 4 bytes;
* the activations a chunk's forward keeps for its backward, through the layers that need
  gradients (from the lowest adapted layer up: the frozen layers below keep none, and with
  ``train.cache-frozen`` they do not even run; their cached output lives in host RAM);
* the peak of one step, and the Ray ``num-gpus`` fraction that fits a GPU of ``--gpu-memory``.

How: the model is built from its config on PyTorch's ``meta`` device (shapes, no weights, nothing
downloaded: ``model.name`` must resolve to a local directory, the pip-installed MiniLM, or a hub
copy already in the local cache) with the LoRA setup of ``model.build_model``, and one training
step of the product's code path (Opacus ``GradSampleModule``, the DP optimizer, Adam; the
prefix-skipped forward with the cache) runs on meta tensors while every tensor allocation and free
is counted. The peak of that dry run is the step's memory as allocated, with every temporary of
autograd and Opacus, and no arithmetic. ``tests/test_memory_plan.py`` checks it against the peak
RSS of a real CPU step (``dp_sgd_train_local``) of the same configuration at a small size.

What it cannot see (stated in the output): on CUDA the run uses bf16 autocast, which keeps most
activations in 2 bytes instead of 4 (the float32 count is an upper bound) but keeps a bf16 copy of
each frozen weight that the backward needs (added, 2 bytes each); the CUDA context of each
process (``--cuda-context``); the caching allocator's slack (``--headroom``).

Exit codes: 0 fits (or no GPU asked), 1 does not fit at the run's chunk size (the largest chunk
that would is printed), 2 invalid input (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tomllib
from dataclasses import asdict
from typing import Any, Optional, Sequence

from ..config import ConfigError, RunConfig, load_preset, parse_config, with_method_preset
from .gpu import DEFAULT_CUDA_CONTEXT, DEFAULT_HEADROOM, fmt, gpu_fit, parse_size, server_need
from .plan import FLOAT32, MemoryPlan, plan_memory

# ------------------------------------------------------------------------------------------------
# the command line
# ------------------------------------------------------------------------------------------------
#: Shortcut flags (argparse dest) -> the run-config key they set.
FLAG_KEYS = {"model": "model.name", "rank": "lora.rank", "batch_size": "train.batch-size"}


class _ArgError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise _ArgError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="fedpower-memory",
                description="The memory one ClientApp needs for a run configuration (weights, LoRA state, "
                            "DP-SGD's per-example gradients, activations) and the Ray num-gpus fraction that "
                            "fits a GPU. Trains nothing. Same configuration as fedpower-run.")
    run = p.add_argument_group("run configuration (as fedpower-run)")
    run.add_argument("--preset", help="a conf/*.toml preset")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override a run-config key (TOML value), repeatable")
    run.add_argument("--model", default=None, help="model.name (a local directory, 'minilm', or a cached hub id)")
    run.add_argument("--rank", default=None, help="lora.rank")
    run.add_argument("--batch-size", dest="batch_size", default=None, help="train.batch-size")
    gpu = p.add_argument_group("GPU")
    gpu.add_argument("--gpu-memory", action="append", default=[], metavar="SIZE",
                     help="memory of one GPU, e.g. 24GiB or 16GB (a bare number is GiB); repeatable")
    gpu.add_argument("--headroom", type=float, default=DEFAULT_HEADROOM,
                     help=f"fraction added to the tensor memory for the caching allocator (default {DEFAULT_HEADROOM})")
    gpu.add_argument("--cuda-context", default="512MiB", metavar="SIZE",
                     help="per-process CUDA context and library handles (default 512MiB; 0 to leave out)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def load_config(args) -> RunConfig:
    """defaults < preset < the method's settings < --set < shortcut flags, as fedpower-run."""
    from ..launcher import parse_set

    overrides: dict[str, Any] = {}
    explicit: set = set()
    if args.preset:
        try:
            overrides.update(load_preset(args.preset))
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read preset {args.preset!r}: {exc}") from None
    sets = parse_set(args.set)
    overrides.update(sets)
    explicit |= set(sets)
    for dest, key in FLAG_KEYS.items():
        raw = getattr(args, dest)
        if raw is None:
            continue
        value = raw if dest == "model" else parse_set([f"{key}={raw}"])[key]
        if key in sets and sets[key] != value:
            raise ConfigError(f"config key {key!r} is set twice, by --set ({sets[key]!r}) and by "
                              f"--{dest.replace('_', '-')} ({value!r})")
        overrides[key] = value
        explicit.add(key)
    overrides, _applied, _source = with_method_preset(overrides, explicit=explicit)
    return parse_config(overrides)


def _layers(ix: list) -> str:
    if not ix:
        return "none"
    if ix == list(range(ix[0], ix[-1] + 1)) and len(ix) > 1:
        return f"{ix[0]}-{ix[-1]}"
    return ",".join(map(str, ix))


def render(plan: MemoryPlan, fits: list, *, source: str = "") -> str:
    P = plan.trainable_params
    what = {"AB": "LoRA A and B", "B": "LoRA B only (A frozen)"}[plan.trains]
    L = [f"fedpower-memory: one ClientApp{(' of ' + source) if source else ''} "
         f"({plan.method}, {'DP-SGD on the silo' if plan.dp_sgd else 'no per-example gradients (not DP-SGD)'})",
         f"model       {plan.model} ({plan.model_type}): {plan.layers} layers, hidden {plan.hidden}, "
         f"{plan.total_params / 1e6:.1f} M parameters",
         f"adapters    {what} on {','.join(plan.targets)} of layers {_layers(plan.adapted_layers)}; "
         f"{P:,} trainable parameters",
         f"chunk       {plan.chunk} examples x {plan.tokens} tokens per forward/backward ({plan.chunk_why}; "
         f"padded to the longest row, at most task.max-length)"]
    below = plan.lowest_adapted_layer
    if plan.cache_frozen:
        path = (f"layers {below}-{plan.layers - 1} backpropagated; layers 0-{below - 1} and the embeddings "
                f"cached once per silo (train.cache-frozen), host RAM <= {fmt(plan.cache_bytes_per_row)} per "
                f"training row")
    elif below > 0:
        path = (f"layers {below}-{plan.layers - 1} backpropagated; layers 0-{below - 1} run every step but keep "
                f"nothing for backward (train.cache-frozen would skip them)")
    else:
        path = "every layer backpropagated"
    L.append(f"backward    {path}")
    L.append("")
    rows = [("weights (float32, all of the model)", plan.weights, f"{plan.total_params:,} x 4 B"),
            ("trainable state", plan.trainable_state,
             f"grads{' + clipped sum' if plan.dp_sgd else ''}{' + Adam moments' if plan.optimizer == 'adam' else ''}: "
             f"{plan.trainable_state // (P * FLOAT32)} x {P:,} x 4 B")]
    if plan.dp_sgd:
        rows.append(("per-example gradients (Opacus)", plan.per_example_grads, f"{plan.chunk} x {P:,} x 4 B"))
    layer_bytes = [v for k, v in plan.activations_by_layer.items() if k >= 0]
    per_layer = f"{fmt(max(layer_bytes))} per adapted layer" if layer_bytes else ""
    rows.append(("activations kept for backward", plan.activations, per_layer))
    rows.append(("step peak above the weights", plan.step_peak,
                 "dry run: activations + per-example grads + temporaries, as allocated"))
    rows.append(("no-gradient passes peak", plan.no_grad_peak, plan.no_grad_why))
    w = max(len(r[0]) for r in rows)
    for label, n, how in rows:
        L.append(f"  {label:<{w}}  {fmt(n):>11}   {how}")
    L.append("")
    L.append(f"CPU ClientApp (float32): {fmt(plan.cpu_bytes())} of tensors")
    L.append(f"GPU ClientApp: {fmt(plan.gpu_tensor_bytes())} of tensors (with {fmt(plan.autocast_weight_copies)} of bf16 "
             f"copies of the frozen weights the backward reads under autocast; activations counted in float32: "
             f"an upper bound under bf16 autocast)")
    for fit in fits:
        G = fit["gpu_memory"]
        head = (f"GPU {fmt(G)}: each ClientApp needs {fmt(fit['need'])} "
                f"({fmt(plan.gpu_tensor_bytes())} x {1 + fit['headroom']:.2f} headroom + {fmt(fit['cuda_context'])} "
                f"CUDA context)")
        L.append(head)
        if fit.get("reserved"):
            L.append(f"  the ServerApp takes {fmt(fit['reserved'])} of the first GPU (its model and central evaluation, "
                     "outside Ray's num-gpus; server-device = \"cpu\" frees it)")
        if fit["fits"]:
            L.append(f"  -> num-gpus = {fit['num_gpus']:g}: {fit['per_gpu']} ClientApp(s) per GPU, "
                     f"{fmt(fit['used'])} of {fmt(G)} "
                     f"(fedpower-run --gpus-per-client {fit['num_gpus']:g}; Flower federation key "
                     f"client-resources-num-gpus)")
        else:
            L.append(f"  -> DOES NOT FIT at chunks of {plan.chunk}; chunks of at most {fit['largest_chunk']} examples "
                     f"would (train.physical-batch-size), or lower task.max-length")
    for note in plan.notes:
        L.append(f"note: {note}")
    return "\n".join(L)


def main(argv: Optional[Sequence[str]] = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never download: shapes come from a local config
    parser = build_parser()
    try:
        args = parser.parse_args(list(argv) if argv is not None else None)
    except _ArgError as e:
        print(f"fedpower-memory: error: {e} (see fedpower-memory --help)", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return int(e.code or 0)
    try:
        if not 0 <= args.headroom < 10:
            raise ValueError(f"--headroom must be in [0, 10), got {args.headroom}")
        gpus = [parse_size(g) for g in args.gpu_memory]
        context = parse_size(args.cuda_context, allow_zero=True)
        cfg = load_config(args)
        import torch

        torch.set_num_threads(1)
        plan = plan_memory(cfg)
        # The ServerApp sits on the first GPU unless server-device = "cpu": outside Ray's accounting,
        # so the fit leaves it room there (the fraction is per GPU: Ray places the same k on each).
        reserve = 0.0 if cfg["server-device"] == "cpu" else server_need(plan, args.headroom, context)
        fits = [gpu_fit(plan, g, headroom=args.headroom, cuda_context=context, reserve=reserve) for g in gpus]
    except ValueError as e:  # ConfigError is a ValueError
        print(f"fedpower-memory: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    if args.json:
        out = {k: v for k, v in asdict(plan).items() if not k.startswith("_")}
        out.update(cpu_bytes=plan.cpu_bytes(), gpu_tensor_bytes=plan.gpu_tensor_bytes(), gpus=fits)
        print(json.dumps(out))
    else:
        print(render(plan, fits, source=args.preset or ""))
    return 0 if all(f["fits"] for f in fits) else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
