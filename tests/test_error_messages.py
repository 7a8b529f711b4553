"""Error messages name real run-config keys.

A message that tells the user to set a key that does not exist (the GLUE offline error used to say
`data-dir`; the key is `task.data-dir`) sends them to a dead end. This scans the string literals of
the project's Python sources for names that look like run-config keys and checks each against
``fedpower_app.config.SCHEMA``.

What counts as "looks like a run-config key" (see :func:`candidates`):

* anywhere in a message, docstrings included: ``<section>.<name>`` where ``<section>`` is one of
  the config sections (``task``, ``model``, ``lora``, ``train``, ``eval``, ``strategy``, ``dp``),
  e.g. ``dp.clip``, ``task.data-dir``;
* in a message that talks about keys or setting them (``key``, ``set``, ``--set``, ``run-config``),
  docstrings excepted: any lower-case dotted or hyphenated name that is backticked (`` `data-dir` ``),
  quoted (``'num-server-rounds'``) or follows ``set``/``--set``/``key``.

"Messages" are the literals inside ``raise`` statements and every literal that contains whitespace
(prose: log, print, help and error text, also when built before the ``raise``). Single-word
literals elsewhere (``cfg["dp.clip"]``) are code, not messages.
"""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

import pytest

from fedpower_app.config import SCHEMA, ConfigError, parse_config

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("fedpower_app", "strategies", "client_app", "server_app")

SECTIONS = sorted({key.split(".")[0] for key in SCHEMA if "." in key})
KEYLIKE = re.compile(r"^[a-z][a-z0-9]*(?:[.-][a-z0-9]+)+$")
SECTION_KEY = re.compile(r"(?<![\w./-])(?:%s)\.[a-z][a-z0-9-]*(?![\w(/])" % "|".join(SECTIONS))
KEY_CONTEXT = re.compile(r"\bkeys?\b|--set\b|\bset\b|run[- ]config", re.I)
BACKTICKED = re.compile(r"`([^`\s]+)`")
QUOTED = re.compile(r"""(?<!\w)['"]([^'"\s]+)['"]""")
AFTER_VERB = re.compile(r"""(?:--set|\bset|\bkeys?)\s+['"`]?([a-z][a-z0-9.-]*[a-z0-9])""", re.I)

# Names that look like keys but are not run-config keys, each with the reason.
NOT_RUN_CONFIG = {
    # Flower's simulation (--federation-config) keys, which fedpower-run sets from its own flags.
    "num-supernodes", "client-resources-num-cpus", "client-resources-num-gpus",
    "init-args-num-cpus", "init-args-num-gpus", "init-args-logging-level", "init-args-log-to-driver",
    # grid-file keys of fedpower-experiment (a ClientApp's Ray resources), not run-config keys
    "cpus-per-client", "gpus-per-client",
    # Flower message types of the secure-sum stages, and the train message's secure-sum request
    "train.secagg", "secagg.request",
}
FILE_SUFFIX = re.compile(r"\.(tsv|csv|parquet|json|jsonl|toml|py|txt|md|pt|bin|safetensors|log|db|yaml)$")


def _docstring_nodes(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                out.add(id(first.value))
    return out


def _text(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):  # f-string: formatted values become {}
        return "".join(v.value if isinstance(v, ast.Constant) and isinstance(v.value, str) else "{}"
                       for v in node.values)
    return None


def messages(source: str) -> list[tuple[int, str, bool]]:
    """(line, text, is_docstring) of every message-like string literal in ``source``."""
    tree = ast.parse(source)
    docs = _docstring_nodes(tree)
    in_raise = {id(n) for r in ast.walk(tree) if isinstance(r, ast.Raise) for n in ast.walk(r)}
    parts_of_fstrings = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    out = []
    for node in ast.walk(tree):
        if id(node) in parts_of_fstrings:
            continue
        text = _text(node)
        if text is None:
            continue
        if id(node) in docs:
            out.append((node.lineno, text, True))
        elif id(node) in in_raise or re.search(r"\s", text):
            out.append((node.lineno, text, False))
    return out


def candidates(text: str, docstring: bool = False) -> set[str]:
    """Names in ``text`` that look like run-config keys."""
    found = set(SECTION_KEY.findall(text))
    if not docstring and KEY_CONTEXT.search(text):
        for rx in (BACKTICKED, QUOTED, AFTER_VERB):
            for token in rx.findall(text):
                token = token.rstrip(".,;:)")
                if KEYLIKE.match(token):
                    found.add(token)
    return {t for t in found if not FILE_SUFFIX.search(t) and t not in NOT_RUN_CONFIG}


def unknown_keys(source: str) -> list[tuple[int, str, str]]:
    return sorted((line, key, text) for line, text, doc in messages(source)
                  for key in candidates(text, doc) if key not in SCHEMA)


def project_sources() -> list[Path]:
    files = [f for d in SOURCE_DIRS for f in sorted((ROOT / d).rglob("*.py"))]
    assert len(files) > 10, files
    return files


def test_messages_name_only_real_config_keys():
    problems = []
    checked = 0
    for path in project_sources():
        source = path.read_text(encoding="utf-8")
        checked += sum(len(candidates(t, d)) for _, t, d in messages(source))
        for line, key, text in unknown_keys(source):
            problems.append(f"{path.relative_to(ROOT)}:{line}: {key!r} is not a run-config key: {text[:160]!r}")
    assert not problems, "\n".join(problems)
    assert checked > 50  # the scan really sees the keys the messages mention


@pytest.mark.parametrize("source, bad", [
    # the GLUE offline message before the fix
    ('raise RuntimeError("point the run-config key "\n    "`data-dir` (data_dir=...) at a local GLUE directory")',
     "data-dir"),
    ('raise ConfigError(f"config key \'lora.ranks\' must be >= 1, got {v}")', "lora.ranks"),
    ('msg = "set dp.clipping to a positive value"\nraise ValueError(msg)', "dp.clipping"),
    ('log.warning("no data: use --set task.datadir=...")', "task.datadir"),
    ('def f():\n    """Uses ``strategy.rate`` as the sampling rate."""', "strategy.rate"),
    ('raise ValueError("unknown key `num-server-round`")', "num-server-round"),
])
def test_the_scan_catches_wrong_keys(source, bad):
    assert [key for _, key, _ in unknown_keys(source)] == [bad]


@pytest.mark.parametrize("source", [
    'raise ConfigError("config key \'task.data-dir\' is set but task.name = \'synthetic\'")',
    'raise RuntimeError("set `num-server-rounds` or --set dp.epsilon=3")',
    'raise RuntimeError("in simulation set client-resources-num-gpus > 0")',  # a Flower federation key
    'raise FileNotFoundError("expected train.tsv / dev.tsv in the task folder")',  # file names
    'x = cfg["dp.clip"]',
])
def test_the_scan_accepts_real_keys_and_non_keys(source):
    assert unknown_keys(source) == []


def test_glue_offline_error_names_task_data_dir(monkeypatch):
    """The message a user without network sees: it must point at `task.data-dir`, with a working --set."""
    from fedpower_app.data import glue
    from fedpower_app.launcher import parse_set

    def offline(*args, **kwargs):
        raise OSError("Network is unreachable")

    monkeypatch.setattr(glue, "_fetch_hub_splits", offline)
    with pytest.raises(RuntimeError) as info:
        glue.load_glue_hub("sst2")
    message = str(info.value)
    named = set(BACKTICKED.findall(message))
    assert named == {"task.data-dir"}, message
    assert candidates(message) <= set(SCHEMA), message
    hint = re.search(r"--set (\S+=\S+?);", message)
    assert hint, message
    # as the shell hands it to fedpower-run
    assert parse_set(shlex.split(hint.group(1))) == {"task.data-dir": "/path/to/glue"}


def _bad_value(key: str, typ: type):
    """A value of the wrong type for ``key``."""
    return 7 if typ is str else "not-a-number" if typ in (int, float) else "maybe"


@pytest.mark.parametrize("key", sorted(SCHEMA))
def test_every_config_error_names_its_key(key):
    typ, check = SCHEMA[key]
    with pytest.raises(ConfigError) as info:
        parse_config({key: _bad_value(key, typ)})
    assert repr(key) in str(info.value)
