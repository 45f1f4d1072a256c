"""Sampler and learner overlapped (train.max_staleness=1, rollout.devices=1) vs the synchronous
loop, on two host-platform devices, at the long-tail bench's shape.

A tiny random decoder over the carry-multiplication task's vocabulary (problems of 1..20
digits) runs the real RL loop (rl/loop.train: sample, reward, update) for --steps steps per
call, GRPO with a toy reward (the share of '+' in a completion, as tests/test_loop.py), so
groups carry signal and every update moves the weights. At temperature 1 a random policy stops
at <eos> after a geometric number of tokens: lengths spread over the whole --max-new-tokens, the
tail every step waits for.

  sync     train.max_staleness=0, rollout.devices=0: sample, then update, on both devices;
  split    train.max_staleness=0, rollout.devices=1: sample on device 1, then update on device
           0 (the split alone, no overlap);
  overlap  train.max_staleness=1, rollout.devices=1: the split, step t's rollouts sampled with
           the weights of t - 1 updates while the learner updates on step t - 1's.
  inflight overlap with rollout.inflight_kv=keep: the weights of t updates, published while
           step t decodes, take over at its next chunk (the KV kept); the table's mean staleness
           and in-flight share say how many tokens they drew.
  recompute inflight with rollout.inflight_kv=recompute: the new weights compute the KV
           written so far again before they decode on.
  partial  the synchronous loop with partial rollouts (rollout.partial_tokens = a quarter of
           --max-new-tokens): a step trains the groups the step before drew, their tails
           decoded beside its own request's first rounds (rl/partial.py).

Each call is a fresh run in a new workdir; the figure is the median step time over its steps
after the first two (compilation is paid once per process, in a warm-up call of each arm).
Arms alternate round after round (bench/common.py). Printed beside: cores, threads, devices.

  python bench/bench_overlap.py                 # 16 contexts x 8 samples, 6 steps, 3 rounds
  python bench/bench_overlap.py --quick         # 4 x 4, 4 steps, 1 round
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import jax  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from jaxprefix import rewards, run_config  # noqa: E402
from jaxprefix.data.tasks import carry_multiplication as task  # noqa: E402
from jaxprefix.methods.grpo import GrpoMethod  # noqa: E402
from jaxprefix.methods.prompting import TaskPrompts  # noqa: E402
from jaxprefix.models.config import ModelConfig  # noqa: E402
from jaxprefix.models.decoder import Decoder  # noqa: E402
from jaxprefix.models.sharding import shard_model, split_meshes  # noqa: E402
from jaxprefix.rl.loop import train  # noqa: E402
from jaxprefix.run_setup.learner_settings import loop_settings, validate  # noqa: E402
from jaxprefix.rl.metrics import read_metrics  # noqa: E402
from jaxprefix.sampling import RolloutSpec  # noqa: E402


def plus_share(text, problem):
    return text.count("+") / max(len(text), 1)


rewards.register("bench_plus_share", plus_share, in_process=True)
TOKENIZER = task.tokenizer()


def model_config(hidden: int) -> ModelConfig:
    return ModelConfig(model_type="llama", vocab_size=TOKENIZER.vocab_size, hidden_size=hidden,
                       intermediate_size=3 * hidden, num_layers=4, num_heads=4, num_kv_heads=2,
                       head_dim=hidden // 4, tie_word_embeddings=True)


# (train.max_staleness, rollout.devices, rollout.inflight_kv, rollout.partial_tokens as a share
# of max_new_tokens)
ARMS = {"sync": (0, 0, "", 0), "split": (0, 1, "", 0), "overlap": (1, 1, "", 0),
        "inflight": (1, 1, "keep", 0), "recompute": (1, 1, "recompute", 0),
        "partial": (0, 0, "", 0.25)}


def settings(args, arm: str):
    staleness, devices, inflight_kv, partial = ARMS[arm]
    c = run_config.base_config()
    c.data.verifier = "bench_plus_share"
    c.rollout.update(n=args.n, max_new_tokens=args.max_new_tokens, devices=devices,
                     inflight_kv=inflight_kv,
                     partial_tokens=int(partial * args.max_new_tokens))
    c.train.update(problems_per_step=args.contexts, total_steps=args.steps, learning_rate=1e-3,
                   max_staleness=staleness)
    c.eval.every = 0
    c.checkpoint.update(every=args.steps, keep=1)
    return c


def one_run(args, arm: str) -> list[dict]:
    """A fresh run of args.steps steps; its metrics rows."""
    config = settings(args, arm)
    mesh, sampler_mesh = split_meshes(config.rollout.devices, devices=jax.devices()[:2])
    problems = task.generate(4 * args.contexts, digits=(1, 20), seed=0)
    method = GrpoMethod(TaskPrompts(TOKENIZER), problems, problems_per_step=args.contexts,
                        n=args.n, seed=0)
    model = shard_model(Decoder(model_config(args.hidden), rngs=nnx.Rngs(0)), mesh)
    with tempfile.TemporaryDirectory() as workdir:
        train(loop_settings(config), workdir, method=method, model=model, tokenizer=TOKENIZER,
              stop_ids=(TOKENIZER.eos_id,), progress=False, mesh=mesh, sampler_mesh=sampler_mesh,
              learner_config=validate(config, mesh),
              rollout=RolloutSpec.from_config(config.rollout, training=True),
              contexts_per_step=args.contexts)
        return read_metrics(workdir)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--arms", default=",".join(ARMS),
                        help=f"comma-separated arms to run, of {','.join(ARMS)}")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.contexts, args.n, args.steps, args.rounds = 4, 4, 4, 1
    if len(jax.devices()) < 2:
        parser.error("needs two devices: XLA_FLAGS=--xla_force_host_platform_device_count=2")
    names = args.arms.split(",")
    if not set(names) <= set(ARMS):
        parser.error(f"--arms={args.arms}: expected arms of {','.join(ARMS)}")
    common.print_load()
    print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS')}; {args.contexts} contexts x {args.n} "
          f"samples x up to {args.max_new_tokens} new tokens, hidden {args.hidden}, "
          f"{args.steps} steps a call, medians over steps 3..{args.steps}")
    for name in names:  # compiles each arm's programs once
        one_run(args, name)
    steps = {name: [] for name in names}
    detail = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            rows = one_run(args, name)[2:]
            steps[name] += [row["time/step"] for row in rows]
            detail[name] += rows
    print(f"\n{'arm':<9}{'step s':>8}{'min s':>8}{'wait s':>8}{'update s':>9}"
          f"{'sampling s':>11}{'stale max':>10}{'mean':>6}{'in-flight':>10}{'tokens/s':>10}")
    for name, rows in detail.items():
        med = lambda key: statistics.median(row[key] for row in rows)
        mean = lambda key: statistics.mean(row[key] for row in rows)
        print(f"{name:<9}{med('time/step'):>8.3f}{min(steps[name]):>8.3f}"
              f"{med('time/sampler_wait'):>8.3f}{med('time/update'):>9.3f}"
              f"{med('time/sampler_busy'):>11.3f}{max(r['staleness/max'] for r in rows):>10}"
              f"{mean('staleness/mean'):>6.2f}{mean('staleness/inflight_share'):>10.2f}"
              f"{med('throughput/tokens_per_s'):>10.1f}")
    for slow, fast in (("sync", "overlap"), ("split", "overlap"), ("sync", "split"),
                       ("overlap", "inflight"), ("overlap", "recompute"), ("sync", "partial")):
        if slow not in steps or fast not in steps:
            continue
        gain = statistics.median(steps[slow]) / statistics.median(steps[fast])
        print(f"{fast} vs {slow} (step rate): {gain:.2f}x from medians, "
              f"{min(steps[slow]) / min(steps[fast]):.2f}x from fastest steps")


if __name__ == "__main__":
    main()
