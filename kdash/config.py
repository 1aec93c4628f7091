"""The config file: `$XDG_CONFIG_HOME/kdash/config.toml` (else `~/.config/kdash/config.toml`).

Holds the theme the user last chose (`t` cycles it and the choice is saved) and the findings'
thresholds. Example::

    theme = "dark"

    [thresholds]
    runq_ms_per_s = 5.0          # run-queue delay of a hot thread, ms waited per s, to flag
    hot_thread_cpu_pct = 50.0    # a thread above this CPU % counts as hot
    migrations_per_s = 20.0      # migrations per s of a hot thread to flag
    low_cpu_freq_ratio = 0.6     # CPU clock below this share of its max while busy
    busy_cpu_pct = 50.0          # a CPU above this busy % counts as under load
    gpu_busy_util_pct = 50.0     # GPU utilisation above this counts as busy
    sm_clock_ratio = 0.8         # SM clock below this share of its max while busy
    min_duration_s = 1.0         # a condition must hold this long before it becomes a finding
    shared_core_ratio = 0.5      # two hot threads on one CPU in this share of polls: flag

An unreadable file is reported once and defaults are used; the dashboard still starts.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from kdash.errors import UserError


@dataclass
class Thresholds:
    """The findings' thresholds (`kdash.analyses.findings`); `[thresholds]` in the config file.

    - runq_ms_per_s: run-queue delay, ms a hot thread waited for a CPU per wall second, above
      which it is flagged (10x this is critical). 5 ms/s = 0.5% of its time spent waiting.
    - hot_thread_cpu_pct: a thread whose CPU demand (on-CPU % plus run-queue wait as %) is at
      least this counts as hot; only hot threads are judged for affinity, delay, migrations.
    - migrations_per_s: CPU migrations per second of a hot thread above which it is flagged.
    - low_cpu_freq_ratio: a busy CPU clocked below this share of its maximum is flagged.
    - busy_cpu_pct: a CPU at or above this busy % counts as under load.
    - gpu_busy_util_pct: a GPU at or above this utilisation counts as busy (throttle and
      SM-clock findings only judge busy samples).
    - sm_clock_ratio: a busy GPU's SM clock below this share of its maximum is flagged.
    - min_duration_s: a condition must hold this long without a break before it becomes a
      finding, so one unlucky poll never raises one.
    - shared_core_ratio: two hot threads on the same CPU (or SMT core) in at least this share
      of the polls where both are hot are flagged as sharing a core.
    """

    runq_ms_per_s: float = 5.0
    hot_thread_cpu_pct: float = 50.0
    migrations_per_s: float = 20.0
    low_cpu_freq_ratio: float = 0.6
    busy_cpu_pct: float = 50.0
    gpu_busy_util_pct: float = 50.0
    sm_clock_ratio: float = 0.8
    min_duration_s: float = 1.0
    shared_core_ratio: float = 0.5


@dataclass
class Config:
    theme: str = "dark"
    thresholds: Thresholds = field(default_factory=Thresholds)
    path: Path | None = None
    warning: str = ""  # set when the file existed but could not be used


def config_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "kdash" / "config.toml"


def load_config(path: Path | None = None) -> Config:
    path = path or config_path()
    cfg = Config(path=path)
    if not path.exists():
        return cfg
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        cfg.warning = f"config {path} ignored: {e}"
        return cfg
    if isinstance(data.get("theme"), str):
        cfg.theme = data["theme"]
    th = data.get("thresholds", {})
    if isinstance(th, dict):
        names = {f.name for f in fields(Thresholds)}
        for k, v in th.items():
            if k in names and isinstance(v, int | float) and not isinstance(v, bool):
                setattr(cfg.thresholds, k, float(v))
            else:
                cfg.warning = f"config {path}: ignored thresholds.{k}"
    return cfg


def _updated_text(old: str | None, cfg: Config) -> str:
    """The file's new text: the user's own file with our values set in it (its comments,
    order, blank lines and unknown keys kept, through tomlkit's round-trip document), or a
    fresh file when there is none or it does not parse."""
    import tomlkit

    doc = None
    if old is not None:
        try:
            doc = tomlkit.parse(old)
        except tomlkit.exceptions.ParseError:
            doc = None  # load_config already said it was ignored; write a clean one
    if doc is None:
        doc = tomlkit.document()
        doc.add("theme", cfg.theme)
        table = tomlkit.table()
        for k, v in asdict(cfg.thresholds).items():
            table.add(k, float(v))
        doc.add("thresholds", table)
        return tomlkit.dumps(doc)
    doc["theme"] = cfg.theme
    th = doc.get("thresholds")
    if not isinstance(th, dict):  # absent, or not a table (load_config ignored it)
        th = tomlkit.table()
        doc["thresholds"] = th
    for k, v in asdict(cfg.thresholds).items():
        # a value the user wrote and we did not change stays as written (1 stays 1, not 1.0)
        if _as_float(th.get(k)) != float(v):
            th[k] = float(v)
    return tomlkit.dumps(doc)


def _as_float(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def save_config(cfg: Config) -> None:
    """Write atomically, keeping what the user wrote in the file (comments included)."""
    path = cfg.path or config_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            old = path.read_text()
        except (FileNotFoundError, UnicodeDecodeError):
            old = None
        text = _updated_text(old, cfg)
        tmp = path.with_suffix(".toml.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        raise UserError(f"cannot write config {path}: {e.strerror or e}") from None
