"""What the method tests share: the demo task's problems and tokenizer, a tiny random decoder,
verifiers whose outcome is known in advance, and the methods built the way the rl job builds them."""
import dataclasses

import pytest
from flax import nnx

from jaxprefix import rewards
from jaxprefix.data.tasks import carry_multiplication as task
from jaxprefix.methods import pope, prefixrl
from jaxprefix.rl.compute_ledger import ComputeLedger
from jaxprefix.methods.probing import Prober
from jaxprefix.sampling import RolloutSpec
from jaxprefix.methods.prompting import TaskPrompts, oracle_prefix_text
from jaxprefix.methods.prefix_schedules import FixedPrefix
from jaxprefix.models.config import ModelConfig
from jaxprefix.models.decoder import Decoder
from jaxprefix.sampling import SharedContext

TOKENIZER = task.tokenizer()
PROMPTS = TaskPrompts(TOKENIZER)
PROBLEMS = task.generate(8, digits=(4, 6), seed=0)
EASY = task.generate(6, digits=(1, 2), seed=5)
MODEL = ModelConfig(model_type="llama", vocab_size=TOKENIZER.vocab_size, hidden_size=32,
                    intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=8, tie_word_embeddings=True)
STOP = (TOKENIZER.eos_id,)

# --- verifiers with outcomes known in advance ------------------------------------------------
SOLVED_IDS = {PROBLEMS[1].id, PROBLEMS[4].id, PROBLEMS[6].id}
STEPS_NEEDED: dict = {}  # problem id -> oracle steps a text must start with to count as solved


def solved_by_id(text, problem):
    return float(problem.id in SOLVED_IDS)


def starts_with_enough_steps(text, problem):
    return float(text.startswith(oracle_prefix_text(problem, STEPS_NEEDED[problem.id])))


rewards.register("test_methods_solved_by_id", solved_by_id, in_process=True)
rewards.register("test_methods_enough_steps", starts_with_enough_steps, in_process=True)


@pytest.fixture(scope="module")
def model():
    return Decoder(MODEL, rngs=nnx.Rngs(0))


def prober(model, verifier, rows_per_call=8, max_new_tokens=6):
    spec = RolloutSpec(max_new_tokens=max_new_tokens)
    return Prober(model, TOKENIZER, spec, stop_ids=STOP, verifier=verifier,
                  ledger=ComputeLedger(MODEL.num_params()), rows_per_call=rows_per_call,
                  progress=False)


SETTINGS = {f.name for f in dataclasses.fields(pope.PopeSettings)}


def pope_settings(**kwargs) -> pope.PopeSettings:
    return pope.PopeSettings(**{"guidance": "solution_prefix", **kwargs})


def pope_method(hard=PROBLEMS[:4], units=2, schedule=None, **kwargs):
    """A PopeMethod; keywords that are PopeSettings fields go to its settings."""
    settings = pope_settings(**{k: v for k, v in kwargs.items() if k in SETTINGS})
    rest = dict(problems_per_step=len(hard), n=2, seed=0) | {
        k: v for k, v in kwargs.items() if k not in SETTINGS}
    return pope.PopeMethod(PROMPTS, hard, {p.id: units for p in hard}, settings=settings,
                           schedule=schedule or FixedPrefix(), **rest)


def prefixrl_method(problems=PROBLEMS[:4], schedule=None, **kwargs):
    settings = dict(problems_per_step=len(problems), n=2, seed=0, prefixes_per_problem=3,
                    unprefixed_copies=1)
    return prefixrl.PrefixRLMethod(PROMPTS, problems, prefixrl.oracle_trace_pool(PROMPTS, problems),
                                   schedule=schedule or FixedPrefix(), **(settings | kwargs))


def context_ids(context) -> list:
    if isinstance(context, SharedContext):
        return list(context.prompt) + list(context.suffix)
    return list(context)

