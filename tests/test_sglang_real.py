"""kdash against SGLang's own code (0.5.10) on a CPU: tests/sglang_real.py says what is real.

Skipped unless the sglang wheel is installed (bench/sglang_cpu_env.sh); CI installs `.[test]`
only.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import sglang_real as real
from kdash.collectors import sglang_http as sh
from kdash.collectors.sglang_tree import Ranks, local_gpu_id, parse_ranks

from kdash.kineto import parse_trace_name, read_traces

pytestmark = pytest.mark.skipif(
    real.load() is None, reason="sglang not installed (bench/sglang_cpu_env.sh)"
)


def _files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.trace.json.gz")) if folder.exists() else []


def test_busy_profile_is_left_alone(tmp_path):
    """Item 1: another user's running profile gets a 500 for kdash, and stays theirs."""
    theirs, ours = tmp_path / "theirs", tmp_path / "ours"
    with real.CpuServer(tp=2) as srv:
        c = sh.SglangClient(srv.url)
        c.start_profile(sh.ProfileRequest(output_dir=str(theirs), activities=["CPU"]))
        with pytest.raises(sh.SglangError) as e:
            sh.take_profile(c, ranks=2, server_dir=str(ours), timeout_s=3, stable_s=0.2)
        assert e.value.kind == "busy"
        assert not _files(ours) and not _files(theirs)  # kdash wrote and stopped nothing
        assert c.stop_profile() and len(_files(theirs)) == 2  # their own stop still works
        assert not srv.crashed


def test_capture_records_exactly_the_steps_asked_and_idle_leaves_nothing(tmp_path):
    with real.CpuServer(tp=1) as srv:
        c = sh.SglangClient(srv.url)
        files = sh.take_profile(c, ranks=1, server_dir=str(tmp_path / "a"), num_steps=7,
                                timeout_s=20, stable_s=0.3)  # fmt: skip
        tables, _ = read_traces(files)
        names = list(tables["markers"]["name"])
        assert sum(n == "forward_DECODE" for n in names) == 7  # markers: CPU activity on
    with real.CpuServer(tp=1, traffic=[False]) as srv:
        c = sh.SglangClient(srv.url)
        with pytest.raises(sh.UserError, match="no forward step"):
            sh.take_profile(c, ranks=1, server_dir=str(tmp_path / "b"), timeout_s=1.5)
        srv.traffic[0] = True  # traffic after kdash gave up: its profile was disarmed
        time.sleep(1.0)
        assert not _files(tmp_path / "b")
        assert srv.scheds[0].profile_in_progress is False


def test_profile_request_turns_stacks_and_shapes_off():
    req = sh.ProfileRequest.for_capture(output_dir="/x", num_steps=3, activities=["CPU", "GPU"],
                                        prefix="p", profile_v2=False)  # fmt: skip
    body = req.to_json()
    assert body["with_stack"] is False and body["record_shapes"] is False
    assert body["start_step"] == 1 and "profile_by_stage" not in body


def test_two_keys(tmp_path):
    """Item 2: plain key for info and loads, admin key for the profile; none for metrics."""
    with real.CpuServer(tp=1, api_key="user", admin_api_key="admin") as srv:
        none = sh.SglangClient(srv.url)
        assert none.health() == 200 and none.metrics_text() is not None
        with pytest.raises(sh.SglangError, match="--api-key"):
            none.get_server_info()
        only_user = sh.SglangClient(srv.url, api_key="user")
        assert only_user.get_server_info()["admin_api_key"] == "admin"
        with pytest.raises(sh.SglangError, match="--admin-api-key") as e:
            only_user.start_profile(sh.ProfileRequest(num_steps=1, start_step=1))
        assert e.value.kind == "unauthorized"
        both = sh.SglangClient(srv.url, api_key="user", admin_api_key="admin")
        files = sh.take_profile(both, ranks=1, server_dir=str(tmp_path), num_steps=2,
                                timeout_s=20, stable_s=0.3)  # fmt: skip
        assert len(files) == 1 and both.get_load()[0]["_endpoint"] == "/v1/loads"


def test_titles_and_dp_gpu_offsets_from_sglang_code():
    """Item 3: titles as configure_scheduler writes them; GPUs as the DP controller gives."""
    configs = [
        dict(tp_size=4, moe_dp_size=2, tp=3, moe_dp=1),
        dict(dp=1, tp_size=2, tp=0, attn_cp_size=2, attn_cp=1, pp_size=2, pp=1),
        dict(tp_size=1, dp=2),
    ]
    got = [parse_ranks(t[len("sglang::scheduler") :]) for t in real.titles(configs)]
    assert got[0] == Ranks(tp=3, moe_dp=1)
    assert got[1] == Ranks(tp=0, dp=1, pp=1, attn_cp=1)
    assert got[2] == Ranks(tp=0, dp=2)
    sizes = dict(tp_size=2, dp_size=2, gpu_id_step=2)
    for dp, tp, gpu in real.dp_gpu_ids(**sizes):
        assert local_gpu_id(Ranks(tp=tp, dp=dp), dict(sizes, pp_size=1)) == gpu


def test_loads_count_running_apart_from_waiting():
    """Item 4: /v1/loads, and the old /get_load's running+waiting counting."""
    with real.CpuServer(tp=1, dp=2) as srv:
        srv.scheds[0].set_load(running=8, waiting=3, throughput=200)
        srv.scheds[1].set_load(running=4, waiting=0, throughput=280)
        c = sh.SglangClient(srv.url)
        rows = sh.load_rows(c.get_load())
        assert rows["num_running_reqs"] == 12 and rows["num_queue_reqs"] == 3
        assert rows["gen_throughput"] == 480 and rows["max_total_num_tokens"] == 20_000
        c._load_path = "/get_load"
        old = sh.load_rows(c.get_load())
        assert old["num_running_reqs"] == 12 and old["num_queue_reqs"] == 3
        assert c.get_server_info() and c._info_path == "/server_info"


def test_profile_v2_by_stage_is_handled_and_plain_start_would_kill(tmp_path):
    """Item 6: V2 takes kdash's by-stage start; a plain start kills the schedulers."""
    with real.CpuServer(tp=2, v2=True) as srv:
        c = sh.SglangClient(srv.url)
        files = sh.take_profile(c, ranks=2, server_dir=str(tmp_path), num_steps=3,
                                profile_v2=True, timeout_s=20, stable_s=0.3)  # fmt: skip
        assert [parse_trace_name(f.name).stage for f in files] == ["decode", "decode"]
        assert not srv.crashed
        with pytest.raises(sh.SglangError):
            c.start_profile(sh.ProfileRequest(num_steps=3))
        assert srv.crashed  # what kdash's old request did to a real server


def test_uneven_dp_takes_what_came(tmp_path):
    """Item 8: a DP replica with no request writes no trace; the others' are kept."""
    with real.CpuServer(tp=1, dp=2, traffic=[True, False]) as srv:
        c = sh.SglangClient(srv.url)
        # the wait runs out for the idle replica: long enough for the busy one's trace on a
        # loaded machine (about 1 s idle), which is all the test waits for beyond it
        cap = sh.capture_via_server(c, ranks=2, server_dir=str(tmp_path), num_steps=3,
                                    timeout_s=10, stable_s=0.3, activities=("CPU",),
                                    expect=[(0, 0, None), (1, 0, None)])  # fmt: skip
        assert len(cap.files) == 1 and cap.missing == ["DP1 TP0"]
        assert "DP1 TP0" in cap.partial
        srv.traffic[1] = True
        time.sleep(0.5)
        assert len(_files(tmp_path)) == 1  # the idle replica was disarmed


def test_gauges_one_series_per_dp_rank():
    """Item 7: every TP rank repeats its DP rank's gauges (all-schedulers metrics)."""
    lines = []
    for dp, running in ((0, 8), (1, 4)):
        for tp in (0, 1):
            lab = f'model_name="m",tp_rank="{tp}",pp_rank="0",dp_rank="{dp}"'
            lines.append(f"sglang:num_running_reqs{{{lab}}} {running}")
            lines.append(f"sglang:gen_throughput{{{lab}}} 240")
    text = "# TYPE sglang:num_running_reqs gauge\n" + "\n".join(
        line for line in lines if "running" in line
    )
    text += "\n# TYPE sglang:gen_throughput gauge\n" + "\n".join(
        line for line in lines if "throughput" in line
    )
    scrape = sh.parse_metrics(text + "\n")
    assert scrape.gauges["num_running_reqs"] == 12 and scrape.gauges["gen_throughput"] == 480
    assert scrape.ranked == {
        "num_running_reqs[dp=0]": 8.0,
        "num_running_reqs[dp=1]": 4.0,
        "gen_throughput[dp=0]": 240.0,
        "gen_throughput[dp=1]": 240.0,
    }


def test_metric_names_kdash_reads_exist_in_sglang():
    src = Path(real.load()["metrics_collector"].__file__).read_text()
    for name in [*sh.GAUGES, *sh.HISTOGRAMS, sh.STAGE_HISTOGRAM, "gpu_execution_seconds_total"]:
        if name == "time_per_output_token_seconds":
            continue  # 0.4.x's name
        assert f'"sglang:{name}"' in src, name
