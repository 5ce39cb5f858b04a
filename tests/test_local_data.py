"""A user's local prompt dataset: formats, the row contract, ids, held-out splits, errors."""

from __future__ import annotations

import json
import random
import socket

import datasets
import pytest

from streamrl.errors import ConfigError
from streamrl.tasks.local_data import check_enough_rows, load_prompt_dataset, split_heldout
from streamrl.tasks.prompt_sets import COLUMNS, load_prompt_file

ROWS = [
    {"prompt": "2+2=", "answer": 4, "difficulty": 1, "source_url": "a"},
    {"prompt": "3*5=", "answer": 15, "difficulty": 2, "source_url": "b"},
    {"prompt": "10-7=", "answer": 3, "difficulty": 1, "source_url": "c"},
    {"prompt": "9/3=", "answer": 3, "difficulty": 3, "source_url": "d"},
]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2="}]


@pytest.fixture(autouse=True)
def offline_tmp_caches(tmp_path, monkeypatch):
    """Caches under tmp_path, and any network connection fails the test."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf" / "datasets"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf" / "datasets")

    def no_network(*args, **kwargs):
        raise AssertionError("load_prompt_dataset must not touch the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)


def write(path, rows):
    """Write ``rows`` to ``path`` in the format its suffix (or ``_dir``) names; return the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix in (".csv", ".tsv", ".parquet"):
        frame = datasets.Dataset.from_list(rows).to_pandas()
        if path.suffix == ".parquet":
            frame.to_parquet(path)
        else:
            frame.to_csv(path, sep="\t" if path.suffix == ".tsv" else ",", index=False)
    else:
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


def by_prompt(ds):
    return {str(row["prompt"]): row["prompt_id"] for row in ds}


FORMATS = ["math.jsonl", "math.json", "math.csv", "math.tsv", "math.parquet", "math_dir"]


@pytest.mark.parametrize("name", FORMATS)
def test_each_format_gives_the_contract_and_keeps_extra_columns(tmp_path, name):
    ds = load_prompt_dataset(write(tmp_path / name, ROWS))
    assert ds.column_names == [*COLUMNS, "difficulty", "source_url"]
    assert ds["prompt"][:] == [r["prompt"] for r in ROWS]
    assert ds["answer"][:] == ["4", "15", "3", "3"]  # numbers (CSV too) become strings
    assert ds["answer_len"][:] == [1, 2, 1, 1]
    assert ds["task"][:] == [name.split(".")[0]] * 4  # the file stem / directory name
    assert ds["difficulty"][:] == [1, 2, 1, 3] and ds["source_url"][:] == ["a", "b", "c", "d"]
    assert len(set(ds["prompt_id"])) == 4 and ds[0]["prompt_id"].startswith("math")


def test_dataset_dict_directory_picks_a_split_and_lists_splits_when_missing(tmp_path):
    splits = datasets.DatasetDict(
        train=datasets.Dataset.from_list(ROWS[:3]), test=datasets.Dataset.from_list(ROWS[3:])
    )
    splits.save_to_disk(str(tmp_path / "arith"))
    train = load_prompt_dataset(tmp_path / "arith")
    test = load_prompt_dataset(tmp_path / "arith", split="test")
    assert (len(train), len(test)) == (3, 1)
    assert set(train["task"]) == set(test["task"]) == {"arith"}
    with pytest.raises(ConfigError, match=r"Unknown split 'tset' \(did you mean 'test'\?\)"):
        load_prompt_dataset(tmp_path / "arith", split="tset")


def test_column_mapping_copies_to_the_contract_and_keeps_the_columns(tmp_path):
    rows = [
        {"question": r["prompt"], "solution": r["answer"], "uid": 100 + i, "src": "gsm"}
        for i, r in enumerate(ROWS)
    ]
    ds = load_prompt_dataset(
        write(tmp_path / "x.jsonl", rows),
        prompt_column="question",
        answer_column="solution",
        id_column="uid",
        task_column="src",
    )
    # A reward reading row["solution"] (or any mapped column) finds it under its own name.
    assert ds.column_names == [*COLUMNS, "question", "solution", "uid", "src"]
    assert ds["prompt_id"][:] == ["100", "101", "102", "103"]
    assert ds["task"][:] == ["gsm"] * 4 and ds["answer"][0] == "4"
    assert ds["question"][:] == ds["prompt"][:] and ds["uid"][:] == [100, 101, 102, 103]
    assert [str(s) for s in ds["solution"]] == ds["answer"][:]


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_a_byte_that_is_not_utf8_is_named_with_its_line_and_offset(tmp_path, suffix):
    path = tmp_path / f"latin{suffix}"
    first = '{"prompt": "a", "answer": "1"}\n' if suffix == ".jsonl" else "prompt,answer\n"
    second = '{"prompt": "caf\xe9", "answer": "2"}\n' if suffix == ".jsonl" else "caf\xe9,2\n"
    path.write_bytes(first.encode() + second.encode("latin-1"))
    offset = len(first.encode()) + second.index("\xe9")
    with pytest.raises(ConfigError, match=rf"latin{suffix}:2: byte 0xe9 at offset {offset} is not"):
        load_prompt_dataset(path)
    if suffix == ".jsonl":
        with pytest.raises(ConfigError, match=r":2: byte 0xe9 .* save the file as UTF-8"):
            load_prompt_file(path)


def test_a_prompt_file_keeps_every_extra_field(tmp_path):
    path = write(tmp_path / "p.jsonl", [{"prompt": "a", "answer": "1", "solution": "x=1"}])
    assert load_prompt_file(path)[0]["solution"] == "x=1"


def test_no_answer_column_gives_empty_answers(tmp_path):
    rows = [{"prompt": r["prompt"]} for r in ROWS]
    ds = load_prompt_dataset(write(tmp_path / "open.jsonl", rows), answer_column=None)
    assert ds["answer"][:] == [""] * 4 and ds["answer_len"][:] == [0] * 4


def test_csv_keeps_ids_and_answers_as_written(tmp_path):
    path = tmp_path / "codes.csv"
    path.write_text("prompt_id,prompt,answer\n007,a,04\n008,b,1.50\n")
    ds = load_prompt_dataset(path)
    assert ds["prompt_id"][:] == ["007", "008"] and ds["answer"][:] == ["04", "1.50"]


def test_prompt_sets_jsonl_files_load_with_their_ids_and_tasks(tmp_path):
    rows = [
        {"prompt_id": "p1", "task": "count", "prompt": "count 1 3=", "answer": "1 2 3"},
        {"prompt_id": "p2", "task": "copy", "prompt": "copy ab=", "answer": "ab"},
    ]
    ds = load_prompt_dataset(write(tmp_path / "mine.jsonl", rows))
    assert ds.to_list() == [{**r, "answer_len": len(r["answer"])} for r in rows]


def test_content_ids_are_stable_across_loads_and_row_order(tmp_path):
    rows = [*ROWS, ROWS[0]]  # an exact repeat gets a "-2" suffix
    shuffled = rows[:]
    random.Random(3).shuffle(shuffled)
    first = load_prompt_dataset(write(tmp_path / "a" / "train.jsonl", rows))
    again = load_prompt_dataset(tmp_path / "a" / "train.jsonl")
    moved = load_prompt_dataset(write(tmp_path / "b" / "train.jsonl", shuffled))
    assert first["prompt_id"][:] == again["prompt_id"][:]
    assert sorted(first["prompt_id"]) == sorted(moved["prompt_id"])
    assert by_prompt(first) == by_prompt(moved)
    assert first["prompt_id"][4] == first["prompt_id"][0] + "-2"
    different_answer = [{**ROWS[0], "answer": 5}]
    other = load_prompt_dataset(write(tmp_path / "c" / "train.jsonl", different_answer))
    assert other["prompt_id"][0] != first["prompt_id"][0]


def test_duplicate_ids_name_both_rows(tmp_path):
    rows = [{**r, "prompt_id": f"id{i % 3}"} for i, r in enumerate(ROWS)]
    with pytest.raises(ConfigError, match=r"rows 0 and 3 .* share prompt_id 'id0'"):
        load_prompt_dataset(write(tmp_path / "dup.jsonl", rows))


@pytest.mark.parametrize("name", ["chat.jsonl", "chat.parquet", "chat_dir"])
def test_chat_message_prompts_are_kept_as_lists(tmp_path, name):
    rows = [{"prompt": CHAT, "answer": "4"}, {"prompt": CHAT[1:], "answer": "4"}]
    ds = load_prompt_dataset(write(tmp_path / name, rows))
    assert ds["prompt"][0] == CHAT and ds["prompt"][1] == CHAT[1:]
    assert ds["prompt_id"][0] != ds["prompt_id"][1]


def test_heldout_from_a_second_file_uses_the_same_mapping(tmp_path):
    rows = [{"q": r["prompt"], "a": r["answer"]} for r in ROWS]
    mapping = {"prompt_column": "q", "answer_column": "a"}
    train = load_prompt_dataset(write(tmp_path / "train.jsonl", rows[:3]), **mapping)
    same, heldout = split_heldout(train, heldout_path=write(tmp_path / "dev.csv", rows), **mapping)
    assert same is train and len(heldout) == 4 and heldout["task"][0] == "dev"
    assert not set(train["prompt_id"]) & set(heldout["prompt_id"])
    # ids that collide across the two sets would mix their per-prompt records
    with pytest.raises(ConfigError, match="3 held-out prompt ids also name training rows"):
        split_heldout(train, heldout_path=tmp_path / "train.jsonl", **mapping)


def test_heldout_from_another_split(tmp_path):
    splits = datasets.DatasetDict(
        train=datasets.Dataset.from_list(ROWS), test=datasets.Dataset.from_list(ROWS[:2])
    )
    splits.save_to_disk(str(tmp_path / "arith"))
    train = load_prompt_dataset(tmp_path / "arith")
    _, test = split_heldout(train, heldout_path=tmp_path / "arith", heldout_split="test")
    assert test["prompt"][:] == [ROWS[0]["prompt"], ROWS[1]["prompt"]]
    assert not set(train["prompt_id"]) & set(test["prompt_id"])  # ids carry the split name
    with pytest.raises(ConfigError, match="needs heldout_path"):
        split_heldout(train, heldout_split="test")


def test_heldout_fraction_is_seeded_disjoint_and_order_free(tmp_path):
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(40)]
    ds = load_prompt_dataset(write(tmp_path / "a" / "q.jsonl", rows))
    train, heldout = split_heldout(ds, heldout_fraction=0.25, seed=1)
    assert (len(train), len(heldout)) == (30, 10)
    assert set(train["prompt_id"]).isdisjoint(heldout["prompt_id"])
    assert set(train["prompt_id"]) | set(heldout["prompt_id"]) == set(ds["prompt_id"])
    random.Random(0).shuffle(rows)
    moved = load_prompt_dataset(write(tmp_path / "b" / "q.jsonl", rows))
    assert set(split_heldout(moved, heldout_fraction=0.25, seed=1)[1]["prompt_id"]) == set(
        heldout["prompt_id"]
    )
    assert set(split_heldout(ds, heldout_fraction=0.25, seed=2)[1]["prompt_id"]) != set(
        heldout["prompt_id"]
    )
    assert len(split_heldout(ds)[1]) == 4  # default: 10%
    assert len(split_heldout(ds, n_heldout=7)[1]) == 7


def test_heldout_errors(tmp_path):
    ds = load_prompt_dataset(write(tmp_path / "q.jsonl", ROWS))
    with pytest.raises(ConfigError, match="choose one of heldout_fraction, n_heldout"):
        split_heldout(ds, heldout_fraction=0.5, n_heldout=2)
    with pytest.raises(ConfigError, match="leaves the held-out set empty"):
        split_heldout(ds, heldout_fraction=0.1)
    with pytest.raises(ConfigError, match="leaves the training set empty"):
        split_heldout(ds, n_heldout=4)
    with pytest.raises(ConfigError, match=r"must be in \(0, 1\)"):
        split_heldout(ds, heldout_fraction=1.5)


def test_missing_column_lists_the_columns_the_file_has(tmp_path):
    path = write(tmp_path / "q.jsonl", [{"question": "a", "answer": "b", "meta": 1}])
    with pytest.raises(ConfigError) as err:
        load_prompt_dataset(path, prompt_column="questions")
    assert "Unknown column 'questions' (did you mean 'question'?)" in str(err.value)
    assert "Known: answer, meta, question" in str(err.value)
    with pytest.raises(ConfigError, match="answer_column=None"):
        load_prompt_dataset(path, prompt_column="question", answer_column="solution")


def test_mapping_onto_an_existing_column_is_an_error(tmp_path):
    path = write(tmp_path / "q.jsonl", [{"prompt": "raw", "messages": CHAT, "answer": "4"}])
    with pytest.raises(ConfigError, match="prompt_column='messages' would replace its existing"):
        load_prompt_dataset(path, prompt_column="messages")
    with pytest.raises(ConfigError, match="answer_column=None would replace its existing 'answer'"):
        load_prompt_dataset(path, answer_column=None)


def test_too_few_rows_for_an_iteration():
    ds = datasets.Dataset.from_list([{"prompt_id": "a"}] * 5)
    check_enough_rows(ds, 5, "'q.jsonl'")
    with pytest.raises(ConfigError) as err:
        check_enough_rows(ds, 8, "'q.jsonl'")
    assert "Dataset 'q.jsonl' has 5 rows; one iteration needs 8" in str(err.value)
    assert "Lower rl.prompts_per_iteration to at most 5 or add rows" in str(err.value)


@pytest.mark.parametrize(
    ("prompt", "problem"),
    [
        ("  ", "the prompt is empty"),
        (None, "the prompt is None"),
        ([{"role": "user"}], "the prompt has message 0 = "),
        ([], "the prompt is an empty list"),
    ],
)
def test_bad_prompts_name_the_row_and_id(tmp_path, prompt, problem):
    rows = [{"prompt_id": "ok", "prompt": "x"}, {"prompt_id": "bad", "prompt": prompt}]
    with pytest.raises(ConfigError, match=rf"row 1 \(0-based, prompt_id 'bad'\): {problem}"):
        load_prompt_dataset(write(tmp_path / "q.jsonl", rows), answer_column=None)


def test_missing_answer_says_how_to_fix(tmp_path):
    path = write(tmp_path / "q.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b"}])
    with pytest.raises(ConfigError, match=r"row 1 \(0-based\): answer is None.*answer_column=None"):
        load_prompt_dataset(path)


def test_bad_paths(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_prompt_dataset(tmp_path / "nope.jsonl")
    (tmp_path / "q.txt").write_text("hello\n")
    with pytest.raises(
        ConfigError, match=r"unsupported suffix '\.txt'; use one of \.jsonl, \.json"
    ):
        load_prompt_dataset(tmp_path / "q.txt")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        load_prompt_dataset(tmp_path / "empty.jsonl")
    (tmp_path / "broken.jsonl").write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(ConfigError, match="Could not read"):
        load_prompt_dataset(tmp_path / "broken.jsonl")
    (tmp_path / "plain_dir").mkdir()
    with pytest.raises(ConfigError, match="not one written by save_to_disk"):
        load_prompt_dataset(tmp_path / "plain_dir")
    with pytest.raises(ConfigError, match="single file"):
        load_prompt_dataset(write(tmp_path / "q.jsonl", ROWS), split="test")


def test_episode_rows_need_no_prompt_column(tmp_path):
    """An episode run's rows (``require_prompt=False``): no prompt column, ids from each row's
    whole content (stable, repeats numbered); a prompt column is still required elsewhere."""
    path = tmp_path / "deals.jsonl"
    rows = [
        {"seed": 1, "answer": "hit"},
        {"seed": 2, "answer": "hit"},
        {"seed": 1, "answer": "hit"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    loaded = load_prompt_dataset(path, require_prompt=False)
    assert "prompt" not in loaded.column_names and loaded["seed"] == [1, 2, 1]
    ids = loaded["prompt_id"]
    assert ids[0] != ids[1] and ids[2] == ids[0] + "-2" and ids[0].startswith("deals-")
    assert load_prompt_dataset(path, require_prompt=False)["prompt_id"] == ids  # stable
    with pytest.raises(ConfigError, match=r"column 'prompt'"):
        load_prompt_dataset(path)
    with pytest.raises(ConfigError, match=r"column 'question'"):  # a named column must exist
        load_prompt_dataset(path, prompt_column="question", require_prompt=False)
