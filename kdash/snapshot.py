"""`kdash snapshot`: watch a process for a few seconds, print what the panes would show, exit.

The one-shot answer people paste into a ticket (as `nvidia-smi`, `nvitop -1` or `py-spy dump`
give): the target, each GPU's clocks, power against its limit, throttle reasons and busy time,
the hottest threads, the findings, and the top kernels when the target has a kdash agent. It
records the seconds into a capture in a private temporary folder and summarises that with the
report's own code (`kdash.report.summarize`), so a snapshot and `kdash report` of a capture
agree on every number; the capture is removed afterwards.

It does not inject an agent unless asked (`--inject`): a snapshot is for looking, and a
process someone wants a quick answer about should not be changed by it.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

from kdash.errors import UserError
from kdash.options import LiveOptions, SnapshotOptions

MAX_SECONDS = 600.0


def cmd_snapshot(args: SnapshotOptions) -> int:
    from kdash import commands
    from kdash.capture import load_capture
    from kdash.report import DEFAULT_TOP, render, summarize
    from kdash.target import Target

    seconds = float(args.seconds)
    if not 0 < seconds <= MAX_SECONDS:
        raise UserError(f"--seconds must be above 0 and at most {MAX_SECONDS:g}, not {seconds:g}")
    server = None
    api_key = getattr(args, "api_key", None)
    if args.sglang is not None:
        from kdash.sglang import discover_from_url

        server = discover_from_url(args.sglang, api_key)
        root = server.tree.root.pid if server.tree.root else None
        if root is None:
            raise UserError(f"found no SGLang process of {args.sglang} on this machine")
    else:
        Target.from_pid(args.pid)  # a dead or bad pid: its own one-line reason
        root = args.pid
    target = Target.from_pid(root)
    sources = commands.build_sources(
        target,
        args.gpus,
        args.interval,
        inject_allowed=args.inject,
        try_inject=args.inject,
    )
    if server is not None:
        sources += commands._sglang_sources(server, args.interval)
    folder = Path(tempfile.mkdtemp(prefix="kdash-snapshot-"))
    try:
        out = folder / "snapshot.kdash"
        rec_args = LiveOptions(headless=True, duration=seconds, output=out, interval=args.interval)
        quiet = _Quiet()
        with quiet:
            commands._record_headless(target, rec_args, sources, server=server)
        summary = summarize(load_capture(out), top=args.top or DEFAULT_TOP)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    summary["snapshot"] = {"seconds": seconds, "injected": bool(args.inject)}
    summary["title"] = summary.get("title") or f"kdash snapshot ({seconds:g} s)"
    if args.json:
        sys.stdout.write(json.dumps(summary, indent=1, default=str) + "\n")
    else:
        from rich.console import Console

        render(summary, Console(width=commands.report_width(None)))
    return 0


class _Quiet:
    """The headless recorder's progress and "saved" lines go to stderr; a snapshot has no file
    to announce, so they are held back (and shown only if the recording fails)."""

    def __enter__(self) -> _Quiet:
        import io

        self._saved = sys.stderr
        self.buffer = io.StringIO()
        sys.stderr = self.buffer
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        sys.stderr = self._saved
        if exc_type is not None:
            sys.stderr.write(self.buffer.getvalue())
