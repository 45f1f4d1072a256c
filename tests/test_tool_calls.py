"""Tool calls parsed in the template's own format; observations rendered as the template's tool
turn and tokenized to append (the bundled SmolLM2 GGUF tokenizer, and small hand-written
templates for the tool-role and the user-turn fallback)."""
import pytest

from jaxprefix import tokenizers
from jaxprefix.checkpoints.gguf import bundled_smollm2_path
from jaxprefix.tokenizers import chat_template
from jaxprefix.tools.calls import ToolCall, format_for, parse_hermes, parse_llama3, parser
from jaxprefix.tools.observations import observation_text, observation_tokens

CALC = '{"name": "calculator", "arguments": {"expression": "2+3"}}'

# Llama 3.1's headers, written small: tool messages under the ipython header.
LLAMA3_LIKE = ("{% for m in messages %}{% if m.role == 'tool' %}{% set role = 'ipython' %}"
               "{% else %}{% set role = m.role %}{% endif %}"
               "<|start_header_id|>{{ role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
               "{% endfor %}{% if add_generation_prompt %}"
               "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
# Gemma-like: roles must alternate user/assistant, so a tool message raises.
ALTERNATING = ("{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
               "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
               "<turn {{ m.role }}>{{ m.content }}</turn>{% endfor %}"
               "{% if add_generation_prompt %}<turn assistant>{% endif %}")
# A template that silently drops any role but user and assistant.
DROPS_TOOLS = ("{% for m in messages %}{% if m.role in ['user', 'assistant'] %}"
               "[{{ m.role }}]{{ m.content }}[/]{% endif %}{% endfor %}"
               "{% if add_generation_prompt %}[assistant]{% endif %}")


@pytest.fixture(scope="module")
def smollm2():
    return tokenizers.load(bundled_smollm2_path())


def test_hermes_calls():
    assert parse_hermes("The answer is 5.") == []
    assert parse_hermes(f"Let me compute.\n<tool_call>\n{CALC}\n</tool_call>") == [
        ToolCall("calculator", {"expression": "2+3"})]
    two = parse_hermes(f"<tool_call>{CALC}</tool_call>\n<tool_call>"
                       '{"name": "lookup", "arguments": "{\\"key\\": 7}"}</tool_call>')
    assert two == [ToolCall("calculator", {"expression": "2+3"}), ToolCall("lookup", {"key": 7})]
    assert parse_hermes(f"<tool_call>{CALC}") == [ToolCall("calculator", {"expression": "2+3"})]


@pytest.mark.parametrize("body, error", [
    ('{"name": "calculator", "arguments": {"expression": "2+3"}', "not valid JSON"),
    ('{"arguments": {}}', 'string "name"'),
    ('["calculator"]', 'string "name"'),
    ('{"name": "calculator", "arguments": [1]}', "must be a JSON object"),
])
def test_malformed_hermes_calls_are_calls_with_an_error(body, error):
    (call,) = parse_hermes(f"<tool_call>{body}</tool_call>")
    assert call.error is not None and error in call.error


def test_llama3_calls():
    call = ToolCall("calculator", {"expression": "2+3"})
    params = '{"name": "calculator", "parameters": {"expression": "2+3"}}'
    assert parse_llama3(params) == [call]
    assert parse_llama3(f"<|python_tag|>{params}<|eom_id|>") == [call]
    assert parse_llama3(f"  {params}<|eot_id|>") == [call]
    assert parse_llama3("The sum is 5.<|eot_id|>") == []
    assert parse_llama3('{"result": 5}') == []  # JSON, but no call: an answer
    (bad,) = parse_llama3('{"name": "calculator", "parameters": ')
    assert bad.error and "not valid JSON" in bad.error


def test_format_for_templates(smollm2):
    assert format_for(smollm2.chat_template) == "hermes"
    assert format_for(LLAMA3_LIKE) == "llama3"
    assert format_for("{{ '<tool_call>' }}<|eot_id|>") == "hermes"
    assert parser("llama3") is parse_llama3
    with pytest.raises(ValueError, match="config.tools.format='xml'"):
        parser("xml")


def test_smollm2_observation_is_its_tool_turn(smollm2):
    text = observation_text(smollm2.chat_template, ["5"], **smollm2.special_tokens)
    assert text == "<|im_end|>\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    # The sampled turn ended on <|im_end|> (EOS): it is not appended twice.
    ids = observation_tokens(smollm2, ["5"], sampled_stop=smollm2.eos_id)
    assert smollm2.decode(ids) == text.removeprefix("<|im_end|>")
    assert observation_tokens(smollm2, ["5"])[0] == smollm2.eos_id  # truncated: closed here


def test_smollm2_episode_tokens_equal_the_templates_conversation(smollm2):
    """prompt + sampled call + observation tokens + answer == the template's own rendering of
    the whole conversation, token for token: nothing drifts at the seams."""
    user = [{"role": "user", "content": "What is 2+3?"}]
    call = f"<tool_call>\n{CALC}\n</tool_call>"
    sampled_call = smollm2.encode(call) + [smollm2.eos_id]
    answer = smollm2.encode("2+3 = 5.") + [smollm2.eos_id]
    episode = (smollm2.apply_chat_template(user, tokenize=True) + sampled_call +
               observation_tokens(smollm2, ["5"], sampled_stop=smollm2.eos_id) + answer)
    whole = user + [{"role": "assistant", "content": call}, {"role": "tool", "content": "5"},
                    {"role": "assistant", "content": "2+3 = 5."}]
    rendered = smollm2.apply_chat_template(whole, add_generation_prompt=False, tokenize=True)
    assert episode == rendered[:len(episode)]
    assert smollm2.decode(rendered[len(episode):]) == "\n"  # the template's newline after EOS


def test_llama3_like_tool_turn_is_the_ipython_header():
    text = observation_text(LLAMA3_LIKE, ['{"value": 5}'])
    assert text == ('<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n{"value": 5}'
                    "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")


@pytest.mark.parametrize("template, expected", [
    (ALTERNATING, "</turn><turn user><tool_response>\n5\n</tool_response>\n<tool_response>\n"
                  "7\n</tool_response></turn><turn assistant>"),
    (DROPS_TOOLS, "[/][user]<tool_response>\n5\n</tool_response>\n<tool_response>\n7\n"
                  "</tool_response>[/][assistant]"),
])
def test_templates_without_a_tool_role_get_a_user_turn(template, expected):
    assert observation_text(template, ["5", "7"]) == expected


def test_template_that_cannot_continue_is_refused():
    first_two = "{% for m in messages[:2] %}{{ m.content }}{% endfor %}"
    with pytest.raises(ValueError, match="renders neither a tool message"):
        observation_text(first_two, ["5"])
    assert chat_template.render(first_two, [{"role": "user", "content": "x"}]) == "x"


# Qwen3's tool section, written small: the schemas as JSON lines in a system turn.
LISTS_TOOLS = ("{% if tools %}<|im_start|>system\n# Tools\n<tools>"
               "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools><|im_end|>\n"
               "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
               "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
               "{% endif %}")


def test_prompt_lists_the_registry_tools_as_transformers_renders_them():
    from transformers.utils.chat_template_utils import render_jinja_template

    from jaxprefix import tools
    schemas = tools.registry(["calculator"]).schemas()
    assert schemas[0]["function"]["name"] == "calculator"
    messages = [{"role": "user", "content": "What is 2+3?"}]
    ours = chat_template.render(LISTS_TOOLS, messages, add_generation_prompt=True,
                                tools=schemas)
    (theirs,), _ = render_jinja_template(conversations=[messages], tools=schemas,
                                         chat_template=LISTS_TOOLS, add_generation_prompt=True)
    assert ours == theirs
    assert '"name": "calculator"' in ours and ours.endswith("<|im_start|>assistant\n")
    assert "<tools>" not in chat_template.render(LISTS_TOOLS, messages, tools=[])


@pytest.mark.parametrize("max_turns,environment,listed", [
    (2, "chat", True), (1, "chat", False), (2, "keyed_multiplication", False)])
def test_a_chat_policys_prompts_list_the_tools_of_a_chat_environment(max_turns, environment,
                                                                     listed):
    """A run whose episodes call tools in the chat template's own format: its policy's prompts
    (questions and unfinished answers) render the template's tool section with the registry's
    schemas; a run of one turn, or an environment of its own format, lists none."""
    from jaxprefix import run_config, tools
    from jaxprefix.data.problem import Problem
    from jaxprefix.run_setup.mining import MiningSettings
    from jaxprefix.run_setup.policy import PolicySettings

    config = run_config.base_config()
    config.model.update(source="gguf", path="bundled")
    config.rollout.max_turns = max_turns
    if max_turns > 1:
        config.tools.update(names=("calculator",) if environment == "chat" else ("read_key",),
                            environment=environment)
    settings = PolicySettings.from_config(config)
    schemas = tools.registry(["calculator"]).schemas()
    assert settings.tools == (tuple(schemas) if listed else ())
    tokenizer = tokenizers.load(bundled_smollm2_path())
    tokenizer.chat_template = LISTS_TOOLS
    prompts = settings.chat_prompts(tokenizer)
    problem = Problem("p", "What is 2+3?", "5")
    question = tokenizer.decode(prompts.question(problem))
    unfinished = prompts.render_unfinished(problem, "Let me")
    for text in (question, unfinished):
        assert ('"name": "calculator"' in text) == listed
        assert ("<tools>" in text) == listed
    assert question.endswith("What is 2+3?<|im_end|>\n<|im_start|>assistant\n")
    # Mining samples the run's episodes, with its tools.
    assert MiningSettings.from_config(config).probe.tools.episodes == (max_turns > 1)


# One worked call shown in the prompt (SmolLM2's template has no tool section, and the 135M
# model called nothing zero-shot: 0 calls in 4 greedy episodes with either system prompt tried).
SHOT = [{"role": "system", "content": "You are a helpful assistant. For arithmetic, call the "
                                      "calculator tool, then answer with its result."},
        {"role": "user", "content": "What is 12 * 13?"},
        {"role": "assistant", "content": "<tool_call>\n" + CALC.replace("2+3", "12 * 13")
         + "\n</tool_call>"},
        {"role": "tool", "content": "156"},
        {"role": "assistant", "content": "12 * 13 = 156."}]


@pytest.mark.slow  # SmolLM2-135M on CPU, 16 episodes of up to 2 turns: a minute or two
def test_smollm2_calls_the_calculator_through_its_chat_template(smollm2):
    """The real-LLM smoke: SmolLM2-135M-Instruct (the bundled GGUF) in the chat environment
    with the calculator, sampled at temperature 1. The episodes run; what it calls parses (in
    the Hermes format the template speaks, malformed or not); the result comes back as the
    template's own tool turn and the episode goes on. Nothing is claimed of its arithmetic."""
    from jaxprefix.checkpoints.hf import from_gguf
    from jaxprefix.tools.settings import ToolSettings

    model, _ = from_gguf(bundled_smollm2_path(), "float32")
    settings = ToolSettings(max_turns=2, names=("calculator",), episode_token_budget=512)
    rollout = settings.episode_rollout(smollm2, model.config.max_position_embeddings)
    contexts = [smollm2.apply_chat_template(SHOT + [{"role": "user", "content": q}],
                                            tokenize=True)
                for q in ("What is 37 * 41?", "What is 1234 + 5678?")]
    episodes = rollout(model, contexts, n=8, seed=0, stop_ids=[smollm2.eos_id],
                       max_new_tokens=48, temperature=1.0)
    called = [e for e in episodes if e.tool_calls]
    assert called, [smollm2.decode(e.tokens[e.prompt_length:].tolist()) for e in episodes]
    for e in called:
        turn = e.tokens[e.turn_starts[0]:e.turn_starts[1]]
        sampled = turn[e.sampled[e.turn_starts[0]:e.turn_starts[1]] == 1].tolist()
        assert sampled[-1] == smollm2.eos_id and len(parse_hermes(smollm2.decode(
            sampled[:-1]))) == e.tool_calls
        observation = smollm2.decode(e.tokens[e.observation_mask == 1].tolist())
        assert observation.startswith("\n<|im_start|>tool\n")
        assert observation.endswith("<|im_end|>\n<|im_start|>assistant\n")
        assert e.turns == 2
