"""The policy model: ModelConfig, Decoder (flax.nnx), KV segments, scoring, checkpoint I/O."""
import jax.numpy as jnp

from jaxprefix.models.attention import KVCache, KVSegment
from jaxprefix.models.config import ModelConfig, Rope
from jaxprefix.models.decoder import Decoder
from jaxprefix.models.scoring import token_logprobs
from jaxprefix.models.sharding import make_mesh, shard_model

# jaxprefix.checkpoints imports this package, so its loaders are resolved on first use.
_FROM_HF = ('from_pretrained', 'save_pretrained', 'load_hf_state')


def __getattr__(name):
    if name in _FROM_HF:
        from jaxprefix.checkpoints import hf
        return getattr(hf, name)
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


def from_gguf(path, dtype=jnp.float32, *, param_dtype=None):
    """A Decoder from a GGUF file (llama architecture); see jaxprefix.checkpoints.gguf."""
    from jaxprefix.checkpoints.gguf import from_gguf as load  # optional module: import lazily
    return load(path, dtype, param_dtype=param_dtype)


__all__ = ['Decoder', 'KVCache', 'KVSegment', 'ModelConfig', 'Rope', 'from_gguf',
           'from_pretrained', 'load_hf_state', 'make_mesh', 'save_pretrained', 'shard_model',
           'token_logprobs']
