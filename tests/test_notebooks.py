"""The notebooks execute without errors, print what they should and nothing on stderr
(nbclient, python3 kernel, run from notebooks/ as Jupyter does); they are tracked, not ignored."""

import subprocess
from pathlib import Path

import nbformat
import pytest

nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parents[1]
NB_DIR = ROOT / "notebooks"


def _run(name):
    nb = nbformat.read(NB_DIR / name, as_version=4)
    # Committed without outputs.
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), f"{name} has outputs"
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": str(NB_DIR)}})
    client.execute()
    text, err = [], []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            assert out.get("output_type") != "error", out
            if out.get("output_type") == "stream":
                (err if out.get("name") == "stderr" else text).append(out["text"])
            elif "text/plain" in out.get("data", {}):
                text.append(out["data"]["text/plain"])
    # nothing on stderr: no warnings (e.g. tqdm's "IProgress not found"), no progress bars
    assert not err, "".join(err)
    images = sum("image/png" in out.get("data", {}) for c in nb.cells for out in c.get("outputs", []))
    return "".join(text), images


def test_approximations_notebook():
    text, images = _run("approximations.ipynb")
    assert "missing tables: []" in text
    assert "gelu" in text and "ratio 1->4 bit" in text
    # every row of the error table: a name, four numbers and a ratio, separated by spaces
    header = next(i for i, ln in enumerate(text.splitlines()) if "ratio 1->4 bit" in ln)
    rows = text.splitlines()[header + 1:header + 7]
    assert [r.split()[0] for r in rows] == ["gelu", "silu", "mish", "elu", "tanh", "sigmoid"], rows
    for row in rows:
        cells = row.split()
        assert len(cells) == 6, row
        errs = [float(c) for c in cells[1:5]]
        assert cells[5].endswith("x") and float(cells[5][:-1]) == pytest.approx(errs[0] / errs[3], rel=1e-2)
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


def test_notebooks_are_tracked_and_not_ignored():
    tracked = subprocess.run(["git", "ls-files", "notebooks"], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")
    names = set(tracked.stdout.split())
    assert {"notebooks/approximations.ipynb", "notebooks/memory.ipynb"} <= names
    # --no-index: would a fresh clone's .gitignore ignore them (e.g. after `git rm --cached`)?
    ignored = subprocess.run(["git", "check-ignore", "--no-index", *sorted(names)], cwd=ROOT,
                             capture_output=True, text=True)
    assert ignored.stdout == "", f"tracked notebook files matched by .gitignore:\n{ignored.stdout}"
