"""The policy model: ModelConfig, Decoder (flax.nnx), KV segments, scoring, sharding.

Reading and writing model files is jaxprefix.checkpoints (hf: from_pretrained, save_pretrained,
from_gguf), which builds on this package and is never imported by it."""
from jaxprefix.models.attention import KVCache, KVSegment
from jaxprefix.models.config import ModelConfig, Rope
from jaxprefix.models.decoder import Decoder
from jaxprefix.models.scoring import token_logprobs
from jaxprefix.models.sharding import make_mesh, shard_model, split_meshes

__all__ = ['Decoder', 'KVCache', 'KVSegment', 'ModelConfig', 'Rope', 'make_mesh', 'shard_model', 'split_meshes',
           'token_logprobs']
