"""Where the LoRA update's time goes, ours against torch's, on one micro-batch (issue 48).

One micro-batch of --rows x --width tokens of SmolLM2-135M-Instruct with LoRA rank 16 on every
projection (alpha 32), the same weights in both frameworks (our HF export read back by
transformers, peft's adapters, torch 2 threads):
  forward    the logits, no gradient
  backward   the gradient of the mean log-prob of every next token w.r.t. the adapters alone
             (the learner's update without its optimizer, clipping and micro-batch loop)
Ours at f32 and with bf16 compute (`model.dtype=bfloat16`: the frozen base and the activations
bf16, the adapters f32), torch at f32 (its autocast is not what TRL's CPU run uses). Arms alternate,
--rounds rounds after one untimed call each; printed: medians, spreads, backward / forward
per arm, and each of ours against torch's.

    python bench/bench_update_split.py                 # 8 x 256, 3 rounds
"""
from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from bench import common  # noqa: E402
from jaxprefix.checkpoints.gguf import bundled_smollm2_path  # noqa: E402
from jaxprefix.checkpoints.hf import from_gguf  # noqa: E402
from jaxprefix.models import lora  # noqa: E402

RANK, ALPHA = 16, 32.0


def ours(model, tokens):
  """(forward, backward) callables of our Decoder with adapters on `tokens`."""
  graphdef, params, rest = nnx.split(model, lora.trainable(model), ...)

  def logits(params, rest, tokens):
    return nnx.merge(graphdef, params, rest)(tokens)

  def mean_logprob(params, rest, tokens):
    lp = jax.nn.log_softmax(logits(params, rest, tokens)[:, :-1].astype(jnp.float32), -1)
    return jnp.take_along_axis(lp, tokens[:, 1:, None], -1).mean()

  forward, backward = jax.jit(logits), jax.jit(jax.grad(mean_logprob))
  return (common.blocking(lambda: forward(params, rest, tokens)),
          common.blocking(lambda: backward(params, rest, tokens)))


def torch_arms(model, config, tokens):
  """(forward, backward) callables of transformers + peft on the same weights and tokens."""
  import torch
  from peft import LoraConfig, get_peft_model

  peer = common.transformers_llama(model, config)
  peer = get_peft_model(peer, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules="all-linear"))
  ids = torch.as_tensor(np.asarray(tokens, np.int64))

  def forward():
    with torch.no_grad():
      return peer(input_ids=ids).logits

  def backward():
    logits = peer(input_ids=ids).logits[:, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).mean()
    lp.backward()
    peer.zero_grad(set_to_none=True)

  return forward, backward


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, default=8)
  parser.add_argument("--width", type=int, default=256)
  parser.add_argument("--rounds", type=int, default=3)
  args = parser.parse_args()
  common.print_load()
  model, config = common.load_smollm2()
  tokens = jnp.asarray(np.random.default_rng(0).integers(3, config.vocab_size,
                                                         (args.rows, args.width)), jnp.int32)
  arms = {}
  arms["torch_fwd"], arms["torch_bwd"] = torch_arms(model, config, tokens)
  for dtype in ("float32", "bfloat16"):
    # With LoRA the frozen base is held in the compute dtype (run_setup/policy.model_dtypes).
    cast = model if dtype == "float32" else from_gguf(bundled_smollm2_path(), jnp.bfloat16)[0]
    adapted = lora.with_adapters(cast, lora.LoraConfig(RANK, alpha=ALPHA))
    arms[f"ours_{dtype}_fwd"], arms[f"ours_{dtype}_bwd"] = ours(adapted, tokens)
  for call in arms.values():  # compiles, warm-ups
    call()
  seconds = common.time_alternating(arms, args.rounds)
  print(f"one micro-batch of {args.rows} x {args.width} tokens, LoRA r{RANK} on every projection:")
  for name, samples in seconds.items():
    median, spread = common.summary(samples)
    print(f"  {name:<18} {median:7.2f} s  spread {spread:4.0%}")
  med = {name: float(np.median(s)) for name, s in seconds.items()}
  for arm in ("torch", "ours_float32", "ours_bfloat16"):
    print(f"  {arm}: backward / forward {med[f'{arm}_bwd'] / med[f'{arm}_fwd']:.2f}")
  for dtype in ("float32", "bfloat16"):
    print(f"  torch / ours_{dtype}: forward {med['torch_fwd'] / med[f'ours_{dtype}_fwd']:.2f}x, "
          f"backward {med['torch_bwd'] / med[f'ours_{dtype}_bwd']:.2f}x")
  print(f"  f32 matmul yardstick: {common.matmul_peak_gflops():.0f} GFLOP/s")
  common.print_load()


if __name__ == "__main__":
  main()
