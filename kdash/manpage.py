"""kdash(1), in roff, generated from kdash's argument parser.

`kdash man` prints it: a pip-installed tool has no place of its own in MANPATH, so the user
saves it where `man` looks (the README gives the two commands), or reads it at once with
`kdash man | man -l -`. Every command and option comes from the parser (`kdash.cli_spec`); the
sections around them (exit status, environment, files) are written here.
"""

from __future__ import annotations

import datetime as dt

from kdash.cli_spec import Command, Option, Spec

# Variables kdash reads, and what for.
ENVIRONMENT = (
    ("KDASH_DEBUG", "set to 1: a bug in kdash prints its traceback instead of one line"),
    ("KDASH_SGLANG_API_KEY", "default of --api-key"),
    ("KDASH_SGLANG_ADMIN_API_KEY", "default of --admin-api-key"),
    ("KDASH_RUN_LOG", "where `kdash run` writes the command's output (default kdash-run-PID.log)"),
    ("KDASH_LIBCUPTI", "the libcupti to read cubins' line tables with"),
    ("KDASH_NVDISASM", "the nvdisasm to read cubins' line tables with"),
    ("NO_COLOR", "set: no colours, the mono theme by default"),
    ("TEXTUAL_FPS", "the highest frame rate the terminal is sent (slow links: 2)"),
)

EXIT_STATUS = (
    ("0", "success"),
    ("2", "bad input: one line on standard error saying what, no traceback"),
    ("1", "a bug in kdash: one line (KDASH_DEBUG=1 shows the traceback)"),
    ("130", "interrupted"),
)


def esc(text: str) -> str:
    """Text safe in a roff line: backslashes and hyphens escaped, no leading control dot."""
    out = text.replace("\\", "\\e").replace("-", "\\-")
    if out.startswith((".", "'")):
        out = "\\&" + out
    return out


def render(spec: Spec, version: str, date: dt.date | None = None) -> str:
    day = (date or dt.date.today()).isoformat()
    name = spec.prog
    lines = [
        f'.TH {name.upper()} 1 "{day}" "{name} {esc(version)}" "User Commands"',
        ".SH NAME",
        f"{name} \\- {esc(spec.description)}",
        ".SH SYNOPSIS",
    ]
    for c in spec.commands:
        rest = c.usage.removeprefix(f"{name} {c.name}").strip()
        lines += [".PP", f"\\fB{name} {c.name}\\fR {esc(rest)}"]
    lines += [".SH DESCRIPTION", esc(spec.description)]
    lines += [".SH OPTIONS"]
    for o in spec.options:
        lines += _option(o)
    lines.append(".SH COMMANDS")
    for c in spec.commands:
        lines += _command(name, c)
    lines.append(".SH EXIT STATUS")
    for code, what in EXIT_STATUS:
        lines += [".TP", f".B {code}", esc(what)]
    lines.append(".SH ENVIRONMENT")
    for var, what in ENVIRONMENT:
        lines += [".TP", f".B {var}", esc(what)]
    lines += [
        ".SH FILES",
        ".TP",
        ".I ~/.config/kdash/config.toml",
        esc("theme and thresholds of the findings ($XDG_CONFIG_HOME/kdash/config.toml)"),
        ".SH SEE ALSO",
        esc(f"{name} completion bash|zsh|fish, for the shell's completion script."),
        "",
    ]
    return "\n".join(lines)


def _command(prog: str, c: Command) -> list[str]:
    out = [f".SS {prog} {c.name}", esc(c.description or c.help)]
    if c.positionals:
        for p in c.positionals:
            out += [".TP", f".I {esc(p.metavar or p.dest)}", esc(p.help or "")]
    for o in c.options:
        out += _option(o)
    return out


def _option(o: Option) -> list[str]:
    flags = ", ".join(f"\\fB{esc(f)}\\fR" for f in o.flags)
    if o.takes_value:
        flags += f" \\fI{esc(o.metavar or '')}\\fR"
    what = o.help
    if o.choices:
        what = (what + " " if what else "") + f"(one of: {', '.join(o.choices)})"
    return [".TP", flags, esc(what or "")]
