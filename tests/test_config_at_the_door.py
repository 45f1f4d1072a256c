"""Settings are read once, at the door (issue 42): the jobs and run_setup/ turn the config into
typed settings, and below them no module imports ml_collections or reads a config block, except
a settings class's own `from_config` (and the `*_settings` helpers those call), which is where
its fields are parsed and checked. This walks every module's syntax tree; it fails naming the
module, the line and the block read."""
import ast
import pathlib

import jaxprefix
from jaxprefix import run_config

ROOT = pathlib.Path(jaxprefix.__file__).parent
# Above the dashed line of docs/ARCHITECTURE.md's walk: these read the config.
DOOR = {"main.py", "api.py", "jobs", "run_setup", "variants.py", "run_config.py", "study_fields.py",
        "config_fields.py", "config_reads.py", "errors.py", "distributed.py"}
BLOCKS = set(run_config.base_config().keys())


def _is_builder(name: str | None) -> bool:
    return name is not None and (name == "from_config" or name.endswith("_settings"))


def _reads(tree) -> list[tuple[int, str, str | None]]:
    """(line, 'config.<block>', the function it is in) of every config block read."""
    found = []

    def walk(node, function):
        for child in ast.iter_child_nodes(node):
            inner = (child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
                     else function)
            if (isinstance(child, ast.Attribute) and isinstance(child.value, ast.Name)
                    and child.value.id == "config" and child.attr in BLOCKS):
                found.append((child.lineno, f"config.{child.attr}", function))
            elif isinstance(child, ast.Call) and _block_by_name(child):
                found.append((child.lineno, _block_by_name(child), function))
            walk(child, inner)

    walk(tree, None)
    return found


def _block_by_name(call: ast.Call) -> str | None:
    """`config.get("block")` or `getattr(config, "block")`: a block read by its name."""
    f, args = call.func, call.args
    if (isinstance(f, ast.Attribute) and f.attr == "get" and isinstance(f.value, ast.Name)
            and f.value.id == "config" and args and isinstance(args[0], ast.Constant)
            and args[0].value in BLOCKS):
        return f"config.get({args[0].value!r})"
    if (isinstance(f, ast.Name) and f.id == "getattr" and len(args) >= 2
            and isinstance(args[0], ast.Name) and args[0].id == "config"
            and isinstance(args[1], ast.Constant) and args[1].value in BLOCKS):
        return f"getattr(config, {args[1].value!r})"
    return None


def _below_the_door():
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT)
        if relative.parts[0] not in DOOR:
            yield relative.as_posix(), ast.parse(path.read_text())


def test_no_module_below_the_jobs_reads_the_config():
    modules = list(_below_the_door())
    assert any(name.startswith("studies/") for name, _ in modules)  # the walk sees them
    reads = [f"{name}:{line} {what} in {function or 'the module'}"
             for name, tree in modules for line, what, function in _reads(tree)
             if not _is_builder(function)]
    assert not reads, "config read below the jobs (build a settings object at the door):\n" \
        + "\n".join(reads)


def test_no_module_below_the_jobs_imports_ml_collections():
    imports = [name for name, tree in _below_the_door() for node in ast.walk(tree)
               if isinstance(node, (ast.Import, ast.ImportFrom))
               and any("ml_collections" in (a.name if isinstance(node, ast.Import)
                                            else node.module or "") for a in node.names)]
    assert not imports, f"ml_collections imported below the jobs: {sorted(set(imports))}"


def test_the_walk_catches_a_read():
    tree = ast.parse("def run(config):\n    return config.rollout.n\n"
                     "class S:\n    def from_config(config):\n        return config.train\n")
    assert [(line, what, fn) for line, what, fn in _reads(tree)
            if not _is_builder(fn)] == [(2, "config.rollout", "run")]
    tree = ast.parse("def hold(config):\n    return config.get('workdir_lock'), "
                     "getattr(config, 'storage')\n")
    assert [what for _, what, _ in _reads(tree)] == ["config.get('workdir_lock')",
                                                     "getattr(config, 'storage')"]
