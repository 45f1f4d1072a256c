"""Built-in procedural tasks with oracle solutions; each module's `register_verifier()` registers
its verifier with jaxprefix.rewards."""

from jaxprefix.data.tasks import carry_multiplication

__all__ = ["carry_multiplication"]
