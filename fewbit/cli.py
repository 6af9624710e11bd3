"""The ``fewbit`` command line: fit, inspect and plot few-bit tables.

Commands::

    fewbit fit NAME [--bits 1 2 3 4] [--domain A B] [--weight uniform|normal:SIGMA]
                    [--grid N] [--symmetric/--no-symmetric] [--param KEY=VALUE ...]
                    [-o PATH] [--force]
    fewbit error NAME... [--bits ...] [--domain A B] [--param KEY=VALUE ...] [--json]
                    [--refit (+ fit options)]
    fewbit plot NAME [--bits ...] [--param ...] [--table PATH] [--xlim A B] [-o FILE.png]
    fewbit list
    fewbit memory ...
    fewbit --version

A table approximates an activation's derivative ``f'`` by a piecewise-constant ``q`` with
``2**bits`` levels (Novikov et al., "Few-bit Backward", ICML 2023, eq. 3-5; docs/method.md §2-3).
The *error* reported everywhere is docs/method.md §3: ``integral over [A, B] of (f' - q)^2 dx``
(uniform weight, default domain ``[-10, 10]``), printed with 4 significant digits.

Options that take several values accept them space-separated (``--bits 1 2 3 4``),
comma-separated (``--bits 1,2,3``) or repeated (``--bits 1 --bits 2``).

Errors in user input are reported as one line on stderr with a non-zero exit status.
This module imports only click and the standard library at import time: torch, the
solver (numba, scipy), tqdm and matplotlib are imported inside the commands that need them.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import click

from fewbit import __version__
from fewbit._checks import check_bits, is_int
from fewbit.memory_cli import OutputFile, memory
from fewbit.plan_cli import plan
from fewbit.table import Table, TableFormatError, atomic_output

__all__ = ["cli", "main"]

#: Default bit widths of ``fit``, ``error`` and ``plot``.
DEFAULT_BITS = (1, 2, 3, 4)
#: Default fitting domain (docs/method.md §3).
DEFAULT_DOMAIN = (-10.0, 10.0)


# ---------------------------------------------------------------------------------------
# Parsing helpers
# ---------------------------------------------------------------------------------------

# Tokens that continue a multi-valued option: integers or comma lists of them (bits), and
# KEY=VALUE pairs (params). Anything else ends the option's values.
_BITS_TOKEN = re.compile(r"^[+-]?[\d.]+(?:,[+-]?[\d.]*)*$")
_PARAM_TOKEN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_CONTINUATIONS: dict[str, re.Pattern] = {
    "--bits": _BITS_TOKEN,
    "-b": _BITS_TOKEN,
    "--param": _PARAM_TOKEN,
    "-p": _PARAM_TOKEN,
}


def _expand_multi_value_options(args: Sequence[str]) -> list[str]:
    """Rewrite ``--bits 1 2 3`` as ``--bits 1 --bits 2 --bits 3`` (and alike for ``--param``).

    click options take a fixed number of values, so the continuation tokens that follow a
    multi-valued option (those matching the option's pattern) are turned into repeated
    options before click parses the command line. ``--`` ends the rewriting.
    """
    out: list[str] = []
    i = 0
    args = list(args)
    while i < len(args):
        tok = args[i]
        out.append(tok)
        i += 1
        if tok == "--":
            out.extend(args[i:])
            break
        opt = tok.split("=", 1)[0] if tok.startswith("--") else tok
        pattern = _CONTINUATIONS.get(opt)
        if pattern is None:
            continue
        if "=" not in tok or not tok.startswith("--"):
            # The option's first value is the next token, taken by click as it is.
            if i < len(args):
                out.append(args[i])
                i += 1
        while i < len(args) and pattern.match(args[i]):
            out.extend([opt, args[i]])
            i += 1
    return out


class MultiValueCommand(click.Command):
    """A click command whose ``--bits`` / ``--param`` options take several values."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, _expand_multi_value_options(args))


class _BitsType(click.ParamType):
    """One or more bit widths, ``"3"`` or ``"1,2,3"``; each an integer in 1..8."""

    name = "BITS"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[int, ...]:
        if isinstance(value, tuple):
            return value
        if is_int(value):
            parts: list[Any] = [value]
        else:
            parts = [p.strip() for p in str(value).split(",") if p.strip()]
        if not parts:
            self.fail(f"bits must be integers in 1..8, got {value!r}", param, ctx)
        out = []
        for p in parts:
            try:
                b = int(p)
            except (TypeError, ValueError):
                self.fail(f"bits must be integers in 1..8, got {p!r}", param, ctx)
            try:
                out.append(check_bits(b))
            except ValueError as exc:
                self.fail(str(exc), param, ctx)
        return tuple(out)


def _flatten_bits(ctx: click.Context, param: click.Parameter, value: Any) -> tuple[int, ...] | None:
    if not value:
        return None
    return tuple(sorted({b for group in value for b in group}))


class _ParamType(click.ParamType):
    """A ``KEY=VALUE`` pair with a finite float value."""

    name = "KEY=VALUE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[str, float]:
        if isinstance(value, tuple):
            return value
        key, sep, raw = str(value).partition("=")
        key = key.strip()
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            self.fail(f"must be KEY=VALUE (e.g. alpha=0.5), got {value!r}", param, ctx)
        try:
            val = float(raw)
        except ValueError:
            self.fail(f"value of {key} must be a number, got {raw!r}", param, ctx)
        if not math.isfinite(val):
            self.fail(f"value of {key} must be finite, got {raw!r}", param, ctx)
        return key, val


def _params_dict(ctx: click.Context, param: click.Parameter, value: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, val in value or ():
        if key in out and out[key] != val:
            raise click.BadParameter(f"{key} given twice ({out[key]!r} and {val!r})", ctx, param)
        out[key] = val
    return out


def _check_domain(ctx: click.Context, param: click.Parameter, value: Any) -> tuple[float, float] | None:
    if value is None:
        return None
    a, b = value
    if not (math.isfinite(a) and math.isfinite(b)):
        raise click.BadParameter(f"ends must be finite, got {a} {b}", ctx, param)
    if not a < b:
        raise click.BadParameter(f"needs A < B, got A={a} B={b}", ctx, param)
    if not math.isfinite(b - a):
        raise click.BadParameter(f"the width B - A must be finite, got A={a} B={b}", ctx, param)
    if b - a < 1e-9 * max(1.0, abs(a), abs(b)):  # a grid over it would repeat points
        raise click.BadParameter(f"needs a width B - A >= 1e-9 of max(1, |A|, |B|), got A={a!r} B={b!r}", ctx, param)
    return float(a), float(b)


def _check_grid(ctx: click.Context, param: click.Parameter, value: Any) -> int | None:
    if value is not None and value < 2:
        raise click.BadParameter(f"must be an integer >= 2, got {value}", ctx, param)
    return value


def _one_line_text(text: str) -> str:
    return " ".join(str(text).split())


def _one_line(exc: BaseException) -> str:
    """The message of a library exception as one line."""
    return _one_line_text(str(exc)) or type(exc).__name__


class _LibraryErrors:
    """Turn the library's ValueError / TypeError / TableFormatError into a ClickException."""

    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is not None and isinstance(exc, (ValueError, TypeError, TableFormatError)):
            raise click.ClickException(self.prefix + _one_line(exc)) from None
        return False


def _fmt_error(err: float | None) -> str:
    """An error with 4 significant digits (``0`` for an exact table)."""
    if err is None or (isinstance(err, float) and math.isnan(err)):
        return "n/a"
    if err == 0:
        return "0"
    return f"{err:.3e}"


def _fmt_params(params: Mapping[str, float]) -> str:
    return ",".join(f"{k}={v:g}" for k, v in sorted(params.items())) or "-"


def _render_table(header: Sequence[str], rows: Iterable[Sequence[str]], right_from: int = 1) -> str:
    """Plain aligned text table; columns from ``right_from`` on are right-aligned."""
    rows = [list(map(str, r)) for r in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in rows)) if rows else len(str(h)) for i, h in enumerate(header)]

    def line(cells: Sequence[str]) -> str:
        out = []
        for i, (c, w) in enumerate(zip(cells, widths)):
            out.append(c.rjust(w) if i >= right_from else c.ljust(w))
        return "  ".join(out).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(list(map(str, header))), sep, *(line(r) for r in rows)])


# ---------------------------------------------------------------------------------------
# Names, parameters, tables
# ---------------------------------------------------------------------------------------


def _is_user_function(name: str) -> bool:
    return ":" in name


def _resolve(name: str, params: Mapping[str, float]) -> tuple[str, dict[str, float], Any]:
    """Canonical name, non-default params and the runtime Activation (None for user functions).

    A Hugging Face formula name (``gelu_new``, ``gelu_fast``, ...) stands for the registry
    function whose tables it uses (its forward does not matter here: only tables and f').

    Raises:
        click.ClickException: unknown name (with close matches) or bad parameters.
    """
    if _is_user_function(name):
        from fewbit.resolve import resolve_fn

        with _LibraryErrors():  # its number defaults left out, as its table file names them
            return name, resolve_fn(name).table_params(params), None
    from fewbit.activations import non_default_params, table_activation

    with _LibraryErrors():
        act = table_activation(name)
        nd = non_default_params(act, params)
    return act.name, nd, act


def _full_params(act: Any, params: Mapping[str, float]) -> dict[str, float]:
    if act is None:
        return dict(params)
    from fewbit.activations import canonical_params

    return canonical_params(act, params)


def _find_tables(name: str, params: Mapping[str, float], bits: Iterable[int]) -> dict[int, tuple[Table, str]]:
    """``{bits: (table, source)}`` for the widths that exist, found as the runtime finds them
    (:func:`fewbit.resolve.find_table`: exact table of a stepwise derivative, shipped table,
    user cache), never fitted. ``source`` is ``"exact"``, ``"fewbit.tables/<file>"`` or a
    cache path.

    Raises:
        click.ClickException: an unreadable shipped or cached file, or a bad name/params.
    """
    from fewbit.resolve import find_table

    out = {}
    with _LibraryErrors():
        for b in bits:
            table, source = find_table(name, b, params)
            if table is not None:
                out[b] = (table, source)
    return out


def _what(name: str, params: Mapping[str, float]) -> str:
    return name + (f" ({_fmt_params(params)})" if params else "")


def _command_line(*words: Any) -> str:
    """A shell command line (quoted as needed), e.g. for the hint of an error message."""
    import shlex

    return shlex.join(str(w) for w in words)


def _param_args(params: Mapping[str, float]) -> list[str]:
    return [w for k, v in sorted(params.items()) for w in ("--param", f"{k}={v!r}")]


def _bits_args(bits: Sequence[int] | None) -> list[str]:
    return ["--bits", *map(str, bits)] if bits else []


def _nothing_found(name: str, params: Mapping[str, float], bits: Sequence[int]) -> str:
    """Where the tables were looked for, for an error message."""
    from fewbit.resolve import cache_dir

    where = "no shipped table and no" if not _is_user_function(name) else "no"
    return (
        f"{where} table in the user cache ({cache_dir()}) for {_what(name, params)} "
        f"at bits {', '.join(map(str, bits))}"
    )


def _cache_note(found: Mapping[int, tuple[Table, str]]) -> str:
    """'; bits 3 from the user cache PATH' for the tables that are neither shipped nor exact."""
    by_source: dict[str, list[int]] = {}
    for b, (_, source) in sorted(found.items()):
        if source != "exact" and not source.startswith("fewbit.tables/"):
            by_source.setdefault(source, []).append(b)
    return "".join(
        f"; bits {', '.join(map(str, bs))} from "
        + ("tables fitted in this process" if src == "memory" else f"the user cache {src}")
        for src, bs in by_source.items()
    )


def _check_writable(path: Path, force: bool) -> None:
    """Fail early (before a long fit) if ``path`` cannot be written.

    Raises:
        click.ClickException: the path is a directory, exists without ``--force``, or its
            directory is missing or not writable.
    """
    try:
        if path.is_dir():
            raise click.ClickException(f"output path {path} is a directory")
        if path.exists() and not path.is_file():  # a FIFO or a device (/dev/null) would be replaced by a file
            raise click.ClickException(f"output path {path} is not a regular file")
        if (path.exists() or path.is_symlink()) and not force:  # a dangling link is a file the user has
            raise click.ClickException(f"output file {path} exists; pass --force to overwrite it")
    except OSError as exc:  # a name too long for the file system
        raise click.ClickException(f"cannot write {path}: {exc.strerror or exc}") from None
    path = Path(os.path.realpath(path))  # written through a symbolic link (fewbit.table.atomic_output)
    directory = path.parent if str(path.parent) else Path(".")
    if not directory.is_dir():
        raise click.ClickException(f"cannot write {path}: directory {directory} does not exist")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".check", dir=directory)
    except OSError as exc:
        raise click.ClickException(f"cannot write {path}: {exc.strerror or exc}") from None
    os.close(fd)
    os.unlink(tmp)
    if path.exists() and not os.access(path, os.W_OK):
        raise click.ClickException(f"cannot write {path}: permission denied")


class _ProgressBar:
    """A tqdm bar on stderr driven by ``progress(done, total)`` callbacks.

    The bar is created at the first callback (the solver reports ``(0, total)`` first),
    so it shows its real total from the start.
    """

    def __init__(self, desc: str, enabled: bool) -> None:
        self.desc = desc
        self.enabled = enabled
        self.bar = None

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        total = max(int(total), 1)
        if self.bar is None:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=self.desc, unit="step", file=sys.stderr, leave=False)
        self.bar.total = total
        self.bar.n = min(int(done), total)
        self.bar.refresh()

    def __enter__(self) -> "_ProgressBar":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.close()


def _run_fit(
    name: str,
    bits: Sequence[int],
    *,
    domain: tuple[float, float],
    weight: str,
    grid: int | None,
    symmetric: bool | None,
    params: Mapping[str, float],
    progress: bool,
) -> dict[int, Table]:
    """Fit tables with :func:`fewbit.solver.fit_many`, showing a tqdm progress bar."""
    from fewbit import solver  # heavy: numba / scipy

    kwargs: dict[str, Any] = dict(domain=domain, weight=weight, symmetric=symmetric, params=dict(params) or None)
    if grid is not None:
        kwargs["grid"] = grid
    if _is_user_function(name):
        _check_user_function(name, domain, params)
    with _ProgressBar(f"fit {name}", progress) as report:
        with _LibraryErrors(f"cannot fit {name}: "):
            try:
                tables = solver.fit_many(name, list(bits), progress=report, **kwargs)
            except (ImportError, AttributeError) as exc:
                # a user "module:callable" that does not import or has no such attribute
                if not _is_user_function(name):
                    raise
                raise ValueError(_one_line(exc)) from None
    return dict(tables)


def _check_user_function(spec: str, domain: tuple[float, float], params: Mapping[str, float]) -> None:
    """Load a ``module:callable`` and check that f' is finite on a dense sample of the domain
    and does not grow past it (:func:`fewbit.resolve.check_derivative_growth`).

    Raises:
        click.ClickException: the module does not import, the attribute is missing or not
            callable, the function changes shape, f' is not finite somewhere on the domain,
            or it grows past the domain.
    """
    import numpy as np

    from fewbit.solver import registry

    with _LibraryErrors(f"cannot fit {spec}: "):
        sf = registry.get(spec)
        x = np.linspace(domain[0], domain[1], 20001)
        df = np.asarray(sf.df(x, **params), dtype=np.float64)
    bad = ~np.isfinite(df)
    if bad.any():
        raise click.ClickException(
            f"cannot fit {spec}: its derivative is not finite on the domain (e.g. f'({x[bad][0]:g}) = {df[bad][0]})"
        )
    from fewbit.resolve import check_derivative_growth

    try:  # the table's end levels stand for f' past the domain (torch:exp: 43.93 on all of [-3, 3])
        check_derivative_growth(spec, lambda t: sf.df(t.numpy(), **params), domain)
    except ValueError as exc:
        raise click.ClickException(f"cannot fit {exc}") from None


def _fit_options(f: Callable) -> Callable:
    """Options shared by ``fit`` and ``error --refit``."""
    opts = [
        click.option("--weight", default="uniform", show_default=True, metavar="uniform|normal:SIGMA",
                     help="Weight of the objective (paper eq. 3)."),
        click.option("--grid", type=int, default=None, callback=_check_grid, metavar="N",
                     help="Grid points of the dynamic programme (solver default if omitted)."),
        click.option("--symmetric/--no-symmetric", default=None,
                     help="Fit on [0, B] and mirror (default: when f' is even)."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def _bits_option(help_text: str) -> Callable:
    return click.option("--bits", "-b", "bits", type=_BitsType(), multiple=True, callback=_flatten_bits,
                        metavar="B [B ...]", help=help_text)


_param_option = click.option(
    "--param", "-p", "params", type=_ParamType(), multiple=True, callback=_params_dict,
    metavar="KEY=VALUE [...]", help="Function parameter, e.g. --param alpha=0.5 (repeatable).",
)


# ---------------------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------------------


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning as one line on stderr (Python's shows the file, line and source: a
    numpy overflow inside a fit printed three lines before the command's error)."""
    click.echo(f"Warning: {_one_line_text(str(message))}", err=True)


class _Group(click.Group):
    """The top-level group: every error is reported as one line on stderr.

    click normally prints the usage text before a usage error; here the error and a
    pointer to the command's ``--help`` fit on one line, and no traceback is shown.
    """

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):  # noqa: D102
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            with warnings.catch_warnings():  # restores showwarning after
                warnings.showwarning = _show_warning
                rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.NoArgsIsHelpError as exc:  # `fewbit` alone: click's help, as it prints it
            exc.show()
            sys.exit(exc.exit_code)
        except click.UsageError as exc:
            hint = f" (see '{exc.ctx.command_path} --help')" if exc.ctx is not None else ""
            click.echo(f"Error: {_one_line_text(exc.format_message())}{hint}", err=True)
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            click.echo(f"Error: {_one_line_text(exc.format_message())}", err=True)
            sys.exit(exc.exit_code)
        except click.Abort as exc:
            click.echo("Aborted!", err=True)
            # Ctrl-C: the shell's 128 + SIGINT, as a command killed by it (scripts tell it
            # from a failure); an end of input at a prompt: 1
            sys.exit(130 if isinstance(exc.__cause__, KeyboardInterrupt) else 1)
        sys.exit(rv if isinstance(rv, int) else 0)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", "-V", prog_name="fewbit", message="%(prog)s %(version)s")
def cli() -> None:
    """fewbit: few-bit backward for activation functions (Novikov et al., ICML 2023).

    Fit, inspect and plot the tables that replace an activation's derivative by a
    piecewise-constant function with 2**bits levels.
    """




@cli.command("fit", cls=MultiValueCommand)
@click.argument("name")
@_bits_option("Bit widths to fit (default: 1 2 3 4).")
@click.option("--domain", nargs=2, type=float, default=None, callback=_check_domain, metavar="A B",
              help="Fitting interval [A, B] (default: -10 10).")
@_fit_options
@_param_option
@click.option("-o", "--output", type=OutputFile(), default=None,
              help="JSON file to write (default: ./<name>.json).")
@click.option("-f", "--force", is_flag=True, help="Overwrite the output file if it exists.")
@click.option("--progress/--no-progress", default=True, help="Show a progress bar on stderr.")
def fit_cmd(name, bits, domain, weight, grid, symmetric, params, output, force, progress) -> None:
    """Fit few-bit tables for NAME and write them as JSON.

    NAME is a registered activation (see `fewbit list`; e.g. gelu, silu, elu) or a
    user function "package.module:callable": a torch elementwise function of a float64
    tensor (f' is taken with torch autograd).

    A table q is piecewise constant with 2**bits levels. The fit minimises
    L = integral of (f'(x) - q(x))^2 w(x) dx over the domain [A, B] (Novikov et al.
    2023, eq. 3), w being the weight (--weight; uniform: w = 1, normal:SIGMA: the
    density of N(0, SIGMA^2)). Prints per bit width the error, the integral of
    (f'(x) - q(x))^2 dx over the domain (L with w = 1), and with another weight also
    the minimised L, labelled with its weight.

    Example: fewbit fit gelu --bits 1 2 3 4 --grid 2000 -o gelu.json
    \f
    The error is docs/method.md §3; the objective eq. 3 of the paper.
    """
    from fewbit.table import table_filename, write_tables

    cname, nd_params, act = _resolve(name, params)
    if act is not None and act.stepwise and (domain is not None or weight != "uniform" or grid is not None):
        # its table is exact (1 bit, borders at the steps): the fit takes none of them
        given = [opt for opt, v in (("--domain", domain), ("--weight", weight != "uniform" or None),
                                     ("--grid", grid)) if v is not None]
        raise click.ClickException(f"{cname} is stepwise: its table is exact, with no fit over a domain, so "
                                   f"{', '.join(given)} cannot apply")
    bits = bits or DEFAULT_BITS
    domain = domain or DEFAULT_DOMAIN
    path = output if output is not None else Path(table_filename(cname, nd_params))
    _check_writable(path, force)
    tables = _run_fit(cname, bits, domain=domain, weight=weight, grid=grid, symmetric=symmetric,
                      params=nd_params, progress=progress)
    try:
        write_tables(path, tables.values(), overwrite=force)
    except FileExistsError:
        raise click.ClickException(f"output file {path} was created while fitting; pass --force to overwrite "
                                   "it") from None
    except OSError as exc:
        raise click.ClickException(f"cannot write {path}: {exc.strerror or exc}") from None
    # written before the summary: a closed stdout (`| head -1`) must not lose the fit
    first = tables[min(tables)]
    dom = f"[{domain[0]:g}, {domain[1]:g}]"
    click.echo(f"{_what(cname, nd_params)} on {dom}, weight {first.weight}")
    if first.weight in ("uniform", "exact"):
        rows = [[str(b), _fmt_error(t.error), str(t.num_intervals)] for b, t in sorted(tables.items())]
        click.echo(_render_table(["bits", "error", "intervals"], rows))
        click.echo(f"error = integral of (f' - q)^2 dx over {dom} (w = 1), the objective the fit minimised")
    else:
        # The fit minimised the weighted objective; the uniform error is what `fewbit error`
        # and `fewbit list` show. Both are labelled.
        rows = [[str(b), _fmt_error(t.objective), _fmt_error(t.error), str(t.num_intervals)]
                for b, t in sorted(tables.items())]
        weighted = f"error (w = {first.weight})"
        click.echo(_render_table(["bits", weighted, "error (w = 1)", "intervals"], rows))
        click.echo(f"{weighted} = integral of (f' - q)^2 w dx over {dom}, the objective the fit minimised")
        click.echo(f"error (w = 1) = integral of (f' - q)^2 dx over {dom}, as `fewbit error` reports it")
    click.echo(f"wrote {path}")


@cli.command("error", cls=MultiValueCommand)
@click.argument("names", nargs=-1, required=True, metavar="NAME...")
@_bits_option("Bit widths (columns; default: 1 2 3 4).")
@click.option("--domain", nargs=2, type=float, default=None, callback=_check_domain, metavar="A B",
              help="Interval of the error integral (default: the table's, -10 10).")
@_param_option
@click.option("--json", "as_json", is_flag=True, help="Print {name: {bits: error}} as JSON.")
@click.option("--refit", is_flag=True, help="Fit the tables anew instead of using the shipped or cached ones.")
@_fit_options
@click.option("--progress/--no-progress", default=True, help="Show a progress bar on stderr (--refit).")
def error_cmd(names, bits, domain, params, as_json, refit, weight, grid, symmetric, progress) -> None:
    """Print the approximation error of the tables of each NAME.

    The error of a table q (piecewise constant, 2**bits levels) is the integral of
    (f'(x) - q(x))^2 dx over the domain [A, B] (Novikov et al. 2023, eq. 3 with
    weight w = 1), printed with 4 significant digits; rows are functions, columns bit
    widths. The tables are those the library uses: the exact table of a stepwise
    derivative (ReLU, ...), a shipped table, or one fitted earlier for these parameters
    and kept in the user cache. --refit fits them anew; with --domain the error is
    recomputed on that interval.

    Example: fewbit error gelu silu --bits 1 2 3 4
    \f
    The error is docs/method.md §3.
    """
    if not refit:
        given = [o for o, v in (("--weight", weight != "uniform"), ("--grid", grid is not None),
                                ("--symmetric/--no-symmetric", symmetric is not None)) if v]
        if given:
            verb = "applies" if len(given) == 1 else "apply"
            raise click.UsageError(f"{', '.join(given)} only {verb} with --refit (the fit options of new tables)")
    asked_bits, bits = bits, bits or DEFAULT_BITS
    results: dict[str, dict[int, float | None]] = {}
    missing: list[str] = []
    cached: list[str] = []
    resolved = [(name, *_resolve(name, params)) for name in names]
    for name, cname, nd_params, act in resolved:
        if refit:
            tables = _run_fit(cname, bits, domain=domain or DEFAULT_DOMAIN, weight=weight, grid=grid,
                              symmetric=symmetric, params=nd_params, progress=progress)
        else:
            found = _find_tables(cname, nd_params, bits)
            if not found:
                hint = _command_line("fewbit", "error", cname, *_param_args(nd_params), *_bits_args(asked_bits),
                                     "--refit")
                raise click.ClickException(f"{_nothing_found(cname, nd_params, bits)}; fit them with `{hint}`")
            tables = {b: t for b, (t, _) in found.items()}
            note = _cache_note(found)
            if note:
                cached.append(_what(cname, nd_params) + ": " + note[2:])
        row: dict[int, float | None] = {}
        for b in bits:
            table = tables.get(b)
            if table is None:
                row[b] = None
                missing.append(f"{cname}@{b}")
                continue
            err = table.error
            if domain is not None and (tuple(domain) != tuple(table.domain) or err is None):
                err = _recompute_error(table, cname, act, nd_params, domain)
            elif err is None:
                err = _recompute_error(table, cname, act, nd_params, tuple(table.domain))
            row[b] = float(err)
        results[name] = row
    if as_json:
        click.echo(json.dumps({n: {str(b): e for b, e in r.items()} for n, r in results.items()}, indent=1))
    else:
        header = ["function"] + [f"{b} bit" + ("s" if b > 1 else "") for b in bits]
        rows = [[n] + [_fmt_error(r[b]) for b in bits] for n, r in results.items()]
        click.echo(_render_table(header, rows))
        dom = domain or DEFAULT_DOMAIN
        click.echo(f"error = integral of (f' - q)^2 over [{dom[0]:g}, {dom[1]:g}] (uniform weight)")
    for line in cached:
        click.echo(f"note: {line}", err=True)
    if missing:
        click.echo(f"note: no shipped or cached table for {', '.join(missing)} (n/a); use --refit", err=True)


def _recompute_error(table: Table, name: str, act: Any, params: Mapping[str, float],
                     domain: tuple[float, float]) -> float:
    from fewbit import solver

    with _LibraryErrors(f"cannot compute the error of {name}: "):
        return float(solver.approximation_error(table, domain=domain))


@cli.command("list")
def list_cmd() -> None:
    """List the shipped tables with their bit widths and errors.

    The error of a table q (piecewise constant, 2**bits levels) is the integral of
    (f'(x) - q(x))^2 dx over the table's domain (Novikov et al. 2023, eq. 3 with
    weight w = 1).
    \f
    The error is docs/method.md §3.
    """
    from fewbit.table import loads_tables, shipped_table_files

    files = shipped_table_files()
    if not files:
        click.echo("no shipped tables found in fewbit.tables")
        return
    entries = []
    for fname in sorted(files):
        with _LibraryErrors():
            tables = loads_tables(files[fname].read_text(encoding="utf-8"), source=f"fewbit.tables/{fname}")
        entries.append((fname, tables))
    all_bits = sorted({b for _, t in entries for b in t})
    header = ["function", "params", "domain", "weight", "sym"] + [f"{b}b" for b in all_bits]
    rows = []
    for fname, tables in sorted(entries, key=lambda e: (next(iter(e[1].values())).name, e[0])):
        first = next(iter(tables.values()))
        dom = f"[{first.domain[0]:g}, {first.domain[1]:g}]"
        rows.append(
            [first.name, _fmt_params(first.params), dom, first.weight, "yes" if first.symmetric else "no"]
            + [_fmt_error(tables[b].error) if b in tables else "" for b in all_bits]
        )
    click.echo(_render_table(header, rows, right_from=5))
    click.echo(f"{len(rows)} tables; error = integral of (f' - q)^2 dx over the domain "
               "(Novikov et al. 2023, eq. 3 with w = 1)")


@cli.command("plot", cls=MultiValueCommand)
@click.argument("name")
@_bits_option("Bit widths to draw (default: 1 2 3 4, those available).")
@_param_option
@click.option("--table", "table_path", type=click.Path(dir_okay=False, exists=True, path_type=Path),
              default=None,
              help="Plot the tables of this JSON file (from `fewbit fit`) instead of the shipped or cached ones.")
@click.option("--xlim", nargs=2, type=float, default=None, callback=_check_domain, metavar="A B",
              help="x range of the plot (default: the table's domain).")
@click.option("-o", "--output", type=OutputFile(), default=None,
              help="Image to write, in the format of its suffix (png, pdf, svg, ...; default: ./<name>.png).")
@click.option("-f", "--force", is_flag=True, help="Overwrite the output file if it exists.")
def plot_cmd(name, bits, params, table_path, xlim, output, force) -> None:
    """Plot f' of NAME with its few-bit approximations q and the error |f' - q|.

    Top panel: f' and one step line per bit width, the legend giving each table's
    error, the integral of (f'(x) - q(x))^2 dx over the table's domain (Novikov et al. 2023,
    eq. 3 with weight w = 1); bottom panel: the pointwise error |f' - q| on a log
    scale. The tables are those the library uses (exact, shipped, or fitted earlier
    and kept in the user cache), or those of --table; none is fitted here.

    Example: fewbit plot gelu --bits 1 2 3 4 -o gelu.png
    \f
    The error is docs/method.md §3.
    """
    from fewbit.table import table_filename

    note = ""
    if table_path is not None:
        from fewbit.table import read_tables

        with _LibraryErrors():
            tables = read_tables(table_path)
        first = next(iter(tables.values()))
        asked = name if _is_user_function(name) else _resolve(name, {})[0]
        if asked != first.name:
            raise click.ClickException(f"{table_path} holds tables of {first.name!r}, not {name!r}")
        cname, nd_params, act = _resolve(first.name, first.params)
        if params and _resolve(first.name, params)[1] != nd_params:
            raise click.ClickException(
                f"{table_path} holds tables for {_what(cname, nd_params)}, not for --param {_fmt_params(params)}"
            )
        if bits:
            absent = [str(b) for b in bits if b not in tables]
            if absent:
                raise click.ClickException(
                    f"{table_path} has no table at bits {', '.join(absent)} "
                    f"(it has bits {', '.join(map(str, sorted(tables)))})"
                )
            chosen = {b: tables[b] for b in bits}
        else:
            chosen = {b: t for b, t in sorted(tables.items()) if b in DEFAULT_BITS} or dict(sorted(tables.items()))
    else:
        cname, nd_params, act = _resolve(name, params)
        wanted = bits or DEFAULT_BITS
        found = _find_tables(cname, nd_params, wanted)
        absent = [b for b in wanted if b not in found]
        if bits and absent or not found:
            fname = table_filename(cname, nd_params)
            fit_cmd_line = _command_line("fewbit", "fit", cname, *_param_args(nd_params), *_bits_args(bits))
            plot_line = _command_line("fewbit", "plot", cname, *_bits_args(bits), "--table", fname)
            raise click.ClickException(
                f"{_nothing_found(cname, nd_params, absent)}; fit them with `{fit_cmd_line}` "
                f"(writes {fname}) and plot that with `{plot_line}`"
            )
        if act is not None and act.stepwise and not bits:
            found = {1: found[1]}  # the exact 1-bit table serves every width
        chosen = {b: t for b, (t, _) in sorted(found.items())}
        note = _cache_note(found)
    path = output if output is not None else Path(f"{cname.replace(':', '--')}.png")
    fmt = _image_format(path)
    _check_writable(path, force)
    try:
        with _LibraryErrors(f"cannot plot {cname}: "):
            _plot(cname, act, nd_params, chosen, xlim, path, fmt, overwrite=force)
    except FileExistsError:
        raise click.ClickException(f"output file {path} was created while plotting; pass --force to overwrite "
                                   "it") from None
    click.echo(f"wrote {path}" + (f" ({note[2:]})" if note else ""))


def _image_format(path: Path) -> str:
    """The image format of ``-o PATH`` from its suffix (``png`` without one), one that
    matplotlib writes; a one-line error for another (``plot.txt`` was PNG data)."""
    from matplotlib.figure import Figure

    fmt = path.suffix.lower().lstrip(".") or "png"
    supported = Figure().canvas.get_supported_filetypes()
    if fmt not in supported:
        raise click.BadParameter(f"{path}: .{fmt} is not an image format matplotlib writes "
                                 f"(use one of: {', '.join(sorted(supported))})", param_hint="'-o' / '--output'")
    return fmt


def _plot(name: str, act: Any, params: Mapping[str, float], tables: Mapping[int, Table],
          xlim: tuple[float, float] | None, path: Path, fmt: str = "png", *, overwrite: bool = True) -> None:
    import numpy as np

    from fewbit.solver import approximation_error, registry

    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fn = registry.get(name)
    full = _full_params(act, params)
    first = next(iter(tables.values()))
    lo, hi = xlim or first.domain
    # Dense grid plus the borders themselves so that the steps are drawn sharply.
    borders = np.unique(np.concatenate([np.asarray(t.borders) for t in tables.values()] or [np.empty(0)]))
    x = np.union1d(np.linspace(lo, hi, 4001), borders[(borders > lo) & (borders < hi)])
    dfx = np.asarray(fn.df(x, **full), dtype=np.float64)

    fig, (ax_top, ax_err) = plt.subplots(
        2, 1, figsize=(9, 7.5), sharex=True, layout="constrained", gridspec_kw={"height_ratios": [3, 2]}
    )
    colors = plt.get_cmap("viridis")(np.linspace(0.0, 0.85, max(len(tables), 1)))
    ax_top.plot(x, dfx, color="black", lw=2.4, label="f'(x) (exact)", zorder=3)
    floor = 1e-12
    for color, (b, table) in zip(colors, sorted(tables.items())):
        q = table.evaluate(x)
        try:  # the table's own error, not the figure its file states (an edited file kept the old one)
            err = approximation_error(table)
        except ValueError:
            err = table.error
        label = f"{b} bit{'s' if b > 1 else ''}: error {_fmt_error(err)}"
        # q is constant on (b_{i-1}, b_i] (searchsorted side="left") and x holds the borders,
        # so "pre" steps draw the table exactly.
        ax_top.step(x, q, where="pre", color=color, lw=1.6, label=label, zorder=2)
        ax_err.semilogy(x, np.maximum(np.abs(dfx - q), floor), color=color, lw=1.2, label=f"{b} bit{'s' if b > 1 else ''}")
    pstr = "" if not params else f" ({_fmt_params(params)})"
    ax_top.set_title(f"{name}{pstr}: derivative f'(x) and its few-bit approximations q(x)", fontsize=12)
    ax_top.set_ylabel("f'(x),  q(x)")
    ax_top.grid(True, alpha=0.3)
    ax_top.legend(loc="best", fontsize=9, framealpha=0.9,
                  title=f"error = ∫ (f' − q)² dx over [{first.domain[0]:g}, {first.domain[1]:g}]",
                  title_fontsize=9)
    ax_err.set_ylabel("|f'(x) − q(x)|  (log scale)")
    ax_err.set_xlabel("x")
    ax_err.grid(True, which="major", alpha=0.3)
    finite = np.abs(dfx[:, None] - np.stack([t.evaluate(x) for t in tables.values()], 1))
    top = float(finite.max()) if finite.size else 1.0
    ax_err.set_ylim(max(top * 1e-5, floor), top * 2 if top > 0 else 1.0)
    ax_err.set_xlim(lo, hi)
    ax_err.legend(loc="best", fontsize=8, ncol=min(len(tables), 4), framealpha=0.9)
    try:
        with atomic_output(path, suffix=f".{fmt}", overwrite=overwrite) as tmp:
            fig.savefig(tmp, dpi=120, format=fmt)
    finally:
        plt.close(fig)


cli.add_command(memory)
cli.add_command(plan)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``fewbit`` console script.

    As with ``python -m``, the current directory goes first on ``sys.path``, so that a
    user function named ``mypkg.acts:my_act`` imports from the directory the command runs
    in (a console script otherwise sees only its own ``bin/`` directory).
    """
    try:
        cwd = os.getcwd()
    except OSError:  # the current directory was deleted: nothing to import from it
        cwd = None
    if cwd is not None and (not sys.path or sys.path[0] != cwd):
        sys.path.insert(0, cwd)
    cli.main(args=list(argv) if argv is not None else None, prog_name="fewbit")


if __name__ == "__main__":  # pragma: no cover
    main()
