"""The continuous decode against the static one: same rollouts for any rows in flight, devices and
KV budget; bounded compiles; memory that follows the rows in flight, not the request."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxprefix import models
from jaxprefix.models import make_mesh, shard_model
from jaxprefix.models.sharding import param_shardings
from jaxprefix.sampling import SharedContext, budget, generate, sampler
from jaxprefix.sampling.sampler import TRACE_COUNTS

# GQA (4 query heads over 2 KV heads), small enough that a decode step is B-independent in f32.
CONFIG = models.ModelConfig(model_type='llama', vocab_size=64, hidden_size=32,
                            intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                            head_dim=8, max_position_embeddings=256, eos_token_ids=(2,))
_rng = np.random.default_rng(0)
A, B, C, D, E = (_rng.integers(3, 64, size=size).tolist() for size in (3, 9, 7, 12, 5))
# Mixed lengths, and a prompt shared by three contexts (one of them with no suffix).
CONTEXTS = [A, B, C, D, E, SharedContext(B, A), SharedContext(B, []), SharedContext(B, C)]
# Stop ids a random 64-token model samples within ~20 tokens now and then: rows stop at many
# different steps, some never (checked in the test, so the request keeps its teeth).
REQUEST = dict(n=3, max_new_tokens=20, stop_ids=(5, 9, 17), seed=3)


def make_model():
    return models.Decoder(CONFIG, rngs=nnx.Rngs(0))


@pytest.fixture(scope='module')
def model():
    return make_model()


@pytest.fixture(scope='module')
def static(model):
    """temperature -> the static decode's rollouts (every row in flight)."""
    cache = {}

    def get(temperature):
        if temperature not in cache:
            cache[temperature] = generate(model, CONTEXTS, temperature=temperature, **REQUEST)
        return cache[temperature]
    return get


def assert_same_rollouts(r, reference):
    assert r.routes is None  # a dense model's rollouts record no experts
    assert r.completions() == reference.completions()
    np.testing.assert_allclose(r.logprobs, reference.logprobs, atol=1e-6, rtol=0)
    np.testing.assert_array_equal(r.lengths, reference.lengths)
    np.testing.assert_array_equal(r.stopped, reference.stopped)


# One row at a time; a few rows on small pages (pages run out: preemption); greedy on large
# pages; every row at once (the static decode).
@pytest.mark.parametrize('rows,temperature,page_size', [
    (1, 1.0, 128), (3, 1.0, 16), (8, 0.0, 128), (24, 1.0, 16)])
def test_rows_in_flight_do_not_change_rollouts(model, static, rows, temperature, page_size):
    reference = static(temperature)
    stopped_at = set(reference.lengths[reference.stopped].tolist())
    assert len(stopped_at) >= 3 and not reference.stopped.all(), reference.lengths
    req = sampler.prepare_request(model, CONTEXTS, temperature=temperature, top_p=1.0, top_k=0,
                           max_rows_in_flight=rows, kv_budget_bytes=None, page_size=page_size,
                           **REQUEST)
    # 24 rows: every row fits, so the static decode runs; fewer: the continuous one, with that cap.
    assert (req.plan is None) == (rows >= 24)
    assert req.plan is None or req.plan.rows_in_flight == rows
    r = generate(model, CONTEXTS, temperature=temperature, max_rows_in_flight=rows,
                 page_size=page_size, **REQUEST)
    assert_same_rollouts(r, reference)


def test_a_dense_model_records_no_routes(model, static):
    assert static(1.0).routes is None
    with pytest.raises(ValueError, match='record_routes: the model has no sparse'):
        generate(model, CONTEXTS, temperature=1.0, record_routes=True, **REQUEST)


def test_kv_budget_sets_rows_in_flight(model, static):
    page_token = budget.page_bytes_per_token(CONFIG, 'float32')  # 256 bytes
    # 3 = ceil(6/3) + 1 group slots of 16 + 16 context tokens and 6 pages of 32 tokens (a row's
    # whole bucket: one page each) fit; 7 rows (4 group slots) do not.
    allowed = (3 * 32 + 6 * 32) * page_token
    req = sampler.prepare_request(model, CONTEXTS, temperature=1.0, top_p=1.0, top_k=0,
                           max_rows_in_flight=None, kv_budget_bytes=allowed, **REQUEST)
    assert req.plan == budget.ContinuousPlan(shards=1, row_slots=6, context_slots=3, admit=2,
                                           page_size=32, pages=6, reserve=1)
    r = generate(model, CONTEXTS, temperature=1.0, kv_budget_bytes=allowed, **REQUEST)
    assert_same_rollouts(r, static(1.0))


def test_rows_preempted_when_pages_run_out_draw_the_same_tokens(model, static):
    # Pages of 16 tokens, each active row promised 1 of its 2: 8 rows start on the pages of 4
    # whole rows (beside 4 = ceil(8/3) + 1 group slots), so rows that grow past 16 tokens run
    # the pool dry and the youngest give their pages back and start again.
    page_token = budget.page_bytes_per_token(CONFIG, 'float32')
    allowed = (4 * 32 + 8 * 16) * page_token
    req = sampler.prepare_request(model, CONTEXTS, temperature=1.0, top_p=1.0, top_k=0,
                           max_rows_in_flight=8, kv_budget_bytes=allowed, page_size=16,
                           reserve_fraction=0.5, **REQUEST)
    assert (req.plan.row_slots, req.plan.pages, req.plan.reserve) == (8, 8, 1)
    reference = static(1.0)
    assert (reference.lengths > 16).sum() > 8  # more rows outgrow one page than pages allow
    r = generate(model, CONTEXTS, temperature=1.0, max_rows_in_flight=8, kv_budget_bytes=allowed,
                 page_size=16, reserve_fraction=0.5, **REQUEST)
    assert_same_rollouts(r, reference)


def test_preemption_takes_the_fewest_youngest_rows():
    from jaxprefix.sampling.page_pool import youngest_to_preempt
    active = jnp.array([True, True, True, False, True])  # row 3 queued
    started = jnp.array([0, 5, 3, 9, 7])
    held = jnp.array([3, 1, 2, 0, 1])
    needs = jnp.array([True, True, False, False, True])
    # 1 free page, 3 needed: giving back row 4's (youngest: 1 page, and its own need) leaves
    # 2 needed, 2 free. Rows 1 then 2 would come next.
    picked = youngest_to_preempt(active, started, held, jnp.int32(1), needs)
    assert picked.tolist() == [False, False, False, False, True]
    picked = youngest_to_preempt(active, started, held, jnp.int32(0), needs)
    assert picked.tolist() == [False, True, False, False, True]
    picked = youngest_to_preempt(active, started, held, jnp.int32(3), needs)
    assert not picked.any()


def test_eight_devices_equal_one(model, static, tmp_path):
    mesh = make_mesh(8, 1, 1)
    sharded = shard_model(make_model(), mesh)
    assert len(sharded.embed[...].sharding.device_set) == 8
    # 16 rows over 8 devices: 2 row slots per device, each device admitting its own contexts.
    r = generate(sharded, CONTEXTS, temperature=1.0, max_rows_in_flight=16, page_size=16,
                 **REQUEST)
    assert_same_rollouts(r, static(1.0))


@pytest.mark.parametrize('rows', [6, None])
def test_tensor_parallel_decode_equals_fsdp_weights(model, static, rows):
    """Weights trained under FSDP, resharded for a decode with heads over 'tensor' (2 of the 8
    devices; rows over the other 4): the same rollouts as one device."""
    sharded = shard_model(make_model(), make_mesh(1, 8, 1))
    req = sampler.prepare_request(sharded, CONTEXTS, temperature=1.0, top_p=1.0, top_k=0,
                           max_rows_in_flight=rows, kv_budget_bytes=None, tensor_parallel=2,
                           **REQUEST)
    assert dict(req.mesh.shape) == {'data': 4, 'fsdp': 1, 'tensor': 2}
    r = generate(sharded, CONTEXTS, temperature=1.0, max_rows_in_flight=rows, page_size=16,
                 tensor_parallel=2, **REQUEST)
    assert_same_rollouts(r, static(1.0))


def test_varying_requests_do_not_recompile(model):
    kwargs = dict(n=3, max_rows_in_flight=4, stop_ids=(5,))
    generate(model, [A, B, C], max_new_tokens=20, temperature=1.0, seed=1, **kwargs)
    before = dict(TRACE_COUNTS)
    generate(model, [D, E, A, B], max_new_tokens=30, temperature=0.7, top_p=1.0, seed=2,
             **kwargs)
    generate(model, [E, [7], A], max_new_tokens=17, temperature=1.3, seed=3,
             **{**kwargs, 'stop_ids': (5, 6, 7)})
    assert dict(TRACE_COUNTS) == before
    generate(model, [D + D, A], max_new_tokens=20, seed=1, **kwargs)  # a longer context bucket
    assert TRACE_COUNTS['continuous'] == before['continuous'] + 1


def _decode_temp_bytes(num_contexts, n, rows):
    abstract = nnx.eval_shape(make_model)
    programs = sampler.abstract_programs(abstract, num_contexts=num_contexts, context_length=24,
                                         n=n, max_new_tokens=60, max_rows_in_flight=rows)
    program = programs['continuous' if 'continuous' in programs else 'decode']
    return program.lower().compile().memory_analysis().temp_size_in_bytes


def test_decode_temporaries_grow_with_rows_in_flight_not_with_the_request():
    small = _decode_temp_bytes(4, 4, rows=4)
    # 8x the contexts, same rows in flight (and n: a group slot holds a context's n rows).
    assert _decode_temp_bytes(32, 4, rows=4) == small
    assert _decode_temp_bytes(8, 4, rows=16) > 1.5 * small  # 4x the rows in flight
    assert _decode_temp_bytes(32, 8, rows=None) > 4 * small  # the static decode: every row


# The same shapes as a mixture of experts (its programs record each token's experts).
MOE = CONFIG.replace(model_type='qwen3_moe', qk_norm=True, num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=16, norm_topk_prob=True)


@pytest.mark.parametrize('config', [CONFIG, MOE], ids=['dense', 'moe_recording_routes'])
def test_abstract_programs_lower_as_generate_runs_them(config):
    """Lowered from abstract shapes on a sharded abstract model, each program's text equals the
    lowering of the call generate() makes on real arrays."""
    mesh = make_mesh(4, 2, 1)
    make = lambda: models.Decoder(config, rngs=nnx.Rngs(0))
    record = bool(config.num_experts)
    real = shard_model(make(), mesh)
    abstract = nnx.eval_shape(make)
    shardings = param_shardings(abstract, mesh)
    nnx.update(abstract, jax.tree.map(
        lambda v, s: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s)),
        nnx.state(abstract), shardings, is_leaf=lambda x: isinstance(x, nnx.Variable)))
    contexts = [list(range(3 + i, 15 + i)) for i in range(6)]  # 6 distinct contexts of 12
    for rows in (None, 8):
        req = sampler.prepare_request(real, contexts, n=4, max_new_tokens=40, temperature=1.0,
                               top_p=1.0, top_k=0, stop_ids=(2,), seed=0,
                               max_rows_in_flight=rows, kv_budget_bytes=None,
                               record_routes=record)
        programs = sampler.abstract_programs(abstract, num_contexts=6, context_length=12, n=4,
                                             max_new_tokens=40, max_rows_in_flight=rows,
                                             record_routes=record)
        with jax.set_mesh(mesh):
            if rows is None:
                prefill = sampler.prefill_program(req)
                segments, state, _ = prefill()
                expected = {'prefill': prefill,
                            'decode': sampler._decode_program(req, segments, state)}
            else:
                expected = {'continuous': sampler._continuous_program(req)}
            assert programs.keys() == expected.keys()
            for name, program in programs.items():
                assert program.lower().as_text() == expected[name].lower().as_text(), name


def test_plan():
    kw = dict(num_contexts=8, n=4, context_length=32, new_bucket=64, shards=2,
              bytes_per_token=10)
    static_bytes = (8 * 32 + 32 * 64) * 10
    assert budget.plan(**kw) is None
    assert budget.plan(**kw, kv_budget_bytes=static_bytes) is None
    assert budget.plan(**kw, max_rows_in_flight=32) is None
    # A cap: rows per device rounded down, one at least; K = ceil(s / n) and a quarter more (one
    # at least), F = ceil(s / n); pages: a whole row (one page of 64 tokens here) a row.
    assert budget.plan(**kw, max_rows_in_flight=13) == budget.ContinuousPlan(2, 6, 3, 2, 64, 6, 1)
    assert budget.plan(**kw, max_rows_in_flight=1) == budget.ContinuousPlan(2, 1, 2, 1, 64, 1, 1)
    # Pages of 16 tokens: 4 a row; half of them promised to each active row.
    assert budget.plan(**kw, max_rows_in_flight=8, page_size=16) == budget.ContinuousPlan(
        2, 4, 2, 1, 16, 16, 4)
    assert budget.plan(**kw, max_rows_in_flight=8, page_size=16, reserve_fraction=0.5) == \
        budget.ContinuousPlan(2, 4, 2, 1, 16, 8, 2)
    # A budget: the most rows whose group slots and reserved pages fit, 2 x (K x 32 context
    # tokens + s x 64 page tokens); what the contexts leave goes to pages.
    allowed = 2 * (3 * 32 + 5 * 64) * 10
    assert budget.plan(**kw, kv_budget_bytes=allowed) == budget.ContinuousPlan(2, 5, 3, 2, 64, 5, 1)
    assert budget.plan(**kw, kv_budget_bytes=allowed - 1) == budget.ContinuousPlan(2, 4, 2, 1, 64, 5, 1)
    with pytest.raises(ValueError, match=r'kv_budget_bytes=100 holds no row: .* need 2560 bytes'):
        budget.plan(**kw, kv_budget_bytes=100)


class _Device:
    def __init__(self, process_index, free):
        self.process_index, self._free = process_index, free

    def memory_stats(self):
        if self.process_index != 0:  # as PjRt answers for another host's device
            raise RuntimeError('MemoryStats is only supported for addressable PjRt devices')
        return None if self._free is None else {'bytes_limit': 100, 'bytes_in_use': 100 - self._free}


def test_free_device_memory_asks_only_this_process_devices():
    # Another host's devices are never asked; the least free share counts for every device.
    devices = [_Device(0, 40), _Device(0, 30), _Device(1, 5), _Device(1, 90)]
    assert budget.free_device_memory(devices) == 4 * 30
    assert budget.free_device_memory([_Device(0, None), _Device(1, 5)]) is None


class _Publisher:
    """newer() for LiveWeights: nothing before the decode's `at`-th chunk, then `model` as
    version 1 (one swap), as a learner publishing mid-decode would."""

    def __init__(self, model, at):
        self.model, self.at, self.calls = model, at, 0

    def __call__(self, current):
        self.calls += 1
        return (1, self.model) if self.calls > self.at and current < 1 else None


def _live(model, newer, chunk_steps=4, kv='keep'):
    from jaxprefix.sampling import LiveWeights, sample_live
    return sample_live(LiveWeights(0, model, newer, kv=kv), CONTEXTS, temperature=1.0,
                       chunk_steps=chunk_steps, page_size=16, **REQUEST)


def _teacher_forced(model, rollouts):
    """Each sampled token's log-prob under `model` given everything before it."""
    from jaxprefix.models.scoring import token_logprobs
    real = np.arange(rollouts.tokens.shape[1]) < (rollouts.context_lengths
                                                  + rollouts.lengths)[:, None]
    logprobs = token_logprobs(model, rollouts.tokens, real, positions=rollouts.positions)[0]
    return np.where(rollouts.completion_mask, np.asarray(logprobs), 0.0)


def test_newer_weights_take_over_a_running_decode_at_a_chunk_the_kv_kept(model, static):
    reference = static(1.0)
    unchanged = _live(model, lambda current: None)
    assert_same_rollouts(unchanged.rollouts, reference)  # generate()'s streams, chunked
    assert unchanged.versions == {0: int(reference.lengths.sum())}
    # The same values under a new version: the swap itself changes nothing.
    copy = nnx.merge(*nnx.split(jax.tree.map(jnp.copy, model)))
    same = _live(model, _Publisher(copy, at=1))
    assert_same_rollouts(same.rollouts, reference)
    assert same.stats['weight_swaps'] == 1
    # Other weights from the second chunk (4 decode steps in): each row's first tokens are the
    # old weights' draws, what follows the new weights', every token counted once.
    other = models.Decoder(CONFIG, rngs=nnx.Rngs(1))
    swapped = _live(model, _Publisher(other, at=1))
    firsts = [ids[:3] for ids in reference.completions()]
    assert [ids[:3] for ids in swapped.rollouts.completions()] == firsts
    assert sum(swapped.versions.values()) == int(swapped.rollouts.lengths.sum())
    assert 0 < swapped.versions[0] < sum(swapped.versions.values()) and swapped.versions[1] > 0
    assert swapped.rollouts.completions() != reference.completions()


def test_newer_weights_recompute_the_kv_written_before_they_took_over(model, static):
    """rollout.inflight_kv='recompute': after the swap every token is drawn as the new weights
    alone would draw it after that prefix (its log-prob is theirs, teacher-forced); with 'keep'
    the old weights' KV still shapes it. The tokens before the swap stay the old weights'."""
    reference = static(1.0)
    copy = nnx.merge(*nnx.split(jax.tree.map(jnp.copy, model)))
    same = _live(model, _Publisher(copy, at=1), kv='recompute')
    assert_same_rollouts(same.rollouts, reference)  # equal weights: computing again changes nothing
    assert same.stats['swap_recomputed_tokens'] > 0
    other = models.Decoder(CONFIG, rngs=nnx.Rngs(1))
    swapped = _live(model, _Publisher(other, at=1), kv='recompute')
    assert [ids[:3] for ids in swapped.rollouts.completions()] == \
        [ids[:3] for ids in reference.completions()]
    assert sum(swapped.versions.values()) == int(swapped.rollouts.lengths.sum())
    r = swapped.rollouts
    # Every row started at the first step, so each drew its first chunk's 4 tokens before.
    after = r.completion_mask.astype(bool) & (
        np.arange(r.tokens.shape[1]) >= r.context_lengths[:, None] + 4)
    assert after.sum() > 20
    old, new = _teacher_forced(model, r), _teacher_forced(other, r)
    np.testing.assert_allclose(r.logprobs[after], new[after], atol=1e-5)
    before = r.completion_mask.astype(bool) & ~after
    np.testing.assert_allclose(r.logprobs[before], old[before], atol=1e-5)
    kept = _live(model, _Publisher(other, at=1)).rollouts
    kept_after = kept.completion_mask.astype(bool) & (
        np.arange(kept.tokens.shape[1]) >= kept.context_lengths[:, None] + 4)
    assert np.abs(kept.logprobs - _teacher_forced(other, kept))[kept_after].max() > 1e-3
