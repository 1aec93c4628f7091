"""SGLang's Kineto trace files: what a file name says, and the rank files of one profile in a
folder (found, and waited for while torch still writes them).

**SGLang file names** `{prefix-}{profile_id}-TP-{tp}[-DP-d][-PP-p][-EP-e][-EXTEND|-DECODE]
.trace.json.gz` give each trace's ranks and stage (`parse_trace_name`; checked against
SGLang's profile_utils `_ProfilerTorch.stop`: DP/PP/EP appear only when that size is > 1, the
stage is `-{stage.name}` with `profile_by_stage`, `-prefill`/`-decode` with SGLANG_PROFILE_V2);
they are kept per trace in the metadata, and rows of a rank are told apart by `pid` (the
scheduler's process).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from kdash.errors import UserError

_STAGE_RE = r"(?:-(?P<stage>[A-Za-z][A-Za-z_]*))?"  # -EXTEND/-DECODE; V2: -prefill/-decode
_TRACE_NAME = re.compile(
    r"^(?:(?P<prefix>.*?)-)?(?P<id>[^-]+)(?P<ranks>(?:-(?:TP|DP|PP|EP)-\d+)+)"
    + _STAGE_RE
    + r"\.trace\.json(?:\.gz)?$"
)
_RANK = re.compile(r"-(TP|DP|PP|EP)-(\d+)")
_MERGED = re.compile(r"^merged-(?P<id>.+?)\.trace\.json(?:\.gz)?$")


@dataclass
class TraceName:
    """What an SGLang trace file name says; all None for other names."""

    prefix: str | None = None
    profile_id: str | None = None
    tp: int | None = None
    dp: int | None = None
    pp: int | None = None
    ep: int | None = None
    stage: str | None = None
    merged: bool = False


def parse_trace_name(name: str) -> TraceName:
    """Ranks and stage from SGLang's trace file name (rank tokens in any order)."""
    base = os.path.basename(name)
    m = _TRACE_NAME.match(base)
    if m:
        ranks = {k.lower(): int(v) for k, v in _RANK.findall(m.group("ranks"))}
        prefix, pid = m.group("prefix") or None, m.group("id")
        # Some SGLang entry points name a profile by time.strftime("%Y%m%d-%H%M%S"): the id
        # itself holds a dash.
        if prefix and re.fullmatch(r"\d{6}", pid):
            head, _, last = prefix.rpartition("-")
            if re.fullmatch(r"\d{8}", last):
                prefix, pid = head or None, f"{last}-{pid}"
        return TraceName(prefix=prefix, profile_id=pid, stage=m.group("stage"), **ranks)
    m = _MERGED.match(base)
    if m:
        return TraceName(profile_id=m.group("id"), merged=True)
    return TraceName()


def settled_traces(
    folder: Path, prefix: str, sizes: dict[Path, tuple[int, float]], stable_s: float
) -> tuple[list[Path], int]:
    """(files of `prefix`, how many kept their size for `stable_s`): torch writes in place.
    `sizes` carries each file's last size and since when, from one call to the next."""
    import time

    now = time.monotonic()
    files = find_rank_traces(folder, prefix)
    settled = 0
    for f in files:
        try:
            size = f.stat().st_size
        except OSError:
            continue
        old = sizes.get(f)
        if old is None or old[0] != size:
            sizes[f] = (size, now)
        elif size > 0 and now - old[1] >= stable_s:
            settled += 1
    return files, settled


def find_rank_traces(folder: str | os.PathLike, prefix: str | None = None) -> list[Path]:
    """SGLang rank trace files in `folder` (of one `profile_prefix` when given), sorted by
    profile id, stage and ranks. Merged files are left out: the rank files hold the same events.
    """
    out = []
    try:
        entries = list(Path(folder).iterdir())
    except OSError:
        return []
    for p in entries:
        n = parse_trace_name(p.name)
        if n.profile_id is None or n.merged:
            continue
        if prefix is not None and n.prefix != prefix:
            continue
        out.append((n.profile_id, n.stage or "", n.dp or 0, n.pp or 0, n.tp or 0, n.ep or 0, p))
    return [t[-1] for t in sorted(out, key=lambda t: t[:-1])]


def wait_for_traces(
    folder: str | os.PathLike,
    prefix: str,
    count: int,
    timeout_s: float = 60.0,
    stable_s: float = 1.0,
    poll_s: float = 0.2,
) -> list[Path]:
    """Wait until `count` rank files of `prefix` exist and their sizes have not changed for
    `stable_s` (torch writes the .gz in place, so a file can be seen half written).

    Returns the files; UserError on timeout, saying how many came. `folder` may be a path seen
    through /proc/PID/root for a server in a container.
    """
    import time

    deadline = time.monotonic() + timeout_s
    sizes: dict[Path, tuple[int, float]] = {}
    files: list[Path] = []
    while True:
        now = time.monotonic()
        files, settled = settled_traces(folder, prefix, sizes, stable_s)
        if len(files) >= count and settled >= len(files):
            return files
        if now >= deadline:
            raise UserError(
                f"{len(files)} of {count} trace files with prefix {prefix!r} in {folder} after "
                f"{timeout_s:g} s (no requests, so no steps? or the server cannot write there)"
            )
        time.sleep(poll_s)
