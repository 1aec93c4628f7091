"""The `kdash` argument parser as plain data, for the shell completions and the man page.

Both are generated from the parser that `kdash.cli.build_parser` builds, so a new command or
option appears in them without a second list to keep (the tests hold them to the parser).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Option:
    flags: tuple[str, ...]  # ("-o", "--output"); empty for a positional
    dest: str
    help: str
    metavar: str | None  # None: a switch that takes no value
    choices: tuple[str, ...] = ()
    is_path: bool = False  # its value names a file or folder (complete file names)
    repeat: bool = False  # a positional taking several values, or the rest of the line

    @property
    def takes_value(self) -> bool:
        return self.metavar is not None


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    usage: str
    description: str
    options: tuple[Option, ...]
    positionals: tuple[Option, ...] = ()


@dataclass(frozen=True)
class Spec:
    prog: str
    description: str
    options: tuple[Option, ...]  # the top-level ones (--help, --version)
    commands: tuple[Command, ...] = field(default_factory=tuple)

    def command(self, name: str) -> Command:
        return next(c for c in self.commands if c.name == name)


def spec_of(parser: argparse.ArgumentParser) -> Spec:
    """The commands and options of `parser` (one level of subcommands, as kdash has)."""
    options, _, sub = _split(parser)
    commands = []
    if sub is not None:
        helps = {a.dest: _help(parser, a) for a in sub._choices_actions}
        for name, sp in sub.choices.items():
            opts, pos, _ = _split(sp)
            commands.append(
                Command(
                    name=name,
                    help=helps.get(name, ""),
                    usage=_usage(sp),
                    description=sp.description or helps.get(name, ""),
                    options=tuple(opts),
                    positionals=tuple(pos),
                )
            )
    return Spec(
        prog=parser.prog,
        description=parser.description or "",
        options=tuple(options),
        commands=tuple(commands),
    )


def _split(p: argparse.ArgumentParser):
    opts: list[Option] = []
    pos: list[Option] = []
    sub = None
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            sub = a
            continue
        if a.help == argparse.SUPPRESS:
            continue
        takes = a.nargs != 0 and not isinstance(
            a, argparse._StoreConstAction | argparse._CountAction | argparse._HelpAction
        )
        takes = takes and not isinstance(a, argparse._VersionAction)
        metavar = None
        if takes:
            mv = a.metavar if a.metavar is not None else a.dest.upper()
            metavar = " ".join(mv) if isinstance(mv, tuple) else str(mv)
        o = Option(
            flags=tuple(a.option_strings),
            dest=a.dest,
            help=_help(p, a),
            metavar=metavar,
            choices=tuple(str(c) for c in a.choices) if a.choices else (),
            is_path=a.type is Path,
            repeat=a.nargs in ("+", "*", argparse.REMAINDER),
        )
        (opts if a.option_strings else pos).append(o)
    return opts, pos, sub


def _help(p: argparse.ArgumentParser, a: argparse.Action) -> str:
    if not a.help:
        return ""
    # argparse's own expansion of %(default)s and %% in help strings
    return " ".join(p._get_formatter()._expand_help(a).split())


def _usage(p: argparse.ArgumentParser) -> str:
    text = p.format_usage().strip()
    return " ".join(text.removeprefix("usage:").split())
