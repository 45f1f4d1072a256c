"""LoRA (models/lora.py): identity at init, only adapters trained, merged == applied, PEFT export."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import tiny_checkpoints
from jaxprefix.checkpoints.hf import from_pretrained, save_pretrained
from jaxprefix.checkpoints import peft as peft_format
from jaxprefix.models import lora
from jaxprefix.models.scoring import token_logprobs
from jaxprefix.rl import loop
from jaxprefix.run_setup.learner_settings import lora_config, train_config
from jaxprefix.rl.train_config import TrainConfig
from jaxprefix.rl.train_step import Learner
from jaxprefix.run_config import base_config

RANK = 4
TOKENS = np.random.default_rng(0).integers(3, tiny_checkpoints.VOCAB, (2, 9)).astype(np.int32)


def tiny(family: str, tmp_path, seed: int = 0):
    """(our f32 Decoder, the transformers model, its directory) of a random tiny checkpoint."""
    path, hf_model = tiny_checkpoints.save_checkpoint(family, tmp_path / family, seed=seed)
    model, _ = from_pretrained(path)
    return model, hf_model, path


def trained(model, config=lora.LoraConfig(RANK, alpha=8.0), seed=1):
    """`model` with adapters whose B (and A) are random: an adapter that changes the logits."""
    adapted = lora.with_adapters(model, config)
    for i, name in enumerate(config.targets):
        for factor in ("a", "b"):
            v = getattr(adapted.adapters, f"{name}_{factor}")
            v.set_value(0.05 * jax.random.normal(jax.random.key(seed * 100 + i * 2 + (factor == "b")),
                                                 v.shape, v.dtype))
    return adapted


def params(model, kind=nnx.Param):
    return {path: np.asarray(v) for path, v in nnx.to_flat_state(nnx.state(model, kind))}


# The adapters wrap the same projections in every family: llama, and gemma3 (its own norms,
# scaled embeddings, sliding windows) stand for them; the PEFT export below runs them all.
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_fresh_adapters_leave_the_logits_exactly_the_base(family, tmp_path):
    model, _, _ = tiny(family, tmp_path)
    adapted = lora.with_adapters(model, lora.LoraConfig(RANK))
    np.testing.assert_array_equal(np.asarray(adapted(TOKENS)), np.asarray(model(TOKENS)))
    # Trained adapters change them; merged into the base they give the same logits.
    changed = trained(model)
    logits = np.asarray(changed(TOKENS))
    assert np.abs(logits - np.asarray(model(TOKENS))).max() > 1e-2
    np.testing.assert_allclose(np.asarray(lora.merged(changed)(TOKENS)), logits, atol=2e-5)
    assert not lora.has_adapters(lora.merged(changed)) and lora.has_adapters(changed)


def rollout_batch(rows=8, width=12, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, tiny_checkpoints.VOCAB, (rows, width)).astype(np.int32)
    cols = np.arange(width)[None]
    mask = cols < rng.integers(7, width + 1, rows)[:, None]
    return {"tokens": np.where(mask, tokens, 0), "token_mask": mask,
            "positions": np.where(mask, cols, 0).astype(np.int32),
            "completion_mask": ((cols >= 4) & mask).astype(np.float32),
            "advantages": rng.normal(size=rows).astype(np.float32)}


@pytest.mark.parametrize("out", [(12,), (3, 4)])  # an MLP's outputs; attention's heads x dims
def test_the_adapters_hand_written_gradient_is_autodiffs(out):
    """lora._up's VJP (B's gradient laid out for XLA's CPU backend) equals autodiff's of u B."""
    rng = np.random.default_rng(0)
    u = jnp.asarray(rng.normal(size=(2, 5, 4)), jnp.float32)
    b = jnp.asarray(rng.normal(size=(4,) + out), jnp.float32)
    cot = jnp.asarray(rng.normal(size=(2, 5) + out), jnp.float32)
    ours = jax.grad(lambda u, b: (lora._up(u, b) * cot).sum(), argnums=(0, 1))(u, b)
    plain = jax.grad(lambda u, b: (jnp.tensordot(u, b, axes=1) * cot).sum(),
                     argnums=(0, 1))(u, b)
    for a, e in zip(ours, plain):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5)


def test_rl_updates_train_only_the_adapters(tmp_path):
    model, _, _ = tiny("qwen2", tmp_path)
    base_before = params(model)
    adapted = lora.with_adapters(model, lora.LoraConfig(RANK, dropout=0.1))
    learner = Learner(adapted, TrainConfig(learning_rate=1e-2, micro_batch_size=4))
    state = learner.init_state()
    batch = rollout_batch()
    batch["old_logprobs"] = np.asarray(learner.logprobs(state.params, batch))
    # The KL reference (the initial adapters, B = 0) scores exactly as the base does.
    base = Learner(model, TrainConfig())
    np.testing.assert_array_equal(batch["old_logprobs"],
                                  np.asarray(base.logprobs(base.initial_params(), batch)))
    adapter_shapes = {v.shape for v in params(adapted, lora.LoraParam).values()}
    for _ in range(3):
        state, metrics = learner.update(state, batch)
    assert int(state.updates) == 3 and np.isfinite(float(metrics["loss"]))

    # Only adapters are trained state: B moved off zero, the frozen base is bit-identical.
    trained_state = nnx.merge(learner.graphdef, state.params, learner.rest)
    assert all(np.abs(np.asarray(b)).max() > 0 for _, b in trained_state.adapters.factors().values())
    for path, value in params(trained_state).items():
        np.testing.assert_array_equal(value, base_before[path], err_msg=str(path))
    for path, value in params(model).items():  # the caller's model is untouched too
        np.testing.assert_array_equal(value, base_before[path], err_msg=str(path))
    # The optimizer state holds adapter-shaped arrays only (Adam's mu and nu) besides counters.
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
    assert moments and {x.shape for x in moments} == adapter_shapes
    assert sum(x.size for x in moments) == 2 * sum(x.size for x in jax.tree.leaves(state.params))
    # The sampler's policy has the adapters folded in and scores as the adapted model does.
    policy = learner.sampling_model(state)
    assert not lora.has_adapters(policy) and lora.has_adapters(learner.model(state))
    merged_logp = np.asarray(learner.logprobs(state.params, batch))
    sampler_logp = token_logprobs(policy, batch["tokens"], batch["token_mask"],
                                  positions=batch["positions"])[0]
    np.testing.assert_allclose(np.asarray(sampler_logp), merged_logp, atol=1e-4)


def test_adapter_dropout_acts_in_the_loss_only(tmp_path):
    model, _, _ = tiny("llama", tmp_path)
    adapted = trained(model, lora.LoraConfig(RANK, dropout=0.5))
    graphdef, adapters, rest = nnx.split(adapted, lora.LoraParam, ...)
    batch = {k: jnp.asarray(v) for k, v in rollout_batch().items()}

    @jax.jit
    def with_dropout(key):
        m = nnx.merge(graphdef, adapters, rest)
        lora.set_dropout_key(m, key)
        return token_logprobs(m, batch["tokens"], batch["token_mask"],
                              positions=batch["positions"])[0]

    plain = np.asarray(token_logprobs(adapted, batch["tokens"], batch["token_mask"],
                                      positions=batch["positions"])[0])  # sampling, scoring
    dropped = np.asarray(with_dropout(jax.random.key(1)))
    assert np.abs(dropped - plain).max() > 1e-3
    np.testing.assert_array_equal(dropped, np.asarray(with_dropout(jax.random.key(1))))
    assert np.abs(dropped - np.asarray(with_dropout(jax.random.key(2)))).max() > 1e-3


@pytest.mark.parametrize("field, value, message", [
    ("lora_rank", -1, "config.train.lora_rank=-1: expected an integer >= 1"),
    ("lora.alpha", 0.0, "config.train.lora.alpha=0.0: expected > 0"),
    ("lora.dropout", 1.0, r"config.train.lora.dropout=1.0: expected in \[0, 1\)"),
    ("lora.targets", ("q", "qkv"), "config.train.lora.targets=.*expected distinct names"),
])
def test_bad_lora_fields_are_one_line_errors_naming_them(field, value, message):
    c = base_config()
    c.train.lora_rank = 8
    block, _, name = field.rpartition(".")
    (c.train.lora if block else c.train)[name] = value
    with pytest.raises(ValueError, match=message) as error:
        lora_config(c)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma3"])
def test_peft_export_loads_onto_the_transformers_base_with_our_logits(family, tmp_path):
    peft = pytest.importorskip("peft")
    model, hf_model, path = tiny(family, tmp_path)
    adapted = trained(model, lora.LoraConfig(RANK, alpha=8.0, targets=lora.TARGETS))
    ours = np.asarray(adapted(TOKENS))

    adapter_dir = peft_format.save_peft_adapter(adapted, tmp_path / "adapter", str(path))
    peft_model = peft.PeftModel.from_pretrained(hf_model, str(adapter_dir)).eval()
    assert peft_model.peft_config["default"].r == RANK
    with torch.no_grad():
        theirs = peft_model(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(theirs, ours, atol=1e-4)

    # The merged full HF directory is the same model for transformers alone.
    import transformers
    merged_dir = save_pretrained(lora.merged(adapted), None, tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
    merged.config._attn_implementation = "eager"
    with torch.no_grad():
        logits = merged.eval()(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(logits, theirs, atol=1e-4)


def test_export_job_writes_the_peft_adapter_beside_the_merged_model(tmp_path):
    """A LoRA workdir through `--config.job=export`: export/adapter/ on the transformers base
    (peft) and the merged export/ (transformers alone) both give the trained policy's logits."""
    peft = pytest.importorskip("peft")
    import transformers

    from jaxprefix import models, run_config, storage, tokenizers
    from jaxprefix.checkpoints.gguf import bundled_smollm2_path
    from jaxprefix.checkpoints.train_state import TrainCheckpointer
    from jaxprefix.jobs.export import run_export

    tokenizer = tokenizers.load(bundled_smollm2_path())  # an export carries its tokenizer
    shape = models.ModelConfig(model_type="llama", vocab_size=tokenizer.vocab_size, hidden_size=32,
                               intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                               head_dim=8, tie_word_embeddings=True)
    base = str(tmp_path / "base")
    save_pretrained(models.Decoder(shape, rngs=nnx.Rngs(0)), shape, base, tokenizer=tokenizer)
    config = run_config.base_config()
    config.job = "export"
    config.model.update(source="hf", path=base)
    config.train.lora_rank, config.train.lora.alpha = RANK, 8.0
    # What the RL loop checkpoints: the adapters (here random, i.e. trained) and their optimizer.
    learner = Learner(loop.adapted(from_pretrained(base)[0], lora_config(config), config.seed),
                      train_config(config))
    state = learner.init_state()
    state = state.replace(params=jax.tree.map(
        lambda x: 0.05 * jax.random.normal(jax.random.key(x.size), x.shape), state.params))
    workdir = str(tmp_path / "run")
    ckpt = TrainCheckpointer(storage.join(workdir, "checkpoints"))
    ckpt.save(3, {"params": state.params, "opt_state": state.opt_state, "step": state.step,
                  "updates": state.updates, "skipped": state.skipped}, {})
    ckpt.close()
    ours = np.asarray(learner.model(state)(TOKENS))

    path = run_export(config, workdir)
    with torch.no_grad():
        base_model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        adapted = peft.PeftModel.from_pretrained(base_model, storage.join(path, "adapter")).eval()
        with_adapter = adapted(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()
        merged = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        merged_logits = merged.eval()(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(with_adapter, ours, atol=1e-4)
    np.testing.assert_allclose(merged_logits, ours, atol=1e-4)
    assert np.abs(ours - np.asarray(from_pretrained(base)[0](TOKENS))).max() > 1e-3


def test_a_peft_adapter_loads_back_onto_the_base_with_the_same_logits(tmp_path):
    model, _, _ = tiny("llama", tmp_path)
    adapted = trained(model, lora.LoraConfig(RANK, alpha=8.0, targets=("q", "v", "down")))
    path = peft_format.save_peft_adapter(adapted, tmp_path / "adapter")
    loaded = peft_format.load_peft_adapter(model, path)
    assert loaded.adapters.config.targets == ("down", "q", "v")  # PEFT lists them sorted
    np.testing.assert_array_equal(np.asarray(loaded(TOKENS)), np.asarray(adapted(TOKENS)))
    # in bf16: the factors rounded, and read back as the f32 adapters hold them
    bf16 = peft_format.load_peft_adapter(
        model, peft_format.save_peft_adapter(adapted, tmp_path / "bf16", dtype="bfloat16"))
    for name, (a, b) in adapted.adapters.factors().items():
        got_a, got_b = bf16.adapters.factors()[name]
        np.testing.assert_array_equal(np.asarray(got_a), np.asarray(a.astype(jnp.bfloat16)))
        np.testing.assert_array_equal(np.asarray(got_b), np.asarray(b.astype(jnp.bfloat16)))
