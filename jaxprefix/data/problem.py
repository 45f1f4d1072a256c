"""The Problem record: one question, its reference answer and, where known, its oracle solution.

POPE and PrefixRL condition the policy on a prefix of the oracle solution (the privileged
information), so a problem carries the solution text and, where a source knows them, its steps.
Records are frozen, hashable (by id) and picklable, so verifier worker processes receive them as
they are and a problem can key a dict of per-problem statistics.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterator, Mapping
from typing import Any

from jaxprefix.errors import UserError


class DataError(UserError, ValueError):
    """A source could not be read as Problem records; the message names file, line and field."""


class FrozenMetadata(Mapping):
    """A read-only mapping of JSON values that pickles and compares like a dict.

    Values are normalised through JSON on construction (tuples become lists, unknown objects
    their text), so a record survives `to_json`/`from_json`, TFDS and parquet unchanged.
    """

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, Any] | None = None):
        object.__setattr__(self, "_items", json.loads(_canonical_json(dict(items or {}))))

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __setattr__(self, name, value):
        raise AttributeError("FrozenMetadata is read-only")

    def __getstate__(self):
        return self._items

    def __setstate__(self, items):
        object.__setattr__(self, "_items", items)

    def __eq__(self, other) -> bool:
        return isinstance(other, Mapping) and dict(self._items) == dict(other)

    def __hash__(self) -> int:
        return hash(_canonical_json(self._items))

    def __repr__(self) -> str:
        return f"FrozenMetadata({self._items!r})"


def _canonical_json(value: Any) -> str:
    # default=str: generator metadata may hold tuples of sets or other objects JSON cannot name;
    # the record keeps them as text rather than failing the whole load.
    try:
        return json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)
    except TypeError:  # keys of mixed types cannot be sorted; their given order is still stable
        return json.dumps(value, ensure_ascii=False, default=str)


def content_id(source: str, question: str) -> str:
    """A stable id from the content: identical across reloads, machines and Python versions."""
    digest = hashlib.sha256(f"{source}\x00{question}".encode("utf-8")).hexdigest()
    return f"{source or 'problem'}-{digest[:16]}"


@dataclasses.dataclass(frozen=True)
class Problem:
    """One problem. `solution` is the oracle text; `steps` its steps where the source knows them."""

    id: str
    question: str
    answer: str
    solution: str | None = None
    steps: tuple[str, ...] = ()
    source: str = ""
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=FrozenMetadata)

    def __post_init__(self):
        for name in ("id", "question", "answer", "source"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise TypeError(f"Problem.{name}: expected str, got {type(value).__name__}")
        if self.solution is not None and not isinstance(self.solution, str):
            raise TypeError(f"Problem.solution: expected str or None, got {type(self.solution).__name__}")
        steps = tuple(self.steps)
        if not all(isinstance(step, str) for step in steps):
            raise TypeError("Problem.steps: expected a sequence of str")
        object.__setattr__(self, "steps", steps)
        if not isinstance(self.metadata, FrozenMetadata):
            object.__setattr__(self, "metadata", FrozenMetadata(self.metadata))

    # Identity is the id: two loads of one file give equal, equally hashed records.
    def __hash__(self) -> int:
        return hash(self.id)

    @property
    def oracle_steps(self) -> tuple[str, ...]:
        """Steps of the oracle solution: the given steps, else the solution's non-empty lines."""
        if self.steps:
            return self.steps
        if self.solution is None:
            return ()
        return tuple(line for line in self.solution.split("\n") if line.strip())

    def to_json(self) -> str:
        record = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        record["steps"] = list(self.steps)
        record["metadata"] = dict(self.metadata)
        return _canonical_json(record)

    @classmethod
    def from_json(cls, text: str) -> "Problem":
        record = json.loads(text)
        record["steps"] = tuple(record.get("steps", ()))
        return cls(**record)
