"""A whole RL step (sample, score, update) on SmolLM2-135M: jaxprefix vs Tunix's GRPOLearner.

Both arms run the same GRPO step from the same weights (bench/common.py), on CPU in f32:
  --prompts contexts of --prompt tokens of English text (the same ids in both arms), --n samples
  each, up to --new tokens at temperature 1, stopping at <|im_end|> (id 2); the reward is the
  same in-process Python function of the completion ids (the share of even ids: cheap and varied,
  so advantages are not zero); GRPO advantages (r - mean) / std over each group; the clipped
  token-mean policy loss (eps 0.2), no KL term, one update per batch (on-policy), and jaxprefix's
  optimizer (global-norm clip 1.0, AdamW lr 1e-6) in both.
  ours   the body of jaxprefix.rl.loop.train without checkpoints or metrics files: generate()
         (prefill once per prompt, n rows decoded in-graph), reward, group_advantages,
         build_batch, Learner.update;
  tunix  Tunix 0.1.7's GRPOLearner.train on an RLCluster (vanilla rollout: its Sampler with each
         prompt repeated n times; reward; grpo advantages; the actor Trainer's jitted step), on
         Tunix's Llama3 holding our weights (rope theta fixed). A step's time is the interval
         between two of its metric-function calls (once per step, after the rewards).
Memory settings, the same in both arms, as a user would set them to fit the box (without them
our arm needs 36.8 GB at 2 x 8 x (512 + 128) tokens, and 24 GiB is all there is):
  remat       on (--no-remat: off): ours TrainConfig(remat=True) (each decoder layer recomputed
              in the backward pass); Tunix's Llama3 with RematConfig.DECODER, the same policy;
  micro-batch --micro-prompts prompts' groups per gradient-accumulation step (default 1, i.e.
              n rows): ours TrainConfig(micro_batch_size=micro_prompts * n); Tunix
              RLTrainingConfig(mini_batch_size=prompts, train_micro_batch_size=micro_prompts),
              i.e. optax.MultiSteps over the micro-batches, one optimizer update per batch in
              both. Tunix's rollout stays one batch (rollout_micro_batch_size=prompts), as ours.
  Our log-probs are computed over vocabulary chunks (TrainConfig.logprob_chunk, 1024 positions);
  Tunix has no such setting (its loss takes full [rows, T, vocab] logits).
  Measured (bench/README.md): at --prompts 2 --n 8 --prompt 512 --new 128 ours peaks at 10.3
  GiB; Tunix's loss gradient needs 19 GiB of temporaries per 8-row micro-batch even with remat
  (on CPU its remat saves almost nothing) and the arm is OOM-killed on a 24 GiB box: there, run
  --arms ours, and compare both at --prompt 256.
Rounds alternate the arms (--steps steps of each per round; the first step of each arm is its
compile and is not timed); the script prints seconds per step, the ratio, and the load.

  python bench/bench_rl_step.py             # 2 prompts x 4 samples, 128 + up to 128 tokens
  python bench/bench_rl_step.py --arms ours --prompts 2 --n 8 --prompt 512 --new 128  # issue 23
  python bench/bench_rl_step.py --quick     # 1 x 2, 16 + 16: a sanity run
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench import common  # noqa: E402
from bench.bench_sampler import IdTokenizer, make_context  # noqa: E402
from jaxprefix import sampling  # noqa: E402
from jaxprefix.checkpoints.gguf import bundled_smollm2_path  # noqa: E402
from jaxprefix.rl import dynamic_sampling, objectives  # noqa: E402
from jaxprefix.rl.train_config import TrainConfig, make_optimizer  # noqa: E402
from jaxprefix.rl.train_step import Learner  # noqa: E402

EOS_ID = 2  # SmolLM2's <|im_end|>
PAD_ID = 0


def reward(completion_ids) -> float:
  """The share of even token ids in a completion (0 for an empty one)."""
  ids = np.asarray(completion_ids)
  return float((ids % 2 == 0).mean()) if ids.size else 0.0


def train_config(args) -> TrainConfig:
  return TrainConfig(learning_rate=1e-6, aggregation="token_mean", eps_low=0.2, eps_high=0.2,
                     max_grad_norm=1.0, remat=args.remat,
                     micro_batch_size=args.micro_prompts * args.n)


class OurStep:
  """One RL step of jaxprefix per call: sample, score, update (the RL loop's body)."""

  def __init__(self, model, contexts, args):
    self.learner = Learner(model, train_config(args))
    self.state = self.learner.init_state()
    self.contexts, self.args, self.step = contexts, args, 0

  def __call__(self):
    a = self.args
    policy = self.learner.model(self.state)
    rollouts = sampling.generate(policy, self.contexts, n=a.n, max_new_tokens=a.new,
                                 temperature=1.0, stop_ids=(EOS_ID,), seed=self.step)
    rewards = rollouts.grouped(np.array([reward(c) for c in rollouts.completions()]))
    advantages = np.asarray(objectives.group_advantages(rewards, "grpo"))
    selection = dynamic_sampling.select_groups([rewards], len(self.contexts),
                                               drop_zero_variance=False)
    batch = dynamic_sampling.build_batch([rollouts], [advantages], selection)
    self.state, metrics = self.learner.update(self.state, batch)
    self.step += 1
    return jax.block_until_ready(metrics)


class TunixSteps:
  """Tunix's GRPOLearner, trained `steps` steps per call; records each step's seconds."""

  def __init__(self, model, config, contexts, args, total_steps: int):
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo.grpo_learner import GRPOConfig, GRPOLearner
    from tunix.rl.rollout import base_rollout
    tokenizer = IdTokenizer()
    self.args, self.prompts = args, [tokenizer.decode(c) for c in contexts]
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    roles = rl_cluster_lib.Role
    cluster_config = rl_cluster_lib.ClusterConfig(
        role_to_mesh={roles.ACTOR: mesh, roles.REFERENCE: mesh, roles.ROLLOUT: mesh},
        rollout_engine="vanilla", offload_to_cpu=False,
        training_config=rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=make_optimizer(train_config(args)), eval_every_n_steps=10 ** 9,
            max_steps=total_steps, mini_batch_size=args.prompts,
            train_micro_batch_size=args.micro_prompts, rollout_micro_batch_size=args.prompts),
        rollout_config=base_rollout.RolloutConfig(
            max_tokens_to_generate=args.new, max_prompt_length=args.prompt,
            kv_cache_size=args.prompt + args.new, temperature=1.0, top_p=1.0, top_k=None,
            eos_tokens=[EOS_ID]))
    cluster = rl_cluster_lib.RLCluster(actor=common.tunix_llama3(model, config, remat=args.remat), reference=None,
                                       tokenizer=tokenizer, cluster_config=cluster_config)
    algo = GRPOConfig(num_generations=args.n, num_iterations=1, beta=0.0, epsilon=0.2,
                      loss_agg_mode="token-mean")

    def tunix_reward(prompts, completions, **_):
      return [reward(tokenizer.encode(text)) for text in completions]

    self.marks: list[float] = []

    def mark(**_):  # called once per step, after the rewards
      self.marks.append(time.perf_counter())
      return {}

    self.learner = GRPOLearner(cluster, algo, reward_fns=tunix_reward, metric_fns=[mark])

  def run(self, steps: int) -> list[float]:
    """Trains `steps` steps; returns the seconds of each step but the first of the call."""
    self.marks.clear()
    self.learner.train([{"prompts": np.array(self.prompts)}] * (steps + 1))
    return list(np.diff(self.marks))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--prompts", type=int, default=2)
  parser.add_argument("--n", type=int, default=4)
  parser.add_argument("--prompt", type=int, default=128)
  parser.add_argument("--new", type=int, default=128)
  parser.add_argument("--steps", type=int, default=3, help="timed steps of each arm per round")
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--micro-prompts", type=int, default=1,
                      help="prompts (of n samples each) per gradient-accumulation micro-batch")
  parser.add_argument("--no-remat", dest="remat", action="store_false",
                      help="keep every layer's activations for the backward pass")
  parser.add_argument("--arms", default="ours,tunix")
  parser.add_argument("--quick", action="store_true")
  args = parser.parse_args()
  args.arms = common.comma_list(parser, "--arms", args.arms, ("ours", "tunix"))
  if args.prompts % args.micro_prompts:
    parser.error(f"--micro-prompts {args.micro_prompts} must divide --prompts {args.prompts}")
  if args.quick:
    args.prompts, args.n, args.prompt, args.new, args.steps, args.rounds = 1, 2, 16, 16, 2, 1

  common.print_load()
  model, config = common.load_smollm2()
  base = make_context(bundled_smollm2_path(), args.prompt + args.prompts)
  contexts = [base[i:i + args.prompt] for i in range(args.prompts)]  # distinct, same length
  arms = {}  # name -> run(steps) -> the seconds of each step
  if "ours" in args.arms:
    ours = OurStep(model, contexts, args)
    arms["ours"] = lambda steps: [timed_call(ours) for _ in range(steps)]
  if "tunix" in args.arms:
    arms["tunix"] = TunixSteps(model, config, contexts, args,
                               total_steps=2 + args.rounds * (args.steps + 1)).run
  print(f"SmolLM2-135M f32 CPU: {args.prompts} prompts x {args.n} samples, prompt "
        f"{args.prompt} tokens, up to {args.new} new; temperature 1, stop id {EOS_ID}, no KL, "
        f"one update per batch in micro-batches of {args.micro_prompts * args.n} rows, remat "
        f"{'on' if args.remat else 'off'}")
  for name, run in arms.items():
    start = time.perf_counter()
    run(1)  # compiles the arm's sampler and train step
    print(f"{name} compiled and warmed up in {time.perf_counter() - start:.0f} s", flush=True)
  seconds = {name: [] for name in arms}
  for round_index in range(args.rounds):
    for name, run in arms.items():
      seconds[name] += run(args.steps)
    print(f"  round {round_index + 1}: " + ", ".join(
        f"{name} {[round(s, 2) for s in seconds[name][-args.steps:]]}" for name in arms),
        flush=True)
  for name, samples in seconds.items():
    median, spread = common.summary(samples)
    print(f"  {name:<6} median {median:7.2f} s/step  min {min(samples):7.2f}  spread "
          f"{spread:4.0%}  ({len(samples)} steps)")
  if len(arms) == 2:
    ratio = statistics.median(seconds["tunix"]) / statistics.median(seconds["ours"])
    print(f"ours / tunix steps/s: {ratio:.2f} from medians, "
          f"{min(seconds['tunix']) / min(seconds['ours']):.2f} from fastest steps (target >= 1.5)")
  print(f"peak RSS of this process (every arm run): {common.peak_rss_gib():.2f} GiB")
  common.print_load()


def timed_call(fn) -> float:
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start

if __name__ == "__main__":
  main()
