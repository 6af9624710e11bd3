"""Table resolution without fitting (fewbit.functional._find_table, used by the CLI) and
the user cache's handling of unreadable files (fewbit.functional._set_aside)."""

from __future__ import annotations

import sys
import warnings

import torch

import pytest

import fewbit.functional as FF
from fewbit.table import TableFormatError, read_tables, table_filename


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FEWBIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(FF.FIT_OPTIONS, "grid", 300)
    FF.clear_table_cache()
    yield tmp_path / "tables"
    FF.clear_table_cache()


def test_find_table_follows_the_runtime_and_never_fits(cache):
    pytest.importorskip("fewbit.solver")
    t, src = FF._find_table("relu", 4)
    assert src == "exact" and t == FF.load_table("relu", 4)
    t, src = FF._find_table("gelu", 2)
    assert src == "fewbit.tables/gelu.json" and t == FF.load_table("gelu", 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no TableFittedWarning: nothing is fitted
        assert FF._find_table("elu", 2, {"alpha": 0.5}) == (None, "")
    assert not cache.exists()
    with pytest.warns(FF.TableFittedWarning):
        fitted = FF.load_table("elu", 2, {"alpha": 0.5})
    FF.clear_table_cache()
    t, src = FF._find_table("elu", 2, {"alpha": 0.5})
    assert src == str(cache / table_filename("elu", {"alpha": 0.5})) and t == fitted
    assert FF._find_table("elu", 3, {"alpha": 0.5}) == (None, "")  # that width was never fitted
    assert FF._find_table("elu", 2) == (FF.load_table("elu", 2), "fewbit.tables/elu.json")
    with pytest.raises(ValueError, match="bits must be"):
        FF._find_table("elu", 9)


def test_find_table_reports_a_corrupt_cache_file_and_leaves_it(cache):
    path = cache / table_filename("elu", {"alpha": 0.5})
    path.parent.mkdir(parents=True)
    path.write_text('{"schema_version": 1, "name": "elu", "tables": null}')
    with pytest.raises(TableFormatError, match=f"{path}: .*tables must be an object, got null"):
        FF._find_table("elu", 2, {"alpha": 0.5})
    assert path.exists() and sorted(p.name for p in cache.iterdir()) == [path.name]


@pytest.mark.parametrize("other, other_params", [("celu", {"alpha": 0.5}), ("elu", {"alpha": 0.25})])
def test_a_cache_file_for_another_setting_is_set_aside_and_refitted(cache, other, other_params):
    """A valid cache file under this setting's name but for another function or other
    parameters (copied by hand, restored from a backup) is the cache's to rebuild, as an
    unreadable one is: kept beside, refitted (before: every call raised "table is for
    'celu', not 'elu'"). Without fitting (the CLI's lookup) it is still an error."""
    pytest.importorskip("fewbit.solver")
    with pytest.warns(FF.TableFittedWarning):
        FF.load_table(other, 1, other_params)
    path = cache / table_filename("elu", {"alpha": 0.5})
    foreign = (cache / table_filename(other, other_params)).read_text()
    path.write_text(foreign)
    FF.clear_table_cache()
    with pytest.raises(ValueError, match="table is for|table was fitted for"):
        FF._find_table("elu", 1, {"alpha": 0.5})
    with pytest.warns(FF.TableFittedWarning, match=r"a cache file for another setting was moved to .*\.corrupt"):
        t = FF.load_table("elu", 1, {"alpha": 0.5})
    assert t.name == "elu" and dict(t.params) == {"alpha": 0.5}
    assert (cache / (path.name + ".corrupt")).read_text() == foreign
    assert read_tables(path)[1] == t


def test_a_second_corrupt_cache_file_does_not_overwrite_the_first(cache):
    """Each unreadable cache file is kept: .corrupt, then .corrupt.1, ... (it used to be
    os.replace'd onto .corrupt, losing the first one)."""
    pytest.importorskip("fewbit.solver")
    path = cache / table_filename("elu", {"alpha": 0.5})
    path.parent.mkdir(parents=True)
    for i, junk in enumerate(["{first", "{second", "{third"]):
        path.write_text(junk)
        FF.clear_table_cache()
        with pytest.warns(FF.TableFittedWarning, match="moved to .*corrupt"):
            FF.load_table("elu", 1, {"alpha": 0.5})
    assert (cache / (path.name + ".corrupt")).read_text() == "{first"
    assert (cache / (path.name + ".corrupt.1")).read_text() == "{second"
    assert (cache / (path.name + ".corrupt.2")).read_text() == "{third"
    assert sorted(read_tables(path)) == [1]


def test_a_cache_file_of_other_fit_options_is_kept(cache, monkeypatch):
    """A 1-bit cache table fitted on another domain cannot share a file with a new
    2-bit one: the new table is used but not cached, and the file is unchanged."""
    pytest.importorskip("fewbit.solver")
    with pytest.warns(FF.TableFittedWarning):
        FF.load_table("elu", 1, {"alpha": 0.5})
    path = cache / table_filename("elu", {"alpha": 0.5})
    before = path.read_text()
    monkeypatch.setitem(FF.FIT_OPTIONS, "domain", (-4.0, 4.0))
    with pytest.warns(FF.TableFittedWarning, match="not cached .*domain"):
        t = FF.load_table("elu", 2, {"alpha": 0.5})
    assert t.bits == 2 and t.domain == (-4.0, 4.0)
    assert path.read_text() == before
    assert FF._find_table("elu", 2, {"alpha": 0.5})[1] == "memory"


@pytest.mark.parametrize("spec", ["torch:exp", "torch:square", "torch:cosh"])
def test_a_user_function_whose_derivative_grows_is_refused(cache, spec):
    """``exp``'s fitted 3-bit table gave 43.93 for every input in [-3, 3] (the levels went to
    the right tail, f'(10) = 22026), silently but for 'fitted a table'. A user function whose
    derivative grows past the fit domain is refused before fitting; nothing is cached."""
    x = torch.linspace(-3, 3, 7, requires_grad=True)
    with pytest.raises(ValueError, match=rf"{spec}: its derivative grows past the fit domain"):
        FF.activation(x, spec, bits=3)
    assert not cache.exists() or not list(cache.iterdir())


@pytest.mark.parametrize("spec", ["torch:atan", "torch:tanh", "torch:sin", "torch.special:expit"])
def test_user_functions_whose_derivative_stays_in_range_are_fitted(cache, spec):
    """Derivatives that decay slowly (atan: 1/(1+x^2)) or stay bounded (sin) are fitted."""
    x = torch.linspace(-3, 3, 7, requires_grad=True)
    with pytest.warns(FF.TableFittedWarning):
        FF.activation(x, spec, bits=2).sum().backward()
    assert x.grad.isfinite().all()


def test_a_growing_derivative_is_refused_with_a_table_and_by_fit(cache, tmp_path):
    """The README's own path for a custom activation (``fewbit fit torch:exp -o exp.json``,
    then ``table="exp.json"``) bypassed the refusal above: the gradient was 43.93 at every
    x in [-3, 3]. ``fewbit fit`` now refuses such a function in one line (any domain: a
    table's end levels stand for f' past it), and a table passed for one is refused."""
    from click.testing import CliRunner

    from fewbit.cli import cli
    from fewbit.solver import fit

    r = CliRunner().invoke(cli, ["fit", "torch:exp", "--bits", "3", "-o", str(tmp_path / "exp.json")])
    assert r.exit_code == 1 and not (tmp_path / "exp.json").exists()
    assert "cannot fit torch:exp: its derivative grows past the fit domain (-10, 10)" in r.output
    assert "Traceback" not in r.output and r.output.count("\n") == 1
    r = CliRunner().invoke(cli, ["fit", "torch:exp", "--bits", "3", "--domain", "-3", "3", "-o",
                                 str(tmp_path / "exp.json")])
    assert r.exit_code == 1 and "fit domain (-3, 3)" in r.output
    table = fit("torch:exp", 3)  # made without the check (the solver's own entry point)
    x = torch.linspace(-3, 3, 7, requires_grad=True)
    with pytest.raises(ValueError, match=r"torch:exp: its derivative grows past the fit domain \(-10, 10\)"):
        FF.activation(x, "torch:exp", table=table)
    r = CliRunner().invoke(cli, ["fit", "torch:tanh", "--bits", "2", "-o", str(tmp_path / "tanh.json")])
    assert r.exit_code == 0, r.output
    FF.activation(x, "torch:tanh", table=str(tmp_path / "tanh.json")).sum().backward()
    assert x.grad.isfinite().all()


def test_cache_dir_expands_home_and_is_absolute(monkeypatch, tmp_path):
    """``FEWBIT_CACHE_DIR=~/fewbit`` made a directory named ``~`` in the working directory
    (Python does not expand it), and a relative value moved with ``os.chdir``."""
    from fewbit.resolve import cache_dir

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FEWBIT_CACHE_DIR", "~/fb")
    assert cache_dir() == tmp_path / "home" / "fb" / "tables"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FEWBIT_CACHE_DIR", "rel")
    assert cache_dir() == tmp_path / "rel" / "tables" and cache_dir().is_absolute()


def test_a_table_for_a_user_function_is_checked_once(cache, monkeypatch):
    """The growth check of ``table=`` ran at every call (68 -> 236 us a call); once per
    function, parameters and domain now."""
    from fewbit import resolve
    from fewbit.solver import fit

    calls = []
    real = resolve._check_asymptotes
    monkeypatch.setattr(resolve, "_check_asymptotes", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    table = fit("torch:tanh", 2)
    x = torch.randn(8, requires_grad=True)
    for _ in range(20):
        FF.activation(x, "torch:tanh", table=table)
    assert len(calls) <= 1


def test_an_edited_user_function_is_refitted_not_served_its_old_table(cache, tmp_path, monkeypatch):
    """The user cache keyed a user function by its ``module:callable`` name only: after the
    function was edited (x·sigmoid(1.5x) -> 3·tanh(x)) the next process loaded the old table,
    and backward was the old function's derivative (-0.066 where the new one is 0.21). Its
    cache file is named with a fingerprint of the derivative now: the edited function is
    fitted anew; the unchanged one finds its file, also with the memory cache cleared (a new
    process)."""
    import importlib
    import sys

    pytest.importorskip("fewbit.solver")
    package = tmp_path / "edited_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    x = torch.linspace(-4, 4, 9, requires_grad=True)
    grads = {}
    for name, body in (("swish", "x * torch.sigmoid(1.5 * x)"), ("tanh", "3.0 * torch.tanh(x)")):
        (package / "acts.py").write_text(f"import torch\n\n\ndef act(x):\n    return {body}\n")
        sys.modules.pop("edited_pkg.acts", None)
        importlib.invalidate_caches()
        FF.clear_table_cache()  # a new process
        with pytest.warns(FF.TableFittedWarning):
            FF.activation(x, "edited_pkg.acts:act", bits=3).sum().backward()
        grads[name], x.grad = x.grad.clone(), None
        FF.clear_table_cache()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # found in the cache: not fitted again
            FF.activation(x, "edited_pkg.acts:act", bits=3).sum().backward()
        assert torch.equal(x.grad, grads[name])
        x.grad = None
    true = 3.0 / torch.cosh(x.detach()).square()
    assert (grads["tanh"] - true).abs().max() < 0.5 < (grads["swish"] - true).abs().max()
    assert len(list(cache.glob("*.json"))) == 2  # beside them the fits' lock files


def _user_package(tmp_path, monkeypatch, body: str) -> None:
    package = tmp_path / "fp_pkg"
    package.mkdir(exist_ok=True)
    (package / "__init__.py").write_text("")
    (package / "acts.py").write_text("import torch\nimport torch.nn.functional as F\n\n\n" + body)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("fp_pkg", "fp_pkg.acts"):  # another test's package of the same name
        monkeypatch.delitem(sys.modules, name, raising=False)


def test_the_fingerprint_is_the_same_on_every_cpu_kernel_set(tmp_path, monkeypatch):
    """A tail value of the derivative was -5e-15 with torch's default kernels and 0 with
    AVX-512's, and 7 significant digits of it named another cache file (a refit, or
    ImportError without the solver, on another machine): the fingerprint is relative to the
    largest value, and -0 is 0."""
    import subprocess
    import sys

    _user_package(tmp_path, monkeypatch, "def act(x):\n    return F.gelu(x, approximate='tanh')\n")
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from fewbit.resolve import _fingerprint, resolve_fn; "
            "print(_fingerprint(resolve_fn('fp_pkg.acts:act'), {}))")
    names = set()
    for capability in ("default", "avx2", None):
        env = {k: v for k, v in __import__("os").environ.items() if k != "ATEN_CPU_CAPABILITY"}
        if capability:
            env["ATEN_CPU_CAPABILITY"] = capability
        proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                              env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        names.add(proc.stdout.strip())
    assert len(names) == 1 and len(names.pop()) == 16


def test_the_fingerprint_leaves_bad_functions_to_the_fit_and_works_in_inference_mode(cache, tmp_path, monkeypatch):
    """The fingerprint ran the user's function first: an in-place one raised autograd's
    "leaf Variable ... in-place" instead of the fit's ValueError, and a cached table could
    not be loaded under ``torch.inference_mode`` (autograd there)."""
    pytest.importorskip("fewbit.solver")
    _user_package(tmp_path, monkeypatch, "def inplace(x):\n    return x.mul_(torch.sigmoid(x))\n\n\n"
                                         "def act(x):\n    return x * torch.sigmoid(1.5 * x)\n")
    with pytest.raises(ValueError, match="modified its input in place"):
        FF.load_table("fp_pkg.acts:inplace", bits=3)
    with pytest.warns(FF.TableFittedWarning):
        fitted = FF.load_table("fp_pkg.acts:act", bits=3)
    FF.clear_table_cache()
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("error")  # found in the cache, not fitted again
        assert FF.load_table("fp_pkg.acts:act", bits=3) == fitted


def test_a_rescaled_function_is_not_served_the_old_table(cache, tmp_path, monkeypatch):
    """The fingerprint was relative to the derivative's largest value: ``tanh`` and
    ``3·tanh`` shared a file, and the edited function's backward was the old one's (0.915
    where 3.0 is right). The scale is hashed too; a first fit under ``inference_mode`` works."""
    from fewbit.resolve import _fingerprint, resolve_fn

    _user_package(tmp_path, monkeypatch, "def one(x):\n    return torch.tanh(x)\n\n\n"
                                         "def three(x):\n    return 3.0 * torch.tanh(x)\n")
    assert _fingerprint(resolve_fn("fp_pkg.acts:one"), {}) != _fingerprint(resolve_fn("fp_pkg.acts:three"), {})
    pytest.importorskip("fewbit.solver")
    with pytest.warns(FF.TableFittedWarning), torch.inference_mode():
        FF.load_table("fp_pkg.acts:three", bits=2)


def test_an_edit_between_the_fingerprints_points_is_refitted(cache, tmp_path, monkeypatch):
    """A hinge whose kink moved from 0 to 0.1 had the same fingerprint (f' sampled 0.156
    apart) and was served the old table: gradient 1.0 on (0, 0.1] where the function's is 0.1."""
    import importlib

    pytest.importorskip("fewbit.solver")
    x = torch.tensor([0.05, 0.07], requires_grad=True)
    for kink in ("0.0", "0.1"):
        _user_package(tmp_path, monkeypatch, f"def hinge(x):\n    return torch.where(x > {kink}, x, 0.1 * x)\n")
        importlib.invalidate_caches()
        FF.clear_table_cache()  # a new process
        with pytest.warns(FF.TableFittedWarning):  # fitted for each version, not served the first's
            FF.activation(x, "fp_pkg.acts:hinge", bits=2).sum().backward()
        x.grad = None
    FF.activation(x, "fp_pkg.acts:hinge", bits=2).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((2,), 0.1), rtol=0, atol=1e-6)
    assert len(list(cache.glob("*.json"))) == 2  # beside them the fits' lock files


def test_the_code_digest_is_stable_and_sees_closures():
    from fewbit.resolve import _code_digest

    def make(c):
        def f(x):
            return x * c
        return f

    assert _code_digest(make(2.0)) == _code_digest(make(2.0)) != _code_digest(make(3.0))
    inner = make(2.0)

    def outer(x):
        return inner(x)

    other = make(2.0)

    def outer2(x):
        return other(x)

    assert _code_digest(outer) != ""  # a closure over a function: its code, no memory address
    assert _code_digest(torch.tanh) == ""


def test_a_long_user_function_name_gets_a_short_cache_file(cache, tmp_path, monkeypatch):
    """A 244-character function name: the cache file name passed the file system's limit and
    ``FF.activation`` raised ``OSError`` (ENAMETOOLONG)."""
    pytest.importorskip("fewbit.solver")
    name = "act_" + "x" * 240
    _user_package(tmp_path, monkeypatch, f"def {name}(x):\n    return x * torch.sigmoid(x)\n")
    x = torch.linspace(-3, 3, 7, requires_grad=True)
    with pytest.warns(FF.TableFittedWarning, match="cached at"):
        FF.activation(x, f"fp_pkg.acts:{name}", bits=2).sum().backward()
    (path,) = cache.glob("*.json")
    assert len(path.name) <= 200 + len(".json") and path.name.startswith("fp_pkg.acts--act_x")
    assert len(table_filename(f"fp_pkg.acts:{name}")) < 130 and table_filename("gelu") == "gelu.json"


def test_a_cache_file_another_process_set_aside_first(tmp_path):
    """Processes starting together (DDP ranks) on one unreadable cache file: the ones that
    found it gone when moving it aside raised TableFormatError (3 runs in 8 with 4 processes)."""
    from fewbit.resolve import _set_aside

    path = tmp_path / "gelu.json"
    note = _set_aside(path, TableFormatError("truncated"))  # gone already: another process moved it
    assert "moved aside by another process" in note
    path.write_text("{")
    assert "moved to" in _set_aside(path, TableFormatError("truncated")) and not path.exists()


def test_concurrent_fits_of_other_bit_widths_all_stay_in_the_cache_file(cache, monkeypatch):
    """Three fits of one function at other bit widths at once: an unlocked read-modify-write
    of the cache file dropped one of them."""
    import threading
    import time

    import fewbit.solver
    from fewbit import resolve, table as fewbit_table
    from fewbit.table import load_shipped

    shipped = load_shipped("gelu", {})
    monkeypatch.setattr(fewbit.solver, "fit", lambda name, bits, **kw: shipped[bits])
    real_write = fewbit_table.write_tables

    def slow_write(*a, **k):  # widens the read-modify-write window
        time.sleep(0.2)
        return real_write(*a, **k)

    monkeypatch.setattr(resolve, "write_tables", slow_write)
    f = resolve.resolve_fn("gelu")
    threads = [threading.Thread(target=resolve._fit_and_cache, args=(f, b, {})) for b in (1, 2, 3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FF.TableFittedWarning)
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert sorted(read_tables(cache / "gelu.json")) == [1, 2, 3]


def test_a_table_cached_by_an_earlier_solver_is_fitted_again(cache):
    """Tables the user cache holds from before a solver fix (a user hinge's misplaced border,
    softplus' levels of 0 at a tiny beta) were served for ever: a cached table of another
    ``CACHE_REVISION`` is fitted again, and the new one is written with the revision."""
    from dataclasses import replace

    from fewbit.resolve import CACHE_REVISION
    from fewbit.table import write_tables

    params = {"beta": 1e-300}
    path = cache / table_filename("softplus", params)
    path.parent.mkdir(parents=True)
    stale = replace(load_toy_softplus(params), values=[0.0, 0.0, 0.0, 0.0], provenance={})
    write_tables(path, [stale])
    x = torch.tensor([-1.0, 0.0, 2.0], requires_grad=True)
    with pytest.warns(FF.TableFittedWarning):
        FF.softplus(x, beta=1e-300, bits=2).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 0.5))  # torch's derivative there
    assert read_tables(path)[2].provenance["cache_revision"] == CACHE_REVISION
    FF.clear_table_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # now served from the cache
        FF.softplus(x, beta=1e-300, bits=2)


def load_toy_softplus(params):
    from helpers import toy_table

    return toy_table("softplus", 2, params)


@pytest.mark.parametrize("body", [
    # a frozenset constant (review 2)
    "def act(x, mode_soft=1.0):\n    if 'soft' in {'soft', 'smooth', 'hard', 'x', 'y'}:\n"
    "        return x * torch.sigmoid(x)\n    return x\n",
    # a closure over an object holding a set (review 3)
    "import types\n_CFG = types.SimpleNamespace(tags={'a', 'b', 'c', 'd', 'e'})\n"
    "def make(cfg):\n    def act(x):\n        return x * torch.sigmoid(x) if cfg.tags else x\n    return act\n"
    "act = make(_CFG)\n",
], ids=["frozenset-constant", "object-with-a-set"])
def test_the_fingerprint_is_the_same_in_every_process(tmp_path, monkeypatch, body):
    """Sets print in the order of the process's string hash seed: such a function got
    another fingerprint per process, a refit and a new cache file every run."""
    import subprocess

    _user_package(tmp_path, monkeypatch, body)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from fewbit.resolve import _fingerprint, resolve_fn; "
            "print(_fingerprint(resolve_fn('fp_pkg.acts:act'), {}))")
    names = set()
    for seed in ("1", "2", "3"):
        env = dict(__import__("os").environ, PYTHONHASHSEED=seed)
        proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                              env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        names.add(proc.stdout.strip())
    assert len(names) == 1


def test_a_long_non_ascii_name_is_shortened_by_bytes():
    name = "pkg.mod:" + "\u51fd" * 100  # 3 bytes a character in UTF-8
    short = table_filename(name)
    assert len(short.encode()) <= 200 and short.endswith(".json")


def test_an_edited_helper_of_a_user_function_is_refitted(cache, tmp_path, monkeypatch):
    """``act`` calls ``_hinge`` of its own module: an edit of ``_hinge`` between the sampled
    points was served the old table (the digest held ``act``'s code only)."""
    import importlib

    pytest.importorskip("fewbit.solver")
    x = torch.tensor([0.0995], requires_grad=True)
    for kink in ("0.099", "0.1"):
        _user_package(tmp_path, monkeypatch, f"def _hinge(x):\n    return torch.where(x > {kink}, x, 0.1 * x)\n\n\n"
                                             "def act(x):\n    return _hinge(x)\n")
        importlib.invalidate_caches()
        FF.clear_table_cache()
        with pytest.warns(FF.TableFittedWarning):
            FF.activation(x, "fp_pkg.acts:act", bits=2).sum().backward()
        x.grad = None
    FF.activation(x, "fp_pkg.acts:act", bits=2).sum().backward()
    torch.testing.assert_close(x.grad, torch.tensor([0.1]), rtol=0, atol=1e-6)


def test_a_stale_table_is_served_without_the_solver(cache, monkeypatch):
    """Without scipy/numba a cached table of an earlier revision raised ImportError (fitting
    needs them) where it had been served."""
    from dataclasses import replace

    from fewbit import resolve
    from fewbit.table import write_tables
    from helpers import toy_table

    params = {"alpha": 0.5}
    path = cache / table_filename("elu", params)
    path.parent.mkdir(parents=True)
    write_tables(path, [replace(toy_table("elu", 2, params), provenance={})])
    monkeypatch.setattr(resolve, "_solver_available", lambda: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # served, not fitted
        table = FF.load_table("elu", 2, params)
    assert table.provenance == {}


def test_the_digest_of_modules_classes_and_mutual_helpers():
    """A default or closure holding a module (``lib=torch``, ``torch.nn.functional``, numpy)
    made the digest walk the module: torch.classes raised from ``hasattr``, numpy's digest
    changed with the hash seed; helpers calling each other made it exponential."""
    import time

    import numpy as np

    from fewbit.resolve import _code_digest

    def act(x, lib=torch):
        return lib.tanh(x)

    def act_np(x, lib=np):
        return x

    F_ = torch.nn.functional

    def act_closure(x):
        return F_.silu(x)

    for fn in (act, act_np, act_closure):
        assert len(_code_digest(fn)) == 64
    namespace: dict = {"__name__": "fan"}
    names = [f"h{i}" for i in range(20)]
    src = "".join(f"def {n}(x, k=0):\n    return x if k <= 0 else " + " + ".join(f"{m}(x, k - 1)" for m in names
                                                                              if m != n) + "\n" for n in names)
    exec(compile(src, "fan", "exec"), namespace)
    start = time.perf_counter()
    _code_digest(namespace["h0"])
    assert time.perf_counter() - start < 1.0
