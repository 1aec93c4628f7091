"""Output files that appear whole, in one step, or not at all.

`new_file(path)` writes into a file with no name (Linux O_TMPFILE) and links it to `path` at
the end (through /proc/self/fd, else linkat's AT_EMPTY_PATH). The link fails when `path`
exists, so "it does not exist yet" and "it is ours now" are one step (two kdash processes
given one `--output` cannot both say "saved"), and a process killed mid-write leaves nothing
behind. Where no unnamed file can be made or linked, a named temp file beside the output takes
its place; it carries the writer's pid, so the next write into that folder removes temps whose
writer is dead.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from kdash.errors import UserError

TEMP_SUFFIX = ".kdash-tmp"
_TEMP_RE = re.compile(r"^\..+\.(\d+)-[0-9a-f]{8}" + re.escape(TEMP_SUFFIX) + r"$")


def temp_name(path: Path, pid: int | None = None) -> Path:
    """The named temp file for `path` (the fallback when O_TMPFILE is not there)."""
    pid = os.getpid() if pid is None else pid
    return path.with_name(f".{path.name}.{pid}-{secrets.token_hex(4)}{TEMP_SUFFIX}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    except OverflowError:
        return False
    return True


def remove_stale_temps(folder: Path) -> list[Path]:
    """Remove kdash temp files in `folder` whose writing process is gone; returns them."""
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        m = _TEMP_RE.match(entry.name)
        if m is None or _pid_alive(int(m.group(1))):
            continue
        with contextlib.suppress(OSError):
            os.unlink(entry.path)
            removed.append(Path(entry.path))
    return removed


def _write_error(path: Path, e: OSError) -> UserError:
    return UserError(f"cannot write {path}: {e.strerror or e}")


def _open_unnamed(folder: Path) -> int | None:
    """An O_TMPFILE descriptor in `folder`, or None where the system or filesystem has none."""
    flag = getattr(os, "O_TMPFILE", None)
    if flag is None or not os.path.isdir("/proc/self/fd"):
        return None
    try:
        return os.open(folder, flag | os.O_RDWR, 0o666)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT):
            return None
        raise


def _exists_error(path: Path) -> UserError:
    return UserError(
        f"{path} exists (another process created it while kdash was writing); "
        "nothing was overwritten: choose another name"
    )


@contextlib.contextmanager
def new_file(path: str | os.PathLike, *, exclusive: bool = True) -> Iterator[BinaryIO]:
    """A binary file to write `path`'s contents into; on a clean exit it becomes `path`.

    `exclusive`: never replace an existing `path` (UserError instead); else replace it
    atomically. Any OSError (a full disk, a read-only folder) is a one-line UserError.
    """
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    remove_stale_temps(folder)
    try:
        fd = _open_unnamed(folder) if exclusive else None
    except OSError as e:
        raise _write_error(path, e) from None
    if fd is not None:
        yield from _via_unnamed(fd, path)
        return
    tmp = temp_name(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as e:
        raise _write_error(path, e) from None
    try:
        with os.fdopen(fd, "wb") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        if exclusive:
            _link_named(tmp, path)
        else:
            os.replace(tmp, path)
    except OSError as e:
        raise _write_error(path, e) from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _via_unnamed(fd: int, path: Path) -> Iterator[BinaryIO]:
    try:
        with os.fdopen(fd, "w+b") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
            if not _link_fd(fh.fileno(), path):
                # this system links no unnamed file (a sandbox, an old kernel): name a copy
                fh.seek(0)
                _copy_to_named(fh, path)
    except OSError as e:
        raise _write_error(path, e) from None


def _link_fd(fd: int, path: Path) -> bool:
    """Give the unnamed file `fd` the name `path`; False where this system cannot."""
    try:
        os.link(f"/proc/self/fd/{fd}", path, follow_symlinks=True)
        return True
    except FileExistsError:
        raise _exists_error(path) from None
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.ENOENT, errno.EPERM, errno.EACCES):
            raise
    return _linkat_empty_path(fd, path)


def _linkat_empty_path(fd: int, path: Path) -> bool:
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        linkat = libc.linkat
    except (OSError, AttributeError):
        return False
    at_fdcwd, at_empty_path = -100, 0x1000
    if linkat(fd, b"", at_fdcwd, os.fsencode(path), at_empty_path) == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.EEXIST:
        raise _exists_error(path)
    return False


def _copy_to_named(src: BinaryIO, path: Path) -> None:
    import shutil

    tmp = temp_name(path)
    try:
        with open(tmp, "xb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
            dst.flush()
            os.fsync(dst.fileno())
        _link_named(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _link_named(tmp: Path, path: Path) -> None:
    try:
        os.link(tmp, path)
        return
    except FileExistsError:
        raise _exists_error(path) from None
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            raise
    # a filesystem without hard links: claim the name first, then move the data onto it
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    except FileExistsError:
        raise _exists_error(path) from None
    os.replace(tmp, path)
