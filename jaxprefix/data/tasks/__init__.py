"""Built-in procedural tasks with oracle solutions; each module's `verify(text, problem)` is its
verifier, which jaxprefix.rewards registers under the task's NAME.

- carry_multiplication: difficulty spread evenly over 20 steps (the long-guidance case);
- keyed_multiplication: the difficulty in one key early step (POPE's short-prefix case).
"""

from jaxprefix.data.tasks import carry_multiplication, keyed_multiplication

__all__ = ["carry_multiplication", "keyed_multiplication", "TASKS", "HINTS", "RESTATING", "get"]

# Task name -> its module: generate, hard_set, problem_sets, sft_batch, hinted, verify, ...
TASKS = {m.NAME: m for m in (carry_multiplication, keyed_multiplication)}

# Task name -> hinted(problem, steps): the problem with its first oracle steps given in the
# prompt, in the task's own layout (POPE's guidance for a policy that reads no English).
HINTS = {name: m.hinted for name, m in TASKS.items()}

# Task name -> restating_prefix(problem): the oracle solution's prefix up to the name of the rule
# its key step reads by ('' where the problem's notation names none), for tasks with such a
# notation (keyed_multiplication's data.key_names_rule): POPE's hint when restating is allowed.
RESTATING = {name: m.restating_prefix for name, m in TASKS.items()
             if hasattr(m, "restating_prefix")}


def get(name: str):
    """The built-in task module called `name`."""
    if name not in TASKS:
        raise ValueError(f"unknown built-in task {name!r}; expected one of {sorted(TASKS)}")
    return TASKS[name]
