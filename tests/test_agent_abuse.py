"""Issue 11: the agent and `kdash run` under hostile input from their own user, and in targets
that stretch their limits: many open files, junk connections, oversized or endless requests,
a squatted socket folder, a planted log name. Real child processes, as in test_agent.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from kdash.collectors.agent import client, security, server, wire
from kdash.collectors.agent.client import AgentSource
from test_agent import (
    PATIENCE_S,
    SAFETY_S,
    agent_stats,
    count,
    drain_until,
    finish,
    kill_target,
    start_target,
    wait_for,
    wait_socket,
)

from kdash.errors import UserError


def _raw_connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(PATIENCE_S)
    s.connect(path)
    return s


def _read_frames_until_closed(
    s: socket.socket, seconds: float = PATIENCE_S, until=None, dec: wire.Decoder | None = None
) -> tuple[list, bool]:
    """The frames the agent sends until it closes the connection, `until(frames)` holds or
    `seconds` pass (a safety net: the tests wait for an answer or a close, not for a time),
    and whether it closed the connection."""
    dec = dec or wire.Decoder()
    s.settimeout(seconds)
    end = time.monotonic() + seconds
    out: list = []
    try:
        while until is None or not until(out):
            s.settimeout(max(0.01, end - time.monotonic()))
            m = wire.recv_message(s, dec)
            if m is None:
                return out, True
            out.append(m)
    except (TimeoutError, OSError, wire.WireError):
        return out, False
    return out, False


def _hello(s: socket.socket, dec: wire.Decoder) -> list:
    """The agent's HELLO, the first frame on a new connection."""
    frames, _ = _read_frames_until_closed(s, until=lambda f: len(f) >= 1, dec=dec)
    assert frames and frames[0].type == wire.MsgType.HELLO, frames
    return frames


def _of_type(kind: wire.MsgType):
    return lambda frames: any(m.type == kind for m in frames)


# ---- item 5: a target with more than 1024 open files --------------------------------------------

MANY_FILES = textwrap.dedent(
    """
    import os, resource, sys, time
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 2200
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(2000)]
    print("holding", len(held), max(held), flush=True)
    n = 0
    end = time.monotonic() + float(sys.argv[1])
    while time.monotonic() < end and not os.path.exists(sys.argv[2]):  # the test's stop file
        n += sum(range(200))
        time.sleep(0.001)
    print("done", flush=True)
    """
)


def test_a_target_holding_2000_open_files_is_watched(fake_cupti, tmp_path):
    import resource

    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 2200:
        pytest.skip("RLIMIT_NOFILE hard limit below 2200 here")
    from kdash.collectors.agent import bootstrap

    base = {**os.environ, **fake_cupti}
    p = subprocess.Popen(
        [sys.executable, "-c", MANY_FILES, str(SAFETY_S), str(tmp_path / "stop")],
        env=bootstrap.run_env(base),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    p.stop_file = tmp_path / "stop"  # type: ignore[attr-defined]  # what `finish` touches
    try:
        first = p.stdout.readline().split()
        assert first[:2] == ["holding", "2000"] and int(first[2]) > 1024, first
        wait_socket(p.pid)
        src = AgentSource(p.pid, continuous=True, graph_kernels=True)
        src.start()
        assert wait_for(lambda: src.health.ok), str(src.health)
        got = drain_until(src, lambda g: count(g, "kernels") > 0)
        assert got.get("kernels"), (src.health, src.stats)
        assert src.health.ok, str(src.health)  # not "lost the agent ...: Broken pipe"
        src.stop()
    finally:
        rc, out, err = finish(p)
    assert rc == 0, err


# ---- item 11: same-user abuse --------------------------------------------------------------------


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def test_data_frames_from_a_client_are_refused_before_their_payload(fake_cupti):
    """NAMES and BATCH frames are for the agent to send; a peer sending them is cut off at the
    header, so their payloads are neither read nor kept (they grew the target by 700 MB)."""
    p = start_target(fake_cupti)
    try:
        path = wait_socket(p.pid)
        # made before connecting: a connection has SPEAK_WAIT_S to send its first frame
        names = [f"junk-{i:08d}-" + "x" * 200 for i in range(40_000)]  # ~8.6 MB a frame
        big = {"activities": [f"act{i}" for i in range(50_000)]}
        payload = json.dumps(big).encode()
        header = wire.HEADER.pack(
            wire.MAGIC, wire.VERSION, int(wire.MsgType.START), 0, 0, 0, len(payload)
        )
        s = _raw_connect(path)
        dec = wire.Decoder()
        _hello(s, dec)
        base = _rss_kb(p.pid)
        sent = 0
        try:
            for k in range(20):
                s.sendall(wire.encode_names(k * len(names), names))
                sent += 1
        except OSError:
            pass  # the agent closed the connection: what must happen
        _frames, closed = _read_frames_until_closed(s, dec=dec)
        s.close()
        assert closed or sent < 20
        assert _rss_kb(p.pid) - base < 60_000, (base, _rss_kb(p.pid))
        # a START too large for a request is refused the same way
        s = _raw_connect(path)
        _hello(s, wire.Decoder())
        with pytest.raises(OSError):
            s.sendall(header + payload)
            end = time.monotonic() + PATIENCE_S
            while time.monotonic() < end:  # the agent has closed; writes fail once it is seen
                s.sendall(header)
                time.sleep(0.02)
        s.close()
        st = agent_stats(p.pid)  # and the agent still answers a client
        assert "exceeds" in st["last_error"] or "not accepted" in st["last_error"], st
    finally:
        kill_target(p)


def test_unknown_activities_are_refused_once_and_notes_stay_bounded(fake_cupti):
    p = start_target(fake_cupti)
    try:
        path = wait_socket(p.pid)
        s = _raw_connect(path)
        dec = wire.Decoder()
        _hello(s, dec)
        start = {"activities": [f"nope{i}" for i in range(2000)]}
        s.sendall(wire.encode_control(wire.MsgType.START, start))
        frames, _ = _read_frames_until_closed(s, until=_of_type(wire.MsgType.STATUS), dec=dec)
        statuses = [m.body for m in frames if m.type == wire.MsgType.STATUS]
        assert statuses and statuses[0]["state"] == "error", statuses
        assert "at most" in statuses[0]["line"]
        # a list within the cap: the unknown names are one note, the known ones are enabled
        s.sendall(
            wire.encode_control(
                wire.MsgType.START, {"activities": ["kernels"] + [f"n{i}" for i in range(30)]}
            )
        )
        s.sendall(wire.encode_control(wire.MsgType.STATS, {}))
        frames, _ = _read_frames_until_closed(s, until=_of_type(wire.MsgType.STATS), dec=dec)
        stats = [m.body for m in frames if m.type == wire.MsgType.STATS]
        assert stats, frames
        notes = stats[-1]["notes"]
        assert len(notes) <= server.MAX_NOTES
        unknown = [n for n in notes if "unknown activities" in n]
        assert len(unknown) == 1 and "26 more" in unknown[0], notes
        s.close()
    finally:
        kill_target(p)


def test_held_junk_connections_do_not_lock_kdash_out(fake_cupti):
    """300 connections held open by a process of our own user: kdash still gets in at once,
    and the target is not left holding them."""
    p = start_target(fake_cupti)
    junk: list[socket.socket] = []
    try:
        path = wait_socket(p.pid)
        for _ in range(300):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(2)
            try:
                s.connect(path)
            except OSError:
                s.close()
                continue
            junk.append(s)
        src = AgentSource(p.pid, connect_timeout_s=PATIENCE_S)
        src.start()
        assert wait_for(lambda: src.health.ok), str(src.health)
        fds = len(os.listdir(f"/proc/{p.pid}/fd"))
        assert fds < 100, fds  # the junk is not kept open in the target
        # another client while kdash is attached is told busy at once
        other = AgentSource(p.pid)
        other.start()
        assert wait_for(lambda: other.health.state == "unavailable")
        assert "another kdash client is attached" in str(other.health)
        other.stop()
        assert src.health.ok
        src.stop()
        # a connection that never speaks is closed after SPEAK_WAIT_S
        s = _raw_connect(path)
        frames, closed = _read_frames_until_closed(s, server.SPEAK_WAIT_S + PATIENCE_S)
        s.close()
        assert closed and frames[0].type == wire.MsgType.HELLO
    finally:
        for s in junk:
            s.close()
        kill_target(p)


def test_session_name_table_is_bounded():
    enc = wire.StringEncoder(max_strings=10, max_bytes=10_000, max_chars=50)
    ids = [enc.intern(f"name{i}") for i in range(100)]
    assert len(enc) == 10 and enc.overflowed == 91
    assert set(ids[9:]) == {9}  # every later name is the one overflow entry
    t = wire.StringTable()
    frame = enc.pending_names()
    msg = wire.Decoder(t).decode(frame)
    assert wire.OVERFLOW_NAME in msg.body
    long_enc = wire.StringEncoder(max_chars=50)
    assert long_enc.intern("y" * 10_000) == long_enc.intern("y" * 20_000)
    assert len(long_enc._strings[0]) == 50


# ---- item 13: a squatted /tmp/kdash-<uid> --------------------------------------------------------


@pytest.mark.skipif(os.getuid() != 0, reason="making another user's folder needs root")
def test_a_squatted_socket_folder_falls_back_to_a_private_one(tmp_path, monkeypatch):
    monkeypatch.setattr(security, "TMP_ROOT", str(tmp_path))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    uid = os.getuid()
    squat = tmp_path / f"kdash-{uid}"
    squat.mkdir(mode=0o777)
    os.chown(squat, 4242, 4242)
    (tmp_path / f"kdash-{uid}-theirs").mkdir(mode=0o700)
    os.chown(tmp_path / f"kdash-{uid}-theirs", 4242, 4242)
    planted = squat / "4194999.sock"  # a socket planted there is never taken for an agent
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(planted))
    assert client.find_agent_socket(4194999) is None
    monkeypatch.setattr(server, "_AGENT", None)
    agent = server.start_agent()
    assert agent is not None, server.start_error()
    try:
        folder = os.path.dirname(agent.path)
        assert os.path.basename(folder).startswith(f"kdash-{uid}-") and folder != str(squat)
        assert folder in server.socket_dirs()
        assert client.find_agent_socket(os.getpid()) == agent.path
    finally:
        agent.close()
        monkeypatch.setattr(server, "_AGENT", None)
    assert not os.path.exists(folder)  # the fallback folder goes with the agent


@pytest.mark.skipif(os.getuid() != 0, reason="making another user's folder needs root")
def test_no_socket_in_an_armed_target_says_the_real_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(security, "TMP_ROOT", str(tmp_path))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    squat = tmp_path / f"kdash-{os.getuid()}"
    squat.mkdir(mode=0o777)
    os.chown(squat, 4242, 4242)
    armed = subprocess.Popen(["sleep", str(SAFETY_S)], env={**os.environ, "KDASH_AGENT": "1"})
    try:
        environ = Path(f"/proc/{armed.pid}/environ")
        assert wait_for(lambda: b"KDASH_AGENT=1" in environ.read_bytes())  # exec'd
        src = AgentSource(armed.pid)
        src.start()
        why = str(src.health)
        assert "started by `kdash run`" in why and "belongs to uid 4242" in why, why
        assert "start it with `kdash run" not in why
    finally:
        armed.kill()
        armed.wait()


# ---- item 6: `kdash run`'s log name ------------------------------------------------------------


def test_run_log_never_follows_a_planted_name(tmp_path, monkeypatch):
    from kdash.commands import open_run_log

    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    link = tmp_path / "kdash-run-1.log"
    link.symlink_to(victim)
    with pytest.raises(UserError, match="taken by something else"):
        open_run_log(link)
    with pytest.raises(UserError, match="symlink"):
        open_run_log(link, chosen=True)
    hard = tmp_path / "hard.log"
    os.link(victim, hard)
    with pytest.raises(UserError, match="not a plain file of yours"):
        open_run_log(hard, chosen=True)
    fifo = tmp_path / "fifo.log"
    os.mkfifo(fifo)
    with pytest.raises(UserError):
        open_run_log(fifo, chosen=True)  # neither blocks nor writes to the FIFO's reader
    assert victim.read_text() == "precious\n"
    f, created = open_run_log(tmp_path / "new.log")
    f.close()
    assert created and (os.stat(tmp_path / "new.log").st_mode & 0o777) == 0o600


def test_run_refuses_a_planted_log_symlink_in_one_line(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    # the child pid is not known in advance: plant the name kdash will use through the
    # environment, and the default name in the folder for the in-process case below
    link = tmp_path / "run.log"
    link.symlink_to(victim)
    r = subprocess.run(
        [sys.executable, "-m", "kdash.cli", "run", "--headless", "--duration", "1", "--output",
         str(tmp_path / "r.kdash"), "--", sys.executable, "-c", "print('leak')"],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "KDASH_RUN_LOG": str(link)},
    )  # fmt: skip
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kdash:") and "symlink" in lines[0], r.stderr
    assert victim.read_text() == "precious\n"


def test_run_default_log_name_taken_is_refused(tmp_path, monkeypatch):
    from kdash import commands
    from kdash.options import RunOptions

    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("KDASH_RUN_LOG", raising=False)
    (tmp_path / f"kdash-run-{os.getpid()}.log").symlink_to(victim)
    args = RunOptions(
        cmd=["--", sys.executable, "-c", "print('leak')"], headless=True, duration=1,
        output=tmp_path / "o.kdash",
    )  # fmt: skip
    with pytest.raises(UserError, match="taken by something else"):
        commands.cmd_run(args)
    assert victim.read_text() == "precious\n"


def test_an_agent_in_a_process_with_2000_open_files_keeps_its_session(tmp_path):
    """The same in this process: its session socket gets a descriptor above 1024, which
    select() refused (`session: ValueError`, and the client lost the agent)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 2200:
        pytest.skip("RLIMIT_NOFILE hard limit below 2200 here")
    if soft < 2200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (2200, hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(2000)]
    folder = tmp_path / "kd"
    agent = server.Agent(str(folder / "me.sock"))
    try:
        agent.listen()
        src = AgentSource(os.getpid(), socket_path=agent.path)
        src.start()
        assert src._sock is not None and src._sock.fileno() > 1024
        assert wait_for(lambda: src.status_line), str(src.health)
        src.poll(0)  # asks for STATS
        assert wait_for(lambda: "agent_state" in src.stats), str(src.health)
        assert "went away" not in str(src.health) and "ValueError" not in agent.last_error
        src.stop()
    finally:
        agent.close()
        for fd in held:
            os.close(fd)
        if soft < 2200:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
