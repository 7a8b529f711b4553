"""The documents answer a reader: every relative link and ``#anchor`` in the Markdown resolves, no
file name, comment, preset or doc carries a work-item number, every research script says in one
line what it measures and is cited by RESULTS.md or BENCHMARKS.md, and every results folder is
cited by one of them."""

import re
import unicodedata
from pathlib import Path

import pytest

from fedpower_app.config import PROJECT_ROOT

SKIP_DIRS = {".git", ".venv", "venv", "__pycache__", ".pytest_cache", "outputs", "build", "dist",
             "bench-results", "flwr-home", ".ci-flwr-home", ".ci-venv", ".ci-cache", ".cache",
             "node_modules", "docker"}
TEXT_SUFFIXES = {".py", ".md", ".toml", ".sh", ".txt", ".cfg", ".ini", ".yml", ".yaml"}
TEXT_NAMES = {"Dockerfile", ".gitignore", ".dockerignore", "run"}


def _walk(root: Path, skip_results: bool = True):
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(PROJECT_ROOT)
        if any(p in SKIP_DIRS or p.endswith(".egg-info") for p in rel.parts[:-1]):
            continue
        if skip_results and rel.parts and rel.parts[0] == "results":
            continue
        yield path


def _markdown_files():
    return [p for p in _walk(PROJECT_ROOT) if p.is_file() and p.suffix == ".md"]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading keeps its text
    text = text.lower()
    out = []
    for ch in text:
        if ch in " -_" or unicodedata.category(ch)[0] in "LN":
            out.append("-" if ch == " " else ch)
    return "".join(out)


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_fence = False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
            continue
        m = None if in_fence else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def links(path: Path):
    in_fence = False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
            continue
        if in_fence or line.startswith("    "):
            continue
        line = re.sub(r"`[^`]*`", "", line)
        for m in LINK.finditer(line):
            yield n, m.group(1)


def test_slug_follows_github():
    assert slug("What does privacy cost, and where does the gap come from?") == \
        "what-does-privacy-cost-and-where-does-the-gap-come-from"
    assert slug("The paper's tables (1–3)") == "the-papers-tables-13"
    assert slug("0.1 DP-SGD on the silos: the guarantee") == "01-dp-sgd-on-the-silos-the-guarantee"
    assert slug("Where `dp.noise-at` goes") == "where-dpnoise-at-goes"


def test_every_relative_link_and_anchor_in_the_markdown_resolves():
    files = _markdown_files()
    assert any(p.name == "RESULTS.md" for p in files)
    broken = []
    checked = 0
    for path in files:
        for n, target in links(path):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(PROJECT_ROOT)}:{n}: {target}"
            checked += 1
            if not dest.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{where} (no such anchor)")
    assert checked > 20
    assert not broken, "\n".join(broken)


# Built so that this file does not match itself.
WORK_ITEM = re.compile(r"(?i)\bissues?[ _-]*#?[ ]*\d+|(?<![\w/&(])#\d+\b|\bgrid\s+#\d+")
WORK_ITEM_NAME = re.compile(r"(?i)issue[_-]?\d+")


def _text_files():
    for path in _walk(PROJECT_ROOT):
        if path.is_file() and (path.suffix in TEXT_SUFFIXES or path.name in TEXT_NAMES):
            yield path


def test_no_work_item_numbers_in_the_product_docs_or_conf():
    hits = []
    for path in _text_files():
        if path.name == Path(__file__).name:
            continue
        rel = path.relative_to(PROJECT_ROOT)
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for m in WORK_ITEM.finditer(line):
                hits.append(f"{rel}:{n}: {m.group(0)!r}")
    assert not hits, "\n".join(hits)


def test_no_work_item_numbers_in_file_or_folder_names():
    names = [p.relative_to(PROJECT_ROOT) for p in _walk(PROJECT_ROOT, skip_results=False)]
    bad = [str(p) for p in names if WORK_ITEM_NAME.search(p.name)]
    assert not bad, bad


def _cited_text() -> str:
    return (PROJECT_ROOT / "RESULTS.md").read_text() + (PROJECT_ROOT / "BENCHMARKS.md").read_text()


def test_every_research_script_is_cited_and_says_what_it_measures():
    import ast

    cited = _cited_text()
    scripts = sorted(p for p in (PROJECT_ROOT / "research").glob("*.py") if p.name != "__init__.py")
    assert scripts
    for path in scripts:
        doc = ast.get_docstring(ast.parse(path.read_text()))
        assert doc and doc.split("\n\n")[0].strip() and "\n" not in doc.split("\n\n")[0].strip(), \
            f"{path.name}: its docstring does not open with one line saying what it measures"
        name = path.stem
        assert f"research.{name}" in cited or f"research/{name}.py" in cited, \
            f"research/{path.name} is cited by neither RESULTS.md nor BENCHMARKS.md"


@pytest.mark.parametrize("top", ["results", "benchmarks/results"])
def test_every_results_folder_is_cited(top):
    cited = _cited_text()
    root = PROJECT_ROOT / top
    if not root.exists():
        pytest.skip(f"no {top}/")
    missing = []
    for path in sorted(root.iterdir()):
        if path.name.startswith("."):
            continue
        rel = str(path.relative_to(PROJECT_ROOT))
        if not re.search(rf"(?<![\w.-]){re.escape(path.name)}(?![\w.-])", cited):
            missing.append(rel)
        # a folder of single runs: each run is cited by name too
        for run in sorted(path.glob("*/results.json")) if path.is_dir() else []:
            name = run.parent.name
            if not re.search(rf"(?<![\w.-]){re.escape(name)}(?![\w.-])", cited):
                missing.append(str(run.parent.relative_to(PROJECT_ROOT)))
    assert not missing, missing


def test_every_test_a_document_names_exists():
    """docs/privacy.md names a test for each claim; every ``tests/x.py`` and ``tests/x.py::name``
    that a Markdown file names exists."""
    missing = []
    named = 0
    for path in _markdown_files():
        for m in re.finditer(r"tests/(test_\w+\.py)(?:::(\w+))?", path.read_text()):
            named += 1
            target = PROJECT_ROOT / "tests" / m.group(1)
            if not target.exists():
                missing.append(f"{path.name}: {m.group(0)}")
            elif m.group(2) and not re.search(rf"(?m)^(?:async )?def {m.group(2)}\(", target.read_text()):
                missing.append(f"{path.name}: {m.group(0)}")
    assert named > 20
    assert not missing, missing


def _config_rows() -> dict:
    text = (PROJECT_ROOT / "docs" / "configuration.md").read_text()
    rows: dict = {}
    for m in re.finditer(r"^\| `([a-z0-9.\-]+)` \| ([^|]*) \| ([^|]*) \| (.*) \|$", text, flags=re.M):
        assert m.group(1) not in rows, f"{m.group(1)} documented twice"
        rows[m.group(1)] = (m.group(2).strip(), m.group(3).strip(), m.group(4))
    return rows


def _choices(check):
    """The choice list of a ``config._in(...)`` validator (its closure), or None."""
    if check is None or check.__code__.co_freevars != ("choices",):
        return None
    return tuple(check.__closure__[0].cell_contents)


def test_the_configuration_page_is_the_schema():
    """docs/configuration.md documents every key of the schema once, with its type, its default
    (pyproject.toml) and every value of its choice list; and no key the schema does not have."""
    from fedpower_app.config import SCHEMA, pyproject_defaults

    rows = _config_rows()
    defaults = pyproject_defaults()
    assert set(rows) == set(SCHEMA), set(rows) ^ set(SCHEMA)
    wrong = []
    for key, (typ, check) in SCHEMA.items():
        doc_type, doc_default, meaning = rows[key]
        if doc_type != typ.__name__:
            wrong.append(f"{key}: type {doc_type!r}, schema {typ.__name__!r}")
        want = defaults[key]
        if typ is bool:
            ok = doc_default == str(want).lower()
        elif typ is str:
            ok = doc_default == (f"`{want}`" if want else '`""`')
        elif typ is int:
            ok = re.fullmatch(r"-?\d+", doc_default) is not None and int(doc_default) == want
        else:
            ok = re.fullmatch(r"-?[\d.]+(e-?\d+)?", doc_default) is not None and float(doc_default) == want \
                and not re.fullmatch(r"-?\d+", doc_default)
        if not ok:
            wrong.append(f"{key}: default {doc_default!r}, pyproject {want!r}")
        for choice in _choices(check) or ():
            if f"`{choice}`" not in meaning:
                wrong.append(f"{key}: choice {choice!r} not documented")
    assert not wrong, "\n".join(wrong)
