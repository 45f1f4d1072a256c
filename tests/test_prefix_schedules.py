"""Prefix-length schedules on hand-worked sequences."""
import json

import numpy as np
import pytest

from jaxprefix.methods.prefix_schedules import (AdaptivePrefix, AnnealedPrefix, FixedPrefix,
                                         make_prefix_schedule)


def test_fixed_keeps_the_prefix():
    s = FixedPrefix()
    assert [s.length('p', 7, step) for step in (0, 10, 1000)] == [7, 7, 7]
    assert s.length('p', 0) == 0
    with pytest.raises(ValueError, match='base length'):
        s.length('p', -1)


def test_annealed_linear_by_hand():
    s = AnnealedPrefix(steps=4, start_fraction=1.0, end_fraction=0.0)
    # fractions 1, .75, .5, .25, 0, then held: of 10 units 10, 7.5->8, 5, 2.5->3, 0.
    assert [s.length('p', 10, step) for step in range(7)] == [10, 8, 5, 3, 0, 0, 0]
    s = AnnealedPrefix(steps=10, start_fraction=0.8, end_fraction=0.2)
    assert [s.length('p', 20, step) for step in (0, 5, 10)] == [16, 10, 4]


def test_annealed_cosine_by_hand():
    s = AnnealedPrefix(steps=4, shape='cosine')
    # fraction = (1 + cos(pi t)) / 2 at t = 0, 1/4, 1/2, 3/4, 1: 1, .8536, .5, .1464, 0.
    np.testing.assert_allclose([s.fraction(k) for k in range(5)],
                               [1.0, 0.853553, 0.5, 0.146447, 0.0], atol=1e-6)
    assert [s.length('p', 100, k) for k in range(5)] == [100, 85, 50, 15, 0]


def test_adaptive_shortens_after_a_full_window():
    s = AdaptivePrefix(window=4, threshold=0.5)
    assert s.length('a', 3) == 3
    s.observe(['a'], [[1.0, 1.0]])             # 2 of 4 outcomes: window not full yet
    assert s.length('a', 3) == 3
    s.observe(['a'], [[1.0, 0.0]])             # 3/4 >= 0.5: one unit off, window restarts
    assert s.length('a', 3) == 2
    s.observe(['a', 'a'], [[0.0, 0.0], [0.0, 1.0]])  # one key twice: 1/4 < 0.5
    assert s.length('a', 3) == 2
    s.observe(['a'], [[1.0, 1.0]])             # sliding window: last four 0,1,1,1 -> shorten
    assert s.length('a', 3) == 1
    for _ in range(4):
        s.observe(['a'], [[1.0, 1.0, 1.0, 1.0]])
    assert s.length('a', 3) == 0               # never below 0
    assert s.state()['removed']['a'] == 3


def test_adaptive_keys_are_independent_and_lengthen_is_optional():
    s = AdaptivePrefix(window=2, threshold=1.0, stride=2, lengthen=True)
    s.length('a', 5), s.length('b', 5)
    s.observe(['a', 'b'], [[1.0, 1.0], [1.0, 0.0]])
    assert (s.length('a', 5), s.length('b', 5)) == (3, 5)
    s.observe(['a'], [[0.0, 0.0]])             # no success at length 3: back to 5
    assert s.length('a', 5) == 5
    s.observe(['a'], [[0.0, 0.0]])             # already the full prefix: stays
    assert s.length('a', 5) == 5
    no_lengthen = AdaptivePrefix(window=2, threshold=1.0)
    no_lengthen.length('a', 5)
    no_lengthen.observe(['a'], [[1.0, 1.0]])
    no_lengthen.observe(['a'], [[0.0, 0.0]])
    assert no_lengthen.length('a', 5) == 4


def test_adaptive_success_reward_and_errors():
    s = AdaptivePrefix(window=2, threshold=0.5, success_reward=0.9)
    s.length('a', 2)
    s.observe(['a'], [[0.5, 0.8]])             # partial credit below 0.9 is no success
    assert s.length('a', 2) == 2
    with pytest.raises(ValueError, match='never saw'):
        s.observe(['zzz'], [[1.0]])
    with pytest.raises(ValueError, match=r'\[len\(keys\)=2, n\]'):
        s.observe(['a', 'a'], [1.0, 1.0])


def test_adaptive_state_round_trip_through_json():
    s = AdaptivePrefix(window=3, threshold=0.6)
    for key in ('a', 'b'):
        s.length(key, 4)
    s.observe(['a', 'b'], [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])  # 'a' shortens
    state = json.loads(json.dumps(s.state()))
    t = AdaptivePrefix(window=3, threshold=0.6)
    t.restore(state)
    assert t.state() == s.state()
    for u in (s, t):                           # both continue identically: 'b' window 0,1,1
        u.observe(['b'], [[1.0, 1.0]])
    assert (t.length('a', 4), t.length('b', 4)) == (s.length('a', 4), s.length('b', 4)) == (3, 3)
    with pytest.raises(ValueError, match="kind 'fixed'"):
        t.restore(FixedPrefix().state())


def test_make_prefix_schedule():
    assert isinstance(make_prefix_schedule(None), FixedPrefix)
    s = make_prefix_schedule({'kind': 'annealed', 'steps': 4, 'shape': 'cosine'})
    assert isinstance(s, AnnealedPrefix) and s.length('p', 100, 2) == 50
    import ml_collections
    s = make_prefix_schedule(ml_collections.ConfigDict({'kind': 'adaptive', 'window': 8}))
    assert isinstance(s, AdaptivePrefix) and s.window == 8
    with pytest.raises(ValueError, match='kind must be one of'):
        make_prefix_schedule({'kind': 'exponential'})
    with pytest.raises(ValueError, match="'annealed': bad fields"):
        make_prefix_schedule({'kind': 'annealed', 'steps': 4, 'window': 3})
    with pytest.raises(ValueError, match='shape'):
        make_prefix_schedule({'kind': 'annealed', 'steps': 4, 'shape': 'step'})
