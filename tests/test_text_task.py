"""The generic text-classification task (``task.name = "text"``): any table in CSV, TSV, JSON Lines
or Parquet with configured columns and declared labels; one-line errors naming the file, line and
column; a silo that refuses without naming a row; a Hugging Face dataset through flwr-datasets
(offline: a local directory that ``datasets.load_dataset`` reads); whole runs in process."""

from __future__ import annotations

import csv
import json
import logging
import time
from pathlib import Path

import pytest

from fedpower_app.config import ConfigError, parse_config
from fedpower_app.data.text_files import TextDataError, TextTaskSpec, parse_labels, read_text_dir, read_text_file

NAMES = ("negative", "positive")
SPEC = TextTaskSpec(text_column="review", label_column="sentiment", labels=NAMES)
PAIR = TextTaskSpec(text_column="premise", label_column="label", labels=("0", "1", "2"), pair_column="hypothesis")


def rows(n: int, seed: int = 1) -> list[tuple[str, int]]:
    from fedpower_app.data.synthetic import make_examples

    ex = make_examples(n, seed=seed)
    return list(zip(ex.text_a, ex.labels))


def write(path: Path, data: list[dict], fmt: str | None = None) -> Path:
    """``data`` (dicts of one shape) as a CSV, TSV, JSON Lines or Parquet file, by suffix."""
    fmt = fmt or path.suffix.lstrip(".")
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "csv":
        with open(path, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(data[0]))
            w.writeheader()
            w.writerows(data)
    elif fmt == "tsv":  # no quoting: a field holds no tab
        path.write_text("".join("\t".join(map(str, r)) + "\n" for r in [list(data[0]), *[r.values() for r in data]]))
    elif fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in data))
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(data), path)
    return path


def review_rows(n: int, seed: int = 1, *, names=NAMES) -> list[dict]:
    return [{"id": i, "review": t, "sentiment": names[y]} for i, (t, y) in enumerate(rows(n, seed))]


@pytest.mark.parametrize("fmt", ["csv", "tsv", "jsonl", "parquet"])
def test_every_format_reads_the_same_rows(tmp_path, fmt):
    data = review_rows(30)
    data[3]["review"] = 'a "quoted", comma film' if fmt != "tsv" else 'a "quoted" film'
    ex = read_text_file(write(tmp_path / f"train.{fmt}", data), SPEC)
    assert ex.text_a == [r["review"] for r in data]
    assert ex.labels == [NAMES.index(r["sentiment"]) for r in data] and ex.text_b is None


def test_pairs_and_integer_labels_in_any_spelling(tmp_path):
    data = [{"premise": f"p{i}", "hypothesis": f"h{i}", "label": y} for i, y in enumerate([0, 1, 2, 1.0, "2", "0.0"])]
    for fmt in ("csv", "jsonl", "parquet"):
        if fmt == "parquet":  # one type per column
            data = [{**r, "label": str(r["label"])} for r in data]
        ex = read_text_file(write(tmp_path / f"pairs.{fmt}", data), PAIR)
        assert ex.labels == [0, 1, 2, 1, 2, 0], fmt
        assert ex.text_b == [f"h{i}" for i in range(6)]


def test_the_declared_order_gives_the_label_index(tmp_path):
    path = write(tmp_path / "t.csv", review_rows(20))
    flipped = read_text_file(path, TextTaskSpec("review", "sentiment", ("positive", "negative")))
    straight = read_text_file(path, SPEC)
    assert [1 - y for y in straight.labels] == flipped.labels


def test_declared_labels_are_checked():
    assert parse_labels(" a , b,c ") == ("a", "b", "c")
    for raw, why in [("", "is empty"), ("a", "at least 2"), ("a,,b", "empty label"), ("a,b,a", "more than once")]:
        with pytest.raises(ValueError, match=why):
            parse_labels(raw)
    with pytest.raises(ConfigError, match="'task.labels' is empty"):
        parse_config({"task.name": "text", "task.data-dir": "/x"})
    with pytest.raises(ConfigError, match="exclusive"):
        parse_config({"task.name": "text", "task.labels": "a,b", "task.data-dir": "/x", "task.dataset": "imdb"})
    with pytest.raises(ConfigError, match="task.dataset' needs task.name = 'text'"):
        parse_config({"task.dataset": "imdb"})
    with pytest.raises(ConfigError, match="needs task.dirichlet-alpha > 0"):
        parse_config({"task.partitioner": "dirichlet"})


def bad_files(tmp_path: Path) -> dict[str, tuple[Path, TextTaskSpec, list[str]]]:
    """name -> (file, spec, what the one-line message must say)."""
    cases = {}
    p = write(tmp_path / "unknown.csv", review_rows(5))
    lines = p.read_text().splitlines()
    lines[3] = lines[3].rsplit(",", 1)[0] + ",positve"
    p.write_text("\n".join(lines) + "\n")
    cases["unknown label"] = (p, SPEC, [f"{p}:4: column 3 ('sentiment'): unknown label 'positve'", "negative, positive"])
    p = write(tmp_path / "nocol.csv", [{"text": "x", "sentiment": "positive"}])
    cases["missing column"] = (p, SPEC, [f"{p}:1: no column 'review' (task.text-column)", "['text', 'sentiment']"])
    p = tmp_path / "empty.csv"
    p.write_text("")
    cases["empty file"] = (p, SPEC, [f"{p}: the file is empty (0 bytes)"])
    p = tmp_path / "blank.jsonl"
    p.write_text("\n \n")
    cases["blank file"] = (p, SPEC, [f"{p}: the file is empty (blank lines only)"])
    p = tmp_path / "broken.jsonl"
    p.write_text('{"review": "fine", "sentiment": "positive"}\n{"review": "oops" "sentiment": 1}\n')
    cases["unparseable JSON"] = (p, SPEC, [f"{p}:2:19: not valid JSON (Expecting ',' delimiter)"])
    p = tmp_path / "list.jsonl"
    p.write_text('["fine", "positive"]\n')
    cases["JSON not an object"] = (p, SPEC, [f"{p}:1:1: a JSON Lines row must be an object"])
    p = tmp_path / "fields.csv"
    p.write_text("review,sentiment\na fine film,positive\na fine, long film,positive\n")
    cases["unquoted comma"] = (p, SPEC, [f"{p}:3: 3 field(s) where the header has 2", "quote the field"])
    p = tmp_path / "latin1.tsv"
    p.write_bytes("review\tsentiment\nfine\tpositive\ncaf\xe9\tpositive\n".encode("latin-1"))
    cases["not UTF-8"] = (p, SPEC, [f"{p}:3:4: not UTF-8 text"])
    p = tmp_path / "garbage.parquet"
    p.write_bytes(b"this is not parquet at all")
    cases["not Parquet"] = (p, SPEC, [f"{p}: not a readable Parquet file"])
    p = write(tmp_path / "badlabel.parquet", [{"review": "x", "sentiment": "positive"}, {"review": "y", "sentiment": "meh"}])
    cases["unknown label in Parquet"] = (p, SPEC, [f"{p}: row 2, column 'sentiment': unknown label 'meh'"])
    p = tmp_path / "allempty.csv"
    p.write_text("review,sentiment\n,positive\nfine,\n")
    cases["no usable rows"] = (p, SPEC, [f"{p}: no usable rows (all 2 skipped: empty cells)"])
    p = tmp_path / "train.xlsx"
    p.write_text("x")
    cases["unsupported type"] = (p, SPEC, ["unsupported file type '.xlsx'"])
    return cases


CASES = ["unknown label", "missing column", "empty file", "blank file", "unparseable JSON", "JSON not an object",
         "unquoted comma", "not UTF-8", "not Parquet", "unknown label in Parquet", "no usable rows", "unsupported type"]


@pytest.mark.parametrize("case", CASES)
def test_bad_rows_fail_with_one_line_naming_file_line_and_column(tmp_path, case):
    path, spec, expected = bad_files(tmp_path)[case]
    with pytest.raises(TextDataError) as info:
        read_text_file(path, spec)
    message = str(info.value)
    assert "\n" not in message
    for part in expected:
        assert part in message, (part, message)
    public = info.value.public  # what a silo tells the server: the file's name and the problem, no row
    assert "\n" not in public and str(path.parent) not in public and ":2" not in public and "positve" not in public


def test_skipped_rows_are_said_with_their_lines(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(logging.getLogger("fedpower"), "propagate", True)
    p = tmp_path / "t.csv"
    p.write_text("review,sentiment\nfine,positive\n,negative\nbad,negative\ngood,\n  ,positive\n")
    with caplog.at_level(logging.WARNING, logger="fedpower"):
        ex = read_text_file(p, SPEC)
    assert ex.text_a == ["fine", "bad"]
    said = [r.getMessage() for r in caplog.records]
    assert f"{p}: skipped 2 row(s) with empty 'review' (lines 3, 6)" in said
    assert f"{p}: skipped 1 row(s) with empty 'sentiment' (lines 5)" in said


def test_a_directory_names_its_split_files(tmp_path):
    d = tmp_path / "d"
    write(d / "train.jsonl", review_rows(12))
    write(d / "dev.csv", review_rows(5, 2))
    task = read_text_dir(d, SPEC, need_eval=True)
    assert len(task.train) == 12 and list(task.eval_splits) == ["validation"] and len(task.eval_splits["validation"]) == 5
    assert task.num_labels == 2 and task.label_names == list(NAMES)
    write(d / "train.csv", review_rows(3))
    with pytest.raises(TextDataError, match="train.csv and train.jsonl both hold the train split"):
        read_text_dir(d, SPEC, need_eval=True)
    server = tmp_path / "server"  # evaluation only: no training rows needed
    write(server / "validation.parquet", review_rows(7))
    assert len(read_text_dir(server, SPEC, need_eval=True).train) == 0
    with pytest.raises(TextDataError, match="no training file"):
        read_text_dir(server, SPEC, need_eval=False)
    with pytest.raises(TextDataError, match="does not exist"):
        read_text_dir(tmp_path / "nowhere", SPEC, need_eval=False)


# ------------------------------------------------------------------------------------------
# a silo's own files
# ------------------------------------------------------------------------------------------

TEXT_KEYS = {"task.name": "text", "task.text-column": "review", "task.label-column": "sentiment",
             "task.labels": "negative,positive"}


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from .tiny_bert import save_tiny_bert

    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert"), num_layers=2)


def test_a_silo_refuses_bad_rows_without_naming_a_row(tmp_path, tiny_model_dir, caplog, monkeypatch):
    from .test_silo_data import _query

    monkeypatch.setattr(logging.getLogger("fedpower"), "propagate", True)
    run_config = parse_config({**TEXT_KEYS, "model.name": tiny_model_dir, "task.max-length": 16,
                               "task.cache-dir": str(tmp_path / "cache")}).to_dict()
    silo = tmp_path / "silo"
    data = review_rows(20)
    data[6]["sentiment"] = "secret-label"
    write(silo / "train.csv", data)
    reply = _query(run_config, {"data-dir": str(silo)})
    assert reply.has_error()
    reason = reply.error.reason
    assert "silo data unusable: train.csv: a row has a label that task.labels does not declare" in reason
    assert "secret-label" not in reason and ":8" not in reason and str(silo) not in reason
    logged = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert any(f"{silo / 'train.csv'}:8: column 3 ('sentiment'): unknown label 'secret-label'" in m for m in logged)
    good = tmp_path / "good"
    write(good / "train.tsv", review_rows(23))
    reply = _query(run_config, {"data-dir": str(good), "silo-id": 2, "dp-max-epsilon": 8, "send-shard-size": "true"})
    assert not reply.has_error(), reply.error.reason
    assert reply.content.metric_records["metrics"]["num-examples"] == 23


# ------------------------------------------------------------------------------------------
# whole runs
# ------------------------------------------------------------------------------------------


def test_a_whole_run_on_local_files(tmp_path, tiny_model_dir):
    from .test_app_inprocess import run_inprocess

    d = tmp_path / "data"
    write(d / "train.csv", review_rows(96))
    write(d / "validation.jsonl", review_rows(40, 7))
    res, run_dir = run_inprocess(tmp_path, **{**TEXT_KEYS, "task.data-dir": str(d), "model.name": tiny_model_dir,
                                              "num-server-rounds": 2, "task.max-length": 16, "lora.rank": 4,
                                              "task.metric": "balanced-accuracy", "task.cache-dir": str(tmp_path / "c")})
    assert res["status"] == "completed" and res["clients"]["dataset_sizes"] == [48, 48]
    last = res["rounds"][-1]
    for key in ("accuracy", "macro-f1", "balanced-accuracy", "majority-accuracy", "majority-macro-f1"):
        assert 0.0 <= last[key] <= 1.0, key
    labels = [r["sentiment"] for r in review_rows(40, 7)]
    assert last["majority-accuracy"] == pytest.approx(max(labels.count(n) for n in NAMES) / 40)
    totals = res["totals"]
    assert totals["lead_metric"] == "balanced-accuracy" and totals["final_lead_metric"] == last["balanced-accuracy"]
    assert json.loads((run_dir / "adapter" / "fedpower.json").read_text())["num_labels"] == 2


def hub_style_dir(root: Path) -> Path:
    """A dataset directory that ``datasets.load_dataset`` reads offline: a train and a test split."""
    write(root / "train.csv", [{"sentence": t, "label": y} for t, y in rows(120, 3)])
    write(root / "test.csv", [{"sentence": t, "label": y} for t, y in rows(40, 4)])
    return root


@pytest.mark.parametrize("partitioner", ["iid", "dirichlet"])
def test_a_whole_run_from_a_dataset_through_flwr_datasets(tmp_path, tiny_model_dir, partitioner):
    from fedpower_app import data as D
    from fedpower_app.data.text_hub import flwr_partition_indices

    from .test_app_inprocess import run_inprocess

    ds = hub_style_dir(tmp_path / "hub-style")
    keys = {"task.name": "text", "task.dataset": str(ds), "task.text-column": "sentence", "task.labels": "0,1",
            "task.partitioner": partitioner, "task.dirichlet-alpha": 1.0 if partitioner == "dirichlet" else 0.0}
    cfg = parse_config(keys)
    task = D.load_task(cfg)
    assert len(task.train) == 120 and list(task.eval_splits) == ["test"] and len(task.eval_splits["test"]) == 40
    shards = [flwr_partition_indices(task.train.labels, 3, i, 0, partitioner, cfg["task.dirichlet-alpha"])
              for i in range(3)]
    assert sorted(i for s in shards for i in s) == list(range(120))  # disjoint, covering
    res, _ = run_inprocess(tmp_path, num_nodes=3, **{**keys, "model.name": tiny_model_dir, "num-server-rounds": 1,
                                                     "task.max-length": 16, "lora.rank": 4, "train.batch-size": 8,
                                                     "task.cache-dir": str(tmp_path / "c")})
    assert res["status"] == "completed"
    assert sum(res["clients"]["dataset_sizes"]) == 120
    if partitioner == "iid":
        assert res["clients"]["dataset_sizes"] == [40, 40, 40]


def test_a_hub_id_without_network_fails_fast_with_one_line(monkeypatch):
    import os
    import subprocess
    import sys

    from fedpower_app.data import text_hub

    # offline mode, as a process starts with it (datasets reads it at import): an answer at once
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    code = ("from fedpower_app.data import text_hub\n"
            "try:\n    text_hub.fetch_splits('someone/not-cached-anywhere')\n"
            "except RuntimeError as exc:\n    print(exc)\n")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert time.monotonic() - t0 < 60
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1 and "task.dataset 'someone/not-cached-anywhere': cannot load it from the Hugging Face " \
        "hub: ConnectionError" in lines[0] and "OfflineModeIsEnabled" in lines[0], out
    # offline mode off and no network (an endpoint nobody answers): the check answers within its timeout
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    spec = TextTaskSpec("sentence", "label", ("0", "1"))
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"no answer from http://127.0.0.1:9 within") as info:
        text_hub.load_text_hub(spec, "someone/another-dataset")
    assert time.monotonic() - t0 < text_hub.HUB_TIMEOUT_S + 5 and "\n" not in str(info.value)


# ------------------------------------------------------------------------------------------
# metrics
# ------------------------------------------------------------------------------------------


def test_metrics_match_scikit_learn_and_the_majority_baseline():
    import torch
    from sklearn.metrics import balanced_accuracy_score, f1_score

    from fedpower_app.training.metrics import confusion, scores

    gen = torch.Generator().manual_seed(0)
    y = torch.cat([torch.zeros(90, dtype=torch.long), torch.ones(10, dtype=torch.long), torch.full((5,), 2)])
    for pred in (torch.randint(0, 3, (105,), generator=gen), torch.zeros(105, dtype=torch.long), y.clone()):
        s = scores(confusion(pred, y, 3))
        assert s["accuracy"] == pytest.approx(float((pred == y).double().mean()))
        assert s["macro-f1"] == pytest.approx(f1_score(y, pred, average="macro"))
        assert s["balanced-accuracy"] == pytest.approx(balanced_accuracy_score(y, pred))
        base = scores(confusion(torch.zeros(105, dtype=torch.long), y, 3))
        assert s["majority-accuracy"] == base["accuracy"] == pytest.approx(90 / 105)
        assert s["majority-macro-f1"] == pytest.approx(base["macro-f1"])
    # the always-majority model: accuracy flatters it, the other two do not
    s = scores(confusion(torch.zeros(105, dtype=torch.long), y, 3))
    assert s["accuracy"] > 0.85 and s["balanced-accuracy"] == pytest.approx(1 / 3) and s["macro-f1"] < 0.35


def make_text_silos(root: Path) -> tuple[list[Path], Path, dict]:
    """Three silos of the generic text task with files of their own shapes, of the sizes of
    ``test_silo_data.SIZES`` (one label-skewed): a CSV, a JSON Lines file with extra fields, a
    Parquet file with its columns in another order; and the server's own evaluation file. Returns
    (silo directories, the server's directory, the run config's task keys)."""
    from .test_silo_data import SIZES

    def labelled(n, seed, positive_share=None):
        pairs = rows(4 * n + 64, seed)
        if positive_share is not None:
            pos, neg = [p for p in pairs if p[1] == 1], [p for p in pairs if p[1] == 0]
            k = round(n * positive_share)
            pairs = pos[:k] + neg[:n - k]
        return pairs[:n]

    silos = [root / f"silo-{k}" for k in range(3)]
    write(silos[0] / "train.csv", [{"review": t, "sentiment": NAMES[y]} for t, y in labelled(SIZES[0], 100)])
    write(silos[1] / "train.jsonl", [{"id": i, "sentiment": NAMES[y], "review": t, "source": "web"}
                                     for i, (t, y) in enumerate(labelled(SIZES[1], 101))])
    write(silos[2] / "train.parquet", [{"sentiment": NAMES[y], "stars": 5 * y, "review": t}
                                       for t, y in labelled(SIZES[2], 102, positive_share=0.9)])
    server = root / "server-eval"
    write(server / "validation.csv", [{"review": t, "sentiment": NAMES[y]} for t, y in labelled(64, 300)])
    return silos, server, dict(TEXT_KEYS)


def test_three_silos_with_differently_shaped_files_in_process(tmp_path, tiny_model_dir):
    """The walkthrough's run through the in-process grid (the deployment itself is
    test_deployment.py::test_silos_with_their_own_csv_jsonl_and_parquet_files, slow suite)."""
    from client_app.app import app as client_app
    from fedpower_app.runs.inprocess_grid import InProcessGrid
    from fedpower_app.runs.results import ResultsWriter
    from server_app import app as server

    from .test_silo_data import SIZES, _context, check_server_view, check_silo_ledgers, silo_node_config

    silos, server_dir, keys = make_text_silos(tmp_path / "sites")
    cfg = parse_config({**keys, "task.data-dir": str(server_dir), "model.name": tiny_model_dir,
                        "task.max-length": 16, "task.cache-dir": str(tmp_path / "server-cache"), "lora.rank": 4,
                        "num-server-rounds": 2, "train.local-steps": 2, "train.batch-size": 16,
                        "strategy.min-nodes": 3, "dp.noise-at": "silo", "task.metric": "macro-f1",
                        "output-dir": str(tmp_path / "out"), "run-name": "own-files"})
    grid = InProcessGrid(client_app, 3, cfg.to_dict())
    for k, node in enumerate(grid.get_node_ids()):
        grid._contexts[node] = _context(cfg.to_dict(), silo_node_config(silos[k], k), node)
    run_dir = server.run_directory(cfg)
    server._run(grid, cfg, run_dir, ResultsWriter(run_dir, cfg.to_dict()))
    results = json.loads((run_dir / "results.json").read_text())
    assert results["status"] == "completed" and results["clients"]["dataset_sizes"] == sorted(SIZES)
    assert str(tmp_path / "sites" / "silo-") not in json.dumps(results)
    rows_ = check_silo_ledgers(silos, rounds=2, local_steps=2, batch_size=16)
    check_server_view(results, rows_)
    assert results["totals"]["lead_metric"] == "macro-f1"


def test_train_auto_runs_the_plan_in_the_in_process_runner(tmp_path, tiny_model_dir, capsys):
    """benchmarks.inprocess_run (and the grid's in-process cells) run train.auto's plan, as fedpower-run
    does: the run's config holds the plan's settings with train.auto = false, and the lines say why."""
    from benchmarks.inprocess_run import main as inprocess_main
    from fedpower_app.privacy.recommend import recommend

    d = tmp_path / "data"
    write(d / "train.csv", review_rows(600))
    write(d / "validation.csv", review_rows(40, 7))
    preset = tmp_path / "p.toml"
    preset.write_text("")
    sets = {**TEXT_KEYS, "task.data-dir": str(d), "model.name": tiny_model_dir, "task.max-length": 16,
            "lora.rank": 4, "task.cache-dir": str(tmp_path / "c"), "train.auto": True, "train.epochs": 1.0,
            "dp.noise": "seeded"}
    argv = ["--preset", str(preset), "--clients", "3", "--name", "auto", "--out", str(tmp_path / "out")]
    for k, v in sets.items():
        argv += ["--set", f"{k}={json.dumps(v)}" if not isinstance(v, bool) else f"{k}={str(v).lower()}"]
    assert inprocess_main(argv) == 0
    err = capsys.readouterr().err
    assert "train.auto: train.what=" in err and "train.batch-size=" in err
    res = json.loads((tmp_path / "out" / "auto" / "results.json").read_text())
    plan = recommend([200, 200, 200], 8.0, 1e-5, epochs=1.0)
    cfg = res["config"]
    assert res["status"] == "completed" and cfg["train.auto"] is False
    assert (cfg["train.what"], cfg["train.batch-size"], cfg["train.local-steps"], cfg["num-server-rounds"]) == \
        (plan.what, plan.batch_size, plan.local_steps, plan.rounds)
    assert len(res["rounds"]) == plan.rounds
