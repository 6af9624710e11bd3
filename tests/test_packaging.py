"""Packaging: ``import fewbit`` stays lean, and a built wheel installs and runs on its own.

The wheel is built from a copy of the tracked files (``git ls-files``) so that the repository
gets no build/ or *.egg-info; it is installed into a throw-away venv and run from a directory
outside the repository. The throw-away venv gets its dependencies (torch, numba, ...) from the
environment that runs the tests -- a plain venv as the README makes, or a system interpreter --
through a ``.pth`` file listing that environment's site-packages. A ``.pth`` line only adds a
directory to ``sys.path``: the ``.pth`` files inside it (an editable install's finder among
them) are not processed, so the checkout cannot be what gets imported.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONNOUSERSITE"] = "1"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env["PIP_NO_INPUT"] = "1"
    return env


def _run(cmd, cwd, timeout=300) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=_clean_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


def test_lean_import(tmp_path):
    code = (
        "import sys\n"
        "import fewbit\n"
        "fewbit.GELU; fewbit.functional; fewbit.convert_; fewbit.compress_activations\n"
        "import fewbit.cli\n"
        "import torch\n"
        "heavy = [m for m in ('numba', 'scipy', 'triton', 'matplotlib', 'fewbit.solver') if m in sys.modules]\n"
        "print('heavy:', heavy)\n"
        "print('cuda:', torch.cuda.is_initialized())\n"
    )
    proc = _run([sys.executable, "-c", code], cwd=tmp_path)
    lines = proc.stdout.splitlines()
    assert "heavy: []" in lines, proc.stdout
    assert "cuda: False" in lines, proc.stdout


@pytest.fixture(scope="module")
def repo_copy(tmp_path_factory) -> Path:
    """The tracked files of the repository, copied (the build writes build/ and *.egg-info there)."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    dst = tmp_path_factory.mktemp("src") / "fewbit-src"
    for rel in filter(None, files.decode().split("\0")):
        src = REPO / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)
    return dst


def _dependency_dirs() -> list[str]:
    """Site-packages of the running environment (venv and, if it sees them, the system's)."""
    dirs = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages()]
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    out = []
    for d in dirs:
        p = Path(d).resolve()
        if p.is_dir() and REPO not in p.parents and p != REPO and str(p) not in out:
            out.append(str(p))
    return out


def test_wheel_installs_and_runs(repo_copy, tmp_path):
    before = {p.name for p in REPO.iterdir()}
    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", wheels, repo_copy],
         cwd=tmp_path)
    (wheel,) = wheels.glob("fewbit-*.whl")
    # The repository is left as it was: no build/ or *.egg-info.
    after = {p.name for p in REPO.iterdir()}
    assert not {n for n in after - before if n == "build" or n.endswith(".egg-info")}

    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    assert "fewbit/cli.py" in names and "fewbit/solver/fit.py" in names and "fewbit/tables/gelu.json" in names

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv], cwd=tmp_path)
    py, exe = venv / "bin" / "python", venv / "bin" / "fewbit"
    purelib = _run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp_path).stdout.strip()
    (Path(purelib) / "_fewbit_test_deps.pth").write_text("\n".join(_dependency_dirs()) + "\n")
    # --ignore-installed: the running environment's fewbit (seen through the .pth) is neither
    # uninstalled nor taken as already satisfying the wheel.
    _run([py, "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", "-q", wheel], cwd=tmp_path)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = _run([exe, "list"], cwd=elsewhere)
    gelu = [ln for ln in proc.stdout.splitlines() if ln.split()[:1] == ["gelu"]]
    assert len(gelu) == 1 and "e-0" in gelu[0], proc.stdout

    proc = _run([py, "-c", "import torch, numba, fewbit, fewbit.tables, fewbit.solver; print(fewbit.__file__); "
                 "print(fewbit.tables.__file__); print(fewbit.solver.__file__)"], cwd=elsewhere)
    site = venv.resolve()
    paths = [Path(p).resolve() for p in proc.stdout.split()]
    assert len(paths) == 3
    for p in paths:
        assert site in p.parents, (p, proc.stdout)  # not the editable install in the repository


def test_cli_imports_user_function_from_current_directory(tmp_path):
    """``fewbit fit mypkg.acts:my_act`` run from the folder holding ``mypkg/`` finds it, as
    ``python -m`` would, without ``PYTHONPATH=.``.

    ``python -I -c`` puts neither the current directory nor PYTHONPATH on ``sys.path``:
    exactly what the ``fewbit`` console script sees (its own ``bin/`` instead).
    """
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "acts.py").write_text(
        "import torch\n\n\ndef my_act(x):\n    return x * torch.sigmoid(1.5 * x)\n")
    proc = subprocess.run(
        [sys.executable, "-I", "-c", "from fewbit.cli import main; main()",
         "fit", "mypkg.acts:my_act", "--bits", "1", "--grid", "200", "--no-progress", "-o", "my_act.json"],
        cwd=tmp_path, env=_clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "No module named" not in proc.stderr
    assert json.loads((tmp_path / "my_act.json").read_text())["name"] == "mypkg.acts:my_act"


def test_documented_submodules_reachable_from_a_fresh_import():
    """The README writes ``fewbit.convert.compressor_of(model)`` and
    ``fewbit.ops.load_cpu_kernels()``: in a fresh process ``fewbit.convert`` raised
    AttributeError until something else had imported it."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    names = sorted(set(re.findall(r"\bfewbit\.([a-z_]+)\.[A-Za-z_]+", readme)))
    assert "convert" in names and "ops" in names
    code = "import fewbit\n" + "".join(f"fewbit.{n}\n" for n in names)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
