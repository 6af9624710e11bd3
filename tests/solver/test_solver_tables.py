"""Shipped tables (tables/*.json) are what scripts/build_tables.py and the solver produce now.

The full regeneration (every function) runs in `python scripts/build_tables.py --check`
(about 20 s); here a representative subset is refitted: gelu (plain), sigmoid (mirrored),
selu (jump in f'), relu (exact stepwise). Every file is checked for layout and error.
"""

import importlib.util
import shutil
from pathlib import Path

import pytest

from fewbit import activations
from fewbit.solver import approximation_error
from fewbit.table import load_shipped, read_tables, shipped_table_files, table_filename

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def build_tables():
    spec = importlib.util.spec_from_file_location("build_tables", ROOT / "scripts" / "build_tables.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_function_has_a_shipped_file():
    files = shipped_table_files()
    for name, act in activations.ACTIVATIONS.items():
        assert table_filename(name) in files, name
        tabs = load_shipped(name)
        assert sorted(tabs) == ([1] if act.stepwise else [1, 2, 3, 4])
        for b, t in tabs.items():
            assert t.name == name and t.params == {} and t.domain == (-10.0, 10.0)
            assert t.symmetric == (act.even and not act.stepwise)
            assert t.provenance["command"] == "python scripts/build_tables.py" or act.stepwise


@pytest.mark.parametrize("name", sorted(activations.ACTIVATIONS))
def test_shipped_error_field_is_the_exact_error(name):
    for t in load_shipped(name).values():
        assert approximation_error(t) == pytest.approx(t.error, rel=1e-10, abs=1e-15)


@pytest.mark.parametrize("name", ["gelu", "sigmoid", "selu", "relu"])
def test_shipped_tables_equal_a_fresh_fit(build_tables, name):
    fresh = build_tables.build(name)
    shipped = read_tables(ROOT / "tables" / table_filename(name))
    assert build_tables.compare(shipped, fresh) == []


def test_check_mode_detects_a_difference(build_tables, tmp_path, capsys):
    for name in ("relu", "leaky_relu"):
        shutil.copy(ROOT / "tables" / table_filename(name), tmp_path)
    assert build_tables.main(["--check", "--only", "relu", "leaky_relu", "--out", str(tmp_path)]) == 0
    path = tmp_path / table_filename("leaky_relu")
    path.write_text(path.read_text().replace("0.01", "0.02"))
    assert build_tables.main(["--check", "--only", "relu", "leaky_relu", "--out", str(tmp_path)]) == 1
    assert "leaky_relu" in capsys.readouterr().err
