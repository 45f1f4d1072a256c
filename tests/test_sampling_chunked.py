"""generate() in chunks (sampling/chunked.py): the rollouts of one generate() call, the static
decode's and the continuous one's, whatever the chunk; every chunk's progress a prefix of them."""
import numpy as np
import pytest
from flax import nnx

from jaxprefix import models
from jaxprefix.sampling import SharedContext, generate
from jaxprefix.sampling.chunked import generate_in_chunks

CONFIG = models.ModelConfig(model_type='llama', vocab_size=64, hidden_size=32,
                            intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                            head_dim=8, max_position_embeddings=256, eos_token_ids=(2,))
_rng = np.random.default_rng(0)
A, B, C = (_rng.integers(3, 64, size=size).tolist() for size in (3, 9, 7))
CONTEXTS = [A, B, C, SharedContext(B, A)]
# Stop ids a random 64-token model samples now and then: rows stop at different steps.
REQUEST = dict(n=2, max_new_tokens=20, stop_ids=(5, 9, 17), seed=3, temperature=1.0)


@pytest.fixture(scope='module')
def model():
    return models.Decoder(CONFIG, rngs=nnx.Rngs(0))


# Every row in flight (the static decode), or 3 at a time (the continuous one).
@pytest.mark.parametrize('rows', [None, 3])
@pytest.mark.parametrize('chunk_steps', [1, 6])
def test_chunks_give_generates_rollouts_and_prefixes_of_them(model, rows, chunk_steps):
    whole = generate(model, CONTEXTS, max_rows_in_flight=rows, **REQUEST)
    assert whole.stopped.any() and not whole.stopped.all(), whole.lengths
    progress = list(generate_in_chunks(model, CONTEXTS, chunk_steps=chunk_steps,
                                       max_rows_in_flight=rows, **REQUEST))
    *chunks, last = progress
    assert len(chunks) >= 20 // chunk_steps - 1 and all(p.rollouts is None for p in chunks)
    r = last.rollouts
    assert r.completions() == whole.completions()
    np.testing.assert_array_equal(r.logprobs, whole.logprobs)
    np.testing.assert_array_equal(r.lengths, whole.lengths)
    np.testing.assert_array_equal(r.stopped, whole.stopped)
    final = whole.completions(keep_stop=True)
    for before, after in zip(progress, progress[1:]):
        assert (before.lengths <= after.lengths).all()
    for p in progress:
        for row, length in enumerate(p.lengths):
            assert p.completions[row, :length].tolist() == final[row][:length]


def test_unwanted_rows_stop_at_the_next_chunk_and_the_others_are_unchanged(model):
    """The static decode: rows 0 and 5 are unwanted after the first chunk of 4 steps."""
    request = REQUEST | dict(stop_ids=())  # no row stops by itself: all go to max_new_tokens
    whole = generate(model, CONTEXTS, **request)
    progress = list(generate_in_chunks(model, CONTEXTS, chunk_steps=4,
                                       unwanted=lambda: [0, 5], **request))
    r = progress[-1].rollouts
    np.testing.assert_array_equal(r.lengths, [4 if row in (0, 5) else 20 for row in range(8)])
    kept = [row for row in range(8) if row not in (0, 5)]
    assert [r.completions()[row] for row in kept] == [whole.completions()[row] for row in kept]
    assert r.completions()[0] == whole.completions()[0][:4]
