"""Learner update with blockwise attention vs the dense attention it replaced (issue 13).

Both arms take one Learner.update (forward, backward, AdamW) of SmolLM2-135M-Instruct (bundled
GGUF, f32, remat as in the smollm2 variant) on the same batch of one row of T tokens:
  blockwise  the decoder's no-cache path as shipped: models/backend.attend, which on CPU
             is models/blockwise_attention.attend (tiles, online softmax, flash-style VJP);
  dense      models/attention.attend, which builds the [heads, T, T] scores of every layer (what
             the no-cache path ran before), swapped in while that arm's update is traced.
Time: rounds of one update per arm, alternating, in one process, at each --time-lengths T.
Peak RSS: a child process per arm and T that loads, compiles and runs only that arm.
Target: peak memory linear in T (blockwise), time within 1.2x of dense at T = 2048.

  python bench/bench_long_attention.py                  # time at 2048; RSS at 2048 and 8192
  python bench/bench_long_attention.py --quick          # T = 256, 2 rounds
"""
from __future__ import annotations

import argparse
import contextlib
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench import common  # noqa: E402
from jaxprefix.models import attention, backend  # noqa: E402
from jaxprefix.rl import train_step  # noqa: E402
from jaxprefix.rl.train_config import TrainConfig  # noqa: E402
from jaxprefix.rl.train_step import Learner  # noqa: E402

ARMS = ("blockwise", "dense")


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--time-lengths", default="2048", help="T values timed (comma-separated)")
  parser.add_argument("--rss-lengths", default="2048,8192", help="T values of the RSS children")
  parser.add_argument("--arms", default=",".join(ARMS))
  parser.add_argument("--repeats", type=int, default=3, help="rounds of alternating updates")
  parser.add_argument("--quick", action="store_true", help="T = 256, 2 rounds")
  parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.quick:
    args.time_lengths = args.rss_lengths = "256"
    args.repeats = min(args.repeats, 2)
  args.time_lengths = [int(t) for t in args.time_lengths.split(",") if t]
  args.rss_lengths = [int(t) for t in args.rss_lengths.split(",") if t]
  args.arms = [a for a in args.arms.split(",") if a]
  if not args.arms or set(args.arms) - set(ARMS):
    parser.error(f"--arms: expected some of {ARMS}")
  return args


@contextlib.contextmanager
def dense_attention():
  """The no-cache path with attention.attend (dense scores) while a function is traced."""
  original = backend.attend

  def dense(q, q_pos, segments, *, scale, window=None, logit_cap=None, sliding_window=None):
    return attention.attend(q, q_pos, segments, scale=scale, window=window, logit_cap=logit_cap)
  backend.attend = dense
  try:
    yield
  finally:
    backend.attend = original


def batch_of(config, length: int, seed: int = 0) -> dict:
  """One rollout row: a prompt of T/4 tokens and a completion filling the rest."""
  rng = np.random.default_rng(seed)
  prompt = length // 4
  cols = np.arange(length)[None]
  return {"tokens": rng.integers(1, config.vocab_size, (1, length)).astype(np.int32),
          "positions": cols.astype(np.int32), "token_mask": np.ones((1, length), bool),
          "completion_mask": (cols >= prompt).astype(np.float32),
          "old_logprobs": np.zeros((1, length), np.float32),
          "advantages": np.ones((1,), np.float32)}


class Arm:
  """One update per call, state carried (donated) from call to call. The dense arm's update is
  its own jit of the same function, so the two arms' programs live side by side."""

  def __init__(self, name: str, model, length: int):
    config = TrainConfig(learning_rate=1e-6, remat=True, logprob_chunk=256)
    self.learner = Learner(model, config)
    self.state = self.learner.init_state()
    self.batch = self.learner.place_batch(batch_of(model.config, length))
    self.dense = name == "dense"
    self.update = (jax.jit(train_step._update.__wrapped__, static_argnums=(0, 1, 2),
                           donate_argnums=3) if self.dense else train_step._update)

  def __call__(self):
    learner = self.learner
    with dense_attention() if self.dense else contextlib.nullcontext():
      self.state, metrics = self.update(learner._train_graphdef, learner.config, False,
                                        self.state, learner.rest, self.batch)
    return jax.block_until_ready(metrics)


def main(argv=None):
  args = parse_args(argv)
  model, config = common.load_smollm2()
  if args.child:  # one arm, one length: its peak RSS
    arm = Arm(args.arms[0], model, args.time_lengths[0])
    arm()
    common.report_peak_rss()
    return
  common.print_load()
  for length in args.time_lengths:
    arms = {name: Arm(name, model, length) for name in args.arms}
    for arm in arms.values():
      arm()  # compile
    seconds = common.time_alternating(arms, args.repeats)
    flops = 4 * config.flops_per_token(length // 2) * length  # fwd + remat fwd + bwd (2x)
    common.print_table(f"SmolLM2-135M update, f32, remat, 1 x T={length}", seconds,
                       tokens=length, flops=flops, peak_gflops=common.matmul_peak_gflops())
    if len(arms) == 2:
      common.print_ratios(seconds, [("blockwise", "dense")])
    del arms
  common.print_load()
  print("\npeak RSS (GiB) of a child that loads, compiles and runs one update")
  print("| T | " + " | ".join(args.arms) + " |\n|---:|" + "---:|" * len(args.arms))
  script = str(pathlib.Path(__file__).resolve())
  for length in args.rss_lengths:
    cells = [f"{common.child_peak_rss_gib(script, ['--child', '--arms', arm, '--time-lengths', str(length)]):.2f}"
             for arm in args.arms]
    print(f"| {length} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
  main()
