"""RolloutSpec: config.rollout parsed and checked once, generate()'s keywords, the KV budget rule."""
import pytest

from jaxprefix import run_config
from jaxprefix.sampling import RolloutSpec


def test_from_config_reads_every_field_and_gives_generate_its_keywords():
    c = run_config.base_config()
    c.rollout.max_new_tokens, c.rollout.kv_budget_gib, c.rollout.kv_dtype = 32, 0.5, "int8"
    spec = RolloutSpec.from_config(c.rollout)
    assert spec.max_new_tokens == 32 and spec.page_size == c.rollout.page_size
    kw = spec.sampler_keywords()
    # A budget given in GiB binds; no headroom is then asked of the devices.
    assert kw["kv_budget_bytes"] == 2**29 and kw["memory_headroom"] is None
    assert kw["kv_dtype"] == "int8" and kw["max_rows_in_flight"] is None
    # Defaults: no budget (the devices' memory beyond the headroom), the compute dtype's KV.
    default = RolloutSpec(max_new_tokens=8).sampler_keywords()
    assert default["kv_budget_bytes"] is None and default["memory_headroom"] == 0.16
    assert default["kv_dtype"] is None


@pytest.mark.parametrize("field, value, expected", [
    ("page_size", 48, "a power of two"),
    ("kv_reserve", 0.0, r"a fraction in \(0, 1\]"),
    ("kv_dtype", "float8", "the compute dtype"),
    ("memory_headroom", 1.0, r"a fraction in \[0, 1\)"),
    ("max_new_tokens", 0, ">= 1"),
    ("max_turns", 0, r">= 1 \(more than 1: episodes"),
])
def test_a_bad_field_is_refused_naming_it(field, value, expected):
    with pytest.raises(ValueError, match=rf"config\.rollout\.{field}={value!r}: expected "
                                         rf".*{expected}"):
        RolloutSpec(**{"max_new_tokens": 8, field: value})


def test_kv_budget_rule():
    spec = RolloutSpec(max_new_tokens=8, memory_headroom=0.25)
    # 4 chips of 100 bytes: 75 each usable, 30 in use -> 45 each.
    assert spec.kv_budget_bytes(100, 4, 30) == 180
    assert spec.kv_budget_bytes(100, 4, 90) == 0  # never negative
    assert RolloutSpec(max_new_tokens=8, kv_budget_gib=1.0).kv_budget_bytes(100, 4, 30) == 2**30
