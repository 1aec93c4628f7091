"""Each command's options as a typed record, with its defaults written here and nowhere else.

`kdash.cli` builds the parser from these: every option's default is the field's default (set
on the parser from `defaults()`), and a parsed command line becomes one of these records
(`from_namespace`), which the commands read as typed fields. Code that runs a command itself
(`kdash demo` runs `kdash run`, `kdash snapshot` records as `attach --headless` does) builds
the record too, so an option added here reaches it with its default.

Values are checked by the parser (one-line errors), not here: a record built in code is
trusted to hold what its types say.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

ENV_API_KEY = "KDASH_SGLANG_API_KEY"
ENV_ADMIN_API_KEY = "KDASH_SGLANG_ADMIN_API_KEY"


def _env(name: str):
    """A default read from the environment when the record is made (as the parser does)."""
    return field(default_factory=lambda: os.environ.get(name))


@dataclass(frozen=True)
class LiveOptions:
    """What `attach` and `run` share: polling, the capture window, the agents, headless mode."""

    interval: float = 0.25  # seconds between host polls
    pre: float = 10.0  # seconds before the capture key that `c` keeps
    post: float = 5.0  # seconds after the capture key that `c` records
    capture_dir: Path | None = None  # where `c` saves (None: the current folder)
    theme: str | None = None  # None: the saved one, or mono under NO_COLOR
    gpus: list[int] | None = None  # None: every GPU
    pc_sampling: bool = False
    graph_kernels: bool = False
    cost_budget: float | None = None  # percent; None: the agents' own default
    headless: bool = False
    prometheus: str | None = None  # [HOST:]PORT
    jsonl: str | None = None  # a path, or "-" for stdout
    duration: float | None = None  # seconds, with --headless
    output: Path | None = None  # the capture --headless writes

    @property
    def exporting(self) -> bool:
        """--prometheus or --jsonl asked for."""
        return bool(self.prometheus or self.jsonl)


@dataclass(frozen=True)
class AttachOptions(LiveOptions):
    pid: int | None = None
    sglang: str | None = None  # the server's URL
    api_key: str | None = _env(ENV_API_KEY)
    admin_api_key: str | None = _env(ENV_ADMIN_API_KEY)
    no_inject: bool = False


@dataclass(frozen=True)
class RunOptions(LiveOptions):
    cmd: list[str] = field(default_factory=list)  # may start with "--"


@dataclass(frozen=True)
class OpenOptions:
    path: Path
    theme: str | None = None


@dataclass(frozen=True)
class ReportOptions:
    path: Path
    json: bool = False
    top: int | None = None  # None: kdash.report's DEFAULT_TOP
    width: int | None = None  # None: the terminal's, else $COLUMNS, else a wide page


@dataclass(frozen=True)
class SnapshotOptions:
    pid: int | None = None
    sglang: str | None = None
    api_key: str | None = _env(ENV_API_KEY)
    seconds: float = 2.0
    json: bool = False
    top: int | None = None
    gpus: list[int] | None = None
    interval: float = 0.25
    inject: bool = False


@dataclass(frozen=True)
class ExportOptions:
    path: Path
    perfetto: Path
    force: bool = False


@dataclass(frozen=True)
class ImportOptions:
    traces: list[Path]
    output: Path | None = None  # None: beside the first trace


@dataclass(frozen=True)
class DemoOptions:
    theme: str | None = None
    replay: bool = False
    headless: bool = False
    eager_decode: bool = False
    duration: float | None = None
    output: Path | None = None


@dataclass(frozen=True)
class CompletionOptions:
    shell: str


@dataclass(frozen=True)
class ManOptions:
    pass


T = TypeVar("T")


def defaults(cls: type) -> dict[str, Any]:
    """The default of every field of `cls` that has one (factories called now)."""
    out: dict[str, Any] = {}
    for f in fields(cls):
        if f.default is not MISSING:
            out[f.name] = f.default
        elif f.default_factory is not MISSING:
            out[f.name] = f.default_factory()
    return out


def from_namespace(cls: type[T], ns: argparse.Namespace, skip: tuple[str, ...] = ()) -> T:
    """The record `cls` of a parsed command line. Every value the parser gave must be a field:
    a parser option without a field here is kdash's bug, and said so at once."""
    given = {k: v for k, v in vars(ns).items() if k not in skip}
    unknown = sorted(set(given) - {f.name for f in fields(cls)})
    if unknown:
        raise TypeError(f"{cls.__name__} has no field for the parsed option(s) {unknown}")
    return cls(**given)
