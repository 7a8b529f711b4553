"""A silo's own data: the files a SuperNode reads from its own directory (node config ``data-dir``).

In a deployment every silo may hold its own rows, of its own size and label mix, instead of a slice
of one shared set: ``flower-supernode --node-config 'data-dir="/data/silo" silo-id=3'``. The silo
then trains on *all* of its training split; the server learns only n_k (the size query), never a
path or a row.

The directory is a GLUE task folder (or its parent) in the format of ``task.name``: for SST-2
``train.tsv`` with the header ``sentence<TAB>label`` and labels 0/1 (or negative/positive);
parquet / CSV exports with the same column names work too (``glue_files``). Only the training split
is required. An evaluation split (``dev.tsv``) is read when present; it is needed only if the run
sends this silo evaluate messages (``eval.fraction-clients`` > 0).

Every problem with the directory or its files raises :class:`SiloDataError` with one line that
names the file (and line) and what was expected: a missing directory, a missing or empty file, a
header without the task's columns, a label outside the task's labels, a file without rows.
"""

from __future__ import annotations

import dataclasses
import logging
from functools import lru_cache
from pathlib import Path

from ..config import RunConfig, parse_config
from .glue_files import _find_task_dir, _match_split, read_split_file
from .glue_tasks import get_task_spec, normalise_task_name
from .types import TaskData, TextExamples

log = logging.getLogger("fedpower")

#: ``num`` of a silo that trains on its own data (the ClientApp's shard key): no partition of a shared set.
OWN_DATA = 0


class SiloDataError(ValueError):
    """A silo's own data cannot be used. The message is complete on one line (file, line, what was
    expected); it is raised without a chained traceback. ``public``, when set, is the same reason
    without any row's line or value: what the silo answers the server (the full line stays in the
    silo's log)."""

    def __init__(self, message: str, public: str | None = None) -> None:
        super().__init__(message)
        self.public = public


def _header_hint(task: str) -> str:
    spec = get_task_spec(task)
    cols = [spec.text_a_columns[0], *(() if spec.text_b_columns is None else (spec.text_b_columns[0],)),
            spec.label_columns[-1]]
    labels = ", ".join(f"{i} or {name}" for i, name in enumerate(spec.label_names))
    return f"a header row {'<TAB>'.join(cols)}, then one example per line (label {labels})"


def _check_file(path: Path, task: str) -> None:
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise SiloDataError(f"silo data: cannot read {path}: {exc.strerror or exc}") from None
    if size == 0:
        raise SiloDataError(f"silo data: {path} is empty (0 bytes); it needs {_header_hint(task)}")
    if size < 4096 and path.suffix.lower() in (".tsv", ".txt", ".csv"):
        with open(path, "rb") as fh:
            if not fh.read().strip():
                raise SiloDataError(f"silo data: {path} is empty (blank lines only); it needs {_header_hint(task)}")


def _read(task: str, paths: list[Path]) -> TextExamples:
    for p in paths:
        _check_file(p, task)
    try:
        examples = read_split_file(task, paths if len(paths) > 1 else paths[0])
    except UnicodeDecodeError as exc:
        raise SiloDataError(f"silo data: {paths[0]} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise SiloDataError(f"silo data: cannot read {exc.filename or paths[0]}: {exc.strerror or exc}") from None
    except ValueError as exc:  # unknown label (file, line), unrecognised header, no header
        hint = "" if "Unknown label" in str(exc) else f"; the file needs {_header_hint(task)}"
        raise SiloDataError(f"silo data: {exc}{hint}") from None
    if not len(examples):
        where = paths[0] if len(paths) == 1 else paths[0].parent
        raise SiloDataError(f"silo data: {where} has a header but no rows; it needs {_header_hint(task)}")
    return examples


def _own_task_name(task: str, data_dir) -> str:
    if str(task).strip().lower() == "text":
        return "text"
    if str(task).strip().lower() == "synthetic":
        raise SiloDataError(
            f"silo data: this silo reads its own files (data-dir {data_dir}), but the run's task.name is "
            "'synthetic', a generated task with no files; run task.name = 'text' (any table, with task.labels), "
            "or a GLUE task ('sst2', 'qnli', 'mnli' or 'qqp') in the format of the silo's files")
    try:
        return normalise_task_name(task)
    except ValueError as exc:
        raise SiloDataError(f"silo data: {exc}") from None


def read_silo_task(task: str, data_dir: str | Path) -> TaskData:
    """The task of one silo's own directory: its whole training split (required) and the evaluation
    splits it holds (optional). Raises :class:`SiloDataError` with a one-line reason."""
    spec = get_task_spec(_own_task_name(task, data_dir))
    root = Path(str(data_dir).strip()).expanduser()
    if not str(data_dir).strip():
        raise SiloDataError("silo data: the node config data-dir is empty; give the directory of this silo's files")
    if not root.exists():
        raise SiloDataError(f"silo data: data-dir {root} does not exist on this silo (node config of this "
                            f"SuperNode); expected a directory holding {spec.split_files['train'][0]} "
                            f"(or a {spec.folder_names[0]} folder with it)")
    if not root.is_dir():
        raise SiloDataError(f"silo data: data-dir {root} is not a directory")
    try:
        task_dir = _find_task_dir(spec, root)
    except OSError as exc:
        raise SiloDataError(f"silo data: {exc}") from None
    train_paths = _match_split(spec, task_dir, "train")
    if not train_paths:
        raise SiloDataError(f"silo data: no training file in {task_dir}: expected {spec.split_files['train'][0]} "
                            f"(or train.parquet / train.csv) with {_header_hint(spec.name)}")
    train = _read(spec.name, train_paths)
    evals = {}
    for split in spec.eval_splits:
        paths = _match_split(spec, task_dir, split)
        if paths:
            evals[split] = _read(spec.name, paths)
    return TaskData(name=spec.name, num_labels=spec.num_labels, train=train, eval_splits=evals,
                    label_names=list(spec.label_names))


@lru_cache(maxsize=4)
def load_own_task(task: str, data_dir: str, *, max_train: int = 0, max_eval: int = 0, seed: int = 0) -> TaskData:
    """:func:`read_silo_task`, capped like a shared set (``task.max-train``, ``task.max-eval``) and
    cached per process (in a deployment every message is a fresh process: files are re-read)."""
    return _capped(read_silo_task(task, data_dir), max_train, max_eval, seed)


def read_silo_text_task(spec, data_dir: str | Path) -> TaskData:
    """A ``text`` task's silo: its own directory's training file (required) and evaluation file
    (optional). Raises :class:`SiloDataError` whose ``public`` reason names no row."""
    from .text_files import TextDataError, read_text_dir

    if not str(data_dir).strip():
        raise SiloDataError("silo data: the node config data-dir is empty; give the directory of this silo's files")
    try:
        return read_text_dir(data_dir, spec, need_eval=False)
    except TextDataError as exc:
        raise SiloDataError(f"silo data: {exc}", f"silo data unusable: {exc.public} (the line and column are in "
                            "this silo's log)") from None
    except OSError as exc:
        raise SiloDataError(f"silo data: cannot read {exc.filename or data_dir}: {exc.strerror or exc}",
                            "silo data unusable: a file cannot be read (see this silo's log)") from None


@lru_cache(maxsize=4)
def load_own_text_task(spec, data_dir: str, *, max_train: int = 0, max_eval: int = 0, seed: int = 0) -> TaskData:
    """:func:`read_silo_text_task`, capped and cached as :func:`load_own_task`."""
    return _capped(read_silo_text_task(spec, data_dir), max_train, max_eval, seed)


def _capped(data: TaskData, max_train: int, max_eval: int, seed: int) -> TaskData:
    """``data`` cut like a shared set (``task.max-train``, ``task.max-eval``; 0 = all)."""
    if max_train or max_eval:
        from .glue import subsample_examples

        data = dataclasses.replace(
            data, train=subsample_examples(data.train, max_train or None, seed, "train"),
            eval_splits={s: subsample_examples(e, max_eval or None, seed, s) for s, e in data.eval_splits.items()})
    return data


def silo_task(cfg: RunConfig) -> TaskData:
    """The task of a silo's own data, ``cfg`` being :func:`own_data`'s (its ``task.data-dir`` is the
    silo's directory)."""
    if cfg["task.name"] == "text":
        from .text_files import text_spec

        return load_own_text_task(text_spec(cfg), cfg["task.data-dir"], max_train=cfg["task.max-train"],
                                  max_eval=cfg["task.max-eval"], seed=cfg["seed"])
    return load_own_task(cfg["task.name"], cfg["task.data-dir"], max_train=cfg["task.max-train"],
                         max_eval=cfg["task.max-eval"], seed=cfg["seed"])


def own_data(cfg: RunConfig, data_dir) -> tuple[RunConfig, TaskData]:
    """(the run configuration as this silo reads it, its task) for a SuperNode with node config
    ``data-dir``: ``task.data-dir`` becomes the silo's own directory. A bad directory or file raises
    :class:`SiloDataError`, whose one-line reason is also logged on the silo."""
    try:
        _own_task_name(cfg["task.name"], data_dir)  # before the config check, which names only the run config
        # the silo's own files replace the run's source of rows (a simulation's hub dataset included)
        silo_cfg = parse_config({**cfg.to_dict(), "task.data-dir": str(data_dir).strip(), "task.dataset": ""})
        return silo_cfg, silo_task(silo_cfg)
    except SiloDataError as exc:
        log.error("%s", exc)
        if exc.public:  # the server hears the reason, not the row
            raise SiloDataError(exc.public) from None
        raise


def silo_id(node_config) -> int:
    """Node config ``silo-id`` (default 0): how this silo names itself to the server (the partition id
    of its size reply: the population order, a restarted silo's place, a seeded run's streams)."""
    raw = node_config.get("silo-id", 0)
    try:
        value = int(raw)
        if isinstance(raw, bool) or value != float(raw) or value < 0:
            raise ValueError
    except (TypeError, ValueError):
        message = f"silo data: node config silo-id must be an integer >= 0, got {raw!r}"
        log.error("%s", message)
        raise SiloDataError(message) from None
    return value


def silo_shard(cfg: RunConfig, tokenizer):
    """The tokenised training split of a silo's own data: all of it is the silo's shard."""
    from .pipeline import cache_dir, tokenized_cached

    task = silo_task(cfg)
    from .pipeline import text_task_key

    key = {"task": task.name, "split": "train", "own-data": cfg["task.data-dir"], "seed": cfg["seed"],
           "max_len": cfg["task.max-length"], "max_train": cfg["task.max-train"], **text_task_key(cfg)}
    return tokenized_cached(task.train, tokenizer, cfg["task.max-length"], cache_dir(cfg), key)


def silo_eval_split(cfg: RunConfig, tokenizer):
    """The silo's own primary evaluation split, tokenised; a silo without one cannot evaluate."""
    from .pipeline import cache_dir, tokenized_cached

    task = silo_task(cfg)
    if not task.eval_splits:
        expected = ("validation.csv / .tsv / .jsonl / .parquet" if task.name == "text" else
                    (lambda spec: spec.split_files[spec.eval_splits[0]][0])(get_task_spec(task.name)))
        raise SiloDataError(
            f"silo data: {cfg['task.data-dir']} holds no evaluation split ({expected}), "
            "so this silo cannot answer evaluate messages; run with eval.fraction-clients = 0 (central evaluation "
            "on the server's own data) or give the silo one")
    name, examples = next(iter(task.eval_splits.items()))
    from .pipeline import text_task_key

    key = {"task": task.name, "split": name, "own-data": cfg["task.data-dir"], "seed": cfg["seed"],
           "max_len": cfg["task.max-length"], "max_eval": cfg["task.max-eval"], **text_task_key(cfg)}
    return tokenized_cached(examples, tokenizer, cfg["task.max-length"], cache_dir(cfg), key)
