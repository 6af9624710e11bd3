"""The JSON table schema shared by the solver and the runtime (fewbit.table)."""

import json
import math

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
