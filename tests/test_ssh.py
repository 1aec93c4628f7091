"""kdash over SSH for real: a real sshd on 127.0.0.1, a key login, kdash in tmux at 80x24.

The test starts its own `sshd` (OpenSSH, from the `openssh-server` package) on a free port of
127.0.0.1 with a host key and an authorized key made here, logs in with `ssh` (BatchMode, the
temporary key), and in the remote shell runs `kdash open tests/data/h200-matmul.kdash` inside
a private tmux server at 80x24. Keys are pressed with `tmux send-keys` over ssh and the screen
is read with `tmux capture-pane` over ssh: what a user at the other end would see.

Skipped, saying why, when `sshd`, `ssh`, `ssh-keygen` or `tmux` is not installed (CI installs
them: `apt-get install -y openssh-server openssh-client tmux`). Bounded: every ssh call has a
timeout and the test a deadline; sshd and the tmux server are stopped in `finally`, also when
an assertion fails.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CAPTURE = REPO / "tests" / "data" / "h200-matmul.kdash"
SSHD = shutil.which("sshd") or next(
    (p for p in ("/usr/sbin/sshd", "/usr/local/sbin/sshd") if os.access(p, os.X_OK)), None
)
MISSING = [
    name
    for name, path in (
        ("sshd (apt-get install -y openssh-server)", SSHD),
        ("ssh", shutil.which("ssh")),
        ("ssh-keygen", shutil.which("ssh-keygen")),
        ("tmux", shutil.which("tmux")),
    )
    if path is None
]
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"not installed: {', '.join(MISSING)}")
# The whole test's bound: a safety net so a hung ssh or kdash still ends the test. Every step
# waits for what it needs on the screen, not for a time, and returns as soon as it is there.
DEADLINE_S = 300.0
LISTEN_S = 60.0  # for sshd to listen: seconds on a loaded machine, a fraction of one idle


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _kdash_exe() -> str:
    """The venv's own kdash (absolute: the remote shell's PATH does not have the venv)."""
    exe = Path(sys.executable).parent / "kdash"
    if not exe.exists():
        pytest.skip(f"no kdash console script beside {sys.executable} (pip install -e .)")
    return str(exe)


@contextlib.contextmanager
def sshd(tmp: Path) -> Iterator[tuple[int, Path]]:
    """A real sshd on 127.0.0.1:PORT that lets this user in with a key made here."""
    for name in ("host_key", "user_key"):
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp / name)],
            check=True,
            timeout=30,
        )
    auth = tmp / "authorized_keys"
    auth.write_text((tmp / "user_key.pub").read_text())
    auth.chmod(0o600)
    port = _free_port()
    config = tmp / "sshd_config"
    config.write_text(
        "\n".join(
            [
                f"Port {port}",
                "ListenAddress 127.0.0.1",
                f"HostKey {tmp / 'host_key'}",
                f"AuthorizedKeysFile {auth}",
                f"PidFile {tmp / 'sshd.pid'}",
                "PubkeyAuthentication yes",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "PermitRootLogin prohibit-password",
                "UsePAM no",
                "StrictModes no",  # the temp folder is not a home folder with its modes
                "PrintMotd no",
                "",
            ]
        )
    )
    if os.geteuid() == 0:
        # sshd running as root wants its privilege-separation folder (the package makes it
        # at boot through tmpfiles.d; a container that never booted has none).
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    log = open(tmp / "sshd.log", "wb")  # noqa: SIM115 - closed in the finally below
    proc = subprocess.Popen(
        [SSHD, "-D", "-e", "-f", str(config)], stdout=subprocess.DEVNULL, stderr=log
    )
    try:
        deadline = time.monotonic() + LISTEN_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"sshd exited: {(tmp / 'sshd.log').read_text()[-500:]}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
                break
            if time.monotonic() > deadline:
                pytest.fail(f"sshd did not listen within {LISTEN_S:.0f} s")
            time.sleep(0.1)
        yield port, tmp / "user_key"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@contextlib.contextmanager
def _ssh(port: int, key: Path) -> Iterator[Callable[[str], subprocess.CompletedProcess]]:
    """Runs commands over ssh as this user. One master connection carries every call (a new
    login per screen read took a second or more on a loaded machine, longer than the 2 s a
    notification stays up); a call made without it logs in by itself."""
    user = os.environ.get("USER") or __import__("pwd").getpwuid(os.getuid()).pw_name
    folder = tempfile.mkdtemp(prefix="kd-ssh-")  # short: a socket path has ~100 bytes
    control = os.path.join(folder, "cm")
    opts = ["-F", "/dev/null", "-i", str(key), "-p", str(port)]
    for o in (
        "BatchMode=yes",
        "StrictHostKeyChecking=no",
        "UserKnownHostsFile=/dev/null",
        "LogLevel=ERROR",
        "ConnectTimeout=10",
        f"ControlPath={control}",
    ):
        opts += ["-o", o]
    where = f"{user}@127.0.0.1"
    master = subprocess.Popen(
        ["ssh", *opts, "-o", "ControlMaster=yes", "-M", "-N", where],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + LISTEN_S
    while not os.path.exists(control) and master.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)

    def run(command: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["ssh", *opts, "-o", "ControlMaster=no", where, command],
            capture_output=True,
            text=True,
            timeout=30,
        )

    try:
        yield run
    finally:
        master.terminate()
        try:
            master.wait(timeout=10)
        except subprocess.TimeoutExpired:
            master.kill()
            master.wait()
        shutil.rmtree(folder, ignore_errors=True)


def test_kdash_in_tmux_over_ssh_at_80x24(tmp_path: Path) -> None:
    t_end = time.monotonic() + DEADLINE_S
    kdash = _kdash_exe()
    sock = tmp_path / "tmux.sock"
    xdg = tmp_path / "xdg"
    xdg.mkdir()
    exit_file = tmp_path / "kdash.exit"
    tmux = f"tmux -u -S {sock}"
    with sshd(tmp_path) as (port, key), _ssh(port, key) as ssh:
        who = ssh("echo logged-in-as $(id -un) on $SSH_CONNECTION")
        assert who.returncode == 0, who.stderr
        assert who.stdout.startswith("logged-in-as ") and "127.0.0.1" in who.stdout

        def screen() -> str:
            r = ssh(f"{tmux} capture-pane -p -t kd")
            assert r.returncode == 0, r.stderr
            return r.stdout

        def wait_screen(pred: Callable[[str], bool], what: str) -> str:
            shown = ""
            while time.monotonic() < t_end:
                shown = screen()
                if pred(shown):
                    return shown
                time.sleep(0.3)
            pytest.fail(f"never saw {what} over ssh; last screen:\n{shown}")

        app = (
            f"cd {REPO} && env LANG=C.UTF-8 XDG_CONFIG_HOME={xdg} TEXTUAL_ANIMATIONS=none "
            f"{kdash} open tests/data/{CAPTURE.name}; echo $? > {exit_file}"
        )
        try:
            r = ssh(f"{tmux} new-session -d -s kd -x 80 -y 24 {_quote(app)}")
            assert r.returncode == 0, r.stderr
            # drawn: the status bar and the H200's clocks against their 1980 MHz maximum
            first = wait_screen(lambda s: "REPLAY" in s and "/1980 MHz" in s, "the dashboard")
            print(f"--- over ssh, tmux 80x24, first screen ---\n{first}")  # pytest -rP shows
            lines = first.splitlines()
            assert len(lines) <= 24 and all(len(ln) <= 80 for ln in lines)
            assert "kdash replay" in lines[0]
            assert "Clocks & thermal" in first
            assert "P power cap" in first or "sw-power" in first  # its power cap, as recorded

            ssh(f"{tmux} send-keys -t kd '?'")
            help_screen = wait_screen(lambda s: "kdash keys (replay)" in s, "the help")
            print(f"--- after ? ---\n{help_screen}")
            assert "capture: the --pre s before" in help_screen and "quit" in help_screen
            ssh(f"{tmux} send-keys -t kd Escape")
            wait_screen(lambda s: "kdash keys" not in s, "the help closing")

            ssh(f"{tmux} send-keys -t kd 3")
            cpu = wait_screen(lambda s: "3 CPU affinity" in s, "the CPU pane maximised")
            print(f"--- after 3 ---\n{cpu}")
            assert "Clocks & thermal" not in cpu  # only the maximised pane is shown

            ssh(f"{tmux} send-keys -t kd t")
            themed = wait_screen(lambda s: "theme: light (saved)" in s, "the theme notification")
            print(f"--- after t ---\n{themed}")
            assert (xdg / "kdash" / "config.toml").read_text().count('theme = "light"') == 1

            ssh(f"{tmux} send-keys -t kd q")
            while not exit_file.exists() and time.monotonic() < t_end:
                time.sleep(0.2)
            assert exit_file.read_text().strip() == "0"  # kdash quit cleanly on `q`
        finally:
            ssh(f"{tmux} kill-server")
            # and locally (same machine), in case the ssh call itself failed
            subprocess.run(
                ["tmux", "-S", str(sock), "kill-server"], capture_output=True, timeout=10
            )
        # the tmux server is gone: nothing of the test is left running
        assert ssh(f"{tmux} has-session -t kd").returncode != 0


def _quote(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"
