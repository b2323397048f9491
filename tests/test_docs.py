"""The README's usage example and the notebooks run as written (so the documentation cannot rot)."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_readme_usage_runs():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    assert blocks, "README has no python example"
    namespace = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)
    assert namespace["out"].shape == namespace["q"].shape


NOTEBOOKS = ["01_quickstart.ipynb", "02_prototype_attention.ipynb", "03_focus_retrofit.ipynb"]


def test_every_notebook_is_tested():
    assert sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb")) == sorted(NOTEBOOKS)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_headless(name, tmp_path, monkeypatch):
    """Each notebook executes top to bottom in a fresh Jupyter kernel (nbclient), at the small sizes its
    FOCAL_JAX_NOTEBOOK_SMALL switch selects; a cell that raises fails the test with the cell's traceback."""
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("FOCAL_JAX_NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    notebook = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    assert "pip" in "".join(notebook.cells[1].source), "the first code cell installs the package (Colab)"
    NotebookClient(notebook, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
