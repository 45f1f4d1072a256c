"""The config.json of published models the configs name, shipped as facts: a model's shapes are
known without its weights (the compile job builds it abstractly from these).

Each file in published/ is the model's config.json as its Hugging Face repository publishes it
(Qwen/Qwen3-4B-Instruct-2507, Qwen/Qwen3-1.7B, Qwen/Qwen3-30B-A3B,
HuggingFaceTB/SmolLM2-135M-Instruct).
"""
from __future__ import annotations

import json
import os
import re

_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'published')


def names() -> list[str]:
    return sorted(f[:-len('.json')] for f in os.listdir(_DIR) if f.endswith('.json'))


def hf_config(name_or_path: str) -> dict | None:
    """The shipped config.json of a model named like `name_or_path` (a repo id, a directory or
    gs:// path ending in the model's name; case-insensitive), or None."""
    tail = re.split(r'[/\\]', name_or_path.rstrip('/\\'))[-1].lower()
    for name in names():
        if name.lower() == tail:
            with open(os.path.join(_DIR, f'{name}.json')) as f:
                return json.load(f)
    return None
