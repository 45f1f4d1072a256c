"""POPE as a batch builder (methods/pope.py): guided contexts, its mix of guided and unguided
copies, its settings, and the prefix's tokens carrying no loss. See test_methods.py for PrefixRL,
mining and schedules."""

import numpy as np
import pytest
from flax import nnx

from jaxprefix import sampling, tokenizers
from jaxprefix.checkpoints.gguf import bundled_smollm2_path
from jaxprefix.data.problem import Problem
from jaxprefix.data.tasks import carry_multiplication as task
from jaxprefix.methods import pope
from jaxprefix.methods.prompting import ChatPrompts, TaskPrompts, oracle_prefix_text
from jaxprefix.methods.prefix_schedules import FixedPrefix
from jaxprefix.models.decoder import Decoder
from jaxprefix.rl import dynamic_sampling, objectives
from jaxprefix.sampling import SharedContext
from tests.method_helpers import EASY, MODEL, PROBLEMS, PROMPTS, TOKENIZER, pope_method, pope_settings


# --- POPE guided contexts --------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2():
    return tokenizers.load(bundled_smollm2_path())


@pytest.mark.parametrize("template_name", ["default", "no_restate"])
def test_pope_instruction_prompt_by_hand(smollm2, template_name):
    problem = Problem(id="h", question="What is 12 * 7?", answer="84",
                      solution="12 * 7 = 60 + 24.\nSo the answer is 84.")
    prompts = ChatPrompts(smollm2)
    context, response_prefix = pope.guided_context(prompts, problem, 1, guidance="instruction",
                                                   template=pope.TEMPLATES[template_name])
    user = ("You are given a problem and a partial solution. Study the partial response carefully, "
            "then complete the solution from where it left off. Put your final answer within "
            "\\boxed{}.\n\nProblem: What is 12 * 7?\n\nPartial Response: 12 * 7 = 60 + 24.\n\n"
            "Continue solving the problem, starting from where the partial response ends.")
    if template_name == "no_restate":
        user += " Do not restate, repeat or summarise any part of the partial response."
    expected = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
                f"Face<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")
    assert smollm2.decode(context) == expected
    assert context == smollm2.encode(expected)
    assert response_prefix == ""  # guidance lives in the prompt; the answer starts fresh


def test_pope_solution_prefix_is_question_then_oracle_steps():
    problem = task.make_problem(347, 6)  # steps +24 +82 +02
    for k, steps in ((1, "+24"), (2, "+24+82")):
        context, response_prefix = pope.guided_context(PROMPTS, problem, k,
                                                       guidance="solution_prefix")
        assert isinstance(context, SharedContext)
        assert list(context.prompt) == TOKENIZER.encode(problem.question)
        assert list(context.suffix) == TOKENIZER.encode(steps)
        assert response_prefix == steps
    with pytest.raises(ValueError, match="pope.guidance.*'hint'"):
        pope.guided_context(PROMPTS, problem, 1, guidance="hint")


def test_pope_instruction_on_the_demo_task_puts_steps_in_the_hint_slots():
    problem = task.make_problem(347, 6)  # steps +24 +82 +02
    for k, slots in ((1, "724" "4__" "3__"), (2, "724" "482" "3__")):
        context, response_prefix = pope.guided_context(PROMPTS, problem, k, guidance="instruction")
        assert context == TOKENIZER.encode(slots + "_" * 51 + "x6=")
        assert response_prefix == ""  # the policy writes the whole answer itself


def test_pope_restating_hint_on_the_keyed_task_is_the_oracle_prefix_up_to_the_rule_name():
    from jaxprefix.data.tasks import keyed_multiplication as keyed

    prompts = TaskPrompts(keyed.tokenizer())
    named = keyed.make_problem(47, 6, 3, ">", (2, 8), names_rule=True)  # oracle >63+54+82
    plain = keyed.make_problem(47, 6, 3, ">", (2, 8))                   # oracle *63+54+82
    for units in (1, 2):  # the default template allows restating: the name, whatever units
        context, prefix = pope.guided_context(prompts, named, units, guidance="instruction")
        assert prefix == ">" and named.solution.startswith(prefix)
        assert isinstance(context, SharedContext)
        assert list(context.prompt) + list(context.suffix) == prompts.tokenizer.encode(
            named.question + ">")
        assert keyed.verify(prefix + "63+54+82", named) == 1.0  # read by '>': right
        assert keyed.verify(prefix + "28+22+01", named) == 0.0  # read by '<': wrong
    # no_restate: the value hint (d, c in the prompt's key hints), the policy writes it all
    context, prefix = pope.guided_context(prompts, named, 1, guidance="instruction",
                                          template=pope.NO_RESTATE_TEMPLATE)
    assert prefix == "" and context == prompts.hinted_question(named, 1)
    assert prompts.tokenizer.decode(context)[:3] == ">63"
    # the notation off: the value hint under either template, exactly as before
    for template in pope.TEMPLATES.values():
        context, prefix = pope.guided_context(prompts, plain, 1, guidance="instruction",
                                              template=template)
        assert prefix == "" and context == prompts.tokenizer.encode(keyed.hinted(plain, 1).question)
    assert ChatPrompts(None).restating_prefix(named) == ""


def test_pope_restating_groups_sample_the_rule_read_themselves():
    from jaxprefix.data.tasks import keyed_multiplication as keyed

    prompts = TaskPrompts(keyed.tokenizer())
    hard = keyed.hard_set(4, seed=3, names_rule=True)
    method = pope.PopeMethod(prompts, hard, {p.id: 1 for p in hard}, schedule=FixedPrefix(),
                             settings=pope_settings(guidance="instruction"),
                             problems_per_step=4, n=2, seed=0)
    request = method.next_request(0)
    for context, problem, guided, prefix in zip(request.contexts, request.problems,
                                                request.tags["guided"],
                                                request.response_prefixes):
        if guided:  # the name is forced; the digits d, c are the policy's own tokens
            assert prefix == ">" and list(context.suffix) == prompts.response(">")
            assert keyed.verify(prefix + problem.solution[1:], problem) == 1.0
        else:
            assert prefix == "" and context == prompts.question(problem)
    assert sum(request.tags["guided"]) == 4


# --- mix ratios ------------------------------------------------------------------------------

@pytest.mark.parametrize("guided_copies,unguided_copies", [(1, 1), (2, 1), (0, 3)])
def test_pope_mix(guided_copies, unguided_copies):
    method = pope_method(guided_copies=guided_copies, unguided_copies=unguided_copies)
    request = method.next_request(0)
    per_problem = guided_copies + unguided_copies
    assert len(request.contexts) == 4 * per_problem and request.n == 2
    guided = request.tags["guided"]
    assert guided.dtype == bool and guided.sum() == 4 * guided_copies
    assert sorted(p.id for p in request.problems) == sorted(
        p.id for p in PROBLEMS[:4] for _ in range(per_problem))
    for i, (context, problem) in enumerate(zip(request.contexts, request.problems)):
        question = PROMPTS.question(problem)
        if guided[i]:
            assert context.prompt == tuple(question)  # shares the problem's prompt prefill
            assert list(context.suffix) == TOKENIZER.encode(oracle_prefix_text(problem, 2))
            assert request.response_prefixes[i] == oracle_prefix_text(problem, 2)
        else:
            assert list(context) == question
            assert request.response_prefixes[i] == ""


def test_pope_easy_problems_are_added_unguided():
    method = pope_method(easy=EASY, easy_per_step=3)
    request = method.next_request(0)
    assert len(request.contexts) == 4 * 2 + 3
    easy = request.problems[8:]
    assert {p.id for p in easy} <= {p.id for p in EASY} and len({p.id for p in easy}) == 3
    assert not request.tags["guided"][8:].any() and request.tags["guided"][:8].sum() == 4
    assert [list(c) for c in request.contexts[8:]] == [PROMPTS.question(p) for p in easy]


def test_pope_settings_reject_no_copies_and_unknown_guidance_naming_the_field():
    with pytest.raises(ValueError, match=r"^config.pope.guided_copies/unguided_copies=\(0, 0\): "
                                         r"expected >= 0 each, not both 0$"):
        pope.PopeSettings(guided_copies=0, unguided_copies=0)
    with pytest.raises(ValueError, match=r"^config.pope.guidance='hint': expected one of"):
        pope.PopeSettings(guidance="hint")
    with pytest.raises(ValueError, match=r"^config.pope.template='terse': expected one of"):
        pope.PopeSettings(template="terse")


def test_prefix_limit_caps_by_units_fraction_and_never_the_whole_solution():
    twenty = task.hard_set(1)[0]
    assert pope.prefix_limit(twenty, max_units=19) == 19
    assert pope.prefix_limit(twenty, max_units=19, max_fraction=0.25) == 5
    assert pope.prefix_limit(twenty, max_units=19, max_fraction=0.5) == 10
    assert pope.prefix_limit(twenty, max_units=30) == 19  # 20 would hand over the answer
    assert pope.prefix_limit(twenty, max_units=4, max_fraction=0.5) == 4
    assert pope.prefix_limit(task.make_problem(7, 3), max_units=19) == 0  # one step: nothing


def test_pope_drops_problems_without_a_solvable_prefix_and_counts_them():
    hard = PROBLEMS[:3]  # 4..6 steps each
    found = {hard[0].id: 1, hard[1].id: None, hard[2].id: 2}
    method = pope.PopeMethod(PROMPTS, hard, found, schedule=FixedPrefix(),
                             settings=pope_settings(), problems_per_step=2, n=2, seed=0)
    assert method.prefix_units == {hard[0].id: 1, hard[2].id: 2}
    assert method.dropped == [hard[1].id]
    request = method.next_request(0)
    assert hard[1].id not in {p.id for p in request.problems}
    with pytest.raises(ValueError, match="none of the 1 hard problems has a solvable prefix"):
        pope.PopeMethod(PROMPTS, hard[1:2], found, schedule=FixedPrefix(),
                        settings=pope_settings(max_units=4), problems_per_step=1, n=2, seed=0)


def test_pope_with_nothing_to_train_is_one_line_naming_the_fields_that_change_it():
    from jaxprefix import errors

    hard = PROBLEMS[:3]
    none_found = {p.id: None for p in hard}
    with pytest.raises(errors.NothingToTrain) as e:
        pope.PopeMethod(PROMPTS, hard, none_found, schedule=FixedPrefix(),
                        settings=pope_settings(max_units=4, max_fraction=0.25),
                        problems_per_step=1, n=2, seed=0)
    line = errors.one_line(e.value)
    assert line.startswith("error: pope: none of the 3 hard problems has a solvable prefix "
                           "within the cap (0.25 of the solution, 4 steps)")
    for field in ("pope.max_prefix_fraction", "mining.max_prefix_units", "mining.prefix_samples",
                  "pope.unsolved=unguided"):
        assert field in line and "\n" not in line
    # one-line solutions: a prefix must be shorter than the solution, so none fits any cap
    short = [Problem(id=f"s{i}", question="2+2?", answer="4", solution="2 + 2 = 4.")
             for i in range(2)]
    with pytest.raises(errors.NothingToTrain) as e:
        pope.PopeMethod(PROMPTS, short, {}, schedule=FixedPrefix(),
                        settings=pope_settings(max_units=4, max_fraction=0.25),
                        problems_per_step=1, n=2, seed=0)
    assert errors.one_line(e.value) == (
        "error: pope: no prefix of the 2 hard problems' solutions fits the cap: they have at "
        "most 1 step(s) (lines), and a prefix is at most mining.max_prefix_units=4 steps and "
        "pope.max_prefix_fraction=0.25 of them, never all; expected solutions of several lines "
        "(one step a line), a larger cap, or pope.unsolved=unguided to train them unguided")
    with pytest.raises(errors.NothingToTrain, match="no hard problem to train on.*mining.k"):
        pope.PopeMethod(PROMPTS, [], {}, schedule=FixedPrefix(), settings=pope_settings(),
                        problems_per_step=1, n=2, seed=0)
    # pope.unsolved=unguided trains what it can: every hard problem, unguided
    method = pope.PopeMethod(PROMPTS, hard, none_found, schedule=FixedPrefix(),
                             settings=pope_settings(unsolved="unguided"),
                             problems_per_step=1, n=2, seed=0)
    assert method.dropped == [] and method.prefix_units == {}


def test_pope_longest_fallback_never_guides_with_the_whole_solution():
    hard = PROBLEMS[:3]
    method = pope.PopeMethod(PROMPTS, hard, {p.id: None for p in hard}, schedule=FixedPrefix(),
                             settings=pope_settings(unsolved="longest", max_units=19,
                                                    max_fraction=0.5),
                             problems_per_step=3, n=2, seed=0)
    for problem in hard:  # the longest prefix the search tried: half the steps, rounded down
        assert method.prefix_units[problem.id] == len(problem.steps) // 2 < len(problem.steps)
    uncapped = pope.PopeMethod(PROMPTS, hard, {p.id: None for p in hard}, schedule=FixedPrefix(),
                               settings=pope_settings(unsolved="longest", max_units=99),
                               problems_per_step=3, n=2, seed=0)
    assert all(uncapped.prefix_units[p.id] == len(p.steps) - 1 for p in hard)
    request = uncapped.next_request(0)
    for context, problem, guided in zip(request.contexts, request.problems, request.tags["guided"]):
        if guided:  # the forced prefix stops a step short of the whole solution
            assert TOKENIZER.decode(list(context.suffix)) == "".join(problem.steps[:-1])


# --- POPE with the guidance in the prompt ---------------------------------------------------

def test_instruction_mode_on_the_demo_task_hint_carries_no_loss():
    """Guided contexts of the demo task hold the oracle steps in their hint slots; the batch puts
    no loss on them, and the policy's whole answer is scored against the unguided problem."""
    hard = task.hard_set(4, seed=3)
    method = pope.PopeMethod(PROMPTS, hard, {p.id: 5 for p in hard}, schedule=FixedPrefix(),
                             settings=pope_settings(guidance="instruction"),
                             problems_per_step=4, n=2, seed=0)
    request = method.next_request(0)
    model = Decoder(MODEL, rngs=nnx.Rngs(0))
    rollouts = sampling.generate(model, request.contexts, n=2, max_new_tokens=5,
                                 stop_ids=(TOKENIZER.eos_id,), seed=0)
    rewards = np.random.default_rng(0).uniform(size=(len(request.contexts), 2))
    batch = dynamic_sampling.build_batch(
        [rollouts], [np.asarray(objectives.group_advantages(rewards))],
        dynamic_sampling.select_groups([rewards], len(request.contexts)))
    guided_rows = 0
    for row, group in enumerate(rollouts.group_ids):
        problem, context = request.problems[group], list(request.contexts[group])
        assert batch["tokens"][row, :len(context)].tolist() == context
        assert not batch["completion_mask"][row, :len(context)].any()  # the prompt: no loss
        if request.tags["guided"][group]:
            guided_rows += 1
            text = TOKENIZER.decode(context)
            for i, step in enumerate(problem.steps[:5]):  # s_i c_i in slot i, nothing after
                assert text[i * task.SLOT_LENGTH + 1:(i + 1) * task.SLOT_LENGTH] == step[1:]
            assert text[5 * task.SLOT_LENGTH + 1:6 * task.SLOT_LENGTH] == "__"
            assert request.response_prefixes[group] == ""
            assert task.verify(problem.solution, problem) == 1.0
        else:
            assert context == PROMPTS.question(problem)
    assert guided_rows == 4 * 2


CHAT_PROBLEMS = [Problem(id=f"m{a}", question=f"What is {a} * 7?", answer=str(a * 7),
                         solution=f"{a} * 7 = {a * 7}.\nSo the answer is {a * 7}.")
                 for a in (12, 13, 14, 15)]


def test_instruction_mode_guided_prompt_carries_no_loss(smollm2):
    """Guided contexts hold the partial solution in the user turn, with no response prefix; the
    learner's batch puts no loss on any prompt token and all of it on the policy's answer."""
    prompts = ChatPrompts(smollm2)
    model = Decoder(MODEL.replace(vocab_size=smollm2.vocab_size), rngs=nnx.Rngs(0))
    method = pope.PopeMethod(prompts, CHAT_PROBLEMS, {p.id: 1 for p in CHAT_PROBLEMS},
                             schedule=FixedPrefix(), settings=pope_settings(guidance="instruction"),
                             problems_per_step=4, n=2, seed=0)
    request = method.next_request(0)
    rollouts = sampling.generate(model, request.contexts, n=2, max_new_tokens=5,
                                 stop_ids=(smollm2.eos_id,), seed=0)
    rewards = np.random.default_rng(0).uniform(size=(len(request.contexts), 2))
    selection = dynamic_sampling.select_groups([rewards], len(request.contexts))
    batch = dynamic_sampling.build_batch(
        [rollouts], [np.asarray(objectives.group_advantages(rewards))], selection)
    guided_rows = 0
    for row, group in enumerate(rollouts.group_ids):
        problem, context = request.problems[group], list(request.contexts[group])
        start = len(context)
        assert batch["tokens"][row, :start].tolist() == context
        assert not batch["completion_mask"][row, :start].any()  # the prompt: no loss
        assert batch["completion_mask"][row, start:start + rollouts.lengths[row]].all()
        if request.tags["guided"][group]:
            guided_rows += 1
            partial = f"{problem.question.split()[2]} * 7 = {problem.answer}."
            assert f"Partial Response: {partial}\n\nContinue" in smollm2.decode(context)
            assert problem.answer not in smollm2.decode(prompts.question(problem))
            assert request.response_prefixes[group] == ""
        else:
            assert context == prompts.question(problem)
    assert guided_rows == 4 * 2
