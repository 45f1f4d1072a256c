"""docs/ARCHITECTURE.md's Layout is the tree's: generated from module docstrings (docs/layout.py)."""
import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _layout_script():
    spec = importlib.util.spec_from_file_location("docs_layout", ROOT / "docs" / "layout.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_map_lists_every_module_with_its_docstring(capsys):
    assert _layout_script().main(["--check"]) == 0, capsys.readouterr().out


def test_a_module_added_or_renamed_makes_the_map_stale(tmp_path, monkeypatch):
    layout = _layout_script()
    package = tmp_path / "jaxprefix"
    package.mkdir()
    (package / "fresh.py").write_text('"""A module nobody mapped. More text."""\n')
    monkeypatch.setattr(layout, "ROOT", tmp_path)
    monkeypatch.setattr(layout, "FOLDERS", ("jaxprefix",))
    text = f"# map\n{layout.BEGIN}\nold\n{layout.END}\nrest\n"
    assert "  fresh.py              A module nobody mapped." in layout.with_layout(text)
    assert layout.with_layout(text).endswith(f"{layout.END}\nrest\n")
