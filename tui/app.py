"""The kdash dashboard: four panes over the store, a status bar, hotkey captures, replay.

Construction (the CLI does this; tests do it too)::

    app = KdashApp(store, recorder, meta, mode="live", config=cfg, theme="dark")
    app.run()

- live: `recorder.run_forever` runs in a Textual thread worker (`@work(thread=True)`), so
  polling never blocks the UI; the recorder's events (`on_event`, called on the poll thread) are
  turned into typed `Message`s and posted to the app (`post_message` is thread-safe). Quitting
  stops the recorder before the worker's thread is joined at exit.
- replay: the store is pre-filled from a capture, `recorder` is None, the time axis is anchored
  at the capture's window (`meta["window"]`), and the title says "replay".

Redraw: a timer at `redraw_hz` (1 Hz by default: a slow SSH link carries it, and each
redraw of the tables is most of kdash's own CPU) rebuilds the
status bar and, unless paused, the visible panes; a replay redraws panes only when the view
changed (pan, zoom, theme, layout). Nothing is drawn on the poll thread, and panes hidden by a
maximised pane are not drawn at all.

Themes (item 9): a kdash theme NAME is two things, both chosen here:

1. a Textual `Theme` registered as `kdash-NAME`: the palette every stock widget (header, tables,
   scrollbars) takes its `$variables` from, and
2. `themes/NAME.tcss` (package data of `kdash.themes`): kdash's own semantic colours (finding
   severities, sparklines, the throttle band, the status bar), every rule scoped under the App
   class `.theme-NAME`.

All theme files are loaded at start; switching (`t`, or `--theme`) swaps the App class and the
Textual theme, so no stylesheet is re-parsed. `mono` is the no-colour theme (ANSI default
colours, emphasis by bold/reverse/underline only); it is the default under `NO_COLOR`, and
Textual's own NO_COLOR filter strips any colour left. A theme is listed when both its `.tcss`
file and its palette exist; `resolve_theme` checks a name for the CLI before the app starts.
"""

from __future__ import annotations

import os
import time
from importlib import resources
from pathlib import Path

from kdash.collectors.base import Health, as_health
from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.notifications import SeverityLevel
from textual.theme import Theme
from textual.timer import Timer
from textual.widgets import Header
from textual.worker import Worker, WorkerState

from kdash import clock, schema
from kdash.config import Config, save_config
from kdash.errors import UserError
from kdash.session import CaptureState, Recorder, capture_healths, source_healths
from kdash.store import Store

from .panes.base import Pane, View
from .panes.clocks import ClockPane
from .panes.cpu import CpuPane
from .panes.kernels import KernelPane
from .panes.server import ServerPane
from .panes.source import SourcePane
from .widgets.fit import fit_words
from .widgets.help import HelpScreen
from .widgets.status import StatusBar, StatusInfo

# -- themes -----------------------------------------------------------------------------------
THEME_ORDER = ("dark", "light", "mono")

PALETTES: dict[str, Theme] = {
    "dark": Theme(
        name="kdash-dark",
        primary="#5fafff",
        secondary="#87afaf",
        accent="#ffaf5f",
        warning="#ffd75f",
        error="#ff5f5f",
        success="#87d787",
        foreground="#d0d0d0",
        background="#121212",
        surface="#1c1c1c",
        panel="#262626",
        dark=True,
    ),
    "light": Theme(
        name="kdash-light",
        primary="#005faf",
        secondary="#5f8787",
        accent="#af5f00",
        warning="#af8700",
        error="#d70000",
        success="#008700",
        foreground="#1c1c1c",
        background="#f5f5f5",
        surface="#eeeeee",
        panel="#e4e4e4",
        dark=False,
    ),
    "mono": Theme(
        name="kdash-mono",
        primary="ansi_default",
        secondary="ansi_default",
        accent="ansi_default",
        warning="ansi_default",
        error="ansi_default",
        success="ansi_default",
        foreground="ansi_default",
        background="ansi_default",
        surface="ansi_default",
        panel="ansi_default",
        boost="ansi_default",
        dark=True,
        ansi=True,
        variables={
            "ansi-background": "ansi_default",
            "ansi-foreground": "ansi_default",
            "border": "ansi_default",
            "border-blurred": "ansi_default",
            "block-cursor-foreground": "ansi_default",
            "block-cursor-background": "ansi_default",
            "block-cursor-text-style": "reverse",
            "block-cursor-blurred-text-style": "underline",
            "scrollbar": "ansi_default",
            "scrollbar-hover": "ansi_default",
            "scrollbar-active": "ansi_default",
            "scrollbar-background": "ansi_default",
            "scrollbar-background-hover": "ansi_default",
            "scrollbar-background-active": "ansi_default",
            "scrollbar-corner-color": "ansi_default",
            "footer-key-foreground": "ansi_default",
            "screen-selection-background": "ansi_default",
            "screen-selection-foreground": "ansi_default",
        },
    ),
}


def _theme_dir() -> Path:
    return Path(str(resources.files("kdash.themes")))


def available_themes() -> list[str]:
    """Theme names that have both a `.tcss` file and a palette, in cycling order."""
    files = {p.stem for p in _theme_dir().glob("*.tcss")}
    names = [n for n in THEME_ORDER if n in files and n in PALETTES]
    names += sorted((files & set(PALETTES)) - set(names))
    return names


def resolve_theme(name: str) -> str:
    """Check a theme name (from `--theme` or the config file); return it normalised.

    Raises `UserError("unknown theme X (have: dark, light, mono)")` so the CLI can say so in
    one line before the app starts.
    """
    have = available_themes()
    key = (name or "").strip().lower()
    if key not in have:
        raise UserError(f"unknown theme {name} (have: {', '.join(have)})")
    return key


def default_theme(config: Config) -> str:
    """`NO_COLOR` wins over the saved choice; an unusable saved name falls back to dark."""
    if os.environ.get("NO_COLOR"):
        return "mono"
    try:
        return resolve_theme(config.theme)
    except UserError:
        return "dark"


# -- recorder events as messages ------------------------------------------------------------
class RecorderMessage(Message):
    """Base of the recorder's events; posted from the poll thread, handled on the UI thread."""


class CaptureStarted(RecorderMessage):
    def __init__(self, state: CaptureState) -> None:
        super().__init__()
        self.state = state


class CaptureSaved(RecorderMessage):
    def __init__(self, state: CaptureState) -> None:
        super().__init__()
        self.state = state


class CaptureFailed(RecorderMessage):
    def __init__(self, state: CaptureState) -> None:
        super().__init__()
        self.state = state


class TargetExited(RecorderMessage):
    def __init__(self, pid: object) -> None:
        super().__init__()
        self.pid = pid


EVENT_MESSAGES: dict[str, type[RecorderMessage]] = {
    "capture-started": CaptureStarted,
    "capture-saved": CaptureSaved,
    "capture-failed": CaptureFailed,
    "target-exited": TargetExited,
}

# -- the app ----------------------------------------------------------------------------------
LIVE_WINDOW_S = 60.0
MIN_WINDOW_S = 1.0
COMPACT_WIDTH = 110  # below this many columns (or COMPACT_HEIGHT rows) the panes stack
COMPACT_HEIGHT = 30
REPLAY_NOTE_S = 10.0  # how long a replay's bar answers `c` (its toast: Textual's default 5 s)
REPLAY_WITHIN = 24  # a replay's title says "replay" within its first this many characters
# Textual's Toast: 60 cells wide at most and half the screen, 2 of padding, a 1-cell border.
TOAST_WIDTH, TOAST_FRAME = 60, 3


def toast_text_width(screen_width: int) -> int:
    """The cells a toast's text has on a screen this wide (its CSS: width 60; max-width 50%)."""
    return max(1, min(TOAST_WIDTH, screen_width // 2) - TOAST_FRAME)


def short_cmdline(cmd: str, width: int = 32) -> str:
    parts = cmd.split()
    if not parts:
        return ""
    parts[0] = os.path.basename(parts[0])
    s = " ".join(parts)
    return s if len(s) <= width else s[: width - 1] + "…"


def activity_label(agent_health: Health | str) -> str:
    """ "sampled" or "continuous" from the agent source's health (codes "sampling",
    "continuous"); "" when no agent records (the status bar then says nothing of activity or
    cost: there is none)."""
    code = as_health(agent_health, "agent").code
    return {"continuous": "continuous", "sampling": "sampled"}.get(code, "")


class KdashApp(App[None]):
    """The dashboard. See the module docstring for live vs replay, redraw and themes."""

    CSS_PATH = [Path(__file__).with_name("app.tcss")] + [
        _theme_dir() / f"{n}.tcss" for n in available_themes()
    ]
    ENABLE_COMMAND_PALETTE = False
    BINDINGS = [
        Binding("c", "capture", "capture: the --pre s before and --post s after"),
        Binding("p", "pause", "pause / resume the view (collection goes on)"),
        Binding("t", "next_theme", "next theme (saved to the config file)"),
        Binding("tab", "cycle_pane(1)", "focus: next pane", priority=True),
        Binding("shift+tab", "cycle_pane(-1)", "focus: previous pane", priority=True),
        Binding("1", "maximize('kernels')", "maximise a pane: kernels"),
        Binding("2", "maximize('clocks')", "maximise a pane: clocks & thermal"),
        Binding("3", "maximize('cpu')", "maximise a pane: CPU affinity"),
        Binding("4", "maximize('source')", "maximise a pane: source"),
        Binding("escape", "restore", "restore the layout (all panes)"),
        Binding("left", "pan(-1)", "pan the time window: earlier", priority=True),
        Binding("right", "pan(1)", "pan the time window: later", priority=True),
        Binding("plus,equals_sign", "zoom(0.5)", "zoom: in (halve the window)"),
        Binding("minus", "zoom(2)", "zoom: out (double the window)"),
        Binding("r", "reset_window", "reset the window (follow live / whole capture)"),
        Binding("g", "gpu_detail", "clocks pane: all GPUs dense (when many) / full detail"),
        Binding("f", "pin_kernel", "source pane: pin the table's kernel / follow"),
        Binding("question_mark", "help", "this help"),
        Binding("q", "quit", "quit"),
        # Over SSH people press ctrl+c to leave a monitor (top, nvitop); Textual would copy.
        Binding("ctrl+c", "quit", "quit", priority=True),
    ]
    PANE_IDS = ("kernels", "clocks", "cpu", "source")
    # Only for an SGLang target (meta has "sglang"): a fifth pane, its key, and `C`.
    SGLANG_BINDINGS = [
        Binding("5", "maximize('server')", "maximise a pane: SGLang server"),
        Binding("C", "capture_via_server", "capture through the server's profiler (agents off)"),
    ]

    # Bound in every mode (in a replay it says there is no agent) but listed in the help only
    # live, where it acts: the replay help then still fits an 80x24 terminal.
    LIVE_BINDINGS = [
        Binding("a", "toggle_activity", "kernel activity: duty-cycled / continuous (costs more)"),
        Binding("L", "toggle_pc_sampling", "source pane: PC sampling (line samples) on / off"),
    ]

    def __init__(
        self,
        store: Store,
        recorder: Recorder | None,
        meta: dict,
        mode: str,
        config: Config,
        theme: str | None = None,
        redraw_hz: float = 1.0,
        title: str | None = None,
    ) -> None:
        # Under NO_COLOR, native ANSI colours make Textual strip colour with its NoColor filter
        # (terminal default colours: readable); its Monochrome filter, chosen otherwise, maps
        # the mono theme's "default" colours to black on black.
        super().__init__(ansi_color=True if os.environ.get("NO_COLOR") else None)
        if mode not in ("live", "replay"):
            raise ValueError(f"mode must be 'live' or 'replay', not {mode!r}")
        if mode == "live" and recorder is None:
            raise ValueError("live mode needs a recorder")
        self.store = store
        self.recorder = recorder
        self.meta = dict(meta or {})
        self.mode = mode
        self.config = config
        self.redraw_hz = max(0.1, float(redraw_hz))
        self.kd_theme = resolve_theme(theme) if theme else default_theme(config)
        for palette in PALETTES.values():
            self.register_theme(palette)
        self.theme = PALETTES[self.kd_theme].name
        self.add_class(f"theme-{self.kd_theme}")
        # Colour stripped whatever the theme: app.tcss marks the cursor and the bar by reverse.
        self.set_class(bool(os.environ.get("NO_COLOR")), "-no-color")
        self._title_arg = title
        # An SGLang server gets the server pane (a fifth pane, key 5); any other target keeps
        # the four-pane layout exactly as it was.
        self.sglang = "sglang" in self.meta
        if self.sglang:
            self.PANE_IDS = (*type(self).PANE_IDS, "server")
            for b in self.SGLANG_BINDINGS:
                self.bind(b.key, b.action, description=b.description)
        for b in self.LIVE_BINDINGS:
            self.bind(b.key, b.action, description=b.description)
        self.paused = False
        self._frozen_ns: int | None = None  # "now" of the view while paused (live)
        self.maximized: str | None = None
        self.compact = False
        self._dirty = True
        self._redraw_pending = False
        self.redraws = 0  # pane redraws done (tests and the perf check read it)
        self.last_redraw_ms = 0.0
        self.note = ""
        self._capture_note = ""
        self._capture_note_timer: Timer | None = None
        # Window: `window_s` long, ending `offset_s` before the anchor end.
        self.data_start_ns, self.data_end_ns = self._data_range()
        full = (self.data_end_ns - self.data_start_ns) / 1e9
        self.window_s = max(MIN_WINDOW_S, full) if mode == "replay" else LIVE_WINDOW_S
        self.offset_s = 0.0
        if recorder is not None:
            previous = recorder.on_event

            def on_event(event: str, payload: object) -> None:
                self._on_recorder_event(event, payload)
                if previous is not None:
                    previous(event, payload)

            recorder.on_event = on_event

    # -- layout -------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Header(show_clock=False, icon="≡")
        with Horizontal(id="body"):
            with Vertical(id="left", classes="column"):
                yield KernelPane(id="kernels")
                yield ClockPane(id="clocks")
            with Vertical(id="right", classes="column"):
                if self.sglang:
                    yield ServerPane(id="server")
                yield CpuPane(id="cpu")
                yield SourcePane(id="source")
        yield StatusBar(id="status")

    def main_query(self, selector):
        """Query the dashboard's own screen, also while the help screen is on top (`query`
        searches the active screen only)."""
        stack = self.screen_stack
        return stack[0].query(selector) if stack else self.query(selector)

    @property
    def panes(self) -> list[Pane]:
        """The mounted panes in key order (none before compose or after shutdown)."""
        found = {p.id: p for p in self.main_query(Pane)}
        return [found[i] for i in self.PANE_IDS if i in found]

    def on_mount(self) -> None:
        self.title, self.sub_title = self._titles()
        self._apply_layout(self.size.width, self.size.height)
        if self.mode == "live":
            self._run_recorder()
        self._update_status()
        self.call_after_refresh(self._first_draw)
        if self.config.warning:
            self.notify(self.config.warning, severity="warning")

    def _first_draw(self) -> None:
        # The timer starts here, after the first layout: a tick must never find the panes or
        # the status bar not yet mounted (seen on a loaded machine when started in on_mount).
        self.set_interval(1.0 / self.redraw_hz, self._tick, name="redraw")
        self._redraw(force=True)
        self._update_status()
        for pane in self.main_query("#cpu").results(Pane):
            pane.focus_target().focus()

    def on_resize(self, event) -> None:
        self._apply_layout(event.size.width, event.size.height)
        self.request_redraw()

    def request_redraw(self, now: bool = False) -> None:
        """Redraw once after the pending layout settles (resizes, pan, zoom, theme, layout).

        Coalesced: a burst of requests in one refresh (a held `+` over a slow SSH link, many
        resize events) costs one redraw. Live and running, a resize only marks the view dirty
        and the next timer tick draws it, so redraws stay within `redraw_hz`; a user's view
        change (`now`) is drawn at once so the key feels immediate.
        """
        self._dirty = True
        if self.mode == "live" and not self.paused and not now:
            return  # the next tick redraws: live redraws stay within redraw_hz
        if not self._redraw_pending:
            self._redraw_pending = True
            self.call_after_refresh(self._pending_redraw)

    def _pending_redraw(self) -> None:
        self._redraw_pending = False
        self._redraw(force=True)

    def _apply_layout(self, width: int, height: int) -> None:
        """Compact (stacked) below COMPACT_WIDTH x COMPACT_HEIGHT, else two columns."""
        self.compact = width < COMPACT_WIDTH or height < COMPACT_HEIGHT
        self.set_class(self.compact, "-compact")
        self.set_class(self.maximized is not None, "-maximized")
        for pane in self.panes:
            pane.set_class(pane.id == self.maximized, "-max")
        for col in self.main_query(".column"):
            col.set_class(
                any(p.id == self.maximized for p in col.query(Pane)),
                "-has-max",
            )
        self._update_columns()

    def _update_columns(self) -> None:
        """A column whose panes all have nothing to show collapses to their one-liners."""
        any_empty = False
        for col in self.main_query(".column"):
            empty = all(p.has_class("-empty") for p in col.query(Pane))
            col.set_class(empty, "-all-empty")
            any_empty = any_empty or empty
        # Two columns only pay off when both have something to show; else stack them, so the
        # one-liners sit on top and the panes with data get the full width.
        self.set_class(self.compact or any_empty, "-stacked")

    def _titles(self) -> tuple[str, str]:
        target = self.meta.get("target") or {}
        cmd = short_cmdline(str(target.get("cmdline") or ""))
        if self.mode == "live":
            title = self._title_arg or self.meta.get("title") or "kdash"
            return title, f"live · pid {target.get('pid', '?')} {cmd}".rstrip()
        title = self._title_arg or self.meta.get("title") or ""
        # "replay" near the start: a narrow header cuts a long title at its end.
        at = title.lower().find("replay")
        if at < 0 or at > REPLAY_WITHIN:
            title = f"kdash replay — {title}" if title else "kdash replay"
        bits = []
        if self.meta.get("capture_path"):
            bits.append(Path(str(self.meta["capture_path"])).name)
        host = target.get("host") or (self.meta.get("host") or {}).get("hostname")
        what = cmd or (f"pid {target.get('pid')}" if target.get("pid") else "")
        if what:
            bits.append(f"{what} on {host}" if host else what)
        created = self.meta.get("created_wall_ns")
        if isinstance(created, int):
            bits.append(time.strftime("recorded %Y-%m-%d %H:%M UTC", time.gmtime(created / 1e9)))
        return title, " · ".join(bits)

    # -- time window --------------------------------------------------------------------------
    def _data_range(self) -> tuple[int, int]:
        """Replay: the capture's window (else the data's span). Live: the store's retention."""
        win = self.meta.get("window") or {}
        if self.mode == "replay":
            start, end = win.get("start_ns"), win.get("end_ns")
            if isinstance(start, int) and isinstance(end, int) and end > start:
                return start, end
            lo, hi = None, 0
            for t in schema.TABLES:
                b = self.store.get(t)
                col = b[schema.TIME_COLUMN[t]]
                if len(col):
                    lo = int(col.min()) if lo is None else min(lo, int(col.min()))
                    hi = max(hi, int(col.max()))
            if lo is None:
                now = clock.now_ns()
                return now - int(1e9), now
            return lo, max(hi, lo + int(1e9))
        return 0, 0

    def _anchor_end_ns(self) -> int:
        if self.mode == "replay":
            return self.data_end_ns
        if self.paused and self._frozen_ns is not None:
            return self._frozen_ns
        return clock.now_ns()

    def _max_window_s(self) -> float:
        if self.mode == "replay":
            return max(MIN_WINDOW_S, (self.data_end_ns - self.data_start_ns) / 1e9)
        return max(MIN_WINDOW_S, self.store.retention_ns / 1e9)

    def view_range(self) -> tuple[int, int]:
        end = self._anchor_end_ns() - int(self.offset_s * 1e9)
        start = end - int(self.window_s * 1e9)
        return start, end

    def build_view(self) -> View:
        since, until = self.view_range()
        anchor = self.data_start_ns if self.mode == "replay" else self._anchor_end_ns()
        if self.recorder is not None:
            healths = source_healths(self.recorder.sources)
            findings = self.recorder.findings
            gpus = list(self.meta.get("gpus") or [])
        else:
            healths = capture_healths(self.meta)
            findings = None
            gpus = list(self.meta.get("gpus") or [])
        sglang = self.meta.get("sglang") if self.sglang else None
        describe = getattr(self.recorder, "sglang_meta", None)
        if self.sglang and describe is not None:
            sglang = describe()  # live: GPU mapping refreshed from NVML's process list
        return View(
            store=self.store,
            since_ns=since,
            until_ns=until,
            mode=self.mode,
            anchor_ns=anchor,
            health={k: str(h) for k, h in healths.items()},
            healths=healths,
            findings=findings,
            gpus=gpus,
            sglang=sglang,
        )

    def window_label(self) -> str:
        since, until = self.view_range()
        if self.mode == "replay":
            full = (self.data_end_ns - self.data_start_ns) / 1e9
            a = (since - self.data_start_ns) / 1e9
            b = (until - self.data_start_ns) / 1e9
            return f"t {a:.1f}–{b:.1f} s of {full:.1f} s"
        label = f"window {self.window_s:g} s"
        if self.offset_s:
            label += f", ending {self.offset_s:g} s ago"
        return label

    # -- redraw -------------------------------------------------------------------------------
    def _tick(self) -> None:
        self._update_status()
        if self.paused:
            return
        if self.mode == "replay" and not self._dirty:
            return
        self._redraw()

    def _visible_panes(self) -> list[Pane]:
        if self.maximized is not None:
            return [p for p in self.panes if p.id == self.maximized]
        return self.panes

    def _redraw(self, force: bool = False) -> None:
        """Draw the visible panes for the current view (skipped under a modal screen)."""
        if not force and len(self.screen_stack) > 1:
            return
        t0 = time.perf_counter()
        view = self.build_view()
        for pane in self._visible_panes():
            pane.show(view)
        self._update_columns()
        self._dirty = False
        self.redraws += 1
        self.last_redraw_ms = (time.perf_counter() - t0) * 1e3

    def _view_changed(self) -> None:
        """Pan/zoom/layout/theme: redraw (coalesced), also while paused: frozen, not dead."""
        self.request_redraw(now=True)
        self._update_status()

    def _update_status(self) -> None:
        # query(), not query_one(): during start-up and shutdown there may be no bar to update.
        for bar in self.main_query(StatusBar):
            bar.show(self.status_info())

    def status_info(self) -> StatusInfo:
        target = self.meta.get("target") or {}
        rec = self.recorder
        if rec is not None and rec.target is not None:
            tgt = f"pid {rec.target.pid} {short_cmdline(' '.join(rec.target.cmdline))}"
        else:
            tgt = f"pid {target.get('pid', '?')} {short_cmdline(str(target.get('cmdline') or ''))}"
        info = StatusInfo(
            mode=self.mode,
            target=tgt.rstrip(),
            paused=self.paused,
            window=self.window_label(),
            note=self.note,
        )
        if rec is not None:
            cap = rec.capture
            info.capture_phase = cap.phase
            if cap.phase == "recording":
                info.capture = f"capturing… {cap.remaining_s(clock.now_ns()):.1f} s"
            elif cap.phase == "writing":
                info.capture = "writing capture…"
            detail = getattr(rec, "capture_detail", None)
            extra = detail() if detail is not None else ""
            if cap.phase == "saved":
                info.capture_path = str(cap.path)
            if extra and cap.phase == "saved":  # e.g. the DP ranks that had no step
                info.capture = f"saved: {cap.path} ({extra})"
            elif extra:
                info.capture = f"{info.capture} ({extra})"
            elif cap.phase == "saved":
                info.capture = f"saved: {cap.path}"
            elif cap.phase == "failed":
                info.capture = f"capture failed: {cap.error}"
            info.sources = {s.name: s.health for s in rec.sources}
            info.poll_ms = rec.poll_cost_ms
            agent = self.agent_source()
            if agent is not None:
                info.activity = activity_label(agent.health)
                estimate = getattr(agent, "cost_estimate", None)
                info.cost = estimate() if estimate is not None and info.activity else None
            info.dropped = self.store.overflowed()
        else:
            info.sources = dict(capture_healths(self.meta))
            info.dropped = int(self.meta.get("overflowed_rows") or 0)
            info.capture = self._capture_note
        return info

    # -- recorder worker and its events -------------------------------------------------------
    @work(thread=True, exit_on_error=False, name="recorder", group="recorder")
    def _run_recorder(self) -> None:
        assert self.recorder is not None
        self.recorder.run_forever()

    def _on_recorder_event(self, event: str, payload: object) -> None:
        """Called on the poll thread: only turn the event into a message for the UI thread."""
        cls = EVENT_MESSAGES.get(event)
        if cls is not None:
            self.post_message(cls(payload))  # type: ignore[arg-type]

    def on_capture_started(self, message: CaptureStarted) -> None:
        self._update_status()

    def on_capture_saved(self, message: CaptureSaved) -> None:
        self._update_status()
        self.notify(f"capture saved: {message.state.path}", title="kdash", timeout=6)

    def notify(
        self,
        message: str,
        *,
        title: str = "",
        severity: SeverityLevel = "information",
        timeout: float | None = None,
        markup: bool = False,
    ) -> None:
        """A toast whose words each fit its width, so it wraps only between words: a long
        path keeps its end (`…/captures/run-1201.kdash`), never split mid-name. Plain text by
        default: kdash's messages hold paths and errors, never markup (a `[` in one is text)."""
        width = toast_text_width(self.size.width)
        super().notify(
            fit_words(str(message), width),
            title=title,
            severity=severity,
            timeout=timeout,
            markup=markup,
        )

    def on_capture_failed(self, message: CaptureFailed) -> None:
        self._update_status()
        self.notify(f"capture failed: {message.state.error}", severity="error", timeout=10)

    def on_target_exited(self, message: TargetExited) -> None:
        self.note = f"target {message.pid} exited"
        self._update_status()
        self.notify(
            f"pid {message.pid} exited; the view keeps what was collected (c still captures it)",
            severity="warning",
        )

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        if event.worker.name == "recorder" and event.state == WorkerState.ERROR:
            self.note = f"recorder stopped: {event.worker.error}"
            self._update_status()
            self.notify(self.note, severity="error", timeout=15)

    def _stop_recorder(self) -> None:
        if self.recorder is not None:
            self.recorder.stop()

    def on_unmount(self) -> None:
        self._stop_recorder()

    # -- actions ------------------------------------------------------------------------------
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """While the help is open only help and quit act (tab, ← and → are priority keys).
        ← and → scroll a focused table that has columns out of view instead of panning."""
        if action == "pan" and getattr(self.focused, "takes_sideways_keys", lambda: False)():
            return False
        return action in ("help", "quit") or not isinstance(self.screen, HelpScreen)

    def action_capture(self) -> None:
        if self.recorder is None:
            self._capture_note = "replay: nothing to capture (captures are taken live)"
            self.notify("This is a replay: captures are taken live, with `kdash attach`.")
            self._update_status()
            # An answer to the key, not a state: it gives the one line back to the window.
            if self._capture_note_timer is not None:
                self._capture_note_timer.stop()
            self._capture_note_timer = self.set_timer(REPLAY_NOTE_S, self._clear_capture_note)
            return
        if not self.recorder.trigger_capture():
            self.notify("a capture is already being recorded or written", severity="warning")
        self._start_server_job()
        self._update_status()

    def _clear_capture_note(self) -> None:
        self._capture_note = ""
        self._capture_note_timer = None
        self._update_status()

    def action_capture_via_server(self) -> None:
        """`C`: capture through the server's own profiler even when kdash's agents are in
        the schedulers (they are switched off for it and back on after)."""
        if self.recorder is None or not hasattr(self.recorder, "run_server_job"):
            self.action_capture()
            return
        if not self.recorder.trigger_capture(via_server=True):
            self.notify("a capture is already being recorded or written", severity="warning")
        self._start_server_job()
        self._update_status()

    def _start_server_job(self) -> None:
        job = getattr(self.recorder, "server_job", None)
        if job is not None and self.recorder is not None and job.seq == self.recorder.capture.seq:
            self._run_server_job(job)

    @work(thread=True, exit_on_error=False, name="server-capture", group="server-capture")
    def _run_server_job(self, job) -> None:
        """/start_profile and the wait for every rank's trace: seconds to a minute of
        blocking HTTP and file polling, so a thread worker (the recorder's writer waits for it)."""
        run = getattr(self.recorder, "run_server_job", None)
        if run is not None:
            run(job)

    def action_pause(self) -> None:
        self.paused = not self.paused
        self._frozen_ns = clock.now_ns() if self.paused else None
        if not self.paused:
            self._dirty = True
            self._redraw()
        self._update_status()

    def action_next_theme(self) -> None:
        names = available_themes()
        nxt = (
            names[(names.index(self.kd_theme) + 1) % len(names)]
            if self.kd_theme in names
            else names[0]
        )
        self.set_theme(nxt)
        self.config.theme = nxt
        try:
            save_config(self.config)
        except UserError as e:
            self.notify(str(e), severity="error")
        else:
            self.notify(f"theme: {nxt} (saved)", timeout=2)

    def set_theme(self, name: str) -> None:
        """Switch palette and the App class that scopes the theme's tcss rules."""
        name = resolve_theme(name)
        self.remove_class(f"theme-{self.kd_theme}")
        self.kd_theme = name
        self.add_class(f"theme-{name}")
        self.theme = PALETTES[name].name
        for pane in self.panes:
            pane.refresh()
        self._dirty = True
        self.call_after_refresh(self._view_changed)

    def action_cycle_pane(self, delta: int) -> None:
        """Move focus to the next pane; when one is maximised, maximise the next instead."""
        ids = list(self.PANE_IDS)
        current = self.maximized or self._focused_pane_id() or ids[0]
        nxt = ids[(ids.index(current) + delta) % len(ids)]
        if self.maximized is not None:
            self.action_maximize(nxt)
            return
        pane = self.main_query(f"#{nxt}").only_one(Pane)
        pane.focus_target().focus()

    def _focused_pane_id(self) -> str | None:
        node = self.focused
        while node is not None:
            if isinstance(node, Pane):
                return node.id
            node = node.parent
        return None

    def action_maximize(self, pane_id: str) -> None:
        self.maximized = pane_id
        self._apply_layout(self.size.width, self.size.height)
        self.main_query(f"#{pane_id}").only_one(Pane).focus_target().focus()
        self._view_changed()

    def action_restore(self) -> None:
        if self.maximized is None:
            return
        self.maximized = None
        self._apply_layout(self.size.width, self.size.height)
        self._view_changed()

    def action_pan(self, direction: int) -> None:
        step = self.window_s / 4
        hi = max(0.0, self._max_window_s() - self.window_s)
        self.offset_s = min(hi, max(0.0, self.offset_s - direction * step))
        self._view_changed()

    def action_zoom(self, factor: float) -> None:
        self.window_s = min(self._max_window_s(), max(MIN_WINDOW_S, self.window_s * factor))
        hi = max(0.0, self._max_window_s() - self.window_s)
        self.offset_s = min(self.offset_s, hi)
        self._view_changed()

    def action_reset_window(self) -> None:
        self.offset_s = 0.0
        self.window_s = self._max_window_s() if self.mode == "replay" else LIVE_WINDOW_S
        self._view_changed()

    def action_gpu_detail(self) -> None:
        for pane in self.main_query(ClockPane):
            pane.full_detail = not pane.full_detail
        self._view_changed()

    def action_pin_kernel(self) -> None:
        """`f`: the source pane shows the kernel under the kernel table's cursor (again: the
        hottest). The logic is the source pane's (`SourcePane.toggle_pin`)."""
        table = self.main_query(KernelPane).first().table
        kernel = None
        if table.row_count and table.cursor_row >= 0:
            # the row's key is its kernel's full name (the cell holds its label)
            kernel = str(table.coordinate_to_cell_key((table.cursor_row, 0)).row_key.value)
        for pane in self.main_query(SourcePane):
            known = kernel if kernel in pane.window_names else None
            self.notify(pane.toggle_pin(known), timeout=3)

    def agent_source(self):
        """The live agent tree source (anything with `set_continuous`), or None (replay)."""
        for src in getattr(self.recorder, "sources", None) or []:
            if getattr(src, "name", "") == "agent" and hasattr(src, "set_continuous"):
                return src
        return None

    def _agents_to_switch(self, what: str, setter: str):
        """The agent source when it has agents to switch (and `setter`), else None after
        saying in one line that there is nothing to switch."""
        src = self.agent_source()
        pids = src.active_pids() if src is not None else []
        if not pids or not hasattr(src, setter):
            self.notify(f"no kdash agent attached: {what} cannot be switched", timeout=4)
            return None, 0
        return src, len(pids)

    @work(thread=True, exit_on_error=False, name="agent-switch", group="agent-switch")
    def _switch_agents(self, src, setter: str, on: bool) -> None:
        """A socket write per agent under the source's lock (which a poll may hold): never on
        the UI thread. The status bar and the panes follow at once."""
        getattr(src, setter)(on)
        self.call_from_thread(self._update_status)
        self.call_from_thread(self.request_redraw, now=True)

    def _toggle_agents(self, what: str, setter: str, attr: str, texts: tuple[str, str]) -> None:
        """Flip the agent source's `attr` through `setter` for every agent; `texts` say the
        new state (on, off) in the notification."""
        src, n = self._agents_to_switch(what, setter)
        if src is None:
            return
        on = not bool(getattr(src, attr, False))
        self._switch_agents(src, setter, on)
        self.notify(f"{what}: {texts[0] if on else texts[1]} in {n} process(es)", timeout=4)

    def action_toggle_activity(self) -> None:
        """`a`: every attached agent between its duty cycle and continuous kernel activity.

        Continuous shows every kernel but cost a graph-replayed decode loop ~20% on the H200,
        so it is the user's explicit choice, and the status bar's cost estimate follows it.
        """
        texts = ("continuous (every kernel; costs the target more)", "duty-cycled")
        self._toggle_agents("kernel activity", "set_continuous", "continuous", texts)

    def action_toggle_pc_sampling(self) -> None:
        """`L`: PC-sampling ranges in every attached agent on or off (issue 5).

        Off by default: each range pauses kernel activity (CUPTI refuses both at once), and its
        Stop decodes the samples with the target's GIL held (a range's CUPTI calls from a
        second thread hung the target otherwise, on the H200); the source pane shows the state
        and the reason when sampling cannot run.
        """
        texts = ("on (200 ms ranges every 2 s)", "off")
        self._toggle_agents("PC sampling", "set_pc_sampling", "pc_sampling", texts)

    def action_help(self) -> None:
        if isinstance(self.screen, HelpScreen):
            self.pop_screen()
            return
        keys = list(self.BINDINGS)
        if self.sglang:  # beside 1-4, so the help shows "1 2 3 4 5" on one row
            at = next(i for i, b in enumerate(keys) if b.key == "4") + 1
            keys[at:at] = self.SGLANG_BINDINGS[:1]
            keys.insert(1, self.SGLANG_BINDINGS[1])
        if self.mode == "live":  # after `f`, with the other keys about the kernels
            at = next(i for i, b in enumerate(keys) if b.key == "f") + 1
            keys[at:at] = self.LIVE_BINDINGS
        # The source pane's own keys (active while it has focus) belong in the list too.
        keys += [b for b in KernelPane.BINDINGS if isinstance(b, Binding)]
        keys += [b for b in SourcePane.BINDINGS if isinstance(b, Binding) and b.key in "nNs"]
        self.push_screen(
            HelpScreen(keys, self.mode, {k: str(h) for k, h in self.status_info().sources.items()})
        )

    async def action_quit(self) -> None:
        self._stop_recorder()
        self.exit()
