"""Damaged and hostile inputs: every case exits 0 or 2, and 2 with exactly one `kdash:` line.

Seeded mutations of the shipped captures (tests/data/*.kdash, the bundled demo) and Kineto
traces (tests/data/*.trace.json.gz): byte flips, truncations, renamed zip members, members
whose directory entry claims gigabytes, members damaged behind a valid CRC, metadata with
huge row counts, wrong types or deep nesting, traces nested deep or holding huge numbers. Most
cases run `kdash.cli.main` in this process (a subprocess each would take minutes on two
cores); a few run the real command under a 1 GiB address-space limit, for the real exit status
and the one stderr line.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import random
import resource
import struct
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from kdash.cli import main

DATA = Path(__file__).parent / "data"
CAPTURES = sorted(DATA.glob("*.kdash")) + [
    Path(__file__).parent.parent / "kdash" / "data" / "demo-h200.kdash"
]
TRACES = sorted(DATA.glob("*.trace.json.gz"))
SEED = 20261201
AS_LIMIT = 1 << 30


@dataclass
class Case:
    name: str
    make: Callable[[Path], Path]  # writes the input under a folder, returns its path
    command: str  # report | export | open-check | import


# -- mutations of a capture (zip of kdash.json + Parquet) ---------------------------------
def _central_entries(data: bytes) -> list[tuple[int, str]]:
    """(offset, name) of each central directory entry."""
    out = []
    i = data.find(b"PK\x01\x02")
    while i >= 0:
        n, m, k = struct.unpack("<HHH", data[i + 28 : i + 34])
        out.append((i, data[i + 46 : i + 46 + n].decode("utf-8", "replace")))
        i = data.find(b"PK\x01\x02", i + 46 + n + m + k)
    return out


def _rezip(src: Path, change: Callable[[str, bytes], tuple[str, bytes] | None]) -> bytes:
    """The zip rebuilt with `change(name, data)` applied (None drops the member); valid CRCs."""
    buf = io.BytesIO()
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            got = change(info.filename, zin.read(info))
            if got is not None:
                zout.writestr(got[0], got[1])
    return buf.getvalue()


def _meta_change(edit: Callable[[dict], object]) -> Callable[[str, bytes], tuple[str, bytes]]:
    def change(name: str, data: bytes) -> tuple[str, bytes]:
        if name != "kdash.json":
            return name, data
        meta = json.loads(data)
        out = edit(meta)
        return name, (out if isinstance(out, bytes) else json.dumps(meta).encode())

    return change


def _one_capture(src: Path, rnd: random.Random) -> list[Case]:
    raw = src.read_bytes()
    tag = src.stem
    big = "demo" in tag
    cases = _byte_cases(raw, tag, big, rnd)
    cases += _member_cases(src, raw, tag, rnd)
    cases += _meta_cases(src, tag, big)
    if not big:
        cases.append(Case(f"{tag}-export", lambda d, src=src: src, "export"))
    return cases


def _byte_cases(raw: bytes, tag: str, big: bool, rnd: random.Random) -> list[Case]:
    """Bit flips anywhere, byte flips in the zip's headers, truncations."""
    cases: list[Case] = []
    flips = 10 if big else 25
    for i in range(flips):
        pos = [rnd.randrange(len(raw)) for _ in range(rnd.randint(1, 3))]

        def flip(d: Path, pos: list[int] = pos) -> Path:
            b = bytearray(raw)
            for p in pos:
                b[p] ^= 1 << (p % 8)
            (d / "c.kdash").write_bytes(bytes(b))
            return d / "c.kdash"

        cases.append(Case(f"{tag}-flip{i}", flip, "report"))
    # flips in the central directory and the local headers, where the structure is
    ends = [o for o, _ in _central_entries(raw)]
    for i in range(8):
        if not ends:
            break
        o = rnd.choice(ends) + rnd.randrange(46)

        def head_flip(d: Path, o: int = o) -> Path:
            b = bytearray(raw)
            b[o] ^= 0xFF
            (d / "c.kdash").write_bytes(bytes(b))
            return d / "c.kdash"

        cases.append(Case(f"{tag}-dirflip{i}", head_flip, "report"))
    for i in range(6 if big else 10):
        cut = rnd.randrange(len(raw))

        def trunc(d: Path, cut: int = cut) -> Path:
            (d / "c.kdash").write_bytes(raw[:cut])
            return d / "c.kdash"

        cases.append(Case(f"{tag}-cut{i}", trunc, "report"))
    return cases


def _member_cases(src: Path, raw: bytes, tag: str, rnd: random.Random) -> list[Case]:
    """Per table member: a renamed entry, a 3 GiB size, an unknown method, flips inside."""
    cases: list[Case] = []
    for o, name in _central_entries(raw):
        if not name.startswith("tables/"):
            continue

        def rename(d: Path, o: int = o) -> Path:
            b = bytearray(raw)
            b[o + 46 + 8] ^= 0x01  # one byte of the name in the directory
            (d / "c.kdash").write_bytes(bytes(b))
            return d / "c.kdash"

        def inflate(d: Path, o: int = o) -> Path:
            b = bytearray(raw)
            b[o + 24 : o + 28] = struct.pack("<I", 3 << 30)  # uncompressed size: 3 GiB
            (d / "c.kdash").write_bytes(bytes(b))
            return d / "c.kdash"

        def method(d: Path, o: int = o) -> Path:
            b = bytearray(raw)
            b[o + 10 : o + 12] = struct.pack("<H", 98)  # PPMd
            (d / "c.kdash").write_bytes(bytes(b))
            return d / "c.kdash"

        def inner_flip(d: Path, name: str = name, seed: int = rnd.randrange(1 << 30)) -> Path:
            r = random.Random(seed)

            def change(n: str, data: bytes) -> tuple[str, bytes]:
                if n != name:
                    return n, data
                b = bytearray(data)
                for _ in range(r.randint(1, 4)):
                    p = r.randrange(len(b))
                    b[p] ^= 1 << r.randrange(8)
                return n, bytes(b)

            (d / "c.kdash").write_bytes(_rezip(src, change))
            return d / "c.kdash"

        cases += [
            Case(f"{tag}-rename-{name}", rename, "report"),
            Case(f"{tag}-inflate-{name}", inflate, "report"),
            Case(f"{tag}-method-{name}", method, "report"),
            Case(f"{tag}-innerflip-{name}", inner_flip, "report"),
        ]
    return cases


def _meta_cases(src: Path, tag: str, big: bool) -> list[Case]:
    """Metadata that is the wrong shape, too large, too deep or not an object."""
    cases: list[Case] = []
    meta_edits: list[tuple[str, Callable[[dict], object]]] = [
        ("rows-huge", lambda m: m["tables"].update({k: 200_000_000 for k in m["tables"]})),
        ("rows-off", lambda m: m["tables"].update({k: v + 1 for k, v in m["tables"].items()})),
        ("rows-str", lambda m: m["tables"].update({"threads": "210"})),
        ("tables-list", lambda m: m.update(tables=[1, 2])),
        ("version-str", lambda m: m.update(schema_version="1")),
        ("version-bool", lambda m: m.update(schema_version=True)),
        ("target-list", lambda m: m.update(target=[1])),
        ("window-str", lambda m: m.update(window={"start_ns": "0", "end_ns": 5})),
        ("gpus-dict", lambda m: m.update(gpus={"0": 1})),
        ("gpus-noindex", lambda m: m.update(gpus=[{"name": "x", "index": None}])),
        ("sources-list", lambda m: m.update(sources=["ok"])),
        ("title-int", lambda m: m.update(title=5)),
        ("sglang-bad", lambda m: m.update(sglang={"roles": [{"pid": 1}]})),
        ("deep", lambda m: b'{"format":"kdash-capture","x":' + b"[" * 40_000 + b"]" * 40_000),
        ("not-object", lambda m: b"[1,2,3]"),
        ("big-int", lambda m: m.update(created_wall_ns=10**40)),
        ("huge-string", lambda m: m.update(title="x" * (17 << 20))),
    ]
    for label, edit in meta_edits:
        if big and label in ("huge-string",):
            continue

        def meta_case(d: Path, edit: Callable[[dict], object] = edit) -> Path:
            (d / "c.kdash").write_bytes(_rezip(src, _meta_change(edit)))
            return d / "c.kdash"

        cases.append(Case(f"{tag}-meta-{label}", meta_case, "report"))
        if label in ("target-list", "window-str", "gpus-noindex", "sglang-bad"):
            cases.append(Case(f"{tag}-meta-{label}-open", meta_case, "open-check"))
    return cases


def capture_cases(rnd: random.Random) -> list[Case]:
    cases: list[Case] = []
    for src in CAPTURES:
        cases += _one_capture(src, rnd)
    return cases


# -- mutations of a Kineto trace ------------------------------------------------------------
def _one_trace(src: Path, rnd: random.Random) -> list[Case]:
    cases: list[Case] = []
    packed = src.read_bytes()
    text = gzip.decompress(packed)
    tag = src.name.split(".")[0]

    def write(d: Path, data: bytes, gz: bool = False) -> Path:
        p = d / ("t.trace.json.gz" if gz else "t.trace.json")
        p.write_bytes(gzip.compress(data, 1) if gz else data)
        return p

    for i in range(25):
        pos = [rnd.randrange(len(text)) for _ in range(rnd.randint(1, 4))]

        def flip(d: Path, pos: list[int] = pos) -> Path:
            b = bytearray(text)
            for p in pos:
                b[p] = rnd_byte(p)
            return write(d, bytes(b))

        cases.append(Case(f"{tag}-flip{i}", flip, "import"))
    for i in range(8):
        pos = rnd.randrange(len(packed))

        def gz_flip(d: Path, pos: int = pos) -> Path:
            b = bytearray(packed)
            b[pos] ^= 0x10
            p = d / "t.trace.json.gz"
            p.write_bytes(bytes(b))
            return p

        cases.append(Case(f"{tag}-gzflip{i}", gz_flip, "import"))
    for i in range(8):
        cut = rnd.randrange(len(text))
        cases.append(Case(f"{tag}-cut{i}", lambda d, c=cut: write(d, text[:c]), "import"))
    cut = rnd.randrange(len(packed))
    cases.append(
        Case(f"{tag}-gzcut", lambda d, c=cut: _write_raw(d, packed[:c], ".json.gz"), "import")
    )
    at = text.index(b'"args": {') if b'"args": {' in text else text.index(b'"args":')
    inserts = {
        "deep": b'"deep": ' + b"[" * 40_000 + b"]" * 40_000 + b", ",
        "bigint": b'"big": 123456789012345678901234567890, ',
        "nan-ts": None,
        "long-string": b'"s": "' + b"a" * (17 << 20) + b'", ',
    }
    for label, ins in inserts.items():
        if ins is None:
            data = text.replace(b'"ts": ', b'"ts": 1e300, "x": ', 3)
        else:
            data = text[: at + 9] + ins + text[at + 9 :]
        cases.append(Case(f"{tag}-{label}", lambda d, b=data: write(d, b), "import"))
    cases.append(Case(f"{tag}-deep-gz", lambda d: write(d, b"[" * 40_000, True), "import"))
    cases.append(Case(f"{tag}-ok", lambda d, p=src: p, "import"))
    return cases


def trace_cases(rnd: random.Random) -> list[Case]:
    cases: list[Case] = []
    for src in TRACES:
        cases += _one_trace(src, rnd)
    return cases


def rnd_byte(p: int) -> int:
    return b'{}[]",:0123456789ae-" \\'[p % 23]


def _write_raw(d: Path, data: bytes, suffix: str) -> Path:
    p = d / f"t{suffix}"
    p.write_bytes(data)
    return p


def all_cases() -> list[Case]:
    rnd = random.Random(SEED)
    return capture_cases(rnd) + trace_cases(rnd)


# -- running -------------------------------------------------------------------------------
def _argv(case: Case, path: Path, work: Path) -> list[str]:
    if case.command == "import":
        return ["import", str(path), "--output", str(work / "out.kdash")]
    if case.command == "export":
        return ["export", str(path), "--perfetto", str(work / "out.json.gz")]
    return ["report", str(path), "--json"]


def run_in_process(case: Case, work: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[int, str]:
    path = case.make(work)
    if case.command == "open-check":
        # `kdash open` without a terminal: the app must never start on a bad capture
        import kdash.tui.app as app_mod

        monkeypatch.setattr(app_mod.KdashApp, "run", lambda self: pytest.fail("app started"))
        argv = ["open", str(path)]
    else:
        argv = _argv(case, path, work)
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        rc = main(argv)
    return rc, err.getvalue()


def check_outcome(case: Case, rc: int, stderr: str) -> None:
    assert rc in (0, 2), (case.name, rc, stderr)
    assert "Traceback" not in stderr, (case.name, stderr)
    assert "internal error" not in stderr, (case.name, stderr)
    if rc == 2:
        lines = [ln for ln in stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("kdash: "), (case.name, stderr)


def test_fuzz_in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cases = all_cases()
    assert len(cases) >= 300
    outcomes = {0: 0, 2: 0}
    for i, case in enumerate(cases):
        work = tmp_path / str(i)
        work.mkdir()
        with monkeypatch.context() as mp:
            rc, stderr = run_in_process(case, work, mp)
        check_outcome(case, rc, stderr)
        outcomes[rc] += 1
    print(f"fuzz: {len(cases)} cases, all passed ({outcomes[0]} exit 0, {outcomes[2]} exit 2)")
    assert outcomes[2] > len(cases) // 2  # most mutations are damage kdash must see


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))


SUBPROCESS_CASES = [
    "demo-h200-rename-tables/kernels.parquet",
    "demo-h200-inflate-tables/kernels.parquet",
    "demo-h200-meta-rows-huge",
    "demo-h200-meta-deep",
    "demo-h200-meta-version-str",
    "local-cpu-innerflip-tables/threads.parquet",
    "kdash-h200-TP-0-DECODE-deep",
    "kdash-h200-TP-0-DECODE-long-string",
    "kdash-h200-TP-0-DECODE-bigint",
]


@pytest.mark.parametrize("name", SUBPROCESS_CASES)
def test_fuzz_real_command(tmp_path: Path, name: str) -> None:
    """The real `python -m kdash.cli` under a 1 GiB address-space limit: exit 2, one line."""
    case = next(c for c in all_cases() if c.name == name)
    path = case.make(tmp_path)
    r = subprocess.run(
        [sys.executable, "-m", "kdash.cli", *_argv(case, path, tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=_limit_memory,
    )
    assert r.returncode == 2, (name, r.returncode, r.stderr[-2000:])
    check_outcome(case, r.returncode, r.stderr)


def test_zip_helpers_see_every_member() -> None:
    raw = CAPTURES[0].read_bytes()
    names = [n for _, n in _central_entries(raw)]
    with zipfile.ZipFile(CAPTURES[0]) as zf:
        assert names == zf.namelist()
