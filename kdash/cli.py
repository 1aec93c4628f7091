"""The `kdash` command line.

Exit status: 0 success; 2 bad input (one `kdash: ...` line on stderr, no traceback); 1 a bug in
kdash (one line too; set KDASH_DEBUG=1 for the traceback).
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kdash import options
from kdash.errors import UserError


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad option in one line and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UserError(message)


def _positive(kind: str):
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{kind} must be a number, not {text!r}") from None
        if not v > 0 or v != v or v == float("inf"):
            raise argparse.ArgumentTypeError(f"{kind} must be a positive number, not {text!r}")
        return v

    return parse


def _non_negative(kind: str):
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{kind} must be a number, not {text!r}") from None
        if not v >= 0 or v == float("inf"):
            raise argparse.ArgumentTypeError(f"{kind} must be zero or more, not {text!r}")
        return v

    return parse


def _pid(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a process id: {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"not a process id: {text!r}")
    return v


def _gpu_list(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gpus takes indices like 0,1 — not {text!r}") from None
    if not out or any(g < 0 for g in out):
        raise argparse.ArgumentTypeError(f"--gpus takes indices like 0,1 — not {text!r}")
    return out


def build_parser() -> argparse.ArgumentParser:
    from kdash import __version__

    p = _Parser(
        prog="kdash",
        description="Terminal profiling dashboard for GPU inference processes.",
    )
    p.add_argument("--version", action="version", version=f"kdash {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    live = options.LiveOptions()

    def live_options(sp: argparse.ArgumentParser) -> None:
        sp.add_argument(
            "--interval",
            type=_positive("--interval"),
            metavar="S",
            help=f"seconds between host polls (default {live.interval:g} = "
            f"{1 / live.interval:g} Hz)",
        )
        sp.add_argument(
            "--pre",
            type=_non_negative("--pre"),
            metavar="S",
            help=f"seconds before the capture key to keep (default {live.pre:g})",
        )
        sp.add_argument(
            "--post",
            type=_non_negative("--post"),
            metavar="S",
            help=f"seconds after the capture key to record (default {live.post:g})",
        )
        sp.add_argument(
            "--capture-dir",
            type=Path,
            metavar="DIR",
            help="where `c` saves captures (default: current folder)",
        )
        sp.add_argument("--theme", metavar="NAME", help="dark, light or mono")
        sp.add_argument(
            "--gpus",
            type=_gpu_list,
            metavar="I,J",
            help="only these GPU indices (default: all)",
        )
        sp.add_argument(
            "--pc-sampling",
            action="store_true",
            help="start the agents' PC sampling (source-pane line samples; `L` switches it "
            "live): 200 ms ranges, kernel activity paused during each, spaced 2-30 s apart "
            "so that what they hold the target stays near 5%% (--cost-budget 0: every 2 s)",
        )
        sp.add_argument(
            "--graph-kernels",
            action="store_true",
            help="record kernels also in processes that replay CUDA graphs; on NVIDIA's "
            "current drivers CUPTI then cannot be taken out of such a process again, and it "
            "stays slower (8-25%% on an H200) until it restarts",
        )
        sp.add_argument(
            "--cost-budget",
            type=_non_negative("--cost-budget"),
            metavar="PCT",
            help="while sampling, lower each agent's duty cycle so kdash's estimated cost of "
            "the target stays at PCT percent (default 1.5; 0: always 10%% of each second)",
        )
        sp.add_argument(
            "--headless",
            action="store_true",
            help="record without a UI (needs --duration and --output, or --prometheus/--jsonl)",
        )
        sp.add_argument(
            "--prometheus",
            metavar="[HOST:]PORT",
            help="serve kdash_* series on http://HOST:PORT/metrics (host 127.0.0.1 unless given)",
        )
        sp.add_argument(
            "--jsonl",
            metavar="PATH|-",
            help="write the same sample as one JSON line a second (- = stdout, with --headless)",
        )
        sp.add_argument(
            "--duration",
            type=_positive("--duration"),
            metavar="S",
            help="with --headless: seconds to record, then write --output and exit",
        )
        sp.add_argument(
            "-o",
            "--output",
            type=Path,
            metavar="PATH",
            help="capture file to write in --headless mode (.kdash)",
        )

    a = sub.add_parser(
        "attach",
        help="watch a running process and its children, or a live SGLang server",
        usage="kdash attach (--pid PID | --sglang URL) [--api-key KEY] [--admin-api-key KEY] "
        "[options]",
    )
    who = a.add_mutually_exclusive_group(required=True)
    who.add_argument(
        "--pid",
        type=_pid,
        help="the process to watch (an SGLang server's process is recognised by its titles)",
    )
    who.add_argument(
        "--sglang",
        metavar="URL",
        help="an SGLang server on this machine, e.g. http://127.0.0.1:30000",
    )
    a.add_argument(
        "--api-key",
        metavar="KEY",
        help="the server's --api-key, for /server_info and /v1/loads (default: "
        f"${options.ENV_API_KEY})",
    )
    a.add_argument(
        "--admin-api-key",
        metavar="KEY",
        help="the server's --admin-api-key, for /start_profile (default: "
        f"${options.ENV_ADMIN_API_KEY}; without it --api-key is sent there)",
    )
    a.add_argument(
        "--no-inject",
        action="store_true",
        help="never put the kdash agent into the live process; without an agent already in "
        "it (`kdash run`), only host data is shown",
    )
    live_options(a)

    rn = sub.add_parser(
        "run",
        help="run a command with the kdash agent armed in it, and watch it",
        usage="kdash run [options] -- CMD [ARGS...]",
    )
    live_options(rn)
    rn.add_argument(
        "cmd", nargs=argparse.REMAINDER, metavar="-- CMD ARGS", help="the command to run (after --)"
    )

    op = sub.add_parser("open", help="replay a capture in the dashboard")
    op.add_argument("path", type=Path, help="the capture (.kdash) to replay")
    op.add_argument("--theme", metavar="NAME", help="dark, light or mono")

    r = sub.add_parser("report", help="print a capture's summary tables")
    r.add_argument("path", type=Path, help="the capture (.kdash) to summarise")
    r.add_argument("--json", action="store_true", help="one JSON document on stdout")
    r.add_argument("--top", type=int, metavar="N", help="rows of each list (default 20)")
    r.add_argument(
        "--width",
        type=int,
        metavar="N",
        help="columns of the text report (default: the terminal's; into a pipe $COLUMNS or 200)",
    )

    snap = options.SnapshotOptions()
    sn = sub.add_parser(
        "snapshot",
        help="watch a process for a few seconds, print what the panes would show, exit",
        usage="kdash snapshot (--pid PID | --sglang URL) [--seconds S] [--json] [options]",
    )
    who_sn = sn.add_mutually_exclusive_group(required=True)
    who_sn.add_argument("--pid", type=_pid, help="the process to look at (and its children)")
    who_sn.add_argument("--sglang", metavar="URL", help="a live SGLang server on this machine")
    sn.add_argument(
        "--api-key",
        metavar="KEY",
        help=f"the server's --api-key (default: ${options.ENV_API_KEY})",
    )
    sn.add_argument(
        "--seconds",
        type=float,
        metavar="S",
        help=f"how long to watch (default {snap.seconds:g})",
    )
    sn.add_argument("--json", action="store_true", help="one JSON document on stdout")
    sn.add_argument("--top", type=int, metavar="N", help="rows of each list (default 20)")
    sn.add_argument("--gpus", type=_gpu_list, metavar="I,J", help="only these GPU indices")
    sn.add_argument(
        "--interval", type=float, metavar="S", help=f"poll period (default {snap.interval:g})"
    )
    sn.add_argument(
        "--inject",
        action="store_true",
        help="put a kdash agent into a Python target that has none, for its kernels "
        "(default: only an agent already there is read)",
    )

    e = sub.add_parser("export", help="convert a capture to another format")
    e.add_argument("path", type=Path, help="the capture (.kdash) to convert")
    e.add_argument(
        "--perfetto",
        type=Path,
        required=True,
        metavar="OUT",
        help="Chrome/Perfetto trace to write (.json or .json.gz)",
    )
    e.add_argument("--force", action="store_true", help="replace OUT if it exists")

    i = sub.add_parser("import", help="a torch.profiler/Kineto trace (SGLang's too) into a capture")
    i.add_argument("traces", type=Path, nargs="+", metavar="TRACE", help=".json or .json.gz")
    i.add_argument(
        "-o",
        "--output",
        type=Path,
        metavar="PATH",
        help="capture to write (default: beside the first trace)",
    )

    d = sub.add_parser("demo", help="the embedded demo (live on a GPU, else a recorded replay)")
    d.add_argument("--theme", metavar="NAME", help="dark, light or mono")
    d.add_argument(
        "--replay",
        action="store_true",
        help="open the bundled H200 capture even on a machine with a GPU",
    )
    d.add_argument(
        "--headless", action="store_true", help="record the demo without a UI (with --duration, -o)"
    )
    d.add_argument(
        "--eager-decode",
        action="store_true",
        help="launch every decode kernel from Python (host-bound) instead of replaying CUDA graphs",
    )
    d.add_argument(
        "--duration",
        type=_positive("--duration"),
        metavar="S",
        help="with --headless: seconds to record",
    )
    d.add_argument("-o", "--output", type=Path, metavar="PATH", help="capture to write (.kdash)")

    cp = sub.add_parser(
        "completion", help="print the shell completion script (see README: where it goes)"
    )
    cp.add_argument("shell", choices=("bash", "zsh", "fish"), help="the shell to complete in")
    sub.add_parser("man", help="print the kdash(1) man page in roff (`kdash man | man -l -`)")
    # every default is the options record's (defined once, in kdash.options)
    for name, sp in sub.choices.items():
        sp.set_defaults(**options.defaults(COMMANDS[name].options))
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_usage(sys.stdout)
            raise UserError(f"give a command: {', '.join(COMMANDS)}")
        return run_command(args)
    except UserError as e:
        print(f"kdash: {one_line(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kdash: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `kdash report X | head`: the reader left; not an error of ours.
        sys.stderr.close()
        return 0
    except MemoryError:
        if os.environ.get("KDASH_DEBUG"):
            raise
        # the limits of kdash.limits keep real inputs far below this: the machine (or its
        # ulimit) gives less memory than the input needs
        print("kdash: out of memory (KDASH_DEBUG=1 shows where)", file=sys.stderr)
        return 2
    except OSError as e:
        if e.errno not in _MACHINE_ERRNOS or os.environ.get("KDASH_DEBUG"):
            return _internal_error(e)
        where = f" ({e.filename})" if e.filename else ""
        print(f"kdash: {one_line(e.strerror or str(e))}{where}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - the last line of defence: one line, exit 1
        return _internal_error(e)


# A full disk, a read-only or unreadable place, a machine out of descriptors: not kdash's bug.
_MACHINE_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO}
    | {errno.EMFILE, errno.ENFILE, errno.ENOMEM}
)


def one_line(text: str) -> str:
    """A message as one line (pyarrow's and others' errors span several)."""
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


def _internal_error(e: BaseException) -> int:
    if os.environ.get("KDASH_DEBUG"):
        raise e
    print(
        f"kdash: internal error: {type(e).__name__}: {one_line(str(e))} "
        "(KDASH_DEBUG=1 shows the traceback)",
        file=sys.stderr,
    )
    return 1


def print_completion(opts: options.CompletionOptions) -> int:
    """`kdash completion SHELL`: made from this parser, printed to stdout."""
    from kdash.cli_spec import spec_of
    from kdash.completion import script

    sys.stdout.write(script(opts.shell, spec_of(build_parser())))
    return 0


def print_man(opts: options.ManOptions) -> int:
    """`kdash man`: the man page made from this parser, in roff on stdout."""
    from kdash import __version__
    from kdash.cli_spec import spec_of
    from kdash.manpage import render

    sys.stdout.write(render(spec_of(build_parser()), __version__))
    return 0


@dataclass(frozen=True)
class Command:
    """One command: its options record and the function that runs it with one."""

    options: type
    run: Callable[[Any], int]


def _lazy(module: str, function: str) -> Callable[[Any], int]:
    """`module.function`, imported only when the command runs (so `kdash report` never loads
    what `kdash attach` needs)."""

    def run(opts: Any) -> int:
        return getattr(importlib.import_module(module), function)(opts)

    run.__qualname__ = f"{module}.{function}"
    return run


# The command table: name -> options record and handler. The parser has one subcommand for
# each (a test holds the two together), in the order `kdash` with no command lists them.
COMMANDS: dict[str, Command] = {
    "attach": Command(options.AttachOptions, _lazy("kdash.commands", "cmd_attach")),
    "run": Command(options.RunOptions, _lazy("kdash.commands", "cmd_run")),
    "snapshot": Command(options.SnapshotOptions, _lazy("kdash.snapshot", "cmd_snapshot")),
    "open": Command(options.OpenOptions, _lazy("kdash.commands", "cmd_open")),
    "report": Command(options.ReportOptions, _lazy("kdash.commands", "cmd_report")),
    "export": Command(options.ExportOptions, _lazy("kdash.commands", "cmd_export")),
    "import": Command(options.ImportOptions, _lazy("kdash.kineto", "cmd_import")),
    "demo": Command(options.DemoOptions, _lazy("kdash.commands", "cmd_demo")),
    "completion": Command(options.CompletionOptions, print_completion),
    "man": Command(options.ManOptions, print_man),
}


def parse(argv: list[str]):
    """The options record of a command line (UserError, one line, when it is not one)."""
    args = build_parser().parse_args(argv)
    if args.command is None:
        raise UserError(f"give a command: {', '.join(COMMANDS)}")
    return options.from_namespace(COMMANDS[args.command].options, args, skip=("command",))


def run_command(args: argparse.Namespace) -> int:
    """Run the parsed command line's command with its options record."""
    command = COMMANDS[args.command]
    return command.run(options.from_namespace(command.options, args, skip=("command",)))


if __name__ == "__main__":
    sys.exit(main())
