"""Jinja chat templates rendered the way transformers renders them.

A model's chat template (tokenizer_config.json `chat_template`, a chat_template.jinja file, or GGUF
`tokenizer.chat_template`) is a Jinja program over `messages`, `add_generation_prompt` and the
special-token strings. Matching transformers byte for byte needs its environment: sandboxed,
`trim_blocks` and `lstrip_blocks`, loop controls, `raise_exception`, `strftime_now`, a `tojson`
that does not HTML-escape, and a no-op `{% generation %}` block.

`continue_final_message` renders an unfinished final assistant turn, so that a model continues it
(PrefixRL's prefixes): the final content gets a sentinel appended, the conversation is rendered
whole, and everything from the sentinel on (the end-of-turn markup) is cut off.
"""
from __future__ import annotations

import datetime
import functools
import json

import jinja2
import jinja2.ext
import jinja2.sandbox

# The sentinel transformers uses; its trailing space tells whether the template kept the spacing.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text (for masks): rendered as is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def compile_template(template: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def _check_messages(messages) -> list[dict]:
    if not isinstance(messages, (list, tuple)):
        raise TypeError(f"messages must be a list of dicts, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {m!r}")
    # Like transformers: keys set to None are absent for the template.
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


def render(template: str, messages, *, add_generation_prompt: bool = False,
           continue_final_message: bool = False, tools: list[dict] | None = None,
           **variables) -> str:
    """The template's text for `messages`; `variables` are the special tokens (bos_token, ...).
    `tools`: function schemas ({"type": "function", "function": {...}}) for templates that list
    the tools a model may call (Qwen3, Llama 3.1); None, as transformers, when there are none.

    With `continue_final_message` the text ends right after the final message's content, without
    its end-of-turn markup (and `add_generation_prompt` is ignored).
    """
    messages = _check_messages(messages)
    if continue_final_message:
        if not messages:
            raise ValueError("continue_final_message needs a final message to continue, got none")
        final = messages[-1]["content"]
        if not isinstance(final, str):
            raise ValueError("continue_final_message: the final message's content must be a "
                             f"string, got {type(final).__name__}")
        messages[-1] = {**messages[-1], "content": final + _CONTINUE_TAG}
        add_generation_prompt = False
    text = compile_template(template).render(
        messages=messages, add_generation_prompt=add_generation_prompt, tools=tools or None,
        documents=None, **variables)
    if not continue_final_message:
        return text
    tag = _CONTINUE_TAG.strip()
    if tag not in text or final.strip() not in text:
        raise ValueError("continue_final_message: the chat template dropped (part of) the final "
                         f"message, so it cannot be continued. Rendered:\n{text}")
    cut = text.rindex(tag)
    if text[cut:cut + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:cut]
    return text[:cut].rstrip()  # the template stripped trailing spaces: strip them here too
