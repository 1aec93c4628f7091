"""The one field map (kdash.collectors.agent.fields): every column of every schema table is
accounted for, and both sources' readers do what it says.

The CUPTI records below are HAND-MADE objects shaped like cupti-python's (attribute names from
the map, kinds and enums from the stand-in cupti module in tests/fakes, since no CUPTI runs
here); the Kineto events are HAND-MADE in the shape torch.profiler writes. Each test builds
its expectations from the map itself, so a map entry that a reader ignores fails here.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from fakes import fake_cupti_module
from kdash.collectors.agent import fields
from kdash.collectors.agent.records import RecordConverter, rows_to_batch

from kdash import kineto, kineto_events, schema

BASE_NS = 1_790_000_000_000_000_000
HOST_PID = 4242


def _schema_columns(table: str) -> list[str]:
    return [c for c, _t in schema.TABLES[table]]


def _cupti_tables() -> set[str]:
    return {table for table, _k, _f in fields.RECORDS} | {"markers"}


def _kineto_tables() -> set[str]:
    return {table for table, _c, _f in fields.KINETO}


# -- coverage: every column of every table ---------------------------------------------------
def test_every_table_is_filled_by_both_sources_or_named_as_filled_elsewhere():
    tables = set(schema.TABLES)
    assert _cupti_tables() == _kineto_tables()
    assert _cupti_tables() | set(fields.OTHER_TABLES) == tables
    assert not _cupti_tables() & set(fields.OTHER_TABLES)
    assert all(reason.strip() for reason in fields.OTHER_TABLES.values())


def test_every_cupti_record_kind_accounts_for_every_column_of_its_table():
    kinds = [k for _t, ks, _f in fields.RECORDS for k in ks] + ["MARKER"]
    assert sorted(fields.CUPTI_FILLED) == sorted(kinds) == sorted(fields.RECORD_DTYPES)
    entries = [(t, ks, [c for c, _a, _h in f]) for t, ks, f in fields.RECORDS]
    entries.append(("markers", ("MARKER",), list(fields.MARKER_COLUMNS)))
    for table, kinds, mapped in entries:
        assert len(mapped) == len(set(mapped)), (table, kinds)
        for kind in kinds:
            filled = fields.CUPTI_FILLED[kind]
            assert not set(mapped) & set(filled), kind
            assert sorted([*mapped, *filled]) == sorted(_schema_columns(table)), kind
            assert set(fields.CONSTANTS.get(kind, {})) <= set(filled), kind
            assert all(reason.strip() for reason in filled.values()), kind


def test_every_kineto_entry_accounts_for_every_column_of_its_table():
    for table, cats, entries in fields.KINETO:
        mapped = [c for c, _k, _h, _a in entries]
        derived = fields.KINETO_DERIVED.get(table, {})
        assert len(mapped) == len(set(mapped)), (table, cats)
        assert not set(mapped) & set(derived), (table, cats)
        assert sorted([*mapped, *derived]) == sorted(_schema_columns(table)), (table, cats)
        assert all(reason.strip() for reason in derived.values()), table
    assert set(fields.KINETO_DERIVED) <= _kineto_tables()


def test_a_how_no_reader_knows_is_refused_when_the_importer_loads():
    with pytest.raises(ValueError, match="no reader"):
        kineto_events.EventPlan("api", (("name", ("name",), "upper case", None),))
    with pytest.raises(ValueError, match="start and end"):
        kineto_events.EventPlan("api", (("name", ("name",), fields.TEXT, None),))


# -- the Kineto importer reads what the map says ----------------------------------------------
def _import(tmp_path: Path, events: list[dict]) -> dict[str, dict]:
    """Read `events` (after a host event that names the trace's process) as one trace."""
    host = {"ph": "X", "cat": "python_function", "name": "f", "ts": 1.0, "pid": HOST_PID}
    doc = {"schemaVersion": 1, "baseTimeNanoseconds": BASE_NS, "traceEvents": [host, *events]}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    tables, _infos = kineto.read_traces([path])
    return tables


def _event(cat: str, entries: tuple, drop: set[str]) -> tuple[dict, dict[str, int]]:
    """An event of `cat` with a distinct integer under every source key of the entries but the
    ones in `drop`, and those values by key."""
    ev: dict = {"ph": "X", "cat": cat, "name": "Memcpy HtoD (Pageable -> Device)", "ts": 10.5}
    ev["dur"] = 2.25
    ev["args"] = {}
    values: dict[str, int] = {}
    for _col, keys, how, _absent in entries:
        if how != fields.AS_IS:
            continue
        for key in keys:
            if key in drop or key in values:
                continue
            values[key] = 1000 + len(values)
            if key.startswith("args."):
                ev["args"][key[len("args.") :]] = values[key]
            else:
                ev[key] = values[key]
    return ev, values


def _expect_as_is(col: str, keys: tuple, values: dict[str, int]) -> int:
    present = [values[k] for k in keys if k in values]
    if present:
        return present[0]
    return HOST_PID if col == "pid" else -1  # n/a; a pid column's is the trace's process


@pytest.mark.parametrize(
    "table,cat,entries",
    [(t, c, e) for t, cats, e in fields.KINETO for c in cats],
    ids=[c for _t, cats, _e in fields.KINETO for c in cats],
)
def test_each_column_comes_from_the_key_the_map_names(tmp_path, table, cat, entries):
    as_is = [(col, keys) for col, keys, how, _a in entries if how == fields.AS_IS]
    # every key given, then each column's first key left out (its fallback, or n/a), then all
    cases = [set()] + [{keys[0]} for _c, keys in as_is] + [{k for _c, ks in as_is for k in ks}]
    for drop in cases:
        ev, values = _event(cat, entries, drop)
        row = {c: v[0] for c, v in _import(tmp_path, [ev])[table].items() if len(v)}
        assert row, (cat, drop)
        for col, keys in as_is:
            assert row[col] == _expect_as_is(col, keys, values), (cat, col, drop)
        _check_made_columns(row, entries, cat, ev)


def _check_made_columns(row: dict, entries: tuple, cat: str, ev: dict) -> None:
    start = BASE_NS + round(ev["ts"] * 1000)
    copy_kind = "memset" if cat == "gpu_memset" else "HtoD"
    want = {
        fields.US_START: start,
        fields.US_DURATION: start + round(ev["dur"] * 1000),
        fields.TEXT: ev["name"],
        fields.CATEGORY: cat,
        fields.COPY_KIND: copy_kind,
        fields.TRACE_PID: HOST_PID,
    }
    for col, _keys, how, _absent in entries:
        if how in want:
            assert row[col] == want[how], (cat, col)


def test_a_grid_and_block_fill_their_three_columns_each(tmp_path):
    (entries,) = [e for t, _c, e in fields.KINETO if t == "kernels"]
    ev = {"ph": "X", "cat": "kernel", "name": "k", "ts": 1.0, "dur": 1.0}
    ev["args"] = {"grid": [2, 3, 4], "block": [128, 1, 2], "shared memory": 512}
    row = {c: v[0] for c, v in _import(tmp_path, [ev])["kernels"].items()}
    axis = {fields.DIM3_X: 0, fields.DIM3_Y: 1, fields.DIM3_Z: 2}
    for col, (key,), how, _a in (e for e in entries if e[2] in axis):
        assert row[col] == ev["args"][key[len("args.") :]][axis[how]], col
    # derived (KINETO_DERIVED): Kineto's one figure is static + dynamic
    assert row["dynamic_smem"] == 512 and row["static_smem"] == 0
    del ev["args"]["shared memory"]
    row = {c: v[0] for c, v in _import(tmp_path, [ev])["kernels"].items()}
    assert row["dynamic_smem"] == -1 and row["static_smem"] == -1


def test_the_importer_stores_the_categories_of_the_map_and_no_other(tmp_path):
    cats = [c for _t, cs, _e in fields.KINETO for c in cs]
    events = [{"ph": "X", "cat": c, "name": "n", "ts": 2.0, "dur": 1.0} for c in cats]
    events.append({"ph": "X", "cat": "fwdbwd", "name": "n", "ts": 2.0, "dur": 1.0})
    tables = _import(tmp_path, events)
    kept = {t: len(b["start_ns"]) for t, b in tables.items()}
    want = {t: sum(len(cs) for tt, cs, _e in fields.KINETO if tt == t) for t in _kineto_tables()}
    assert kept == want


# -- the agent's decoders read what the map says ---------------------------------------------
def _record(kind: int, entries: tuple, zero: bool) -> tuple[SimpleNamespace, dict[str, object]]:
    """A record object with a distinct value in every field the map names (0 in the fields
    whose 0 means something, when `zero`)."""
    attrs: dict[str, object] = {"kind": kind}
    for i, (_col, attr, how) in enumerate(entries):
        if how == fields.C_STRING:
            attrs[attr] = f"kernel_{i}"
        elif how in (fields.COPY_NAME, fields.SYNC_NAME):
            attrs[attr] = 1 if how == fields.COPY_NAME else 3
        elif how in (fields.ZERO_IS_NA, fields.ZERO_IS_PID) and zero:
            attrs[attr] = 0
        else:
            attrs[attr] = 100 + i
    return SimpleNamespace(**attrs), attrs


def test_each_cupti_column_comes_from_the_field_the_map_names():
    fake = fake_cupti_module()
    pid = 77
    conv = RecordConverter(fake, pid=pid)
    conv.reader = None  # the attribute decoder; the buffer decoder is checked against it
    named = {
        fields.API_NAME: "cudaLaunchKernel",  # the stand-in's name of every runtime cbid
        fields.COPY_NAME: "HtoD",
        fields.SYNC_NAME: "sync:stream_synchronize",
    }
    for table, kinds, entries in fields.RECORDS:
        for kname in kinds:
            kind = int(getattr(fake.ActivityKind, kname))
            for zero in (False, True):
                rec, attrs = _record(kind, entries, zero)
                batch = conv.batches([rec])[table]
                row = {c: v[0] for c, v in batch.items()}
                for col, attr, how in entries:
                    value = attrs[attr]
                    if how in named:
                        want = named[how] if kname != "DRIVER" else "cuLaunchKernel"
                    elif how == fields.ZERO_IS_NA:
                        want = value or -1
                    elif how == fields.ZERO_IS_PID:
                        want = value or pid
                    else:
                        want = value
                    assert row[col] == want, (kname, col, zero)
                for col in fields.CUPTI_FILLED[kname]:
                    want = fields.CONSTANTS.get(kname, {}).get(col, pid if col == "pid" else -1)
                    assert row[col] == want, (kname, col)


def test_cupti_marker_rows_fill_the_columns_the_map_names():
    fake = fake_cupti_module()
    conv = RecordConverter(fake, pid=9)
    mk = int(fake.ActivityKind.MARKER)
    pt = SimpleNamespace(pt=SimpleNamespace(thread_id=5))
    rec = dict(kind=mk, id=1, name="step", domain="d", object_id=pt)
    rows = conv.convert([SimpleNamespace(flags_=2, timestamp=10, **rec)])
    rows = conv.convert([SimpleNamespace(flags_=4, timestamp=30, **{**rec, "name": ""})])
    batch = rows_to_batch("markers", rows["markers"], 0, 9)
    got = dict(zip(fields.MARKER_COLUMNS, rows["markers"][0], strict=True))
    assert got == {"start_ns": 10, "end_ns": 30, "name": "step", "domain": "d", "tid": 5}
    assert batch["pid"].tolist() == [9]  # CUPTI_FILLED["MARKER"]: the agent's own
