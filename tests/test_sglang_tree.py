"""SGLang process-tree classification against real processes.

No SGLang server can run here (no GPU, its wheels do not install on these machines), so the
tree is made of real Python processes that take SGLang's titles with `setproctitle` — the same
call SGLang makes — under a root started as `python -m sglang.launch_server ...` from a tiny
stand-in `sglang` package written to a temp folder. The root listens on a real TCP port, so
finding the tree from a URL goes through the real socket tables.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from kdash.collectors import sglang_tree as st

from kdash.errors import UserError

pytest.importorskip("setproctitle")

# Every process: take the title, start the children of the spec, report pids, wait for the
# parent to go away (so nothing outlives the test), bounded at 120 s.
_NODE = textwrap.dedent(
    """
    import json, os, socket, subprocess, sys, time
    spec = json.loads(sys.argv[-1])
    if spec.get("title"):
        import setproctitle
        setproctitle.setproctitle(spec["title"])
    env = dict(os.environ, **spec.get("env", {}))
    kids = []
    for c in spec.get("children", []):
        kids.append(subprocess.Popen(
            [sys.executable, os.environ["KDASH_TEST_NODE"], json.dumps(c)],
            env=env, stdout=subprocess.PIPE, text=True))
    pids = {}
    for k in kids:
        pids.update(json.loads(k.stdout.readline()))
    pids[spec.get("title") or "root"] = os.getpid()
    port = None
    if spec.get("listen"):
        srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
        port = srv.getsockname()[1]
        pids["port"] = port
    print(json.dumps(pids), flush=True)
    parent = os.getppid()
    t0 = time.time()
    while time.time() - t0 < 600 and os.getppid() == parent:  # a safety net: the test ends it
        if spec.get("root") and sys.stdin.readline() == "":
            break
        time.sleep(0.1)
    for k in kids:
        k.terminate()
    """
)


@pytest.fixture
def launch(tmp_path: Path):
    """Start a stand-in server tree from a spec; yields a function -> (root Popen, pids)."""
    pkg = tmp_path / "sglang"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    node = tmp_path / "node.py"
    node.write_text(_NODE)
    (pkg / "launch_server.py").write_text(f"exec(open({str(node)!r}).read())\n")
    procs: list[subprocess.Popen] = []

    def start(spec: dict, env: dict | None = None) -> tuple[subprocess.Popen, dict]:
        spec = dict(spec, root=True)
        env = dict(os.environ, PYTHONPATH=str(tmp_path), KDASH_TEST_NODE=str(node), **(env or {}))
        p = subprocess.Popen(
            [sys.executable, "-m", "sglang.launch_server", "--tp", "2", json.dumps(spec)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        procs.append(p)
        line = p.stdout.readline()
        assert line, "stand-in server did not start"
        return p, json.loads(line)

    yield start
    for p in procs:
        try:
            p.stdin.close()
            p.wait(timeout=60)
        except (subprocess.TimeoutExpired, OSError):
            p.kill()
            p.wait()


def _wait_titles(pids: list[int]) -> None:
    """setproctitle runs right after start; give slow machines a moment (up to a minute)."""
    deadline = time.time() + 60
    while time.time() < deadline:
        if all(psutil.Process(p).cmdline()[:1] and psutil.Process(p).cmdline()[0] for p in pids):
            return
        time.sleep(0.05)


def test_titles_classified_in_any_order():
    assert st.classify_cmdline(["sglang::scheduler_TP3"])[2] == st.Ranks(tp=3)
    assert st.classify_cmdline(["sglang::scheduler_DP1_TP0"])[2] == st.Ranks(tp=0, dp=1)
    assert st.classify_cmdline(["sglang::scheduler_TP2_DP1"])[2] == st.Ranks(tp=2, dp=1)
    r = st.classify_cmdline(["sglang::scheduler_DP0_PP1_TP2_EP3"])[2]
    assert r == st.Ranks(tp=2, dp=0, pp=1, ep=3)
    assert r.label() == "DP0 PP1 TP2 EP3"
    # tp_size == 1: SGLang leaves the TP token out
    assert st.classify_cmdline(["sglang::scheduler"])[:2] == ("scheduler", "sglang::scheduler")
    assert st.classify_cmdline(["sglang::scheduler"])[2] == st.Ranks(tp=0)
    assert st.classify_cmdline(["sglang::detokenizer", "", ""])[0] == "detokenizer"
    assert st.classify_cmdline(["sglang::data_parallel_controller"])[0] == "dp_controller"
    assert st.classify_cmdline(["python3", "-m", "sglang.launch_server", "--tp", "8"])[0] == "root"
    assert st.classify_cmdline(["/venv/bin/sglang", "serve", "--model", "m"])[0] == "root"
    assert st.classify_cmdline(["python", "-m", "vllm.entrypoints.openai.api_server"]) is None
    assert st.classify_cmdline(["python", "serve.py"]) is None


def test_real_tp2_tree_classified_and_mapped_through_cuda_visible_devices(launch):
    spec = {
        "children": [
            {"title": "sglang::scheduler_TP0"},
            {"title": "sglang::scheduler_TP1"},
            {"title": "sglang::detokenizer"},
        ],
        "listen": True,
    }
    # The user sets CUDA_VISIBLE_DEVICES on the launch command; the schedulers inherit it, but
    # setproctitle clears what /proc/PID/environ shows for them, so the root's is read.
    root, pids = launch(spec, env={"CUDA_VISIBLE_DEVICES": "4,5"})
    _wait_titles([pids["sglang::scheduler_TP0"], pids["sglang::scheduler_TP1"]])
    tree = st.classify_tree(root.pid)
    assert tree.root is not None and tree.root.pid == root.pid
    assert tree.root.role == "root"
    assert [s.pid for s in tree.schedulers] == [
        pids["sglang::scheduler_TP0"],
        pids["sglang::scheduler_TP1"],
    ]
    assert [s.ranks.tp for s in tree.schedulers] == [0, 1]
    assert tree.detokenizer is not None and tree.detokenizer.pid == pids["sglang::detokenizer"]
    assert tree.tp_size() == 2

    st.assign_gpus(tree)
    assert [(s.gpu.gpu, s.gpu.source) for s in tree.schedulers] == [(4, "env"), (5, "env")]
    assert tree.schedulers[0].gpu.visible_device == "4"
    own = st.read_environ(tree.schedulers[0].pid)
    if not own or "CUDA_VISIBLE_DEVICES" not in own:  # cleared by setproctitle: root's used
        assert f"pid {root.pid}" in tree.schedulers[0].gpu.note
    # base_gpu_id from /get_server_info shifts the ordinal inside CUDA_VISIBLE_DEVICES
    st.assign_gpus(tree, server_info={"tp_size": 2, "base_gpu_id": 0, "gpu_id_step": 1})
    assert tree.schedulers[1].gpu.gpu == 5
    # NVML's pid list wins over the environment
    nvml = {7: [pids["sglang::scheduler_TP0"]], 2: [pids["sglang::scheduler_TP1"]]}
    st.assign_gpus(tree, nvml_pids=nvml)
    assert [(s.gpu.gpu, s.gpu.source) for s in tree.schedulers] == [(7, "nvml"), (2, "nvml")]


def test_from_scheduler_pid_walks_up_to_root(launch):
    root, pids = launch({"children": [{"title": "sglang::scheduler_TP0"}]})
    sched = pids["sglang::scheduler_TP0"]
    _wait_titles([sched])
    assert st.find_root(sched) == root.pid
    tree = st.tree_from_pid(sched)
    assert tree.root.pid == root.pid
    assert [s.pid for s in tree.schedulers] == [sched]
    # no CUDA_VISIBLE_DEVICES: SGLang's rank rule alone
    st.assign_gpus(tree)
    assert (tree.schedulers[0].gpu.gpu, tree.schedulers[0].gpu.source) == (0, "rank")


def test_dp_controller_tree_and_dp_gpu_offsets(launch):
    spec = {
        "children": [
            {
                "title": "sglang::data_parallel_controller",
                "children": [
                    {"title": "sglang::scheduler_DP0_TP0"},
                    {"title": "sglang::scheduler_DP0_TP1"},
                    {"title": "sglang::scheduler_DP1_TP0"},
                    {"title": "sglang::scheduler_DP1_TP1"},
                ],
            },
            {"title": "sglang::detokenizer"},
        ]
    }
    root, pids = launch(spec)
    _wait_titles([v for k, v in pids.items() if k.startswith("sglang::")])
    tree = st.tree_from_pid(pids["sglang::scheduler_DP1_TP1"])
    assert tree.root.pid == root.pid
    assert tree.dp_controller.pid == pids["sglang::data_parallel_controller"]
    assert [s.ranks.label() for s in tree.schedulers] == [
        "DP0 TP0",
        "DP0 TP1",
        "DP1 TP0",
        "DP1 TP1",
    ]
    info = {"tp_size": 2, "dp_size": 2, "enable_dp_attention": False}
    st.assign_gpus(tree, server_info=info)
    assert [s.gpu.gpu for s in tree.schedulers] == [0, 1, 2, 3]
    # DP attention: one TP group across the DP ranks, the GPU follows the TP rank
    st.assign_gpus(tree, server_info=dict(info, enable_dp_attention=True))
    assert [s.gpu.gpu for s in tree.schedulers] == [0, 1, 0, 1]


def test_tree_from_url_finds_the_listening_root(launch):
    root, pids = launch({"children": [{"title": "sglang::scheduler_TP0"}], "listen": True})
    _wait_titles([pids["sglang::scheduler_TP0"]])
    port = pids["port"]
    assert root.pid in st.listening_pids(port)
    # the /proc fallback (socket inode -> pid) finds the same process
    inodes = st._listen_inodes(port, Path("/proc"))
    assert inodes and root.pid in st._pids_with_inodes(inodes, Path("/proc"))
    tree = st.tree_from_url(f"http://127.0.0.1:{port}")
    assert tree.root.pid == root.pid
    assert len(tree.schedulers) == 1


def test_url_errors_are_one_line():
    with pytest.raises(UserError, match="not this machine"):
        st.tree_from_url("http://192.0.2.1:30000")  # TEST-NET-1: never local, not contacted
    with pytest.raises(UserError, match="not an http URL"):
        st.tree_from_url("ftp://127.0.0.1:30000")
    # a port nobody listens on (bind then close to get a free one)
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(UserError, match=f"listens on port {port}"):
        st.tree_from_url(f"127.0.0.1:{port}")


def test_non_sglang_pid_is_refused():
    with pytest.raises(UserError, match="not part of an SGLang server"):
        st.tree_from_pid(os.getpid())


def test_path_in_process_same_root_and_fake_container(tmp_path):
    assert st.path_in_process(os.getpid(), "/tmp/x.trace.json.gz") == Path("/tmp/x.trace.json.gz")
    # a stand-in /proc whose pid 7 has another root folder (what a container looks like)
    fake = tmp_path / "proc"
    (fake / "7").mkdir(parents=True)
    other_root = tmp_path / "container-root"
    (other_root / "tmp").mkdir(parents=True)
    (fake / "7" / "root").symlink_to(other_root)
    got = st.path_in_process(7, "/tmp/t.json", proc_root=fake)
    assert got == fake / "7" / "root" / "tmp" / "t.json"
    (other_root / "tmp" / "t.json").write_text("{}")
    assert got.read_text() == "{}"


def test_listening_port_of_a_process_we_cannot_see(tmp_path, monkeypatch):
    """A stand-in /proc whose tcp table has the port in LISTEN but no readable fd holds it
    (what another user's server looks like to a non-root kdash)."""
    fake = tmp_path / "proc"
    (fake / "net").mkdir(parents=True)
    header = (
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  "
        "timeout inode\n"
    )
    row = (
        "   0: 0100007F:7530 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1001  "
        "      0 424242 1\n"
    )
    (fake / "net" / "tcp").write_text(header + row)
    monkeypatch.setattr(st.psutil, "net_connections", lambda kind: [])
    assert st._listen_inodes(30000, fake) == {424242}
    with pytest.raises(UserError, match="cannot see .another user's"):
        st.tree_from_url("http://127.0.0.1:30000", proc_root=fake)
