"""The notebooks execute without errors and print what they should (nbclient, python3 kernel)."""

from pathlib import Path

import nbformat
import pytest

nbclient = pytest.importorskip("nbclient")

NB_DIR = Path(__file__).resolve().parents[1] / "notebooks"


def _run(name):
    nb = nbformat.read(NB_DIR / name, as_version=4)
    # Committed without outputs.
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), f"{name} has outputs"
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": str(NB_DIR)}})
    client.execute()
    text = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            assert out.get("output_type") != "error", out
            if out.get("output_type") == "stream":
                text.append(out["text"])
            elif "text/plain" in out.get("data", {}):
                text.append(out["data"]["text/plain"])
    images = sum("image/png" in out.get("data", {}) for c in nb.cells for out in c.get("outputs", []))
    return "".join(text), images


def test_approximations_notebook():
    text, images = _run("approximations.ipynb")
    assert "missing tables: []" in text
    assert "gelu" in text and "ratio 1->4 bit" in text
    assert "gelu 3 bit: max |forward - F.gelu| = 0.0e+00" in text
    assert "OK approximations" in text
    assert images >= 1


def test_memory_notebook():
    text, images = _run("memory.ipynb")
    assert "gpt2  fewbit+quant" in text and "bert  vanilla" in text
    assert "largest modules:" in text
    assert "| fewbit3 | 1 |" in text
    assert "OK memory" in text
    assert images >= 1
