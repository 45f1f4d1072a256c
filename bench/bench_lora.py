"""LoRA vs full fine-tuning on SmolLM2-135M (f32, CPU): the RL update; how the sampler runs adapters.

Issue 15. Two parts, each timing its two arms in alternation in this one process:
  update   one Learner.update (fwd + bwd + AdamW) on the same GRPO rollout batch:
             lora  adapters of --rank on q, k, v, o, gate, up, down (alpha 32), base frozen;
             full  every weight trained.
           Peak RSS of each arm comes from a child process that loads, compiles and runs only it.
  sampler  sampling.generate of n continuations of one prompt with trained (non-zero) adapters:
             adapters  the adapted model, adapters applied per token inside the layer scan;
             merged    W + s A B folded into the base once (lora.merged, timed as part of the
                       call: an RL step merges once and samples once), then the plain model.
           Both arms sample the same tokens up to float rounding; the script reports the share
           of equal tokens.

  python bench/bench_lora.py                  # both parts, default shapes (minutes on 2 cores)
  python bench/bench_lora.py --quick          # small shapes, 2 rounds
  python bench/bench_lora.py --parts sampler --repeats 7
"""
from __future__ import annotations

import argparse
import gc
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench import common  # noqa: E402
from bench.bench_train_step import rollout_batch, train_config  # noqa: E402
from jaxprefix import sampling  # noqa: E402
from jaxprefix.models import lora  # noqa: E402
from jaxprefix.rl.train_step import Learner  # noqa: E402

PARTS = ("update", "sampler")
UPDATE_ARMS = ("lora", "full")
# update: (batch, prompt, completion); sampler: (prompt, n, new tokens).
SHAPES = {"update": (4, 128, 384), "sampler": (256, 16, 64)}
QUICK_SHAPES = {"update": (1, 16, 48), "sampler": (32, 4, 16)}


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--parts", default=",".join(PARTS))
  parser.add_argument("--arms", default=",".join(UPDATE_ARMS), help="update arms (child runs)")
  parser.add_argument("--rank", type=int, default=16)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--logprob-chunk", type=int, default=128)
  parser.add_argument("--no-rss", dest="rss", action="store_false")
  args = parser.parse_args(argv)
  args.parts = common.comma_list(parser, "--parts", args.parts, PARTS)
  args.arms = common.comma_list(parser, "--arms", args.arms, UPDATE_ARMS)
  args.shapes = QUICK_SHAPES if args.quick else SHAPES
  if args.quick:
    args.repeats = min(args.repeats, 2)
  return args


def adapted(model, rank: int, trained: bool):
  """`model` with adapters of `rank`; `trained` gives B small random values (B = 0 is the base)."""
  model = lora.with_adapters(model, lora.LoraConfig(rank))
  if trained:
    for i, name in enumerate(model.adapters.config.targets):
      b = getattr(model.adapters, f"{name}_b")
      b.set_value(0.01 * jax.random.normal(jax.random.key(i), b.shape, b.dtype))
  return model


class UpdateArm:
  """One Learner.update per call on a fixed batch, carrying the (donated) state."""

  def __init__(self, model, args, batch: dict):
    self.learner = Learner(model, train_config(args.logprob_chunk))
    self.state = self.learner.init_state()
    batch = dict(batch)
    batch["old_logprobs"] = np.asarray(self.learner.logprobs(self.state.params, batch))
    self.batch = self.learner.place_batch(batch)

  def __call__(self):
    self.state, metrics = self.learner.update(self.state, self.batch)
    return jax.block_until_ready(metrics)

  def trained_leaves(self) -> tuple[int, int]:
    """(arrays, scalars) the optimizer updates."""
    leaves = jax.tree.leaves(self.state.params)
    return len(leaves), sum(int(np.prod(x.shape)) for x in leaves)


def run_update(args, base, config):
  batch_size, prompt, completion = args.shapes["update"]
  batch = rollout_batch(config, batch_size, prompt, completion)
  arms = {}
  if "lora" in args.arms:
    arms["lora"] = UpdateArm(adapted(base, args.rank, trained=False), args, batch)
  if "full" in args.arms:
    arms["full"] = UpdateArm(base, args, batch)
  for name, arm in arms.items():
    metrics = arm()  # compiles
    count, scalars = arm.trained_leaves()
    print(f"{name}: {count} trained arrays, {scalars / 1e6:.2f} M trained scalars; first "
          f"grad norm {float(metrics['grad_norm']):.4g}")
  seconds = common.time_alternating(arms, args.repeats)
  tokens = batch_size * (prompt + completion)
  flops = 3 * config.flops_per_token(context_length=prompt + completion) * tokens
  common.print_table(f"RL update, SmolLM2-135M f32, B={batch_size} x T={prompt}+{completion}, "
                     f"LoRA rank {args.rank} vs full", seconds, tokens=tokens, flops=flops,
                     peak_gflops=args.peak)
  common.print_ratios(seconds, [("lora", "full")])


def run_sampler(args, base, config):
  prompt_len, n, new = args.shapes["sampler"]
  model = adapted(base, args.rank, trained=True)
  context = list(np.random.default_rng(0).integers(1, config.vocab_size, prompt_len))
  sample = dict(n=n, max_new_tokens=new, temperature=1.0, seed=0)

  arms = {"adapters": lambda: sampling.generate(model, [context], **sample),
          "merged": lambda: sampling.generate(lora.merged(model), [context], **sample)}
  first = {name: np.asarray(arm().tokens) for name, arm in arms.items()}  # compiles
  same = float((first["adapters"] == first["merged"]).mean())
  print(f"sampler: {same:.1%} of token positions equal between the arms")
  seconds = common.time_alternating(arms, args.repeats)
  tokens = n * new
  flops = config.flops_per_token(context_length=prompt_len + new // 2) * tokens
  common.print_table(f"sampling n={n} x {new} new tokens after a {prompt_len}-token prompt, "
                     f"SmolLM2-135M f32, trained LoRA rank {args.rank}", seconds,
                     tokens=tokens, flops=flops, peak_gflops=args.peak)
  common.print_ratios(seconds, [("merged", "adapters")])


def print_peak_rss(args):
  print("\npeak RSS GiB of a child process running one update arm (load, compile, 2 steps):")
  batch_size, prompt, completion = args.shapes["update"]
  for arm in UPDATE_ARMS:
    child = ["--parts", "update", "--arms", arm, "--rank", str(args.rank), "--repeats", "1",
             "--no-rss", "--logprob-chunk", str(args.logprob_chunk)]
    child += ["--quick"] if args.quick else []
    gib = common.child_peak_rss_text(__file__, child)
    print(f"  {arm:<8}{gib}  (B={batch_size} x T={prompt}+{completion})", flush=True)


def main(argv=None):
  args = parse_args(argv)
  common.print_load()
  args.peak = common.matmul_peak_gflops()
  print(f"matmul peak (jitted f32 2048^3): {args.peak:.1f} GFLOP/s")
  base, config = common.load_smollm2()
  for part in args.parts:
    (run_update if part == "update" else run_sampler)(args, base, config)
    gc.collect()
    sys.stdout.flush()
  print(f"matmul peak after: {common.matmul_peak_gflops():.1f} GFLOP/s")
  common.print_load()
  if args.rss and "update" in args.parts:
    print_peak_rss(args)
  common.report_peak_rss()


if __name__ == "__main__":
  main()
