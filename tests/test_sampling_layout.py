"""Context layout (prompt dedup, held-back last token, buckets) and Rollouts row layout, by hand."""
import numpy as np
import pytest

from jaxprefix.sampling.layout import SharedContext, bucket, layout_contexts
from jaxprefix.sampling.rollouts import Rollouts


def test_bucket():
    assert [bucket(s) for s in (0, 1, 2, 3, 5, 8, 9)] == [1, 1, 2, 4, 8, 8, 16]
    assert bucket(3, minimum=16) == 16 and bucket(17, minimum=16) == 32


def test_plain_contexts_hold_back_their_last_token():
    lay = layout_contexts([[5, 6, 7], [9]], vocab_size=10)
    assert lay.prompts_are_contexts
    assert lay.prompt_tokens.shape == (2, 16) and lay.suffix_tokens.shape == (2, 0)
    np.testing.assert_array_equal(lay.prompt_tokens[0, :3], [5, 6, 0])
    np.testing.assert_array_equal(lay.prompt_positions[0, :3], [0, 1, -1])
    assert (lay.prompt_positions[1] == -1).all()  # a one-token context has an empty prompt
    np.testing.assert_array_equal(lay.last_tokens, [7, 9])
    np.testing.assert_array_equal(lay.last_positions, [2, 0])
    np.testing.assert_array_equal(lay.valid, [True, True])
    assert lay.full_contexts == [[5, 6, 7], [9]]


def test_shared_prompt_is_laid_out_once():
    contexts = [SharedContext([1, 2, 3], [4, 5]), SharedContext([1, 2, 3], [6]), [7, 8],
                SharedContext([1, 2, 3], [])]
    lay = layout_contexts(contexts, vocab_size=10, context_multiple=8)
    assert lay.valid.shape == (8,) and lay.valid.sum() == 4
    assert not lay.prompts_are_contexts
    # Distinct prompts: (1,2,3), (7,), (1,2) (the suffix-less context gives its last token back).
    assert lay.prompt_tokens.shape[0] == 4
    np.testing.assert_array_equal(lay.prompt_index[:4], [0, 0, 1, 2])
    np.testing.assert_array_equal(lay.prompt_tokens[2, :2], [1, 2])
    np.testing.assert_array_equal(lay.suffix_tokens[0, :1], [4])
    np.testing.assert_array_equal(lay.suffix_positions[0, :2], [3, -1])
    assert (lay.suffix_positions[1:] == -1).all()
    np.testing.assert_array_equal(lay.last_tokens[:4], [5, 6, 8, 3])
    np.testing.assert_array_equal(lay.last_positions[:4], [4, 3, 1, 2])
    assert lay.full_contexts == [[1, 2, 3, 4, 5], [1, 2, 3, 6], [7, 8], [1, 2, 3]]


def test_array_of_contexts():
    lay = layout_contexts(np.array([[3, 4], [5, 6]], np.int32), vocab_size=10)
    assert lay.full_contexts == [[3, 4], [5, 6]]


@pytest.mark.parametrize('contexts,match', [
    ([], 'non-empty list'), ([[1], []], r'contexts\[1\] is empty'),
    ([[1, 12]], r'contexts\[0\] must hold integer token ids in \[0, 10\)'),
    ([[1.5]], 'integer token ids'), (SharedContext([1], [2]), 'non-empty list')])
def test_bad_contexts_are_named(contexts, match):
    with pytest.raises(ValueError, match=match):
        layout_contexts(contexts, vocab_size=10)


def test_rollouts_rows():
    completions = np.array([[3, 4, 0], [5, 0, 0], [6, 7, 8], [9, 0, 0]])
    logprobs = -np.arange(12, dtype=np.float32).reshape(4, 3) - 1
    r = Rollouts.from_parts([[1, 2], [1]], completions, logprobs, lengths=[2, 1, 3, 0],
                            stopped=[True, False, False, False], n=2)
    np.testing.assert_array_equal(r.tokens, [[1, 2, 3, 4], [1, 2, 5, 0], [1, 6, 7, 8],
                                             [1, 0, 0, 0]])
    np.testing.assert_array_equal(r.completion_mask, [[0, 0, 1, 1], [0, 0, 1, 0], [0, 1, 1, 1],
                                                      [0, 0, 0, 0]])
    np.testing.assert_array_equal(r.positions, [[0, 1, 2, 3], [0, 1, 2, 0], [0, 1, 2, 3],
                                                [0, 0, 0, 0]])
    np.testing.assert_array_equal(r.logprobs[0], [0, 0, -1, -2])
    np.testing.assert_array_equal(r.logprobs[2], [0, -7, -8, -9])
    np.testing.assert_array_equal(r.group_ids, [0, 0, 1, 1])
    np.testing.assert_array_equal(r.context_lengths, [2, 2, 1, 1])
    np.testing.assert_array_equal(r.token_mask.sum(1), [4, 3, 4, 1])
    assert r.completions() == [[3], [5], [6, 7, 8], []]  # the stop token that ended row 0 left out
    assert r.completions(keep_stop=True) == [[3, 4], [5], [6, 7, 8], []]
    np.testing.assert_array_equal(r.truncated, [False, True, True, True])
    assert r.grouped(np.arange(4)).tolist() == [[0, 1], [2, 3]]

    class Chars:
        def decode(self, ids):
            return ''.join(chr(ord('a') + i) for i in ids)
    assert r.completion_texts(Chars()) == ['d', 'f', 'ghi', '']
    assert r.completion_texts(Chars(), keep_stop=True) == ['de', 'f', 'ghi', '']
