"""``fedpower-run``: run the app through ``flwr run`` and report the run's real status.

``flwr run`` exits 0 even when the run fails, and the managed local SuperLink needs a few
environment variables to work offline. This wrapper sets them, streams the run's output, then
asks ``flwr ls --format json`` for the run's status and exits non-zero unless it completed.

    fedpower-run                                   # default config, 6 simulated silos
    fedpower-run --preset conf/tiny.toml --set num-server-rounds=3 --set strategy.name='"fedlora"'
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import PROJECT_ROOT, ConfigError, SCHEMA, load_preset

OFFLINE_ENV = {
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",  # no `uv sync` of torch per run (offline, fast)
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "RAY_DEDUP_LOGS": "0",
    "TOKENIZERS_PARALLELISM": "false",
}


@dataclass
class RunOutcome:
    run_id: str | None
    status: str
    returncode: int
    seconds: float
    output: str

    @property
    def ok(self) -> bool:
        return self.status == "finished:completed"


def toml_value(value: Any) -> str:
    """A run-config value as TOML (strings quoted), for ``--run-config``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))


def run_config_arg(overrides: dict[str, Any]) -> str:
    unknown = sorted(set(overrides) - set(SCHEMA))
    if unknown:
        raise ConfigError(f"unknown config key(s): {', '.join(unknown)}")
    return " ".join(f"{k}={toml_value(v)}" for k, v in overrides.items())


def flwr_env(flwr_home: str | Path | None, superlink_port: int | None = None) -> dict[str, str]:
    """Environment for ``flwr``: offline settings, FLWR_HOME and, optionally, private SuperLink ports
    (so parallel jobs on one host do not share a managed SuperLink)."""
    env = dict(os.environ)
    env.update({k: env.get(k, v) for k, v in OFFLINE_ENV.items()})
    # flwr spawns flower-superlink / flwr-simulation by name: make this interpreter's scripts findable
    # even when the venv is not activated.
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in env.get("PATH", "").split(os.pathsep):
        env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    if superlink_port is None and flwr_home:
        superlink_port = default_superlink_port(flwr_home)
    if superlink_port:
        env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"] = str(superlink_port)
        env["FLWR_LOCAL_CONTROL_API_PORT"] = str(superlink_port + 2)
    if flwr_home:
        env["FLWR_HOME"] = str(Path(flwr_home).expanduser().resolve())
        Path(env["FLWR_HOME"]).mkdir(parents=True, exist_ok=True)
    return env


def default_superlink_port(flwr_home: str | Path) -> int:
    """A stable private port per FLWR_HOME (the managed SuperLink is shared by port, not by home)."""
    digest = hashlib.sha256(str(Path(flwr_home).expanduser().resolve()).encode()).digest()
    return 40000 + int.from_bytes(digest[:2], "little") % 20000 // 4 * 4


def _num(value: float) -> str:
    """Flower rejects `num-cpus=2.0`: whole numbers as ints."""
    return str(int(value)) if float(value).is_integer() else str(value)


def _flwr() -> str:
    exe = shutil.which("flwr") or str(Path(sys.executable).with_name("flwr"))
    if not Path(exe).exists() and not shutil.which("flwr"):
        raise RuntimeError("the `flwr` command was not found; install the project (pip install -e .)")
    return exe


def run_status(run_id: str, env: dict[str, str]) -> str:
    """Status of a run from ``flwr ls --run-id ... --format json`` (e.g. finished:completed)."""
    out = subprocess.run([_flwr(), "ls", "--run-id", str(run_id), "--format", "json"], env=env,
                         capture_output=True, text=True, timeout=120)
    try:
        runs = json.loads(out.stdout).get("runs", [])
    except json.JSONDecodeError:
        return f"unknown ({out.stdout.strip()[:200]} {out.stderr.strip()[:200]})"
    for run in runs:
        if str(run.get("run-id")) == str(run_id):
            return str(run.get("status"))
    return "unknown (run not listed)"


def run_flwr(
    app_dir: str | Path = PROJECT_ROOT,
    overrides: dict[str, Any] | None = None,
    *,
    preset: str | Path | None = None,
    num_supernodes: int = 6,
    cpus_per_client: float = 1,
    gpus_per_client: float = 0.0,
    flwr_home: str | Path | None = None,
    superlink_port: int | None = None,
    echo: bool = True,
    timeout: float | None = None,
) -> RunOutcome:
    """Run the app with ``flwr run --stream`` and return its real status."""
    env = flwr_env(flwr_home, superlink_port)
    cmd = [_flwr(), "run", str(app_dir), "--stream",
           "--federation-config",
           f"num-supernodes={num_supernodes} client-resources-num-cpus={_num(cpus_per_client)} "
           f"client-resources-num-gpus={_num(gpus_per_client)}"]
    # flwr refuses a TOML file together with key=value pairs, so a preset is merged into the pairs.
    merged = {**(load_preset(preset) if preset else {}), **(overrides or {})}
    if merged:
        cmd += ["--run-config", run_config_arg(merged)]
    t0 = time.time()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    lines: list[str] = []
    run_id = None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if echo:
                sys.stdout.write(line)
                sys.stdout.flush()
            if run_id is None and (m := re.search(r"started run (\d+)", line)):
                run_id = m.group(1)
            if timeout is not None and time.time() - t0 > timeout:
                proc.send_signal(signal.SIGINT)
                break
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    status = run_status(run_id, env) if run_id else "not-started"
    return RunOutcome(run_id, status, proc.returncode or 0, time.time() - t0, "".join(lines))


def stop_local_superlink(flwr_home: str | Path | None = None) -> None:
    """Stop the managed local SuperLink started for ``flwr_home`` (it runs detached)."""
    home = str(Path(flwr_home or os.environ.get("FLWR_HOME") or Path.home() / ".flwr").expanduser().resolve())
    subprocess.run(["pkill", "-f", f"flower-superlink.*--simulation.*{re.escape(home)}"], check=False)


def parse_set(items) -> dict[str, Any]:
    """``--set key=value`` items as a dict; values are TOML, a bare word is taken as a string."""
    import tomllib

    out = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        key, raw = item.split("=", 1)
        try:
            out[key.strip()] = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            out[key.strip()] = raw  # bare word: treat as a string
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fedpower-run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--app", default=str(PROJECT_ROOT), help="app directory (default: this project)")
    p.add_argument("--preset", help="a conf/*.toml preset")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a run-config key (TOML value)")
    p.add_argument("--supernodes", type=int, default=6, help="number of simulated silos (default 6)")
    p.add_argument("--cpus-per-client", type=float, default=1)
    p.add_argument("--gpus-per-client", type=float, default=0.0, help="fraction of a GPU per ClientApp (e.g. 0.25)")
    p.add_argument("--flwr-home", default=os.environ.get("FLWR_HOME"), help="Flower home (default ~/.flwr)")
    p.add_argument("--stop-superlink", action="store_true", help="stop the managed local SuperLink afterwards")
    args = p.parse_args(argv)
    try:
        overrides = parse_set(args.set)
        if args.preset:
            load_preset(args.preset)  # fail early on a bad file
        run_config_arg(overrides)
        outcome = run_flwr(args.app, overrides, preset=args.preset, num_supernodes=args.supernodes,
                           cpus_per_client=args.cpus_per_client, gpus_per_client=args.gpus_per_client,
                           flwr_home=args.flwr_home)
    except (ConfigError, RuntimeError, OSError) as exc:
        print(f"fedpower-run: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if args.stop_superlink:
            stop_local_superlink(args.flwr_home)
    print(f"\nfedpower-run: run {outcome.run_id} status {outcome.status} after {outcome.seconds:.0f} s")
    return 0 if outcome.ok else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
