"""data.source=hf (save_to_disk directories, hub snapshots, files) and data.source=tfds (a dataset
directory), through the config as a run reads them."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxprefix.data import DataError
from jaxprefix.run_setup.problem_sets import load_problem_sets
from jaxprefix.run_config import base_config

# Field names unlike ours, as many exports have them.
RECORDS = [{"problem": f"What is {i} + {i}?", "worked": f"{i} + {i} = {2 * i}", "final": 2 * i,
            "level": i % 3} for i in range(10)]


def data_config(source, path, **fields):
    c = base_config()
    c.data.update(source=source, path=str(path), question_field="problem",
                  solution_field="worked", answer_field="final", train_size=0, eval_size=0,
                  **fields)
    return c.data


def check(problems, records):
    assert [p.question for p in problems] == [r["problem"] for r in records]
    assert [p.answer for p in problems] == [str(r["final"]) for r in records]
    assert [p.solution for p in problems] == [r["worked"] for r in records]
    assert [p.metadata["level"] for p in problems] == [r["level"] for r in records]


def test_save_to_disk_dataset_and_dataset_dict(tmp_path):
    datasets = pytest.importorskip("datasets")
    train, test = datasets.Dataset.from_list(RECORDS[:7]), datasets.Dataset.from_list(RECORDS[7:])
    train.save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict(train=train, test=test).save_to_disk(str(tmp_path / "both"))

    check(load_problem_sets(data_config("hf", tmp_path / "one")).train, RECORDS[:7])
    sets = load_problem_sets(data_config("hf", tmp_path / "both", eval_split="test"))
    check(sets.train, RECORDS[:7])
    check(sets.eval, RECORDS[7:])
    assert load_problem_sets(data_config("hf", tmp_path / "both")).eval == []  # none asked for
    with pytest.raises(DataError, match="no split 'validation'; the dataset has train, test"):
        load_problem_sets(data_config("hf", tmp_path / "both", split="validation"))


def test_hub_snapshot_shards_by_split_and_single_files(tmp_path):
    snapshot = tmp_path / "snapshot"
    (snapshot / "data").mkdir(parents=True)
    shards = [RECORDS[:4], RECORDS[4:7]]
    for i, shard in enumerate(shards):
        pq.write_table(pa.Table.from_pylist(shard), snapshot / "data" / f"train-0000{i}-of-00002.parquet")
    with open(snapshot / "data" / "test.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in RECORDS[7:])
    (snapshot / "README.md").write_text("# a dataset card")

    sets = load_problem_sets(data_config("hf", snapshot, eval_split="test"))
    check(sets.train, RECORDS[:7])
    check(sets.eval, RECORDS[7:])
    # One file; eval from another path (its split name is ignored for a file).
    sets = load_problem_sets(data_config("hf", snapshot / "data" / "train-00001-of-00002.parquet",
                                         eval_path=str(snapshot / "data" / "test.jsonl")))
    check(sets.train, RECORDS[4:7])
    check(sets.eval, RECORDS[7:])
    with pytest.raises(DataError, match="no data files of split 'validation'"):
        load_problem_sets(data_config("hf", snapshot, split="validation"))


def test_a_bad_record_names_its_file_row_and_field(tmp_path):
    records = RECORDS[:3] + [{"problem": "no answer here", "worked": "", "level": 0}]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "train.parquet")
    with pytest.raises(DataError, match=r"train.parquet:row 3: field 'final': expected a non-empty string") as error:
        load_problem_sets(data_config("hf", tmp_path))
    assert "\n" not in str(error.value)


def test_tfds_dataset_directory(tmp_path):
    from jaxprefix.data import tfds_source
    from jaxprefix.data.files import read_problem_file

    path = tmp_path / "problems.jsonl"
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in RECORDS)
    original = read_problem_file(path, question_field="problem", solution_field="worked",
                                 answer_field="final").problems
    tfds_source.build_problem_dataset(original, "mine", tmp_path / "tfds")
    directory = tmp_path / "tfds" / "jaxprefix_problems" / "mine" / "1.0.0"
    sets = load_problem_sets(data_config("tfds", directory))
    assert sorted(sets.train, key=lambda p: p.id) == sorted(original, key=lambda p: p.id)
    with pytest.raises(DataError, match="TFDS dataset directory .*absent.* cannot be opened") as error:
        load_problem_sets(data_config("tfds", tmp_path / "absent"))
    assert "\n" not in str(error.value)
