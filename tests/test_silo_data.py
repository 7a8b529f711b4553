"""Silos with their own data: a SuperNode reads its own directory (node config
``data-dir``), trains on all of it, and a bad directory or file fails on the silo with one clear
line, not a traceback from deep in the loader.

The deployment itself (SuperLink, three SuperNodes, TLS and authentication) is in
``test_deployment.py::test_silos_with_their_own_data`` (slow suite); here the same ClientApp and
ServerApp code paths run through the in-process grid, with a tiny BERT.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict

from fedpower_app.config import parse_config
from fedpower_app.data.silo import SiloDataError, read_silo_task
from fedpower_app.data.synthetic import make_examples

HEADER = "sentence\tlabel\n"


def tsv_rows(n: int, seed: int, *, positive_share: float | None = None) -> str:
    """``n`` SST-2 rows (``sentence<TAB>label``) of the generated task; ``positive_share`` skews the labels."""
    ex = make_examples(4 * n + 64, seed=seed)
    pairs = list(zip(ex.text_a, ex.labels))
    if positive_share is not None:
        pos = [p for p in pairs if p[1] == 1]
        neg = [p for p in pairs if p[1] == 0]
        k = round(n * positive_share)
        pairs = pos[:k] + neg[:n - k]
    return "".join(f"{t}\t{y}\n" for t, y in pairs[:n])


def silo_dir(root: Path, name: str, train: str | None, dev: str | None = None, *, folder: str = "SST-2") -> Path:
    """A silo's directory with its own GLUE SST-2 folder; ``train``/``dev`` are whole file contents."""
    d = root / name / folder
    d.mkdir(parents=True)
    if train is not None:
        (d / "train.tsv").write_text(train)
    if dev is not None:
        (d / "dev.tsv").write_text(dev)
    return root / name


def test_a_silo_reads_all_of_its_own_training_file(tmp_path):
    d = silo_dir(tmp_path, "silo", HEADER + tsv_rows(37, 1))
    task = read_silo_task("sst2", d)
    assert len(task.train) == 37 and task.eval_splits == {}  # dev.tsv is optional on a silo
    assert task.num_labels == 2
    task = read_silo_task("SST-2", silo_dir(tmp_path, "with-dev", HEADER + tsv_rows(20, 1), HEADER + tsv_rows(5, 2)))
    assert len(task.train) == 20 and len(task.eval_splits["validation"]) == 5
    flat = tmp_path / "flat"  # the split files directly in data-dir work too
    flat.mkdir()
    (flat / "train.tsv").write_text(HEADER + tsv_rows(9, 3))
    assert len(read_silo_task("sst2", flat).train) == 9


def bad_input_cases(tmp_path: Path) -> dict[str, tuple[Path, str, list[str]]]:
    """name -> (data-dir, task, what the one-line message must say)."""
    cases = {}
    cases["data-dir does not exist"] = (tmp_path / "no-such-silo", "sst2",
                                        ["data-dir", str(tmp_path / "no-such-silo"), "does not exist", "train.tsv"])
    d = silo_dir(tmp_path, "bad-header", "text\ty\na fine film\t1\n")
    cases["bad header"] = (d, "sst2", ["Unrecognised column layout", str(d / "SST-2" / "train.tsv"),
                                       "['text', 'y']", "sentence<TAB>label"])
    d = silo_dir(tmp_path, "no-header", "a fine film\t1\na dull film\t0\n")
    cases["no header row"] = (d, "sst2", ["found columns ['a fine film', '1']", "header row sentence<TAB>label"])
    d = silo_dir(tmp_path, "csv-not-tsv", "sentence,label\na fine film,1\n")
    cases["comma-separated"] = (d, "sst2", ["found columns ['sentence,label']"])
    d = silo_dir(tmp_path, "bad-label", HEADER + "a fine film\t1\na dull film\t0\nan odd film\t2\n")
    cases["label outside the task's labels"] = (d, "sst2", ["Unknown label '2'", str(d / "SST-2" / "train.tsv"),
                                                            "line 4", "0 / 'negative', 1 / 'positive'"])
    d = silo_dir(tmp_path, "empty", "")
    cases["empty file"] = (d, "sst2", [str(d / "SST-2" / "train.tsv"), "is empty (0 bytes)", "header row"])
    d = silo_dir(tmp_path, "blank", "\n\n")
    cases["blank file"] = (d, "sst2", ["is empty (blank lines only)", str(d / "SST-2" / "train.tsv")])
    d = silo_dir(tmp_path, "header-only", HEADER)
    cases["header but no rows"] = (d, "sst2", [str(d / "SST-2" / "train.tsv"), "has a header but no rows"])
    d = silo_dir(tmp_path, "dev-only", None, HEADER + "a fine film\t1\n")
    cases["no training file"] = (d, "sst2", ["no training file", "train.tsv"])
    d = silo_dir(tmp_path, "bad-dev", HEADER + "a fine film\t1\n", HEADER + "a dull film\tmaybe\n")
    cases["bad evaluation file"] = (d, "sst2", ["Unknown label 'maybe'", "dev.tsv, line 2"])
    d = silo_dir(tmp_path, "latin1", None)
    (d / "SST-2" / "train.tsv").write_bytes(HEADER.encode() + "caf\xe9 film\t1\n".encode("latin-1"))
    cases["not UTF-8"] = (d, "sst2", ["is not UTF-8 text", "train.tsv"])
    f = tmp_path / "a-file"
    f.write_text("x")
    cases["data-dir is a file"] = (f, "sst2", ["is not a directory"])
    d = silo_dir(tmp_path, "fine", HEADER + "a fine film\t1\n")
    cases["synthetic task"] = (d, "synthetic", ["task.name is 'synthetic'", "task.name = 'text'", "'sst2'"])
    cases["wrong task format"] = (d, "qnli", ["No GLUE qnli data"])
    return cases


CASE_NAMES = ["data-dir does not exist", "bad header", "no header row", "comma-separated",
              "label outside the task's labels", "empty file", "blank file", "header but no rows",
              "no training file", "bad evaluation file", "not UTF-8", "data-dir is a file", "synthetic task",
              "wrong task format"]


@pytest.mark.parametrize("case", CASE_NAMES)
def test_bad_silo_data_fails_with_one_clear_line(tmp_path, case):
    data_dir, task, expected = bad_input_cases(tmp_path)[case]
    with pytest.raises(SiloDataError) as info:
        read_silo_task(task, data_dir)
    message = str(info.value)
    assert message.startswith("silo data: ") and "\n" not in message, message
    for part in expected:
        assert part in message, (part, message)
    # raised from the top, not as the last link of a chain of loader exceptions
    assert info.value.__cause__ is None
    assert info.value.__context__ is None or info.value.__suppress_context__


def _context(run_config: dict, node_config: dict, node_id: int = 7) -> Context:
    return Context(run_id=1, node_id=node_id, node_config=node_config, state=RecordDict(), run_config=run_config)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from .tiny_bert import save_tiny_bert

    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert"), num_layers=2)


def _query(run_config: dict, node_config: dict) -> Message:
    """A size query through the real ClientApp, as the runtime delivers it; a raise becomes an error
    reply (the in-process grid does what flwr-clientapp does)."""
    from client_app.app import app as client_app
    from fedpower_app.runs.inprocess_grid import InProcessGrid

    grid = InProcessGrid(client_app, 1, run_config)
    node = grid.get_node_ids()[0]
    grid._contexts[node] = _context(run_config, node_config, node)
    msg = Message(RecordDict({"config": ConfigRecord({"query": "dataset-size"})}), node, MessageType.QUERY)
    return grid.pull_messages(grid.push_messages([msg]))[0]


def test_the_silo_answers_a_bad_data_dir_with_its_one_line_reason(tmp_path, tiny_model_dir, caplog, monkeypatch):
    """Through the ClientApp: the reply the server gets carries the silo's one-line reason, and the
    silo logs that line itself (before Flower's own traceback). A good directory answers its n_k."""
    import logging

    # An earlier test in this process may have run setup_logging, which stops "fedpower" records
    # from reaching the root logger (where caplog listens).
    monkeypatch.setattr(logging.getLogger("fedpower"), "propagate", True)
    run_config = parse_config({"task.name": "sst2", "model.name": tiny_model_dir, "task.cache-dir": str(tmp_path / "cache"),
                               "task.max-length": 16}).to_dict()
    cases = bad_input_cases(tmp_path)
    for case in ("data-dir does not exist", "bad header", "label outside the task's labels", "empty file"):
        data_dir, _task, expected = cases[case]
        caplog.clear()
        reply = _query(run_config, {"data-dir": str(data_dir)})
        assert reply.has_error(), case
        assert all(part in reply.error.reason for part in expected), (case, reply.error.reason)
        logged = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert any(m.startswith("silo data: ") and expected[-1] in m for m in logged), (case, logged)
    good = silo_dir(tmp_path, "good", HEADER + tsv_rows(23, 4))
    own = {"dp-max-epsilon": 8, "send-shard-size": "true"}
    reply = _query(run_config, {"data-dir": str(good), "silo-id": 5, **own})
    assert not reply.has_error(), reply.error.reason if reply.has_error() else ""
    metrics = reply.content.metric_records["metrics"]
    assert metrics["num-examples"] == 23 and metrics["partition-id"] == 5  # the silo names itself by silo-id
    reply = _query(run_config, {"data-dir": str(good), "silo-id": "first", **own})
    assert reply.has_error() and "silo-id must be an integer >= 0, got 'first'" in reply.error.reason


def test_a_silo_without_an_evaluation_split_refuses_evaluate_clearly(tmp_path, tiny_model_dir):
    from client_app import app as C

    run_config = parse_config({"task.name": "sst2", "model.name": tiny_model_dir, "task.cache-dir": str(tmp_path / "cache"),
                               "task.max-length": 16}).to_dict()
    ctx = _context(run_config, {"data-dir": str(silo_dir(tmp_path, "s", HEADER + tsv_rows(20, 1)))})
    cfg, pid, num, _task, _model, _tok = C._setup(ctx)
    with pytest.raises(SiloDataError, match="holds no evaluation split .*dev.tsv.*eval.fraction-clients = 0"):
        C._eval_shard(cfg, pid, num)


SIZES = (48, 96, 160)  # n_k of silos 0, 1, 2; silo 2 is label-skewed (90 % positive)


def make_silos(root: Path) -> tuple[list[Path], Path]:
    """Three silos with their own SST-2 training files of different sizes (one label-skewed, one with
    its own dev.tsv) and the server's own evaluation folder (no training row: a header-only train.tsv)."""
    silos = [silo_dir(root, "silo-0", HEADER + tsv_rows(SIZES[0], 100)),
             silo_dir(root, "silo-1", HEADER + tsv_rows(SIZES[1], 101), HEADER + tsv_rows(16, 201)),
             silo_dir(root, "silo-2", HEADER + tsv_rows(SIZES[2], 102, positive_share=0.9))]
    server = silo_dir(root, "server-eval", HEADER, HEADER + tsv_rows(64, 300))
    return silos, server


def silo_node_config(silo: Path, k: int) -> dict:
    return {"data-dir": str(silo), "silo-id": k, "ledger-file": str(silo / "ledger.json"), "dp-max-epsilon": 8.0,
            "send-shard-size": "true"}


def check_silo_ledgers(silos: list[Path], rounds: int, local_steps: int, batch_size: int, delta: float = 1e-5):
    """Each silo's ledger, read from its own disk: q_k = b / n_k, the same σ, ε_k from the product's
    accountant; smaller n_k gives larger q_k and larger ε_k for the same steps. Returns the rows."""
    from fedpower_app.privacy.accounting.silo import SiloLedger, dp_sgd_epsilon

    rows = []
    for k, silo in enumerate(silos):
        saved = json.loads((silo / "ledger.json").read_text())
        ledger = SiloLedger.from_state_dict(saved["ledger"])
        assert len(ledger.entries) == 1, ledger.entries
        q, sigma, steps, trained = ledger.entries[0]
        assert q == pytest.approx(batch_size / SIZES[k]) and trained == rounds and steps == rounds * local_steps
        eps = ledger.epsilon()
        assert eps == pytest.approx(dp_sgd_epsilon([(batch_size / SIZES[k], sigma, rounds * local_steps)], delta))
        rows.append({"silo": k, "n": SIZES[k], "q": q, "sigma": sigma, "rounds": trained, "epsilon": eps})
    assert len({r["sigma"] for r in rows}) == 1
    eps = [r["epsilon"] for r in rows]
    assert eps[0] > eps[1] > eps[2] > 0, rows  # n_0 < n_1 < n_2
    assert max(eps) <= 8.0 * (1 + 1e-9)
    return rows


def test_three_silos_with_their_own_data_in_process(tmp_path, tiny_model_dir):
    """The ServerApp and three ClientApps with their own directories (in-process grid): the run
    completes with DP-SGD on the silos; the server's config names only its own evaluation folder;
    every silo's ledger is on its own disk and its ε follows its own n_k."""
    from client_app.app import app as client_app
    from fedpower_app.runs.inprocess_grid import InProcessGrid
    from fedpower_app.runs.results import ResultsWriter
    from server_app import app as server

    silos, server_dir = make_silos(tmp_path / "sites")
    cfg = parse_config({"task.name": "sst2", "task.data-dir": str(server_dir), "model.name": tiny_model_dir,
                        "task.max-length": 16, "task.cache-dir": str(tmp_path / "server-cache"), "lora.rank": 4,
                        "num-server-rounds": 2, "train.local-steps": 2, "train.batch-size": 16,
                        "strategy.client-rate": 1.0, "strategy.min-nodes": 3, "dp.noise-at": "silo",
                        "output-dir": str(tmp_path / "out"), "run-name": "own-data"})
    grid = InProcessGrid(client_app, 3, cfg.to_dict())
    for k, node in enumerate(grid.get_node_ids()):
        grid._contexts[node] = _context(cfg.to_dict(), silo_node_config(silos[k], k), node)
    run_dir = server.run_directory(cfg)
    server._run(grid, cfg, run_dir, ResultsWriter(run_dir, cfg.to_dict()))
    results = json.loads((run_dir / "results.json").read_text())
    assert results["status"] == "completed" and results["clients"]["dataset_sizes"] == sorted(SIZES)
    assert [r["sampled"] for r in results["rounds"]] == [3, 3]
    # a private run withholds its reply counts (a zero would be a claim); every silo's own ledger
    # below shows that all three trained both rounds
    assert results["totals"]["dropped_replies"] == results["totals"]["missing_replies"] == "withheld"
    server_config = json.dumps(results["config"])
    assert str(tmp_path / "sites" / "silo-") not in server_config  # the server knows no silo's path
    assert results["config"]["task.data-dir"] == str(server_dir)
    rows = check_silo_ledgers(silos, rounds=2, local_steps=2, batch_size=16)
    assert results["totals"]["final_epsilon"] == pytest.approx(rows[0]["epsilon"])  # the smallest silo's
    check_server_view(results, rows)


def check_server_view(results: dict, rows: list[dict]) -> None:
    """The server's per-silo ledgers (kept from the sizes the silos reported) match the silos' own."""
    server_rows = results["privacy_final"]["silos"]
    assert [(r["n"], r["rounds_trained"]) for r in server_rows] == [(r["n"], r["rounds"]) for r in rows]
    for mine, theirs in zip(rows, server_rows):
        assert theirs["q"] == pytest.approx(mine["q"]) and theirs["epsilon"] == pytest.approx(mine["epsilon"])
