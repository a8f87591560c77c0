"""The notebooks run top to bottom on the CPU in a fresh kernel, and are committed without outputs.

The kernel gets the environment without TRITON_INTERPRET (which kernels_triton has set in the tests'
process, having found no GPU), so a notebook gets the interpreter as a user's fresh kernel would: from
kernels_triton's own choice when it is first imported.
"""
import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
from nbclient.exceptions import CellExecutionError  # noqa: E402
from nbformat.v4 import new_code_cell, new_notebook  # noqa: E402

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
NAMES = ["01_cache_tour.ipynb", "02_hit_rates.ipynb", "03_figures.ipynb"]


def execute(nb, cwd: Path) -> None:
    """Run every cell in a fresh python3 kernel; raises CellExecutionError when a cell raises."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": str(cwd)}})
    client.execute(env=env)


def test_the_notebooks_are_there():
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_committed_without_outputs(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code and all(not cell.outputs and cell.execution_count is None for cell in code)


@pytest.mark.parametrize("name", NAMES)
def test_runs_top_to_bottom(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    execute(nb, NOTEBOOKS)
    outputs = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs]
    assert not [out for out in outputs if out.output_type == "error"]
    if name == "03_figures.ipynb":  # the committed policy study is drawn as images
        assert any("image/png" in out.get("data", {}) for out in outputs)


def test_a_raising_cell_fails_the_run(tmp_path):
    nb = new_notebook(cells=[new_code_cell("x = 1"), new_code_cell("raise ValueError('boom')"),
                             new_code_cell("x = 2")])
    with pytest.raises(CellExecutionError, match="boom"):
        execute(nb, tmp_path)
