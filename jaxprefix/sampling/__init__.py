"""The sampler: n continuations of each context, prefilled once and decoded in-graph."""
from jaxprefix.sampling.decode_mesh import decode_layout
from jaxprefix.sampling.layout import SharedContext, token_ids
from jaxprefix.sampling.rollout_spec import RolloutSpec
from jaxprefix.sampling.rollouts import Rollouts
from jaxprefix.sampling.sampler import KV_DTYPES, generate
from jaxprefix.sampling.token_choice import SamplingSettings
from jaxprefix.sampling.turns import LiveWeights, TurnEnd, TurnRollouts, sample_live, sample_turns

__all__ = ['KV_DTYPES', 'LiveWeights', 'RolloutSpec', 'Rollouts', 'SamplingSettings',
           'SharedContext', 'TurnEnd', 'TurnRollouts', 'decode_layout', 'generate',
           'sample_live', 'sample_turns', 'token_ids']
