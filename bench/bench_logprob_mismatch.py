"""How far the sampler's log-probs are from the learner's, by KV dtype (SmolLM2-135M, CPU).

The sampler reports the log-prob of each token it draws; the learner recomputes them teacher-
forced (models.token_logprobs, what train.old_logprobs=learner uses). They differ by rounding:
the sampler decodes one token at a time over its KV pages (bf16, or int8 with per-token scales),
the learner runs the whole sequence at once. This prints, per KV dtype, the mean and max
|sampler - learner| log-prob per completion token and their mean difference (a bias would
shift every importance ratio), with the compute dtype and rollout shape it ran.

  python bench/bench_logprob_mismatch.py                    # bf16 compute, 8 prompts x 4, 64 tokens
  python bench/bench_logprob_mismatch.py --dtype float32 --kv float32,bfloat16,int8
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
from jaxprefix.sampling import generate  # noqa: E402

PROMPTS = ['The capital of France is', 'def fibonacci(n):\n    ', 'Solve: 12 * 7 = ',
           'Once upon a time, in a small village,', 'The three laws of thermodynamics are',
           'import numpy as np\n', 'Q: What is the boiling point of water?\nA:',
           'Photosynthesis is']


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--dtype', default='bfloat16', help='compute dtype of both')
    parser.add_argument('--kv', default='bfloat16,int8', help='KV page dtypes to compare')
    parser.add_argument('--n', type=int, default=4)
    parser.add_argument('--new', type=int, default=64)
    args = parser.parse_args()
    common.print_load()
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
    common.print_load()


if __name__ == '__main__':
    main()
