"""Contexts from problems: the token ids a policy continues, unguided or with a response prefix.

Two kinds of policy read problems differently:
- `ChatPrompts`: an instruction-tuned LLM. The question is a user turn rendered by the model's own
  chat template; guidance can be an instruction in the user turn (POPE) or the start of the
  assistant's answer, left unfinished for the policy to continue (PrefixRL).
- `TaskPrompts`: a tiny policy trained on a built-in task's raw text. It reads no English: guidance
  in its prompt is the task's own hint layout (the demo task's hint slots), or the start of its
  solution.

Both give `question(problem)` (the unguided context) and `response(text)` (tokens that continue
the assistant turn). A context with a response prefix is `SharedContext(question, prefix)`: the
sampler prefills the question once however many prefixes of one problem a batch holds.
"""
from __future__ import annotations

from collections.abc import Sequence

from jaxprefix.data import tasks
from jaxprefix.data.problem import Problem
from jaxprefix.sampling import SharedContext


class ChatPrompts:
    """Renders problems through the tokenizer's chat template (system prompt optional); the user
    turn is `user_template` with the problem's question in its {question}. `tools`: function
    schemas the template lists in its own tool section (a template without one ignores them)."""

    def __init__(self, tokenizer, system_prompt: str | None = None,
                 user_template: str = "{question}", tools: Sequence[dict] = ()):
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.user_template = user_template
        self.tools = list(tools) or None

    def _asked(self, problem: Problem) -> str:
        return self.user_template.format(question=problem.question)

    def _messages(self, user_text: str) -> list[dict]:
        messages = [{"role": "user", "content": user_text}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def user_turn(self, text: str) -> list[int]:
        """A conversation of one user turn, ending where the assistant starts to answer."""
        rendered = self.tokenizer.apply_chat_template(self._messages(text),
                                                      add_generation_prompt=True, tools=self.tools)
        return self.tokenizer.encode(rendered, add_special_tokens=False)

    def question(self, problem: Problem) -> list[int]:
        return self.user_turn(self._asked(problem))

    def hinted_question(self, problem: Problem, units: int, template: str) -> list[int]:
        """The question with its first `units` oracle steps in the user turn (POPE's guidance):
        `template` has {question} and {partial_response}."""
        partial = oracle_prefix_text(problem, units)
        return self.user_turn(template.format(question=self._asked(problem),
                                              partial_response=partial))

    def response(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def restating_prefix(self, problem: Problem) -> str:
        """'': a chat model restates the guidance in its own answer, as its template allows."""
        return ""

    def render_unfinished(self, problem: Problem, response_text: str) -> str:
        """The text of an unfinished assistant turn, as the chat template itself renders it."""
        messages = self._messages(self._asked(problem)) + [{"role": "assistant",
                                                           "content": response_text}]
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=False, continue_final_message=True, tools=self.tools)


class TaskPrompts:
    """A built-in task's raw text: the question, then the solution the policy writes."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def question(self, problem: Problem) -> list[int]:
        return self.tokenizer.encode(problem.question)

    def hinted_question(self, problem: Problem, units: int, template: str = "") -> list[int]:
        """The question with its first `units` oracle steps in the task's hint layout (the
        template is English for chat models: unused here)."""
        check_hint_layouts(self, [problem])
        return self.tokenizer.encode(tasks.HINTS[problem.source](problem, units).question)

    def restating_prefix(self, problem: Problem) -> str:
        """The task's restating hint for `problem`, forced as its answer's start: the oracle
        solution up to the name of the rule its key step reads by, so that the policy does the
        read itself ('' where the task or the problem's notation has none)."""
        hint = tasks.RESTATING.get(problem.source)
        return hint(problem) if hint else ""

    def response(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)


def check_hint_layouts(prompts, problems: Sequence[Problem]) -> None:
    """Fails when `prompts` cannot give one of `problems` guidance in its prompt: a task policy
    reads only its task's hint layout (a chat model reads an English instruction: any problem)."""
    if not isinstance(prompts, TaskPrompts):
        return
    missing = sorted({p.source for p in problems} - set(tasks.HINTS))
    if missing:
        raise ValueError(f"config.pope.guidance='instruction': problems from {missing} have no "
                         f"hint layout for a task policy's prompt (tasks with one: "
                         f"{sorted(tasks.HINTS)}); expected pope.guidance='solution_prefix' for them")


def with_response_prefix(prompts, problem: Problem, prefix: Sequence[int]) -> SharedContext:
    """The problem's question followed by `prefix` tokens of an unfinished answer."""
    return SharedContext(prompt=tuple(prompts.question(problem)), suffix=tuple(prefix))


def oracle_units(problem: Problem) -> int:
    """How many units an oracle prefix can take: solution steps where known, else lines."""
    return len(problem.oracle_steps)


def oracle_prefix_text(problem: Problem, units: int) -> str:
    """The first `units` steps of the oracle solution, as the solution writes them."""
    steps = problem.oracle_steps
    if not 0 <= units <= len(steps):
        raise ValueError(f"problem {problem.id}: an oracle prefix of {units} steps is out of "
                         f"range 0..{len(steps)}")
    if not problem.steps and problem.solution is not None:
        return _leading_lines(problem.solution, units)
    return _step_separator(problem).join(steps[:units])


def _leading_lines(text: str, count: int) -> str:
    """`text` up to the end of its `count`-th non-empty line (blank lines inside kept)."""
    if count == 0:
        return ""
    seen = 0
    lines = text.split("\n")
    for i, line in enumerate(lines):
        seen += bool(line.strip())
        if seen == count:
            return "\n".join(lines[:i + 1])
    return text


def _step_separator(problem: Problem) -> str:
    # Join steps the way the solution text joins them (built-in tasks write them back to back).
    for separator in ("", "\n", " "):
        if separator.join(problem.oracle_steps) == problem.solution:
            return separator
    return "\n"
