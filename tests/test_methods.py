"""POPE and PrefixRL as batch builders and miners (methods/{pope,prefixrl,probing}.py).

Everything runs for real: the demo task's problems and character tokenizer, a tiny random
decoder, the sampler and the learner's batch layout. Mining is scored by verifiers registered in
this file whose outcome is known in advance (by problem id, or by how much of the oracle solution
a text starts with), so the hard set, the shortest prefixes and the sample counts can be checked
against numbers counted by hand.
"""
import dataclasses
import json

import numpy as np
import pytest
from flax import nnx

from jaxprefix import rewards, sampling, tokenizers
from jaxprefix.checkpoints.gguf import bundled_smollm2_path
from jaxprefix.data.problem import Problem
from jaxprefix.data.tasks import carry_multiplication as task
from jaxprefix.methods import pope, prefixrl
from jaxprefix.rl.compute_ledger import ComputeLedger
from jaxprefix.methods.probing import Prober
from jaxprefix.sampling import RolloutSpec
from jaxprefix.methods.prompting import ChatPrompts, TaskPrompts, oracle_prefix_text
from jaxprefix.methods.schedules import AdaptivePrefix, AnnealedPrefix, FixedPrefix
from jaxprefix.models.config import ModelConfig
from jaxprefix.models.decoder import Decoder
from jaxprefix.rl import dynamic_sampling, objectives
from jaxprefix.rl.compute_ledger import sampling_flops
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


@pytest.mark.parametrize("prefixes,unprefixed", [(3, 1), (2, 2)])
def test_prefixrl_mix(prefixes, unprefixed):
    method = prefixrl_method(prefixes_per_problem=prefixes, unprefixed_copies=unprefixed)
    request = method.next_request(0)
    assert len(request.contexts) == 4 * (prefixes + unprefixed)
    guided = request.tags["guided"]
    assert guided.sum() == 4 * prefixes
    for problem in PROBLEMS[:4]:
        rows = [i for i, p in enumerate(request.problems) if p.id == problem.id]
        assert guided[rows].sum() == prefixes and (~guided[rows]).sum() == unprefixed
        trace = method.pool.traces[problem.id].tokens
        assert trace == tuple(TOKENIZER.encode(problem.solution))  # oracle traces
        for i in rows:
            context = request.contexts[i]
            if guided[i]:
                assert context.prompt == tuple(PROMPTS.question(problem))
                assert tuple(context.suffix) == trace[:len(context.suffix)]
                assert request.response_prefixes[i] == TOKENIZER.decode(list(context.suffix))
            else:
                assert list(context) == PROMPTS.question(problem)
                assert request.response_prefixes[i] == ""
        suffixes = [len(request.contexts[i].suffix) for i in rows if guided[i]]
        assert suffixes == method.cuts[problem.id]


# --- PrefixRL cut points ---------------------------------------------------------------------

def test_cut_points_by_hand():
    rng = np.random.default_rng(0)
    assert prefixrl.cut_points(10, 5, 0.5, 0.5, rng) == [5] * 5
    cuts = prefixrl.cut_points(4, 200, 0.0, 1.0, rng)
    assert min(cuts) == 1 and max(cuts) == 3  # one token kept, one left to generate
    assert prefixrl.cut_points(1, 3, 0.4, 0.8, rng) == [1, 1, 1]
    with pytest.raises(ValueError, match="0 <= lo <= hi <= 1"):
        prefixrl.cut_points(10, 1, 0.8, 0.4, rng)


def test_prefixrl_cut_points_in_range_reproducible_and_order_free():
    problems = task.generate(32, digits=(2, 20), seed=3)
    lo, hi = 0.4, 0.8
    method = prefixrl_method(problems, cut_range=(lo, hi), problems_per_step=4)
    for problem in problems:
        length = len(method.pool.traces[problem.id].tokens)
        cuts = method.cuts[problem.id]
        assert len(cuts) == 3 and all(isinstance(c, int) for c in cuts)
        for cut in cuts:
            assert round(lo * length) <= cut <= round(hi * length), (problem.id, length, cut)
            assert 1 <= cut <= length - 1
    assert prefixrl_method(problems, problems_per_step=4).cuts == method.cuts
    assert prefixrl_method(problems[::-1], problems_per_step=4).cuts == method.cuts
    other = prefixrl_method(problems, problems_per_step=4, seed=1).cuts
    assert other != method.cuts
    assert sum(other[p.id] != method.cuts[p.id] for p in problems) > len(problems) // 2


def test_prefixrl_needs_a_trace():
    pool = prefixrl.oracle_trace_pool(PROMPTS, PROBLEMS[:2])
    with pytest.raises(ValueError, match="no trace for any training problem"):
        prefixrl.PrefixRLMethod(PROMPTS, PROBLEMS[2:4], pool, schedule=FixedPrefix(),
                                problems_per_step=2, n=2, seed=0)


# --- the loss mask on a real batch -----------------------------------------------------------

@pytest.mark.parametrize("make", [prefixrl_method, pope_method], ids=["prefixrl", "pope"])
def test_prefix_tokens_carry_no_loss(model, make):
    request = make().next_request(0)
    rollouts = sampling.generate(model, request.contexts, n=request.n, max_new_tokens=5,
                                 stop_ids=STOP, seed=0)
    group_rewards = np.random.default_rng(0).uniform(size=(len(request.contexts), request.n))
    advantages = np.asarray(objectives.group_advantages(group_rewards))
    selection = dynamic_sampling.select_groups([group_rewards], len(request.contexts))
    batch = dynamic_sampling.build_batch([rollouts], [advantages], selection)
    assert rollouts.tokens.shape[0] == batch["tokens"].shape[0] == len(request.contexts) * request.n
    prefixed_rows = 0
    for row, group in enumerate(rollouts.group_ids):
        context = context_ids(request.contexts[group])
        start, length = len(context), int(rollouts.lengths[row])
        assert rollouts.context_lengths[row] == start and length >= 1
        assert batch["tokens"][row, :start].tolist() == context  # the prefix is in the context
        expected = np.zeros(batch["tokens"].shape[1], np.float32)
        expected[start:start + length] = 1.0
        np.testing.assert_array_equal(batch["completion_mask"][row], expected)
        width = rollouts.tokens.shape[1]
        np.testing.assert_array_equal(rollouts.completion_mask[row], expected[:width])
        assert batch["token_mask"][row].sum() == start + length
        prefixed_rows += isinstance(request.contexts[group], SharedContext) and bool(
            request.contexts[group].suffix)
    assert prefixed_rows > 0


# --- schedules inside methods ----------------------------------------------------------------

def test_pope_annealed_prefix_shortens_with_steps():
    hard = PROBLEMS[:4]
    method = pope_method(hard, units=4, schedule=AnnealedPrefix(steps=4))
    lengths = []
    for step in range(5):
        request = method.next_request(step)
        guided = [len(c.suffix) for c, g in zip(request.contexts, request.tags["guided"]) if g]
        assert len(set(guided)) == 1  # every problem's prefix is 4 steps here
        lengths.append(guided[0])
    assert lengths == [12, 9, 6, 3, 0]  # 4, 3, 2, 1, 0 steps of 3 tokens


def test_pope_adaptive_prefix_shortens_after_successes():
    hard = PROBLEMS[:3]
    method = pope_method(hard, units=3, schedule=AdaptivePrefix(window=2, threshold=0.5))
    request = method.next_request(0)
    guided = request.tags["guided"]
    ids = [p.id for p in request.problems]
    step_rewards = np.zeros((len(request.contexts), 2))
    step_rewards[[i for i, pid in enumerate(ids) if pid == hard[0].id and guided[i]]] = 1
    # Unguided successes say nothing of the prefix: hard[1]'s stays.
    step_rewards[[i for i, pid in enumerate(ids) if pid == hard[1].id and not guided[i]]] = 1
    method.observe(request, step_rewards)
    after = method.next_request(1)
    units = {p.id: len(c.suffix) // task.STEP_LENGTH
             for c, p, g in zip(after.contexts, after.problems, after.tags["guided"]) if g}
    assert units == {hard[0].id: 2, hard[1].id: 3, hard[2].id: 3}


def test_prefixrl_adaptive_prefix_shortens_one_cut():
    method = prefixrl_method(PROBLEMS[:2], schedule=AdaptivePrefix(window=2, stride=2))
    first = PROBLEMS[0]
    request = method.next_request(0)
    step_rewards = np.zeros((len(request.contexts), 2))
    guided = request.tags["guided"]
    rows = [i for i, p in enumerate(request.problems) if p.id == first.id and guided[i]]
    step_rewards[rows[1]] = 1  # the second cut of the first problem succeeds
    method.observe(request, step_rewards)
    after = method.next_request(1)
    lengths = {p.id: [] for p in PROBLEMS[:2]}
    for c, p, g in zip(after.contexts, after.problems, after.tags["guided"]):
        if g:
            lengths[p.id].append(len(c.suffix))
    cuts = method.cuts[first.id]
    assert lengths[first.id] == [cuts[0], cuts[1] - 2, cuts[2]]
    assert lengths[PROBLEMS[1].id] == method.cuts[PROBLEMS[1].id]


def test_prefixrl_adaptive_with_a_problem_twice_in_a_batch():
    # 2 problems, 3 per step: the batch runs into the next epoch and repeats a problem.
    method = prefixrl_method(PROBLEMS[:2], problems_per_step=3, schedule=AdaptivePrefix(window=4))
    request = method.next_request(0)
    ids = [p.id for p in request.problems]
    twice = max(set(ids), key=ids.count)
    assert ids.count(twice) == 2 * 4  # two occurrences of 3 prefixed + 1 plain
    method.observe(request, np.ones((len(request.contexts), 2)))  # 2 x 2 successes per cut
    after = method.next_request(1)
    cuts = method.cuts[twice]
    shortened = [len(c.suffix) for c, p, g in zip(after.contexts, after.problems,
                                                   after.tags["guided"]) if g and p.id == twice]
    assert shortened[:3] == [c - 1 for c in cuts]


# --- checkpointed state ----------------------------------------------------------------------

def request_summary(request):
    return ([context_ids(c) for c in request.contexts], [p.id for p in request.problems],
            request.tags["guided"].tolist(), request.response_prefixes)


@pytest.mark.parametrize("make", [
    lambda: pope_method(PROBLEMS, problems_per_step=3, easy=EASY, easy_per_step=2,
                        schedule=AdaptivePrefix(window=2)),
    lambda: prefixrl_method(PROBLEMS, problems_per_step=3, schedule=AdaptivePrefix(window=2)),
], ids=["pope", "prefixrl"])
def test_state_round_trip_gives_the_same_next_requests(make):
    method = make()
    for step in range(3):
        request = method.next_request(step)
        method.observe(request, np.ones((len(request.contexts), 2)))
    state = json.loads(json.dumps(method.state()))  # as the checkpoint stores it
    resumed = make()
    resumed.restore(state)
    assert request_summary(resumed.next_request(3)) == request_summary(method.next_request(3))
    assert request_summary(resumed.next_request(4)) == request_summary(method.next_request(4))
    fresh = make()
    assert request_summary(fresh.next_request(3)) != request_summary(resumed.next_request(5))


# --- mining ----------------------------------------------------------------------------------

def test_mine_hard_set_counts_and_ledger(model):
    probe = prober(model, "test_methods_solved_by_id", rows_per_call=6)  # 3 problems per call
    hard = pope.mine_hard_set(probe, PROMPTS, PROBLEMS, k=2, seed=0)
    assert [p.id for p in hard.problems] == [p.id for p in PROBLEMS if p.id not in SOLVED_IDS]
    assert hard.solve_counts == {p.id: 2 if p.id in SOLVED_IDS else 0 for p in PROBLEMS}
    assert hard.to_json()["hard_ids"] == [p.id for p in hard.problems] and hard.k == 2
    ledger = probe.ledger
    assert ledger.extra_rollouts == len(PROBLEMS) * 2 and ledger.rollouts == 0
    context_tokens = len(PROBLEMS) * 2 * task.QUESTION_LENGTH
    assert (sampling_flops(MODEL.num_params(), context_tokens + len(PROBLEMS) * 2)
            <= ledger.extra_flops
            <= sampling_flops(MODEL.num_params(), context_tokens + len(PROBLEMS) * 2 * 6))


def test_shortest_solvable_prefixes_by_hand(model):
    four = [p for p in task.generate(40, digits=(4, 4), seed=7)][:4]
    two = task.generate(1, digits=(2, 2), seed=8)[0]
    problems = four + [two]
    STEPS_NEEDED.update({four[0].id: 1, four[1].id: 2, four[2].id: 3, four[3].id: 4, two.id: 5})
    probe = prober(model, "test_methods_enough_steps", rows_per_call=4)
    search = pope.shortest_solvable_prefixes(probe, PROMPTS, problems, m=2, max_units=3,
                                             guidance="solution_prefix", seed=0)
    assert search.shortest == {four[0].id: 1, four[1].id: 2, four[2].id: 3, four[3].id: None,
                               two.id: None}
    # Pending per length: 1 step: all 5; 2 steps: the four 4-digit minus four[0] (two's limit
    # is 1 step: 2 would be its whole solution); 3 steps: four[2], four[3]. m = 2 samples each.
    assert probe.ledger.extra_rollouts == (5 + 3 + 2) * 2
    # The answers kept are whole solutions: the forced prefix, then the policy's continuation.
    for pid, units in search.shortest.items():
        if units:
            text = TOKENIZER.decode(search.answers[pid])
            assert text.startswith(oracle_prefix_text(next(p for p in problems if p.id == pid),
                                                      units))
    assert pope.revealed_fractions(problems, search.shortest) == [1 / 4, 2 / 4, 3 / 4]
    # A cap of half the solution: at most 2 of 4 steps, so four[2] (needs 3) finds none.
    capped = pope.shortest_solvable_prefixes(prober(model, "test_methods_enough_steps"), PROMPTS,
                                             problems, m=2, max_units=3, max_fraction=0.5,
                                             guidance="solution_prefix", seed=0)
    assert capped.shortest == {four[0].id: 1, four[1].id: 2, four[2].id: None, four[3].id: None,
                               two.id: None}


def test_build_trace_pool_respects_max_samples(model):
    probe = prober(model, "test_methods_solved_by_id", max_new_tokens=4)
    problems = PROBLEMS[:5]  # PROBLEMS[1] and PROBLEMS[4] are solved every time
    pool = prefixrl.build_trace_pool(probe, PROMPTS, problems, samples_per_round=2, max_samples=5,
                                     seed=0)
    assert sorted(pool.traces) == sorted([PROBLEMS[1].id, PROBLEMS[4].id])
    # Solved in round 1 (2 samples); unsolved ones draw 2 rounds (4 samples; a third would pass 5).
    assert pool.samples_per_problem == {p.id: 2 if p.id in SOLVED_IDS else 4 for p in problems}
    assert max(pool.samples_per_problem.values()) <= 5
    assert probe.ledger.extra_rollouts == sum(pool.samples_per_problem.values()) == 2 * 2 + 3 * 4
    for trace in pool.traces.values():
        assert trace.samples == 2 and len(trace.tokens) <= 4
        assert TOKENIZER.eos_id not in trace.tokens  # the stop token is the policy's to write


def test_trace_pool_jsonl_round_trip(tmp_path):
    pool = prefixrl.oracle_trace_pool(PROMPTS, PROBLEMS[:3])
    path = str(tmp_path / "pool.jsonl")
    pool.save_jsonl(path, TOKENIZER)
    loaded = prefixrl.TracePool.load_jsonl(path, PROMPTS)
    assert loaded.traces == pool.traces
    text_only = tmp_path / "text.jsonl"
    text_only.write_text(json.dumps({"id": PROBLEMS[0].id, "text": PROBLEMS[0].solution}) + "\n")
    assert prefixrl.TracePool.load_jsonl(str(text_only), PROMPTS).traces[PROBLEMS[0].id].tokens == \
        tuple(TOKENIZER.encode(PROBLEMS[0].solution))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:line 1: expected fields 'id' and 'tokens' or 'text'"):
        prefixrl.TracePool.load_jsonl(str(bad), PROMPTS)


def test_imported_pool_keeps_only_traces_that_verify(tmp_path):
    """Another model's traces: one right, one wrong (a digit changed), one for a problem not in
    the training set; only the right one is kept, and the drops are counted by reason."""
    right, wrong = PROBLEMS[0], PROBLEMS[1]
    bad_text = wrong.solution[:-2] + str((int(wrong.solution[-2]) + 1) % 10) + wrong.solution[-1]
    path = tmp_path / "pool.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (
        {"id": right.id, "text": right.solution}, {"id": wrong.id, "text": bad_text},
        {"id": "carry_multiplication-1x2", "text": "+20"})))
    pool = prefixrl.TracePool.load_jsonl(str(path), PROMPTS)
    kept, stats = prefixrl.verified_pool(pool, PROBLEMS[:4], verifier=task.NAME,
                                         decode=TOKENIZER.decode)
    assert set(kept.traces) == {right.id}
    assert stats == {"traces": 3, "kept": 1, "unknown_problem": 1, "failed_verification": 1}


def test_mining_states_what_it_will_sample_and_its_flops_before_it_starts():
    from jaxprefix.jobs.mine import sampling_cost

    lengths = [len(PROMPTS.question(p)) for p in PROBLEMS[:3]]
    tokens = 16 * (sum(lengths) + 3 * 61)  # 16 samples of each, up to 61 new tokens
    line = sampling_cost("mining the hard set", lengths, 16, 61, num_params=1000)
    assert line == (f"mining the hard set: will sample 3 contexts x 16 samples x up to 61 new "
                    f"tokens (D <= {tokens:.3g} tokens, contexts included), <= "
                    f"{2 * 1000 * tokens:.3g} FLOPs (2 N D, N = 1e+03 parameters)")
