"""A capture window through the SGLang server's own profiler: the `/start_profile` request,
waiting for the rank trace files, and reading them onto kdash's clock.

What SGLang 0.5.10.post1 does with a start (its scheduler's profiler mixin, run on a CPU by
tests/test_sglang_real.py):

- `POST /start_profile` takes a JSON `ProfileReqInput`: `output_dir`, `start_step`,
  `num_steps`, `activities` ("CPU", "GPU", "MEM", "RPD"), `with_stack`, `record_shapes`,
  `profile_by_stage`, `merge_profiles`, `profile_prefix`, `profile_stages`. Unset `with_stack`
  and `record_shapes` become True in the tokenizer manager, so kdash always sends False.
- A plain start (no `start_step`, no `profile_by_stage`) while a profile runs answers 200: the
  scheduler drops init_profile's refusal and starts a second profiler over the first one. A
  start with `start_step` takes the branch that returns the refusal (500 while busy), arms the
  profile for the next forward step, and records exactly `num_steps` steps. So kdash always
  sends `start_step`, never needs `/stop_profile`, and never stops someone else's profile.
- `SGLANG_PROFILE_V2=1` (a server environment variable) changes the scheduler's profiler: a
  start without `profile_by_stage`, or with `start_step`, fails an assertion that kills the
  scheduler; `/stop_profile` raises; files end in `-prefill`/`-decode`. kdash then sends
  `profile_by_stage` with `profile_stages` and no `start_step` (`ProfileRequest.for_capture`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kdash.errors import UserError
from kdash.schema import Batch

from .sglang_client import SglangClient, SglangError

log = logging.getLogger("kdash.collectors.sglang")


ACTIVITIES = ("CPU", "GPU", "MEM", "RPD")


@dataclass
class ProfileRequest:
    """The body of `/start_profile`, field for field SGLang's `ProfileReqInput`."""

    output_dir: str | None = None
    start_step: int | None = None
    num_steps: int | None = None
    activities: list[str] | None = None
    with_stack: bool | None = None
    record_shapes: bool | None = None
    profile_by_stage: bool = False
    merge_profiles: bool = False
    profile_prefix: str | None = None
    profile_stages: list[str] | None = None

    def validate(self) -> None:
        """Refuse what the server would refuse later, with a clearer line."""
        if self.activities is not None:
            bad = [a for a in self.activities if a not in ACTIVITIES]
            if bad or not self.activities:
                raise UserError(
                    f"profile activities must be some of {', '.join(ACTIVITIES)}; got "
                    f"{self.activities}"
                )
        for name in ("start_step", "num_steps"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise UserError(f"profile {name} must be a non-negative integer; got {v!r}")
        if self.num_steps == 0:
            raise UserError("profile num_steps must be at least 1")
        if self.profile_prefix is not None and ("/" in self.profile_prefix):
            raise UserError(f"profile prefix must not contain '/': {self.profile_prefix!r}")

    def to_json(self) -> dict[str, Any]:
        """Set fields only; booleans that are False are SGLang's defaults and are left out."""
        self.validate()
        out: dict[str, Any] = {}
        for key in (
            "output_dir",
            "start_step",
            "num_steps",
            "activities",
            "with_stack",
            "record_shapes",
            "profile_prefix",
            "profile_stages",
        ):
            v = getattr(self, key)
            if v is not None:
                out[key] = list(v) if key in ("activities", "profile_stages") else v
        if self.profile_by_stage:
            out["profile_by_stage"] = True
        if self.merge_profiles:
            out["merge_profiles"] = True
        return out

    @classmethod
    def for_capture(
        cls,
        *,
        output_dir: str,
        num_steps: int,
        activities: list[str],
        prefix: str,
        profile_v2: bool | None,
    ) -> ProfileRequest:
        """kdash's own start: `num_steps` steps from the next one, no stacks or shapes.

        `profile_v2` False: `start_step`, so a busy server refuses (500) instead of having its
        profile replaced. True or None (the server's SGLANG_PROFILE_V2 could not be read): by
        stage, decode steps only, no `start_step`: the one shape V2 accepts, and one the classic
        profiler takes without harm (it refuses it while busy too).
        """
        common = {
            "output_dir": output_dir,
            "num_steps": num_steps,
            "activities": list(activities),
            "with_stack": False,
            "record_shapes": False,
            "profile_prefix": prefix,
        }
        if profile_v2 is False:
            return cls(start_step=1, **common)
        return cls(profile_by_stage=True, profile_stages=["decode"], **common)


def new_prefix() -> str:
    """A profile_prefix no other capture shares: kdash-<our pid>-<ms>, safe in a file name."""
    import os

    return f"kdash-{os.getpid()}-{int(time.time() * 1000)}"


# The step an armed profile waits for when kdash gives up on it: never reached, so a rank that
# got no forward step does not start kdash's profile long after the capture ended.
NEVER_STEP = 2**31


def disarm(client: SglangClient, server_dir: str, prefix: str) -> None:
    """Move kdash's armed, never started profile to a step no server reaches.

    A rank that got no forward step still holds kdash's `start_step`; /stop_profile cannot
    clear it (it refuses: nothing in progress). A new start with a far `start_step` replaces
    it; a server busy with a profile refuses that (500) and keeps its own. Errors are logged.
    """
    req = ProfileRequest(
        output_dir=server_dir,
        start_step=NEVER_STEP,
        num_steps=1,
        activities=["CPU"],
        with_stack=False,
        record_shapes=False,
        profile_prefix=prefix,
    )
    try:
        client.start_profile(req)
    except SglangError as e:
        log.info("disarming kdash's profile: %s", e)


def take_profile(
    client: SglangClient,
    *,
    ranks: int,
    server_dir: str,
    local_dir: str | None = None,
    num_steps: int = 20,
    activities: tuple[str, ...] = ("CPU", "GPU"),
    prefix: str | None = None,
    profile_v2: bool | None = False,
    timeout_s: float = 120.0,
    stable_s: float = 1.0,
    poll_s: float = 0.2,
) -> list[Path]:
    """Profile `num_steps` forward steps in every scheduler and return the trace files.

    `server_dir` is the folder as the server names it (it writes there); `local_dir` the same
    folder as kdash reaches it (`path_in_process` for a server in a container; default the same
    path). The request is `ProfileRequest.for_capture`: the server stops by itself, a busy one
    refuses, and /stop_profile is never sent (it would stop whichever profile runs, someone
    else's too). `ranks` is the number of scheduler processes: the wait ends when that many
    files came (with V2 or by stage, one per rank and stage seen), or at `timeout_s` with the
    files that came (a DP rank that got no request writes none). With none at all, UserError.
    """
    from kdash.kineto_files import settled_traces

    prefix = prefix or new_prefix()
    req = ProfileRequest.for_capture(
        output_dir=server_dir,
        num_steps=num_steps,
        activities=list(activities),
        prefix=prefix,
        profile_v2=profile_v2,
    )
    client.start_profile(req)
    folder = Path(local_dir or server_dir)
    deadline = time.monotonic() + timeout_s
    sizes: dict[Path, tuple[int, float]] = {}
    while True:
        files, settled = settled_traces(folder, prefix, sizes, stable_s)
        if len(files) >= ranks and settled >= len(files):
            return files
        if time.monotonic() >= deadline:
            break
        time.sleep(poll_s)
    if profile_v2 is False:
        disarm(client, server_dir, prefix + "-off")
    if files:
        end = time.monotonic() + stable_s + 5 * poll_s
        while settled < len(files) and time.monotonic() < end:
            time.sleep(poll_s)
            files, settled = settled_traces(folder, prefix, sizes, stable_s)
        return files
    raise UserError(
        f"no trace with prefix {prefix!r} in {folder} after {timeout_s:g} s: no forward step "
        "(no requests reached the server? send traffic and capture again), or the server "
        "cannot write there"
    )


def missing_ranks(files: list[Path], expect: list[tuple[int | None, int, int | None]]) -> list[str]:
    """Labels (`DP1 TP0`) of the expected (dp, tp, pp) schedulers without a trace file."""
    from kdash.kineto_files import parse_trace_name

    seen = set()
    for f in files:
        n = parse_trace_name(f.name)
        seen.add((n.dp or 0, n.tp or 0, n.pp or 0))
    out = []
    for dp, tp, pp in expect:
        if (dp or 0, tp, pp or 0) not in seen:
            parts = ([f"DP{dp}"] if dp is not None else []) + (
                [f"PP{pp}"] if pp is not None else []
            )
            out.append(" ".join([*parts, f"TP{tp}"]))
    return out


@dataclass
class ServerCapture:
    """What a capture through the server brought back: rows on kdash's clock, the files."""

    tables: dict[str, Batch]
    traces: list[Any]  # kdash.kineto.TraceInfo, one per rank file
    files: list[Path]
    note: str = ""  # set when the traces hold no GPU kernel, saying the likely reason
    missing: list[str] = field(default_factory=list)  # ranks with no step (no trace file)
    partial: str = ""  # the one line that says so; the capture still holds the other ranks


def capture_via_server(
    client: SglangClient,
    *,
    ranks: int,
    server_dir: str,
    local_dir: str | None = None,
    wall_offset_ns: int | None = None,
    num_steps: int = 20,
    activities: tuple[str, ...] = ("CPU", "GPU"),
    timeout_s: float = 120.0,
    stable_s: float = 1.0,
    prefix: str | None = None,
    profile_v2: bool | None = False,
    expect: list[tuple[int | None, int, int | None]] | None = None,
) -> ServerCapture:
    """`take_profile`, then every rank's trace read onto the host monotonic clock
    (`wall_offset_ns` from kdash.clock, as the session keeps it), ready to merge into a
    capture window. `expect` ((dp, tp, pp) per scheduler) names the ranks that wrote nothing.
    When GPU activity was asked for and no kernel came, `note` says why that usually is:
    another CUPTI client (kdash's own agent, Nsight) held CUPTI."""
    from kdash.kineto import read_traces

    files = take_profile(
        client,
        ranks=ranks,
        server_dir=server_dir,
        local_dir=local_dir,
        num_steps=num_steps,
        activities=activities,
        timeout_s=timeout_s,
        stable_s=stable_s,
        prefix=prefix,
        profile_v2=profile_v2,
    )
    tables, infos = read_traces(files, wall_offset_ns=wall_offset_ns)
    note = ""
    if "GPU" in activities and len(tables["kernels"]["start_ns"]) == 0:
        note = (
            "no GPU kernels in the server's traces: another CUPTI client (kdash's agent, "
            "Nsight) held CUPTI while it profiled; switch it off and capture again"
        )
    missing = missing_ranks(files, expect or [])
    partial = ""
    if missing:
        partial = (
            f"no step on {', '.join(missing)} in {timeout_s:g} s (no request reached it): "
            "no trace from it"
        )
    return ServerCapture(
        tables=tables, traces=infos, files=files, note=note, missing=missing, partial=partial
    )
