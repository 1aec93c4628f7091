"""bench/ab_merge.py on the A/B files recorded on the H200 (bench/results): the repeats of
several device calls become one summary, and each run's rate after each detach is kept."""

from __future__ import annotations

import importlib.util
import json
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
FILES = [
    "agent-ab-h200-s11-ilpin.json",
    "agent-ab-h200-s10-eager-il-pinned.json",
    "agent-ab-h200-eager-il3.json",
]


def load_merge():
    spec = importlib.util.spec_from_file_location("ab_merge", ROOT / "bench" / "ab_merge.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_merge_keeps_every_repeat_and_recomputes_the_medians() -> None:
    m = load_merge()
    files = [json.loads((RESULTS / f).read_text()) for f in FILES]
    merged = m.merge(files)
    eager_runs = [k for k in merged["runs"] if k.startswith("eager/default/")]
    # one repeat in the first file, one in the second (written before per_run existed), three
    assert sorted(eager_runs) == [f"eager/default/{i}" for i in range(5)]
    s = merged["summary"]["eager"]
    assert s["repeats"] == 5
    assert s["attached_vs_twin_pct"] == round(statistics.median(s["attached_each_pct"]), 2)
    assert s["after_detach_vs_twin_pct"] == round(statistics.median(s["after_each_pct"]), 2)
    for pair in s["after_each_detach_pct"]:
        assert len(pair) == 2 and all(isinstance(x, float) for x in pair)
    # the graph targets came from one file: their keys are not split at their underscore
    assert merged["summary"]["decode_graph"]["repeats"] == 1
    assert len(merged["summary"]["graph_tiny"]["after_each_detach_pct"]) == 1


def test_the_kept_summary_is_what_merge_gives() -> None:
    m = load_merge()
    files = [json.loads((RESULTS / f).read_text()) for f in FILES]
    kept = json.loads((RESULTS / "agent-ab-h200.json").read_text())
    assert kept["summary"] == json.loads(json.dumps(m.merge(files)["summary"]))


def test_a_file_that_is_not_an_ab_result_is_one_line_and_exit_1(tmp_path, capsys) -> None:
    m = load_merge()
    bad = tmp_path / "bad.json"
    bad.write_text('{"runs": {}}')
    out = tmp_path / "out.json"
    assert m.main([str(out), str(bad), str(tmp_path / "missing.json")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ab_merge: cannot merge")
    assert not out.exists()
