"""launch/colab_tpu.ipynb: its install cell against a source archive of this checkout (default
suite), and the whole notebook on CPU with the smoke model and LoRA (slow)."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

from jaxprefix.rl.metrics import read_metrics

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")

REPO = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "launch" / "colab_tpu.ipynb"


@pytest.fixture(scope="module")
def archive(tmp_path_factory):
    """The source archive a user uploads: `python -m build --sdist` of this checkout."""
    pytest.importorskip("build")
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir",
                    str(out), str(REPO)], check=True, capture_output=True, timeout=600)
    [path] = out.glob("jaxprefix-*.tar.gz")
    return path


def run_cells(tmp_path, monkeypatch, archive, count=None, **env):
    """Executes the first `count` code cells (all by default) in a fresh kernel; returns the
    notebook with its outputs. The install goes into tmp_path/site, without dependencies (they
    are this environment's), built with this environment's setuptools."""
    monkeypatch.setenv("JAXPREFIX_ARCHIVE", str(archive))
    monkeypatch.setenv("JAXPREFIX_TARGET", str(tmp_path / "site"))
    monkeypatch.setenv("JAXPREFIX_PIP_ARGS", "--no-deps --no-build-isolation")
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    for key, value in env.items():
        monkeypatch.setenv(f"JAXPREFIX_{key}", value)
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    if count is not None:
        code = [i for i, cell in enumerate(notebook.cells) if cell.cell_type == "code"]
        notebook.cells = notebook.cells[:code[count - 1] + 1]
    nbclient.NotebookClient(notebook, timeout=1200, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    return notebook


def stream_text(notebook) -> str:
    return "".join(o.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                   for o in cell.get("outputs", []))


def test_install_cell_installs_the_uploaded_archive_and_its_configs(tmp_path, monkeypatch,
                                                                    archive):
    notebook = run_cells(tmp_path, monkeypatch, archive, count=2, MODEL="")
    site = tmp_path / "site"
    # The child process imports the installed copy, not this checkout.
    assert f"{site}/jaxprefix/__init__.py" in stream_text(notebook)
    assert (site / "jaxprefix" / "models" / "lora.py").exists()
    unpacked = archive.parent / archive.name.removesuffix(".tar.gz")
    assert (unpacked / "configs" / "pope.py").exists() and not (unpacked / "jaxprefix").exists()


@pytest.mark.slow
def test_notebook_runs_top_to_bottom_on_cpu_with_lora(tmp_path, monkeypatch, archive):
    workdir = tmp_path / "run"
    notebook = run_cells(tmp_path, monkeypatch, archive, MODEL="", WORKDIR=str(workdir),
                         CONFIG="configs/pope.py:smoke", OVERRIDES="--config.train.lora_rank=8")
    records = read_metrics(str(workdir))
    assert [r["step"] for r in records if "reward/mean" in r]  # the run trained and logged
    images = [o for cell in notebook.cells if cell.cell_type == "code"
              for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) == 1  # the curves
    adapter = workdir / "export" / "adapter"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(adapter))
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 8
    assert (workdir / "export" / "config.json").exists()  # the merged model beside it
    assert "export/adapter/adapter_model.safetensors" in stream_text(notebook)
