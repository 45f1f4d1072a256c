"""The policy model: ModelConfig, Decoder (flax.nnx), KV segments, scoring, checkpoint I/O."""
import jax.numpy as jnp

from jaxprefix.models.attention import KVCache, KVSegment
from jaxprefix.models.config import ModelConfig, Rope
from jaxprefix.models.decoder import Decoder
from jaxprefix.models.scoring import token_logprobs
from jaxprefix.models.sharding import make_mesh, shard_model
from jaxprefix.checkpoints.hf import from_pretrained, load_hf_state, save_pretrained


def from_gguf(path, dtype=jnp.float32):
  """A Decoder from a GGUF file (llama architecture); see jaxprefix.checkpoints.gguf."""
  from jaxprefix.checkpoints.gguf import from_gguf as load  # optional module, imported lazily
  return load(path, dtype)


__all__ = ['Decoder', 'KVCache', 'KVSegment', 'ModelConfig', 'Rope', 'from_gguf',
           'from_pretrained', 'load_hf_state', 'make_mesh', 'save_pretrained', 'shard_model',
           'token_logprobs']
