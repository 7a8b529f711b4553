"""Comments and docs cite sections that exist: every "spec §x" in the product points at
a section of the privacy spec (../shared/docs/privacy-accounting.md), every "docs/privacy.md §x"
at a section of docs/privacy.md."""

import re
from pathlib import Path

import pytest

from fedpower_app.config import PROJECT_ROOT

SPEC = PROJECT_ROOT.parent / "shared" / "docs" / "privacy-accounting.md"
PRODUCT = ("fedpower_app", "strategies", "client_app", "server_app", "benchmarks", "docs", "conf", "tests")


def _sections(path: Path) -> set[str]:
    out = set()
    for line in path.read_text().splitlines():
        m = re.match(r"#+\s+([0-9]+(?:\.[0-9]+)*)[.\s]", line)
        if m:
            out.add(m.group(1))
    return out


def _citations(pattern: str):
    for part in PRODUCT:
        for path in sorted((PROJECT_ROOT / part).rglob("*")):
            if path.suffix not in (".py", ".md", ".toml") or "__pycache__" in path.parts:
                continue
            for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                for m in re.finditer(pattern, line):
                    yield f"{path.relative_to(PROJECT_ROOT)}:{n}", m.group(1).rstrip(".")


def test_docs_privacy_sections_cited_exist():
    have = _sections(PROJECT_ROOT / "docs" / "privacy.md")
    cited = list(_citations(r"privacy\.md\s*§\s*([0-9]+(?:\.[0-9]+)*)"))
    assert cited
    missing = [(where, s) for where, s in cited if s not in have]
    assert not missing, missing


def test_spec_sections_cited_exist():
    if not SPEC.exists():
        pytest.skip(f"the privacy spec is not beside the project ({SPEC})")
    have = _sections(SPEC)
    cited = list(_citations(r"spec\s*(?:§|section)\s*([0-9]+(?:\.[0-9]+)*)"))
    assert cited
    missing = [(where, s) for where, s in cited if s not in have]
    assert not missing, missing
