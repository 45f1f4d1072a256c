"""f32 master weights with bf16 compute train at the paper's learning rate; all-bf16 does not,
and is refused by name. Config -> policy honours model.param_dtype and model.dtype."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxprefix.checkpoints.hf import save_pretrained
from jaxprefix import run_config, variants
from jaxprefix.models.config import ModelConfig
from jaxprefix.models.decoder import Decoder
from jaxprefix.rl.loop import check_update_resolution
from jaxprefix.rl.train_config import TrainConfig
from jaxprefix.rl.train_step import Learner, frozen_fraction
from tests.test_train_step import CONFIG, rollout_batch, with_old_logprobs

LR = 1e-6  # the paper variant's
UPDATES = 5


def weight_change(param_dtype: str, dtype: str) -> tuple[float, Learner, object]:
    """Sum over all weights of |w_after - w_before| after UPDATES updates at LR (from the same
    f32 initial weights, held in `param_dtype`, computed in `dtype`)."""
    config = CONFIG.replace(param_dtype=param_dtype, dtype=dtype)
    start = nnx.state(Decoder(CONFIG, rngs=nnx.Rngs(0)), nnx.Param)
    model = Decoder(config, rngs=nnx.Rngs(0))
    nnx.update(model, jax.tree.map(lambda x: x.astype(param_dtype), start))
    learner = Learner(model, TrainConfig(learning_rate=LR, micro_batch_size=8))
    state = learner.init_state()
    before = [np.asarray(x, np.float32) for x in jax.tree.leaves(state.params)]
    for seed in range(UPDATES):
        batch = with_old_logprobs(rollout_batch(seed), learner, state)
        state, metrics = learner.update(state, batch)
        assert int(metrics["skipped_updates"]) == 0
    after = [np.asarray(x, np.float32) for x in jax.tree.leaves(state.params)]
    return sum(float(np.abs(a - b).sum()) for a, b in zip(after, before)), learner, state


def test_bf16_compute_with_f32_master_weights_trains_like_f32():
    reference, _, _ = weight_change("float32", "float32")
    mixed, learner, state = weight_change("float32", "bfloat16")
    frozen, _, _ = weight_change("bfloat16", "bfloat16")
    assert reference > 0
    assert abs(mixed - reference) <= 0.1 * reference, (mixed, reference)
    # What the check guards against: bf16 weights round a step of 1e-6 away.
    assert frozen < 0.1 * reference, (frozen, reference)
    # Master weights and both AdamW moments stay f32; the sampler gets a bf16 copy.
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype("float32")}
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
    assert moments and {x.dtype for x in moments} == {jnp.dtype("float32")}
    sampler_params = nnx.state(learner.sampling_model(state), nnx.Param)
    assert {x.dtype for x in jax.tree.leaves(sampler_params)} == {jnp.dtype("bfloat16")}


def test_all_bf16_at_a_tiny_learning_rate_is_refused_by_name():
    bf16 = Decoder(CONFIG.replace(param_dtype="bfloat16", dtype="bfloat16"), rngs=nnx.Rngs(0))
    assert frozen_fraction(nnx.state(bf16, nnx.Param), LR) > 0.9
    with pytest.raises(ValueError, match=r"^config.model.param_dtype=bfloat16 with "
                                         r"config.train.learning_rate=1e-06: \d+% of the weights"):
        check_update_resolution(bf16, LR)
    check_update_resolution(bf16, 1e-2)  # a step bf16 can represent
    f32_master = Decoder(CONFIG.replace(param_dtype="float32", dtype="bfloat16"), rngs=nnx.Rngs(0))
    check_update_resolution(f32_master, LR)
    assert frozen_fraction(nnx.state(f32_master, nnx.Param), LR) == 0.0


def test_sampling_model_is_the_state_itself_when_dtypes_agree():
    learner = Learner(Decoder(CONFIG, rngs=nnx.Rngs(0)), TrainConfig())
    state = learner.init_state()
    params = nnx.state(learner.sampling_model(state), nnx.Param)
    assert all(a is b for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(state.params)))


def test_policy_loading_honours_param_dtype_and_dtype(tmp_path):
    from jaxprefix.data.tasks import carry_multiplication as task
    from jaxprefix.run_setup.policy import load_policy

    tokenizer = task.tokenizer()
    config = ModelConfig(model_type="llama", vocab_size=tokenizer.vocab_size, hidden_size=32,
                         intermediate_size=48, num_layers=1, num_heads=4, num_kv_heads=2,
                         head_dim=8, eos_token_ids=(tokenizer.eos_id,))
    save_pretrained(Decoder(config, rngs=nnx.Rngs(0)), config, str(tmp_path / "base"),
                           tokenizer=tokenizer)
    c = run_config.base_config()
    c.model.update(source="sft", path=str(tmp_path / "base"), param_dtype="float32",
                   dtype="bfloat16")
    policy = load_policy(c, str(tmp_path))
    assert policy.model.config.param_dtype == "float32" and policy.model.config.dtype == "bfloat16"
    leaves = jax.tree.leaves(nnx.state(policy.model, nnx.Param))
    assert {x.dtype for x in leaves} == {jnp.dtype("float32")}
    c.model.param_dtype = "int8"
    with pytest.raises(ValueError, match=r"config.model.param_dtype='int8': expected one of"):
        load_policy(c, str(tmp_path))
    paper, _ = variants.method_config("configs/grpo.py", "grpo", "paper")
    assert (paper.model.param_dtype, paper.model.dtype) == ("float32", "bfloat16")


def _dots(jaxpr):
    """Every dot_general of a jaxpr, its sub-jaxprs' (a custom VJP's, a jit's) included."""
    for e in jaxpr.eqns:
        if e.primitive.name == "dot_general":
            yield e
        for value in e.params.values():
            inner = getattr(value, "jaxpr", value)
            if hasattr(inner, "eqns"):
                yield from _dots(inner)


@pytest.mark.parametrize("equation,x_shape,w_shape,f32_result", [
    ("btd,df->btf", (2, 5, 16), (16, 24), False),      # an MLP projection
    ("btd,dnh->btnh", (2, 5, 16), (16, 3, 8), False),  # query heads
    ("nd,vd->nv", (10, 16), (40, 16), True),           # the unembedding's logits
])
def test_bf16_projections_dot_bf16_into_f32_forward_and_backward(equation, x_shape, w_shape,
                                                                 f32_result):
    """layers.linear below f32: every dot of its value and gradient takes two bf16 operands into
    an f32 result (XLA's CPU runs those fast; a bf16 result or an f32 cotangent against a bf16
    weight ran slower than f32), and both equal the f32 computation's to bf16's rounding."""
    from jaxprefix.models import layers

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal(x_shape), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal(w_shape), jnp.bfloat16)
    probe = jnp.asarray(rng.standard_normal(jnp.einsum(equation, x, w).shape), jnp.float32)

    def loss(x, w):
        return (layers.linear(equation, x, w, f32_result=f32_result).astype(jnp.float32)
                * probe).sum()

    def reference(x, w):
        return (jnp.einsum(equation, x.astype(jnp.float32), w.astype(jnp.float32)) * probe).sum()

    dots = list(_dots(jax.make_jaxpr(jax.grad(loss, (0, 1)))(x, w).jaxpr))
    assert len(dots) == 3  # the forward and its two transposes
    for e in dots:
        assert [v.aval.dtype for v in e.invars] == [jnp.bfloat16] * 2
        assert e.params["preferred_element_type"] == jnp.float32
    value, grads = jax.value_and_grad(loss, (0, 1))(x, w)
    want, want_grads = jax.value_and_grad(reference, (0, 1))(x, w)
    np.testing.assert_allclose(value, want, rtol=2e-2, atol=0.5)
    for got, expected in zip(grads, want_grads):
        assert got.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(got, np.float32), expected, rtol=2e-2, atol=0.1)
    f32 = layers.linear(equation, x.astype(jnp.float32), w.astype(jnp.float32))
    np.testing.assert_array_equal(f32, jnp.einsum(equation, x.astype(jnp.float32),
                                                  w.astype(jnp.float32)))
