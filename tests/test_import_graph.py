"""Imports flow one way (docs/ARCHITECTURE.md): no module of jaxprefix imports, directly or
through others, a module that imports it back, lazily inside a function included."""
import ast
import pathlib

import jaxprefix

ROOT = pathlib.Path(jaxprefix.__file__).parent


def _import_graph() -> dict[str, set[str]]:
    modules = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxprefix"):
                for alias in node.names:  # `from pkg import module` names the module itself
                    sub = f"{node.module}.{alias.name}"
                    targets.add(sub if sub in modules else node.module)
            elif isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name.startswith("jaxprefix"))
        graph[name] = targets & modules.keys()
    return graph


def _cycle_from(start: str, graph) -> list[str] | None:
    """A path start -> ... -> start, or None (depth-first)."""
    stack, seen = [(start, [start])], set()
    while stack:
        node, path = stack.pop()
        for nxt in graph[node]:
            if nxt == start:
                return path + [start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, path + [nxt]))
    return None


def test_no_module_imports_itself_back():
    graph = _import_graph()
    assert "jaxprefix.jobs.rl" in graph and graph["jaxprefix.jobs.rl"]  # the walk sees imports
    cycles = [c for c in (_cycle_from(m, graph) for m in sorted(graph)) if c]
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


# The floors, top first: a module imports from its own floor or below, never above (lazily
# inside a function included). The model knows nothing of decoding or training, the sampler
# nothing of losses or papers, the learner nothing of methods, verifiers only text and problems.
FLOORS = (
    ("main",),
    ("api",),                  # the Python door: main's path, from a notebook or a script
    ("jobs",),                 # the entry points: what main dispatches, `python -m` commands
    ("studies",),              # method comparisons from one base, and their reports
    ("run_setup",),            # settings resolved and checked; policy, problem sets, mining
    ("variants",),             # the variants configs/*.py share
    ("run_config", "study_fields"),  # every field's default and doc (the SFT job's and the
    #                                   studies' blocks apart), read by jobs and configs/
    ("tpu",),                  # the compile job's programs: the learner and sampler, compiled
    ("methods",),              # POPE, PrefixRL, IsoCompute: what to sample and how to mix it
    ("rl",),                   # the loop, the learner, the compute ledger
    ("serving",),              # the OpenAI-compatible server over the sampler (docs/SERVING.md)
    ("tools",),                # tools and multi-turn episodes (docs/TOOLS.md)
    ("statistics",),
    ("evaluation", "key_step_probe"),  # pass@k of samples; teacher-forced step probabilities
    ("rewards",),              # verifiers: text and problems in, scores out
    ("data",),
    ("tokenizers",),
    ("sampling",),             # the sampler: token ids in, rollouts out
    ("checkpoints",),          # model files (HF, GGUF, orbax) to models
    ("models",),
    ("run_identity",),
    ("storage",),              # files local or gs://, their faults and retries, the workdir lock
    ("distributed",),
    ("errors", "config_fields", "config_reads", "compile_log", "jaxprefix"),  # leaves
    # (compile_log: what XLA compiled and the cache served; config_fields: a
    # field's default and doc; config_reads: which fields code read; jaxprefix: the version)
)


def _floor(module: str) -> int:
    top = module.split(".")[1] if "." in module else module
    for index, names in enumerate(FLOORS):
        if top in names:
            return index
    raise AssertionError(f"{module}: its package {top!r} has no floor in FLOORS: add it")


def test_no_module_imports_a_floor_above_its_own():
    graph = _import_graph()
    upward = [f"{a} -> {b}" for a in sorted(graph) for b in sorted(graph[a])
              if _floor(b) < _floor(a)]
    assert not upward, "imports up a floor (FLOORS):\n" + "\n".join(upward)


def test_the_library_never_imports_the_studies_beside_it():
    """studies/ at the repository's root (python -m studies.NAME) sits above the package: it
    imports jaxprefix, never the other way."""
    above = []
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                     else [])
            above += [f"{path.relative_to(ROOT)}: {n}" for n in names
                      if n == "studies" or n.startswith("studies.")]
    assert not above, "the library imports a study:\n" + "\n".join(above)


def test_no_module_imports_another_modules_private_names():
    """What two modules share is public: a leading underscore means the module's own."""
    private = []
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxprefix"):
                private += [f"{path.relative_to(ROOT)}: {node.module}.{a.name}"
                            for a in node.names if a.name.startswith("_")]
    assert not private, "private names imported:\n" + "\n".join(private)
