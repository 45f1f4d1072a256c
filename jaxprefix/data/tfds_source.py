"""Problems through TFDS: a local builder that stores Problem records as array_record, and
`tfds.data_source` reading them (or any TFDS dataset with question/answer text fields) back.

Building needs no network and no TensorFlow: `build_problem_dataset(problems, name, data_dir)`
writes `data_dir/jaxprefix_problems/<name>/1.0.0/` once; `tfds_problems("jaxprefix_problems/<name>",
data_dir)` reads it on any host with random access (array_record). Other datasets already
prepared in a `data_dir` are read by field name, as files are.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import numpy as np
import tensorflow_datasets as tfds
from etils import epath

from jaxprefix import storage
from jaxprefix.data.files import Fields, RecordError, read_problem_file, record_to_problem
from jaxprefix.data.problem import DataError, Problem

BUILDER_NAME = "jaxprefix_problems"


class JaxprefixProblems(tfds.core.GeneratorBasedBuilder):
    """Problem records, one TFDS config per named problem set, written as array_record."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Problem records: id, question, answer, solution, steps, source, metadata."}

    # TFDS finds a packaged builder's file through `importlib_resources` (not a dependency here);
    # the file is known, so say it directly.
    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls) -> epath.Path:
        return epath.Path(__file__)

    def __init__(self, *, problems: Sequence[Problem] = (), **kwargs):
        self._problems = list(problems)
        super().__init__(**kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        text = tfds.features.Text()
        # Defined outside TFDS's own package, so `builder=self` (see docs/environment.md).
        return tfds.core.DatasetInfo(builder=self, description=__doc__, features=tfds.features.FeaturesDict({
            "id": text, "question": text, "answer": text,
            "solution": text, "has_solution": tfds.features.Scalar(dtype=np.bool_),
            "steps": tfds.features.Sequence(text), "source": text,
            "metadata_json": text,
        }))

    def _split_generators(self, dl_manager):
        del dl_manager  # nothing to download: the problems are in memory
        return {"train": self._generate_examples()}

    def _generate_examples(self):
        for problem in self._problems:
            yield problem.id, {
                "id": problem.id, "question": problem.question, "answer": problem.answer,
                "solution": problem.solution or "", "has_solution": problem.solution is not None,
                "steps": list(problem.steps), "source": problem.source,
                "metadata_json": json.dumps(dict(problem.metadata), sort_keys=True, default=str),
            }


def build_problem_dataset(problems: Sequence[Problem], name: str, data_dir: str | os.PathLike, *,
                          overwrite: bool = False) -> str:
    """Writes `problems` as TFDS dataset `jaxprefix_problems/<name>`; returns its full name.

    An existing dataset of that name is an error unless `overwrite` (TFDS would otherwise reuse
    the stale one silently).
    """
    if not problems:
        raise DataError(f"build_problem_dataset({name!r}): no problems to write")
    builder = JaxprefixProblems(problems=problems, data_dir=os.fspath(data_dir),
                                config=tfds.core.BuilderConfig(name=name), file_format="array_record")
    if storage.exists(builder.data_dir):
        if not overwrite:
            raise DataError(f"{builder.data_dir}: TFDS dataset {BUILDER_NAME}/{name} exists; "
                            "pass overwrite=True to rebuild it")
        storage.rmtree(builder.data_dir)
    builder.download_and_prepare()
    return f"{BUILDER_NAME}/{name}"


def build_from_file(path: str | os.PathLike, name: str, data_dir: str | os.PathLike, *,
                    overwrite: bool = False, **load_options) -> str:
    """Reads a .jsonl/.json/.parquet problem file (see `read_problem_file`) into a TFDS dataset."""
    return build_problem_dataset(read_problem_file(path, **load_options).problems, name, data_dir,
                                 overwrite=overwrite)


def _decoded(value):
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if hasattr(value, "tolist"):  # numpy scalars and arrays
        value = value.tolist()
    if isinstance(value, list):
        return [_decoded(v) for v in value]
    if isinstance(value, dict):
        return {k: _decoded(v) for k, v in value.items()}
    return value


def _stored_problem(record: dict) -> Problem:
    return Problem(id=record["id"], question=record["question"], answer=record["answer"],
                   solution=record["solution"] if record["has_solution"] else None,
                   steps=tuple(record["steps"]), source=record["source"],
                   metadata=json.loads(record["metadata_json"]))


def tfds_problems(name: str, data_dir: str | os.PathLike | None = None, split: str = "train", *,
                  question_field: str = "question", answer_field: str = "answer",
                  solution_field: str | None = "solution", id_field: str | None = None) -> list[Problem]:
    """Problems of a prepared TFDS dataset, through `tfds.data_source` (no TensorFlow needed).

    Datasets written by `build_problem_dataset` come back exactly; others are read by field name.
    """
    try:
        source = tfds.data_source(name, data_dir=None if data_dir is None else os.fspath(data_dir),
                                  split=split)
    except Exception as e:  # TFDS raises several types for a missing or unprepared dataset
        raise DataError(f"TFDS dataset {name!r} (data_dir={data_dir}, split={split!r}) "
                        f"cannot be opened: {e}") from e
    fields = Fields(question_field, answer_field, solution_field, id_field)
    return _problems_of(source, f"TFDS {name}[{split}]", name.split("/")[0], fields)


def tfds_directory_problems(path: str | os.PathLike, split: str = "train", *,
                            question_field: str = "question", answer_field: str = "answer",
                            solution_field: str | None = "solution",
                            id_field: str | None = None) -> list[Problem]:
    """Problems of a prepared TFDS dataset directory, local or gs:// (the folder holding its
    dataset_info.json, e.g. DATA_DIR/jaxprefix_problems/my_set/1.0.0), as `tfds_problems`."""
    path = os.fspath(path)
    try:
        builder = tfds.builder_from_directory(path)
        source = builder.as_data_source(split=split)
    except Exception as e:  # a missing directory, no dataset_info.json, an unknown split
        raise DataError(f"TFDS dataset directory {path} (split={split!r}) cannot be opened: "
                        f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    fields = Fields(question_field, answer_field, solution_field, id_field)
    return _problems_of(source, f"TFDS {path}[{split}]", builder.name, fields)


def _problems_of(source, label: str, source_name: str, fields: Fields) -> list[Problem]:
    problems, seen = [], set()
    for index in range(len(source)):
        record = _decoded(source[index])
        try:
            if "metadata_json" in record and "has_solution" in record:
                problem = _stored_problem(record)
            else:
                problem = record_to_problem(record, fields, source=source_name)
        except (RecordError, KeyError, TypeError) as e:
            raise DataError(f"{label}:record {index}: {e}") from None
        if problem.id in seen:
            raise DataError(f"{label}:record {index}: duplicate id {problem.id!r}")
        seen.add(problem.id)
        problems.append(problem)
    return problems
