"""The tutorial notebooks run top to bottom on 8 simulated CPU devices (their first cell
sets the devices up) in a fresh kernel of this interpreter."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
NOT_RUN = {
    ("06_long_context_and_moe.ipynb", "from jaxpar.planner import plan"):
        "docs/guides/long-context-moe.md runs the same two searches (jaxpar plan) and "
        "checks what they print",
}
"""Cells not executed here, by notebook and first line, each with the test that runs the
same thing; nothing later in the notebook uses what they define."""


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory):
    """A ``python3`` kernelspec that starts this very interpreter, found via JUPYTER_PATH."""
    root = tmp_path_factory.mktemp("jupyter")
    spec = root / "kernels" / "python3"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "jaxpar test kernel", "language": "python",
    }))
    return root


def test_every_notebook_is_committed_without_outputs():
    assert {p.name for p in NOTEBOOKS} >= {"01_rules_and_meshes.ipynb", "02_planning.ipynb",
                                           "03_pipeline_schedules.ipynb",
                                           "04_bring_your_own_model.ipynb",
                                           "05_finetune_hf.ipynb",
                                           "06_long_context_and_moe.ipynb"}
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        first = nb.cells[1] if nb.cells[0].cell_type == "markdown" else nb.cells[0]
        assert "jax_num_cpu_devices" in first.source, path.name
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, path.name


def test_committed_notebooks_are_what_the_generators_make(monkeypatch):
    """The ``.ipynb`` files are generated (``notebooks/make_notebooks.py``): an edit made
    to one without its generator, or the other way round, fails here."""
    monkeypatch.syspath_prepend(str(ROOT / "notebooks"))
    import make_notebooks

    assert set(make_notebooks.NOTEBOOKS) == {p.name for p in NOTEBOOKS}
    for name, cells in make_notebooks.NOTEBOOKS.items():
        want = make_notebooks.build(cells)
        have = nbformat.read(ROOT / "notebooks" / name, as_version=4)
        assert [(c.cell_type, c.source) for c in have.cells] == [
            (c.cell_type, c.source) for c in want.cells], (
            f"{name} differs from its generator: run python notebooks/make_notebooks.py")


def test_the_cells_not_run_are_few_and_found():
    """Each entry of :data:`NOT_RUN` names a code cell that exists (and is the last of its
    notebook, so no later cell needs it) and the test that covers it instead."""
    for (name, first), why in NOT_RUN.items():
        code = [c for c in nbformat.read(ROOT / "notebooks" / name, as_version=4).cells
                if c.cell_type == "code"]
        assert code[-1].source.split("\n", 1)[0] == first, (name, first)
        assert (ROOT / why.split()[0]).is_file(), why
    assert len(NOT_RUN) <= 2


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, kernel_env, monkeypatch):
    monkeypatch.setenv("JUPYTER_PATH", str(kernel_env))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:  # nbclient skips cells tagged "skip-execution"
        if (path.name, cell.source.split("\n", 1)[0]) in NOT_RUN:
            cell.metadata.setdefault("tags", []).append("skip-execution")
    # Started in the notebook's own folder, as Jupyter starts it (jaxpar installed).
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=300,
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    text = "".join(out.get("text", "") for cell in nb.cells if cell.cell_type == "code"
                   for out in cell.outputs)
    assert "8 devices" in text
