"""A tiny policy that calls the calculator: a Decoder trained (a few hundred Adam steps on three
conversations) to call the calculator on arithmetic questions, read the observation and answer,
and to answer small talk directly. Its greedy rollouts really parse calls, run the calculator
and append its turn (tests/test_tool_episodes.py, test_tool_mining.py, test_episode_replay.py)."""
import string

import numpy as np
import optax
from flax import nnx

from jaxprefix.models import Decoder, ModelConfig, token_logprobs
from jaxprefix.tokenizers import CharTokenizer

# A character-level chat template: "<role initial>:<content><eos>" per message.
TEMPLATE = ("{% for m in messages %}{{ m.role[0] }}:{{ m.content }}<eos>{% endfor %}"
            "{% if add_generation_prompt %}a:{% endif %}")
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'
# (question, expression or None, the calculator's answer, final answer)
CONVERSATIONS = [("2+3?", "2+3", "5", "=5"), ("4*6?", "4*6", "24", "=24"),
                 ("hi?", None, None, "hello")]
MAX_NEW = 96  # one call is 79 characters


def conversation_text(question, expression, observation, answer):
    call = f"{CALL % expression}<eos>t:{observation}<eos>a:" if expression else ""
    return f"u:{question}<eos>a:{call}{answer}<eos>"


def train_calculator_policy():
    """(model, tokenizer, the conversations' prompts as token ids)."""
    texts = [conversation_text(*c) for c in CONVERSATIONS]
    # printable ASCII: the calculator's and the registry's error lines must be encodable
    tokenizer = CharTokenizer(sorted(set(string.printable) - set(string.whitespace) | {" "}))
    tokenizer.chat_template = TEMPLATE
    ids = [tokenizer.encode(t) for t in texts]
    tokens = np.zeros((len(ids), max(map(len, ids))), np.int32)
    mask = np.zeros_like(tokens)
    for row, x in enumerate(ids):
        tokens[row, :len(x)], mask[row, :len(x)] = x, 1
    config = ModelConfig(model_type="llama", vocab_size=tokenizer.vocab_size, hidden_size=64,
                         intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=16, tie_word_embeddings=True)
    model = Decoder(config, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer):
        def loss(m):
            return -token_logprobs(m, tokens, mask)[0].sum() / mask.sum()
        value, grads = nnx.value_and_grad(loss)(model)
        optimizer.update(model, grads)
        return value
    for _ in range(250):
        step(model, optimizer)
    contexts = [tokenizer.encode(f"u:{q}<eos>a:") for q, *_ in CONVERSATIONS]
    return model, tokenizer, contexts
