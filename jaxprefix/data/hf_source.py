"""Problems from a local Hugging Face dataset, read with pyarrow (no need of the `datasets` library).

`data.source=hf` with `data.path` one of:
- a `save_to_disk` directory: a Dataset (state.json + Arrow files) or a DatasetDict
  (dataset_dict.json + one such directory per split, chosen by `data.split`);
- a hub snapshot (`huggingface-cli download --repo-type dataset`): parquet / JSON lines shards of
  each split, named by it (`data/train-00000-of-00001.parquet`, `test.jsonl`) or in a folder of
  its name (`train/`);
- a single .parquet / .jsonl / .json / .arrow file.
Local or gs:// (jaxprefix.storage). Field names are the file source's (`data.question_field`, ...).
"""
from __future__ import annotations

import os
import re

from jaxprefix import storage
from jaxprefix.data.files import data_files, read_problem_file
from jaxprefix.data.problem import DataError, Problem


def hf_problems(path: str | os.PathLike, split: str = "train", **options) -> list[Problem]:
    """Problems of `split` of the dataset at `path`; `options` as for `read_problem_file`."""
    path = os.fspath(path)
    if storage.isfile(path):
        return read_problem_file(path, **options).problems
    if not storage.isdir(path):
        raise DataError(f"{path}: no such dataset directory or file")
    options.setdefault("source", storage.basename(str(path).rstrip("/")))
    splits_file = storage.join(path, "dataset_dict.json")
    if storage.isfile(splits_file):
        splits = storage.read_json(splits_file).get("splits", [])
        if split not in splits:
            raise DataError(f"{path}: no split {split!r}; the dataset has {', '.join(splits)}")
        return read_problem_file(storage.join(path, split), **options).problems
    if storage.isfile(storage.join(path, "state.json")):  # one save_to_disk Dataset
        return read_problem_file(path, **options).problems
    every = data_files(path)
    chosen = [name for name in every if _of_split(name, split)]
    if not chosen:
        raise DataError(f"{path}: no data files of split {split!r} (named {split}-*.parquet, "
                        f"{split}.jsonl, ... or in a {split}/ folder) among {len(every)} "
                        "data files")
    problems, seen = [], {}
    for name in chosen:
        for problem in read_problem_file(storage.join(path, name), **options).problems:
            if problem.id in seen:
                raise DataError(f"{storage.join(path, name)}: duplicate id {problem.id!r} "
                                f"(also in {seen[problem.id]})")
            seen[problem.id] = name
            problems.append(problem)
    return problems


def _of_split(relative: str, split: str) -> bool:
    *folders, name = relative.split("/")
    return split in folders or re.match(rf"{re.escape(split)}([-_.]|$)", name) is not None
