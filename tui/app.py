"""The kdash dashboard: four panes over the store, a status bar, hotkey captures, replay.

Construction (the CLI does this; tests do it too)::

    app = KdashApp(store, session=LiveSession(recorder), meta=meta, config=cfg, theme="dark")
    app.run()

The session (`kdash.session_control`) is what differs between live and replay; the app asks it
and does not branch on which it is (`recorder=` with `mode=` builds one, for callers that have a
recorder or none):

- live (`LiveSession`): `recorder.run_forever` runs in a Textual thread worker
  (`@work(thread=True)`), so polling never blocks the UI; the recorder's events (`on_event`,
  called on the poll thread) are turned into typed `Message`s and posted to the app
  (`post_message` is thread-safe). Quitting stops the recorder before the worker's thread is
  joined at exit.
- replay (`ReplaySession`): the store is pre-filled from a capture, the time axis is anchored
  at the capture's window (`meta["window"]`), and the title says "replay".

Redraw: a timer at `redraw_hz` (1 Hz by default: a slow SSH link carries it, and each
redraw of the tables is most of kdash's own CPU) rebuilds the
status bar and, unless paused, the visible panes; a replay redraws panes only when the view
changed (pan, zoom, theme, layout). Nothing is drawn on the poll thread, and panes hidden by a
maximised pane are not drawn at all.

Themes (palettes, theme files, the one to start with): `kdash.tui.theming`. The recorder's
events as messages: `kdash.tui.messages`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.notifications import SeverityLevel
from textual.timer import Timer
from textual.widgets import Header
from textual.worker import Worker, WorkerState

from kdash import clock
from kdash.config import Config, save_config
from kdash.errors import UserError
from kdash.session import Recorder
from kdash.session_control import (
    MIN_WINDOW_S,
    AgentToggle,
    SessionControl,
    activity_label,
    session_for,
    short_cmdline,
)
from kdash.store import Store

from .messages import EVENT_MESSAGES, CaptureFailed, CaptureSaved, CaptureStarted, TargetExited
from .panes.base import Pane, View
from .panes.clocks import ClockPane
from .panes.cpu import CpuPane
from .panes.kernels import KernelPane
from .panes.server import ServerPane
from .panes.source import SourcePane
from .theming import PALETTES, available_themes, default_theme, resolve_theme, theme_dir
from .widgets.fit import fit_words
from .widgets.help import HelpScreen
from .widgets.status import StatusBar, StatusInfo

# -- the app ----------------------------------------------------------------------------------
COMPACT_WIDTH = 110  # below this many columns (or COMPACT_HEIGHT rows) the panes stack
COMPACT_HEIGHT = 30
REPLAY_NOTE_S = 10.0  # how long a replay's bar answers `c` (its toast: Textual's default 5 s)
# Textual's Toast: 60 cells wide at most and half the screen, 2 of padding, a 1-cell border.
TOAST_WIDTH, TOAST_FRAME = 60, 3


def toast_text_width(screen_width: int) -> int:
    """The cells a toast's text has on a screen this wide (its CSS: width 60; max-width 50%)."""
    return max(1, min(TOAST_WIDTH, screen_width // 2) - TOAST_FRAME)


__all__ = ["KdashApp", "activity_label", "available_themes", "resolve_theme", "short_cmdline"]


class KdashApp(App[None]):
    """The dashboard. See the module docstring for live vs replay, redraw and themes."""

    CSS_PATH = [Path(__file__).with_name("app.tcss")] + [
        theme_dir() / f"{n}.tcss" for n in available_themes()
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
        recorder: Recorder | None = None,
        meta: dict | None = None,
        mode: str | None = None,
        *,
        config: Config,
        theme: str | None = None,
        redraw_hz: float = 1.0,
        title: str | None = None,
        session: SessionControl | None = None,
    ) -> None:
        """`session` says live or replay; without one, `mode` ("live" with its `recorder`,
        or "replay") builds it."""
        # Under NO_COLOR, native ANSI colours make Textual strip colour with its NoColor filter
        # (terminal default colours: readable); its Monochrome filter, chosen otherwise, maps
        # the mono theme's "default" colours to black on black.
        super().__init__(ansi_color=True if os.environ.get("NO_COLOR") else None)
        self.store = store
        self.meta = dict(meta or {})
        if session is None:
            session = session_for(recorder, mode or "", self.meta, store)
        self.session = session
        self.mode = session.mode
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
        self._columns_key: object = None  # what _update_columns last laid out for
        self._panes: list[Pane] = []  # all of PANE_IDS once mounted (never remounted)
        self._redraw_pending = False
        self.redraws = 0  # pane redraws done (tests and the perf check read it)
        self.last_redraw_ms = 0.0
        self.note = ""
        self._capture_note = ""
        self._capture_note_timer: Timer | None = None
        # Window: `window_s` long, ending `offset_s` before the session's end (now, live).
        self.window_s = session.default_window_s()
        self.offset_s = 0.0
        session.subscribe(self._on_recorder_event)

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
        if self._panes and all(p.is_attached for p in self._panes):
            return self._panes  # a DOM query per call was a good part of each redraw
        found = {p.id: p for p in self.main_query(Pane)}
        panes = [found[i] for i in self.PANE_IDS if i in found]
        self._panes = panes if len(panes) == len(self.PANE_IDS) else []
        return panes

    def on_mount(self) -> None:
        self.title, self.sub_title = self._titles()
        self._apply_layout(self.size.width, self.size.height)
        self._run_recorder()  # a replay's returns at once: it has nothing to poll
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
        if self.session.follows_now and not self.paused and not now:
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
        # Looked at on every redraw, changed rarely: the DOM queries and class switches are
        # done only when which panes are empty (or the compact layout) has changed.
        key = (self.compact, tuple(p.has_class("-empty") for p in self.panes))
        if key == self._columns_key:
            return
        self._columns_key = key
        any_empty = False
        for col in self.main_query(".column"):
            empty = all(p.has_class("-empty") for p in col.query(Pane))
            col.set_class(empty, "-all-empty")
            any_empty = any_empty or empty
        # Two columns only pay off when both have something to show; else stack them, so the
        # one-liners sit on top and the panes with data get the full width.
        self.set_class(self.compact or any_empty, "-stacked")

    def _titles(self) -> tuple[str, str]:
        return self.session.titles(self.meta, self._title_arg)

    # -- time window --------------------------------------------------------------------------
    def _anchor_end_ns(self) -> int:
        return self.session.end_ns(self._frozen_ns if self.paused else None)

    def _max_window_s(self) -> float:
        return self.session.max_window_s()

    def view_range(self) -> tuple[int, int]:
        end = self._anchor_end_ns() - int(self.offset_s * 1e9)
        start = end - int(self.window_s * 1e9)
        return start, end

    def build_view(self) -> View:
        since, until = self.view_range()
        anchor = self.session.anchor_ns(self._anchor_end_ns())
        healths = self.session.healths()
        sglang = None
        if self.sglang:  # live: GPU mapping refreshed from NVML's process list
            now = self.session.sglang_meta()
            sglang = self.meta.get("sglang") if now is None else now
        return View(
            store=self.store,
            since_ns=since,
            until_ns=until,
            mode=self.mode,
            anchor_ns=anchor,
            health={k: str(h) for k, h in healths.items()},
            healths=healths,
            findings=self.session.findings(),
            gpus=list(self.meta.get("gpus") or []),
            sglang=sglang,
            target_pid=self.session.target_pid(),
        )

    def window_label(self) -> str:
        since, until = self.view_range()
        return self.session.window_label(since, until, self.window_s, self.offset_s)

    # -- redraw -------------------------------------------------------------------------------
    def _tick(self) -> None:
        self._update_status()
        if self.paused:
            return
        if not self.session.follows_now and not self._dirty:
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
        pid = self.session.target_pid()
        if pid is not None:
            tgt = f"pid {pid} {short_cmdline(self.session.target_cmdline())}"
        else:
            tgt = f"pid {target.get('pid', '?')} {short_cmdline(str(target.get('cmdline') or ''))}"
        st = self.session.status(clock.now_ns())
        return StatusInfo(
            mode=self.mode,
            target=tgt.rstrip(),
            paused=self.paused,
            window=self.window_label(),
            note=self.note,
            # the session's capture state, else a replay's answer to `c`
            capture=st.capture or self._capture_note,
            capture_phase=st.capture_phase,
            capture_path=st.capture_path,
            sources=dict(st.sources),
            poll_ms=st.poll_ms,
            activity=st.activity,
            cost=st.cost,
            dropped=st.dropped,
        )

    # -- recorder worker and its events -------------------------------------------------------
    @work(thread=True, exit_on_error=False, name="recorder", group="recorder")
    def _run_recorder(self) -> None:
        self.session.run()

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
        self.session.stop()

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
        self._capture(via_server=False)

    def action_capture_via_server(self) -> None:
        """`C`: capture through the server's own profiler even when kdash's agents are in
        the schedulers (they are switched off for it and back on after); `c` where the
        session cannot."""
        self._capture(via_server=True)

    def _capture(self, via_server: bool) -> None:
        answer = self.session.capture(via_server)
        if answer.toast:
            self.notify(answer.toast, severity=answer.severity)  # type: ignore[arg-type]
        if answer.note:
            # An answer to the key, not a state: it gives the one line back to the window.
            self._capture_note = answer.note
            self._update_status()
            if self._capture_note_timer is not None:
                self._capture_note_timer.stop()
            self._capture_note_timer = self.set_timer(REPLAY_NOTE_S, self._clear_capture_note)
            return
        if answer.job is not None:
            self._run_server_job(answer.job)
        self._update_status()

    def _clear_capture_note(self) -> None:
        self._capture_note = ""
        self._capture_note_timer = None
        self._update_status()

    @work(thread=True, exit_on_error=False, name="server-capture", group="server-capture")
    def _run_server_job(self, job) -> None:
        """/start_profile and the wait for every rank's trace: seconds to a minute of
        blocking HTTP and file polling, so a thread worker (the recorder's writer waits for it)."""
        self.session.run_server_job(job)

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
        self.window_s = self.session.default_window_s()
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

    @work(thread=True, exit_on_error=False, name="agent-switch", group="agent-switch")
    def _switch_agents(self, toggle: AgentToggle, on: bool) -> None:
        """A socket write per agent under the source's lock (which a poll may hold): never on
        the UI thread. The status bar and the panes follow at once."""
        toggle.set(on)
        self.call_from_thread(self._update_status)
        self.call_from_thread(self.request_redraw, now=True)

    def _toggle_agents(self, what: str, toggle: AgentToggle | None, texts: tuple[str, str]) -> None:
        """Flip `toggle` for every attached agent; `texts` say the new state (on, off) in the
        notification. Without agents (none attached, a replay) say so in one line."""
        if toggle is None:
            self.notify(f"no kdash agent attached: {what} cannot be switched", timeout=4)
            return
        on = not toggle.on
        self._switch_agents(toggle, on)
        self.notify(
            f"{what}: {texts[0] if on else texts[1]} in {toggle.agents} process(es)", timeout=4
        )

    def action_toggle_activity(self) -> None:
        """`a`: every attached agent between its duty cycle and continuous kernel activity.

        Continuous shows every kernel but cost a graph-replayed decode loop ~20% on the H200,
        so it is the user's explicit choice, and the status bar's cost estimate follows it.
        """
        texts = ("continuous (every kernel; costs the target more)", "duty-cycled")
        self._toggle_agents("kernel activity", self.session.continuous_toggle(), texts)

    def action_toggle_pc_sampling(self) -> None:
        """`L`: PC-sampling ranges in every attached agent on or off.

        Off by default: each range pauses kernel activity (CUPTI refuses both at once), and its
        Stop decodes the samples with the target's GIL held (a range's CUPTI calls from a
        second thread hung the target otherwise, on the H200); the source pane shows the state
        and the reason when sampling cannot run.
        """
        texts = ("on (200 ms ranges, spaced to cost the target ≈5%)", "off")
        self._toggle_agents("PC sampling", self.session.pc_sampling_toggle(), texts)

    def action_help(self) -> None:
        if isinstance(self.screen, HelpScreen):
            self.pop_screen()
            return
        keys = list(self.BINDINGS)
        if self.sglang:  # beside 1-4, so the help shows "1 2 3 4 5" on one row
            at = next(i for i, b in enumerate(keys) if b.key == "4") + 1
            keys[at:at] = self.SGLANG_BINDINGS[:1]
            keys.insert(1, self.SGLANG_BINDINGS[1])
        if self.session.live:  # after `f`, with the other keys about the kernels
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
