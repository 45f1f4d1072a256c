"""Problems from JSONL, JSON and parquet files, with configurable field names and precise errors.

The exports users already have (DAPO-Math, OpenR1, POPE-style sets) name their fields differently
(`prompt`/`problem`/`question`, `solution`, `answer`, or nested like `reward_model.ground_truth`),
so field names are arguments and may be dotted paths into nested objects. A question may also be a
list of chat messages (DAPO's `prompt`), from which the last user turn is taken.

A user's file is never half-read silently: the first bad record raises a `DataError` naming the
file, the line (or row) and the field, unless `skip_invalid=True`, which skips bad records and
reports each one in the returned `LoadReport` (and logs how many).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from typing import Any

from absl import logging

from jaxprefix import storage
from jaxprefix.data.problem import DataError, Problem, content_id

SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")


@dataclasses.dataclass(frozen=True)
class Fields:
    """Where each part of a Problem lives in a record; dotted names reach into nested objects."""

    question: str = "question"
    answer: str = "answer"
    solution: str | None = "solution"
    id: str | None = None  # None: a content hash of source and question
    steps: str | None = None


@dataclasses.dataclass
class LoadReport:
    """The problems read from one file and a message for each record skipped."""

    path: str
    problems: list[Problem]
    skipped: list[str]
    locations: list[str] = dataclasses.field(default_factory=list)  # per problem: 'line 7'


class RecordError(Exception):
    """A bad record; the caller adds the file and location."""


def load_problems(path: str | os.PathLike, **options) -> list[Problem]:
    """Problems of a .jsonl, .json, .parquet or .arrow file, or of a directory of them; see
    `read_problem_file` for the options."""
    return read_problem_file(path, **options).problems


def read_problem_file(
    path: str | os.PathLike,
    *,
    question_field: str = "question",
    answer_field: str = "answer",
    solution_field: str | None = "solution",
    id_field: str | None = None,
    steps_field: str | None = None,
    source: str | None = None,
    require_solution: bool = False,
    skip_invalid: bool = False,
) -> LoadReport:
    """Reads every record of `path` into a Problem; fields not used are kept as metadata.

    Args:
      path: a .jsonl (one object per line), .json (a list of objects), .parquet or .arrow (an
        Arrow stream, as HF datasets' save_to_disk writes) file, or a directory: a save_to_disk
        directory (its state.json lists the files) or any directory of such files (sorted).
      *_field: where the parts live in each record (dotted paths allowed).
      source: the problems' source name; defaults to the file name without its suffix.
      require_solution: a record without an oracle solution is invalid (POPE, PrefixRL need one).
      skip_invalid: skip bad records (reported in `LoadReport.skipped`) instead of raising.
    """
    path = os.fspath(path)
    fields = Fields(question_field, answer_field, solution_field, id_field, steps_field)
    if source is None:
        source = storage.basename(path).split(".")[0]
    problems, skipped, first_seen, locations = [], [], {}, []
    for location, record in _records(path):
        try:
            if isinstance(record, RecordError):
                raise record
            problem = record_to_problem(record, fields, source, require_solution)
            if problem.id in first_seen:
                raise RecordError(f"field '{fields.id or 'id'}': duplicate id {problem.id!r} "
                                   f"(first seen at {first_seen[problem.id]})")
        except RecordError as e:
            message = f"{path}:{location}: {e}"
            if not skip_invalid:
                raise DataError(message) from None
            skipped.append(message)
            continue
        first_seen[problem.id] = location
        problems.append(problem)
        locations.append(location)
    if not problems:
        reason = f"all {len(skipped)} records invalid, first: {skipped[0]}" if skipped else "it is empty"
        raise DataError(f"{path}: no problems could be read ({reason})")
    if skipped:
        logging.warning("%s: skipped %d invalid records of %d; first: %s", path, len(skipped),
                        len(skipped) + len(problems), skipped[0])
    return LoadReport(path, problems, skipped, locations)


def read_records(path: str | os.PathLike) -> Iterator[tuple[str, dict]]:
    """(location, record) of each record of a .jsonl / .json / .parquet file, for other readers
    of such files (trace pools); a record that cannot be decoded raises a DataError naming the
    file and the line."""
    path = os.fspath(path)
    for location, record in _records(path):
        if isinstance(record, RecordError):
            raise DataError(f"{path}:{location}: {record}")
        yield location, record


def _records(path: str) -> Iterator[tuple[str, dict | RecordError]]:
    """(location, record) pairs; a record that cannot be decoded comes as a RecordError."""
    if storage.isdir(path):
        yield from _directory_records(path)
        return
    if not storage.isfile(path):
        raise DataError(f"{path}: no such file")
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".jsonl":
        yield from _jsonl_records(path)
    elif suffix == ".json":
        yield from _json_records(path)
    elif suffix == ".parquet":
        yield from _parquet_records(path)
    elif suffix == ".arrow":
        yield from _arrow_records(path)
    else:
        raise DataError(f"{path}: unknown file type {suffix!r}; expected one of {', '.join(SUFFIXES)}")


def _jsonl_records(path: str):
    with storage.open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            location = f"line {number}"
            try:
                text = raw.decode("utf-8-sig" if number == 1 else "utf-8")  # tolerate a BOM
            except UnicodeDecodeError as e:
                yield location, RecordError(f"not valid UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1})")
                continue
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as e:
                yield location, RecordError(f"malformed JSON: {e.msg} at column {e.colno}")
                continue
            if not isinstance(record, dict):
                yield location, RecordError(f"expected a JSON object, got {type(record).__name__}")
                continue
            yield location, record


def _json_records(path: str):
    raw = storage.read_bytes(path)
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise DataError(f"{path}:line {line}: not valid UTF-8 (byte {raw[e.start]:#04x})") from None
    if not text.strip():
        return
    try:
        records = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:line {e.lineno}: malformed JSON: {e.msg} at column {e.colno}") from None
    if not isinstance(records, list):
        raise DataError(f"{path}: expected a JSON list of objects, got {type(records).__name__}")
    for index, record in enumerate(records):
        location = f"record {index}"
        if isinstance(record, dict):
            yield location, record
        else:
            yield location, RecordError(f"expected a JSON object, got {type(record).__name__}")


def _parquet_records(path: str):
    import pyarrow.parquet as pq  # only parquet users pay for the import

    try:
        table = pq.read_table(storage.local_copy(path))
    except Exception as e:  # pyarrow raises several types for corrupt or non-parquet files
        raise DataError(f"{path}: not a readable parquet file: {e}") from None
    for index, record in enumerate(table.to_pylist()):
        yield f"row {index}", record


def _arrow_records(path: str):
    import pyarrow as pa

    try:
        with pa.memory_map(storage.local_copy(path)) as source:
            table = pa.ipc.open_stream(source).read_all()
    except Exception as e:  # pyarrow raises several types for files of another format
        raise DataError(f"{path}: not a readable Arrow stream file: {e}") from None
    for index, record in enumerate(table.to_pylist()):
        yield f"row {index}", record


def data_files(path: str) -> list[str]:
    """The data files of a directory (local or gs://), relative to it: those a save_to_disk
    state.json lists, else every file with a known suffix beneath it (hidden folders skipped),
    sorted."""
    state = storage.join(path, "state.json")
    if storage.isfile(state):
        return [entry["filename"] for entry in storage.read_json(state)["_data_files"]]
    splits_file = storage.join(path, "dataset_dict.json")
    if storage.isfile(splits_file):
        splits = storage.read_json(splits_file).get("splits", [])
        raise DataError(f"{path}: a dataset with splits {', '.join(splits)}: read one split "
                        f"(data.source=hf with data.split, or the split's directory)")
    return sorted(name for name in _walk(path) if os.path.splitext(name)[1].lower() in SUFFIXES)


def _walk(path: str, prefix: str = "") -> Iterator[str]:
    """Relative names of the files beneath `path`, hidden entries skipped."""
    for name in storage.listdir(path):
        if name.startswith("."):
            continue
        if storage.isdir(storage.join(path, name)):
            yield from _walk(storage.join(path, name), f"{prefix}{name}/")
        else:
            yield prefix + name


def _directory_records(path: str):
    names = data_files(path)
    if not names:
        raise DataError(f"{path}: no data files ({', '.join(SUFFIXES)}) in this directory")
    for name in names:
        for location, record in _records(storage.join(path, name)):
            yield f"{name}:{location}", record


def _lookup(record: dict, name: str) -> tuple[bool, Any]:
    value = record
    for part in name.split("."):
        if not isinstance(value, dict) or part not in value:
            return False, None
        value = value[part]
    return True, value


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"


def _question_text(value: Any, name: str) -> str:
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        turns = [m.get("content") for m in value if m.get("role") == "user"]
        value = turns[-1] if turns else None
        if not isinstance(value, str):
            raise RecordError(f"field '{name}': a list of chat messages without a user turn of text")
    if not isinstance(value, str) or not value.strip():
        raise RecordError(f"field '{name}': expected a non-empty string, got {_describe(value)}")
    return value


def _answer_text(value: Any, name: str) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str) or not value.strip():
        raise RecordError(f"field '{name}': expected a non-empty string or a number, got {_describe(value)}")
    return value.strip()


def _string_list(value: Any, name: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise RecordError(f"field '{name}': expected a list of strings, got {_describe(value)}")
    return tuple(value)


def record_to_problem(record: dict, fields: Fields, source: str, require_solution: bool = False) -> Problem:
    """One decoded record as a Problem; raises RecordError (no location) when it is invalid."""
    def required(name):
        found, value = _lookup(record, name)
        if not found:
            present = ", ".join(map(str, record)) or "none"
            raise RecordError(f"field '{name}' is missing (fields present: {present})")
        return value

    question = _question_text(required(fields.question), fields.question)
    answer = _answer_text(required(fields.answer), fields.answer)

    solution, steps = None, ()
    if fields.solution is not None:
        found, value = _lookup(record, fields.solution)
        if isinstance(value, list):  # a solution given as its steps
            steps = _string_list(value, fields.solution)
            solution = "\n".join(steps)
        elif isinstance(value, str) and value.strip():
            solution = value
        elif found and value is not None and not isinstance(value, str):
            raise RecordError(f"field '{fields.solution}': expected a string or a list of strings, "
                               f"got {_describe(value)}")
    if require_solution and solution is None:
        raise RecordError(f"field '{fields.solution}': an oracle solution is required (require_solution=True)")
    if fields.steps is not None:
        steps = _string_list(required(fields.steps), fields.steps)

    if fields.id is not None:
        raw_id = required(fields.id)
        if isinstance(raw_id, bool) or not isinstance(raw_id, (str, int)) or str(raw_id) == "":
            raise RecordError(f"field '{fields.id}': expected a non-empty string or an integer id, "
                               f"got {_describe(raw_id)}")
        problem_id = str(raw_id)
    else:
        problem_id = content_id(source, question)

    used = {name for name in (fields.question, fields.answer, fields.solution, fields.id, fields.steps)
            if name is not None and "." not in name}
    metadata = {key: value for key, value in record.items() if key not in used}
    return Problem(id=problem_id, question=question, answer=answer, solution=solution, steps=steps,
                   source=source, metadata=metadata)
