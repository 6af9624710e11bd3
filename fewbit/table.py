"""Few-bit tables: the one schema shared by the solver (writer) and the runtime (reader).

A table for (function, parameters, bits) holds three arrays (docs/method.md §2; Novikov et al.,
"Few-bit Backward", ICML 2023, sec. 3):

- ``borders``: ``m - 1`` strictly increasing finite floats, the interior interval ends;
- ``codes``: ``m`` integers in ``[0, 2**bits)``, the code of each interval;
- ``values``: ``2**bits`` floats, the derivative approximation of each code.

The interval index of ``x`` is the number of borders strictly less than ``x``
(``torch.searchsorted(borders, x, right=False)``), so interval ``i`` is
``(borders[i-1], borders[i]]``; ``code(x) = codes[i(x)]`` and ``q(x) = values[code(x)]``.

On disk a JSON file holds every bit width fitted for one function and parameter set::

    {
      "schema_version": 1,
      "name": "gelu",
      "params": {},
      "symmetric": false,
      "domain": [-10.0, 10.0],
      "weight": "uniform",
      "provenance": {"solver_version": "...", "grid": 10000, "command": "..."},
      "tables": {"1": {"borders": [...], "codes": [...], "values": [...], "error": 0.1}, ...}
    }

Files are read with :func:`json.loads` only (never pickle) and written atomically.
This module imports nothing beyond the standard library.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

__all__ = [
    "SCHEMA_VERSION",
    "Table",
    "TableFormatError",
    "dumps_tables",
    "loads_tables",
    "read_tables",
    "write_tables",
    "atomic_output",
    "table_filename",
    "shipped_table_files",
    "load_shipped",
]

#: Version of the JSON layout above. Readers refuse any other version.
SCHEMA_VERSION = 1


class TableFormatError(ValueError):
    """A table file is missing, corrupt, or of another schema version."""


def _check_bits(bits: Any, name: str = "bits") -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"{name} must be an integer in 1..8, got {bits!r}")
    return bits


@dataclass(frozen=True)
class Table:
    """A piecewise-constant approximation of an activation's derivative for ``bits`` bits.

    Args:
        name: registry name of the function (e.g. ``"gelu"``), or ``"module:callable"``.
        bits: bits per element of the code, 1..8.
        borders: ``(m - 1,)`` strictly increasing finite floats (float64 semantics).
        codes: ``(m,)`` integers in ``[0, 2**bits)``, the code of each interval.
        values: ``(2**bits,)`` finite floats, the derivative level of each code.
        error: the approximation error of docs/method.md §3 (uniform weight over ``domain``),
            or ``None`` if unknown.
        params: the function's parameters the table was fitted for (e.g. ``{"alpha": 1.0}``).
        domain: ``(A, B)`` the fitting interval.
        weight: the weight used to fit (``"uniform"``, ``"normal:SIGMA"``, ``"histogram"``,
            or ``"exact"`` for stepwise derivatives).
        symmetric: whether the table was fitted on ``[0, B]`` and mirrored (docs/method.md §2).
        provenance: free-form metadata (solver version, grid, command that regenerates it).

    Raises:
        ValueError: if the arrays do not satisfy the constraints above.
    """

    name: str
    bits: int
    borders: tuple[float, ...]
    codes: tuple[int, ...]
    values: tuple[float, ...]
    error: float | None = None
    params: Mapping[str, float] = field(default_factory=dict)
    domain: tuple[float, float] = (-10.0, 10.0)
    weight: str = "uniform"
    symmetric: bool = False
    provenance: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        _check_bits(self.bits)
        object.__setattr__(self, "borders", tuple(float(b) for b in self.borders))
        object.__setattr__(self, "codes", tuple(int(c) for c in self.codes))
        object.__setattr__(self, "values", tuple(float(v) for v in self.values))
        object.__setattr__(self, "params", dict(self.params))
        object.__setattr__(self, "domain", tuple(float(d) for d in self.domain))
        b, c, v = self.borders, self.codes, self.values
        if not all(math.isfinite(x) for x in b):
            raise ValueError(f"borders must be finite, got {list(b)}")
        if any(b[i] >= b[i + 1] for i in range(len(b) - 1)):
            raise ValueError(f"borders must be strictly increasing, got {list(b)}")
        if len(c) != len(b) + 1:
            raise ValueError(
                f"codes must have len(borders) + 1 = {len(b) + 1} entries, got {len(c)}"
            )
        n_codes = 1 << self.bits
        if any(not 0 <= x < n_codes for x in c):
            raise ValueError(f"codes must be in [0, {n_codes}) for bits={self.bits}, got {list(c)}")
        if len(v) != n_codes:
            raise ValueError(f"values must have 2**bits = {n_codes} entries, got {len(v)}")
        if not all(math.isfinite(x) for x in v):
            raise ValueError(f"values must be finite, got {list(v)}")
        if len(self.domain) != 2 or not self.domain[0] < self.domain[1]:
            raise ValueError(f"domain must be (A, B) with A < B, got {self.domain}")

    @property
    def num_intervals(self) -> int:
        """Number of intervals ``m`` (``len(borders) + 1``)."""
        return len(self.borders) + 1

    def to_dict(self) -> dict[str, Any]:
        """The per-bit-width JSON record (``borders``, ``codes``, ``values``, ``error``)."""
        return {
            "borders": list(self.borders),
            "codes": list(self.codes),
            "values": list(self.values),
            "error": self.error,
        }


def _params_key(params: Mapping[str, float] | None) -> str:
    if not params:
        return ""
    return ",".join(f"{k}={float(params[k])!r}" for k in sorted(params))


def table_filename(name: str, params: Mapping[str, float] | None = None) -> str:
    """File name of the table for ``name`` with non-default ``params``.

    ``table_filename("gelu")`` is ``"gelu.json"``;
    ``table_filename("elu", {"alpha": 0.5})`` is ``"elu@alpha=0.5.json"``.
    """
    safe = name.replace(":", "--").replace("/", "_")
    key = _params_key(params)
    return f"{safe}@{key}.json" if key else f"{safe}.json"


def dumps_tables(tables: Iterable[Table]) -> str:
    """Serialise tables of one function and parameter set (several bit widths) to JSON.

    Raises:
        ValueError: if ``tables`` is empty or mixes functions, parameters or domains.
    """
    tables = sorted(tables, key=lambda t: t.bits)
    if not tables:
        raise ValueError("tables must not be empty")
    first = tables[0]
    bits = [t.bits for t in tables]
    if len(set(bits)) != len(bits):
        raise ValueError(f"each bit width may appear once, got bits {bits}")
    for t in tables[1:]:
        if (t.name, dict(t.params), t.symmetric) != (first.name, dict(first.params), first.symmetric):
            raise ValueError("all tables of one file must share name, params and symmetric")
    doc = {
        "schema_version": SCHEMA_VERSION,
        "name": first.name,
        "params": dict(first.params),
        "symmetric": first.symmetric,
        "domain": list(first.domain),
        "weight": first.weight,
        "provenance": dict(first.provenance),
        "tables": {str(t.bits): t.to_dict() for t in tables},
    }
    return json.dumps(doc, indent=1, sort_keys=False) + "\n"


def loads_tables(text: str, *, source: str = "<string>") -> dict[int, Table]:
    """Parse a JSON table file; returns ``{bits: Table}``.

    Raises:
        TableFormatError: if the text is not valid JSON, is of another schema version,
            or any table in it is invalid.
    """
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TableFormatError(f"{source}: not a valid table file ({exc})") from None
    if not isinstance(doc, dict):
        raise TableFormatError(f"{source}: not a valid table file (top level is not an object)")
    version = doc.get("schema_version")
    if version != SCHEMA_VERSION:
        raise TableFormatError(
            f"{source}: schema_version must be {SCHEMA_VERSION}, got {version!r}"
        )
    out: dict[int, Table] = {}
    try:
        for key, rec in doc["tables"].items():
            out[int(key)] = Table(
                name=doc["name"],
                bits=int(key),
                borders=rec["borders"],
                codes=rec["codes"],
                values=rec["values"],
                error=rec.get("error"),
                params=doc.get("params", {}),
                domain=tuple(doc.get("domain", (-10.0, 10.0))),
                weight=doc.get("weight", "uniform"),
                symmetric=bool(doc.get("symmetric", False)),
                provenance=doc.get("provenance", {}),
            )
    except (KeyError, TypeError, ValueError) as exc:
        raise TableFormatError(f"{source}: invalid table ({exc})") from None
    if not out:
        raise TableFormatError(f"{source}: holds no tables")
    return out


def read_tables(path: str | os.PathLike) -> dict[int, Table]:
    """Read a JSON table file from ``path``; returns ``{bits: Table}``.

    Raises:
        TableFormatError: if the file is missing, unreadable or invalid.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TableFormatError(f"{path}: cannot read table file ({exc.strerror or exc})") from None
    return loads_tables(text, source=str(path))


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, suffix: str = ".tmp") -> Iterator[str]:
    """Yield a temporary file name beside ``path``; on success rename it onto ``path``.

    Nothing is left half-written: on any error the temporary file is removed and the
    previous ``path``, if any, is unchanged.

    Raises:
        OSError: if the directory is not writable.
    """
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=directory)
    os.close(fd)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_tables(path: str | os.PathLike, tables: Iterable[Table]) -> Path:
    """Write tables to ``path`` atomically (a temporary file renamed into place).

    Nothing is left half-written: on any error the previous file, if any, is unchanged.

    Raises:
        OSError: if the directory is not writable.
    """
    path = Path(path)
    text = dumps_tables(tables)
    with atomic_output(path) as tmp:
        Path(tmp).write_text(text, encoding="utf-8")
    return path


def shipped_table_files() -> dict[str, Any]:
    """The JSON files shipped in the ``fewbit.tables`` package: ``{file name: Traversable}``."""
    root = resources.files("fewbit.tables")
    return {p.name: p for p in root.iterdir() if p.name.endswith(".json")}


def load_shipped(name: str, params: Mapping[str, float] | None = None) -> dict[int, Table] | None:
    """Load the shipped tables of ``name`` for ``params`` (``None`` or ``{}``: defaults).

    Returns ``{bits: Table}``, or ``None`` if no such file is shipped.

    Raises:
        TableFormatError: if the shipped file is corrupt.
    """
    fname = table_filename(name, params)
    files = shipped_table_files()
    if fname not in files:
        return None
    return loads_tables(files[fname].read_text(encoding="utf-8"), source=f"fewbit.tables/{fname}")
