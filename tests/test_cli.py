"""The ``fewbit`` command line (fewbit/cli.py), run in-process with click's CliRunner.

Happy paths check the printed numbers against the shipped tables and the solver; bad input
must give a non-zero exit, exactly one line of error, no traceback and no file written
(an existing output file stays untouched). Fits are tiny (``--grid 300``).
"""

from __future__ import annotations

import json
import re
import textwrap
import uuid
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from fewbit import __version__
from fewbit.cli import cli
from fewbit.table import load_shipped, read_tables, shipped_table_files

GRID = "300"
# An error cell: 4 significant digits in scientific notation (or "0" for an exact table).
ERR4 = re.compile(r"^(?:\d\.\d{3}e[+-]\d{2}|0)$")


def run(*args: str):
    return CliRunner().invoke(cli, [str(a) for a in args], prog_name="fewbit")


def fmt4(x: float) -> str:
    return "0" if x == 0 else f"{x:.3e}"


def assert_one_line_error(result, *needles: str) -> str:
    """Non-zero exit, no traceback, exactly one non-empty line on stderr (and none on stdout)."""
    assert result.exit_code != 0, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: "), lines[0]
    assert result.stdout.strip() == "", result.stdout
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def table_rows(stdout: str) -> dict[str, list[str]]:
    """Rows of a rendered text table (after the ``---`` separator), keyed by first cell."""
    lines = stdout.splitlines()
    sep = next(i for i, ln in enumerate(lines) if ln.startswith("---"))
    rows = {}
    for ln in lines[sep + 1:]:
        cells = ln.split()
        if not cells or ln.startswith(("error =", "wrote ")) or re.match(r"\d+ tables;", ln):
            break
        rows[cells[0]] = cells[1:]
    return rows


@pytest.fixture(autouse=True)
def user_cache(tmp_path_factory, monkeypatch):
    """An empty user table cache of its own for every test (never the user's real one)."""
    import fewbit.functional as FF

    path = tmp_path_factory.mktemp("cache")
    monkeypatch.setenv("FEWBIT_CACHE_DIR", str(path))
    monkeypatch.setitem(FF.FIT_OPTIONS, "grid", 300)
    FF.clear_table_cache()
    yield path / "tables"
    FF.clear_table_cache()


@pytest.fixture
def usermod(tmp_path, monkeypatch):
    """Write a helper module into tmp_path (on sys.path); returns its unique module name."""

    def make(source: str) -> str:
        name = f"fewbit_cli_user_{uuid.uuid4().hex[:10]}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        monkeypatch.syspath_prepend(str(tmp_path))
        return name

    return make


# ---------------------------------------------------------------------------------------
# Happy paths
# ---------------------------------------------------------------------------------------


def test_version_and_help():
    r = run("--version")
    assert r.exit_code == 0
    assert r.stdout.strip() == f"fewbit {__version__}"
    r = run("--help")
    assert r.exit_code == 0
    for cmd in ("fit", "error", "plot", "list", "memory"):
        assert re.search(rf"^\s+{cmd}\s", r.stdout, re.M), cmd
    r = run("fit", "--help")
    assert r.exit_code == 0 and "torch" in r.stdout and "numpy function" not in r.stdout


def test_list_shows_shipped_tables_with_errors():
    r = run("list")
    assert r.exit_code == 0, r.output
    rows = table_rows(r.stdout)
    assert len(rows) == len(shipped_table_files())
    gelu = load_shipped("gelu")
    cells = rows["gelu"]
    # function, params, domain (2 cells), weight, sym, then one cell per bit width 1..8 present
    errs = cells[-len(gelu):] if len(cells) >= 5 + len(gelu) else None
    assert errs == [fmt4(gelu[b].error) for b in sorted(gelu)]
    assert all(ERR4.match(c) for c in errs)
    assert rows["relu"][-1] == "0"  # exact stepwise table (1 bit only)
    assert "tables; error = integral" in r.stdout


def test_error_table_4_significant_digits_matches_shipped():
    names = ["gelu", "silu", "sigmoid", "tanh"]
    r = run("error", *names, "--bits", "1", "2", "3", "4")
    assert r.exit_code == 0, r.output
    header = r.stdout.splitlines()[0].split()
    assert header == ["function", "1", "bit", "2", "bits", "3", "bits", "4", "bits"]
    rows = table_rows(r.stdout)
    assert list(rows) == names
    for name in names:
        shipped = load_shipped(name)
        assert rows[name] == [fmt4(shipped[b].error) for b in (1, 2, 3, 4)]
        assert all(ERR4.match(c) and c != "0" for c in rows[name])


def test_error_json_structure_and_values():
    r = run("error", "gelu", "silu", "relu", "--bits", "1", "2", "3", "4", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert list(data) == ["gelu", "silu", "relu"]
    for name in ("gelu", "silu"):
        shipped = load_shipped(name)
        assert data[name] == {str(b): shipped[b].error for b in (1, 2, 3, 4)}
    # ReLU' is a step: the exact 1-bit table serves every width with error 0.
    assert data["relu"] == {"1": 0.0, "2": 0.0, "3": 0.0, "4": 0.0}


@pytest.mark.parametrize(
    "bits_args, expected",
    [
        (["--bits", "1", "2", "3"], ["1", "2", "3"]),
        (["--bits", "1,2,3"], ["1", "2", "3"]),
        (["--bits", "3", "--bits", "1"], ["1", "3"]),
        (["-b", "2"], ["2"]),
        ([], ["1", "2", "3", "4"]),
    ],
)
def test_bits_parsing(bits_args, expected):
    r = run("error", *bits_args, "gelu", "--json")  # NAME after the bits: not taken as a width
    assert r.exit_code == 0, r.output
    assert list(json.loads(r.stdout)["gelu"]) == expected


def test_error_domain_recomputes_the_integral():
    full = json.loads(run("error", "gelu", "--bits", "2", "--json", "--domain", "-10", "10").stdout)["gelu"]["2"]
    assert full == load_shipped("gelu")[2].error
    part = json.loads(run("error", "gelu", "--bits", "2", "--json", "--domain", "-2", "2").stdout)["gelu"]["2"]
    # the integrand (f' - q)^2 is >= 0 and not 0 outside [-2, 2]
    assert 0 < part < full


def test_error_refit_close_to_shipped():
    r = run("error", "silu", "--refit", "--grid", GRID, "--bits", "1", "2", "--json", "--no-progress")
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)["silu"]
    shipped = load_shipped("silu")
    for b in (1, 2):
        assert got[str(b)] == pytest.approx(shipped[b].error, rel=2e-3)


def test_fit_writes_loadable_tables(tmp_path):
    out = tmp_path / "gelu.json"
    r = run("fit", "gelu", "--bits", "1", "2", "--grid", GRID, "-o", out, "--no-progress")
    assert r.exit_code == 0, r.output
    tables = read_tables(out)
    assert sorted(tables) == [1, 2]
    for b, t in tables.items():
        assert t.name == "gelu" and t.bits == b and len(t.values) == 2**b
        assert t.provenance["grid"] == int(GRID)
        assert t.error == pytest.approx(load_shipped("gelu")[b].error, rel=2e-3)
    rows = table_rows(r.stdout)
    assert rows["1"][0] == fmt4(tables[1].error) and rows["2"][0] == fmt4(tables[2].error)
    assert f"wrote {out}" in r.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gelu.json"]  # no temporary left


def test_fit_options_reach_the_solver(tmp_path):
    out = tmp_path / "elu.json"
    r = run("fit", "elu", "--bits", "1", "--grid", GRID, "--domain", "-4", "4", "--weight", "normal:2",
            "--no-symmetric", "--param", "alpha=0.5", "-o", out, "--no-progress")
    assert r.exit_code == 0, r.output
    (t,) = read_tables(out).values()
    assert t.params == {"alpha": 0.5}
    assert tuple(t.domain) == (-4.0, 4.0)
    assert t.weight == "normal:2" or t.weight.startswith("normal:2")
    assert t.symmetric is False


def test_fit_shows_progress_bar(tmp_path):
    r = run("fit", "tanh", "--bits", "1", "--grid", GRID, "-o", tmp_path / "t.json")
    assert r.exit_code == 0, r.output
    assert "fit tanh" in r.stderr and "100%" in r.stderr


def test_fit_user_function_matches_registry(tmp_path, usermod):
    mod = usermod("""
        import torch

        def my_silu(x):
            return x * torch.sigmoid(x)
    """)
    out = tmp_path / "u.json"
    r = run("fit", f"{mod}:my_silu", "--bits", "1", "2", "--grid", GRID, "-o", out, "--no-progress")
    assert r.exit_code == 0, r.output
    tables = read_tables(out)
    shipped = load_shipped("silu")
    for b in (1, 2):
        assert tables[b].name == f"{mod}:my_silu"
        assert tables[b].error == pytest.approx(shipped[b].error, rel=2e-3)


def test_fit_force_overwrites(tmp_path):
    out = tmp_path / "g.json"
    out.write_text("old")
    r = run("fit", "gelu", "--bits", "1", "--grid", GRID, "-o", out, "--force", "--no-progress")
    assert r.exit_code == 0, r.output
    assert sorted(read_tables(out)) == [1]


def _png_checks(path: Path) -> None:
    import matplotlib.image as mpimg
    import numpy as np

    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 20_000
    img = mpimg.imread(path)
    assert img.shape[0] > 400 and img.shape[1] > 400
    colours = np.unique((img[..., :3] * 255).astype(np.uint8).reshape(-1, 3), axis=0)
    assert len(colours) > 50  # curves, text and anti-aliasing, not a blank canvas


def test_plot_shipped(tmp_path):
    out = tmp_path / "gelu.png"
    r = run("plot", "gelu", "--bits", "1", "2", "3", "-o", out)
    assert r.exit_code == 0, r.output
    _png_checks(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gelu.png"]


@pytest.mark.parametrize("name", ["gelu_new", "gelu_fast"])
def test_plot_and_error_of_a_hugging_face_formula(tmp_path, name):
    """A formula name stands for the function whose tables it uses (gelu_tanh)."""
    out = tmp_path / "f.png"
    r = run("plot", name, "--bits", "2", "3", "-o", out)
    assert r.exit_code == 0, r.output
    _png_checks(out)
    r = run("error", name, "--bits", "2", "3", "--json")
    assert r.exit_code == 0, r.output
    shipped = load_shipped("gelu_tanh")
    assert json.loads(r.stdout) == {name: {"2": shipped[2].error, "3": shipped[3].error}}


def test_plot_writes_the_format_of_its_suffix_and_refuses_others(tmp_path):
    """``-o plot.txt`` and ``-o plot.pdf`` held PNG data."""
    for name, magic in (("g.pdf", b"%PDF"), ("g.svg", b"<?xml"), ("g.png", b"\x89PNG")):
        r = CliRunner().invoke(cli, ["plot", "gelu", "--bits", "2", "-o", str(tmp_path / name)])
        assert r.exit_code == 0, r.output
        assert (tmp_path / name).read_bytes().startswith(magic)
    r = CliRunner().invoke(cli, ["plot", "gelu", "-o", str(tmp_path / "g.txt")])
    assert r.exit_code == 2 and ".txt is not an image format" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "g.txt").exists()


def test_outputs_write_through_symbolic_links(tmp_path):
    """``-o link -f`` replaced the link by a regular file, and a dangling link was replaced
    without ``-f``. The link's target is written, the link stays, and a dangling link is an
    existing output."""
    target, link = tmp_path / "target.png", tmp_path / "link.png"
    link.symlink_to(target)  # dangling
    r = CliRunner().invoke(cli, ["plot", "gelu", "--bits", "2", "-o", str(link)])
    assert r.exit_code == 1 and "exists; pass --force" in r.output and not target.exists()
    r = CliRunner().invoke(cli, ["plot", "gelu", "--bits", "2", "-o", str(link), "-f"])
    assert r.exit_code == 0, r.output
    assert link.is_symlink() and target.read_bytes().startswith(b"\x89PNG")


def test_plot_fitted_table(tmp_path):
    tj = tmp_path / "t.json"
    assert run("fit", "silu", "--bits", "1", "2", "--grid", GRID, "-o", tj, "--no-progress").exit_code == 0
    out = tmp_path / "silu.png"
    r = run("plot", "silu", "--table", tj, "-o", out)
    assert r.exit_code == 0, r.output
    _png_checks(out)


# ---------------------------------------------------------------------------------------
# Bad input: one line, non-zero exit, no traceback, nothing written
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("cmd", ["fit", "error", "plot"])
def test_unknown_name_suggests_close_matches(cmd, tmp_path):
    r = run(cmd, "gelux", "-o" if cmd != "error" else "--json", *([tmp_path / "o"] if cmd != "error" else []))
    line = assert_one_line_error(r, "gelux", "did you mean", "'gelu'")
    assert "'elu'" in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("cmd", ["fit", "error", "plot"])
@pytest.mark.parametrize("bits", [["0"], ["9"], ["1", "9"], ["1,0"], ["-1"], ["x"], ["2.5"]])
def test_bits_out_of_range(cmd, bits, tmp_path):
    extra = ["-o", tmp_path / "o"] if cmd != "error" else []
    r = run(cmd, "gelu", "--bits", *bits, *extra)
    assert_one_line_error(r, "--bits", "1..8")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("cmd", ["fit", "error"])
@pytest.mark.parametrize("domain, needle", [
    (["1", "1"], "A < B"), (["2", "-1"], "A < B"), (["0", "inf"], "finite"),
    (["nan", "1"], "finite"), (["-inf", "0"], "finite"), (["a", "1"], "--domain"),
])
def test_bad_domain(cmd, domain, needle, tmp_path):
    extra = ["-o", tmp_path / "o"] if cmd == "fit" else []
    r = run(cmd, "gelu", "--domain", *domain, *extra)
    assert_one_line_error(r, "--domain", needle)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("grid_args, needle", [
    (["--bits", "4", "--grid", "8"], "2**bits = 16"),
    (["--bits", "1", "2", "3", "--grid", "5"], "2**bits = 8"),
    (["--grid", "1"], "--grid"),
    (["--grid", "many"], "--grid"),
])
def test_grid_too_small(grid_args, needle, tmp_path):
    r = run("fit", "gelu", *grid_args, "-o", tmp_path / "o.json", "--no-progress")
    assert_one_line_error(r, needle)
    assert list(tmp_path.iterdir()) == []


def test_refit_grid_too_small():
    r = run("error", "gelu", "--refit", "--bits", "3", "--grid", "4", "--no-progress")
    assert_one_line_error(r, "2**bits = 8")


@pytest.mark.parametrize("cmd", [["fit", "gelu", "-o", "o.json"], ["error", "gelu", "--refit"]])
def test_grid_too_large_is_refused_before_any_allocation(cmd, tmp_path):
    """A grid of 1e11 cells once reached numpy (a 745 GiB ``linspace``) and printed its
    traceback; the DP's O(grid**2) time caps it (fewbit.solver.MAX_GRID)."""
    from fewbit.solver import MAX_GRID

    cmd = [str(tmp_path / c) if c.endswith(".json") else c for c in cmd]
    assert_one_line_error(run(*cmd, "--grid", "100000000000", "--no-progress"), f"at most {MAX_GRID}",
                          "100000000000")
    assert list(tmp_path.iterdir()) == []


def test_domain_whose_width_overflows_is_one_line(tmp_path):
    r = run("fit", "gelu", "--domain", "-1e308", "1e308", "--grid", "300", "-o", tmp_path / "o.json")
    assert_one_line_error(r, "width", "finite")
    assert "RuntimeWarning" not in r.output


@pytest.mark.parametrize("command", [["fit", "gelu", "--bits", "1", "-o"], ["plot", "gelu", "-o"],
                                     ["plan", "--model", "gpt2", "--budget", "50%", "--output"]])
def test_output_written_as_a_directory_is_refused(tmp_path, command):
    """``-o x.json/`` wrote ``x.json`` (pathlib drops the trailing separator)."""
    r = run(*command, f"{tmp_path / 'x.json'}/")
    assert_one_line_error(r, "ends with a path separator")
    r = run(*command, f"{tmp_path / 'x.json'}/.")
    assert_one_line_error(r, "names a directory")
    r = run(*command, "")
    assert_one_line_error(r, "names a directory")
    assert list(tmp_path.iterdir()) == []


def test_error_refuses_fit_options_without_refit():
    """``fewbit error gelu --grid 5`` printed the shipped table's error as if the options
    had been used."""
    for args, needle in ((["--grid", "5"], "--grid"), (["--symmetric"], "--symmetric"),
                         (["--weight", "normal:0.1"], "--weight")):
        assert_one_line_error(run("error", "gelu", "--bits", "4", *args), needle, "only applies with --refit")
    assert_one_line_error(run("error", "gelu", "--bits", "4", "--grid", "5", "--symmetric"), "--grid",
                          "only apply with --refit")
    assert run("error", "gelu", "--bits", "4", "--weight", "uniform").exit_code == 0


def test_no_arguments_prints_the_help():
    """``fewbit`` alone printed the whole help folded into one ``Error:`` line."""
    r = run()
    assert "Error" not in r.output
    assert r.output.startswith("Usage: fewbit") and "Commands:" in r.output and len(r.output.splitlines()) > 8


@pytest.mark.parametrize("source, attr, needle", [
    ("raise RuntimeError('broken module')\n", "f", "cannot import module"),
    ("import torch\nnot_callable = 3\n", "not_callable", "not callable"),
    ("import torch\n", "missing", "no attribute 'missing'"),
    ("import torch\ndef f(x):\n    return x.sum(0, keepdim=True)\n", "f", "elementwise"),
    ("import torch\ndef f(x):\n    return torch.sqrt(x)\n", "f", "not finite"),
    ("import torch\ndef f(x):\n    raise RuntimeError('boom')\n", "f", "boom"),
    ("def f(x):\n    return [1.0]\n", "f", "torch.Tensor"),
])
def test_bad_user_function(source, attr, needle, usermod, tmp_path):
    mod = usermod(source)
    out = tmp_path / "out" / "u.json"
    out.parent.mkdir()
    r = run("fit", f"{mod}:{attr}", "--bits", "1", "--grid", GRID, "-o", out, "--no-progress")
    assert_one_line_error(r, f"{mod}:{attr}", needle)
    assert list(out.parent.iterdir()) == []


def test_user_module_not_found(tmp_path):
    r = run("fit", "no_such_pkg_fewbit.acts:f", "--grid", GRID, "-o", tmp_path / "o.json", "--no-progress")
    assert_one_line_error(r, "cannot import module", "no_such_pkg_fewbit")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("cmd", ["fit", "plot"])
def test_unwritable_output(cmd, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    adir = tmp_path / "adir"
    adir.mkdir()
    ext = ".json" if cmd == "fit" else ".png"
    for target, needle in [
        (afile / f"o{ext}", "cannot write"),            # parent is a file
        (tmp_path / "missing" / f"o{ext}", "does not exist"),
        (adir, "directory"),
    ]:
        r = run(cmd, "gelu", "--bits", "1", "-o", target, "--no-progress" if cmd == "fit" else "--force")
        assert_one_line_error(r, needle)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "afile"]
    assert afile.read_text() == "x" and list(adir.iterdir()) == []


def test_existing_output_untouched_on_error(tmp_path):
    out = tmp_path / "gelu.json"
    out.write_text("precious")
    # exists, no --force
    assert_one_line_error(run("fit", "gelu", "--bits", "1", "--grid", GRID, "-o", out), "exists", "--force")
    # --force but the fit fails (grid too small / bad user function / bad weight)
    assert_one_line_error(run("fit", "gelu", "--bits", "4", "--grid", "8", "-o", out, "--force", "--no-progress"),
                          "2**bits")
    assert_one_line_error(run("fit", "gelu", "--weight", "normal:-1", "--grid", GRID, "-o", out, "--force",
                              "--no-progress"), "sigma")
    png = tmp_path / "p.png"
    png.write_text("precious png")
    assert_one_line_error(run("plot", "gelu", "--bits", "5", "-o", png, "--force"), "bits 5")
    assert_one_line_error(run("plot", "gelu", "-o", png), "exists")
    assert out.read_text() == "precious" and png.read_text() == "precious png"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gelu.json", "p.png"]


@pytest.mark.parametrize("params, needle", [
    (["alpha"], "KEY=VALUE"),
    (["=1"], "KEY=VALUE"),
    (["alpha="], "must be a number"),
    (["alpha=x"], "must be a number"),
    (["alpha=inf"], "finite"),
    (["alpha=1", "alpha=2"], "given twice"),
    (["beta=1"], "beta"),  # ELU takes only alpha
])
def test_malformed_param(params, needle, tmp_path):
    r = run("fit", "elu", "--bits", "1", "--grid", GRID, "--param", *params, "-o", tmp_path / "o.json",
            "--no-progress")
    assert_one_line_error(r, needle)
    assert list(tmp_path.iterdir()) == []


def test_error_without_shipped_table_or_command():
    assert_one_line_error(run("error", "elu", "--param", "alpha=0.3"), "no shipped table", "--refit")
    assert_one_line_error(run("nosuchcommand"), "No such command")
    assert_one_line_error(run("error"), "NAME")


# ---------------------------------------------------------------------------------------
# Issue 13: tables the runtime cached, labelled errors, progress total, provenance,
# permissions, help texts, hostile table files
# ---------------------------------------------------------------------------------------


def _runtime_fit(name, bits, params):
    """Fit a table the way a training script does (load_table -> solver -> user cache)."""
    import fewbit.functional as FF

    with pytest.warns(FF.TableFittedWarning):
        table = FF.load_table(name, bits, params)
    FF.clear_table_cache()  # the CLI must find it on disk
    return table


def test_plot_and_error_find_the_table_the_runtime_cached(tmp_path, user_cache):
    cached = _runtime_fit("elu", 3, {"alpha": 0.5})
    path = user_cache / "elu@alpha=0.5.json"
    assert path.exists()
    out = tmp_path / "elu.png"
    r = run("plot", "elu", "--param", "alpha=0.5", "-o", out)
    assert r.exit_code == 0, r.output
    assert f"wrote {out}" in r.stdout and str(path) in r.stdout and "bits 3" in r.stdout
    _png_checks(out)
    r = run("error", "elu", "--param", "alpha=0.5", "--bits", "2", "3", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == {"elu": {"2": None, "3": cached.error}}
    assert "elu@2" in r.stderr and str(path) in r.stderr
    # what the runtime uses is what the CLI shows: shipped default, exact stepwise
    r = run("error", "elu", "relu", "--bits", "3", "--json")
    assert json.loads(r.stdout) == {"elu": {"3": load_shipped("elu")[3].error}, "relu": {"3": 0.0}}
    assert sorted(p.name for p in user_cache.glob("*.json")) == ["elu@alpha=0.5.json"]  # nothing fitted


def _suggested(line: str) -> list[list[str]]:
    import shlex

    return [shlex.split(cmd) for cmd in re.findall(r"`([^`]+)`", line)]


def test_plot_without_any_table_suggests_commands_that_work(tmp_path, monkeypatch, user_cache):
    monkeypatch.chdir(tmp_path)
    line = assert_one_line_error(run("plot", "elu", "--param", "alpha=0.5"), "elu (alpha=0.5)", str(user_cache))
    fit, plot = _suggested(line)
    assert fit[:5] == ["fewbit", "fit", "elu", "--param", "alpha=0.5"] and "--table" in plot
    r = run(*fit[1:], "--grid", GRID, "--no-progress")
    assert r.exit_code == 0, r.output
    r = run(*plot[1:])
    assert r.exit_code == 0, r.output
    _png_checks(tmp_path / "elu.png")
    # some widths asked for are missing: the suggested fit covers all of them
    _runtime_fit("elu", 3, {"alpha": 0.25})
    line = assert_one_line_error(run("plot", "elu", "--param", "alpha=0.25", "--bits", "2", "3", "-o", "x.png"),
                                 "at bits 2;")
    fit, plot = _suggested(line)
    assert fit[-3:] == ["--bits", "2", "3"] and plot[3:6] == ["--bits", "2", "3"]
    assert not user_cache.joinpath("elu@alpha=0.5.json").exists()  # plot fits nothing


def test_error_without_any_table_suggests_a_command_that_works(user_cache):
    line = assert_one_line_error(run("error", "elu", "--param", "alpha=0.5"), "no shipped table", str(user_cache))
    (cmd,) = _suggested(line)
    assert cmd == ["fewbit", "error", "elu", "--param", "alpha=0.5", "--refit"]
    r = run(*cmd[1:], "--grid", GRID, "--no-progress", "--json")
    assert r.exit_code == 0, r.output
    assert list(json.loads(r.stdout)["elu"]) == ["1", "2", "3", "4"]


def test_corrupt_cache_file_is_reported_not_used(tmp_path, user_cache):
    user_cache.mkdir(parents=True)
    bad = user_cache / "elu@alpha=0.5.json"
    bad.write_text('{"schema_version": 1, "name": "elu", "tables": null}')
    for args in (["plot", "elu", "--param", "alpha=0.5", "-o", tmp_path / "p.png"],
                 ["error", "elu", "--param", "alpha=0.5"]):
        assert_one_line_error(run(*args), str(bad), "tables must be an object, got null")
    assert bad.read_text().endswith("null}") and sorted(p.name for p in user_cache.iterdir()) == [bad.name]


def test_fit_with_a_weight_shows_the_minimised_error_labelled(tmp_path):
    out = tmp_path / "elu.json"
    r = run("fit", "elu", "--param", "alpha=0.5", "--weight", "normal:2", "--bits", "1", "2", "3", "4",
            "--grid", GRID, "-o", out, "--no-progress")
    assert r.exit_code == 0, r.output
    header = next(ln for ln in r.stdout.splitlines() if ln.startswith("bits"))
    assert "error (w = normal:2.0)" in header and "error (w = 1)" in header
    tables = read_tables(out)
    rows = table_rows(r.stdout)
    weighted = []
    for b in (1, 2, 3, 4):
        t = tables[b]
        assert rows[str(b)] == [fmt4(t.objective), fmt4(t.error), str(t.num_intervals)]
        weighted.append(t.objective)
    assert weighted == sorted(weighted, reverse=True)  # the minimised error falls with bits
    assert "the objective the fit minimised" in r.stdout and "as `fewbit error` reports it" in r.stdout


def test_fit_progress_bar_has_its_total_from_the_start(tmp_path):
    r = run("fit", "gelu", "--bits", "1", "2", "3", "4", "--grid", GRID, "-o", tmp_path / "t.json")
    assert r.exit_code == 0, r.output
    frames = re.findall(r"\| *(\d+)/(\d+) ", r.stderr)
    assert frames and frames[0][0] == "0", frames
    assert len({total for _, total in frames}) == 1, frames  # was 0/1 then 1/6 ...
    assert frames[-1][0] == frames[-1][1]


def test_fit_file_provenance_names_all_bit_widths(tmp_path):
    out = tmp_path / "t.json"
    assert run("fit", "silu", "--bits", "1", "2", "4", "--grid", GRID, "-o", out, "--no-progress").exit_code == 0
    prov = json.loads(out.read_text())["provenance"]
    assert prov["command"] == f"fewbit.solver.fit_many('silu', [1, 2, 4], grid={GRID})"
    assert all(t.provenance == prov for t in read_tables(out).values())


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_outputs_and_cache_files_follow_the_umask(tmp_path, user_cache, umask):
    import os
    import stat

    old = os.umask(umask)
    try:
        assert run("fit", "gelu", "--bits", "1", "--grid", GRID, "-o", tmp_path / "g.json",
                   "--no-progress").exit_code == 0
        assert run("plot", "gelu", "--bits", "1", "-o", tmp_path / "g.png").exit_code == 0
        _runtime_fit("elu", 1, {"alpha": 0.5})
    finally:
        os.umask(old)
    for path in (tmp_path / "g.json", tmp_path / "g.png", user_cache / "elu@alpha=0.5.json"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask, path


def _all_commands(group, prefix=()):
    for name, cmd in group.commands.items():
        yield (*prefix, name)
        if isinstance(cmd, click.Group):
            yield from _all_commands(cmd, (*prefix, name))


def test_help_texts_define_the_error_and_cite_no_file_users_lack():
    commands = [()] + list(_all_commands(cli))
    assert ("fit",) in commands and ("memory",) in commands
    for words in commands:
        r = run(*words, "--help")
        assert r.exit_code == 0, (words, r.output)
        assert "docs/" not in r.stdout and ".md" not in r.stdout, (words, r.stdout)
    for words in (("fit",), ("error",), ("plot",), ("list",)):
        text = " ".join(run(*words, "--help").stdout.split())
        assert "integral of (f'(x) - q(x))^2 dx over the" in text and "eq. 3" in text, (words, text)
    assert "weight" in " ".join(run("fit", "--help").stdout.split())


@pytest.mark.parametrize("doc_text, needle", [
    ('"tables": null', "tables must be an object, got null"),
    ('"tables": []', "tables must be an object, got []"),
    ('"symmetric": "no", "tables": {}', 'symmetric must be true or false, got "no"'),
])
def test_plot_hostile_table_file_is_one_line(tmp_path, doc_text, needle):
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": 1, "name": "gelu", ' + doc_text + "}")
    assert_one_line_error(run("plot", "gelu", "--table", bad, "-o", tmp_path / "p.png"), str(bad), needle)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json"]


def test_plot_table_file_refuses_other_params(tmp_path):
    tj = tmp_path / "elu.json"
    assert run("fit", "elu", "--param", "alpha=0.5", "--bits", "1", "--grid", GRID, "-o", tj,
               "--no-progress").exit_code == 0
    assert_one_line_error(run("plot", "elu", "--table", tj, "--param", "alpha=2", "-o", tmp_path / "p.png"),
                          "alpha=0.5", "alpha=2")
    r = run("plot", "elu", "--table", tj, "--param", "alpha=0.5", "-o", tmp_path / "p.png")
    assert r.exit_code == 0, r.output


# ---------------------------------------------------------------------------------------
# Review of 2026-11-27: output files and odd inputs
# ---------------------------------------------------------------------------------------


def test_output_that_is_not_a_regular_file_is_refused(tmp_path):
    """``-o FIFO --force`` (or ``-o /dev/null --force``) replaced the FIFO or device node by a
    regular file."""
    import os
    import stat

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for cmd in (("fit", "gelu", "--bits", "1", "--grid", "50", "--no-progress"), ("plot", "gelu", "--bits", "1")):
        assert_one_line_error(run(*cmd, "-o", fifo, "--force"), "is not a regular file")
        assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    from fewbit.table import atomic_output

    with pytest.raises(OSError, match="not a regular file"):
        with atomic_output(fifo):
            pass


def test_a_file_made_while_fitting_is_kept_without_force(tmp_path, monkeypatch):
    """The output was checked before the fit and replaced after it: a file the user made
    meanwhile was overwritten without ``--force``."""
    import fewbit.cli as fcli

    out = tmp_path / "out.json"
    real = fcli._run_fit

    def slow_fit(*a, **k):
        out.write_text("USER DATA")
        return real(*a, **k)

    monkeypatch.setattr(fcli, "_run_fit", slow_fit)
    r = run("fit", "gelu", "--bits", "1", "--grid", "50", "--no-progress", "-o", out)
    assert r.exit_code != 0 and "was created while fitting; pass --force" in r.stderr
    assert out.read_text() == "USER DATA"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]  # no temporary left
    out.unlink()
    r = run("fit", "gelu", "--bits", "1", "--grid", "50", "--no-progress", "-o", out, "--force")
    assert r.exit_code == 0 and 1 in read_tables(out)


def test_long_output_name_and_degenerate_ranges_are_one_line_errors(tmp_path):
    assert_one_line_error(run("plot", "gelu", "--bits", "1", "-o", tmp_path / ("a" * 300 + ".png")), "cannot write")
    assert_one_line_error(run("fit", "gelu", "--domain", "1", "1.0000000000000002", "--no-progress"),
                          "--domain", "B - A")
    assert_one_line_error(run("plot", "gelu", "--xlim", "-1e308", "1e308"), "--xlim", "must be finite")


def test_stepwise_functions_refuse_fit_options_they_ignore(tmp_path):
    """``fewbit fit relu --domain 1 5 --weight normal:2`` printed "on [1, 5]" for a table that
    is exact (its file: domain [-10, 10], weight exact)."""
    r = run("fit", "relu", "--domain", "1", "5", "--weight", "normal:2", "-o", tmp_path / "r.json")
    assert_one_line_error(r, "relu is stepwise", "--domain, --weight")
    assert not (tmp_path / "r.json").exists()
    assert run("fit", "relu", "--bits", "1", "-o", tmp_path / "r.json", "--no-progress").exit_code == 0


def test_a_user_functions_default_parameter_names_no_table(usermod, tmp_path, monkeypatch):
    """``fewbit fit mod:f --param a=1.5`` with 1.5 its default wrote ``…@a=1.5.json`` holding
    params {}, which ``fewbit plot --table that --param a=1.5`` then refused."""
    mod = usermod("""
        import torch
        def withparam(x, a=1.5):
            return x * torch.sigmoid(a * x)
    """)
    out = tmp_path / "t.json"
    r = run("fit", f"{mod}:withparam", "--param", "a=1.5", "--bits", "1", "--grid", "50", "--no-progress", "-o", out)
    assert r.exit_code == 0, r.output
    r = run("plot", f"{mod}:withparam", "--table", out, "--param", "a=1.5", "-o", tmp_path / "p.png")
    assert r.exit_code == 0, r.output
    monkeypatch.chdir(tmp_path)
    r = run("fit", f"{mod}:withparam", "--param", "a=1.5", "--bits", "1", "--grid", "50", "--no-progress")
    assert r.exit_code == 0 and f"wrote {mod}--withparam.json" in r.stdout


def test_warnings_are_one_line_and_a_narrow_weight_is_fitted_with_a_warning(tmp_path):
    """A normal weight narrower than the grid's cells: its mass was found by quadrature
    nodes that stepped over the peak ("normal:1e-05 has no mass on the domain"), and a grid
    too coarse for it gave a fit 3x worse than the best, silently. Warnings are one line,
    not Python's file, line and source."""
    r = run("fit", "gelu", "--weight", "normal:1e-3", "--bits", "2", "--grid", "400", "--no-progress",
            "-o", tmp_path / "n.json")
    assert r.exit_code == 0, r.output
    warned = [line for line in r.output.splitlines() if line.startswith("Warning:")]
    assert warned == [line for line in r.output.splitlines() if "Warning" in line]
    assert len(warned) == 1 and "narrower than the grid's cells" in warned[0] and "grid >= 5000" in warned[0]
    r = run("fit", "gelu", "--weight", "normal:1e-5", "--bits", "2", "--grid", "300", "--no-progress",
            "-o", tmp_path / "m.json")
    assert r.exit_code == 0, r.output
    assert "no mass" not in r.output and (tmp_path / "m.json").exists()


def test_plot_legend_gives_the_tables_own_error(tmp_path):
    """The legend printed the ``error`` a table file states: a hand-edited table kept its old
    figure (4.056e-02 for a table whose error is 5.14), one without it said "n/a"."""
    from fewbit.solver import approximation_error

    gelu = shipped_table_files()["gelu.json"]
    d = json.loads(Path(gelu).read_text())
    d["tables"] = {"2": d["tables"]["2"]}
    d["tables"]["2"]["values"] = [0.5, 0.5, 0.5, 0.5]
    (tmp_path / "edited.json").write_text(json.dumps(d))
    want = f"{approximation_error(read_tables(tmp_path / 'edited.json')[2]):.3e}"
    del d["tables"]["2"]["error"]
    (tmp_path / "noerror.json").write_text(json.dumps(d))
    for name in ("edited.json", "noerror.json"):
        r = run("plot", "gelu", "--table", tmp_path / name, "-o", tmp_path / f"{name}.svg")
        assert r.exit_code == 0, r.output
        assert f"2 bits: error {want}" in (tmp_path / f"{name}.svg").read_text()


@pytest.mark.parametrize("command", ["memory", "plan"])
def test_sizes_past_their_range_are_one_line_errors(command):
    """``--hidden 99999999999999999999`` spun without end in the head-size search, and a
    ``--group-size`` of 20 digits passed Config, then printed a traceback of 146 lines from
    inside the first step."""
    assert_one_line_error(run(command, "--model", "gpt2", "--hidden", "99999999999999999999"),
                          "'--hidden': must be in 1..65536, got 99999999999999999999")
    if command == "memory":
        assert_one_line_error(run("memory", "--model", "gpt2", "--layers", "1", "--hidden", "64", "--seq-len", "8",
                                  "--saved-bits", "4", "--group-size", "99999999999999999999", "--no-progress"),
                              "group_size must be an integer in 1..2147483647")


def test_a_closed_stdout_does_not_lose_the_fit(tmp_path):
    """``fewbit fit ... | head -1``: the summary was printed before the file was written, so
    a pipe closed by then ended the command (exit 1, no message) and the fit was lost
    (review h70). The file is written first."""
    import subprocess
    import sys

    out = tmp_path / "t.json"
    proc = subprocess.Popen([sys.executable, "-m", "fewbit.cli", "fit", "gelu", "--bits", "2", "--grid", "100",
                             "--no-progress", "-o", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=tmp_path)
    proc.stdout.close()  # the reader is gone before anything is printed
    proc.wait(timeout=300)
    proc.stderr.close()
    assert 2 in read_tables(out)
