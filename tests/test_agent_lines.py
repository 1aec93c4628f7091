"""Line tables made in kdash's process for the kernels PC samples name (collectors/agent/lines.py),
on the real H200 samples and cubins in tests/data (see tests/test_h200_pcsamples.py)."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
from kdash.collectors.agent.lines import LineTableFeeder, target_triton_cache

from kdash import cubin, schema

DATA = Path(__file__).parent / "data"
NVDISASM, WHY = cubin.find_nvdisasm()
LIBCUPTI, WHY_CUPTI = cubin.find_libcupti()
pytestmark = [
    pytest.mark.skipif(NVDISASM is None, reason=WHY),
    pytest.mark.skipif(LIBCUPTI is None, reason=WHY_CUPTI),
]


@pytest.fixture
def triton_cache(tmp_path: Path) -> Path:
    """A Triton-shaped cache (<hash>/<name>.cubin + .json) holding the H200 cubins, plus a
    second `_decode_stage1` build whose CRC is not the samples' (a stale specialisation)."""
    for i, name in enumerate(("_decode_stage1", "_decode_stage2", "_extend_kernel")):
        d = tmp_path / f"hash{i}"
        d.mkdir()
        shutil.copy(DATA / "h200-cubins" / f"{name}.cubin", d / f"{name}.cubin")
        (d / f"{name}.json").write_text(json.dumps({"name": name, "target": {"arch": 90}}))
    other = tmp_path / "hash9"
    other.mkdir()
    shutil.copy(DATA / "h200-cubins" / "_decode_stage2.cubin", other / "_decode_stage1.cubin")
    (other / "_decode_stage1.json").write_text(json.dumps({"name": "_decode_stage1"}))
    return tmp_path


def real_batch() -> dict:
    with gzip.open(DATA / "h200-pcsamples.json.gz", "rt") as f:
        return schema.from_frame("pc_samples", pd.DataFrame(json.load(f)))


def test_line_tables_for_sampled_triton_kernels_by_crc(triton_cache):
    feeder = LineTableFeeder(pid=1, cache_dir=triton_cache)
    batch = real_batch()
    feeder.offer(batch)
    assert feeder.wait_idle(60)
    made = feeder.take()
    sl = schema.to_frame("source_lines", schema.concat("source_lines", made))
    assert set(sl["function"]) == {"_decode_stage1", "_decode_stage2", "_extend_kernel"}
    # the right build of _decode_stage1: its CRC is the samples' one
    want = set(
        pd.Series(batch["cubin_crc"])[pd.Series(batch["kernel"]) == "_decode_stage1"].tolist()
    )
    got = set(sl.loc[sl["function"] == "_decode_stage1", "cubin_crc"].tolist())
    assert got == want
    ok = {k for (k, _), v in feeder.outcomes.items() if v == "ok"}
    assert ok == {"_decode_stage1", "_decode_stage2", "_extend_kernel"}
    missing = {k: v for (k, _), v in feeder.outcomes.items() if v != "ok"}
    assert missing and all(v.startswith("not in the Triton cache") for v in missing.values())
    # each (kernel, CRC) is looked at once
    feeder.offer(batch)
    assert feeder.wait_idle(10) and feeder.take() == []
    # the tables map every sampled PC of those kernels to a line
    tables = cubin.from_frame(sl)
    hot = cubin.hot_lines(
        schema.to_frame("pc_samples", batch), cubin.table_for_kernel(tables, "_decode_stage1")
    )
    assert Path(hot["file"].iloc[0]).name == "decode_attention.py"


def test_triton_cache_of_the_target_from_its_environment(tmp_path):
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "tc"))
    code = "import time; print('ready', flush=True); time.sleep(5)"
    p = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        assert target_triton_cache(p.pid) == tmp_path / "tc"
    finally:
        p.kill()
        p.wait()
    # a process that is gone: this user's cache, no error
    assert target_triton_cache(p.pid) == cubin.triton_cache_dir()


def test_torch_compile_cubins_are_found_under_inductors_cache(tmp_path):
    """inductor compiles its Triton modules with the cache under its own folder, which the
    target's environment does not name: the roots include `<inductor dir>/triton/<device>`."""
    import os
    import subprocess
    import sys

    from kdash.collectors.agent.lines import triton_cache_roots

    ind = tmp_path / "ind"
    (ind / "triton" / "0").mkdir(parents=True)
    own = tmp_path / "own"
    own.mkdir()
    home = tmp_path / "home"
    (home / ".triton" / "cache").mkdir(parents=True)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(ind), TRITON_CACHE_DIR=str(own))
    env["HOME"] = str(home)
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env=env)
    try:
        import time

        for _ in range(100):  # /proc/PID/environ is the child's own once it has exec'd
            if f"{own}".encode() in Path(f"/proc/{p.pid}/environ").read_bytes():
                break
            time.sleep(0.05)
        roots = triton_cache_roots(p.pid)
    finally:
        p.kill()
        p.wait()
    assert roots == [own, home / ".triton" / "cache", ind / "triton" / "0"]


def test_the_text_of_the_files_a_line_table_points_at_is_carried_once(tmp_path):
    """A cubin compiled here (sm_90, line info) in a Triton-shaped cache: its line table comes
    with one `source_files` row, the file's text and hash, and not again for the same text."""
    import hashlib

    from cubin_fixtures import compile_kernel

    data = compile_kernel("_decode_stage2", tmp_path / "tc")
    d = tmp_path / "cache" / "h0"
    d.mkdir(parents=True)
    (d / "_decode_stage2.cubin").write_bytes(data)
    (d / "_decode_stage2.json").write_text(json.dumps({"name": "_decode_stage2"}))
    crc, _ = cubin.cubin_crc(data)
    batch = schema.make_batch(
        "pc_samples",
        t_ns=[1],
        kernel=["_decode_stage2"],
        cubin_crc=[cubin.crc_to_i8(crc)],
        pc_offset=[0],
        stall_reason=["smsp__pcsamp_warps_issue_stalled_selected"],
        count=[1],
    )
    feeder = LineTableFeeder(pid=1, cache_dir=tmp_path / "cache")
    feeder.offer(batch)
    assert feeder.wait_idle(60)
    assert feeder.take() and feeder.outcomes[("_decode_stage2", cubin.crc_to_i8(crc))] == "ok"
    files = schema.to_frame("source_files", schema.concat("source_files", feeder.take_files()))
    assert len(files) == 1
    path = Path(files["file"].iloc[0])
    assert path.name == "decode_attention.py" and path.read_text() == files["text"].iloc[0]
    assert files["sha256"].iloc[0] == hashlib.sha256(path.read_bytes()).hexdigest()
    feeder._one("_decode_stage2", cubin.crc_to_i8(crc))  # the same table again
    assert feeder.take_files() == []
