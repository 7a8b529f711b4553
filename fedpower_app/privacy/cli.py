"""``fedpower-privacy``: the privacy plan of a run, without training.

It reads the SAME configuration as ``fedpower-run`` (pyproject.toml defaults, a ``--preset``,
``--set key=value`` overrides) and builds the noise calibration with the server's own function
(``fedpower_app.privacy.build_privacy``), so what it prints is what the server will use::

    fedpower-privacy                                   # the default run (`fedpower-run`), 6 silos
    fedpower-privacy --preset conf/tiny.toml --supernodes 3
    fedpower-privacy --set strategy.name='"fedlora"' --set dp.level='"client"' --json
    fedpower-privacy --preset conf/paper-sst2.toml --dataset-size 67349 --num-modules 48

The older explicit flags still work and override the matching config key, e.g.
``--epsilon`` (dp.epsilon), ``--rounds`` (num-server-rounds), ``--method`` (strategy.name)::

    fedpower-privacy --method fedpower --level sample --epsilon 3 --rounds 200 \\
        --client-rate 0.5 --num-clients 6 --dataset-size 67349 --batch-size 128 --local-steps 1

Data: the number of silos is ``--supernodes`` (default: the launcher's default, 6). The training
set is the generated one (task.synthetic-train-size) or the local GLUE copy (task.data-dir), split
exactly as the clients split it; a GLUE task from the hub is not downloaded, pass
``--dataset-size`` (rows of the train split; task.max-train caps it as in a run) or
``--client-sizes``. The number of LoRA modules is counted on the model's architecture (its
config, no weights), as the server counts them; ``--num-modules`` overrides.

Exit codes: 0 success, 2 invalid input (one line on stderr naming the config key or flag).
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import math
import sys
import tomllib
from typing import Any, Optional, Sequence

from fedpower_app.privacy import accounting as acc  # before anything imports torch: fast opacus path
from fedpower_app import launcher
from fedpower_app.config import ConfigError, RunConfig, load_preset, parse_config, with_method_preset

#: Silos of the default run: ``fedpower-run``'s default ``--supernodes``.
DEFAULT_SUPERNODES: int = inspect.signature(launcher.run_flwr).parameters["num_supernodes"].default

#: Older explicit flags (argparse dest) -> the run-config key they override.
FLAG_KEYS: dict[str, str] = {
    "method": "strategy.name",
    "level": "dp.level",
    "epsilon": "dp.epsilon",
    "delta": "dp.delta",
    "rounds": "num-server-rounds",
    "client_rate": "strategy.client-rate",
    "batch_size": "train.batch-size",
    "local_steps": "train.local-steps",
    "clip": "dp.clip",
    "rank": "lora.rank",
    "refactor_every": "strategy.refactor-every",
    "sample_mode": "dp.sample-mode",
    "accountant": "dp.accountant",
    "calibration": "dp.calibration",
    "noise_multiplier": "dp.noise-multiplier",
}
#: Flags taking a name: case and '_' are normalised (``--sample-mode two_stage`` works).
_NAME_FLAGS = ("method", "level", "sample_mode", "accountant", "calibration")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


class _ArgError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # raise instead of sys.exit so main() can return 2
        raise _ArgError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="fedpower-privacy",
        description="The privacy plan of a fedpower run: calibrated noise (the server's own calibration), "
                    "sensitivities and the epsilon trajectory. Same configuration as fedpower-run.",
        epilog="Older flags override their config key: "
               + ", ".join(f"{_flag(d)} ({k})" for d, k in FLAG_KEYS.items()) + ".",
    )
    run = p.add_argument_group("run configuration (as fedpower-run)")
    run.add_argument("--preset", help="a conf/*.toml preset")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override a run-config key (TOML value), repeatable")
    run.add_argument("--supernodes", "--num-clients", dest="num_clients", type=int, default=None,
                     help=f"number of silos N (default {DEFAULT_SUPERNODES}, as fedpower-run)")
    data = run.add_mutually_exclusive_group()
    data.add_argument("--dataset-size", type=int, default=None,
                      help="rows of the task's train split (task.max-train caps it, as in a run); "
                           "split over the silos like the clients do")
    data.add_argument("--client-sizes", default=None, help="comma-separated shard size of every silo")
    run.add_argument("--num-modules", type=int, default=None,
                     help="number of LoRA modules M (default: counted on the model's architecture)")
    old = p.add_argument_group("older flags (each overrides one config key)")
    for dest, key in FLAG_KEYS.items():
        old.add_argument(_flag(dest), dest=dest, default=None, metavar="VALUE", help=key)
    rec = p.add_argument_group("recommended settings (public rules: fedpower_app/privacy/recommend.py)")
    rec.add_argument("--recommend", action="store_true",
                     help="print the b, L, T, sigma, clip and lr the rules choose for these silos, dp.epsilon and "
                          "dp.delta, and why (what fedpower-run --set train.auto=true runs)")
    budget = rec.add_mutually_exclusive_group()
    budget.add_argument("--epochs", type=float, default=None,
                        help="compute budget: epochs of the smallest silo (default: config key train.epochs)")
    budget.add_argument("--minutes", type=float, default=None,
                        help="compute budget: minutes of training, with --rows-per-second")
    rec.add_argument("--rows-per-second", type=float, default=None,
                     help="with --minutes: rows one silo trains per second under DP-SGD (measured on a short run)")
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print one JSON object")
    out.add_argument("--every", type=int, default=10, help="trajectory print stride (default 10)")
    return p


# --------------------------------------------------------------------------------------------
# configuration: defaults < preset < --set < older flags, validated by parse_config
# --------------------------------------------------------------------------------------------


def run_overrides(args) -> tuple[dict[str, Any], dict[str, str]]:
    """The run-config overrides of the command line and where each came from."""
    overrides: dict[str, Any] = {}
    origin: dict[str, str] = {}
    if args.preset:
        try:
            preset = load_preset(args.preset)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read preset {args.preset!r}: {exc}") from None
        overrides.update(preset)
        origin.update({k: f"preset {args.preset}" for k in preset})
    sets = launcher.parse_set(args.set)
    overrides.update(sets)
    origin.update({k: "--set" for k in sets})
    for dest, key in FLAG_KEYS.items():
        raw = getattr(args, dest)
        if raw is None:
            continue
        value = launcher.parse_set([f"{key}={raw}"])[key]  # same TOML rules as --set
        if dest in _NAME_FLAGS and isinstance(value, str):
            value = value.strip().lower().replace("_", "-")
        if key in sets and sets[key] != value:
            raise ConfigError(f"config key {key!r} is set twice, by --set ({sets[key]!r}) and by "
                              f"{_flag(dest)} ({value!r})")
        overrides[key] = value
        origin[key] = _flag(dest)
    explicit = {k for k, where in origin.items() if not where.startswith("preset ")}
    overrides, from_method, source = with_method_preset(overrides, explicit=explicit)  # as fedpower-run
    origin.update({k: f"method preset ({source})" for k in from_method})
    return overrides, origin


def load_config(args) -> tuple[RunConfig, dict[str, str]]:
    overrides, origin = run_overrides(args)
    try:
        return parse_config(overrides), origin
    except ConfigError as exc:
        msg = str(exc)
        flags = sorted({o for k, o in origin.items() if o.startswith("--") and repr(k) in msg})
        raise ConfigError(msg + (f" (from {', '.join(flags)})" if flags else "")) from None


# --------------------------------------------------------------------------------------------
# data and model: what the server learns at start (shard sizes, number of LoRA modules)
# --------------------------------------------------------------------------------------------


def _parse_sizes(raw: str) -> list[int]:
    try:
        sizes = [int(x) for x in raw.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise ConfigError(f"--client-sizes must be a comma-separated list of integers, got {raw!r}") from None
    if not sizes:
        raise ConfigError("--client-sizes is empty")
    if any(n <= 0 for n in sizes):
        raise ConfigError(f"--client-sizes must be positive integers, got {raw!r}")
    return sizes


def client_sizes(args, cfg: RunConfig) -> tuple[Optional[list[int]], int, str]:
    """(shard sizes or None when unknown, number of silos, description of the source)."""
    if args.client_sizes is not None:
        sizes = _parse_sizes(args.client_sizes)
        if args.num_clients is not None and args.num_clients != len(sizes):
            raise ConfigError(f"--client-sizes lists {len(sizes)} silos but --supernodes/--num-clients "
                              f"is {args.num_clients}")
        return sizes, len(sizes), f"--client-sizes ({len(sizes)} silos)"
    n_silos = DEFAULT_SUPERNODES if args.num_clients is None else args.num_clients
    if n_silos < 1:
        raise ConfigError(f"--supernodes/--num-clients must be >= 1, got {n_silos}")
    if n_silos < cfg["strategy.min-nodes"]:  # the server would wait for silos that never come
        raise ConfigError(f"config key 'strategy.min-nodes' = {cfg['strategy.min-nodes']} exceeds the "
                          f"{n_silos} silos of --supernodes/--num-clients")
    silos = f"{n_silos} silos" + (f" (fedpower-run's default --supernodes)" if args.num_clients is None else "")
    task, cap = cfg["task.name"], cfg["task.max-train"]
    if args.dataset_size is not None:
        if args.dataset_size < 1:
            raise ConfigError(f"--dataset-size must be >= 1, got {args.dataset_size}")
        n, what = args.dataset_size, f"--dataset-size {args.dataset_size}"
        if task != "synthetic" and cap and cap < n:  # the run keeps a subset of max-train rows
            n, what = cap, what + f" capped by task.max-train = {cap}"
    elif task == "synthetic" or cfg["task.data-dir"]:
        from fedpower_app import data as D  # the run's own loader (local files only)

        try:
            n = len(D.load_task(cfg).train)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"config key 'task.data-dir' ({cfg['task.data-dir']!r}): cannot load the "
                              f"{task} train split: {exc}") from None
        what = ("task.synthetic-train-size" if task == "synthetic"
                else f"train split of task.data-dir" + (f", task.max-train = {cap}" if cap else ""))
    else:
        return None, n_silos, (f"{silos}; shard sizes unknown: task.name = {task!r} with an empty task.data-dir "
                               "(the hub copy is not downloaded)")
    from fedpower_app import data as D

    try:  # the clients' own split (IID or Dirichlet: the same sizes, differing by at most one)
        sizes = [len(D.partition_indices(n, n_silos, i, cfg["seed"])) for i in range(n_silos)]
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"cannot split the training set over the silos: {exc}") from None
    return sizes, n_silos, f"{n} training examples ({what}) over {silos}"


@functools.lru_cache(maxsize=8)
def count_lora_modules(model_name: str, target_modules: tuple[str, ...], rank: int) -> tuple[int, list[str], str]:
    """(number of LoRA modules, targets, architecture) the run adapts: PEFT applied to the model
    built from its config on the meta device (no weights read, nothing downloaded). Equals
    ``len(modules)`` of the server's initial adapter state."""
    import logging
    import warnings

    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from fedpower_app import model as M

    try:
        config = AutoConfig.from_pretrained(M.resolve_model_path(model_name), local_files_only=True)
    except (OSError, ValueError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"config key 'model.name' ({model_name!r}): no local config for this model, so the "
                          f"number of LoRA modules is unknown ({first}); pass --num-modules M") from None
    try:
        targets = M.target_modules_for(config.model_type, list(target_modules))
    except ValueError as exc:
        raise ConfigError(f"config key 'model.target-modules': {exc}") from None
    hf_log = logging.getLogger("transformers")
    level = hf_log.level
    hf_log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.device("meta"):
                base = AutoModelForSequenceClassification.from_config(config)
            peft_model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=rank, target_modules=targets, bias="none"))
    except ValueError as exc:  # PEFT: targets not found in the model
        raise ConfigError(f"config key 'model.target-modules' ({','.join(targets)!r}): {exc}") from None
    finally:
        hf_log.setLevel(level)
    modules, _ = M.split_adapter_keys(get_peft_model_state_dict(peft_model))
    return len(modules), list(targets), str(config.model_type)


def num_modules(args, cfg: RunConfig) -> tuple[int, str]:
    if args.num_modules is not None:
        if args.num_modules < 1:
            raise ConfigError(f"--num-modules must be >= 1, got {args.num_modules}")
        return args.num_modules, "--num-modules"
    n, targets, arch = count_lora_modules(cfg["model.name"], tuple(cfg.target_modules), cfg["lora.rank"])
    return n, f"{cfg['model.name']} ({arch}), targets {','.join(targets)}, counted on the architecture"


# --------------------------------------------------------------------------------------------
# plan: the server's build_privacy
# --------------------------------------------------------------------------------------------


def _accounted(hook) -> bool:
    """A hook with server-side noise calibrated by ``fedpower_app.privacy.accounting`` (plan + calibration)."""
    return (isinstance(getattr(hook, "plan", None), acc.PrivacyPlan)
            and isinstance(getattr(hook, "calibration", None), acc.Calibration))


def _num_labels(cfg: RunConfig) -> int:
    """The task's number of labels, from the configuration alone (no data read)."""
    from fedpower_app.data.glue_tasks import GLUE_TASKS
    from fedpower_app.data.text_files import parse_labels

    if cfg["task.name"] == "text":
        return len(parse_labels(cfg["task.labels"]))
    return GLUE_TASKS[cfg["task.name"]].num_labels if cfg["task.name"] in GLUE_TASKS else 2


def _adapter_shapes(cfg: RunConfig) -> dict:
    """The shapes of the adapters and head the silos train (distributed DP's sums are sized by them):
    the server's own initial adapter state, from the local model."""
    from fedpower_app import model as M

    try:
        state = M.initial_adapter_state(cfg, _num_labels(cfg))
    except (OSError, ValueError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"config key 'model.name' ({cfg['model.name']!r}): distributed DP sizes its secure sums by "
                          f"the adapters' shapes, and the model cannot be loaded here ({first})") from None
    return {k: tuple(v.shape) for k, v in state.items()}


def plan_privacy(args) -> dict[str, Any]:
    """Everything the report needs: config, inputs and the server's privacy hook."""
    from fedpower_app.privacy import build_privacy

    cfg, origin = load_config(args)
    out: dict[str, Any] = {"cfg": cfg, "origin": origin}
    if not cfg.dp_enabled:
        out["hook"] = build_privacy(cfg, client_sizes=[1], num_modules=1)  # NonPrivate: nothing used
        return out
    sizes, n_silos, sizes_src = client_sizes(args, cfg)
    m, m_src = num_modules(args, cfg)
    shapes = _adapter_shapes(cfg) if cfg["secagg.enabled"] and cfg["dp.level"] == "client" else None
    hook = build_privacy(cfg, client_sizes=sizes if sizes is not None else [1] * n_silos, num_modules=m,
                         adapter_shapes=shapes)
    # Unknown shard sizes are fine only if the plan does not use them (client level).
    if sizes is None and not (_accounted(hook) and hook.plan.client_sizes is None):
        raise ConfigError(f"config key 'task.name' = {cfg['task.name']!r} with an empty task.data-dir: the shard "
                          f"sizes are unknown (the hub copy is not downloaded) and dp.level = {cfg['dp.level']!r} "
                          "needs them; pass --dataset-size N (rows of the train split) or --client-sizes n1,n2,...")
    out.update(hook=hook, sizes_source=sizes_src, num_modules=m, modules_source=m_src,
               noise=noise_table(hook) if _accounted(hook) else None)
    return out


def noise_table(hook) -> dict[str, dict[str, Any]]:
    """Per round type: each released block's sensitivity and noise std, and the round's totals.

    Delta is the L2 sensitivity of everything released in the round (privacy-accounting spec §3.1), i.e.
    sqrt(sum_j Delta_j^2) of the blocks, and z = (sum_j (Delta_j/s_j)^2)^(-1/2) is the effective
    multiplier the accountant uses. When every block has the same std s (all methods in rigorous
    mode except output perturbation), s = z * Delta. Otherwise ``std`` is the single std that gives
    the same z on the concatenated release (``std_is_equivalent``). Sample level: the k-dependent
    averages are over the fixed m = q_c N (Delta = 2C/m), as the server releases them.
    Stds are the server's (``hook.noise_stds``), sensitivities ``accounting.block_sensitivities``.
    """
    from strategies import mechanisms as MECH

    plan, cal = hook.plan, hook.calibration
    table: dict[str, dict[str, Any]] = {}
    server_stds = getattr(hook, "noise_stds", None)  # what the strategy asks for (never the realised k)

    def stds_at(rt: str, k: int) -> list[float]:
        return [float(s) for s in (server_stds(rt, k) if server_stds else cal.noise_std[rt])]

    for rt in cal.noise_std:
        stds = stds_at(rt, 1)
        over_m = rt in MECH.MECHANISMS and MECH.get(rt).k_dependent
        m = getattr(hook, "fixed_denominator", None) if over_m else None
        names = list(acc.BLOCK_NAMES.get(rt, ())) or [f"block{j + 1}" for j in range(len(stds))]
        if len(names) < len(stds):  # PowerDP-L: (Y, X) per power iteration -> Y1, X1, Y2, X2, ...
            names = [f"{names[j % len(names)]}{j // len(names) + 1}" for j in range(len(stds))]
        z = float(cal.z_per_round_type.get(rt, cal.z))
        try:
            sens = [float(d) for d in plan.sensitivities(rt, m)]
            sens_k2 = plan.sensitivities(rt, 2)
        except ValueError:  # a release the sensitivity table does not know: report the stds only
            sens, sens_k2 = None, None
        entry: dict[str, Any] = {
            "z": z,
            "blocks": [{"name": n, "delta": None if sens is None else sens[j], "std": s}
                       for j, (n, s) in enumerate(zip(names, stds))],
            "std_scales_with_k": stds_at(rt, 2) != stds,
            "delta_depends_on_k": sens is not None and [float(d) for d in sens_k2] != [float(d) for d in plan.sensitivities(rt, 1)],
            "denominator": m,
        }
        if sens is not None and len(sens) == len(stds):
            delta = math.sqrt(sum(d * d for d in sens))
            same = max(stds) - min(stds) <= 1e-12 * max(stds)
            entry.update(delta=delta, std=stds[0] if same else z * delta, std_is_equivalent=not same,
                         z_from_blocks=acc.effective_z(sens, stds))
        table[rt] = entry
    return table


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------


def _fmt(x: Optional[float], nd: int = 6) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return f"{x:.{nd}g}"


def _g(x: float) -> str:  # the noise table: 8 significant digits, so std = z*Delta checks to 1e-7
    return f"{x:.8g}"


def _config_line(cfg: RunConfig, origin: dict[str, str], preset: Optional[str]) -> str:
    if not origin:
        return "config: pyproject.toml defaults (the run of `fedpower-run` without arguments)"
    parts = [f"preset {preset}"] if preset else []
    cli = [f"{k}={cfg[k]!r} ({o})" for k, o in origin.items() if not o.startswith("preset")]
    return "config: pyproject.toml defaults + " + ", ".join(parts + cli)


def render(res: dict[str, Any], every: int, preset: Optional[str] = None) -> str:
    from fedpower_app.privacy import guarantee

    cfg, hook = res["cfg"], res["hook"]
    L = [_config_line(cfg, res["origin"], preset)]
    if "sizes_source" in res:
        L.append(f"data: task {cfg['task.name']}, {res['sizes_source']}")
        L.append(f"model: {res['num_modules']} LoRA modules ({res['modules_source']})")
    if not _accounted(hook):  # non-private run, or a hook this report has no table for: its own summary
        where = f", dp.noise-at={cfg.values['dp.noise-at']}" if "dp.noise-at" in cfg.values else ""
        L.insert(0, f"fedpower-privacy: method={cfg['strategy.name']}, dp.level={cfg['dp.level']}{where}")
        claim = guarantee(cfg)
        return "\n".join(L + list(hook.summary_lines())
                         + ([f"guarantee: {'VALID' if claim['valid'] else 'NOT VALID'} -- {claim['statement']}"]
                            if cfg.dp_enabled else []))
    plan, cal = hook.plan, hook.calibration
    mode = f" ({plan.sample_mode})" if plan.level == "sample" else ""
    L.insert(0, f"fedpower-privacy: method={plan.method}, {plan.level} level{mode}, "
                f"accountant={plan.accountant}, calibration={cal.mode}")
    L.append("inputs:")
    L.append(f"  target epsilon={_fmt(plan.epsilon)}  delta={plan.delta:g}  rounds T={plan.num_rounds}  "
             f"client rate q_c={_fmt(plan.client_rate)}  clients N={plan.num_clients}")
    L.append(f"  clip C={_fmt(plan.clip)}  rank r={plan.rank}  modules M={plan.num_modules}  "
             f"refactor every F={plan.refactor_every}")
    if plan.level == "sample":
        sz = plan.client_sizes
        L.append(f"  client sizes: {len(sz)} clients, min {min(sz)}, max {max(sz)}, total {sum(sz)}; "
                 f"batch b={plan.batch_size}, local steps L={plan.local_steps}")
        L.append(f"  q_s = b/min(n_i) = {_fmt(plan.q_s)}   pi = 1-(1-q_s)^L = {_fmt(plan.pi)}   "
                 f"q_c*pi = {_fmt(plan.client_rate * plan.pi)}")
    L.append("schedule: " + ", ".join(f"{rt} x{n}" for rt, n in cal.schedule_counts.items()))
    if cal.mode == "paper":
        L.append(f"paper sigma_alg = {_fmt(cal.sigma_alg)} (per-entry noise std sigma_alg*C on every block)")
        L.append("effective noise multiplier per round type (worst case k=1): "
                 + ", ".join(f"{rt} z={_fmt(z)}" for rt, z in cal.z_per_round_type.items()))
    else:
        what = {"rigorous": "calibrated", "fixed-z": "given by dp.noise-multiplier"}.get(cal.mode, cal.mode)
        L.append(f"effective noise multiplier z = {_fmt(cal.z)} ({what}; the same in every round)")
    L.append("noise per round type: Delta = L2 sensitivity of everything released in the round (privacy-accounting spec §3.1), "
             "std = noise std per entry, z = std/Delta")
    for rt, e in res["noise"].items():
        blocks = e["blocks"]
        if "delta" not in e:  # no sensitivity known for this release: stds only
            L.append(f"  {rt:8s} z={_g(e['z'])}  stds " + ", ".join(f"{b['name']} {_g(b['std'])}" for b in blocks))
            continue
        eq = e["std_is_equivalent"]
        line = (f"  {rt:8s} Delta{'_eff' if eq else ''}={_g(e['delta'])}  std{'_eq' if eq else ''}={_g(e['std'])}  "
                f"z={_g(e['z'])}")
        if len(blocks) == 1:
            line += f"  ({blocks[0]['name']})"
        if e.get("denominator"):
            line += (f"  [average over the fixed m = q_c*N = {_fmt(e['denominator'])}, whatever the number of "
                     "replies: Delta = 2C/m, std fixed before the round]")
        elif plan.level == "sample" and e["delta_depends_on_k"]:
            line += "  [fixed std; Delta at k=1, the worst case]"
        L.append(line)
        if len(blocks) > 1:
            L.append("           blocks: " + ", ".join(f"{b['name']} Delta={_g(b['delta'])} std={_g(b['std'])}"
                                                       for b in blocks)
                     + "; Delta = sqrt(sum_j Delta_j^2)"
                     + ("; z = (sum_j (Delta_j/std_j)^2)^-1/2, std_eq = z*Delta_eff (one std on every block "
                        "with the same privacy)" if eq else ""))
        if abs(e["z_from_blocks"] - e["z"]) > 1e-9 * e["z"]:
            L.append(f"  WARNING: z of the blocks (sum_j (Delta_j/std_j)^2)^-1/2 = {_g(e['z_from_blocks'])} differs "
                     f"from the calibration's z = {_g(e['z'])}")
    L.append(f"epsilon trajectory (delta={plan.delta:g}, {cal.trajectory_accountant}):")
    T = len(cal.trajectory)
    stride = max(1, int(every))
    for t in sorted(set([1] + list(range(stride, T + 1, stride)) + [T])):
        L.append(f"  t={t:<6d} epsilon={cal.trajectory[t - 1]:.4f}")
    if cal.mode == "paper":
        L.append(f"claimed epsilon {_fmt(plan.epsilon)}; TRUE epsilon after T={plan.num_rounds}: "
                 f"{cal.epsilon:.4f} ({cal.accountant})")
    else:
        L.append(f"epsilon after T={plan.num_rounds}: {cal.epsilon:.4f} ({cal.accountant}; target {_fmt(plan.epsilon)})")
    if cal.accountant == "pld":
        L.append(f"  (RDP for comparison: {cal.epsilon_rdp:.4f})")
    L.append(f"valid DP guarantee: {'yes' if hook.is_valid_guarantee else 'NO'} -- {cal.label}")
    claim = guarantee(cfg)
    L.append(f"guarantee: {'VALID' if claim['valid'] else 'NOT VALID'} -- {claim['statement']}")
    for n in cal.notes:
        L.append(f"note: {n}")
    return "\n".join(L)


def to_json(res: dict[str, Any]) -> dict[str, Any]:
    from fedpower_app.privacy import guarantee

    hook = res["hook"]
    out: dict[str, Any] = {"config": res["cfg"].to_dict(), "privacy": hook.describe(), "guarantee": guarantee(res["cfg"])}
    if "sizes_source" in res:
        out.update(data=res["sizes_source"], num_modules=res["num_modules"], modules=res["modules_source"])
    if _accounted(hook):
        out.update(plan=hook.plan.to_dict(), pi=hook.plan.pi, calibration=hook.calibration.to_dict(),
                   noise=res["noise"], source=getattr(hook, "source", None))
    return out


def recommend_main(args) -> int:
    """``--recommend``: the plan of the public rules, or the refusal with what would fit (exit 2)."""
    from fedpower_app.privacy.recommend import PlanRefused, epochs_for_minutes, recommend, render as render_plan

    try:
        cfg, _origin = load_config(args)
        sizes, n_silos, source = client_sizes(args, cfg)
        if sizes is None:
            raise ConfigError("--recommend needs the silos' shard sizes: pass --client-sizes n1,n2,... (what the "
                              "silos answer the size query) or --dataset-size N")
        if args.minutes is not None:
            if args.rows_per_second is None:
                raise ConfigError("--minutes needs --rows-per-second (rows one silo trains per second)")
            epochs = epochs_for_minutes(args.minutes, args.rows_per_second, sizes)
        elif args.rows_per_second is not None:
            raise ConfigError("--rows-per-second goes with --minutes")
        else:
            epochs = cfg["train.epochs"] if args.epochs is None else args.epochs
        plan = recommend(sizes, cfg["dp.epsilon"], cfg["dp.delta"], epochs=epochs, accountant=cfg["dp.accountant"])
    except PlanRefused as exc:
        print(f"fedpower-privacy: refused: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"fedpower-privacy: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"sizes": sizes, "sizes_source": source, **plan.to_dict(),
                          "overrides": plan.overrides(train_head=cfg["model.train-head"])}))
    else:
        print(f"silos: {source}, sizes {min(sizes)}..{max(sizes)}, total {sum(sizes)}")
        print(render_plan(plan))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(list(argv) if argv is not None else None)
    except _ArgError as e:
        print(f"fedpower-privacy: error: {e} (see fedpower-privacy --help)", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return int(e.code or 0)
    if args.recommend:
        return recommend_main(args)
    try:
        if args.every <= 0:
            raise ValueError(f"--every must be a positive integer, got {args.every}")
        res = plan_privacy(args)
    except ValueError as e:  # ConfigError is a ValueError; so are the accountant's input errors
        print(f"fedpower-privacy: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    try:
        if args.json:
            print(json.dumps(to_json(res), allow_nan=False))
        else:
            print(render(res, args.every, args.preset))
        sys.stdout.flush()
    except BrokenPipeError:  # e.g. `fedpower-privacy | head`
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
