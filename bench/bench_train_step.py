"""Train-step tokens/s (forward + backward + AdamW): jaxprefix.rl.train_step vs Tunix's GRPO step.

Issue 4. Both arms take one optimizer step on the same GRPO rollout batch, from the same
weights, with the same optax optimizer (jaxprefix make_optimizer: global-norm clip 1.0, AdamW),
the same token-mean clipped policy loss (eps 0.2, no KL) and the same old log-probs:
  ours   Learner.update: the one jitted update of jaxprefix.rl.train_step (log-probs over
         vocabulary chunks of --logprob-chunk positions under jax.checkpoint; no full logits).
  tunix  what Tunix 0.1.7's GRPOLearner runs per batch on the actor: its rl.trainer.Trainer
         (PeftTrainer) jitted train step (nnx.value_and_grad + nnx.Optimizer.update, optimizer
         donated) over algo_core.grpo_loss_fn (full [B, T, V] logits), wired exactly as
         GRPOLearner wires it (with_loss_fn, with_gen_model_input_fn), on Tunix's Llama3 holding
         our weights (rope_theta fixed, bench.common.tunix_llama3). Rollout, reward and
         advantage stages of the learner are not timed (they are not part of a train step).
Before timing, the first step of each arm is compared: the gradient norms must agree (so both
compute the same loss on the same model). Tokens/s counts every token of the B x T batch;
FLOP/s counts 3x the forward FLOPs (ModelConfig.flops_per_token), not remat or recompute.
Peak RSS per arm is measured in a child process that loads, compiles and runs only that arm.

  python bench/bench_train_step.py           # SmolLM2-135M B=4 x T=512 and a tiny model
  python bench/bench_train_step.py --quick   # small shapes, 2 rounds
  python bench/bench_train_step.py --models smollm2 --batch 2 --no-rss
"""
from __future__ import annotations

import argparse
import gc
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from bench import common  # noqa: E402
from jaxprefix.models import Decoder, ModelConfig, Rope  # noqa: E402
from jaxprefix.rl.train_step import Learner, TrainConfig, make_optimizer  # noqa: E402

ARMS = ("ours", "tunix")
MODELS = ("smollm2", "tiny")
PAD_ID = 0
# Same rope theta as SmolLM2: the Tunix fix binds one theta per process (bench.common).
TINY = ModelConfig(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                   tie_word_embeddings=True, rope=Rope(theta=100_000.0))
# (batch, prompt, completion) per model; --quick shrinks both.
SHAPES = {"smollm2": (4, 128, 384), "tiny": (8, 32, 96)}
QUICK_SHAPES = {"smollm2": (1, 16, 48), "tiny": (4, 8, 24)}
GRAD_NORM_RTOL = 1e-3


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="small shapes, 2 rounds")
  parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated of {MODELS}")
  parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated of {ARMS}")
  parser.add_argument("--batch", type=int, help="SmolLM2 rows (default 4)")
  parser.add_argument("--prompt", type=int, help="SmolLM2 prompt tokens (default 128)")
  parser.add_argument("--completion", type=int, help="SmolLM2 completion width (default 384)")
  parser.add_argument("--repeats", type=int, default=3, help="rounds of alternating steps")
  parser.add_argument("--logprob-chunk", type=int, default=128,
                      help="ours: positions per vocabulary-projection chunk")
  parser.add_argument("--no-rss", dest="rss", action="store_false",
                      help="skip the per-arm peak-RSS child processes")
  args = parser.parse_args(argv)
  args.models = common.comma_list(parser, "--models", args.models, MODELS)
  args.arms = common.comma_list(parser, "--arms", args.arms, ARMS)
  shapes = dict(QUICK_SHAPES if args.quick else SHAPES)
  given = (args.batch, args.prompt, args.completion)
  shapes["smollm2"] = tuple(g or d for g, d in zip(given, shapes["smollm2"]))
  args.shapes = shapes
  if args.quick:
    args.repeats = min(args.repeats, 2)
  return args


def child_args(args, model_name: str, arm: str) -> list[str]:
  """Command line of a child that runs one arm of one model once (for its peak RSS)."""
  batch, prompt, completion = args.shapes["smollm2"]
  out = ["--models", model_name, "--arms", arm, "--repeats", "1", "--no-rss",
         "--batch", str(batch), "--prompt", str(prompt), "--completion", str(completion),
         "--logprob-chunk", str(args.logprob_chunk)]
  return out + (["--quick"] if args.quick else [])


def rollout_batch(config: ModelConfig, batch: int, prompt: int, completion: int, seed=0):
  """A GRPO batch as the sampler lays it out: a full prompt, then a completion of random length
  (half to all of `completion` tokens), then padding (id 0); one advantage per row."""
  rng = np.random.default_rng(seed)
  width = prompt + completion
  tokens = rng.integers(1, config.vocab_size, (batch, width)).astype(np.int32)
  lengths = prompt + rng.integers(completion // 2, completion + 1, batch)
  cols = np.arange(width)[None]
  token_mask = cols < lengths[:, None]
  return {"tokens": np.where(token_mask, tokens, PAD_ID),
          "positions": np.where(token_mask, cols, 0).astype(np.int32),
          "token_mask": token_mask,
          "completion_mask": ((cols >= prompt) & token_mask).astype(np.float32),
          "advantages": rng.normal(size=batch).astype(np.float32)}


def train_config(chunk: int) -> TrainConfig:
  # max_grad_norm 1.0 and token_mean: clipping and loss the same in both arms.
  return TrainConfig(learning_rate=1e-6, aggregation="token_mean", eps_low=0.2, eps_high=0.2,
                     max_grad_norm=1.0, logprob_chunk=chunk)


class OurStep:
  """One Learner.update per call, carrying the (donated) state from call to call."""

  def __init__(self, model, config: TrainConfig, batch: dict):
    self.learner = Learner(model, config)
    self.state = self.learner.init_state()
    self.batch = self.learner.place_batch(batch)

  def __call__(self):
    self.state, metrics = self.learner.update(self.state, self.batch)
    return jax.block_until_ready(metrics)


def tunix_step(peer, config: TrainConfig, batch: dict, prompt: int, eos_id: int):
  """Tunix's actor train step as GRPOLearner sets it up, jitted by the trainer itself.
  Returns () -> (loss, aux, grad_norm)."""
  from tunix.rl import algo_core
  from tunix.rl import trainer as rl_trainer
  from tunix.rl.grpo.grpo_learner import GRPOConfig, TrainExample
  from tunix.sft import peft_trainer

  algo = GRPOConfig(num_generations=2, beta=0.0, epsilon=0.2, loss_agg_mode="token-mean")
  algo.temperature = 1.0  # GRPOLearner copies the rollout temperature here

  def loss_fn(model, train_example, algo_config):
    return algo_core.grpo_loss_fn(model, train_example, algo_config=algo_config,
                                  pad_id=PAD_ID, eos_id=eos_id)

  trainer = rl_trainer.Trainer(peer, make_optimizer(config),
                               peft_trainer.TrainingConfig(eval_every_n_steps=10 ** 9),
                               custom_checkpoint_metadata_fn=dict)
  trainer.with_loss_fn(loss_fn, has_aux=True)
  trainer.with_gen_model_input_fn(lambda x: {"train_example": x, "algo_config": algo})
  train_step, _ = trainer.jit_train_and_eval_step()

  completion_mask = batch["completion_mask"][:, prompt:]
  example = TrainExample(
      prompt_ids=jnp.asarray(batch["tokens"][:, :prompt]),
      prompt_mask=jnp.asarray(batch["token_mask"][:, :prompt].astype(np.int32)),
      completion_ids=jnp.asarray(batch["tokens"][:, prompt:]),
      completion_mask=jnp.asarray(completion_mask.astype(np.int32)),
      advantages=jnp.asarray(batch["advantages"]),
      ref_per_token_logps=None,
      old_per_token_logps=jnp.asarray(batch["old_logprobs"][:, prompt:]))
  return lambda: jax.block_until_ready(train_step(example))


def load(model_name: str):
  if model_name == "smollm2":
    return common.load_smollm2()
  return Decoder(TINY, rngs=nnx.Rngs(0)), TINY


def build_arms(args, model_name: str):
  """name -> compiled step callable on one shared batch; checks the first steps agree."""
  model, config = load(model_name)
  batch_size, prompt, completion = args.shapes[model_name]
  batch = rollout_batch(config, batch_size, prompt, completion)
  tc = train_config(args.logprob_chunk)
  arms = {}
  if "ours" in args.arms:
    arms["ours"] = OurStep(model, tc, batch)
    # Old log-probs as the sampler reports them: the policy's own, so the first ratio is 1.
    learner = arms["ours"].learner
    batch["old_logprobs"] = np.asarray(learner.logprobs(arms["ours"].state.params, batch))
    arms["ours"].batch = learner.place_batch(batch)
  else:
    # A Tunix-only child measures memory: same shapes, same work, no Learner beside it.
    batch["old_logprobs"] = np.zeros(batch["tokens"].shape, np.float32)
  if "tunix" in args.arms:
    eos = config.eos_token_ids[0] if config.eos_token_ids else 1
    arms["tunix"] = tunix_step(common.tunix_llama3(model, config), tc, batch, prompt, eos)
  first = {name: arm() for name, arm in arms.items()}  # compiles each arm
  if len(first) == 2:
    ours_norm = float(first["ours"]["grad_norm"])
    tunix_norm = float(first["tunix"][2])
    print(f"{model_name}: first-step grad norm ours {ours_norm:.6g}, tunix {tunix_norm:.6g}; "
          f"ours max |ratio - 1| {float(first['ours']['ratio/first_max_abs_dev']):.2e}, "
          f"tunix ratio in [{float(first['tunix'][1]['is_ratio/min']):.6f}, "
          f"{float(first['tunix'][1]['is_ratio/max']):.6f}]")
    if abs(ours_norm - tunix_norm) > GRAD_NORM_RTOL * abs(ours_norm):
      raise AssertionError(f"{model_name}: gradient norms differ (ours {ours_norm}, tunix "
                           f"{tunix_norm}): the arms do not compute the same step")
  tokens = batch_size * (prompt + completion)
  flops = 3 * config.flops_per_token(context_length=prompt + completion) * tokens
  return arms, tokens, flops


def print_peak_rss(args):
  """Peak RSS of each (model, arm) in a child process, once the timed arms are freed here:
  children that load, compile and run one arm once. A child that dies (e.g. killed when the
  box runs out of memory) is reported, not fatal."""
  print("\npeak RSS GiB of a child process running one arm (load, compile, 2 steps):")
  for model_name in args.models:
    for arm in args.arms:
      gib = common.child_peak_rss_text(__file__, child_args(args, model_name, arm))
      print(f"  {model_name:<10}{arm:<8}{gib}", flush=True)


def main(argv=None):
  args = parse_args(argv)
  common.print_load()
  peak = common.matmul_peak_gflops()
  print(f"matmul peak (jitted f32 2048^3): {peak:.1f} GFLOP/s")
  for model_name in args.models:
    arms, tokens, flops = build_arms(args, model_name)
    seconds = common.time_alternating(arms, args.repeats)
    del arms  # frees both arms' weights and optimizer states before the next model
    gc.collect()
    batch_size, prompt, completion = args.shapes[model_name]
    common.print_table(
        f"{model_name} train step (fwd+bwd+AdamW), f32, B={batch_size} x "
        f"T={prompt}+{completion} ({flops / 1e12:.3f} TFLOP a step)", seconds, tokens=tokens,
        flops=flops, peak_gflops=peak)
    common.print_ratios(seconds, [("ours", "tunix")])
    sys.stdout.flush()
  print(f"matmul peak after: {common.matmul_peak_gflops():.1f} GFLOP/s")
  common.print_load()
  if args.rss:
    print_peak_rss(args)
  common.report_peak_rss()


if __name__ == "__main__":
  main()
