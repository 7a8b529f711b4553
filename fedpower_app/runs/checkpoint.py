"""Atomic per-round checkpoints of a run, and the in-flight round journal (Flower-free).

After every round the ServerApp writes ``<run_dir>/checkpoint.pt``: the global adapters, the last
finished round, every privacy ledger (server and per silo), the results so far and a fingerprint of
the run configuration. The file is written to a temporary name, fsync'ed, renamed over the old one
and the directory fsync'ed, so a kill at any instant leaves either the previous checkpoint or the
new one, never a mixture. A SHA-256 of the body detects a truncated or damaged file.

Before a round's train messages leave the server, ``<run_dir>/inflight.json`` records the round
and the silos it is sent to. On resume a journal for the round after the checkpoint means that
round was in flight at the kill. What it counts as (docs/privacy.md §11):

* ``dp.noise = "seeded"``: every coin and noise draw of round t is a function of (seed, stream, t),
  so re-running round t recomputes *the same* release: it is counted once, when it is re-run.
* ``dp.noise = "hardened"``: the killed round's draws are gone; the silos sent noised updates that
  cannot be reproduced, so that release is charged to their ledgers (``lost_release``) and the
  re-run is a second, separately charged release. A released round always counts.

The noise source needs no saved position: every generator is derived from (seed, stream, round).

Fault injection for tests: ``FEDPOWER_FAULT="<point>:<round>"`` SIGKILLs the process at ``point``
(``after-journal``, ``checkpoint-tmp-written``, ``after-checkpoint``) of round ``round``.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import signal
from pathlib import Path
from typing import Any

import torch

from .atomic import write_atomic

FORMAT = "fedpower-checkpoint/1"
CHECKPOINT_FILE = "checkpoint.pt"
INFLIGHT_FILE = "inflight.json"
_MAGIC = b"FEDPOWER-CHECKPOINT-1\n"
# Keys that may change between a run and its resumption without changing its math.
RESUMABLE_KEYS = ("resume", "strategy.round-timeout", "eval.batch-size")
# Keys added after checkpoints were first written, each with the value that reproduces the runs made
# before it existed. At that value a key is left out of the fingerprint, so those checkpoints resume.
ADDED_KEYS = {"task.dirichlet-alpha": 0.0, "dp.diagnostics": "off", "task.validation-rows": 0,
              "lora.top-layers": 0, "train.cache-frozen": False,
              "train.optimizer-state": "round", "model.pooling": "pooler", "train.adam-eps": 1e-8,
              "train.head-lr-scale": 1.0, "model.dropout": -1.0,
              "train.label-smoothing": 0.0, "train.precision": "auto"}


def _fingerprinted(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in sorted(config.items())
            if k not in RESUMABLE_KEYS and not (k in ADDED_KEYS and v == ADDED_KEYS[k])}


class CheckpointError(RuntimeError):
    """A checkpoint that must not be used (corrupt, truncated, another config or strategy)."""


def config_fingerprint(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(_fingerprinted(config), sort_keys=True, default=str).encode()).hexdigest()


def fault_point(point: str, server_round: int) -> None:
    """Kill this process (SIGKILL, no cleanup) if FEDPOWER_FAULT names this point and round."""
    spec = os.environ.get("FEDPOWER_FAULT", "")
    if spec and spec == f"{point}:{server_round}":
        os.kill(os.getpid(), signal.SIGKILL)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes, *, fault: tuple[str, int] | None = None) -> None:
    write_atomic(path, data, before_replace=(lambda: fault_point(*fault)) if fault else None)
    _fsync_dir(path.parent)


def save_checkpoint(run_dir: Path, payload: dict[str, Any]) -> Path:
    """Write ``payload`` (tensors and JSON-able values) atomically with a checksum."""
    buf = io.BytesIO()
    torch.save({"format": FORMAT, **payload}, buf)
    body = buf.getvalue()
    digest = hashlib.sha256(body).hexdigest().encode()
    path = Path(run_dir) / CHECKPOINT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(path, _MAGIC + digest + b"\n" + body, fault=("checkpoint-tmp-written", int(payload["round"])))
    fault_point("after-checkpoint", int(payload["round"]))
    return path


def load_checkpoint(run_dir: Path, *, config: dict[str, Any], strategy: str) -> dict[str, Any] | None:
    """The run's checkpoint, or None if it has none. Raises CheckpointError, saying why, for a
    file that is damaged or belongs to another configuration or strategy."""
    path = Path(run_dir) / CHECKPOINT_FILE
    if not path.exists():
        return None
    raw = path.read_bytes()
    if not raw.startswith(_MAGIC):
        raise CheckpointError(f"{path} is not a fedpower checkpoint (bad header)")
    header_end = len(_MAGIC) + 64
    digest, body = raw[len(_MAGIC):header_end], raw[header_end + 1:]
    if raw[header_end:header_end + 1] != b"\n" or hashlib.sha256(body).hexdigest().encode() != digest:
        raise CheckpointError(f"{path} is truncated or damaged (checksum mismatch, {len(raw)} bytes); "
                              "refusing to resume from it")
    try:
        payload = torch.load(io.BytesIO(body), weights_only=True, map_location="cpu")  # saved on any device
    except Exception as exc:
        raise CheckpointError(f"{path} cannot be read: {type(exc).__name__}: {exc}") from None
    if payload.get("format") != FORMAT:
        raise CheckpointError(f"{path} has format {payload.get('format')!r}, expected {FORMAT!r}")
    if payload.get("strategy") != strategy:
        raise CheckpointError(f"{path} was written by strategy {payload.get('strategy')!r}; this run is {strategy!r}")
    if payload.get("fingerprint") != config_fingerprint(config):
        saved, now = _fingerprinted(json.loads(payload.get("config_json") or "{}")), _fingerprinted(config)
        keys = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
        raise CheckpointError(f"{path} was written with another run configuration; refusing to resume "
                              f"(differs in: {', '.join(keys) or 'unknown keys'})")
    return payload


def write_inflight(run_dir: Path, server_round: int, silos: list[int]) -> None:
    """Record, before the train messages leave, that ``server_round`` is sent to ``silos``
    (population indices)."""
    data = json.dumps({"round": int(server_round), "silos": [int(s) for s in silos]}).encode()
    _write_atomic(Path(run_dir) / INFLIGHT_FILE, data)
    fault_point("after-journal", server_round)


def read_inflight(run_dir: Path) -> dict[str, Any] | None:
    path = Path(run_dir) / INFLIGHT_FILE
    try:
        data = json.loads(path.read_text())
        return {"round": int(data["round"]), "silos": [int(s) for s in data["silos"]]}
    except (OSError, ValueError, KeyError, TypeError):
        return None  # no journal, or one cut short before its rename (then nothing was sent)
