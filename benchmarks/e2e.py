"""Targets 3 and 4: end-to-end rounds at the CPU preset.

* ``flwr run`` (managed local SuperLink, Ray simulation) with FedPower (F = 1) and FedLoRA, same
  seeds; per-round times and server aggregation times come from ``results.json``.
* A bare in-process loop doing the same client work with no Flower and no Ray: the same shards,
  the same number of sampled clients per round (same sampling coins), the same local steps and
  batches (same example-sampling generators), the same release math and the same central
  evaluation, in one process.
* Optionally the real ServerApp + ClientApp code driven by an in-process Grid (Flower Message
  objects and ArrayRecords, but no Ray and no SuperLink), to split the framework overhead.

The CPU preset is pyproject.toml's defaults (synthetic task, MiniLM, 6 silos, client rate 0.5,
5 local steps of 32, DP at sample level) with fewer rounds.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
import uuid
from pathlib import Path

from .common import PROJECT_ROOT, median

NUM_SUPERNODES = 6
_INITIAL_ADAPTERS: dict = {}  # cache key -> the seeded initial adapters of this process's cached model


def _fresh_model(cfg, num_labels):
    """The process-cached model with its adapters reset to the seeded initial state."""
    from fedpower_app import model as M

    model = M.cached_model(cfg, num_labels)
    key = M.model_cache_key(cfg, num_labels)
    if key not in _INITIAL_ADAPTERS:
        _INITIAL_ADAPTERS[key] = M.adapter_state(model)
    M.load_adapter_state(model, _INITIAL_ADAPTERS[key])
    return model


# ----------------------------------------------------------------------------------------------
# flwr run
# ----------------------------------------------------------------------------------------------
class FlwrSession:
    """A private FLWR_HOME and the app snapshot for the benchmark's ``flwr run`` cases.
    ``run_flwr`` starts a SuperLink of its own for this home (reused across cases); it is stopped
    by PID at the end (``stop_local_superlink``), never by matching process names."""

    def __init__(self, workdir: Path) -> None:
        self.home = workdir / "flwr-home"
        self.app_dir = app_snapshot(workdir)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        from fedpower_app.launcher import stop_local_superlink

        stop_local_superlink(self.home)


APP_PARTS = ("pyproject.toml", "README.md", "LICENSE", "fedpower_app", "strategies", "client_app", "server_app")


def app_snapshot(workdir: Path) -> Path:
    """A clean copy of the Flower app (the packages of the wheel + pyproject.toml).

    ``flwr run`` packs every non-ignored file of the app directory into the FAB, so run outputs
    or a FLWR_HOME left inside the working tree (e.g. ``results/.../flwr-home``) can break the
    build ("exceeds the maximum directory depth") or bloat the upload. The benchmark runs the same
    code from a snapshot instead.
    """
    dst = workdir / "app"
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    for part in APP_PARTS:
        src = PROJECT_ROOT / part
        if src.is_dir():
            shutil.copytree(src, dst / part, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif src.exists():
            shutil.copy2(src, dst / part)
    return dst


def flwr_case(session: FlwrSession, overrides: dict, out_dir: Path, log_path: Path, timeout: float,
              cpus_per_client: float = 2, gpus_per_client: float = 0.0) -> dict:
    from fedpower_app.launcher import run_flwr

    run_name = f"bench-{overrides['strategy.name']}-{uuid.uuid4().hex[:6]}"
    ov = {**overrides, "run-name": run_name, "output-dir": str(out_dir)}
    t0 = time.perf_counter()
    outcome = run_flwr(session.app_dir, ov, num_supernodes=NUM_SUPERNODES, flwr_home=session.home, echo=False,
                       timeout=timeout, cpus_per_client=cpus_per_client, gpus_per_client=gpus_per_client)
    total = time.perf_counter() - t0
    log_path.write_text(outcome.output)
    res_path = out_dir / run_name / "results.json"
    if not outcome.ok or not res_path.exists():
        return {"ok": False, "status": outcome.status, "seconds": total, "log": str(log_path)}
    data = json.loads(res_path.read_text())
    rounds = data["rounds"]
    walls = [r["wall_seconds"] for r in rounds]
    per_round = [walls[0]] + [b - a for a, b in zip(walls, walls[1:])]
    return {
        "ok": True, "status": outcome.status, "process_seconds": total, "log": str(log_path),
        "results": str(res_path),
        "round_seconds": per_round,  # round 1 includes Ray actors loading the model (startup)
        "rounds_wall_seconds": walls[-1],  # initial eval + all rounds (excludes SuperLink/Ray/ServerApp startup)
        "aggregation_seconds": [r["aggregation_seconds"] for r in rounds],
        "sampled": [r["sampled"] for r in rounds],
        "accuracy": [r.get("accuracy") for r in rounds],
    }


# ----------------------------------------------------------------------------------------------
# Bare in-process loop (no Flower, no Ray)
# ----------------------------------------------------------------------------------------------
def bare_loop(overrides: dict, device_name: str) -> dict:
    """The same client and server work as a flwr run, in one process, with no framework."""
    run = BareRun(overrides, device_name)
    for rnd in range(1, run.rounds + 1):
        run.step(rnd)
    return run.result()


def paired_bare(a_overrides: dict, b_overrides: dict, device_name: str) -> tuple[dict, dict]:
    """Two bare runs advanced round by round in alternating order (AB, BA, ...): background
    load drifts hit both alike, so their per-round difference isolates the method's cost."""
    a, b = BareRun(a_overrides, device_name), BareRun(b_overrides, device_name)
    for rnd in range(1, a.rounds + 1):
        for run in ((a, b) if rnd % 2 else (b, a)):
            run.step(rnd)
    return a.result(), b.result()


class BareRun:
    """One run of the bare loop, advanced with ``step(round)``."""

    def __init__(self, overrides: dict, device_name: str) -> None:
        self.__dict__.update(_bare_setup(overrides, device_name))
        self.t_start = time.perf_counter()
        self.central_eval()  # round 0, as the ServerApp does
        self.round_s: list[float] = []
        self.busy = time.perf_counter() - self.t_start

    def step(self, rnd: int) -> None:
        t0 = time.perf_counter()
        self._round(rnd)
        dt = time.perf_counter() - t0
        self.round_s.append(dt)
        self.busy += dt

    def result(self) -> dict:
        import torch

        return {"round_seconds": self.round_s, "aggregation_seconds": self.agg_s, "train_seconds": self.train_s,
                "eval_seconds": self.eval_s, "sampled": self.sampled_n, "rounds_wall_seconds": self.busy,
                "torch_threads": torch.get_num_threads()}


def _bare_setup(overrides: dict, device_name: str) -> dict:
    """The product's round engine (strategies.engine) and a silo's round (training.silo_round),
    with the messages replaced by function calls: the same sampling, plan, training (DP-SGD when
    the plan says so), release and commit as a Flower run, with no framework."""
    from client_app.app import dp_sgd_params, reply_state
    from fedpower_app import data as D
    from fedpower_app import model as M
    from fedpower_app.config import parse_config
    from fedpower_app.training import evaluate as evaluate_model
    from fedpower_app.training.silo_round import train_round
    from server_app.app import engine_for
    from strategies.engine import RoundReport

    cfg = parse_config({**overrides, "device": device_name})
    n = NUM_SUPERNODES
    task = D.load_task(cfg)
    model = _fresh_model(cfg, task.num_labels)
    device = next(model.parameters()).device
    tok = M.load_tokenizer(cfg["model.name"])
    shards = [D.client_shard(cfg, tok, pid, n) for pid in range(n)]
    splits = D.eval_splits(cfg, tok)
    engine = engine_for(cfg, M.adapter_state(model), client_sizes=[s.dp_size for s in shards])
    rounds = cfg["num-server-rounds"]

    def central_eval():
        M.load_adapter_state(model, engine.global_state)
        return [evaluate_model(model, s, batch_size=cfg["eval.batch-size"], device=device) for s in splits.values()]

    agg_s, train_s, eval_s, sampled_n = [], [], [], []

    def one_round(rnd: int) -> None:
        plan = engine.plan_for(rnd, list(range(n)))  # sampling and the privacy layer's plan
        config = engine.train_instructions(plan)
        params = dp_sgd_params(config)
        t_tr = time.perf_counter()
        updates = []
        for pid in plan.admitted:
            M.load_adapter_state(model, engine.global_state)
            train_round(cfg, model, shards[pid], partition_id=pid, server_round=rnd,
                        train_lora=config["train-lora"], params=params)
            updates.append(engine.update_from_state(reply_state(model, config["train-lora"])))
        train_s.append(time.perf_counter() - t_tr)
        t_agg = time.perf_counter()
        engine.release_updates(RoundReport(rnd, plan.round_type, sampled=len(plan.admitted)), updates)
        agg_s.append(time.perf_counter() - t_agg)
        t_ev = time.perf_counter()
        if rnd % cfg["eval.every"] == 0 or rnd == rounds:
            central_eval()
        eval_s.append(time.perf_counter() - t_ev)
        sampled_n.append(len(plan.admitted))

    return {"engine": engine, "central_eval": central_eval, "_round": one_round, "rounds": rounds, "agg_s": agg_s, "train_s": train_s,
            "eval_s": eval_s, "sampled_n": sampled_n}


# ----------------------------------------------------------------------------------------------
# Real ServerApp/ClientApp code on an in-process Grid (Flower messages, no Ray, no SuperLink)
# ----------------------------------------------------------------------------------------------
def inprocess_flower(overrides: dict, device_name: str, out_dir: Path) -> dict:
    from client_app.app import app as client_app
    from fedpower_app.runs.inprocess_grid import InProcessGrid
    from fedpower_app.config import parse_config
    from fedpower_app.runs.results import ResultsWriter
    from server_app.app import _run

    run_name = f"inproc-{overrides['strategy.name']}-{uuid.uuid4().hex[:6]}"
    run_config = {**overrides, "device": device_name, "run-name": run_name, "output-dir": str(out_dir)}
    cfg = parse_config(run_config)
    from fedpower_app.data import load_task

    _fresh_model(cfg, load_task(cfg).num_labels)
    run_dir = out_dir / run_name
    results = ResultsWriter(run_dir, cfg.to_dict())
    _run(InProcessGrid(client_app, NUM_SUPERNODES, run_config), cfg, run_dir, results)
    rounds = results.data["rounds"]
    walls = [r["wall_seconds"] for r in rounds]
    return {"round_seconds": [walls[0]] + [b - a for a, b in zip(walls, walls[1:])],
            "aggregation_seconds": [r["aggregation_seconds"] for r in rounds],
            "sampled": [r["sampled"] for r in rounds], "rounds_wall_seconds": walls[-1]}


# ----------------------------------------------------------------------------------------------
# Suite
# ----------------------------------------------------------------------------------------------
def _steady(xs: list[float]) -> float:
    """Median per-round time excluding round 1 (warm-up: model loads, first-touch allocations)."""
    return median(xs[1:] if len(xs) > 1 else xs)


def _per_client(res: dict) -> float:
    """Median over rounds >= 2 of round time per sampled client (rounds differ in client count)."""
    vals = [t / max(1, k) for t, k in zip(res["round_seconds"][1:], res["sampled"][1:])]
    return median(vals) if vals else float("nan")


def run(*, rounds: int, device, only: set[str], workdir: Path | None = None, timeout: float = 900, log=print,
        inprocess: bool = True, cpus_per_client: float = 2, gpus_per_client: float = 0.0):
    """Targets 3 (``e2e``) and 4 (``framework``). Returns (rows, data)."""
    from .common import Row

    workdir = Path(workdir or tempfile.mkdtemp(prefix="fedpower-bench-"))
    out_dir = workdir / "outputs"
    out_dir.mkdir(parents=True, exist_ok=True)
    base = {"num-server-rounds": rounds, "seed": 0, "strategy.refactor-every": 1}
    fp = {**base, "strategy.name": "fedpower"}
    fl = {**base, "strategy.name": "fedlora"}
    dev = "cuda" if device.type == "cuda" else "cpu"
    data: dict = {"rounds": rounds, "supernodes": NUM_SUPERNODES, "workdir": str(workdir),
                  "client_resources": {"num_cpus": cpus_per_client, "num_gpus": gpus_per_client}}
    # Flower parses num-cpus as an integer: pass 2, not 2.0.
    fkw = dict(cpus_per_client=int(cpus_per_client) if float(cpus_per_client).is_integer() else cpus_per_client,
               gpus_per_client=int(gpus_per_client) if float(gpus_per_client).is_integer() else gpus_per_client)
    rows: list[Row] = []

    # Warm the token cache and the model files once so no measured run pays for tokenisation.
    log("[e2e] warm-up: tokenise shards, load model (not timed)")
    bare_loop({**fp, "num-server-rounds": 1}, dev)

    # Order: flwr FedPower, bare FedPower, bare FedLoRA, flwr FedLoRA (ABBA: drift hits both alike).
    with FlwrSession(workdir) as session:
        log(f"[e2e] flwr run, FedPower F=1, {rounds} rounds, {NUM_SUPERNODES} supernodes (private SuperLink port {session.http_port})")
        data["flwr_fedpower"] = flwr_case(session, fp, out_dir, workdir / "flwr-fedpower.log", timeout, **fkw)
        log(f"    -> {_brief(data['flwr_fedpower'])}")
        if "e2e" in only:
            log("[e2e] bare in-process loops, FedPower and FedLoRA advanced round by round in alternating order")
            data["bare_fedpower"], data["bare_fedlora"] = paired_bare(fp, fl, dev)
            log(f"    -> FedPower {_brief(data['bare_fedpower'])}")
            log(f"    -> FedLoRA  {_brief(data['bare_fedlora'])}")
        else:
            log("[e2e] bare in-process loop, FedPower")
            data["bare_fedpower"] = bare_loop(fp, dev)
            log(f"    -> {_brief(data['bare_fedpower'])}")
        if inprocess and "framework" in only:
            log("[e2e] ServerApp + ClientApp on an in-process Grid (Flower messages, no Ray), FedPower")
            data["inprocess_flower_fedpower"] = inprocess_flower(fp, dev, out_dir)
            log(f"    -> {_brief(data['inprocess_flower_fedpower'])}")
        if "e2e" in only:
            log(f"[e2e] flwr run, FedLoRA, {rounds} rounds")
            data["flwr_fedlora"] = flwr_case(session, fl, out_dir, workdir / "flwr-fedlora.log", timeout, **fkw)
            log(f"    -> {_brief(data['flwr_fedlora'])}")

    ffp, bfp = data["flwr_fedpower"], data["bare_fedpower"]
    if "e2e" in only:
        bfl, ffl = data["bare_fedlora"], data["flwr_fedlora"]
        if ffp.get("ok") and ffl.get("ok"):
            a, b = ffl["rounds_wall_seconds"], ffp["rounds_wall_seconds"]
            agg_fp, agg_fl = sum(ffp["aggregation_seconds"]), sum(ffl["aggregation_seconds"])
            rows.append(Row("3", f"flwr run, {rounds} rounds, CPU preset", "FedLoRA total", "FedPower F=1 total", a, b,
                            b / a, "time ratio", "<= 1.02", b / a <= 1.02,
                            note=f"server aggregation share: FedPower {agg_fp / b:.2%}, FedLoRA {agg_fl / a:.2%} of wall; "
                                 f"refactorisation overhead from aggregation times alone = {(agg_fp - agg_fl) / a:+.2%}"))
        a, b = bfl["rounds_wall_seconds"], bfp["rounds_wall_seconds"]
        agg_fp, agg_fl = sum(bfp["aggregation_seconds"]), sum(bfl["aggregation_seconds"])
        spread = max(abs(x - y) / y for x, y in zip(bfp["train_seconds"], bfl["train_seconds"]))
        rows.append(Row("3", f"bare loop, {rounds} rounds paired (ABBA), CPU preset", "FedLoRA total", "FedPower F=1 total",
                        a, b, b / a, "time ratio", "<= 1.02", b / a <= 1.02,
                        note=f"aggregation: FedPower {agg_fp:.3f} s ({agg_fp / b:.2%}), FedLoRA {agg_fl:.3f} s "
                             f"({agg_fl / a:.2%}); overhead from aggregation times {(agg_fp - agg_fl) / a:+.3%}; "
                             f"identical client work still differs by up to {spread:.0%} per round (machine noise)"))
        rows.append(Row("3", f"bare loop, {rounds} rounds: server aggregation only", "FedLoRA round total",
                        "FedPower - FedLoRA aggregation", a, agg_fp - agg_fl, 1 + (agg_fp - agg_fl) / a,
                        "time ratio", "<= 1.02", 1 + (agg_fp - agg_fl) / a <= 1.02,
                        note="the only work that differs between the two methods; client work is identical "
                             "(same clients, batches and steps)"))
    if "framework" in only and ffp.get("ok"):
        fr, br = _steady(ffp["round_seconds"]), _steady(bfp["round_seconds"])
        same_k = ffp["sampled"] == bfp["sampled"]
        rows.append(Row("4", f"per round (median of rounds 2..{rounds}), FedPower", "bare loop", "flwr run", br, fr,
                        fr / br, "time ratio", "<= 1.25", fr / br <= 1.25,
                        note=("same clients per round " if same_k else f"clients per round differ {ffp['sampled']} vs {bfp['sampled']}; ")
                             + f"per sampled client: flwr {_per_client(ffp):.2f} s vs bare {_per_client(bfp):.2f} s; "
                               f"bare: train {median(bfp['train_seconds'][1:]):.2f} s, eval {median(bfp['eval_seconds'][1:]):.2f} s, "
                               f"agg {median(bfp['aggregation_seconds'][1:]):.3f} s per round"))
        ip = data.get("inprocess_flower_fedpower")
        if ip:
            irs = _steady(ip["round_seconds"])
            rows.append(Row("4", "per round, FedPower: framework split", "bare loop", "ServerApp+ClientApp, in-process Grid",
                            br, irs, irs / br, "time ratio", "(diagnostic)", None,
                            note="Flower messages/ArrayRecords/copies without Ray or SuperLink"))
    return rows, data


def _brief(res: dict) -> str:
    if res.get("ok") is False:
        return f"FAILED status {res.get('status')} (log {res.get('log')})"
    rs = res["round_seconds"]
    return (f"rounds {', '.join(f'{x:.1f}' for x in rs)} s; clients {res['sampled']}; "
            f"aggregation {sum(res['aggregation_seconds']):.3f} s; rounds wall {res['rounds_wall_seconds']:.1f} s")
