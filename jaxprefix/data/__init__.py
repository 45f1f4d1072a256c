"""Problems in: records, file and generator sources, and the checkpointable loader.

TFDS and reasoning-gym sources import their libraries on use: `jaxprefix.data.tfds_source`,
`jaxprefix.data.reasoning_gym_source`.
"""

from jaxprefix.data.files import Fields, LoadReport, load_problems, read_problem_file
from jaxprefix.data.problem import DataError, FrozenMetadata, Problem, content_id

__all__ = [
    "DataError", "Fields", "FrozenMetadata", "LoadReport", "Problem", "content_id",
    "load_problems", "read_problem_file",
]
