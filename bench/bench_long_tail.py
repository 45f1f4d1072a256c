"""Long-tail rollouts: generated tokens/s of the continuous sampler vs the static one at equal KV memory.

The carry-multiplication task's own policy (the tiny model trained here for --sft-steps on
configs/sft.py:carry's data, or loaded with --base from an `sft` job's base directory) samples
--contexts problems of 1..20 digits, --n samples each, temperature 1, stopping at <eos>: a
completion is ~3 tokens per digit plus <eos>, so lengths spread ~10x within one request.

  static      today's static sampler under a KV budget: one generate() call per chunk of
              --static-contexts contexts (every row of a chunk in flight until its longest stops);
  continuous  one generate() call for every context with kv_budget_bytes = the static chunk's KV
              bytes: rows start as the KV pages they are promised (--reserve of a whole row's,
              in pages of --page-size tokens) are free, and take pages as they grow.

Both arms run in one process, alternating (bench/common.py); the script prints tokens/s, their
ratio, the rows in flight each arm holds and the completion-length distribution.

  python bench/bench_long_tail.py                      # 256 contexts x 16 samples
  python bench/bench_long_tail.py --quick              # 32 x 4, a sanity run
"""
from __future__ import annotations

import argparse
import heapq
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from jaxprefix import models, sampling  # noqa: E402
from jaxprefix.checkpoints import hf  # noqa: E402
from jaxprefix.data.tasks import carry_multiplication as task  # noqa: E402
from jaxprefix.sampling import budget, layout  # noqa: E402


def train_base(steps: int, path: str):
    """The demo policy after `steps` SFT steps of configs/sft.py's demo recipe (saved to path)."""
    import optax
    from jaxprefix.run_setup import sft_base
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..'))
    from configs import sft as sft_config
    config = sft_config.get_config('carry')
    tokenizer = task.tokenizer()
    model = models.Decoder(sft_base.model_config(config, tokenizer), rngs=nnx.Rngs(config.seed))
    schedule = optax.join_schedules([optax.linear_schedule(0.0, config.lr, config.warmup_steps),
                                     optax.constant_schedule(config.lr)], [config.warmup_steps])
    optimizer = nnx.Optimizer(model, optax.adamw(schedule, weight_decay=config.weight_decay),
                              wrt=nnx.Param)
    start = time.perf_counter()
    for step in range(1, steps + 1):
        loss = sft_base.train_step(model, optimizer, *map(jnp.asarray,
                                                     sft_base.training_batch(config, step, tokenizer)))
        if step % 100 == 0 or step == steps:
            print(f'  sft step {step}/{steps}: loss {float(loss):.3f} '
                  f'({time.perf_counter() - start:.0f} s)', flush=True)
    hf.save_pretrained(model, sft_base.model_config(config, tokenizer), path)
    return model


def load_or_train(base: str, steps: int):
    if os.path.exists(os.path.join(base, 'config.json')):
        print(f'policy: {base}')
        return hf.from_pretrained(base)[0]
    print(f'policy: training {steps} SFT steps into {base}')
    return train_base(steps, base)


def decode_steps(lengths: np.ndarray, n: int, static_contexts: int, rows_in_flight: int):
    """(static, continuous) decode steps these completion lengths need: each static chunk runs to
    its longest row; ideal continuous slots take the next sample, in request order, the step a
    row stops (no admission delay). Their ratio bounds the speed-up when a step costs the same in both arms."""
    per_context = lengths.reshape(-1, n)
    static = sum(int(per_context[i:i + static_contexts].max())
                 for i in range(0, len(per_context), static_contexts))
    free_at = [0] * rows_in_flight  # a min-heap of the steps at which each slot frees
    for length in lengths:
        heapq.heappush(free_at, heapq.heappop(free_at) + int(length))
    return static, max(free_at)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--contexts', type=int, default=256)
    parser.add_argument('--n', type=int, default=16)
    parser.add_argument('--static-contexts', type=int, default=16,
                        help='contexts per static call: sets the KV memory of both arms')
    parser.add_argument('--digits', default='1,20', help='problem digit range, inclusive')
    parser.add_argument('--repeats', type=int, default=5)
    parser.add_argument('--sft-steps', type=int, default=800)
    parser.add_argument('--base', default='/tmp/jaxprefix_bench_long_tail_base')
    parser.add_argument('--page-size', type=int, default=16,
                        help='continuous arm: tokens per KV page (rollout.page_size)')
    parser.add_argument('--reserve', type=float, default=0.5,
                        help='continuous arm: share of a whole row\'s pages promised to each '
                             'row it starts (rollout.kv_reserve; below 1 it may preempt)')
    parser.add_argument('--quick', action='store_true')
    args = parser.parse_args()
    if args.quick:
        args.contexts, args.n, args.static_contexts, args.repeats = 32, 4, 8, 2

    common.print_load()
    model = load_or_train(args.base, args.sft_steps)
    tokenizer = task.tokenizer()
    low, high = (int(x) for x in args.digits.split(','))
    problems = task.generate(args.contexts, digits=(low, high), seed=7)
    contexts = [tokenizer.encode(p.question) for p in problems]
    request = dict(n=args.n, max_new_tokens=task.MAX_COMPLETION_LENGTH, temperature=1.0,
                   stop_ids=(tokenizer.eos_id,))

    # The static chunk's KV bytes: its contexts' prefill plus a full new-token bucket per row.
    lay = layout.layout_contexts(contexts[:args.static_contexts], model.config.vocab_size)
    context_length = lay.prompt_tokens.shape[1] + lay.suffix_tokens.shape[1]
    new_bucket = layout.bucket(task.MAX_COMPLETION_LENGTH, layout.MIN_NEW_TOKENS_BUCKET)
    kv_bytes = budget.kv_bytes_per_token(model.config) * budget.static_kv_tokens(
        lay.valid.shape[0], args.n, context_length, new_bucket)
    paging = dict(page_size=args.page_size, reserve_fraction=args.reserve)
    plan = budget.plan(num_contexts=layout.bucket(args.contexts), n=args.n,
                           context_length=context_length, new_bucket=new_bucket, shards=1,
                           bytes_per_token=budget.kv_bytes_per_token(model.config),
                           page_bytes=budget.page_bytes_per_token(model.config,
                                                                  model.config.dtype),
                           kv_budget_bytes=kv_bytes, **paging)
    print(f'{args.contexts} contexts x {args.n} samples, digits {low}..{high}; KV budget '
          f'{kv_bytes / 2**20:.2f} MiB = static chunks of {args.static_contexts} contexts '
          f'({args.static_contexts * args.n} rows in flight); continuous: {plan}')

    def static_arm(seed=0):
        tokens = 0
        for start in range(0, args.contexts, args.static_contexts):
            r = sampling.generate(model, contexts[start:start + args.static_contexts],
                                  seed=seed * 1000 + start, **request)
            tokens += int(r.lengths.sum())
        return tokens

    def continuous_arm(seed=0):
        r = sampling.generate(model, contexts, seed=seed, kv_budget_bytes=kv_bytes, **paging,
                              **request)
        continuous_arm.lengths = r.lengths
        return int(r.lengths.sum())

    arms = {'static': static_arm, 'continuous': continuous_arm}
    compile_start = time.perf_counter()
    tokens = {name: arm() for name, arm in arms.items()}  # compile, and count tokens
    print(f'compiled and warmed up in {time.perf_counter() - compile_start:.0f} s')
    lengths = continuous_arm.lengths
    print(f'completion lengths: mean {lengths.mean():.1f}, p10 {np.percentile(lengths, 10):.0f}, '
          f'median {np.median(lengths):.0f}, p90 {np.percentile(lengths, 90):.0f}, max '
          f'{lengths.max()}; generated tokens per call: {tokens}')
    static_steps, continuous_steps = decode_steps(lengths, args.n, args.static_contexts,
                                                  plan.rows_in_flight)
    print(f'decode steps these lengths need: static {static_steps}, continuous '
          f'{continuous_steps} (ideal refill): at equal cost a step, continuous / static ~ '
          f'{static_steps / continuous_steps:.2f}')
    seconds = common.time_alternating(arms, args.repeats)
    for name, samples in seconds.items():
        median, spread = common.summary(samples)
        print(f'  {name:<11} median {median:7.3f} s  min {min(samples):7.3f} s  spread '
              f'{spread:4.0%}  {tokens[name] / median:9.0f} tokens/s')
    ratio = ((tokens['continuous'] / statistics.median(seconds['continuous'])) /
             (tokens['static'] / statistics.median(seconds['static'])))
    fastest = ((tokens['continuous'] / min(seconds['continuous'])) /
               (tokens['static'] / min(seconds['static'])))
    print(f'continuous / static generated tokens/s: {ratio:.2f} from medians, {fastest:.2f} from '
          f'fastest calls (target >= 1.6)')
    common.print_load()


if __name__ == '__main__':
    main()
