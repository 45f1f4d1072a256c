"""Tools: the calculator's values and refusals, the python tool's caps and empty environment,
and the contract that no tool failure ever raises into the rollout."""
import dataclasses
import os
import pathlib
import string

import pytest

from jaxprefix import tools
from jaxprefix.tokenizers import CharTokenizer
from jaxprefix.tools import calculator, sandbox
from jaxprefix.tools.python_tool import PythonLimits, run_code

# wall_s well above cpu_s: a CPU-bound snippet meets its CPU cap first even on a loaded machine.
LIMITS = PythonLimits(cpu_s=1, memory_mb=256, wall_s=20.0, output_bytes=8192)
# The python tool's caps hold in each isolation that starts here (tests/test_sandbox.py: what
# the sandbox adds); the sandbox is the default wherever bubblewrap runs.
ISOLATIONS_HERE = [i for i in sandbox.ISOLATIONS if i != "sandbox" or not sandbox.unavailable()]


@pytest.fixture(params=ISOLATIONS_HERE)
def limits(request):
    return dataclasses.replace(LIMITS, isolation=request.param)


@pytest.mark.parametrize("expression, value", [
    ("1 + 2 * 3", 7), ("(1 + 2) * 3", 9), ("-4 ** 2", -16), ("(-4) ** 2", 16),
    ("7 / 2", 3.5), ("7 // 2", 3), ("-7 // 2", -4), ("7 % 3", 1), ("2 ** 10", 1024),
    ("2 ** -1", 0.5), ("--3", 3), ("+5", 5), ("1.5 * 4", 6.0), (" 12*13 ", 156),
    ("(12 + 3) * -4 ** 2 // 7", -35),
])
def test_calculator_values(expression, value):
    assert calculator.evaluate(expression) == value
    assert type(calculator.evaluate(expression)) is type(value)


@pytest.mark.parametrize("expression, why", [
    ("__import__('os').system('true')", "unsupported syntax: Call"),
    ("x + 1", "unsupported syntax: Name"),
    ("(1).real", "unsupported syntax: Attribute"),
    ("'a' * 3", "unsupported syntax: Constant"),
    ("1 < 2", "unsupported syntax: Compare"),
    ("[1, 2]", "unsupported syntax: List"),
    ("1 +", "syntax error"),
    ("1 / 0", "division by zero"), ("5 % 0", "division by zero"),
    ("9 ** 9 ** 9", "exponent"), ("2 ** 5000", "exponent"),
    ("(10 ** 999) * (10 ** 999) * (10 ** 999) * (10 ** 999)", "bits"),
    ("1e308 * 10", "not finite"), ("(-8) ** 0.5", "complex"),
    ("1 + " * 60 + "1", "characters"),
])
def test_calculator_refusals(expression, why):
    with pytest.raises(calculator.CalculatorError, match=why):
        calculator.evaluate(expression)


def test_calculator_as_a_tool_never_raises():
    registry = tools.registry(["calculator"])
    assert registry.run("calculator", {"expression": "12 * 13"}) == tools.ToolResult("156", True)
    for arguments in ({"expression": "1/0"}, {"expr": "1"}, {"expression": 5}, ["1+1"]):
        result = registry.run("calculator", arguments)
        assert not result.ok and result.text.startswith("error: ")
        assert "\n" not in result.text
    unknown = registry.run("search", {})
    assert not unknown.ok and "no tool named 'search'" in unknown.text


def test_tool_outputs_are_capped_and_failures_one_line(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text("def flood(arguments):\n    return 'x' * 10**6\n"
                    "def crash(arguments):\n    raise RuntimeError('bad\\nthing ' * 1000)\n"
                    "def number(arguments):\n    return 3\n")
    registry = tools.registry([f"{path}:flood", f"{path}:crash", f"{path}:number"])
    flood = registry.run("flood", {}, max_chars=500)
    assert flood.ok and len(flood.text) == 500 and "more characters cut" in flood.text
    for name in ("crash", "number"):
        result = registry.run(name, {})
        assert not result.ok and "\n" not in result.text and len(result.text) <= 300


def test_registry_refuses_unknown_and_unrequested_python(tmp_path):
    with pytest.raises(ValueError, match="unknown tool 'shell'"):
        tools.registry(["shell"])
    with pytest.raises(ValueError, match="opt-in"):
        tools.registry(["python"])
    with pytest.raises(FileNotFoundError, match="no such file"):
        tools.registry([f"{tmp_path}/missing.py:f"])
    assert tools.registry(["python"], python=dataclasses.replace(
        LIMITS, isolation=ISOLATIONS_HERE[0])).names == ["python"]


def test_python_tool_runs_code(limits):
    result = run_code("print(sum(range(10)))", limits)
    assert result == tools.ToolResult("45\n", True)


def test_python_tool_environment_and_directory_are_empty(monkeypatch, limits):
    monkeypatch.setenv("JAXPREFIX_TEST_SECRET", "hunter2")
    result = run_code("import os\nprint(sorted(os.environ))\nprint(sorted(os.listdir('.')))\n"
                      "print(os.getcwd())", limits)
    environ, listing, cwd = result.text.splitlines()
    # The interpreter itself sets LC_CTYPE (PEP 538 locale coercion); nothing is inherited.
    assert eval(environ) in ([], ["LC_CTYPE"])
    assert "hunter2" not in result.text
    assert eval(listing) == []  # its output goes to an unnamed file of ours
    if limits.isolation == "sandbox":
        assert cwd == "/tmp"  # the temporary directory, the sandbox's /tmp
    else:
        assert cwd != os.getcwd() and not os.path.exists(cwd)  # a temporary directory, deleted


@pytest.mark.parametrize("code, why", [
    ("while True:\n    pass", "CPU time limit of 1 s"),
    ("x = bytearray(10 ** 10)", "MemoryError"),
    ("x = [0] * 10 ** 9", "MemoryError"),
    ("print('y' * 10 ** 7)", "output over 8192 bytes"),
    ("while True:\n    print('z' * 1000)", "output over 8192 bytes"),
    ("raise ValueError('boom')", "ValueError: boom"),
    ("import os\nos._exit(3)", "exit status 3"),
    ("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)", "SIGSEGV"),
])
def test_python_tool_failures_end_as_error_observations(code, why, limits):
    result = tools.call(tools.python_tool(limits), {"code": code})
    assert not result.ok and result.text.startswith("error: python: ") and why in result.text
    assert "\n" not in result.text and len(result.text) <= 300


def test_python_tool_hang_is_killed_at_the_wall_timeout(limits):
    limits = dataclasses.replace(limits, wall_s=1.0)
    code = "import time\ntime.sleep(60)"  # asleep: no CPU used, only the wall clock stops it
    result = run_code(code, limits)
    assert result == tools.ToolResult("error: python: timed out after 1 s wall clock", False,
                                      stopped="timeout")


def test_calls_run_together_answer_in_order(limits):
    from jaxprefix.tools.calls import ToolCall
    from jaxprefix.tools.episodes import run_calls
    registry = tools.registry(["calculator", "python"], python=limits)
    calls = [ToolCall("python", {"code": f"print({i} * {i})"}) for i in range(4)] + [
        ToolCall("calculator", {"expression": "6 * 7"}), ToolCall("", {}, "tool call is not JSON")]
    sequential = run_calls(calls, registry)
    assert [r.text for r in sequential] == ["0\n", "1\n", "4\n", "9\n", "42",
                                            "error: tool call is not JSON"]
    assert run_calls(calls, registry, workers=4) == sequential


def test_tool_settings_are_checked_once_in_one_line(tmp_path):
    """config.tools is read where rollout.max_turns > 1 and refused on a run of one turn; turns
    with no tool, the python tool's caps without it, unknown names: one line each."""
    from jaxprefix import run_config
    from jaxprefix.tools.settings import ToolSettings

    def refused(match, **fields):
        c = run_config.base_config()
        for name, value in fields.items():
            block, _, field = name.rpartition("__")
            target = c.rollout if block == "rollout" else c.tools
            if block == "python":
                target = c.tools.python
            target[field] = value
        with pytest.raises(ValueError, match=match) as e:
            ToolSettings.from_config(c)
        assert "\n" not in str(e.value)

    assert not ToolSettings.from_config(run_config.base_config()).episodes
    refused(r"config.tools.names=\('calculator',\): expected left at its default: "
            r"rollout.max_turns=1", names=("calculator",))
    refused("config.tools.python.cpu_s=9: expected left at its default: "
            "tools.python.enabled=False", python__cpu_s=9)
    refused(r"config.tools.names=\(\): expected the tools of rollout.max_turns=2",
            rollout__max_turns=2)
    refused("unknown tool 'search'", rollout__max_turns=2, names=("search",))
    refused("'python' runs model-written code and is opt-in", rollout__max_turns=2,
            names=("python",))
    refused("config.tools.rollout='fast': expected one of", rollout__max_turns=2,
            names=("calculator",), rollout="fast")
    # No sandbox starts (here: bubblewrap is not where the field points): the python tool is
    # refused unless the capped subprocess is chosen by name (tests/test_sandbox.py).
    refused(r"config.tools.python.isolation='sandbox': expected a sandbox for the python "
            r"tool's model-written code, and none starts here \('/nonexistent/bwrap' not found",
            rollout__max_turns=2, names=("python",), python__enabled=True,
            python__bwrap="/nonexistent/bwrap")
    refused("config.tools.python.isolation='docker': expected one of", rollout__max_turns=2,
            names=("python",), python__enabled=True, python__isolation="docker")
    c = run_config.base_config()
    c.rollout.max_turns = 3
    c.tools.update(names=("python",), python={**c.tools.python.to_dict(), "enabled": True,
                                              "isolation": "capped_subprocess",
                                              "bwrap": "/nonexistent/bwrap"})
    settings = ToolSettings.from_config(c)
    assert settings.episodes and settings.python == PythonLimits(
        2, 512, 5.0, 16384, 32, "capped_subprocess", "/nonexistent/bwrap")


def test_environments_by_name_and_from_a_file(tmp_path):
    """The built-in tool task's environment reads calls in the task's symbols and answers in
    them ('__=' for a failed call: an error line is not in its vocabulary); the chat one reads
    the template's format; a user's environment is FILE.py:NAME."""
    from jaxprefix.data.tasks import keyed_multiplication as keyed
    from jaxprefix.tools.environments import environment

    tok = keyed.tokenizer()
    env = environment("keyed_multiplication", tok, tools.registry(["read_key"]))
    assert env.parse("*63+54+82<eos>") == []
    (call,) = env.parse("x>2683<eos>")
    assert (call.name, call.arguments) == ("read_key", {"rule": ">", "key": "2683"})
    assert env.observe([env.tools.run(call.name, call.arguments)], tok.eos_id) == \
        tok.encode("63=")
    (bad,) = env.parse("x>26<eos>")
    failed = env.tools.run(bad.name, bad.arguments)
    assert not failed.ok and env.observe([failed], tok.eos_id) == tok.encode("__=")
    with pytest.raises(ValueError, match="calls 'read_key'"):
        environment("keyed_multiplication", tok, tools.registry(["calculator"]))
    with pytest.raises(ValueError, match="has its own call format"):
        environment("keyed_multiplication", tok, tools.registry(["read_key"]), format="hermes")
    with pytest.raises(ValueError, match="expected one of"):
        environment("gym", tok, tools.registry([]))

    # docs/TOOLS.md's example environment, as printed there
    doc = (pathlib.Path(__file__).parent.parent / "docs" / "TOOLS.md").read_text()
    example = doc.split("# my_env.py:", 1)[1].split("\n", 1)[1].split("```", 1)[0]
    (tmp_path / "env.py").write_text(example + "\ndef wrong(tokenizer, registry):\n    return 3\n")
    chars = CharTokenizer(sorted(set(string.printable) - set(string.whitespace) | {" "}))
    mine = environment(f"{tmp_path}/env.py:questions", chars, tools.registry(["calculator"]))
    assert mine.parse("12*13 is what") == []
    (call,) = mine.parse(" 12*13?")
    assert mine.observe([mine.tools.run(call.name, call.arguments)], None) == \
        chars.encode("=156.")
    with pytest.raises(ValueError, match="returned int, expected a jaxprefix.tools.Environment"):
        environment(f"{tmp_path}/env.py:wrong", tok, tools.registry([]))
