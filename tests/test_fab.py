"""What `flwr run` ships: the FAB holds the app's code and presets, never the results under it.

Without `fab-include`, Flower packages every .py/.toml/.md/.json file under the project; the audit's
row lists and plans in results/ then pushed the FAB past Flower's 10 MB limit and every audit run
failed before starting (2026-11-25)."""

from __future__ import annotations

import json
import random
import shutil
import zipfile
from io import BytesIO

from flwr.cli.build import build_fab_from_disk

from fedpower_app.config import PROJECT_ROOT

CODE_DIRS = ("fedpower_app/", "strategies/", "client_app/", "server_app/", "conf/")


def _fab_names(app) -> list[str]:
    return zipfile.ZipFile(BytesIO(build_fab_from_disk(app))).namelist()


def test_fab_holds_the_app_code_and_presets_only():
    names = _fab_names(PROJECT_ROOT)
    for needed in ("pyproject.toml", "client_app/app.py", "server_app/app.py", "strategies/powerdp.py",
                   "fedpower_app/config.py", "conf/audit-sst2.toml"):
        assert needed in names
    stray = [n for n in names if not n.startswith(CODE_DIRS) and n not in ("pyproject.toml", ".info/CONTENT")]
    assert stray == []
    assert not any(n.startswith("tests/") for n in names)


def test_large_results_under_the_project_stay_out_of_the_fab(tmp_path):
    app = tmp_path / "fedpower"
    for d in ("fedpower_app", "strategies", "client_app", "server_app", "conf"):
        shutil.copytree(PROJECT_ROOT / d, app / d, ignore=shutil.ignore_patterns("__pycache__"))
    for f in ("pyproject.toml", "LICENSE", ".gitignore"):
        shutil.copy(PROJECT_ROOT / f, app / f)
    # ~12 MB of incompressible JSON, like an audit's row lists: alone it would exceed the 10 MB limit
    rng = random.Random(0)
    run = app / "results" / "audit" / "x" / "runs" / "run000"
    run.mkdir(parents=True)
    (run / "train-rows.json").write_text(json.dumps({"rows": [rng.getrandbits(64) for _ in range(600_000)]}))
    (app / "results" / "audit" / "x" / "report.md").write_text("# report\n")
    names = _fab_names(app)  # raises if the FAB is over the limit
    assert "client_app/app.py" in names
    assert not any(n.startswith("results/") for n in names)
