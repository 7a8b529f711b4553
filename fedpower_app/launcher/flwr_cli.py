"""How the ``flwr`` CLI and the SuperLink are called: their environment (offline, quiet or verbose), run-config arguments, ports and executables."""


from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import sys
from pathlib import Path
from typing import Any

from ..config import ConfigError, SCHEMA



OFFLINE_ENV = {
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",  # no `uv sync` of torch per run (offline, fast)
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "RAY_DEDUP_LOGS": "0",
    "TOKENIZERS_PARALLELISM": "false",
}


# Environment of the SuperLink (hence the simulation and Ray) unless --verbose: silence known-harmless
# output at its source. Python warning filters name the module that issues the warning.
QUIET_ENV = {
    # "FutureWarning: Tip: In future versions of Ray, Ray will no longer override accelerator visible
    # devices ..." (every Ray init) and transformers' "`is_gradient_checkpointing` is deprecated" (PEFT).
    # Opacus' per-example gradient hooks on LoRA layers whose inputs (frozen base) need no gradient:
    # torch's "Full backward hook is firing when gradients are computed with respect to module
    # outputs since no inputs require gradients" (harmless: Opacus uses the output gradients).
    "PYTHONWARNINGS": ",".join([
        "ignore::FutureWarning:ray._private.worker",
        "ignore::FutureWarning:transformers.modeling_utils",
        "ignore:Full backward hook is firing when gradients are computed with respect to module outputs:UserWarning",
    ]),
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # "Loading weights: 100%|####| 103/103" per process
}


# (Not RAY_BACKEND_LOG_LEVEL: Ray's C++ logs go to files anyway, and setting it makes every raylet
# print "Set ray log level from environment variable RAY_BACKEND_LOG_LEVEL" on the console.)
# --verbose: everything back, plus Flower's DEBUG log (with timestamps) and fedpower's DEBUG lines.
VERBOSE_ENV = {"FLWR_LOG_LEVEL": "DEBUG", "FEDPOWER_VERBOSE": "1"}


CONNECTION = "fedpower-run"  # name of the connection in the private CLI home


class LauncherError(RuntimeError):
    """The launcher could not start or talk to its SuperLink."""


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
    (``FLWR_LOCAL_*``: a ``:local:`` connection then reaches the SuperLink :func:`run_flwr` keeps on
    that port)."""
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


def output_env(env: dict[str, str], verbose: bool) -> dict[str, str]:
    """``env`` plus the console settings: :data:`QUIET_ENV` by default, :data:`VERBOSE_ENV` with --verbose."""
    env = dict(env)
    if verbose:
        env.update(VERBOSE_ENV)
        return env
    for key, value in QUIET_ENV.items():
        if key == "PYTHONWARNINGS" and env.get(key):
            env[key] = f"{env[key]},{value}"  # keep the user's filters
        else:
            env.setdefault(key, value)
    return env


def default_superlink_port(flwr_home: str | Path) -> int:
    """A stable port per FLWR_HOME (what :func:`flwr_env` exports when no port is given)."""
    digest = hashlib.sha256(str(Path(flwr_home).expanduser().resolve()).encode()).digest()
    return 40000 + int.from_bytes(digest[:2], "little") % 20000 // 4 * 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_is_free(port: int | None) -> bool:
    if not port:
        return False
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _num(value: float) -> str:
    """Flower rejects `num-cpus=2.0`: whole numbers as ints."""
    return str(int(value)) if float(value).is_integer() else str(value)


def _flwr() -> str:
    exe = shutil.which("flwr") or str(Path(sys.executable).with_name("flwr"))
    if not Path(exe).exists() and not shutil.which("flwr"):
        raise RuntimeError("the `flwr` command was not found; install the project (pip install -e .)")
    return exe


def _superlink_exe() -> str:
    exe = Path(sys.executable).with_name("flower-superlink")
    found = str(exe) if exe.exists() else shutil.which("flower-superlink")
    if not found:
        raise LauncherError("the `flower-superlink` command was not found; install flwr[simulation]")
    return found


def _home(flwr_home: str | Path | None) -> Path:
    return Path(flwr_home or os.environ.get("FLWR_HOME") or Path.home() / ".flwr").expanduser().resolve()
