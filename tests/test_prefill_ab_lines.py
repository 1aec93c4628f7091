"""bench/prefill_ab_lines.py on a real A/B's JSON (bench/results/prefill-ab-h100-s29-6.json,
an H100): two Gluon configs at one shape keep two names (the log once showed one of them)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load():
    spec = importlib.util.spec_from_file_location(
        "prefill_ab_lines", ROOT / "bench" / "prefill_ab_lines.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gates_and_rounds_in_one_line_each(monkeypatch, capsys) -> None:
    import io

    mod = load()
    ab = json.loads((ROOT / "bench" / "results" / "prefill-ab-h100-s29-6.json").read_text())
    lines = [json.dumps(r) for r in ab["gates"][:3]] + [json.dumps(ab["timing"][0]), "a note"]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(lines) + "\n"))
    assert mod.main() == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 5
    assert out[0].startswith("gate ragged d128 16/16/128 True passed")
    assert out[3].startswith("16/16/128 full 4096 {")
    for name in ("'default'", "'gluon1'", "'gluon2'", "'against'", "'cudnn'", "'flash'"):
        assert name in out[3]
    assert out[4] == "a note"
