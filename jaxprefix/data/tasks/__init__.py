"""Built-in procedural tasks with oracle solutions (`register_verifier()` registers each verifier)."""

from jaxprefix.data.tasks import carry_multiplication

__all__ = ["carry_multiplication"]
