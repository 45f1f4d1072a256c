"""A tool's observation as the chat template's own tool turn, in token ids to append.

The sampled assistant turn is already in the episode's tokens; what comes next is the text the
template puts between the end of an assistant message's content and the next assistant turn's
first token, with the tool messages in between:

    ...</tool_call>|<|im_end|>⏎<|im_start|>tool⏎5<|im_end|>⏎<|im_start|>assistant⏎
                   ^ this "bridge" (SmolLM2's) is what observation_tokens() returns

It is found by rendering a probe conversation twice (ending in an open assistant message, then
with the tool messages and a generation prompt) and taking the difference, so every template
that renders a `tool` role (SmolLM2, Qwen, Llama 3.1's ipython header) gets its own markup.
A template that refuses a tool role or drops it (some alternate user/assistant strictly) gets
the observations as one user message of <tool_response> blocks, as Hermes/Qwen render them.

Token-in/token-out: these ids are appended to the ids sampled so far, never re-tokenized
with them; a stop token the policy sampled that the bridge also starts with (its end of turn)
is not appended twice.
"""
from __future__ import annotations

from typing import Sequence

import jinja2

from jaxprefix.tokenizers import chat_template

_PROBE = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]


def _user_fallback(observations: Sequence[str]) -> list[dict]:
    body = "\n".join(f"<tool_response>\n{o}\n</tool_response>" for o in observations)
    return [{"role": "user", "content": body}]


def observation_text(template: str, observations: Sequence[str], **special_tokens) -> str:
    """The template's text from the end of an assistant message's content through the next
    assistant turn's header, with `observations` as tool messages (or a user message)."""
    if not observations:
        raise ValueError("observation_text: expected at least one observation")
    head = chat_template.render(template, _PROBE, continue_final_message=True, **special_tokens)
    for messages in ([{"role": "tool", "content": o} for o in observations],
                     _user_fallback(observations)):
        try:
            full = chat_template.render(template, _PROBE + messages, add_generation_prompt=True,
                                        **special_tokens)
        except jinja2.TemplateError:
            continue  # e.g. raise_exception('roles must alternate'): try the user turn
        tail = full[len(head):]
        if full.startswith(head) and all(o in tail for o in observations):
            return tail
    raise ValueError("observation_text: the chat template renders neither a tool message nor "
                     "a user message after an assistant message, so observations cannot be "
                     "appended (expected a template that continues a conversation)")


def observation_tokens(tokenizer, observations: Sequence[str],
                       sampled_stop: int | None = None) -> list[int]:
    """Token ids appended after a sampled turn that called tools: the end of that turn, the
    tool turn(s) with `observations`, the next assistant header. `sampled_stop`: the stop
    token the turn ended on (None: it was truncated), left out when the bridge starts with it."""
    if tokenizer.chat_template is None:
        raise ValueError(f"{tokenizer.source}: no chat template, so a tool turn cannot be "
                         "rendered (expected a tokenizer with a chat template)")
    text = observation_text(tokenizer.chat_template, observations, **tokenizer.special_tokens)
    ids = tokenizer.encode(text)
    if sampled_stop is not None and ids[:1] == [sampled_stop]:
        ids = ids[1:]
    return ids
