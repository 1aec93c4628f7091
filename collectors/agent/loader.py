"""The one way the agent's modules get into a process.

`kdash run`'s sitecustomize and the boot code that injection runs inside a live target both
load this file by its path and call `load_agent()`; the agent calls `ensure_kdash()` once a
client has connected. Why by path, and not `import kdash.collectors.agent.server`: importing
the `kdash` package would run its `__init__` (and, through it, more of kdash) in every armed
process, which pays for it even when nobody ever connects. So the agent's modules are loaded
one by one from this folder under their real names, in AGENT_MODULES order, and import each
other only as `from .module import name` (which finds the module already loaded and needs no
parent package). A later `import kdash.collectors.agent.server` then gets the same modules
and the same single agent.

Standard library only, like every module listed here.
"""

from __future__ import annotations

import os
import sys

PACKAGE = "kdash.collectors.agent"
HERE = os.path.dirname(os.path.abspath(__file__))
# Every module the agent imports at module level, each after the ones it imports.
AGENT_MODULES = (
    "constants",
    "loader",
    "security",
    "probes",
    "fields",
    "buffers",
    "records",
    "duty",
    "controller",
    "outbox",
    "pcrun",
    "session",
    "server",
)
ENV_PKGS = "KDASH_AGENT_PKGS"


def load_file(name: str, path: str):
    """Load the module `name` from `path` (once: a loaded one is returned as it is)."""
    import importlib.util

    mod = sys.modules.get(name)
    if mod is not None:
        return mod
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {name} from {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return mod


def load_agent():
    """The agent's server module, with every module it needs, loaded from this folder."""
    for name in AGENT_MODULES:
        load_file(f"{PACKAGE}.{name}", os.path.join(HERE, f"{name}.py"))
    return sys.modules[f"{PACKAGE}.server"]


def ensure_kdash() -> None:
    """Make `kdash.schema` and `kdash.collectors.agent.wire` importable, importing them late.

    They pull in numpy, so they are imported when the first client connects, never at start-up.
    When the target's interpreter has no kdash installed (`kdash run -- /other/python ...`), the
    three package folders that `kdash run` put in KDASH_AGENT_PKGS are mounted as bare packages
    (their `__init__` is not run) so the two modules load from kdash's own files.
    """
    try:
        import kdash.collectors.agent.wire

        import kdash.schema

        return
    except ImportError as first:
        dirs = os.environ.get(ENV_PKGS, "").split(os.pathsep)
        if len(dirs) != 3 or not all(os.path.isdir(d) for d in dirs):
            raise ImportError(
                f"kdash is not importable by {sys.executable} ({first}) and {ENV_PKGS} "
                "does not name its folders"
            ) from None
    import types

    names = ("kdash", "kdash.collectors", "kdash.collectors.agent")
    for name, d in zip(names, dirs, strict=True):
        mod = types.ModuleType(name)
        mod.__path__ = [d]
        mod.__package__ = name
        sys.modules[name] = mod
    import kdash.collectors.agent.wire

    import kdash.schema  # noqa: F401


def wire_module():
    ensure_kdash()
    return sys.modules["kdash.collectors.agent.wire"]


def schema_module():
    ensure_kdash()
    return sys.modules["kdash.schema"]
