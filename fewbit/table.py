"""Few-bit tables: the one schema shared by the solver (writer) and the runtime (reader).

A table for (function, parameters, bits) holds three arrays (docs/method.md §2; Novikov et al.,
"Few-bit Backward", ICML 2023, sec. 3):

- ``borders``: ``m - 1`` strictly increasing finite floats, the interior interval ends;
- ``codes``: ``m`` integers in ``[0, 2**bits)``, the code of each interval;
- ``values``: ``2**bits`` floats, the derivative approximation of each code.

The interval index of ``x`` is the number of borders strictly less than ``x``
(``torch.searchsorted(borders, x, right=False)``), so interval ``i`` is
``(borders[i-1], borders[i]]``; ``code(x) = codes[i(x)]`` and ``q(x) = values[code(x)]``
(:meth:`Table.code`, :meth:`Table.evaluate`). A table fitted on ``[0, C]`` for an even
derivative is stored mirrored (:func:`mirrored_code_map`), so the same lookup serves it.

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

``schema_version``, ``name`` and ``tables`` are required; the other top-level fields
default to the values shown (``params`` ``{}``, ``symmetric`` false, ``domain``
``[-10, 10]``, ``weight`` ``"uniform"``, ``provenance`` ``{}``). A bit-width record may
also hold ``objective`` (the weighted objective the fit minimised) and its own
``provenance`` (when it differs from the file's). Keys of ``tables`` are ``"1"`` to ``"8"``.

Files are read with :func:`json.loads` only (never pickle) and validated strictly: every
field must have its JSON type (numbers are numbers, not strings; codes are integers;
``symmetric`` is true or false), numbers must be finite (``NaN``/``Infinity`` are refused),
levels must be finite in float32 (the kernels compute in it), and unknown or duplicate
keys are refused, so a typo never silently falls back to a default. Any problem raises one
:class:`TableFormatError` naming the file, the field and the value. Files are written
atomically, with the permissions of an ordinary new file (``0o666`` minus the umask) or
those of the file they replace. This module imports nothing beyond the standard library
and :mod:`fewbit._checks` (torch-free until a tensor is checked); numpy is imported by the
evaluation methods only.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import numbers
import os
import re
import stat
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

from fewbit._checks import check_bits, is_int

__all__ = [
    "SCHEMA_VERSION",
    "MAX_FILE_SIZE",
    "Table",
    "TableFormatError",
    "mirrored_code_map",
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

#: Largest table file read, in bytes (a 8-bit table is about 60 kB; anything near this
#: limit is not a table file).
MAX_FILE_SIZE = 4 * 1024 * 1024

# A float64 at or beyond this magnitude rounds to inf in float32 (2**128 - 2**103 is the
# midpoint between the largest float32 and 2**128; ties round to the even 2**128).
_FLOAT32_OVERFLOW = 2.0**128 - 2.0**103


class TableFormatError(ValueError):
    """A table file is missing, corrupt, or of another schema version.

    A subclass of ``ValueError``; the message names the file (or source) and the problem.
    """


def _short(value: Any, limit: int = 60) -> str:
    """``value`` as JSON (as it was in the file), else its repr; at most ``limit`` characters."""
    try:
        text = json.dumps(value, allow_nan=True)
    except (TypeError, ValueError, RecursionError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _real(name: str, x: Any) -> float:
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise ValueError(f"{name} must be a number, got {_short(x)}")
    return float(x)


def _sequence(name: str, seq: Any) -> list:
    if isinstance(seq, (str, bytes, Mapping)) or not isinstance(seq, Iterable):
        raise ValueError(f"{name} must be a list of numbers, got {_short(seq)}")
    return list(seq)


def _reals(name: str, seq: Any) -> tuple[float, ...]:
    return tuple(_real(f"{name}[{i}]", x) for i, x in enumerate(_sequence(name, seq)))


def _integers(name: str, seq: Any) -> tuple[int, ...]:
    out = []
    for i, x in enumerate(_sequence(name, seq)):
        if not is_int(x):
            raise ValueError(f"{name}[{i}] must be an integer, got {_short(x)}")
        out.append(int(x))
    return tuple(out)


def _optional_nonnegative(name: str, x: Any) -> float | None:
    if x is None:
        return None
    x = _real(name, x)
    if not (math.isfinite(x) and x >= 0):
        raise ValueError(f"{name} must be a finite number >= 0 or None, got {x!r}")
    return x


def _params(params: Any) -> dict[str, float]:
    if not isinstance(params, Mapping):
        raise ValueError(f"params must be a mapping of names to numbers, got {_short(params)}")
    out = {}
    for k, v in params.items():
        if not isinstance(k, str) or not k.isidentifier():
            raise ValueError(f"params: parameter names must be identifiers, got {_short(k)}")
        v = _real(f"params.{k}", v)
        if not math.isfinite(v):
            raise ValueError(f"params.{k} must be finite, got {v!r}")
        out[k] = v
    return out


@dataclass(frozen=True)
class Table:
    """A piecewise-constant approximation of an activation's derivative for ``bits`` bits.

    Args:
        name: registry name of the function (e.g. ``"gelu"``), or ``"module:callable"``
            (printable, at most 256 characters).
        bits: bits per element of the code, 1..8.
        borders: ``(m - 1,)`` strictly increasing finite floats (float64 semantics).
        codes: ``(m,)`` integers in ``[0, 2**bits)``, the code of each interval.
        values: ``(2**bits,)`` finite floats, the derivative level of each code.
        error: the approximation error of docs/method.md §3 (uniform weight over ``domain``),
            or ``None`` if unknown.
        objective: the objective the fit minimised, ``L = int (f' - q)^2 w`` over ``domain``
            with the fit's ``weight`` (Novikov et al., ICML 2023, eq. 3), or ``None`` if
            unknown; equal to ``error`` for the uniform weight. Like ``provenance``, it
            records how the table was fitted and is not compared by ``==``.
        params: the function's parameters the table was fitted for (e.g. ``{"alpha": 1.0}``).
        domain: ``(A, B)`` the fitting interval.
        weight: the weight used to fit (``"uniform"``, ``"normal:SIGMA"``, ``"histogram"``,
            or ``"exact"`` for stepwise derivatives).
        symmetric: whether the table was fitted on ``[0, B]`` and mirrored (docs/method.md §2).
        provenance: free-form metadata (solver version, grid, command that regenerates it).

    Raises:
        ValueError: if a field does not satisfy the constraints above (numbers must be real
            numbers, not strings or booleans; codes integers; values finite in float32).
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
    objective: float | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        name = self.name
        if not isinstance(name, str) or not name or len(name) > 256 or not name.isprintable():
            # (printable: a newline or a bidi override would garble or spoof messages)
            raise ValueError(f"name must be a non-empty string of printable characters (at most 256), "
                             f"got {_short(name)}")
        object.__setattr__(self, "bits", check_bits(self.bits))
        b = _reals("borders", self.borders)
        c = _integers("codes", self.codes)
        v = _reals("values", self.values)
        object.__setattr__(self, "borders", b)
        object.__setattr__(self, "codes", c)
        object.__setattr__(self, "values", v)
        object.__setattr__(self, "params", _params(self.params))
        object.__setattr__(self, "domain", _reals("domain", self.domain))
        object.__setattr__(self, "error", _optional_nonnegative("error", self.error))
        object.__setattr__(self, "objective", _optional_nonnegative("objective", self.objective))
        if not isinstance(self.weight, str) or not self.weight:
            raise ValueError(f"weight must be a non-empty string, got {self.weight!r}")
        if not isinstance(self.symmetric, bool):
            raise ValueError(f"symmetric must be True or False, got {self.symmetric!r}")
        if not isinstance(self.provenance, Mapping):
            raise ValueError(f"provenance must be a mapping, got {type(self.provenance).__name__}")
        object.__setattr__(self, "provenance", dict(self.provenance))
        for i, x in enumerate(b):
            if not math.isfinite(x):
                raise ValueError(f"borders must be finite, got borders[{i}] = {x!r}")
            if i and not b[i - 1] < x:
                raise ValueError(
                    f"borders must be strictly increasing, got borders[{i - 1}] = {b[i - 1]!r} "
                    f"then borders[{i}] = {x!r}"
                )
        if len(c) != len(b) + 1:
            raise ValueError(
                f"codes must have len(borders) + 1 = {len(b) + 1} entries, got {len(c)}"
            )
        n_codes = 1 << self.bits
        for i, x in enumerate(c):
            if not 0 <= x < n_codes:
                raise ValueError(f"codes must be in [0, {n_codes}) for bits={self.bits}, got codes[{i}] = {x}")
        if len(v) != n_codes:
            raise ValueError(f"values must have 2**bits = {n_codes} entries, got {len(v)}")
        for i, x in enumerate(v):
            if not abs(x) < _FLOAT32_OVERFLOW:
                what = "finite" if not math.isfinite(x) else "finite in float32 (|value| < 3.4e38)"
                raise ValueError(f"values must be {what}, got values[{i}] = {x!r}")
        d = self.domain
        if len(d) != 2 or not all(math.isfinite(x) for x in d) or not d[0] < d[1]:
            raise ValueError(f"domain must be (A, B), finite, with A < B, got {list(d)}")

    @property
    def num_intervals(self) -> int:
        """Number of intervals ``m`` (``len(borders) + 1``)."""
        return len(self.borders) + 1

    def code(self, x: Any) -> Any:
        """``code(x) = codes[i(x)]``, ``i(x) = searchsorted(borders, x, side='left')``
        (docs/method.md §2), in float64: the codes the kernels compute (their pure-torch
        reference is :func:`fewbit.ops.encode_reference`).

        Args:
            x: a number or array-like of any shape, converted to float64 (a CPU tensor
                that needs no grad works; convert bfloat16 first). NaN lands in the last
                interval, -inf in the first.

        Returns:
            ``numpy.ndarray`` of int64 of the shape of ``x``.
        """
        import numpy as np

        x = np.asarray(x, dtype=np.float64)
        idx = np.searchsorted(np.asarray(self.borders, dtype=np.float64), x, side="left")
        return np.asarray(self.codes, dtype=np.int64)[idx]

    def evaluate(self, x: Any) -> Any:
        """``q(x) = values[code(x)]``, the table's approximation of ``f'`` (docs/method.md §2).

        Args:
            x: as :meth:`code`.

        Returns:
            ``numpy.ndarray`` of float64 of the shape of ``x``.
        """
        import numpy as np

        return np.asarray(self.values, dtype=np.float64)[self.code(x)]

    def to_dict(self) -> dict[str, Any]:
        """The per-bit-width JSON record (``borders``, ``codes``, ``values``, ``error``,
        and ``objective`` when known)."""
        out = {
            "borders": list(self.borders),
            "codes": list(self.codes),
            "values": list(self.values),
            "error": self.error,
        }
        if self.objective is not None:
            out["objective"] = self.objective
        return out


def mirrored_code_map(half_borders: Sequence[float]) -> tuple[list[float], list[int]]:
    """Borders and codes of a table fitted on ``[0, C]`` for an even ``f'`` and mirrored
    (docs/method.md §2; the parity argument of Novikov et al., ICML 2023).

    ``K - 1`` increasing positive borders ``s_1 < ... < s_{K-1}`` of ``K`` pieces on
    ``[0, C]`` give ``2K - 2`` borders ``-s_{K-1}, ..., -s_1, s_1, ..., s_{K-1}`` and
    ``2K - 1`` intervals with codes ``K-1, ..., 1, 0, 1, ..., K-1``: the central interval
    ``(-s_1, s_1]`` has code 0 and piece ``k`` of ``[0, C]`` shares its code ``k`` (and
    its level ``values[k]``) with its mirror image.

    Args:
        half_borders: the ``K - 1`` borders on ``[0, C]``, increasing and positive (not
            checked here; :class:`Table` refuses the result if they are not).

    Returns:
        ``(borders, codes)``: ``2K - 2`` floats and ``2K - 1`` codes in ``[0, K)``.
    """
    half = [float(s) for s in half_borders]
    k = len(half) + 1
    return [-s for s in reversed(half)] + half, list(range(k - 1, 0, -1)) + list(range(k))


def _params_key(params: Mapping[str, float] | None) -> str:
    if not params:
        return ""
    return ",".join(f"{k}={float(params[k])!r}" for k in sorted(params))


def table_filename(name: str, params: Mapping[str, float] | None = None) -> str:
    """File name of the table for ``name`` with non-default ``params``.

    ``table_filename("gelu")`` is ``"gelu.json"``;
    ``table_filename("elu", {"alpha": 0.5})`` is ``"elu@alpha=0.5.json"``. A name longer
    than :data:`MAX_FILENAME` bytes (file systems refuse more than 255) keeps its first 96
    bytes (UTF-8, whole characters) and a SHA-256 digest of the whole: ``"<start>~<16 hex>.json"``.

    Args:
        name: registry name or ``"module:callable"`` (``:`` is written ``--``, ``/`` is ``_``).
        params: non-default parameters (``None`` or ``{}``: none), sorted by name, values
            written as ``repr(float(v))``.

    Returns:
        str: a file name (no directory) of at most :data:`MAX_FILENAME` bytes in UTF-8.
    """
    safe = name.replace(":", "--").replace("/", "_")
    key = _params_key(params)
    full = f"{safe}@{key}.json" if key else f"{safe}.json"
    if len(full.encode()) <= MAX_FILENAME:
        return full
    import hashlib

    start = full.encode()[:96].decode(errors="ignore")  # bytes are what the limit counts (a CJK name)
    return f"{start}~{hashlib.sha256(full.encode()).hexdigest()[:16]}.json"


#: Longest table file name kept as it is (bytes): longer ones are shortened by
#: :func:`table_filename` (a user function's 244-character name raised ENAMETOOLONG).
MAX_FILENAME = 200


def dumps_tables(tables: Iterable[Table]) -> str:
    """Serialise tables of one function and parameter set (several bit widths) to JSON.

    The file-level ``provenance`` is that of the lowest bit width; a table whose
    provenance differs keeps its own in its record.

    Args:
        tables: :class:`Table` objects, in any order (written sorted by bits).

    Returns:
        str: the JSON text (schema :data:`SCHEMA_VERSION`, indented, ending in a newline).

    Raises:
        ValueError: if ``tables`` is empty, holds a bit width twice, or mixes functions,
            parameters, symmetry, domains or weights; also (from :func:`json.dumps`) if a
            ``provenance`` holds a NaN or infinity.
        TypeError: (from :func:`json.dumps`) if a ``provenance`` holds a value JSON cannot
            represent (a set, a numpy integer).
    """
    tables = sorted(tables, key=lambda t: t.bits)
    if not tables:
        raise ValueError("tables must not be empty")
    first = tables[0]
    bits = [t.bits for t in tables]
    if len(set(bits)) != len(bits):
        raise ValueError(f"each bit width may appear once, got bits {bits}")
    shared = ("name", "params", "symmetric", "domain", "weight")
    for t in tables[1:]:
        for attr in shared:
            if getattr(t, attr) != getattr(first, attr):
                raise ValueError(
                    "all tables of one file must share name, params, symmetric, domain and weight; "
                    f"{first.bits}-bit has {attr}={getattr(first, attr)!r}, {t.bits}-bit has {getattr(t, attr)!r}"
                )
    records = {}
    for t in tables:
        rec = t.to_dict()
        if t.provenance != first.provenance:
            rec["provenance"] = dict(t.provenance)
        records[str(t.bits)] = rec
    doc = {
        "schema_version": SCHEMA_VERSION,
        "name": first.name,
        "params": dict(first.params),
        "symmetric": first.symmetric,
        "domain": list(first.domain),
        "weight": first.weight,
        "provenance": dict(first.provenance),
        "tables": records,
    }
    # allow_nan=False: a non-finite number is a bug upstream, never written as NaN/Infinity.
    return json.dumps(doc, indent=1, sort_keys=False, allow_nan=False) + "\n"


_TOP_REQUIRED = ("schema_version", "name", "tables")
_TOP_OPTIONAL = ("params", "symmetric", "domain", "weight", "provenance")
_RECORD_REQUIRED = ("borders", "codes", "values")
_RECORD_OPTIONAL = ("error", "objective", "provenance")
_BITS_KEY = re.compile(r"[1-8]")
_WEIGHT = re.compile(r"uniform|exact|histogram|normal:(.+)")
_RECORD_FIELD = re.compile(r"(?:borders|codes|values|error|objective)\b")


def _json_type(x: Any) -> str:
    if x is None:
        return "null"
    if isinstance(x, bool):
        return "a boolean"
    if isinstance(x, (int, float)):
        return "a number"
    if isinstance(x, str):
        return "a string"
    return "a list" if isinstance(x, list) else "an object"


class _Reject(Exception):
    """A problem found while parsing (field, message); turned into TableFormatError."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _Reject(f"duplicate key {_short(k)} in one object (which one counts is unclear)")
        out[k] = v
    return out


def _no_constants(name: str) -> Any:
    raise _Reject(f"{name} is not a JSON number (numbers must be finite)")


def _check_keys(where: str, obj: dict, required: tuple[str, ...], optional: tuple[str, ...]) -> None:
    """Every required key present and no other than the optional ones (a typo such as
    "symetric" would otherwise fall back to the default silently)."""
    for k in required:
        if k not in obj:
            raise _Reject(f"{where + '.' if where else ''}{k} is missing")
    for k in obj:
        if k not in required and k not in optional:
            allowed = ", ".join(required + optional)
            raise _Reject(f"{where or 'top level'}: unknown field {_short(k)} (known: {allowed})")


def _expect(field: str, value: Any, kind: type) -> Any:
    """``value`` if it has the JSON type ``kind`` (dict, list, str or bool)."""
    if not isinstance(value, kind):
        want = {dict: "an object", list: "a list", str: "a string", bool: "true or false"}[kind]
        raise _Reject(f"{field} must be {want}, got {_short(value)}")
    return value


def _parse_doc(doc: Any) -> dict[int, Table]:
    """Validate a decoded table file; returns ``{bits: Table}`` or raises _Reject."""
    if not isinstance(doc, dict):
        raise _Reject(f"the top level must be an object, got {_json_type(doc)}")
    version = doc.get("schema_version")
    if not is_int(version) or version != SCHEMA_VERSION:
        raise _Reject(f"schema_version must be {SCHEMA_VERSION}, got {_short(version)}")
    _check_keys("", doc, _TOP_REQUIRED, _TOP_OPTIONAL)
    name = _expect("name", doc["name"], str)
    params = _expect("params", doc.get("params", {}), dict)
    symmetric = _expect("symmetric", doc.get("symmetric", False), bool)
    domain = _expect("domain", doc.get("domain", [-10.0, 10.0]), list)
    weight = _expect("weight", doc.get("weight", "uniform"), str)
    provenance = _expect("provenance", doc.get("provenance", {}), dict)
    records = _expect("tables", doc["tables"], dict)
    if len(domain) != 2:
        raise _Reject(f"domain must be a list [A, B] of 2 numbers, got {_short(domain)}")
    match = _WEIGHT.fullmatch(weight)
    if match is None:
        raise _Reject(f"weight must be 'uniform', 'normal:SIGMA', 'histogram' or 'exact', got {_short(weight)}")
    if match.group(1) is not None:
        try:
            sigma = float(match.group(1))
        except ValueError:
            sigma = math.nan
        if not (math.isfinite(sigma) and sigma > 0):
            raise _Reject(f"weight: SIGMA of 'normal:SIGMA' must be a finite number > 0, got {_short(weight)}")
    if not records:
        raise _Reject("tables holds no table (it must map bit widths '1'..'8' to tables)")
    out: dict[int, Table] = {}
    for key, rec in records.items():
        if not _BITS_KEY.fullmatch(key):
            raise _Reject(f"tables: keys must be bit widths '1' to '8', got {_short(key)}")
        where = f"tables.{key}"
        _expect(where, rec, dict)
        _check_keys(where, rec, _RECORD_REQUIRED, _RECORD_OPTIONAL)
        for k in _RECORD_REQUIRED:
            _expect(f"{where}.{k}", rec[k], list)
        try:
            out[int(key)] = Table(
                name=name,
                bits=int(key),
                borders=rec["borders"],
                codes=rec["codes"],
                values=rec["values"],
                error=rec.get("error"),
                objective=rec.get("objective"),
                params=params,
                domain=tuple(domain),
                weight=weight,
                symmetric=symmetric,
                provenance=_expect(f"{where}.provenance", rec.get("provenance", provenance), dict),
            )
        except ValueError as exc:
            # Table's messages start with the field; a record's fields get the record's path
            msg = str(exc)
            raise _Reject(f"{where}.{msg}" if _RECORD_FIELD.match(msg) else msg) from None
    return out


def loads_tables(text: str, *, source: str = "<string>") -> dict[int, Table]:
    """Parse and validate a JSON table file; returns ``{bits: Table}``.

    Args:
        text: the file's content.
        source: what to call it in error messages (the file name).

    Returns:
        ``{bits: Table}`` with int keys in 1..8, one per record of ``tables``.

    Raises:
        TypeError: if ``text`` is not a ``str`` (decode bytes first, or use :func:`read_tables`).
        TableFormatError: if the text is not valid JSON (``NaN``/``Infinity`` included),
            is larger than :data:`MAX_FILE_SIZE`, nests too deeply, repeats a key, is of
            another schema version, lacks a required field, has an unknown field, or any
            field has the wrong type or an invalid value; the message names ``source``,
            the field and the value.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    if len(text) > MAX_FILE_SIZE:
        raise TableFormatError(
            f"{source}: not a table file ({len(text)} characters, more than {MAX_FILE_SIZE})"
        )
    try:
        doc = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constants)
        return _parse_doc(doc)
    except _Reject as exc:
        raise TableFormatError(f"{source}: invalid table file: {exc}") from None
    except json.JSONDecodeError as exc:
        raise TableFormatError(f"{source}: not a valid table file ({exc})") from None
    except RecursionError:
        raise TableFormatError(f"{source}: not a valid table file (nested too deeply)") from None
    except ValueError as exc:  # e.g. an integer with more digits than int() accepts
        raise TableFormatError(f"{source}: not a valid table file ({exc})") from None


def read_tables(path: str | os.PathLike) -> dict[int, Table]:
    """Read a JSON table file from ``path``; returns ``{bits: Table}``.

    Args:
        path: the file (``str`` or ``os.PathLike``); UTF-8, a byte-order mark allowed.

    Returns:
        ``{bits: Table}`` as :func:`loads_tables`.

    Raises:
        TableFormatError: if the file is missing, unreadable, not UTF-8, larger than
            :data:`MAX_FILE_SIZE`, or invalid (see :func:`loads_tables`).
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_SIZE + 1)
    except OSError as exc:
        raise TableFormatError(f"{path}: cannot read table file ({exc.strerror or exc})") from None
    if len(data) > MAX_FILE_SIZE:
        raise TableFormatError(f"{path}: not a table file (larger than {MAX_FILE_SIZE} bytes)")
    try:
        text = data.decode("utf-8-sig")  # a byte-order mark some editors write is fine
    except UnicodeDecodeError as exc:
        raise TableFormatError(
            f"{path}: not a valid table file (not UTF-8: {exc.reason} at byte {exc.start})"
        ) from None
    return loads_tables(text, source=str(path))


def _new_file_beside(path: Path, suffix: str) -> str:
    """Create an empty, unique file beside ``path``; return its name.

    Its permissions are those of ``path`` if it exists, else those of any new file
    (``0o666`` minus the umask; :func:`tempfile.mkstemp` would give ``0o600``).
    """
    directory = path.parent if str(path.parent) else Path(".")
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        mode = None
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = directory / f".{path.name}.{os.urandom(6).hex()}{suffix}"
        try:
            fd = os.open(tmp, flags, 0o666)
        except FileExistsError:
            continue
        try:
            if mode is not None:
                os.chmod(tmp, mode)
        except OSError:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
        return str(tmp)
    raise FileExistsError(f"cannot create a temporary file beside {path}")


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, suffix: str = ".tmp", *, overwrite: bool = True) -> Iterator[str]:
    """Yield a temporary file name beside ``path``; on success rename it onto ``path``.

    Nothing is left half-written: on any error the temporary file is removed and the
    previous ``path``, if any, is unchanged. The new file gets the permissions of the
    file it replaces, or those of any new file (``0o666`` minus the umask).

    A symbolic link is written through: its target gets the new file (the link stays).
    ``overwrite=False``: a file that exists at the end (also one made meanwhile) is kept and
    ``FileExistsError`` raised (a hard link puts the new file in place only if none is there).

    Args:
        path: the file to write (``str`` or ``os.PathLike``).
        suffix: suffix of the temporary file's name (``.<name>.<12 hex><suffix>``).
        overwrite: replace an existing ``path`` (default) or keep it.

    Returns:
        A context manager: ``with atomic_output(path) as tmp:`` gives ``tmp`` (str), the
        name of the empty temporary file to write; ``path`` is written when the block ends
        without an exception.

    Raises:
        OSError: if the directory is not writable, or ``path`` exists and is not a regular
            file (a FIFO or a device such as ``/dev/null``: a rename would replace it by a
            file); ``FileExistsError`` as above.
    """
    path = Path(os.path.realpath(path))  # through symbolic links: the rename would replace the link
    if path.exists() and not path.is_file():
        raise OSError(errno.EINVAL, f"{path} is not a regular file")
    tmp = _new_file_beside(path, suffix)
    try:
        yield tmp
        if overwrite:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)  # fails if anything is there now
            except FileExistsError:
                raise
            except OSError:  # no hard links on this file system: check, then rename
                if os.path.lexists(path):
                    raise FileExistsError(errno.EEXIST, f"{path} exists") from None
                os.replace(tmp, path)
            else:
                os.unlink(tmp)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_tables(path: str | os.PathLike, tables: Iterable[Table], *, overwrite: bool = True) -> Path:
    """Write tables to ``path`` atomically (a temporary file renamed into place).

    Nothing is left half-written: on any error the previous file, if any, is unchanged.
    ``overwrite=False``: an existing file is kept (:func:`atomic_output`).

    Args:
        path: the file (``str`` or ``os.PathLike``).
        tables: :class:`Table` objects of one function and parameter set (:func:`dumps_tables`).
        overwrite: replace an existing file (default) or refuse to.

    Returns:
        ``Path(path)``, as given (a symbolic link is not resolved).

    Raises:
        OSError: if the directory is not writable or ``path`` is not a regular file;
            ``FileExistsError`` if it exists and ``overwrite`` is False.
        ValueError, TypeError: as :func:`dumps_tables` (before anything is written).
    """
    path = Path(path)
    text = dumps_tables(tables)
    with atomic_output(path, overwrite=overwrite) as tmp:
        Path(tmp).write_text(text, encoding="utf-8")
    return path


def shipped_table_files() -> dict[str, Any]:
    """The JSON files shipped in the ``fewbit.tables`` package: ``{file name: Traversable}``.

    Returns:
        dict from file name (``"gelu.json"``) to an :mod:`importlib.resources` Traversable.
    """
    root = resources.files("fewbit.tables")
    return {p.name: p for p in root.iterdir() if p.name.endswith(".json")}


def load_shipped(name: str, params: Mapping[str, float] | None = None) -> dict[int, Table] | None:
    """Load the shipped tables of ``name`` for ``params`` (``None`` or ``{}``: defaults).

    Args:
        name: canonical registry name (``"gelu"``; aliases are not resolved here).
        params: the non-default parameters (:func:`table_filename`).

    Returns:
        ``{bits: Table}``, or ``None`` if no such file is shipped.

    Raises:
        TableFormatError: if the shipped file is corrupt.
    """
    fname = table_filename(name, params)
    files = shipped_table_files()
    if fname not in files:
        return None
    return loads_tables(files[fname].read_text(encoding="utf-8"), source=f"fewbit.tables/{fname}")
