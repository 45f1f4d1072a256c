"""A study made from its config, for the jobs that compare methods (demo, results): the one
place its settings are read (run_setup/study_settings.py) and its base, problem sets and
mining set up, and which of its POPE arms search prefixes."""
from __future__ import annotations

from jaxprefix.methods import pope
from jaxprefix.run_setup.mining import mined_artifacts, set_up
from jaxprefix.run_setup.study_settings import StudySettings
from jaxprefix.studies.study import Study


def study_of(config, workdir: str, *, prefixes: bool = True, trace_pool: bool = False) -> Study:
    """The study of `config` in `workdir`: its base (trained if absent), its hard set mined
    [, its POPE prefix search] [, its trace pool]."""
    study = Study(StudySettings.from_config(config), workdir, *set_up(config, workdir))
    if prefixes:
        study.prefix_search()
    if trace_pool:
        study.trace_pool()
    return study


def guiding_searches(configs) -> list[pope.PopeSettings]:
    """The prefix searches of those POPE run configs of `configs` that guide (a POPE arm
    without guided copies searches nothing)."""
    searches = [pope.PopeSettings.from_config(c) for c in configs]
    return [s for s, c in zip(searches, configs) if s.search_name in mined_artifacts(c)]
