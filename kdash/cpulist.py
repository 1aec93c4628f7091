"""The cpulist form (`"0-31,64-95"`: what sysfs and `taskset -c` use) to and from sets of CPUs.

In the core, not in a collector: the findings (an analysis) and the topology and scheduler
collectors all read and write it.
"""

from __future__ import annotations

from collections.abc import Iterable


def parse_cpulist(text: str) -> set[int]:
    """`"0-3,8"` -> {0, 1, 2, 3, 8}. Empty or whitespace -> empty set.

    Also accepts the kernel's group form `"0-15:2/4"` (the first 2 of every 4 CPUs) that
    boot parameters and some cgroup files use. Raises ValueError on anything else, so a
    misread file is loud in tests, not a silent empty set.
    """
    cpus: set[int] = set()
    text = text.strip()
    if not text:
        return cpus
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        used = group = 0
        if ":" in part:
            part, grp = part.split(":", 1)
            used_s, _, group_s = grp.partition("/")
            used, group = int(used_s), int(group_s)
            if used <= 0 or group <= 0 or used > group:
                raise ValueError(f"bad cpulist group {grp!r} in {text!r}")
        if "-" in part:
            lo_s, hi_s = part.split("-", 1)
            lo, hi = int(lo_s), int(hi_s)
            if lo < 0 or hi < lo:
                raise ValueError(f"bad cpulist range {part!r} in {text!r}")
            if group:
                cpus.update(c for c in range(lo, hi + 1) if (c - lo) % group < used)
            else:
                cpus.update(range(lo, hi + 1))
        else:
            if group:
                raise ValueError(f"group form needs a range in {text!r}")
            n = int(part)
            if n < 0:
                raise ValueError(f"negative CPU in {text!r}")
            cpus.add(n)
    return cpus


def format_cpulist(cpus: Iterable[int]) -> str:
    """{0, 1, 2, 3, 8} -> `"0-3,8"`; the inverse of `parse_cpulist` (empty -> "")."""
    s = sorted(set(cpus))
    if not s:
        return ""
    parts: list[str] = []
    start = prev = s[0]
    for c in s[1:]:
        if c == prev + 1:
            prev = c
            continue
        parts.append(f"{start}-{prev}" if prev != start else str(start))
        start = prev = c
    parts.append(f"{start}-{prev}" if prev != start else str(start))
    return ",".join(parts)
