"""How `kdash run -- CMD` arms the agent in CMD and in every Python process CMD spawns.

Mechanism: the child environment gets `KDASH_AGENT=1` and a folder prepended to `PYTHONPATH`
that holds only a `sitecustomize.py`. Python imports `sitecustomize` at start-up from the first
folder on its path that has one, so every Python process of the tree (SGLang's scheduler and TP
workers are spawned, not forked, and inherit the environment) runs it before user code. It calls
`start_agent()` (a listener thread; nothing else until a client connects) and then runs the
`sitecustomize` that would have been found without ours, so a site's own hook keeps working.

Why not `-X importtime`-style flags or `.pth` files: flags do not reach grandchildren started as
`python ...` by a shell, and a `.pth` needs write access to the target's site-packages.

What does not get the agent: interpreters started with `-I`/`-S`/`-E` (they ignore
PYTHONPATH or skip `site`), and processes whose environment is scrubbed by their parent.

When the child's interpreter is not the one kdash is installed in, the hook still finds the
agent's modules through `KDASH_AGENT_PKGS` (the folders of `kdash`, `kdash.collectors` and
`kdash.collectors.agent`); the target then needs only numpy (and cupti-python for kernels).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

ENV_FLAG = "KDASH_AGENT"
ENV_PKGS = "KDASH_AGENT_PKGS"
ENV_NVTX = "KDASH_AGENT_NVTX"
SITE_DIR = str(Path(__file__).resolve().parent / "_site")


def package_dirs() -> list[str]:
    """Folders of kdash, kdash.collectors and kdash.collectors.agent, in that order."""
    import kdash.collectors
    import kdash.collectors.agent

    import kdash

    return [
        str(Path(next(iter(m.__path__))).resolve())
        for m in (kdash, kdash.collectors, kdash.collectors.agent)
    ]


def run_env(base_env: Mapping[str, str] | None = None, nvtx: bool = False) -> dict[str, str]:
    """The environment for `kdash run`'s child: `base_env` (default: ours) plus the agent hook.

    `nvtx=True` also makes the hook point NVTX at the target's libcupti (NVTX_INJECTION64_PATH)
    so NVTX ranges reach the markers table; off by default because every NVTX call then enters
    libcupti even while nobody watches. Idempotent: arming an already armed environment does
    not add the folder twice.
    """
    env = dict(os.environ if base_env is None else base_env)
    env[ENV_FLAG] = "1"
    if nvtx:
        env[ENV_NVTX] = "1"
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != SITE_DIR]
    env["PYTHONPATH"] = os.pathsep.join([SITE_DIR, *parts])
    env[ENV_PKGS] = os.pathsep.join(package_dirs())
    return env


def disarmed_env(base_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base_env` with the hook removed (for tools kdash starts that must not be watched)."""
    env = dict(os.environ if base_env is None else base_env)
    env.pop(ENV_FLAG, None)
    env.pop(ENV_PKGS, None)
    env.pop(ENV_NVTX, None)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != SITE_DIR]
    if parts:
        env["PYTHONPATH"] = os.pathsep.join(parts)
    else:
        env.pop("PYTHONPATH", None)
    return env
