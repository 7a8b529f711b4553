"""A run's spec: what to run (the run-config overrides, validated as the ServerApp will), on which
backend (``flwr``: a Flower simulation through a SuperLink; ``inprocess``: the real ServerApp and
ClientApp in one process), and the federation (number of SuperNodes, each ClientApp's resources).

``fedpower-run`` writes it to ``<run dir>/run.json`` before anything starts, so that
``fedpower-run --resume <run dir>`` restores the same federation, not only the same config: a run
started with ``--supernodes 3`` resumes with 3 SuperNodes."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..config import ConfigError, RunConfig, validate_overrides
from .atomic import write_json_atomic

BACKENDS = ("flwr", "inprocess")
SPEC_FILE = "run.json"
FORMAT = "fedpower-run/1"


@dataclass
class RunSpec:
    overrides: dict[str, Any] = field(default_factory=dict)
    backend: str = "flwr"
    supernodes: int = 6
    cpus_per_client: float = 1.0
    gpus_per_client: float = 0.0

    def check(self) -> None:
        """The federation's own checks (the config is checked by :meth:`config`)."""
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if int(self.supernodes) < 1:
            raise ConfigError(f"--supernodes must be >= 1, got {self.supernodes}")
        if self.backend == "inprocess" and int(self.supernodes) < 2:
            raise ConfigError("the in-process backend needs --supernodes >= 2 (its virtual clients)")
        if self.cpus_per_client <= 0 or self.gpus_per_client < 0:
            raise ConfigError("--cpus-per-client must be > 0 and --gpus-per-client >= 0")

    def config(self) -> RunConfig:
        self.check()
        return validate_overrides(self.overrides)

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RunSpec":
        if d.get("format") != FORMAT:
            raise ConfigError(f"not a run spec ({SPEC_FILE} format {d.get('format')!r}, expected {FORMAT!r})")
        return cls(overrides=dict(d.get("overrides") or {}), backend=str(d.get("backend", "flwr")),
                   supernodes=int(d.get("supernodes", 6)), cpus_per_client=float(d.get("cpus_per_client", 1.0)),
                   gpus_per_client=float(d.get("gpus_per_client", 0.0)))

    def save(self, run_dir: Path | str) -> Path:
        return write_json_atomic(Path(run_dir) / SPEC_FILE, self.to_dict())

    @classmethod
    def load(cls, run_dir: Path | str) -> "RunSpec | None":
        """The spec a run was started with, or None for a run made before specs were written."""
        path = Path(run_dir) / SPEC_FILE
        if not path.exists():
            return None
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{path}: unreadable run spec: {exc}") from None


def default_run_name(cfg: RunConfig) -> str:
    """``<strategy>-<task>-<timestamp>``: the name of a run whose ``run-name`` is empty."""
    return f"{cfg['strategy.name']}-{cfg['task.name']}-{time.strftime('%Y%m%d-%H%M%S')}"


def gpu_placement(device: str, gpus_per_client: float, *, server_device: str = "auto",
                  cuda_visible: bool | None = None) -> tuple[str | None, str | None]:
    """Where a Ray simulation's silos and server will run, checked before anything starts:
    (a reason to refuse, a warning), each None when there is none.

    Ray hides the GPUs from a ClientApp that reserves none, so ``device = "auto"`` without
    ``--gpus-per-client`` trains every silo on the CPU while the ServerApp, outside Ray, takes the
    GPU; and ClientApps that reserve GPUs on a machine without any are never scheduled."""
    wants_gpu = device.startswith("cuda")
    if gpus_per_client == 0 and wants_gpu:
        return (f"config key 'device' = '{device}' needs --gpus-per-client > 0 (Ray hides the GPUs from "
                "ClientApps that reserve none)"), None
    if cuda_visible is None:
        if gpus_per_client == 0 and device == "cpu" and server_device in ("auto", "cpu"):
            return None, None  # nothing here touches a GPU: do not import torch to look
        import torch

        cuda_visible = torch.cuda.is_available()
    if gpus_per_client > 0 and not cuda_visible:
        return (f"--gpus-per-client {gpus_per_client:g} but this machine shows no CUDA GPU: Ray would never "
                "schedule the ClientApps (leave it at 0 to train on the CPU)"), None
    if gpus_per_client == 0 and device == "auto" and cuda_visible:
        server = "the CPU" if server_device == "cpu" else "the GPU"
        return None, (f"a GPU is visible, but --gpus-per-client is 0: every silo trains on the CPU (Ray hides the "
                      f"GPU from its ClientApps) and the server runs on {server}. Pass --gpus-per-client (e.g. "
                      "0.25 for 4 ClientApps per GPU; fedpower-memory sizes it), or set device = \"cpu\" to say so")
    return None, None
