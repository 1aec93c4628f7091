"""bench/gpu_prefill_variants.py's choice of a config per variant and class, and its summary,
on made-up timing rows (the script itself times on a GPU; ``--smoke`` runs its flow on the CPU)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_prefill_variants.py"


def load():
    spec = importlib.util.spec_from_file_location("gpu_prefill_variants", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def row(cls, seq, default, flash, cudnn, variants):
    per = {
        n: {c: ({"ms": ms} if ms else {"error": "x"}) for c, ms in cs.items()}
        for n, cs in variants.items()
    }
    return {"class": cls, "seq": seq, "default_ms": default, "sdpa_flash_ms": flash,
            "sdpa_cudnn_ms": cudnn, "variants": per}  # fmt: skip


def test_choice_is_per_class_by_geometric_mean_and_summary_names_the_best() -> None:
    gv = load()
    # Config "a" wins at 4k by a little, "b" at 8k by a lot: the geometric mean picks "b".
    rows = [
        row("d128-full", 4096, 2.0, 2.4, 1.5, {"tma": {"a": 1.6, "b": 1.7}}),
        row("d128-full", 8192, 4.0, 4.8, 3.0, {"tma": {"a": 4.0, "b": 3.0}}),
        # "c" failed at one shape: never chosen; ffma has rows at d64 only: incomplete.
        row("d64-full", 4096, 1.0, 1.2, 0.9, {"tma": {"c": 0.8, "d": None}, "ffma": {"t": 0.95}}),
        row("d64-full", 8192, 2.0, 2.4, 1.8, {"tma": {"c": 1.6, "d": 1.9}, "ffma": {"t": 1.9}}),
    ]
    rows[2]["variants"]["tma"]["d"] = {"ms": 0.85}
    rows[3]["variants"]["tma"]["c"] = {"error": "compile"}
    for r, ptr in zip(rows, (2.2, 4.4, 1.1, 2.2), strict=True):
        r["pointer_ms"] = ptr
    chosen = gv.choose(rows)
    assert chosen["tma"] == {"d128-full": "b", "d64-full": "d"}
    assert chosen["ffma"] == {"d64-full": "t"}
    s = gv.summarize(rows, chosen)
    tma = s["variants"]["tma"]
    # tma: cuDNN / ours = 1.5/1.7, 3.0/3.0, 0.9/0.85, 1.8/1.9 -> lowest 1.5/1.7.
    assert tma["prefill_vs_sdpa_cudnn"] == pytest.approx(1.5 / 1.7)
    assert tma["prefill_vs_sdpa_flash"] == pytest.approx(2.4 / 1.9)
    assert tma["complete"] is True
    assert s["variants"]["ffma"]["complete"] is False
    assert s["best_variant"] == "tma"
    assert s["prefill_vs_sdpa_cudnn"] == tma["prefill_vs_sdpa_cudnn"]
    assert s["default"]["prefill_vs_sdpa_cudnn"] == pytest.approx(0.75)
    # The pointer kernel (the fallback): cuDNN / pointer = 1.5/2.2, 3.0/4.4, 0.9/1.1, 1.8/2.2.
    assert s["pointer"]["prefill_vs_sdpa_cudnn"] == pytest.approx(1.5 / 2.2)


def test_candidates_start_with_the_variants_own_config() -> None:
    gv = load()
    from kdash.kernels.prefill_hopper import VARIANTS, variant_config

    for name in VARIANTS:
        for d in (64, 128):
            for causal in (True, False):
                cands = gv.candidates(name, d, causal)
                assert cands[0] == variant_config(name, d, causal)
                assert len(set(cands)) == len(cands)
                want = "host" if name == "tma" else "none"
                assert all(c.descriptors == want for c in cands)


def test_a_gate_child_that_hangs_is_killed_and_the_rest_still_gated(tmp_path, monkeypatch) -> None:
    """A kernel that never returns cannot be made here, so the child is a stand-in script: it
    reports the start of its first job, then hangs on the even ones and passes the odd ones."""
    gv = load()
    fake = tmp_path / "child.sh"
    fake.write_text(
        "#!/bin/sh\n"
        "# argv: script --gate-child JOBS PROGRESS\n"
        'first=$(python3 -c "import json, sys; '
        'print(json.load(open(sys.argv[1]))[0][\'tag\'])" "$3")\n'
        'echo \'{"i": 0, "start": true}\' >> "$4"\n'
        "if [ $((first % 2)) -eq 1 ]; then\n"
        '  echo \'{"i": 0, "done": true, "pass": true, "msg": "ok"}\' >> "$4"\n'
        "  exit 0\n"
        "fi\n"
        "exec sleep 30\n"
    )
    fake.chmod(0o755)
    monkeypatch.setattr(gv.sys, "executable", str(fake))
    jobs = [{"tag": t} for t in (0, 1, 2)]
    got = list(gv.gates_in_child(jobs, False, 1.0))
    assert [j["tag"] for j, _ in got] == [0, 1, 2]
    assert [r["pass"] for _, r in got] == [False, True, False]
    assert got[0][1]["msg"].startswith("hung: no progress for 1 s, killed")
    assert got[1][1]["msg"] == "ok"
