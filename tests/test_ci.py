"""CI (.ci/run) runs exactly the README's test command, both suites, and fails on either."""
import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]


def readme_test_command() -> str:
    section = (ROOT / "README.md").read_text().split("## Run the tests", 1)[1]
    return section.split("```bash\n", 1)[1].split("```", 1)[0].strip()


def test_ci_runs_the_readme_test_command_default_suite_then_slow():
    command = readme_test_command()
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == command
    assert "set -euo pipefail" in ci
    assert command.endswith("&& python -m pytest && python -m pytest -m slow")
    # Before it, bubblewrap (the python tool's sandbox) where it is missing, and nothing else.
    assert ci[-2] == ("command -v bwrap >/dev/null || (apt-get update -qq && apt-get install -y "
                      "-qq bubblewrap)")


def test_a_suite_that_collects_nothing_fails_the_command():
    # The command's two suites, each narrowed to this file: the default one passes, the slow
    # one collects nothing here (pytest's exit status 5), and the chain fails with it.
    suites = readme_test_command().split(" && ")[-2:]
    narrowed = " && ".join(f"{suite} tests/test_ci.py -k ci_runs -p no:cacheprovider"
                           for suite in suites)
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", narrowed], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 5, result.stdout[-2000:]
