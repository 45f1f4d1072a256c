"""Contexts from problems (methods/prompting.py) with the real SmolLM2 tokenizer and chat template.

References: transformers' own tokenizer and chat template read from the same GGUF file, and
strings written out by hand. A guided context must be token for token what the model would see
if the chat template rendered the unfinished assistant turn itself.
"""
import dataclasses
import os

import pytest

from jaxprefix import tokenizers
from jaxprefix.checkpoints.gguf import bundled_smollm2_path
from jaxprefix.data.problem import Problem
from jaxprefix.data.tasks import carry_multiplication as task
from jaxprefix.methods.prompting import (ChatPrompts, TaskPrompts, oracle_prefix_text,
                                         oracle_units, with_response_prefix)
from jaxprefix.sampling import SharedContext

SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
PROBLEM = Problem(id="p1", question="What is 12 * 7?", answer="84",
                  solution="12 * 7 = 12 * 5 + 12 * 2.\n12 * 5 = 60 and 12 * 2 = 24.\nSo 84.")
# Boundaries where a tokenizer could merge the end of the prompt with the start of the prefix.
RESPONSE_TEXTS = ["First, 12*7", "Step 1: 12 * 5 = 60\nStep 2:", " leading space",
                  "\nleading newline", "trailing space ", "trailing newline\n", "\\boxed{8",
                  "12 * 7 = 12 * 5 + 12 * 2.\n"]


@pytest.fixture(scope="module")
def smollm2():
    return tokenizers.load(bundled_smollm2_path())


@pytest.fixture(scope="module")
def reference():
    """transformers' tokenizer of the same GGUF file (its own chat template implementation)."""
    from transformers import AutoTokenizer

    path = bundled_smollm2_path()
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def test_question_is_the_template_rendering_with_generation_prompt(smollm2, reference):
    prompts = ChatPrompts(smollm2)
    expected_text = (f"<|im_start|>system\n{SMOLLM2_SYSTEM}<|im_end|>\n"
                     f"<|im_start|>user\nWhat is 12 * 7?<|im_end|>\n<|im_start|>assistant\n")
    ids = prompts.question(PROBLEM)
    assert smollm2.decode(ids) == expected_text
    assert ids == smollm2.encode(expected_text, add_special_tokens=False)
    messages = [{"role": "user", "content": PROBLEM.question}]
    assert ids == list(reference.apply_chat_template(messages, add_generation_prompt=True,
                                                     tokenize=True, return_dict=False))


def test_system_prompt_replaces_the_default(smollm2, reference):
    system = "Please reason step by step, and put your final answer within \\boxed{}."
    ids = ChatPrompts(smollm2, system).question(PROBLEM)
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": PROBLEM.question}]
    assert ids == list(reference.apply_chat_template(messages, add_generation_prompt=True,
                                                     tokenize=True, return_dict=False))
    assert smollm2.decode(ids).startswith(f"<|im_start|>system\n{system}<|im_end|>\n")
    assert SMOLLM2_SYSTEM not in smollm2.decode(ids)


def test_user_template_holds_the_question(smollm2, reference):
    template = "{question}\nPut the final answer in \\boxed{{}}, for example \\boxed{{7}}."
    ids = ChatPrompts(smollm2, None, template).question(PROBLEM)
    asked = "What is 12 * 7?\nPut the final answer in \\boxed{}, for example \\boxed{7}."
    messages = [{"role": "user", "content": asked}]
    assert ids == list(reference.apply_chat_template(messages, add_generation_prompt=True,
                                                     tokenize=True, return_dict=False))


@pytest.mark.parametrize("system", [None, "Reason step by step."])
@pytest.mark.parametrize("text", RESPONSE_TEXTS)
def test_unfinished_assistant_turn(smollm2, reference, system, text):
    prompts = ChatPrompts(smollm2, system)
    rendered = prompts.render_unfinished(PROBLEM, text)
    messages = prompts._messages(PROBLEM.question) + [{"role": "assistant", "content": text}]
    assert rendered == reference.apply_chat_template(messages, tokenize=False,
                                                     continue_final_message=True)
    assert rendered.endswith("<|im_start|>assistant\n" + text)

    context = with_response_prefix(prompts, PROBLEM, prompts.response(text))
    assert isinstance(context, SharedContext)
    assert list(context.prompt) == prompts.question(PROBLEM)  # shared with unguided copies
    ids = list(context.prompt) + list(context.suffix)
    assert smollm2.decode(ids) == rendered
    # Prompt and prefix tokenised apart must equal the whole turn tokenised at once.
    assert ids == smollm2.encode(rendered, add_special_tokens=False)


def test_oracle_prefix_text_on_task_steps():
    # Digits least significant first: 7*6 = 42, 4*6 + 4 = 28, 3*6 + 2 = 20.
    problem = task.make_problem(347, 6)
    assert problem.question == "7__4__3__" + "_" * 51 + "x6="
    assert oracle_units(problem) == 3
    expected = ["", "+24", "+24+82", "+24+82+02"]
    for units, text in enumerate(expected):
        assert oracle_prefix_text(problem, units) == text
    assert task.verify(oracle_prefix_text(problem, 3), problem) == 1.0
    for bad in (-1, 4):
        with pytest.raises(ValueError, match=rf"{problem.id}.*{bad}.*0\.\.3"):
            oracle_prefix_text(problem, bad)


def test_oracle_prefix_text_on_lines_of_a_text_solution():
    assert oracle_units(PROBLEM) == 3
    assert oracle_prefix_text(PROBLEM, 1) == "12 * 7 = 12 * 5 + 12 * 2."
    assert oracle_prefix_text(PROBLEM, 2) == ("12 * 7 = 12 * 5 + 12 * 2.\n"
                                              "12 * 5 = 60 and 12 * 2 = 24.")
    assert oracle_prefix_text(PROBLEM, 3) == PROBLEM.solution
    spaced = Problem(id="s", question="q", answer="3", solution="x = 1. y = 2. x + y = 3.",
                     steps=("x = 1.", "y = 2.", "x + y = 3."))
    assert oracle_prefix_text(spaced, 2) == "x = 1. y = 2."
    no_solution = Problem(id="n", question="q", answer="1")
    assert oracle_units(no_solution) == 0
    with pytest.raises(ValueError, match="n: an oracle prefix of 1 steps"):
        oracle_prefix_text(no_solution, 1)


def test_task_prompts_give_guidance_in_the_task_hint_layout():
    tokenizer = task.tokenizer()
    prompts = TaskPrompts(tokenizer)
    problem = task.make_problem(347, 6)
    # Guidance in the prompt is the task's hint slots (POPE's 'instruction' mode); no English.
    assert prompts.hinted_question(problem, 2) == tokenizer.encode(task.hinted(problem, 2).question)
    foreign = dataclasses.replace(problem, source="gsm8k")
    with pytest.raises(ValueError, match="solution_prefix"):
        prompts.hinted_question(foreign, 1)
    assert prompts.question(problem) == tokenizer.encode(problem.question)
    assert len(prompts.question(problem)) == task.QUESTION_LENGTH
    context = with_response_prefix(prompts, problem, prompts.response("+24+82"))
    # The raw-text policy sees the guided problem of the task itself.
    assert list(context.prompt) + list(context.suffix) == task.format_context(problem, 2, tokenizer)
