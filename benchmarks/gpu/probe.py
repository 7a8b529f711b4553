"""Throughput probe for the GPU recipe: one silo's DP-SGD steps per second and examples per second,
where a step's time goes (torch.profiler), and the share of the device's bf16 peak.

It runs the product's own code on silo 0 of ``--silos`` IID shards of the preset's task: the model
of ``fedpower_app.model.build_model``, the frozen-prefix cache of
``fedpower_app.training.frozen_prefix.build_prefix_cache`` (when the preset sets
``train.cache-frozen``) and ``fedpower_app.training.dp_sgd.dp_sgd_train_local`` (Poisson batch,
physical chunks, per-example clip, noise, Adam), at the preset's precision. Each case is a logical
batch b and a physical chunk size ("auto" is the product's choice for the device). Steps are timed
with the device synchronized; the first call of a case is a warm-up and not counted.

    python -m benchmarks.gpu.probe --preset conf/sst2-dp-gpu.toml --set task.data-dir='"DIR"' \\
        --set model.name='"MODEL_DIR"' --device cuda --seconds 60 --json probe.json --profile profile.txt

FLOPs. A step runs the layers above the cache (the top ``lora.top-layers`` encoder layers with
their LoRA modules, and the head) on every token of its chunks, padding included. The count is
the usual dense estimate, 6 x P x tokens (forward 2 P, backward 4 P per token), P = the parameters
those layers hold. It over-counts the frozen weights (their weight gradients are never formed:
4 P would do for them), ignores attention's score products (about 4 x seq x hidden per token and
layer, under 3 % at SST-2's lengths) and the per-example gradient, clip and noise arithmetic. The
share of the peak is that count per second over ``--peak-tflops`` (790: an 8192^3 bf16 matrix
product measured on the H200 of this workplace).
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def params_touched(model, first_layer: int) -> int:
    """Parameters of the encoder layers a cached step runs (index >= first_layer) and of everything
    above the encoder (pooler, head); LoRA tensors included."""
    import re

    layer_re = re.compile(r"\.layer\.(\d+)\.")
    total = 0
    for name, p in model.named_parameters():
        if ".embeddings." in name:
            continue
        m = layer_re.search(name)
        if m is not None and int(m.group(1)) < first_layer:
            continue
        total += p.numel()
    return total


def padded_tokens_per_example(data, batch_size: int, chunk: int, generator: torch.Generator, draws: int = 5) -> tuple[float, float]:
    """(padded, real) tokens per example of a Poisson batch of expected size ``batch_size`` cut into
    the product's length-sorted chunks: what a step computes on, and what it needs."""
    from fedpower_app.training.loops import physical_chunks

    lengths = data.attention_mask.sum(dim=1)
    padded = real = rows = 0
    q = min(1.0, batch_size / len(data))
    for _ in range(draws):
        idx = torch.nonzero(torch.rand(len(data), generator=generator) < q).flatten()
        for c in physical_chunks(data, idx, chunk):
            lc = lengths[c]
            padded += len(c) * int(lc.max())
            real += int(lc.sum())
            rows += len(c)
    return (padded / rows, real / rows) if rows else (math.nan, math.nan)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", required=True)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--device", default="auto", help="cuda, cpu or auto")
    ap.add_argument("--silos", type=int, default=6, help="silo 0 of this many IID shards")
    ap.add_argument("--case", action="append", default=[], metavar="B[:CHUNK]",
                    help="logical batch B and physical chunk (default: the preset's b, b/4, and b at chunk 1024)")
    ap.add_argument("--seconds", type=float, default=60.0, help="time for the timed steps of all cases together")
    ap.add_argument("--peak-tflops", type=float, default=790.0, help="the device's measured bf16 matrix rate")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default="", help="write the numbers here")
    ap.add_argument("--profile", default="", help="write the profiler's tables here")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    t_start = time.perf_counter()

    from fedpower_app import data as D
    from fedpower_app import model as M
    from fedpower_app.config import load_preset, parse_config, with_method_preset
    from fedpower_app.launcher import parse_set
    from fedpower_app.training.dp_sgd import DPSGDParams, dp_sgd_train_local
    from fedpower_app.training.frozen_prefix import build_prefix_cache, lowest_adapted_layer
    from fedpower_app.training.loops import evaluate, physical_batch_size_for, uses_bf16

    sets = parse_set(a.set)
    overrides, _, _ = with_method_preset({**load_preset(a.preset), **sets}, explicit=set(sets))  # as the run
    overrides["device"] = a.device
    cfg = parse_config(overrides)
    device = M.resolve_device(cfg["device"])
    precision = cfg["train.precision"]
    forward = "bf16 autocast" if uses_bf16(device, precision) else "float32"
    B, L = cfg["train.batch-size"], cfg["train.local-steps"]
    cases = a.case or [f"{B}", f"{max(1, B // 4)}", f"{B}:1024"]
    parsed = []
    for c in cases:
        b, _, chunk = c.partition(":")
        parsed.append((int(b), None if chunk in ("", "auto") else int(chunk)))
    auto_chunk = physical_batch_size_for(device)

    t0 = time.perf_counter()
    task = D.load_task(cfg)
    tok = M.load_tokenizer(cfg["model.name"])
    model = M.build_model(cfg, task.num_labels, device=device)
    M.set_trainable(model, train_a=True, train_b=True)
    shard = D.client_shard(cfg, tok, 0, a.silos)
    _sync(device)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    data = build_prefix_cache(model, shard, device=device) if cfg["train.cache-frozen"] else shard
    _sync(device)
    cache_s = time.perf_counter() - t0
    first_layer = lowest_adapted_layer(model) if cfg["train.cache-frozen"] else 0
    touched = params_touched(model, first_layer)
    print(f"probe: {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
          f"train.precision {precision} ({forward}); silo 0 of {a.silos}: {len(shard)} rows; model and data {load_s:.1f} s; "
          f"frozen-prefix cache {cache_s:.1f} s; {touched:,} parameters touched per token "
          f"(layers >= {first_layer} and the head), {M.count_trainable(model):,} trainable", flush=True)

    # The server's evaluation of one round: every evaluation split, at the preset's batch size.
    t0 = time.perf_counter()
    eval_rows = 0
    for split in D.eval_splits(cfg, tok).values():
        evaluate(model, split, batch_size=cfg["eval.batch-size"], device=device, precision=precision)
        eval_rows += len(split)
    _sync(device)
    eval_s = time.perf_counter() - t0
    model.train()

    sampling = torch.Generator().manual_seed(0)

    def run_steps(b: int, chunk: int | None, steps: int):
        params = DPSGDParams(noise_multiplier=1.0, clip=cfg["dp.clip"], batch_size=b, local_steps=steps,
                             head_clip=cfg["dp.head-clip"], head_noise_ratio=cfg["dp.head-noise-ratio"])
        return dp_sgd_train_local(model, data, params=params, lr=cfg["train.lr"], sampling_generator=sampling,
                                  noise_generator=torch.Generator(device=device).manual_seed(1), device=device,
                                  physical_batch_size=chunk, optimizer=cfg["train.optimizer"],
                                  adam_eps=cfg["train.adam-eps"], head_lr_scale=cfg["train.head-lr-scale"],
                                  precision=precision)

    results = []
    budget = a.seconds / len(parsed)
    for b, chunk in parsed:
        t0 = time.perf_counter()
        run_steps(b, chunk, 1)  # warm-up: kernels, autotuning, allocator
        _sync(device)
        warm_s = time.perf_counter() - t0
        steps = seconds = examples = 0
        while seconds < budget and (steps == 0 or seconds + seconds / steps <= budget * 1.2):
            n = max(1, min(L, int((budget - seconds) / max(seconds / steps if steps else warm_s, 1e-3))))
            t0 = time.perf_counter()
            stats = run_steps(b, chunk, n)
            _sync(device)
            seconds += time.perf_counter() - t0
            steps += n
            examples += stats.examples_seen
        per_step = seconds / steps
        pad, real = padded_tokens_per_example(data, b, chunk or auto_chunk, torch.Generator().manual_seed(1))
        flop_per_step = 6 * touched * pad * b
        row = {"batch": b, "chunk": chunk or auto_chunk, "chunk_is_products": chunk is None, "steps": steps,
               "seconds": seconds, "seconds_per_step": per_step, "steps_per_s": 1 / per_step,
               "examples_per_s": examples / seconds, "warmup_s": warm_s,
               "padded_tokens_per_example": pad, "real_tokens_per_example": real,
               "model_tflop_per_step": flop_per_step / 1e12, "model_tflops": flop_per_step / per_step / 1e12,
               "peak_share": flop_per_step / per_step / 1e12 / a.peak_tflops}
        results.append(row)
        print(f"probe: b {b:>5} chunk {row['chunk']:>5}: {row['steps_per_s']:7.2f} steps/s, "
              f"{row['examples_per_s']:9.0f} examples/s, {row['model_tflops']:7.2f} TFLOP/s "
              f"({100 * row['peak_share']:.2f} % of {a.peak_tflops:.0f}); {steps} steps in {seconds:.1f} s", flush=True)

    # What a round of the run costs at the preset's b, on the product's chunk. Saved before the
    # profile, so a failure there keeps the numbers.
    main_case = next((r for r in results if r["batch"] == B and r["chunk_is_products"]), results[0])
    silo_rows = len(shard)
    out = {"benchmark": "gpu-probe", "device": str(device),
           "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "cuda": torch.version.cuda, "precision": precision, "forward": forward,
           "preset": a.preset, "set": a.set, "silos": a.silos, "silo_rows": silo_rows,
           "load_seconds": load_s, "cache_seconds": cache_s, "cache_seconds_per_1000_rows": 1000 * cache_s / max(1, silo_rows),
           "eval_seconds": eval_s, "eval_rows": eval_rows, "params_touched": touched, "first_layer": first_layer,
           "flop_formula": "6 x params_touched x padded tokens of the step's chunks",
           "peak_tflops": a.peak_tflops, "cases": results,
           "round_estimate": {"batch": B, "local_steps": L, "silos": a.silos,
                              "train_seconds": a.silos * L * main_case["seconds_per_step"],
                              "eval_seconds": eval_s,
                              "seconds": a.silos * L * main_case["seconds_per_step"] + eval_s,
                              "epochs_per_round": L * B / silo_rows,
                              "cache_seconds_all_silos": a.silos * cache_s}}

    def save() -> None:
        out["probe_seconds"] = time.perf_counter() - t_start
        if a.json:
            with open(a.json, "w") as fh:
                json.dump(out, fh, indent=1)

    save()
    r = out["round_estimate"]
    print(f"probe: a round at b {B}, L {L}, {a.silos} silos: about {r['seconds']:.2f} s "
          f"({r['train_seconds']:.2f} s training, {eval_s:.2f} s evaluating {eval_rows} rows), "
          f"{r['epochs_per_round']:.3f} epochs; caches for all silos about {r['cache_seconds_all_silos']:.1f} s", flush=True)

    # Where one step's time goes (the first case: the preset's b at the product's chunk).
    b0, c0 = parsed[0]
    try:
        out.update(profile_step(lambda: run_steps(b0, c0, 1), device, a.profile,
                                f"one DP-SGD step, b {b0}, chunk {c0 or auto_chunk}, {device}, forward in {forward}"))
    except Exception as exc:  # the numbers above stand without the profile
        out["profile_error"] = f"{type(exc).__name__}: {exc}"
        print(f"probe: the profiler failed: {out['profile_error']}")
    save()
    return 0


def profile_step(step, device: torch.device, path: str, title: str) -> dict:
    """Run ``step`` once under torch.profiler; write its tables to ``path``; return the summary."""
    from torch.profiler import ProfilerActivity, profile

    def self_device_us(evt) -> float:
        return float(getattr(evt, "self_device_time_total", 0.0) or 0.0)

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    _sync(device)
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        step()
        _sync(device)
    wall = time.perf_counter() - t0
    averages = prof.key_averages()
    sort_key = "self_device_time_total" if cuda else "self_cpu_time_total"
    busy = sum(self_device_us(e) for e in averages) / 1e6 if cuda else None
    top = sorted(averages, key=(self_device_us if cuda else (lambda e: e.self_cpu_time_total)), reverse=True)[:10]
    top_rows = [{"op": e.key, "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,
                 "self_device_ms": self_device_us(e) / 1e3} for e in top]
    if path:
        with open(path, "w") as fh:
            fh.write(f"{title}; wall {wall * 1e3:.1f} ms under the profiler"
                     + (f"; device busy {busy * 1e3:.1f} ms" if busy is not None else "") + "\n\n")
            fh.write(f"sorted by {sort_key}\n{averages.table(sort_by=sort_key, row_limit=25)}\n\n")
            if cuda:
                fh.write(f"sorted by self_cpu_time_total\n{averages.table(sort_by='self_cpu_time_total', row_limit=25)}\n")
    print(f"probe: {title}, under the profiler: {wall * 1e3:.0f} ms wall"
          + (f", device busy {busy * 1e3:.0f} ms ({100 * busy / wall:.0f} %)" if busy is not None else ""))
    for r in top_rows[:8]:
        print(f"probe:   {r['op'][:48]:<48} x{r['calls']:<5} self cpu {r['self_cpu_ms']:8.2f} ms"
              f"  self device {r['self_device_ms']:8.2f} ms")
    return {"profile_step_wall_s": wall, "profile_device_busy_s": busy, "profile_top": top_rows}


if __name__ == "__main__":
    raise SystemExit(main())
