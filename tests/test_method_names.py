"""No line of the library switches on a method's name: what a method changes is declared on its
MethodSpec (methods/method_spec.py) and read from there, so a new method plugs in unnoticed.

The paper studies still inside the package (issue 69 moves them beside it, studies/) compare
their arms by method on purpose: they are listed, and must exist while they are."""
import ast
import pathlib

import jaxprefix
from jaxprefix.methods.registry import method_names

ROOT = pathlib.Path(jaxprefix.__file__).parent
STUDY_MODULES = {"jobs/results.py", "run_setup/study_settings.py"}


def _names(node) -> str:
    """The dotted text of a name, attribute or subscript's value (`RUNS[x].method`: 'RUNS.method')."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_names(node.value)}.{node.attr}"
    if isinstance(node, ast.Subscript):
        return _names(node.value)
    return ""


def method_name_comparisons(tree: ast.AST, methods: set[str]) -> list[int]:
    """Lines comparing something called method (or a method's .name) with a method's name."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        constants = set()
        for side in sides:
            values = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
            constants |= {v.value for v in values if isinstance(v, ast.Constant)}
        named = [_names(s) for s in sides]
        if constants & methods and any("method" in n.lower() for n in named):
            lines.append(node.lineno)
    return lines


def test_no_library_line_compares_a_method_with_its_name():
    methods = set(method_names())
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        relative = str(path.relative_to(ROOT))
        if relative in STUDY_MODULES:
            continue
        found += [f"{relative}:{line}" for line in
                  method_name_comparisons(ast.parse(path.read_text()), methods)]
    assert not found, ("a method's name switched on (declare it on MethodSpec instead):\n"
                       + "\n".join(found))
    assert all((ROOT / m).exists() for m in STUDY_MODULES), "a listed study module moved: unlist it"


def test_the_check_sees_the_forms_a_comparison_takes():
    source = ('if method.name != "grpo": pass\n'
              'if RUNS[name].method == "pope": pass\n'
              'if config.method in ("pope", "prefixrl"): pass\n'
              'if mode == "grpo": pass\n')  # an advantage mode, not a method: not flagged
    assert method_name_comparisons(ast.parse(source), {"grpo", "pope", "prefixrl"}) == [1, 2, 3]
