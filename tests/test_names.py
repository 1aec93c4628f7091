"""Kernel names: demangled at ingest by a pure-Python demangler, labelled alike everywhere.

Names are the REAL ones recorded on the H200 (kdash/data/demo-h200.kdash, tests/data).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kdash import kineto, schema
from kdash.analyses.kernels import top_kernels
from kdash.capture import load_capture
from kdash.names import demangle, demangle_kernels, short_names

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "kdash/data/demo-h200.kdash"
OLD = ROOT / "tests/data/h200-demo-old-agent.kdash"  # an older agent's: mangled names in the file
DATA = ROOT / "tests/data"


def _raw_kernel_names(path: Path) -> list[str]:
    """The kernel names as the capture file holds them (before load_capture demangles)."""
    import io
    import zipfile

    import pyarrow.parquet as pq

    with zipfile.ZipFile(path) as zf:
        if "tables/kernels.parquet" not in zf.namelist():
            return []
        raw = zf.read("tables/kernels.parquet")
    return pq.read_table(io.BytesIO(raw), columns=["name"]).column("name").to_pylist()


def _mangled_names() -> list[str]:
    names: set[str] = set()
    for p in [DEMO, *sorted(DATA.glob("*.kdash"))]:
        names.update(n for n in _raw_kernel_names(p) if n.startswith("_Z"))
    return sorted(names)


def test_demangled_as_cxxfilt_spells_it():
    """GNU spelling, as c++filt and Kineto (abi::__cxa_demangle) write names: joins with
    imported traces match. c++filt only checks here; kdash never runs it."""
    names = _mangled_names()
    assert len(names) >= 20
    out = [demangle(n) for n in names]
    assert not any(o.startswith("_Z") for o in out)
    if shutil.which("c++filt") is None:
        pytest.skip("no c++filt here to compare with")
    ref = subprocess.run(
        ["c++filt"], input="\n".join(names) + "\n", capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out == ref


def test_demo_capture_holds_demangled_names_and_their_symbols():
    """The current agent's store demangles what enters it: the file holds the demangled
    names, and kernel_symbols the mangled ones they came from."""
    raw = set(_raw_kernel_names(DEMO))
    assert not any(n.startswith("_Z") for n in raw)
    sym = load_capture(DEMO).tables["kernel_symbols"]
    assert len(sym) >= 10 and set(sym["name"]) <= raw
    assert (sym["name"] == sym["mangled"].map(demangle)).all()


def test_old_capture_loads_demangled_with_the_symbols_kept():
    raw = np.asarray(_raw_kernel_names(OLD), dtype=object)
    assert sum(n.startswith("_Z") for n in set(raw)) >= 10
    cap = load_capture(OLD)
    k, sym = cap.tables["kernels"], cap.tables["kernel_symbols"]
    assert not k["name"].str.startswith("_Z").any()
    assert set(sym["mangled"]) == {n for n in raw if n.startswith("_Z")}
    assert (sym["name"] == sym["mangled"].map(demangle)).all()
    plain = ~np.array([n.startswith("_Z") for n in raw])
    assert (k["name"].to_numpy()[plain] == raw[plain]).all()


def test_store_demangles_what_enters_it_once(tmp_path):
    from kdash.capture import write_capture
    from kdash.store import Store

    sym = _mangled_names()[0]
    b = schema.make_batch("kernels", start_ns=[1, 2], end_ns=[2, 3], name=[sym, "_decode_stage1"])
    s = Store()
    later = {**b, "start_ns": b["start_ns"] + 10, "end_ns": b["end_ns"] + 10}
    s.append("kernels", b)
    s.append("kernels", later)
    got = s.get("kernels")
    assert got["name"].tolist() == [demangle(sym), "_decode_stage1"] * 2
    syms = s.get("kernel_symbols")
    assert syms["mangled"].tolist() == [sym] and syms["name"].tolist() == [demangle(sym)]
    assert demangle_kernels(got)[0] is got  # nothing left to do: the same batch back
    # a capture of that store keeps the symbols, and loading it adds none
    out = write_capture(tmp_path / "c.kdash", {"title": "t"}, {t: s.get(t) for t in schema.TABLES})
    cap = load_capture(out)
    assert cap.tables["kernel_symbols"]["mangled"].tolist() == [sym]


def test_no_two_rows_of_the_demos_top_kernels_read_the_same():
    top = top_kernels(load_capture(DEMO).tables["kernels"])
    assert len(top) >= 20
    for width in (28, 40, 48):
        labels = short_names(top["name"], width)
        assert len(set(labels.values())) == len(top), width
        assert all(len(v) <= width for v in labels.values())
    head = short_names(top["name"].head(20), 40)
    assert len(set(head.values())) == 20
    shown = set(head.values())
    # ATen's elementwise kernels name their op, a GEMM keeps its tile
    assert {"elementwise_kernel<MulFunctor, BFloat16>", "reduce_kernel<MeanOps>"} <= shown
    every = short_names(top["name"], 40).values()
    assert any(v.startswith("vectorized_elementwise") and "FillFunctor" in v for v in every)
    assert not any(v.endswith("<…>") and "elementwise" in v for v in shown)
    nvjet = [v for v in short_names(top["name"], 40).values() if v.startswith("nvjet")]
    assert nvjet and all("x" in v.split("…")[-1] for v in nvjet)


def test_labels_tell_instances_apart():
    n = [
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
        "std::array<char*, 1ul> >(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)",
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<int>, "
        "std::array<char*, 1ul> >(int, at::native::FillFunctor<int>, std::array<char*, 1ul>)",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, "
        "at::native::MeanOps<float, float, float, float>, unsigned int, float, 4, 4> >("
        "at::native::ReduceOp<float, at::native::MeanOps<float, float, float, float>, "
        "unsigned int, float, 4, 4>)",
    ]
    labels = short_names(n, 60)
    assert labels[n[0]] == "vectorized_elementwise_kernel<FillFunctor, float>"
    assert labels[n[1]] == "vectorized_elementwise_kernel<FillFunctor, int>"
    assert labels[n[2]] == "reduce_kernel<MeanOps>"
    assert short_names(["_decode_stage1"])["_decode_stage1"] == "_decode_stage1"


def test_report_json_has_the_symbol_in_its_own_field():
    out = subprocess.run(
        [sys.executable, "-m", "kdash.cli", "report", str(DEMO), "--json", "--top", "20"],
        capture_output=True,
        text=True,
        check=True,
    )
    top = json.loads(out.stdout)["top_kernels"]
    assert len(top) == 20
    assert not any(k["name"].startswith("_Z") for k in top)
    mangled = [k for k in top if k["mangled"]]
    assert len(mangled) >= 10 and all(k["mangled"].startswith("_Z") for k in mangled)
    assert all(demangle(k["mangled"]) == k["name"] for k in mangled)
    assert all(k["mangled"] is None for k in top if not k["name"].startswith("void "))
    assert len({k["label"] for k in top}) == 20


def test_no_cxxfilt_process(monkeypatch):
    """Demangling never starts a process (it runs on the UI's workers and at ingest)."""

    def refuse(*a, **k):
        raise AssertionError(f"a process was started: {a[:1]}")

    monkeypatch.setattr(subprocess, "run", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)
    from kdash import triton_index

    sym = _mangled_names()[0]
    assert triton_index.demangle(sym) == demangle(sym) != sym
    top_kernels(load_capture(DEMO).tables["kernels"])
    for mod in ("kdash/names.py", "kdash/analyses/kernels.py"):
        assert "import subprocess" not in (ROOT / mod).read_text()


def test_imported_trace_names_stay_as_kineto_wrote_them():
    gz = DATA / "kdash-h200-TP-0-DECODE.trace.json.gz"
    tables, _ = kineto.read_traces([gz])
    assert len(tables["kernels"]["name"]) and not len(
        tables.get("kernel_symbols", {"t_ns": []})["t_ns"]
    )
