"""A verifiers v1 environment (PyPI `verifiers`, `verifiers.v1`) as an external environment
(external.py). Why this works: a v1 harness calls the model through verifiers' interception
server, whose training client (verifiers/v1/clients/train.py) renders prompts with a `renderers`
tokenizer and samples /inference/v1/generate, which the live server serves; the trace's message
graph (verifiers/v1/graph.py) keeps each turn's token ids, sampled mask and log-probs: its turns
become external.Turns, its reward (the task's @vf.reward) the episode's.

`VerifiersEnvironment(vf_env, task_of, tokenizer)`: a verifiers.v1.Env, its Task for a run's
Problem, the policy's tokenizer (saved as an HF directory: the renderer loads it by name). The
env's default harness and runtime (`bash`, a prime sandbox) leave this machine: `chat_harness()`
is a chat loop in this process (runtime subprocess). verifiers imports a taskset or harness as
the top-level module its id names (verifiers/v1/utils/loaders.py): `plugin(name, cls)` registers
one. `TemplateBridge` (the default renderer) keeps a later turn's earlier ids, which renderers'
fallback re-renders from text. `pip install 'jaxprefix[verifiers]'` installs verifiers (it
pins openai<3, which the server takes too).
"""
from __future__ import annotations

import asyncio
import atexit
import os
import shutil
import sys
import tempfile
import types

from jaxprefix.serving.external import EpisodeResult, Turn

CHAT_HARNESS, BRIDGE = "jaxprefix_chat", f"{__name__}.TemplateBridge"


def _vf():
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise ImportError(f"a verifiers environment needs verifiers ({e}): pip install "
                          "'jaxprefix[verifiers]'") from None
    return vf


def plugin(name: str, *classes) -> str:
    """Registers `classes` (Taskset, Harness, Env) as the top-level module `name`, their id."""
    module = sys.modules.setdefault(name, types.ModuleType(name))
    for cls in classes:
        setattr(module, cls.__name__, cls)
    module.__all__ = sorted({*getattr(module, "__all__", ()), *(c.__name__ for c in classes)})
    return name


def chat_harness() -> str:
    """A harness in this process (its id): the prompt, then each `follow_ups` after a reply."""
    if CHAT_HARNESS in sys.modules:
        return CHAT_HARNESS
    vf = _vf()

    class ChatHarnessConfig(vf.HarnessConfig):
        follow_ups: list[str] = []

    class ChatHarness(vf.Harness[ChatHarnessConfig]):
        APPENDS_SYSTEM_PROMPT, EXECUTES_CODE, NEEDS_CONTAINER = True, False, False

        async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_):
            import openai
            from verifiers.v1.dialects.chat import message_to_wire

            system, prompt = self.resolve_prompt(data)
            messages = [{"role": "system", "content": system}] if system else []
            messages += ([{"role": "user", "content": prompt}] if isinstance(prompt, str)
                         else [message_to_wire(m) for m in prompt or ()])
            async with openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as c:
                reply = await c.chat.completions.create(model=ctx.model, messages=messages)
                for follow_up in self.config.follow_ups:
                    messages += [{"role": "assistant", "content": reply.choices[0].message.content
                                  or ""}, {"role": "user", "content": follow_up}]
                    reply = await c.chat.completions.create(model=ctx.model, messages=messages)
            return vf.ProgramResult(exit_code=0, stdout="", stderr="")

    return plugin(CHAT_HARNESS, ChatHarnessConfig, ChatHarness)


def __getattr__(name):  # TemplateBridge, built when renderers imports BRIDGE
    if name != "TemplateBridge":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from renderers import RenderedTokens
    from renderers.base import reject_assistant_in_extension, trim_to_turn_close
    from renderers.configs import DefaultRendererConfig
    from renderers.default import DefaultRenderer

    class TemplateBridge(DefaultRenderer):
        # a later turn: the earlier ids (closed where cut short), then the template's tokens
        config_class = DefaultRendererConfig

        def bridge_to_next_turn(self, prompt_ids, completion_ids, new, *, tools=None, **_):
            probe = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "."}]
            rendered, stops = self._apply(probe, tools=tools), set(self.get_stop_token_ids())
            closes = [k for k, t in enumerate(rendered) if t in stops]
            if not closes or not new or reject_assistant_in_extension(new):
                return None
            ids = trim_to_turn_close(prompt_ids, completion_ids, stops,
                                     synthesize_close=rendered[closes[-1]])
            indices, done = [-1] * len(ids), closes[-1] + 1
            for i in range(len(new) + 1):
                now = self._apply(probe + list(new[:i + 1]), tools=tools,
                                  add_generation_prompt=i == len(new))
                if now[:done] != rendered[:done]:
                    return None  # the template rewrites what came before: re-render
                ids += now[done:]
                indices += [-1 if i == len(new) else i] * (len(now) - done)
                rendered, done = now, len(now)
            return RenderedTokens(token_ids=ids, message_indices=indices,
                                  sampled_mask=[False] * len(ids),
                                  message_roles=[m.get("role") or "" for m in new])

    globals()["TemplateBridge"] = TemplateBridge
    return TemplateBridge


def turns_of(trace) -> list[Turn]:
    """A v1 trace's policy turns, in the order sampled (prompt: its path in the graph)."""
    turns = []
    for call in trace.calls:
        path, node = [], call.node
        while node is not None:
            path, node = [trace.nodes[node], *path], trace.nodes[node].parent
        if not path or True not in path[-1].mask:
            continue  # a failed call, or one without tokens
        last, start = path[-1], path[-1].mask.index(True)
        if not all(last.mask[start:]) or len(last.logprobs) != len(last.mask) - start:
            raise ValueError(f"verifiers trace {trace.id}: a turn's sampled tokens are not one "
                             "span with a log-prob each; expected the training client's")
        prompt = [t for n in path[:-1] for t in n.token_ids] + last.token_ids[:start]
        turns.append(Turn(tuple(prompt), tuple(last.token_ids[start:]),
                          tuple(map(float, last.logprobs)), call.finish_reason or "length"))
    return turns


class VerifiersEnvironment:
    """`env` (a verifiers.v1.Env) as an external environment (module docstring): `task_of(problem)`
    its Task for a run's Problem; `tokenizer` the policy's (the one `NAME(tokenizer)` is given,
    saved to a temporary directory for the renderer) or an HF tokenizer directory; `renderer` a
    renderers.RendererConfig (None: TemplateBridge over the model's chat template)."""

    def __init__(self, env, task_of, tokenizer, renderer=None):
        _vf()
        if not isinstance(tokenizer, (str, os.PathLike)):
            directory = tempfile.mkdtemp(prefix="jaxprefix_tokenizer_")
            atexit.register(shutil.rmtree, directory, ignore_errors=True)
            tokenizer.save(directory)
            tokenizer = directory
        self.env, self.task_of, self.tokenizer_dir = env, task_of, str(tokenizer)
        self.renderer, self._loop = renderer or {"name": "custom", "import_path": BRIDGE}, None

    async def run_episode(self, client, model: str, problem, sampling_args: dict):
        vf = _vf()
        if asyncio.get_running_loop() is not self._loop:  # each round is an asyncio.run
            import renderers.client  # its process-wide lock binds to the first loop it waits in
            renderers.client._max_prompt_len_lock = asyncio.Lock()
            self._loop = asyncio.get_running_loop()
        # The run's sampling is every turn's; the training client asks for log-probs itself.
        sampling = {k: v for k, v in {**sampling_args, **sampling_args.get("extra_body", {})}
                    .items() if k not in ("extra_body", "logprobs", "return_token_ids")}
        ctx = vf.ModelContext(model=model, sampling=vf.SamplingConfig(**sampling),
                              client=vf.TrainClientConfig(
                                  base_url=str(client.base_url), api_key_var="JAXPREFIX_API_KEY",
                                  renderer_model_name=self.tokenizer_dir, renderer=self.renderer))
        episode = await self.env.run_episode(self.task_of(problem), ctx)
        errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
        trained = [t for t in episode.traces if t.agent is None or t.agent.trainable]
        if errors or not episode.ok or len(trained) != 1:
            raise RuntimeError(f"verifiers episode of problem {problem.id!r}: " + (
                f"{errors[-1].type}: {errors[-1].message}" if errors else "not ok" if not
                episode.ok else f"{len(trained)} trainable traces, expected one (one row)"))
        return EpisodeResult(turns_of(trained[0]), float(trained[0].reward))

