"""The typed contracts: each command's options record (kdash.options) and a capture's metadata
record (kdash.meta), held to the parser and to the captures on disk."""

from __future__ import annotations

import argparse
import json
import zipfile
from dataclasses import fields
from pathlib import Path

import pytest

from kdash import cli, options
from kdash.capture import META_NAME, load_capture, read_meta, validate_meta, write_capture
from kdash.meta import CaptureMeta, ClockInfo, Window, build_meta

DATA = Path(__file__).parent / "data"
CAPTURES = sorted(DATA.glob("*.kdash")) + sorted(
    (Path(__file__).resolve().parents[1] / "kdash" / "data").glob("*.kdash")
)


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


# -- options ---------------------------------------------------------------------------------
def test_the_command_table_and_the_parser_name_the_same_commands():
    assert set(cli.COMMANDS) == set(_subparsers())


def test_every_option_of_a_command_is_a_field_of_its_record_and_back():
    for name, sp in _subparsers().items():
        dests = {a.dest for a in sp._actions if a.dest != "help"}
        record = {f.name for f in fields(cli.COMMANDS[name].options)}
        assert dests == record, name


def test_parser_defaults_are_the_records_defaults(monkeypatch):
    monkeypatch.delenv(options.ENV_API_KEY, raising=False)
    monkeypatch.delenv(options.ENV_ADMIN_API_KEY, raising=False)
    assert cli.parse(["attach", "--pid", "7"]) == options.AttachOptions(pid=7)
    assert cli.parse(["run", "--", "true"]) == options.RunOptions(cmd=["--", "true"])
    assert cli.parse(["snapshot", "--sglang", "http://h:1"]) == options.SnapshotOptions(
        sglang="http://h:1"
    )
    assert cli.parse(["demo"]) == options.DemoOptions()
    assert cli.parse(["report", "x.kdash"]) == options.ReportOptions(path=Path("x.kdash"))
    assert cli.parse(["man"]) == options.ManOptions()
    live = options.LiveOptions()
    assert (live.interval, live.pre, live.post) == (0.25, 10.0, 5.0)
    assert not live.pc_sampling and live.cost_budget is None and not live.graph_kernels


def test_a_given_option_reaches_its_typed_field(monkeypatch):
    monkeypatch.setenv(options.ENV_API_KEY, "from-env")
    got = cli.parse(
        ["attach", "--pid", "3", "--interval", "0.5", "--gpus", "0,2", "--pc-sampling"]
        + ["--cost-budget", "2", "--headless", "--duration", "4", "-o", "out.kdash"]
    )
    assert isinstance(got, options.AttachOptions)
    assert (got.interval, got.gpus, got.pc_sampling, got.cost_budget) == (0.5, [0, 2], True, 2.0)
    assert (got.headless, got.duration, got.output) == (True, 4.0, Path("out.kdash"))
    assert got.api_key == "from-env" and got.admin_api_key is None
    assert options.AttachOptions(pid=3).api_key == "from-env"  # the same default in code


def test_an_option_without_a_field_is_a_bug_said_at_once():
    ns = argparse.Namespace(command="demo", theme=None, surprise=1)
    with pytest.raises(TypeError, match="surprise"):
        options.from_namespace(options.DemoOptions, ns, skip=("command",))


def test_no_command_names_the_table_in_one_line(capsys):
    assert cli.main([]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"kdash: give a command: {', '.join(cli.COMMANDS)}"


# -- capture metadata ------------------------------------------------------------------------
@pytest.mark.parametrize("path", CAPTURES, ids=lambda p: p.name)
def test_every_stored_capture_reads_into_the_record_and_back(path):
    """Old captures open: the record reads them and gives back the same non-null keys."""
    meta = read_meta(path)
    record = CaptureMeta.from_dict(meta)
    assert record.window.end_ns == meta["window"]["end_ns"]
    assert record.sources == meta.get("sources", {})
    assert load_capture(path).info == record
    back = record.to_dict()
    assert {k: v for k, v in meta.items() if v is not None} == {
        k: v for k, v in back.items() if v is not None
    }
    assert validate_meta(back) == ""


def test_a_sparse_old_meta_takes_defaults_and_keeps_unknown_keys():
    old = {"format": "kdash-capture", "schema_version": 1, "window": {"start_ns": 5}, "new": [1]}
    r = CaptureMeta.from_dict(old)
    assert r.window == Window(start_ns=5) and r.clock == ClockInfo() and r.gpus == []
    assert r.title is None and r.extra == {"new": [1]}
    assert r.to_dict()["new"] == [1] and r.merged({"title": "t"}).title == "t"


def test_the_builder_writes_the_keys_captures_have(tmp_path):
    from kdash.session import build_meta as recorded_meta

    rec = recorded_meta(
        target=None,
        gpus=[{"index": 0, "name": "G", "driver_version": "580.1"}],
        sources={"nvml": "ok"},
        start_ns=1_000,
        end_ns=2_500_001_000,
        trigger_ns=2_000_000_000,
        wall_offset_ns=7,
        extra={"interval_s": 0.25, "title": "t"},
    )
    assert set(rec) == {
        "kdash_version",
        "created_wall_ns",
        "title",
        "target",
        "host",
        "gpus",
        "driver",
        "clock",
        "window",
        "sources",
        "sources_health",
        "overflowed_rows",
        "interval_s",
    }
    assert rec["driver"] == "580.1" and rec["overflowed_rows"] == 0
    assert rec["window"] == {
        "start_ns": 1_000,
        "end_ns": 2_500_001_000,
        "seconds": 2.5,
        "trigger_ns": 2_000_000_000,
    }
    assert rec["clock"] == {"domain": "host monotonic ns", "wall_offset_ns": 7}
    assert rec["sources_health"]["nvml"]["state"] == "ok"

    imported = build_meta(
        target={"pid": 1, "cmdline": "", "host": "h"},
        host={"hostname": "h"},
        gpus=[],
        clock=ClockInfo(domain="unix wall ns", derived_from="Kineto baseTimeNanoseconds + ts"),
        window=Window.of(0, 1_234_567, digits=6),
        sources={"kineto": "ok"},
        origin="kineto-import",
    ).to_dict()
    assert "sources_health" not in imported and "created_wall_ns" not in imported
    assert imported["driver"] is None and imported["window"]["seconds"] == 0.001235
    assert imported["clock"]["from"] == "Kineto baseTimeNanoseconds + ts"

    # a record and its dict write the same kdash.json
    a = write_capture(tmp_path / "a", CaptureMeta.from_dict(rec), {})
    b = write_capture(tmp_path / "b", rec, {})
    with zipfile.ZipFile(a) as za, zipfile.ZipFile(b) as zb:
        assert json.loads(za.read(META_NAME)) == json.loads(zb.read(META_NAME))
