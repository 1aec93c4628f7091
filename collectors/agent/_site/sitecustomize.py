"""kdash's start-up hook (see kdash.collectors.agent.bootstrap): start the agent, then chain.

Runs in every Python process of a `kdash run` tree, before user code. It must never fail the
target: any problem is written to `<socket folder>/<pid>.unavailable`, where the kdash client
reads it to say why this process has no agent, and the target starts as usual.
"""

import contextlib
import os
import sys


def _kdash_private(d):
    """Is `d` a real folder of ours with mode 0700 (creating it if absent)?"""
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(d, 0o700)
        st = os.lstat(d)
    except OSError:
        return False
    return (
        st.st_uid == os.getuid()
        and os.path.isdir(d)
        and not os.path.islink(d)
        and not (st.st_mode & 0o077)
    )


def _kdash_note_dirs():
    """Where the note may go, in the order the agent and the client use (server.socket_dirs):
    `$XDG_RUNTIME_DIR/kdash`, `/tmp/kdash-<uid>`, then private `/tmp/kdash-<uid>-*` folders
    (for when someone else made `/tmp/kdash-<uid>` first)."""
    uid = os.getuid()
    out = []
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        try:
            st = os.stat(xdg)
            if st.st_uid == uid and os.path.isdir(xdg):
                out.append(os.path.join(xdg, "kdash"))
        except OSError:
            pass  # unusable runtime dir: fall back to /tmp as the agent does
    out.append(f"/tmp/kdash-{uid}")
    with contextlib.suppress(OSError):
        out += sorted(
            os.path.join("/tmp", n) for n in os.listdir("/tmp") if n.startswith(f"kdash-{uid}-")
        )
    return out


def _kdash_note_failure(reason):
    try:
        d = next((d for d in _kdash_note_dirs() if _kdash_private(d)), None)
        if d is None:  # every folder is taken: one of our own, which the client also lists
            d = f"/tmp/kdash-{os.getuid()}-{os.urandom(4).hex()}"
            os.mkdir(d, 0o700)
        path = os.path.join(d, f"{os.getpid()}.unavailable")
        with open(path, "w") as f:
            f.write(reason[:2000])
        import atexit

        atexit.register(_kdash_unlink, path)
    except Exception as e:  # noqa: BLE001 - last resort: say it where a human may look
        if os.environ.get("KDASH_AGENT_DEBUG"):
            sys.stderr.write(f"kdash: agent unavailable ({reason}); could not record it: {e}\n")


def _kdash_unlink(path):
    try:
        os.unlink(path)
    except OSError:
        return


def _kdash_import_agent():
    """The agent's server module, through the agent's one loader (loader.py, next to this
    folder), which loads the agent's modules by path and not the `kdash` package: importing
    kdash and numpy in every Python process of the tree would cost start-up time the target
    pays even when nobody ever connects."""
    import importlib.util

    name = "kdash.collectors.agent.loader"
    mod = sys.modules.get(name)
    if mod is None:
        here = os.path.dirname(os.path.abspath(__file__))
        path = os.path.join(os.path.dirname(here), "loader.py")
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load the kdash agent from {path}")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        try:
            spec.loader.exec_module(mod)
        except BaseException:
            sys.modules.pop(name, None)
            raise
    return mod.load_agent()


def _kdash_start():
    if os.environ.get("KDASH_AGENT") != "1":
        return
    try:
        server = _kdash_import_agent()
    except Exception as e:  # noqa: BLE001
        _kdash_note_failure(
            f"the kdash agent module is not importable in {sys.executable} "
            f"({type(e).__name__}: {e})"
        )
        return
    if server.start_agent() is None:
        _kdash_note_failure(f"the kdash agent could not listen: {server.start_error()}")


def _kdash_nvtx():
    """With `kdash run --nvtx` (KDASH_AGENT_NVTX=1): point NVTX at libcupti so CUPTI sees NVTX
    ranges. NVTX reads NVTX_INJECTION64_PATH at its first call, so it must be set before user
    code runs; it is opt-in because it makes every NVTX call enter libcupti even while nobody
    is watching. The library is looked for in the nvidia-cuda-cupti wheels on sys.path,
    without importing anything."""
    if os.environ.get("KDASH_AGENT_NVTX") != "1" or os.environ.get("NVTX_INJECTION64_PATH"):
        return
    import glob

    for entry in sys.path:
        for pattern in ("nvidia/cuda_cupti/lib/libcupti.so*", "nvidia/cu*/lib/libcupti.so*"):
            hits = sorted(glob.glob(os.path.join(entry or ".", pattern)))
            if hits:
                os.environ["NVTX_INJECTION64_PATH"] = hits[0]
                return


def _kdash_chain():
    """Run the sitecustomize that Python would have imported without ours, if there is one."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        try:
            if os.path.abspath(entry or os.getcwd()) == here:
                continue
        except (OSError, TypeError):
            continue
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", [entry])
        if spec is None or spec.loader is None:
            continue
        mod = importlib.util.module_from_spec(spec)
        sys.modules["sitecustomize"] = mod
        spec.loader.exec_module(mod)  # its errors surface as they would without kdash
        return


_kdash_start()
try:
    _kdash_nvtx()
except Exception as _kdash_e:  # noqa: BLE001 - NVTX ranges are optional; say why they are absent
    _kdash_note_failure(f"NVTX hook: {type(_kdash_e).__name__}: {_kdash_e}")
    del _kdash_e
_kdash_chain()
