"""Tests for fedpower_app.data.glue: local TSV/parquet/CSV loaders, labels, errors, IID partitions, hub path.

No network: the hub path is exercised by monkeypatching ``datasets.load_dataset`` with an
in-memory DatasetDict. The real-data tests read ../shared/glue (relative to the repo root) and
skip when it is absent.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from fedpower_app.data.types import TaskData
from fedpower_app.data.glue import (
    GLUE_TASKS,
    iid_partition_indices,
    load_glue,
    load_glue_hub,
    load_glue_local,
    normalise_task_name,
    read_split_file,
)

SHARED_GLUE = Path(__file__).resolve().parents[2] / "shared" / "glue"


def _shared(*parts: str) -> Path:
    path = SHARED_GLUE.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"shared GLUE data not available at {path}")
    return path


def _write_tsv(path: Path, header: list[str], rows: list[list[str]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ["\t".join(header)] + ["\t".join(r) for r in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------------
# official-format TSV fixtures (small, written by the tests)
# ------------------------------------------------------------------------------------------

MNLI_TRAIN_HEADER = [
    "index", "promptID", "pairID", "genre", "sentence1_binary_parse", "sentence2_binary_parse",
    "sentence1_parse", "sentence2_parse", "sentence1", "sentence2", "label1", "gold_label",
]  # fmt: skip
MNLI_DEV_HEADER = [
    "index", "promptID", "pairID", "genre", "sentence1_binary_parse", "sentence2_binary_parse",
    "sentence1_parse", "sentence2_parse", "sentence1", "sentence2",
    "label1", "label2", "label3", "label4", "label5", "gold_label",
]  # fmt: skip


def _mnli_train_row(i: int, s1: str, s2: str, label: str) -> list[str]:
    return [str(i), str(100 + i), f"{100 + i}e", "fiction", "( a b )", "( c d )", "(ROOT a)", "(ROOT c)", s1, s2, label, label]


def _mnli_dev_row(i: int, s1: str, s2: str, gold: str) -> list[str]:
    votes = ["neutral", "entailment", "contradiction", "neutral", "entailment"]
    return [str(i), str(200 + i), f"{200 + i}n", "slate", "( a )", "( b )", "(ROOT a)", "(ROOT b)", s1, s2, *votes, gold]


@pytest.fixture()
def official_glue(tmp_path: Path) -> Path:
    """A parent dir with SST-2, QNLI, MNLI, QQP folders in the official GLUE column layouts."""
    root = tmp_path / "glue_official"
    # SST-2: stray quote characters that ordinary CSV quoting would merge across rows.
    _write_tsv(
        root / "SST-2" / "train.tsv",
        ["sentence", "label"],
        [
            ["hide new secretions from the parental units ", "0"],
            ['the " stray quote opens here ', "1"],
            ["and nothing closes it ", "0"],
            ['"quoted start', "1"],
            ["plain ending ", "1"],
        ],
    )
    _write_tsv(root / "SST-2" / "dev.tsv", ["sentence", "label"], [["it 's a charming journey . ", "1"], ['bleak " and desperate ', "0"]])
    # QNLI: index question sentence label, string labels.
    qnli_rows = [
        ["0", 'What did "Kanye say?', "He said nothing .", "not_entailment"],
        ["1", "Where is Paris?", 'Paris is in France ."', "entailment"],
        ["2", "Who?", "Nobody .", "not_entailment"],
    ]
    _write_tsv(root / "QNLI" / "train.tsv", ["index", "question", "sentence", "label"], qnli_rows)
    _write_tsv(root / "QNLI" / "dev.tsv", ["index", "question", "sentence", "label"], qnli_rows[:2])
    # MNLI: 12-column train, 16-column dev (label1..label5 gold_label) with one '-' gold label.
    _write_tsv(
        root / "MNLI" / "train.tsv",
        MNLI_TRAIN_HEADER,
        [
            _mnli_train_row(0, "Well, he showed them.", "He beat them up.", "neutral"),
            _mnli_train_row(1, 'He said "yes.', "He agreed.", "entailment"),
            _mnli_train_row(2, "It rained.", "It was dry.", "contradiction"),
            _mnli_train_row(3, "Cats purr.", 'Cats make "sounds.', "entailment"),
        ],
    )
    _write_tsv(
        root / "MNLI" / "dev_matched.tsv",
        MNLI_DEV_HEADER,
        [
            _mnli_dev_row(0, "A man walks.", "A person moves.", "entailment"),
            _mnli_dev_row(1, "No consensus here.", "Annotators disagreed.", "-"),
            _mnli_dev_row(2, 'A "quote.', "Something.", "contradiction"),
        ],
    )
    _write_tsv(
        root / "MNLI" / "dev_mismatched.tsv",
        MNLI_DEV_HEADER,
        [_mnli_dev_row(0, "Letters arrive.", "Mail comes.", "neutral"), _mnli_dev_row(1, "x", "y", "entailment")],
    )
    # QQP: id qid1 qid2 question1 question2 is_duplicate.
    qqp_header = ["id", "qid1", "qid2", "question1", "question2", "is_duplicate"]
    _write_tsv(
        root / "QQP" / "train.tsv",
        qqp_header,
        [
            ["1", "1", "2", "How do I learn Python?", "What is the best way to learn Python?", "1"],
            ["2", "3", "4", 'What does "love mean?', "Why is the sky blue?", "0"],
            ["3", "5", "6", "Is it raining?", "", "0"],
        ],
    )
    _write_tsv(root / "QQP" / "dev.tsv", qqp_header, [["9", "7", "8", "A?", "B?", "0"], ["10", "9", "10", "C?", "C?", "1"]])
    return root


# ------------------------------------------------------------------------------------------
# task names and specs
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("alias", "canonical"),
    [("sst2", "sst2"), ("sst-2", "sst2"), ("SST-2", "sst2"), ("Sst_2", "sst2"), ("QNLI", "qnli"), ("mnli", "mnli"), ("QQP", "qqp")],
)
def test_task_aliases(alias: str, canonical: str) -> None:
    assert normalise_task_name(alias) == canonical


@pytest.mark.parametrize("bad", ["mnli-m", "cola", "", "sst"])
def test_unknown_task_lists_valid_tasks(bad: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="sst2, qnli, mnli, qqp"):
        normalise_task_name(bad)
    with pytest.raises(ValueError, match="valid tasks"):
        load_glue(bad, tmp_path)


def test_task_specs() -> None:
    assert set(GLUE_TASKS) == {"sst2", "qnli", "mnli", "qqp"}
    assert GLUE_TASKS["sst2"].label_names == ("negative", "positive")
    assert GLUE_TASKS["qnli"].label_names == ("entailment", "not_entailment")
    assert GLUE_TASKS["mnli"].label_names == ("entailment", "neutral", "contradiction")
    assert GLUE_TASKS["qqp"].label_names == ("not_duplicate", "duplicate")
    assert [GLUE_TASKS[t].num_labels for t in ("sst2", "qnli", "mnli", "qqp")] == [2, 2, 3, 2]
    assert GLUE_TASKS["mnli"].eval_splits == ("validation_matched", "validation_mismatched")


# ------------------------------------------------------------------------------------------
# official TSV layouts
# ------------------------------------------------------------------------------------------


def test_official_sst2_tsv_quoting_disabled(official_glue: Path) -> None:
    for data_dir in (official_glue, official_glue / "SST-2"):  # parent dir or the task folder
        data = load_glue("SST-2", data_dir)
        assert isinstance(data, TaskData)
        assert data.name == "sst2" and data.num_labels == 2
        assert data.label_names == ["negative", "positive"]
        assert data.train.text_b is None
        assert len(data.train) == 5  # the stray quotes did not merge rows
        assert data.train.text_a[0] == "hide new secretions from the parental units "  # verbatim
        assert data.train.text_a[1] == 'the " stray quote opens here '
        assert data.train.text_a[3] == '"quoted start'
        assert data.train.labels == [0, 1, 0, 1, 1]
        assert list(data.eval_splits) == ["validation"]
        assert data.eval_splits["validation"].labels == [1, 0]


def test_task_folder_case_insensitive(official_glue: Path, tmp_path: Path) -> None:
    lower = tmp_path / "lower"
    shutil.copytree(official_glue / "SST-2", lower / "sst-2")
    assert len(load_glue("sst2", lower).train) == 5


def test_official_qnli_string_labels(official_glue: Path) -> None:
    data = load_glue_local("qnli", official_glue)
    assert data.name == "qnli" and data.num_labels == 2
    assert data.train.text_a == ['What did "Kanye say?', "Where is Paris?", "Who?"]
    assert data.train.text_b == ["He said nothing .", 'Paris is in France ."', "Nobody ."]
    assert data.train.labels == [1, 0, 1]  # 0 = entailment, 1 = not_entailment (HF convention)
    assert data.eval_splits["validation"].labels == [1, 0]


def test_official_mnli_12_and_16_columns(official_glue: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="fedpower_app.data.glue"):
        data = load_glue("mnli", official_glue)
    assert data.name == "mnli" and data.num_labels == 3
    assert data.label_names == ["entailment", "neutral", "contradiction"]
    assert data.train.text_a[0] == "Well, he showed them."
    assert data.train.text_b[0] == "He beat them up."
    assert data.train.labels == [1, 0, 2, 0]
    assert data.train.text_a[1] == 'He said "yes.'
    assert list(data.eval_splits) == ["validation_matched", "validation_mismatched"]
    matched = data.eval_splits["validation_matched"]
    assert len(matched) == 2  # the '-' gold-label row is dropped
    assert matched.labels == [0, 2]
    assert matched.text_a == ["A man walks.", 'A "quote.']
    assert data.eval_splits["validation_mismatched"].labels == [1, 0]
    assert "without a gold label" in caplog.text


def test_official_qqp(official_glue: Path) -> None:
    data = load_glue("qqp", official_glue)
    assert data.name == "qqp" and data.num_labels == 2
    assert data.train.labels == [1, 0, 0]
    assert data.train.text_a[1] == 'What does "love mean?'
    assert data.train.text_b[2] == ""  # empty question kept (official QQP has a few)
    assert data.eval_splits["validation"].labels == [0, 1]


def test_reduced_layouts_and_column_order(tmp_path: Path) -> None:
    # MNLI train `sentence1 sentence2 gold_label`, dev `gold_label sentence1 sentence2` (label first).
    d = tmp_path / "MNLI"
    _write_tsv(d / "train.tsv", ["sentence1", "sentence2", "gold_label"], [["p", "h", "contradiction"], ["p2", "h2", "neutral"]])
    _write_tsv(d / "dev_matched.tsv", ["gold_label", "sentence1", "sentence2"], [["entailment", "pm", "hm"]])
    _write_tsv(d / "dev_mismatched.tsv", ["gold_label", "sentence1", "sentence2"], [["neutral", "px", "hx"]])
    data = load_glue("mnli", tmp_path)
    assert data.train.labels == [2, 1]
    assert (data.eval_splits["validation_matched"].text_a, data.eval_splits["validation_matched"].text_b) == (["pm"], ["hm"])
    assert data.eval_splits["validation_mismatched"].labels == [1]


def test_malformed_rows_dropped_with_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    d = tmp_path / "SST-2"
    d.mkdir()
    (d / "train.tsv").write_text(
        "sentence\tlabel\n"
        "good row \t1\n"
        "missing label field\n"  # too few fields: dropped
        "extra\tfield\t1\n"  # extra non-empty field: ambiguous, dropped
        "trailing tab \t0\t\n"  # trailing empty field: tolerated
        "\n"  # blank line: ignored
        "windows line \t0\r\n",  # CRLF line ending
        encoding="utf-8",
    )
    _write_tsv(d / "dev.tsv", ["sentence", "label"], [["x", "0"]])
    with caplog.at_level(logging.WARNING, logger="fedpower_app.data.glue"):
        data = load_glue("sst2", d)
    assert data.train.text_a == ["good row ", "trailing tab ", "windows line "]
    assert data.train.labels == [1, 0, 0]
    assert "dropped 2 malformed row(s)" in caplog.text and "lines 3, 4" in caplog.text


def test_unicode_line_separator_inside_text(tmp_path: Path) -> None:
    d = tmp_path / "SST-2"
    _write_tsv(d / "train.tsv", ["sentence", "label"], [["a\u2028b\x85c", "1"], ["d", "0"]])
    _write_tsv(d / "dev.tsv", ["sentence", "label"], [["x", "0"]])
    data = load_glue("sst2", d)
    assert data.train.text_a == ["a\u2028b\x85c", "d"]


# ------------------------------------------------------------------------------------------
# real GLUE rows in ../shared/glue
# ------------------------------------------------------------------------------------------


def test_shared_sst2_full_sizes() -> None:
    root = _shared("SST-2")
    data = load_glue("sst2", root.parent)
    assert len(data.train) == 67_349
    assert len(data.eval_splits["validation"]) == 872
    assert data.train.text_a[0] == "hide new secretions from the parental units "
    assert data.train.labels[:3] == [0, 0, 1]
    assert set(data.train.labels) == {0, 1}
    again = load_glue("SST-2", root)  # the task folder itself
    assert again.train.labels == data.train.labels


def test_shared_mnli_sizes_and_labels() -> None:
    root = _shared("MNLI")
    data = load_glue("mnli", root.parent)
    assert len(data.train) == 9_999
    assert len(data.eval_splits["validation_matched"]) == 1_000
    assert len(data.eval_splits["validation_mismatched"]) == 1_000
    counts = [data.train.labels.count(k) for k in range(3)]
    assert counts == [3_408, 3_313, 3_278]  # entailment, neutral, contradiction
    assert data.train.text_b is not None and len(data.train.text_b) == 9_999


def test_shared_qqp_sizes_and_labels() -> None:
    root = _shared("QQP")
    data = load_glue("qqp", root)
    assert len(data.train) == 8_999
    assert len(data.eval_splits["validation"]) == 1_000
    assert [data.train.labels.count(k) for k in range(2)] == [5_718, 3_281]
    # stray/doubled quote characters are kept verbatim (quoting disabled)
    assert any('""' in q for q in data.eval_splits["validation"].text_b)


def test_shared_official_columns_samples(tmp_path: Path) -> None:
    mnli_sample = _shared("MNLI", "official_columns_sample.tsv")
    qqp_sample = _shared("QQP", "official_columns_sample.tsv")
    mnli_dir = tmp_path / "MNLI"
    mnli_dir.mkdir()
    shutil.copy(mnli_sample, mnli_dir / "train.tsv")
    shutil.copy(_shared("MNLI", "dev_matched.tsv"), mnli_dir / "dev_matched.tsv")
    shutil.copy(_shared("MNLI", "dev_mismatched.tsv"), mnli_dir / "dev_mismatched.tsv")
    mnli = load_glue("mnli", tmp_path)
    assert len(mnli.train) == 480
    assert [mnli.train.labels.count(k) for k in range(3)] == [160, 160, 160]
    assert mnli.train.text_a[0] == "Well, he showed them."  # sentence1, not a parse column
    assert mnli.train.text_b[0] == "He beat them up."
    assert mnli.train.labels[0] == 1  # neutral

    qqp_dir = tmp_path / "QQP"
    qqp_dir.mkdir()
    shutil.copy(qqp_sample, qqp_dir / "train.tsv")
    shutil.copy(qqp_sample, qqp_dir / "dev.tsv")
    qqp = load_glue("qqp", tmp_path)
    assert len(qqp.train) == 320 == len(qqp.eval_splits["validation"])
    assert qqp.train.text_a[0] == "How much energy/heat does one standard tea light candle produce?"
    assert qqp.train.labels[0] == 0
    assert read_split_file("qqp", qqp_sample).labels == qqp.train.labels


# ------------------------------------------------------------------------------------------
# HF exports: parquet / CSV
# ------------------------------------------------------------------------------------------

HF_FRAMES = {
    "sst2": {"sentence": ['a, "quoted" one ', "two"], "label": [1, 0]},
    "qnli": {"question": ["q1?", 'q2 "?'], "sentence": ["s1,", "s2"], "label": [0, 1]},
    "mnli": {"premise": ["p1", "p2", "p3"], "hypothesis": ["h1", "h2", "h3"], "label": [0, 1, 2]},
    "qqp": {"question1": ["a?", "b?"], "question2": ["c?", "d?"], "label": [1, 0]},
}


def _write_export(task_dir: Path, task: str, fmt: str, with_idx: bool = True) -> None:
    import pandas as pd

    task_dir.mkdir(parents=True, exist_ok=True)
    frame = pd.DataFrame(HF_FRAMES[task])
    if with_idx:
        frame["idx"] = range(len(frame))
    for split in ("train", *GLUE_TASKS[task].eval_splits):
        path = task_dir / f"{split}.{fmt}"
        frame.to_parquet(path, index=False) if fmt == "parquet" else frame.to_csv(path, index=False)


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
@pytest.mark.parametrize("task", ["sst2", "qnli", "mnli", "qqp"])
def test_hf_exports(tmp_path: Path, task: str, fmt: str) -> None:
    _write_export(tmp_path / task, task, fmt)  # HF config name as folder name
    data = load_glue(task, tmp_path)
    frame = HF_FRAMES[task]
    cols = list(frame)
    assert data.train.text_a == frame[cols[0]]
    assert data.train.labels == frame["label"]
    if task == "sst2":
        assert data.train.text_b is None
    else:
        assert data.train.text_b == frame[cols[1]]
    assert list(data.eval_splits) == list(GLUE_TASKS[task].eval_splits)
    for ex in data.eval_splits.values():
        assert ex.labels == frame["label"]


def test_parquet_shards_and_string_labels(tmp_path: Path) -> None:
    import pandas as pd

    d = tmp_path / "MNLI"
    d.mkdir()
    pd.DataFrame({"premise": ["a", "b"], "hypothesis": ["c", "d"], "label": ["entailment", "Contradiction"]}).to_parquet(
        d / "train-00000-of-00002.parquet"
    )
    pd.DataFrame({"premise": ["e"], "hypothesis": ["f"], "label": ["neutral"]}).to_parquet(d / "train-00001-of-00002.parquet")
    for split in ("validation_matched", "validation_mismatched"):
        pd.DataFrame({"premise": ["x"], "hypothesis": ["y"], "label": [2]}).to_parquet(d / f"{split}-00000-of-00001.parquet")
    data = load_glue("mnli", d)
    assert data.train.text_a == ["a", "b", "e"]
    assert data.train.labels == [0, 2, 1]
    assert data.eval_splits["validation_mismatched"].labels == [2]


@pytest.mark.parametrize(
    ("task", "raw", "expected"),
    [
        ("sst2", ["0", "1", "negative", "POSITIVE"], [0, 1, 0, 1]),
        ("qnli", ["entailment", "not_entailment", "0", "1"], [0, 1, 0, 1]),
        ("mnli", ["entailment", "neutral", "contradiction", "2"], [0, 1, 2, 2]),
        ("qqp", ["0", "1", "duplicate", "not_duplicate"], [0, 1, 1, 0]),
    ],
)
def test_label_mapping(tmp_path: Path, task: str, raw: list[str], expected: list[int]) -> None:
    spec = GLUE_TASKS[task]
    header = [spec.text_a_columns[0]] + ([spec.text_b_columns[0]] if spec.text_b_columns else []) + [spec.label_columns[0]]
    rows = [["t"] * (len(header) - 1) + [r] for r in raw]
    path = _write_tsv(tmp_path / "train.tsv", header, rows)
    assert read_split_file(task, path).labels == expected


# ------------------------------------------------------------------------------------------
# errors
# ------------------------------------------------------------------------------------------


def test_missing_directory(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="does not exist") as info:
        load_glue("sst2", missing)
    assert str(missing) in str(info.value) and "SST-2" in str(info.value)


def test_directory_without_task_data(tmp_path: Path) -> None:
    (tmp_path / "QQP").mkdir()
    with pytest.raises(FileNotFoundError, match="No GLUE sst2 data") as info:
        load_glue("sst2", tmp_path)
    assert "SST-2" in str(info.value) and "train.tsv" in str(info.value)


def test_missing_split_names_candidates(tmp_path: Path) -> None:
    _write_tsv(tmp_path / "SST-2" / "train.tsv", ["sentence", "label"], [["x", "0"]])
    with pytest.raises(FileNotFoundError, match="'validation'") as info:
        load_glue("sst2", tmp_path)
    msg = str(info.value)
    assert "dev.tsv" in msg and "validation.parquet" in msg and "validation.csv" in msg

    d = tmp_path / "MNLI"
    _write_tsv(d / "train.tsv", ["sentence1", "sentence2", "gold_label"], [["a", "b", "neutral"]])
    _write_tsv(d / "dev_matched.tsv", ["sentence1", "sentence2", "gold_label"], [["a", "b", "neutral"]])
    with pytest.raises(FileNotFoundError, match="validation_mismatched") as info:
        load_glue("mnli", tmp_path)
    assert "dev_mismatched.tsv" in str(info.value)


def test_unknown_columns(tmp_path: Path) -> None:
    d = tmp_path / "QQP"
    path = _write_tsv(d / "train.tsv", ["q_a", "q_b", "is_duplicate"], [["a", "b", "0"]])
    _write_tsv(d / "dev.tsv", ["question1", "question2", "is_duplicate"], [["a", "b", "0"]])
    with pytest.raises(ValueError, match="Unrecognised column layout") as info:
        load_glue("qqp", tmp_path)
    msg = str(info.value)
    assert str(path) in msg  # the file
    assert "'q_a', 'q_b', 'is_duplicate'" in msg  # the columns found
    assert "question1" in msg and "question2" in msg  # the columns expected


def test_unknown_columns_parquet(tmp_path: Path) -> None:
    import pandas as pd

    path = tmp_path / "train.parquet"
    pd.DataFrame({"text": ["a"], "label": [0]}).to_parquet(path)
    with pytest.raises(ValueError, match="found columns \\['text', 'label'\\]"):
        read_split_file("sst2", path)


@pytest.mark.parametrize(("task", "bad"), [("sst2", "2"), ("qnli", "maybe"), ("mnli", "entail"), ("qqp", "yes"), ("sst2", "")])
def test_unknown_label(tmp_path: Path, task: str, bad: str) -> None:
    spec = GLUE_TASKS[task]
    header = [spec.text_a_columns[0]] + ([spec.text_b_columns[0]] if spec.text_b_columns else []) + [spec.label_columns[0]]
    good = spec.label_names[0]
    rows = [["t"] * (len(header) - 1) + [good], ["t"] * (len(header) - 1) + [bad]]
    path = _write_tsv(tmp_path / "train.tsv", header, rows)
    with pytest.raises(ValueError, match="Unknown label") as info:
        read_split_file(task, path)
    assert str(path) in str(info.value) and repr(bad) in str(info.value) and "line 3" in str(info.value)


def test_unknown_integer_label_parquet(tmp_path: Path) -> None:
    import pandas as pd

    path = tmp_path / "validation.parquet"
    pd.DataFrame({"sentence": ["a", "b"], "label": [0, -1]}).to_parquet(path)  # -1 = HF test split
    with pytest.raises(ValueError, match="Unknown label -1"):
        read_split_file("sst2", path)


@pytest.mark.parametrize("bad", [0, -3, 1.5, True])
def test_invalid_max_values(official_glue: Path, bad: object) -> None:
    with pytest.raises(ValueError, match="max_train"):
        load_glue("sst2", official_glue, max_train=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_eval"):
        load_glue("sst2", official_glue, max_eval=bad)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------
# subsampling
# ------------------------------------------------------------------------------------------


def test_subsample_deterministic(tmp_path: Path) -> None:
    d = tmp_path / "SST-2"
    rows = [[f"s{i}", str(i % 2)] for i in range(200)]
    _write_tsv(d / "train.tsv", ["sentence", "label"], rows)
    _write_tsv(d / "dev.tsv", ["sentence", "label"], rows[:50])
    a = load_glue("sst2", d, max_train=30, max_eval=10, seed=7)
    b = load_glue("sst2", d, max_train=30, max_eval=10, seed=7)
    c = load_glue("sst2", d, max_train=30, max_eval=10, seed=8)
    assert len(a.train) == 30 and len(a.eval_splits["validation"]) == 10
    assert a.train.text_a == b.train.text_a and a.eval_splits["validation"].text_a == b.eval_splits["validation"].text_a
    assert a.train.text_a != c.train.text_a
    idx = [int(t[1:]) for t in a.train.text_a]
    assert idx == sorted(idx) and len(set(idx)) == 30  # original order, no duplicates
    assert all(a.train.labels[k] == i % 2 for k, i in enumerate(idx))  # text/label stay aligned
    full = load_glue("sst2", d, max_train=10_000, max_eval=None)
    assert len(full.train) == 200 and len(full.eval_splits["validation"]) == 50


# ------------------------------------------------------------------------------------------
# IID partitions
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "k"), [(1, 1), (10, 1), (10, 3), (7, 7), (100, 6), (101, 10), (1_000, 7), (67_349, 6)])
def test_iid_partition_sizes(n: int, k: int) -> None:
    parts = [iid_partition_indices(n, k, p, seed=42) for p in range(k)]
    sizes = [len(p) for p in parts]
    assert sum(sizes) == n
    assert max(sizes) - min(sizes) <= 1
    flat = [i for p in parts for i in p]
    assert sorted(flat) == list(range(n))  # disjoint and complete


def test_iid_partition_on_real_sst2_size() -> None:
    data = load_glue("sst2", _shared("SST-2"))
    n = len(data.train)
    assert n == 67_349
    sizes = [len(iid_partition_indices(n, 6, p, seed=0)) for p in range(6)]
    assert sizes == [11_225] * 5 + [11_224]


def test_iid_partition_deterministic() -> None:
    assert iid_partition_indices(500, 4, 2, seed=3) == iid_partition_indices(500, 4, 2, seed=3)
    assert iid_partition_indices(500, 4, 2, seed=3) != iid_partition_indices(500, 4, 2, seed=4)
    assert all(isinstance(i, int) for i in iid_partition_indices(50, 3, 0, seed=1))


@pytest.mark.parametrize(("n", "k", "seed"), [(103, 5, 0), (1_000, 6, 42)])
def test_iid_partition_matches_flwr_iid_partitioner(n: int, k: int, seed: int) -> None:
    """Same partitions as FederatedDataset(shuffle=True, seed) + IidPartitioner(k)."""
    from datasets import Dataset
    from flwr_datasets.partitioner import IidPartitioner

    shuffled = Dataset.from_dict({"i": list(range(n))}).shuffle(seed=seed)
    partitioner = IidPartitioner(num_partitions=k)
    partitioner.dataset = shuffled
    for p in range(k):
        assert iid_partition_indices(n, k, p, seed) == partitioner.load_partition(p)["i"]


@pytest.mark.parametrize(
    ("args", "exc", "pattern"),
    [
        ((10, 0, 0, 0), ValueError, "num_partitions"),
        ((10, -2, 0, 0), ValueError, "num_partitions"),
        ((10, 3, 3, 0), ValueError, "partition_id"),
        ((10, 3, -1, 0), ValueError, "partition_id"),
        ((2, 3, 0, 0), ValueError, "non-empty"),
        ((10, 3, 0, -1), ValueError, "seed"),
        ((10, 3.0, 0, 0), TypeError, "num_partitions"),
        ((10, 3, 0, None), TypeError, "seed"),
    ],
)
def test_iid_partition_validation(args: tuple, exc: type, pattern: str) -> None:
    with pytest.raises(exc, match=pattern):
        iid_partition_indices(*args)


# ------------------------------------------------------------------------------------------
# hub path (monkeypatched, no network)
# ------------------------------------------------------------------------------------------


def _fake_glue(config: str):
    from datasets import ClassLabel, Dataset, DatasetDict, Features, Value

    spec = GLUE_TASKS[config]
    text_cols = {"sst2": ["sentence"], "qnli": ["question", "sentence"], "mnli": ["premise", "hypothesis"], "qqp": ["question1", "question2"]}[config]
    k = spec.num_labels

    def split(n: int, tag: str) -> Dataset:
        data = {c: [f"{tag}-{c}-{i}" for i in range(n)] for c in text_cols}
        data["label"] = [i % k for i in range(n)]
        data["idx"] = list(range(n))
        feats = {c: Value("string") for c in text_cols}
        feats["label"] = ClassLabel(names=list(spec.label_names))
        feats["idx"] = Value("int32")
        return Dataset.from_dict(data, features=Features(feats))

    splits = {"train": split(12, "train")}
    for name in spec.eval_splits:
        splits[name] = split(5, name)
    test_name = "test_matched" if config == "mnli" else "test"
    test = split(3, test_name).cast_column("label", Value("int64")).map(lambda r: {"label": -1})
    splits[test_name] = test
    return DatasetDict(splits)


@pytest.fixture()
def fake_hub(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    import datasets

    calls: list[dict] = []

    def fake_load_dataset(path=None, name=None, **kwargs):
        calls.append({"path": path, "name": name, **kwargs})
        assert path == "nyu-mll/glue"
        return _fake_glue(name)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    # flwr-datasets posts a telemetry event per load_split: keep the tests offline.
    monkeypatch.setattr("flwr_datasets.common.telemetry.FLWR_TELEMETRY_ENABLED", "0")
    return calls


@pytest.mark.parametrize("task", ["sst2", "qnli", "mnli", "qqp"])
def test_hub_path_via_federated_dataset(fake_hub: list[dict], task: str) -> None:
    data = load_glue_hub(task)
    assert fake_hub and fake_hub[0]["path"] == "nyu-mll/glue" and fake_hub[0]["name"] == task
    assert data.name == task and data.num_labels == GLUE_TASKS[task].num_labels
    assert len(data.train) == 12
    assert list(data.eval_splits) == list(GLUE_TASKS[task].eval_splits)
    assert all(len(ex) == 5 for ex in data.eval_splits.values())
    k = data.num_labels
    assert data.train.labels == [i % k for i in range(12)]  # unshuffled, same order as the hub
    assert data.train.text_a[0].startswith("train-")
    assert (data.train.text_b is None) == (task == "sst2")


def test_load_glue_without_data_dir_uses_hub(fake_hub: list[dict]) -> None:
    data = load_glue("SST-2", None, max_train=4, max_eval=2, seed=1)
    assert fake_hub[0]["name"] == "sst2"
    assert len(data.train) == 4 and len(data.eval_splits["validation"]) == 2
    assert load_glue("sst2", "", max_train=4, seed=1).train.text_a == data.train.text_a


def test_hub_fallback_without_flwr_datasets(fake_hub: list[dict], monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "flwr_datasets", None)  # makes `import flwr_datasets` fail
    data = load_glue_hub("mnli", cache_dir="/tmp/hf-cache")
    assert fake_hub[0]["cache_dir"] == "/tmp/hf-cache"
    assert len(data.eval_splits["validation_mismatched"]) == 5


def test_hub_label_names_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    def swapped(path=None, name=None, **kwargs):
        dsd = _fake_glue("qnli")
        return dsd.cast_column("label", datasets.ClassLabel(names=["not_entailment", "entailment"]))

    monkeypatch.setattr(datasets, "load_dataset", swapped)
    monkeypatch.setattr("flwr_datasets.common.telemetry.FLWR_TELEMETRY_ENABLED", "0")
    with pytest.raises(ValueError, match="label names"):
        load_glue_hub("qnli")


def test_hub_unreachable_is_wrapped(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'nyu-mll/glue' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    monkeypatch.setattr("flwr_datasets.common.telemetry.FLWR_TELEMETRY_ENABLED", "0")
    with pytest.raises(RuntimeError, match="unreachable") as info:
        load_glue("qqp")
    assert "data-dir" in str(info.value)
    assert isinstance(info.value.__cause__, ConnectionError)


def test_heavy_libraries_imported_lazily() -> None:
    import subprocess
    import sys

    code = (
        "import sys, fedpower_app.data.glue; "
        "print(sorted(m for m in ('datasets', 'flwr_datasets', 'pandas', 'pyarrow', 'torch') if m in sys.modules))"
    )
    repo_root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], cwd=repo_root, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
