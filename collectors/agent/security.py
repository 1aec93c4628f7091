"""Who may talk to the agent, and where its socket lives.

Kernel names and API traces reveal what a process runs, so only its own user may see them:
the socket sits in a folder that is ours and 0700 (a folder someone else made first is never
used: they could swap our socket for theirs), the socket is 0600, and every peer's uid
(SO_PEERCRED) must equal ours. The client looks for sockets with the same functions.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import struct

TMP_ROOT = "/tmp"  # where the shared-folder candidates live (tests point it elsewhere)


def folder_problem(path: str, uid: int) -> str | None:
    """Why an existing `path` cannot be our socket folder (not a real folder, or another
    user's), or None when it is usable or absent. Loose modes of our own folder do not count:
    ensure_private_dir tightens them."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"{path}: {e.strerror or e}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} exists and is not a folder (a symlink?)"
    if st.st_uid != uid:
        return f"{path} belongs to uid {st.st_uid} (another user made it first)"
    return None


def fallback_dirs(uid: int | None = None) -> list[str]:
    """Private folders `<TMP_ROOT>/kdash-<uid>-<suffix>` already made (by fallback_dir) for
    when `/tmp/kdash-<uid>` is taken: only real folders of ours with mode 0700, by name."""
    uid = os.getuid() if uid is None else uid
    prefix = f"kdash-{uid}-"
    try:
        names = sorted(n for n in os.listdir(TMP_ROOT) if n.startswith(prefix))
    except OSError:
        return []
    out = []
    for name in names:
        path = os.path.join(TMP_ROOT, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == uid and not st.st_mode & 0o077:
            out.append(path)
    return out


def fallback_dir() -> str:
    """Make a new private folder `<TMP_ROOT>/kdash-<uid>-<random>` (0700, made by mkdir, so it
    cannot be someone else's) for an agent whose usual folders are taken; the client finds it
    with fallback_dirs()."""
    uid = os.getuid()
    for _ in range(8):
        path = os.path.join(TMP_ROOT, f"kdash-{uid}-{os.urandom(4).hex()}")
        try:
            os.mkdir(path, 0o700)
            return path
        except FileExistsError:
            continue
    raise OSError(f"cannot make a private folder kdash-{uid}-* in {TMP_ROOT}")


def socket_dirs(uid: int | None = None) -> list[str]:
    """Candidate folders, best first: `$XDG_RUNTIME_DIR/kdash` (when that runtime dir is ours),
    `/tmp/kdash-<uid>`, then the private fallbacks of fallback_dirs(). A candidate that exists
    but is not a folder of ours is left out: it could be a folder someone else made first to
    plant a socket there. The client looks in the same places."""
    uid = os.getuid() if uid is None else uid
    out = []
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        try:
            st = os.stat(xdg)
            if stat.S_ISDIR(st.st_mode) and st.st_uid == uid:
                out.append(os.path.join(xdg, "kdash"))
        except OSError:
            pass  # a stale XDG_RUNTIME_DIR (e.g. after su): fall back to /tmp below
    out.append(os.path.join(TMP_ROOT, f"kdash-{uid}"))
    usable = [d for d in out if folder_problem(d, uid) is None] + fallback_dirs(uid)
    # nothing usable: the taken folder stays first, so whatever uses it says why it failed
    return usable or out


def folder_problems(uid: int | None = None) -> list[str]:
    """Why the usual socket folders cannot be used, one phrase each (empty when they can)."""
    uid = os.getuid() if uid is None else uid
    out = []
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    cands = [os.path.join(xdg, "kdash")] if xdg else []
    for d in [*cands, os.path.join(TMP_ROOT, f"kdash-{uid}")]:
        why = folder_problem(d, uid)
        if why:
            out.append(why)
    return out


def ensure_private_dir(path: str) -> None:
    """Create `path` as 0700, or check that an existing one is a real folder of ours and 0700.

    A folder made first by someone else (or a symlink to one) could let them swap our socket
    for theirs, so it is refused with an OSError that says why.
    """
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise OSError(f"{path} exists and is not a folder (a symlink?); refusing to use it")
    if st.st_uid != os.getuid():
        raise OSError(f"{path} belongs to uid {st.st_uid}, not {os.getuid()}; refusing it")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)  # ours but loosened (e.g. by a umask game): tighten it back


def sweep_stale(folder: str) -> int:
    """Remove sockets and notes of processes that are gone; how many were removed.

    A process killed with SIGKILL, or a forked child leaving by os._exit, cannot remove its
    socket; left alone, a later process that gets the same pid would look watched.
    """
    removed = 0
    try:
        names = os.listdir(folder)
    except OSError:
        return 0
    for name in names:
        stem, dot, ext = name.removeprefix(".").partition(".")  # ".<pid>.binding": server.py
        if not dot or ext not in ("sock", "unavailable", "binding") or not stem.isdigit():
            continue
        if os.path.exists(f"/proc/{stem}"):
            continue
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(folder, name))
            removed += 1
    return removed


def socket_path_for(pid: int, uid: int | None = None) -> str:
    return os.path.join(socket_dirs(uid)[0], f"{pid}.sock")


# ---- peer check ---------------------------------------------------------------------------------

_UCRED = struct.Struct("3i")


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process on the other end of a Unix socket (SO_PEERCRED)."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    return _UCRED.unpack(raw)


def check_peer(conn: socket.socket, expected_uid: int | None = None) -> str | None:
    """None when the peer runs as `expected_uid` (default: our uid), else the reason to refuse.

    Same uid only, root included: a root kdash can reach a root target, and a root client
    talking to another user's process must use that user's account (or inject as root).
    """
    expected = os.getuid() if expected_uid is None else expected_uid
    try:
        pid, uid, _gid = peer_credentials(conn)
    except OSError as e:
        return f"cannot read the peer's credentials ({e})"
    if uid != expected:
        return f"peer pid {pid} runs as uid {uid}, the agent accepts only uid {expected}"
    return None
