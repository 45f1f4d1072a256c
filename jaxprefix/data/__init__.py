"""Problems in: records, file and generator sources, and the checkpointable loader.

The TFDS source imports tensorflow_datasets, so it is imported on use:
`from jaxprefix.data import tfds_source`. reasoning-gym is imported when problems are generated.
"""

from jaxprefix.data.files import Fields, LoadReport, load_problems, read_problem_file
from jaxprefix.data.loader import ProblemLoader
from jaxprefix.data.problem import DataError, FrozenMetadata, Problem, content_id
from jaxprefix.data.reasoning_gym_source import reasoning_gym_problems

__all__ = [
    "DataError", "Fields", "FrozenMetadata", "LoadReport", "Problem", "ProblemLoader", "content_id",
    "load_problems", "read_problem_file", "reasoning_gym_problems",
]
