"""Config fields declared with their one-line doc: `Field(default, doc)`, written once.

run_config.py declares every block as a dict of `Field`s (nested dicts for sub-blocks);
`build` turns such a spec into the ConfigDict a config file edits, and `docs` into the
`dotted.name -> doc` table that the describe job prints and a misspelt field's error searches.

    spec = {"rollout": {"n": Field(8, "samples per problem")}}
    build(spec).rollout.n == 8;  docs(spec) == {"rollout.n": "samples per problem"}
"""
from __future__ import annotations

import difflib
from typing import Any, Iterator, NamedTuple

import ml_collections


class Field(NamedTuple):
    default: Any
    doc: str


def build(spec: dict) -> ml_collections.ConfigDict:
    """The ConfigDict of a spec: each Field's default, each nested dict a block."""
    return ml_collections.ConfigDict({
        name: build(value) if isinstance(value, dict) else value.default
        for name, value in spec.items()})


def docs(spec: dict, prefix: str = "") -> dict[str, str]:
    """`dotted.name -> doc` for every Field of a spec."""
    table = {}
    for name, value in spec.items():
        if isinstance(value, dict):
            table.update(docs(value, f"{prefix}{name}."))
        else:
            table[prefix + name] = value.doc
    return table


def leaves(config, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted name, value) of every leaf field of a ConfigDict, in its order."""
    for name, value in config.items():
        if hasattr(value, "items"):
            yield from leaves(value, f"{prefix}{name}.")
        else:
            yield prefix + name, value


def describe(config, table: dict[str, str]) -> list[str]:
    """One line per leaf field: `dotted.name = value  # what it does`."""
    return [f"{name} = {value!r}  # {table.get(name, '(no doc)')}"
            for name, value in leaves(config)]


def nearest(name: str, names, n: int = 3) -> list[str]:
    """The known dotted names closest to a misspelt one (difflib), best first."""
    names = list(names)
    close = difflib.get_close_matches(name, names, n=n, cutoff=0.6)
    if not close:  # a misspelt leaf under a long block name: compare the last parts
        tail = name.rsplit(".", 1)[-1]
        close = [m for m in names if m.rsplit(".", 1)[-1] in
                 difflib.get_close_matches(tail, [x.rsplit(".", 1)[-1] for x in names],
                                           n=n, cutoff=0.7)][:n]
    return close
