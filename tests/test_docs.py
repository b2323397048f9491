"""The README's usage example and the notebooks run as written (so the documentation cannot rot)."""

import json
import pathlib
import re

import matplotlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_readme_usage_runs():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    assert blocks, "README has no python example"
    namespace = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)
    assert namespace["out"].shape == namespace["q"].shape


def test_notebooks_run():
    matplotlib.use("Agg")
    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    assert notebooks, "no notebooks found"
    for path in notebooks:
        cells = json.loads(path.read_text())["cells"]
        code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        namespace = {}
        exec(compile(code, str(path), "exec"), namespace)
