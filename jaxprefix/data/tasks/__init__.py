"""Built-in procedural tasks with oracle solutions; each module's `register_verifier()` registers
its verifier with jaxprefix.rewards."""

from jaxprefix.data.tasks import carry_multiplication

__all__ = ["carry_multiplication", "HINTS"]

# Task name -> hinted(problem, steps): the problem with its first oracle steps given in the
# prompt, in the task's own layout (POPE's guidance for a policy that reads no English).
HINTS = {carry_multiplication.NAME: carry_multiplication.hinted}
