"""Forward tokens/s of SmolLM2-135M (f32, CPU): our Decoder vs Tunix's llama3 vs transformers.

Issue 2. All three arms hold the same weights (our GGUF import, handed to Tunix parameter by
parameter and to transformers through our HF export) and compute full [B, T, V] logits of one
fixed batch of B random sequences of T tokens:
  ours          jax.jit over nnx.split/merge of `Decoder(tokens)`
  tunix         jax.jit over Tunix 0.1.7 `Llama3(tokens, positions, None, causal mask)`, with
                its dropped rope_theta restored (bench.common.tunix_llama3)
  transformers  LlamaForCausalLM (torch, sdpa attention, inference_mode, 2 threads)
Before timing, every arm's logits are checked against ours. FLOPs per call count every matmul
weight plus dense T x T attention scores (what each arm executes; ModelConfig.flops_per_token).

  python bench/bench_forward.py            # B=4, T=512, 5 rounds: minutes on 2 cores
  python bench/bench_forward.py --quick    # B=1, T=64, 2 rounds: a sanity run
  python bench/bench_forward.py --arms ours,tunix --batch 8 --length 256
"""
from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from bench import common  # noqa: E402

ARMS = ("ours", "tunix", "transformers")
# f32 through 30 layers: arms agree to ~1e-4 on logits of magnitude ~20.
LOGITS_ATOL = 2e-2


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="B=1, T=64, 2 rounds")
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--length", type=int, default=512)
  parser.add_argument("--repeats", type=int, default=5, help="rounds of alternating calls")
  parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated of {ARMS}")
  parser.add_argument("--threads", type=int, default=2, help="torch threads (transformers)")
  args = parser.parse_args(argv)
  if args.quick:
    args.batch, args.length, args.repeats = 1, 64, 2
  args.arms = [a for a in args.arms.split(",") if a]
  unknown = sorted(set(args.arms) - set(ARMS))
  if unknown or "ours" not in args.arms:
    parser.error(f"--arms {','.join(args.arms)}: expected 'ours' plus any of {ARMS}")
  return args


def build_arms(args, model, config, tokens):
  """name -> compiled, blocking () -> logits callable, all on the same weights and tokens."""
  forward = common.forward_fn(model)
  arms = {"ours": common.blocking(lambda: forward(tokens))}
  if "tunix" in args.arms:
    tunix_forward = common.tunix_forward_fn(common.tunix_llama3(model, config))
    arms["tunix"] = common.blocking(lambda: tunix_forward(tokens))
  if "transformers" in args.arms:
    peer = common.transformers_llama(model, config, threads=args.threads)
    arms["transformers"] = common.torch_forward_fn(peer, tokens)
  return arms


def check_same_logits(arms) -> dict[str, float]:
  """Calls every arm once (compiling it) and returns each peer's max |logits - ours|; raises
  if a peer computes something else (e.g. Tunix without the rope_theta fix is off by ~10)."""
  reference = np.asarray(arms["ours"]())
  errors = {}
  for name, arm in arms.items():
    if name != "ours":
      errors[name] = float(np.abs(np.asarray(arm()) - reference).max())
      if errors[name] > LOGITS_ATOL:
        raise AssertionError(f"{name} logits differ from ours by {errors[name]:.3g} "
                             f"(> {LOGITS_ATOL}): the arms do not compute the same model")
  return errors


def main(argv=None):
  args = parse_args(argv)
  common.print_load()
  peak = common.matmul_peak_gflops()
  print(f"matmul peak (jitted f32 2048^3): {peak:.1f} GFLOP/s")

  model, config = common.load_smollm2()
  tokens = np.random.default_rng(0).integers(
      1, config.vocab_size, (args.batch, args.length)).astype(np.int32)
  arms = build_arms(args, model, config, tokens)
  for name, error in check_same_logits(arms).items():
    print(f"max |logits {name} - ours| = {error:.2e}")

  seconds = common.time_alternating(arms, args.repeats)
  calls_tokens = args.batch * args.length
  flops = config.flops_per_token(context_length=args.length) * calls_tokens
  common.print_table(
      f"SmolLM2-135M forward, f32, B={args.batch} x T={args.length} "
      f"({flops / 1e12:.3f} TFLOP a call)", seconds, tokens=calls_tokens, flops=flops,
      peak_gflops=peak)
  common.print_ratios(seconds, [("ours", "tunix"), ("ours", "transformers")])
  # The peak again: a change during the run means the box's load changed under us.
  print(f"matmul peak after: {common.matmul_peak_gflops():.1f} GFLOP/s")
  common.print_load()


if __name__ == "__main__":
  main()
