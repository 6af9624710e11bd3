"""The JSON table schema shared by the solver and the runtime (fewbit.table)."""

import json
import math
import re

import pytest

from fewbit.table import (
    SCHEMA_VERSION,
    Table,
    TableFormatError,
    dumps_tables,
    loads_tables,
    read_tables,
    table_filename,
    write_tables,
)


def _table(bits=2, **kw):
    n = 1 << bits
    args = dict(
        name="gelu",
        bits=bits,
        borders=[float(i) for i in range(n - 1)],
        codes=list(range(n)),
        values=[0.1 * i for i in range(n)],
        error=0.5,
    )
    args.update(kw)
    return Table(**args)


def test_round_trip_exact_floats(tmp_path):
    t1 = _table(1, borders=[0.1 + 0.2], values=[math.pi, -1e-300])
    t3 = _table(3)
    path = write_tables(tmp_path / "gelu.json", [t3, t1])
    back = read_tables(path)
    assert sorted(back) == [1, 3]
    assert back[1] == t1 and back[3] == t3
    assert back[1].borders == (0.1 + 0.2,)  # repr round-trips float64 exactly
    doc = json.loads(path.read_text())
    assert doc["schema_version"] == SCHEMA_VERSION and list(doc["tables"]) == ["1", "3"]


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(bits=0), "bits must be an integer in 1..8, got 0"),
        (dict(bits=9), "bits must be an integer in 1..8, got 9"),
        (dict(borders=[1.0, 0.0, 2.0]), "strictly increasing"),
        (dict(borders=[0.0, float("nan"), 2.0]), "finite"),
        (dict(codes=[0, 1, 2]), "codes must have"),
        (dict(codes=[0, 1, 2, 4]), r"codes must be in \[0, 4\)"),
        (dict(values=[0.0, 1.0]), "values must have"),
        (dict(values=[0.0, 1.0, 2.0, float("inf")]), "values must be finite"),
        (dict(domain=(1.0, -1.0)), "domain"),
    ],
)
def test_invalid_tables_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        _table(**kw)


def test_reader_rejects_bad_files(tmp_path):
    with pytest.raises(TableFormatError, match="cannot read"):
        read_tables(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(TableFormatError, match="not a valid table file"):
        read_tables(bad)
    doc = json.loads(dumps_tables([_table()]))
    doc["schema_version"] = 99
    with pytest.raises(TableFormatError, match="schema_version must be 1, got 99"):
        loads_tables(json.dumps(doc))
    doc["schema_version"] = SCHEMA_VERSION
    doc["tables"]["2"]["codes"] = [0, 1]
    with pytest.raises(TableFormatError, match="invalid table"):
        loads_tables(json.dumps(doc))


def test_write_is_atomic_and_leaves_old_file(tmp_path):
    path = write_tables(tmp_path / "t.json", [_table()])
    before = path.read_text()
    with pytest.raises(ValueError):
        write_tables(path, [])
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]


def test_mixed_tables_refused():
    with pytest.raises(ValueError, match="share name"):
        dumps_tables([_table(1), _table(2, name="silu")])
    with pytest.raises(ValueError, match="appear once"):
        dumps_tables([_table(2), _table(2)])


def test_table_filename():
    assert table_filename("gelu") == "gelu.json"
    assert table_filename("elu", {"alpha": 0.5}) == "elu@alpha=0.5.json"
    assert table_filename("softplus", {"threshold": 10, "beta": 2}) == "softplus@beta=2.0,threshold=10.0.json"
    assert table_filename("my.mod:fn") == "my.mod--fn.json"


# ---------------------------------------------------------------------------------------
# Hostile files: every malformed table file gives one TableFormatError naming the file,
# the field and the value (never AttributeError, RecursionError, or a silently wrong table).
# ---------------------------------------------------------------------------------------


def _doc():
    return json.loads(dumps_tables([_table(1), _table(2)]))


def _set(path, value):
    """A mutation of the valid document: set doc[path...] = value."""

    def mutate(doc):
        obj = doc
        for key in path[:-1]:
            obj = obj[key]
        obj[path[-1]] = value

    return mutate


def _drop(*path):
    def mutate(doc):
        obj = doc
        for key in path[:-1]:
            obj = obj[key]
        del obj[path[-1]]

    return mutate


def _rename_bits(old, new):
    def mutate(doc):
        doc["tables"][new] = doc["tables"].pop(old)

    return mutate


def _text(mutate, replace=None):
    doc = _doc()
    if mutate is not None:
        mutate(doc)
    text = json.dumps(doc)
    if replace is not None:
        text = text.replace(*replace)
    return text


_R2 = ("tables", "2")  # the 2-bit record: borders [0, 1, 2], codes [0, 1, 2, 3], values [0, .1, .2, .3]

HOSTILE = [
    # (id, mutation of the valid document, (old, new) text replacement, needles in the message)
    ("tables-null", _set(["tables"], None), None, ["tables must be an object", "null"]),
    ("tables-list", _set(["tables"], [1, 2]), None, ["tables must be an object", "[1, 2]"]),
    ("tables-string", _set(["tables"], "1"), None, ["tables must be an object", '"1"']),
    ("tables-empty", _set(["tables"], {}), None, ["tables holds no table"]),
    ("record-list", _set([*_R2], [0, 1]), None, ["tables.2 must be an object", "[0, 1]"]),
    ("record-null", _set([*_R2], None), None, ["tables.2 must be an object", "null"]),
    ("level-1e300", _set([*_R2, "values"], [0.0, 1e300, 0.2, 0.3]), None,
     ["tables.2.values must be finite in float32", "values[1] = 1e+300"]),
    ("level-float32-max-rounds-to-inf", _set([*_R2, "values"], [0.0, -3.4028235677973366e38, 0.0, 0.0]), None,
     ["tables.2.values must be finite in float32", "values[1]"]),
    ("level-string", _set([*_R2, "values"], [0.0, "0.1", 0.2, 0.3]), None,
     ["tables.2.values[1] must be a number", '"0.1"']),
    ("level-bool", _set([*_R2, "values"], [0.0, True, 0.2, 0.3]), None, ["tables.2.values[1] must be a number", "true"]),
    ("level-null", _set([*_R2, "values"], [0.0, None, 0.2, 0.3]), None, ["tables.2.values[1] must be a number", "null"]),
    ("level-nested-list", _set([*_R2, "values"], [0.0, [0.1], 0.2, 0.3]), None, ["tables.2.values[1] must be a number", "[0.1]"]),
    ("levels-too-few", _set([*_R2, "values"], [0.0, 0.1]), None, ["tables.2.values must have 2**bits = 4 entries", "got 2"]),
    ("levels-object", _set([*_R2, "values"], {"0": 1.0}), None, ["tables.2.values must be a list", '{"0": 1.0}']),
    ("symmetric-no", _set(["symmetric"], "no"), None, ["symmetric must be true or false", '"no"']),
    ("symmetric-0", _set(["symmetric"], 0), None, ["symmetric must be true or false", "got 0"]),
    ("symmetric-null", _set(["symmetric"], None), None, ["symmetric must be true or false", "null"]),
    ("code-1.7", _set([*_R2, "codes"], [0, 1.7, 2, 3]), None, ["tables.2.codes[1] must be an integer", "1.7"]),
    ("code-1.0", _set([*_R2, "codes"], [0, 1.0, 2, 3]), None, ["tables.2.codes[1] must be an integer", "1.0"]),
    ("code-true", _set([*_R2, "codes"], [0, True, 2, 3]), None, ["tables.2.codes[1] must be an integer", "true"]),
    ("code-string", _set([*_R2, "codes"], [0, "1", 2, 3]), None, ["tables.2.codes[1] must be an integer", '"1"']),
    ("code-negative", _set([*_R2, "codes"], [0, -1, 2, 3]), None, ["tables.2.codes must be in [0, 4)", "codes[1] = -1"]),
    ("code-too-big", _set([*_R2, "codes"], [0, 4, 2, 3]), None, ["tables.2.codes must be in [0, 4)", "codes[1] = 4"]),
    ("code-huge-int", None, ('"codes": [0, 1, 2, 3]', '"codes": [0, ' + "9" * 5000 + ', 2, 3]'),
     ["not a valid table file"]),
    ("codes-count", _set([*_R2, "codes"], [0, 1]), None, ["tables.2.codes must have len(borders) + 1 = 4", "got 2"]),
    ("border-string", _set([*_R2, "borders"], [0.0, "1", 2.0]), None, ["tables.2.borders[1] must be a number", '"1"']),
    ("borders-string", _set([*_R2, "borders"], "0,1,2"), None, ["tables.2.borders must be a list", '"0,1,2"']),
    ("borders-decreasing", _set([*_R2, "borders"], [0.0, 2.0, 1.0]), None,
     ["tables.2.borders must be strictly increasing", "borders[1] = 2.0 then borders[2] = 1.0"]),
    ("borders-repeated", _set([*_R2, "borders"], [0.0, 1.0, 1.0]), None, ["tables.2.borders must be strictly increasing"]),
    ("border-1e400-is-inf", None, ('"borders": [0.0, 1.0, 2.0]', '"borders": [0.0, 1.0, 1e400]'),
     ["tables.2.borders must be finite", "borders[2] = inf"]),
    ("nan-extension", None, ('"values": [0.0, 0.1, 0.2, 0.30000000000000004]', '"values": [0.0, NaN, 0.2, 0.3]'),
     ["NaN is not a JSON number"]),
    ("infinity-extension", None, ('"borders": [0.0, 1.0, 2.0]', '"borders": [-Infinity, 1.0, 2.0]'),
     ["-Infinity is not a JSON number"]),
    ("error-nan-extension", None, ('"error": 0.5', '"error": NaN'), ["NaN is not a JSON number"]),
    ("error-negative", _set([*_R2, "error"], -1.0), None, ["tables.2.error must be a finite number >= 0", "-1.0"]),
    ("error-string", _set([*_R2, "error"], "0.1"), None, ["tables.2.error must be a number", '"0.1"']),
    ("objective-negative", _set([*_R2, "objective"], -2.0), None, ["tables.2.objective must be a finite number >= 0"]),
    ("params-string-value", _set(["params"], {"alpha": "x"}), None, ["params.alpha must be a number", '"x"']),
    ("params-numeric-string", _set(["params"], {"alpha": "0.5"}), None, ["params.alpha must be a number", '"0.5"']),
    ("params-bool", _set(["params"], {"alpha": True}), None, ["params.alpha must be a number", "true"]),
    ("params-1e400", None, ('"params": {}', '"params": {"alpha": 1e400}'), ["params.alpha must be finite", "inf"]),
    ("params-list", _set(["params"], [1.0]), None, ["params must be an object", "[1.0]"]),
    ("params-bad-name", _set(["params"], {"a b": 1.0}), None, ["parameter names must be identifiers", '"a b"']),
    ("bits-01", _rename_bits("2", "01"), None, ["keys must be bit widths '1' to '8'", '"01"']),
    ("bits-3.0", _rename_bits("2", "3.0"), None, ["keys must be bit widths", '"3.0"']),
    ("bits-space", _rename_bits("2", " 2"), None, ["keys must be bit widths", '" 2"']),
    ("bits-plus", _rename_bits("2", "+2"), None, ["keys must be bit widths", '"+2"']),
    ("bits-0", _rename_bits("2", "0"), None, ["keys must be bit widths", '"0"']),
    ("bits-9", _rename_bits("2", "9"), None, ["keys must be bit widths", '"9"']),
    ("bits-arabic-digit", _rename_bits("2", "\u0662"), None, ["keys must be bit widths"]),
    ("bits-mismatch", _rename_bits("2", "3"), None, ["tables.3.values must have 2**bits = 8 entries"]),
    ("duplicate-top-key", None, ('"name": "gelu"', '"name": "gelu", "name": "silu"'), ["duplicate key", '"name"']),
    ("duplicate-bits-key", None, ('"2": {', '"1": {'), ["duplicate key", '"1"']),
    ("unknown-top-key-typo", _set(["symetric"], True), None,
     ['top level: unknown field "symetric"']),
    ("unknown-record-key", _set([*_R2, "border"], [0.0]), None, ['tables.2: unknown field "border"']),
    ("missing-tables", _drop("tables"), None, ["tables is missing"]),
    ("missing-name", _drop("name"), None, ["name is missing"]),
    ("missing-borders", _drop(*_R2, "borders"), None, ["tables.2.borders is missing"]),
    ("name-number", _set(["name"], 3), None, ["name must be a string", "got 3"]),
    ("name-empty", _set(["name"], ""), None, ["name must be a non-empty string"]),
    ("name-newline", _set(["name"], "gelu\nError: spoofed"), None, ["name must be a non-empty string", '"gelu\\nError']),
    ("name-bidi-override", _set(["name"], "gelu\u202e"), None, ["name must be a non-empty string"]),
    ("name-huge", _set(["name"], "g" * 10_000), None, ["name must be a non-empty string", "..."]),
    ("schema-true", _set(["schema_version"], True), None, ["schema_version must be 1", "true"]),
    ("schema-1.0", _set(["schema_version"], 1.0), None, ["schema_version must be 1", "1.0"]),
    ("schema-string", _set(["schema_version"], "1"), None, ["schema_version must be 1", '"1"']),
    ("schema-missing", _drop("schema_version"), None, ["schema_version must be 1", "null"]),
    ("domain-one", _set(["domain"], [1.0]), None, ["domain must be a list [A, B] of 2 numbers", "[1.0]"]),
    ("domain-string-end", _set(["domain"], [-1.0, "2"]), None, ["domain[1] must be a number", '"2"']),
    ("domain-reversed", _set(["domain"], [2.0, 1.0]), None, ["domain must be (A, B), finite, with A < B", "[2.0, 1.0]"]),
    ("domain-string", _set(["domain"], "[-10, 10]"), None, ["domain must be a list", '"[-10, 10]"']),
    ("weight-unknown", _set(["weight"], "gaussian"), None, ["weight must be 'uniform', 'normal:SIGMA'", '"gaussian"']),
    ("weight-bad-sigma", _set(["weight"], "normal:-1"), None, ["SIGMA of 'normal:SIGMA'", '"normal:-1"']),
    ("weight-nan-sigma", _set(["weight"], "normal:nan"), None, ["SIGMA of 'normal:SIGMA'", '"normal:nan"']),
    ("weight-number", _set(["weight"], 5), None, ["weight must be a string", "got 5"]),
    ("provenance-string", _set(["provenance"], "x"), None, ["provenance must be an object", '"x"']),
    ("record-provenance-list", _set([*_R2, "provenance"], [1]), None, ["tables.2.provenance must be an object", "[1]"]),
]


@pytest.mark.parametrize("mutate, replace, needles", [c[1:] for c in HOSTILE], ids=[c[0] for c in HOSTILE])
def test_hostile_table_files(tmp_path, mutate, replace, needles):
    text = _text(mutate, replace)
    if replace is not None:
        assert replace[1] in text  # the replacement happened
    path = tmp_path / "hostile.json"
    path.write_text(text)
    with pytest.raises(TableFormatError) as info:
        read_tables(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}: "), msg
    assert "\n" not in msg
    for needle in needles:
        assert needle in msg, (needle, msg)


@pytest.mark.parametrize(
    "text, needle",
    [
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ('{"a": ' * 50_000 + "1" + "}" * 50_000, "nested too deeply"),
        ("", "not a valid table file"),
        ("null", "the top level must be an object, got null"),
        ("[1, 2]", "the top level must be an object, got a list"),
        ("3", "the top level must be an object, got a number"),
        ('{"schema_version": 1', "not a valid table file"),
        ('{"schema_version": 1} trailing', "Extra data"),
        ("\x00\x01", "not a valid table file"),
    ],
    ids=["deep-lists", "deep-objects", "empty", "null", "list", "number", "truncated", "trailing", "control"],
)
def test_hostile_texts(tmp_path, text, needle):
    path = tmp_path / "t.json"
    path.write_text(text)
    with pytest.raises(TableFormatError, match=re.escape(needle)) as info:
        read_tables(path)
    assert str(info.value).startswith(f"{path}: ")


def test_huge_and_binary_files(tmp_path):
    from fewbit.table import MAX_FILE_SIZE

    huge = tmp_path / "huge.json"
    doc = _doc()
    doc["provenance"] = {"padding": "x" * MAX_FILE_SIZE}
    huge.write_text(json.dumps(doc))
    with pytest.raises(TableFormatError, match=f"{re.escape(str(huge))}: not a table file .*larger than"):
        read_tables(huge)
    with pytest.raises(TableFormatError, match="not a table file"):
        loads_tables(json.dumps(doc), source="huge")
    binary = tmp_path / "bin.json"
    binary.write_bytes(b'{"schema_version": 1, "name": "\xff\xfe"}')
    with pytest.raises(TableFormatError, match=f"{re.escape(str(binary))}: .*not UTF-8"):
        read_tables(binary)
    bom = tmp_path / "bom.json"
    bom.write_bytes(b"\xef\xbb\xbf" + dumps_tables([_table(2)]).encode())
    assert read_tables(bom)[2] == _table(2)  # a byte-order mark from an editor is fine


def test_table_constructor_is_strict_too():
    # the same rules for tables built in Python (the solver, user code)
    with pytest.raises(ValueError, match=r"codes\[1\] must be an integer, got 1.7"):
        _table(codes=[0, 1.7, 2, 3])
    with pytest.raises(ValueError, match=r"borders\[0\] must be a number"):
        _table(borders=["0", 1.0, 2.0])
    with pytest.raises(ValueError, match=r"finite in float32 .*values\[3\] = 1e\+39"):
        _table(values=[0.0, 1.0, 2.0, 1e39])
    with pytest.raises(ValueError, match="symmetric must be True or False"):
        _table(symmetric="no")
    with pytest.raises(ValueError, match="params.alpha must be a number"):
        _table(params={"alpha": "x"})
    with pytest.raises(ValueError, match="error must be a finite number >= 0"):
        _table(error=float("nan"))
    import numpy as np

    t = _table(borders=np.array([0.0, 1.0, 2.0]), codes=np.arange(4), values=np.float32([0, 1, 2, 3e38]))
    assert t.codes == (0, 1, 2, 3) and type(t.codes[0]) is int and t.values[3] == float(np.float32(3e38))


def test_objective_and_record_provenance_round_trip(tmp_path):
    t1 = _table(1, objective=0.25, provenance={"command": "a"})
    t2 = _table(2, provenance={"command": "b"})
    path = write_tables(tmp_path / "t.json", [t1, t2])
    doc = json.loads(path.read_text())
    assert doc["provenance"] == {"command": "a"}
    assert "provenance" not in doc["tables"]["1"] and doc["tables"]["2"]["provenance"] == {"command": "b"}
    assert doc["tables"]["1"]["objective"] == 0.25 and "objective" not in doc["tables"]["2"]
    back = read_tables(path)
    assert back[1].objective == 0.25 and back[2].objective is None
    assert back[1].provenance == {"command": "a"} and back[2].provenance == {"command": "b"}


def test_one_file_refuses_tables_of_other_domains_or_weights():
    with pytest.raises(ValueError, match="domain"):
        dumps_tables([_table(1), _table(2, domain=(-4.0, 4.0))])
    with pytest.raises(ValueError, match="weight"):
        dumps_tables([_table(1), _table(2, weight="normal:2.0")])


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_written_files_follow_the_umask(tmp_path, umask):
    import os
    import stat

    old = os.umask(umask)
    try:
        path = write_tables(tmp_path / "t.json", [_table()])
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask


def test_rewritten_file_keeps_its_permissions(tmp_path):
    import os
    import stat

    path = write_tables(tmp_path / "t.json", [_table()])
    os.chmod(path, 0o640)
    write_tables(path, [_table(3)])
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert sorted(read_tables(path)) == [3]


# ----------------------------------------------------------------------------- evaluation


def test_code_and_evaluate_follow_the_definition():
    """code(x) = codes[number of borders < x], q(x) = values[code(x)] (docs/method.md §2):
    a border belongs to the interval on its left, NaN to the last, -inf to the first."""
    np = pytest.importorskip("numpy")
    t = Table(name="gelu", bits=2, borders=[-1.0, 0.0, 2.5], codes=[3, 0, 2, 1], values=[0.5, -1.0, 2.0, 4.0])
    x = np.array([[-np.inf, -1.0, np.nextafter(-1.0, 0.0)], [0.0, 1e-300, 2.5], [3.0, np.inf, np.nan]])
    interval = np.array([[0, 0, 1], [1, 2, 2], [3, 3, 3]])
    assert t.code(x).dtype == np.int64 and t.code(x).shape == x.shape
    np.testing.assert_array_equal(t.code(x), np.array(t.codes)[interval])
    np.testing.assert_array_equal(t.evaluate(x), np.array(t.values)[np.array(t.codes)[interval]])
    assert t.evaluate(2.5) == 2.0 and t.evaluate([-5.0]).tolist() == [4.0]


def test_mirrored_code_map():
    from fewbit.table import mirrored_code_map

    np = pytest.importorskip("numpy")
    borders, codes = mirrored_code_map([0.5, 1.5, 3.0])
    assert borders == [-3.0, -1.5, -0.5, 0.5, 1.5, 3.0] and codes == [3, 2, 1, 0, 1, 2, 3]
    assert mirrored_code_map([]) == ([], [0])
    t = Table(name="sigmoid", bits=2, borders=borders, codes=codes, values=[0.25, 0.2, 0.1, 0.01], symmetric=True)
    x = np.random.default_rng(0).uniform(-5, 5, 1001)  # no border: q is even
    np.testing.assert_array_equal(t.evaluate(x), t.evaluate(-x))
    # piece k of [0, C] has level values[k]
    np.testing.assert_array_equal(t.evaluate([0.2, 1.0, 2.0, 4.0]), [0.25, 0.2, 0.1, 0.01])


def test_bits_may_be_a_numpy_integer():
    np = pytest.importorskip("numpy")
    t = _table(bits=np.int64(2))
    assert t.bits == 2 and type(t.bits) is int


def test_table_module_and_cli_do_not_import_torch():
    """fewbit.table (and so `fewbit --help` and `fewbit list`) stays torch-free, although
    it takes its bits check from fewbit._checks."""
    import subprocess
    import sys

    code = ("import sys, fewbit.table, fewbit.cli; fewbit.table.Table('relu', 1, [0.0], [0, 1], [0.0, 1.0]); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
