"""Which config fields a piece of code reads: a recording view over a ConfigDict.

    view, reads = recording(config)
    settings = resolve(view)       # every field it reads lands in `reads` ('train.learning_rate')

The view reads through to the config: a leaf read (attribute, item, get) records its dotted
name; a block read whole (iterated, its items, to_dict, `**block`) records every leaf under it;
a copy (copy_and_resolve_references) records into the same set, and writes go to the config; a
view of a view records into both (a part's reads, and the whole's). So
the settings builders need no bookkeeping of their own: what a job's settings read is a fact
(run_setup/preflight refuses a set field that nothing read).
"""
from __future__ import annotations

from typing import Any

from jaxprefix.config_fields import leaves


def recording(config) -> tuple[Any, set[str]]:
    """(a view of `config` that records its reads, the set they are recorded in)."""
    reads: set[str] = set()
    return _Recording(config, "", reads), reads


def unwrapped(config):
    """The ConfigDict under a recording view, or views (a config that is none, itself)."""
    while isinstance(config, _Recording):
        config = config._config
    return config


def read_whole(config, name: str) -> set[str]:
    """The dotted names a read of `name` (dotted) whole records: the field, or every leaf of the
    block (none when the config lacks it)."""
    view, reads = recording(config)
    *blocks, last = name.split(".")
    for block in blocks:
        if block not in view:
            return reads
        view = view[block]
    if last in view:
        value = view[last]
        if isinstance(value, _Recording):
            value.to_dict()
    return reads


def _is_block(value) -> bool:
    return hasattr(value, "items")  # a ConfigDict, or a recording view of one (views nest)


class _Recording:
    __slots__ = ("_config", "_prefix", "_reads")

    def __init__(self, config, prefix: str, reads: set[str]):
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "_prefix", prefix)
        object.__setattr__(self, "_reads", reads)

    def _read(self, name: str):
        value = self._config[name]
        if _is_block(value):
            return _Recording(value, f"{self._prefix}{name}.", self._reads)
        self._reads.add(self._prefix + name)
        return value

    def _read_all(self) -> None:
        self._reads.update(name for name, _ in leaves(self._config, self._prefix))

    def __getattr__(self, name: str):
        if name in self._config:
            return self._read(name)
        return getattr(self._config, name)  # the ConfigDict's own methods (lock, ...)

    def __getitem__(self, name: str):
        return self._read(name)

    def get(self, name: str, default=None):
        return self._read(name) if name in self._config else default

    def __contains__(self, name) -> bool:
        return name in self._config

    def __setattr__(self, name: str, value) -> None:
        setattr(self._config, name, value)

    def __setitem__(self, name: str, value) -> None:
        self._config[name] = value

    def update(self, *args, **kwargs) -> None:
        self._config.update(*args, **kwargs)

    def keys(self):
        self._read_all()
        return self._config.keys()

    def items(self):
        self._read_all()
        return self._config.items()

    def values(self):
        self._read_all()
        return self._config.values()

    def __iter__(self):
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self._config)

    def to_dict(self) -> dict:
        self._read_all()
        return self._config.to_dict()

    def copy_and_resolve_references(self) -> _Recording:
        return _Recording(self._config.copy_and_resolve_references(), self._prefix, self._reads)

    def __repr__(self) -> str:
        return f"recording({self._config!r})"
