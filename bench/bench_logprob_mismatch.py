"""How far the sampler's log-probs are from the learner's: by KV dtype (SmolLM2-135M, CPU), and
for a mixture of experts with and without routing replay (a small random Qwen3-MoE).

The sampler reports the log-prob of each token it draws; the learner recomputes them teacher-
forced (models.token_logprobs, what train.old_logprobs=learner uses). They differ by rounding:
the sampler decodes one token at a time over its KV pages (bf16, or int8 with per-token scales),
the learner runs the whole sequence at once. This prints, per KV dtype, the mean and max
|sampler - learner| log-prob per completion token and their mean difference (a bias would
shift every importance ratio), with the compute dtype and rollout shape it ran.

  python bench/bench_logprob_mismatch.py                    # bf16 compute, 8 prompts x 4, 64 tokens
  python bench/bench_logprob_mismatch.py --dtype float32 --kv float32,bfloat16,int8

--model moe: a random Qwen3-MoE (common.random_qwen3_moe: 6 layers of 16 experts, top-2),
f32 master weights and the sampler's bf16 copy as in the RL loop, paged decode. It prints the
share of tokens whose expert set (in any sparse layer) differs between the sampler's forward
and the learner's teacher-forced one, |sampler - learner| log-prob mean and max without and
with routing replay (the learner reusing the sampler's experts), and then a short GRPO run each
way (one update a step on the sampler's log-probs as pi_old: the ratio's deviation from 1 is
the mismatch; a reward of the share of even tokens gives the groups variance): per step the
clip fraction and |ratio - 1| mean and max.

  python bench/bench_logprob_mismatch.py --model moe [--steps 4]
"""
from __future__ import annotations

import argparse
import os
import sys

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from jaxprefix.checkpoints import gguf, hf  # noqa: E402
from jaxprefix.models.scoring import token_logprobs  # noqa: E402
from jaxprefix.rl import dynamic_sampling, objectives  # noqa: E402
from jaxprefix.rl.train_config import TrainConfig  # noqa: E402
from jaxprefix.rl.train_step import Learner  # noqa: E402
from jaxprefix.sampling import generate  # noqa: E402

PROMPTS = ['The capital of France is', 'def fibonacci(n):\n    ', 'Solve: 12 * 7 = ',
           'Once upon a time, in a small village,', 'The three laws of thermodynamics are',
           'import numpy as np\n', 'Q: What is the boiling point of water?\nA:',
           'Photosynthesis is']


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--model', default='smollm2', choices=('smollm2', 'moe'))
    parser.add_argument('--dtype', default='bfloat16', help='compute dtype of both')
    parser.add_argument('--kv', default='bfloat16,int8', help='KV page dtypes to compare')
    parser.add_argument('--n', type=int, default=4)
    parser.add_argument('--new', type=int, default=64)
    parser.add_argument('--steps', type=int, default=4, help='--model moe: GRPO steps each way')
    args = parser.parse_args()
    common.print_load()
    if args.model == 'moe':
        moe_mismatch(args)
    else:
        kv_mismatch(parser, args)
    common.print_load()


def kv_mismatch(parser, args):
    gguf_path = gguf.bundled_smollm2_path()
    model, _ = hf.from_gguf(gguf_path, args.dtype)
    import transformers
    folder, name = os.path.split(gguf_path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    contexts = [[1] + tokenizer(p)['input_ids'] for p in PROMPTS]
    graphdef, params = nnx.split(model)  # weights as arguments, not constants to fold
    score = jax.jit(lambda params, tokens, mask: token_logprobs(nnx.merge(graphdef, params),
                                                                tokens, mask)[0])
    print(f'SmolLM2-135M, {args.dtype} compute, {len(contexts)} prompts x n={args.n}, '
          f'{args.new} new tokens at temperature 1, paged (continuous) decode')
    for kv in common.comma_list(parser, '--kv', args.kv, ('float32', 'bfloat16', 'int8')):
        r = generate(model, contexts, n=args.n, max_new_tokens=args.new, temperature=1.0,
                     seed=0, max_rows_in_flight=8, page_size=16, kv_dtype=kv)
        mask = r.tokens != 0
        mask[np.arange(len(mask)), 0] = True
        mask |= r.completion_mask.astype(bool)
        learner = np.asarray(score(params, r.tokens, mask))
        sampled = r.completion_mask.astype(bool)
        diff = (r.logprobs - learner)[sampled]
        print(f'  {kv:<9} KV: |sampler - learner| log-prob per token: mean {np.abs(diff).mean():.4f}, '
              f'max {np.abs(diff).max():.4f}; mean (sampler - learner) {diff.mean():+.4f} over '
              f'{diff.size} tokens')


def moe_mismatch(args):
    model = common.random_qwen3_moe(dtype=args.dtype)
    config = model.config
    rng = np.random.default_rng(0)
    contexts = [rng.integers(1, config.vocab_size, size=int(s)).tolist()
                for s in rng.integers(8, 25, size=len(PROMPTS))]
    rows = len(contexts) * args.n
    print(f'random Qwen3-MoE ({config.num_layers} layers, {config.num_experts} experts, top-'
          f'{config.num_experts_per_tok}), f32 master weights, {args.dtype} compute (sampler: '
          f'a {args.dtype} copy, paged decode), {len(contexts)} contexts x n={args.n}, {args.new} '
          f'new tokens at temperature 1')

    def sample(learner, state, seed):
        r = generate(learner.sampling_model(state), contexts, n=args.n, max_new_tokens=args.new,
                     temperature=1.0, seed=seed, max_rows_in_flight=rows // 2, page_size=16,
                     record_routes=True)
        rewards = r.grouped((r.tokens % 2 == 0).sum(1, where=r.completion_mask > 0)
                            / np.maximum(r.lengths, 1)).astype(np.float32)
        advantages = np.asarray(objectives.group_advantages(rewards, 'grpo'))
        selection = dynamic_sampling.select_groups([rewards], len(contexts),
                                                   drop_zero_variance=False)
        return dynamic_sampling.build_batch([r], [advantages], selection)

    train = TrainConfig(learning_rate=3e-3, micro_batch_size=rows // 2)
    learner = Learner(model, train)
    state = learner.init_state()
    batch = sample(learner, state, seed=0)
    loss_tokens = batch['completion_mask'] > 0
    model = learner.model(state)
    own = np.asarray(jax.jit(lambda m, b: m.route(b['tokens'], b['positions'], b['token_mask']))(
        model, {k: batch[k] for k in ('tokens', 'positions', 'token_mask')}))
    recorded = batch['routes']
    differs = np.any(np.sort(own, -1) != np.sort(recorded, -1), axis=-1)  # [B, L, layers]
    kept = recorded[..., 0, 0] >= 0  # every token but a row's last (never fed) and padding
    sampled = kept & loss_tokens
    print(f'  expert sets differing between sampler and learner: {differs.any(-1)[kept].mean():.2%}'
          f' of {kept.sum()} tokens (in some sparse layer), {differs[kept].mean():.2%} of '
          f'(token, layer) pairs; {differs.any(-1)[sampled].mean():.2%} of the {sampled.sum()} '
          f'sampled ones')
    for name, fields in (('without replay', batch.keys() - {'routes'}), ('with replay', batch)):
        learner_logp = np.asarray(learner.logprobs(state.params, {k: batch[k] for k in fields}))
        diff = (batch['old_logprobs'] - learner_logp)[loss_tokens]
        print(f'  {name:<15} |sampler - learner| log-prob per sampled token: mean '
              f'{np.abs(diff).mean():.3g}, max {np.abs(diff).max():.3g} over {diff.size} tokens')

    print(f'  GRPO, {args.steps} steps each way (lr {train.learning_rate}, one update a step, '
          f'pi_old = the sampler\'s log-probs): per step clip fraction, |ratio - 1| mean, max')
    for replay in (False, True):
        state, lines = learner.init_state(), []
        for step in range(args.steps):
            batch = sample(learner, state, seed=step)
            if not replay:
                del batch['routes']
            logp = np.asarray(learner.logprobs(state.params, batch))
            mask = batch['completion_mask'] > 0
            dev = np.abs(np.exp(logp - batch['old_logprobs']) - 1)[mask]
            state, metrics = learner.update(state, batch)
            lines.append(f'{float(metrics["clip_frac/total"]):.3g} {dev.mean():.3g} '
                         f'{dev.max():.3g}')
        print(f'  {"with" if replay else "without"} replay: ' + ' | '.join(lines))


if __name__ == '__main__':
    main()
