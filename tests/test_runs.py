"""The runs layer: a run's spec (config, backend, federation) is written to its
directory before it starts, and ``fedpower-run --resume`` restores the federation from it."""

import json
from types import SimpleNamespace

import pytest

from fedpower_app import launcher as L
from fedpower_app.config import ConfigError, parse_config
from fedpower_app.runs import RunSpec
from tests.test_app_inprocess import TINY


def _sets(d):
    return [x for k, v in d.items() for x in ("--set", f"{k}={json.dumps(v)}")]


@pytest.fixture()
def fake_flwr(monkeypatch):
    calls = []

    def run_flwr(app, overrides, **kw):
        calls.append({"overrides": dict(overrides), **kw})
        return SimpleNamespace(ok=True, run_id=1, seconds=0.0)

    monkeypatch.setattr(L.cli, "run_flwr", run_flwr)
    return calls


def test_fedpower_run_writes_its_spec_and_resume_restores_the_federation(tmp_path, fake_flwr, capsys):
    base = {**TINY, "output-dir": str(tmp_path), "run-name": "r1"}
    assert L.main(["--supernodes", "3", "--cpus-per-client", "2", *_sets(base)]) == 0
    spec = RunSpec.load(tmp_path / "r1")
    assert (spec.backend, spec.supernodes, spec.cpus_per_client, spec.gpus_per_client) == ("flwr", 3, 2.0, 0.0)
    assert spec.overrides["run-name"] == "r1" and parse_config(spec.overrides)["train.batch-size"] == 16
    assert fake_flwr[-1]["num_supernodes"] == 3 and fake_flwr[-1]["cpus_per_client"] == 2.0
    (tmp_path / "r1" / "results.json").write_text(json.dumps({"config": parse_config(base).to_dict()}))
    assert L.main(["--resume", str(tmp_path / "r1")]) == 0  # the run's own federation, not the defaults
    assert fake_flwr[-1]["num_supernodes"] == 3 and fake_flwr[-1]["cpus_per_client"] == 2.0
    assert fake_flwr[-1]["overrides"]["resume"] is True
    capsys.readouterr()
    assert L.main(["--resume", str(tmp_path / "r1"), "--supernodes", "6"]) == 2
    assert "started with --supernodes 3" in capsys.readouterr().err and len(fake_flwr) == 2


def test_a_run_without_a_name_is_named_before_it_starts(tmp_path, fake_flwr):
    assert L.main(_sets({**TINY, "output-dir": str(tmp_path)})) == 0
    (run_dir,) = tmp_path.iterdir()
    assert run_dir.name.startswith("fedpower-synthetic-") and fake_flwr[-1]["overrides"]["run-name"] == run_dir.name
    assert RunSpec.load(run_dir).supernodes == 6


def test_a_bad_spec_is_refused():
    with pytest.raises(ConfigError, match="backend"):
        RunSpec(backend="ray").check()
    with pytest.raises(ConfigError, match="in-process backend needs"):
        RunSpec(backend="inprocess", supernodes=1).check()
    with pytest.raises(ConfigError, match="not a run spec"):
        RunSpec.from_dict({"format": "other"})


def test_fedpower_run_runs_in_process(tmp_path, capsys):
    """--backend inprocess: the same ServerApp and ClientApp, no SuperLink; the same run directory."""
    rc = L.main(["--backend", "inprocess", "--supernodes", "2", "--threads", "1",
                 *_sets({**TINY, "num-server-rounds": 1, "output-dir": str(tmp_path), "run-name": "ip"})])
    assert rc == 0, capsys.readouterr().err
    res = json.loads((tmp_path / "ip" / "results.json").read_text())
    assert res["status"] == "completed" and res["clients"]["count"] == 2
    assert RunSpec.load(tmp_path / "ip").backend == "inprocess"
    assert "ip: completed after 1 rounds" in capsys.readouterr().out
