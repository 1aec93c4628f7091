"""Source pane: the hottest kernel's source, its hot lines and their stall reasons.

What it shows, for the kernel with the most GPU time in the window (or the one pinned from the
kernel table with `f`):

- a header: the kernel, its share of GPU time, the file and line, "following" or "pinned";
- the source around the selected line (centred, because a stall is charged to the instruction
  that waits, the consumer of a load or the one after a barrier, so the cause is often a
  neighbour), syntax-highlighted (rich `Syntax`, the file read from
  disk once and cached by mtime), with a heat gutter (the line's share of the kernel's PC
  samples and a shade relative to the hottest line) and `▶` on the selected line, centred;
- the selected line's stall reasons as a ranked bar list with their meanings in plain words
  (`_not_issued` forms are subsets and never added in: see kdash.cubin).

`up`/`down` move the selection line by line, `n`/`N` jump to the next/previous hot line, `s`
toggles the SASS view (every instruction with the same heat), `f` (an app key, so it also works
from the kernel table) pins the kernel selected in the table, or unpins.

Where the lines come from: the capture's / the store's `source_lines` table (line tables made
from the cubins, kdash.cubin) joined with `pc_samples`. Without samples the pane still shows the
kernel's source with its definition line marked, from a line table if there is one, else from
the `@triton.jit` functions found by name (kdash.triton_index): the project's own kernels always,
folders in $KDASH_SOURCE_PATH, and, live, the target's site-packages (scanned once in a thread
worker: seconds for a large environment). One line then says why there are no line samples,
from the sources' health (no agent, PC sampling off, ERR_NVGPUCTRPERM, another profiler).
A source file that changed since the line table was made is flagged in the header.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
from kdash.collectors.base import Health, as_health, is_pc_part
from rich.style import Style
from rich.syntax import Syntax
from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import Static

from kdash import cubin, schema
from kdash import triton_index as ti
from kdash.analyses.kernels import short_name
from kdash.names import short_names, symbols_of

from .base import Pane, View

NO_SAMPLES = (
    "Source: no kernel data — the hottest kernel's source shows here once the agent records "
    "kernels (`kdash run -- CMD`)"
)
HOTTEST_EVERY_S = 1.0
FOLLOW_CANDIDATES = 12  # how far down the hot list the pane looks for a kernel with source
STALL_ROWS = 4  # bars under the code, when the pane has the room
SHADES = " ░▒▓█"


# -- reading and highlighting source files, cached ---------------------------------------------
@dataclass
class _SourceFile:
    mtime_ns: int
    plain: list[str]
    styled: dict[str, list[Text]] = field(default_factory=dict)  # syntax theme -> lines


_FILES: dict[str, _SourceFile] = {}


def read_source(path: str) -> _SourceFile | None:
    """A source file's lines, cached until its mtime changes; None when unreadable."""
    try:
        st = os.stat(path)
        hit = _FILES.get(path)
        if hit is not None and hit.mtime_ns == st.st_mtime_ns:
            return hit
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    sf = _SourceFile(st.st_mtime_ns, text.splitlines())
    _FILES[path] = sf
    return sf


_CARRIED: dict[str, _SourceFile] = {}  # sha256 -> a file's text carried in the data


def carried_source(store, path: str, sha: str = "") -> _SourceFile | None:
    """The text of `path` carried in the data (`source_files`: as it was when its line table
    was made), the version with hash `sha` when given; None when the data has none."""
    b = store.get("source_files")
    if not len(b["file"]):
        return None
    idx = [i for i in range(len(b["file"])) if b["file"][i] == path]
    if sha:
        idx = [i for i in idx if b["sha256"][i] == sha] or idx
    if not idx:
        return None
    i = idx[-1]
    key = str(b["sha256"][i])
    if key not in _CARRIED:
        _CARRIED[key] = _SourceFile(-1, str(b["text"][i]).splitlines())
    return _CARRIED[key]


def styled_lines(sf: _SourceFile, path: str, theme: str | None) -> list[Text]:
    """The file's lines highlighted once per theme (`None`: plain, for the mono theme)."""
    key = theme or ""
    if key not in sf.styled:
        code = "\n".join(sf.plain)
        if theme is None:
            lines = [Text(s) for s in sf.plain]
        else:
            lexer = Syntax.guess_lexer(path, code)
            hl = Syntax(code, lexer, theme=theme).highlight(code)
            lines = list(hl.split("\n", allow_blank=True))
        sf.styled[key] = lines[: len(sf.plain)] + [Text("")] * max(0, len(sf.plain) - len(lines))
    return sf.styled[key]


# -- where a kernel's source is ------------------------------------------------------------------
_INDEXES: dict[str, ti.TritonIndex] = {}


def project_index() -> ti.TritonIndex:
    """The `@triton.jit` functions of the project's own kernels (and $KDASH_SOURCE_PATH)."""
    key = "project:" + os.environ.get("KDASH_SOURCE_PATH", "")
    if key not in _INDEXES:
        import kdash.kernels

        idx = ti.scan(Path(kdash.kernels.__file__).parent)
        for root in filter(None, os.environ.get("KDASH_SOURCE_PATH", "").split(os.pathsep)):
            if os.path.exists(root):
                idx.functions.extend(ti.scan(root).functions)
        idx.__dict__.pop("by_name", None)
        _INDEXES[key] = idx
    return _INDEXES[key]


def why_no_samples(health: Mapping[str, Health | str]) -> str:
    """One line: why this window has no PC samples, from the sources' health."""
    pcs = next((as_health(v, k) for k, v in health.items() if is_pc_part(k)), None)
    agent = health.get("agent")
    if pcs is not None:
        if pcs.code == "pc_unavailable_perm":
            return (
                "no line samples: profiling counters are restricted to admins (ERR_NVGPUCTRPERM)"
                " — run the target as root, or set NVreg_RestrictProfilingToAdminUsers=0"
            )
        if pcs.code == "pc_unavailable_other_client":
            return f"no line samples: another profiler holds the counters ({pcs})"
        if pcs.code == "pc_on":
            return "no line samples for this kernel in the window yet (PC sampling is on)"
        if pcs.code == "pc_starting":
            return "no line samples yet: PC sampling is starting (first range within ~2 s)"
        if pcs.code == "pc_off":
            return "no line samples: PC sampling was off (live: press L to turn it on)"
        return f"no line samples: PC sampling {pcs}"
    # an agent that left kernel activity off in a graph process is there: PC sampling works
    if agent is None or as_health(agent, "agent").trouble:
        why = f" ({agent})" if agent is not None and str(agent) else ""
        return (
            f"no line samples: no in-process agent{why} — start the target with `kdash run -- CMD`"
        )
    return "no line samples: PC sampling was off (live: press L to turn it on)"


@dataclass
class Located:
    """A kernel's source: the file, the definition line, and how it was found."""

    file: str
    def_line: int
    end_line: int
    how: str  # "line table" | "found by name in …"


# -- the pane ------------------------------------------------------------------------------------
class SourcePane(Pane):
    key = "4"
    title = "Source"
    waiting = NO_SAMPLES
    COMPONENT_CLASSES = {
        "source-pane--heat",
        "source-pane--selected",
        "source-pane--note",
        "source-pane--bar",
        "source-pane--header",
        "source-pane--flag",
    }
    DEFAULT_CSS = """
    SourcePane > .source-pane--heat { color: $warning; }
    SourcePane > .source-pane--selected { background: $accent 20%; text-style: bold; }
    SourcePane > .source-pane--note { color: $text-muted; text-style: italic; }
    SourcePane > .source-pane--bar { color: $error; }
    SourcePane > .source-pane--header { text-style: bold; }
    SourcePane > .source-pane--flag { color: $error; text-style: bold; }
    SourcePane > .source-body { height: auto; text-wrap: nowrap; text-overflow: ellipsis; }
    """
    BINDINGS = [
        Binding("up", "move(-1)", "source: previous line", show=False),
        Binding("down", "move(1)", "source: next line", show=False),
        Binding("n", "next_hot(1)", "source: next hot line", show=False),
        Binding("N", "next_hot(-1)", "source: previous hot line", show=False),
        Binding("s", "toggle_sass", "source: SASS view / source view", show=False),
        Binding("pageup", "page(-1)", "source: a page up", show=False),
        Binding("pagedown", "page(1)", "source: a page down", show=False),
    ]

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.body = Static("", classes="source-body", markup=False)
        self.pinned: str | None = None
        self.sass_mode = False
        self._pc_view = False  # the shown kernel has samples but no line table: PCs only
        self.kernel: str | None = None  # the kernel shown
        self.skipped: tuple[str, float] | None = None  # a hotter kernel without source
        self._symbols: dict[str, str] = {}  # demangled name -> symbol
        self._symbols_rows = -1
        self._follow_key: tuple = ()
        self._follow: str | None = None
        self.window_names: list[str] = []  # kernels in the window, hottest first
        self._selected: dict[tuple[str, bool], int] = {}  # (kernel, sass) -> line / row
        self._hot_key: tuple = ()
        self._hot: pd.DataFrame | None = None
        self._hot_at = 0.0
        self._tables_rows = -1
        self._tables: list[cubin.LineTable] = []
        self._live_index: ti.TritonIndex | None = None
        self._live_index_pid: int | None = None
        self._last_view: View | None = None
        # what the last redraw drew, for the keys
        self._hot_rows: list[int] = []  # hot lines (or SASS rows), hottest first
        self._n_rows = 0

    def compose(self) -> ComposeResult:
        yield self.empty_line
        yield self.body

    # -- data -------------------------------------------------------------------------------
    def _hottest(self, view: View, batch: dict[str, np.ndarray]) -> pd.DataFrame:
        """GPU time per kernel name in the window, hottest first.

        Cached per window in a replay; live, recomputed at most once a second (factorize +
        bincount: tens of ms at 100k kernels, too much for every 2 Hz redraw on the UI thread).
        """
        key = (view.since_ns, view.until_ns, len(batch["start_ns"]))
        now = time.monotonic()
        fresh = view.mode == "live" and now - self._hot_at < HOTTEST_EVERY_S
        if self._hot is None or (key != self._hot_key and not fresh):
            dur = np.clip(batch["end_ns"] - batch["start_ns"], 0, None).astype(np.float64)
            codes, names = pd.factorize(batch["name"])
            tot = np.bincount(codes, weights=dur, minlength=len(names)) if len(codes) else dur
            order = np.argsort(-tot, kind="stable")
            self._hot = pd.DataFrame({"name": np.asarray(names)[order], "ns": tot[order]})
            self._hot["pct"] = 100.0 * self._hot["ns"] / (float(self._hot["ns"].sum()) or 1.0)
            self._hot_key, self._hot_at = key, now
        return self._hot

    def _line_tables(self, view: View) -> list[cubin.LineTable]:
        n = view.store.stats()["source_lines"]["total"]
        if n != self._tables_rows:
            frame = schema.to_frame("source_lines", view.store.get("source_lines"))
            self._tables = cubin.from_frame(frame)
            self._tables_rows = n
        return self._tables

    def _names_of(self, view: View, kernel: str) -> list[str]:
        """`kernel` and the symbol it was recorded under (`kernel_symbols`), for the samples."""
        b = view.store.get("kernel_symbols")
        if len(b["name"]) != self._symbols_rows:
            self._symbols, self._symbols_rows = symbols_of(b), len(b["name"])
        m = self._symbols.get(kernel)
        return [kernel, m] if m else [kernel]

    def _readable_among(self, view: View) -> str | None:
        """The hottest kernel after the first that has source, looked for once per window,
        line tables and index (each look reads the window's kernels: too much per redraw)."""
        key = (self._hot_key, self._tables_rows, id(self._live_index))
        if key != self._follow_key:
            self._follow_key, self._follow = key, None
            for name in self.window_names[1:FOLLOW_CANDIDATES]:
                lt = cubin.table_for_kernel(self._line_tables(view), name)
                if _readable(lt, self._locate(name, lt, view)):
                    self._follow = name
                    break
        return self._follow

    def _locate(self, kernel: str, lt: cubin.LineTable | None, view: View) -> Located | None:
        if lt is not None and lt.has_lines:
            d = lt.definition_line(kernel)
            if d is not None:
                lines = [i.line for i in lt.instrs if i.function == kernel and i.file == d[0]]
                return Located(d[0], min(lines), max(lines), "line table")
        shape = self._launch_shape(view, kernel)
        for idx in (self._live_index, project_index()):
            if idx is None:
                continue
            ranked = idx.resolve(kernel, block=shape[:3], grid=shape[3:]) if shape else []
            ranked = ranked or idx.resolve(kernel)
            if ranked:
                f = ranked[0].function
                how = f"found by name in {f.module}"
                if len(ranked) > 1 and ranked[0].score == ranked[1].score:
                    how += f" (1 of {len(ranked)} same-named)"
                return Located(f.file, f.line, f.end_line, how)
        return None

    @staticmethod
    def _launch_shape(view: View, kernel: str) -> tuple[int, ...] | None:
        b = view.store.get("kernels", view.since_ns, view.until_ns)
        idx = np.nonzero(b["name"] == kernel)[0]
        if not len(idx):
            return None
        i = idx[-1]
        cols = ("block_x", "block_y", "block_z", "grid_x", "grid_y", "grid_z")
        return tuple(int(b[c][i]) for c in cols)

    def _maybe_scan_live(self, view: View) -> None:
        """Live: index the target's site-packages once, off the UI thread."""
        if view.mode != "live":
            return
        pid = view.target_pid
        if pid is not None and pid != self._live_index_pid:
            self._live_index_pid = pid
            self._scan_live(pid)

    @work(thread=True, exclusive=True, exit_on_error=False, group="source-index")
    def _scan_live(self, pid: int) -> None:
        idx = ti.TritonIndex(root=f"pid {pid}")
        for root in ti.site_packages_of_pid(pid):
            idx.functions.extend(ti.scan(root).functions)
        self.app.call_from_thread(self._apply_live_index, idx)

    def _apply_live_index(self, idx: ti.TritonIndex) -> None:
        self._live_index = idx
        request = getattr(self.app, "request_redraw", None)
        if request is not None:
            request(now=True)

    # -- drawing ----------------------------------------------------------------------------
    def show(self, view: View) -> None:
        self._last_view = view
        batch = view.store.get("kernels", view.since_ns, view.until_ns)
        pcs = view.store.get("pc_samples", view.since_ns, view.until_ns)
        if len(batch["start_ns"]) == 0 and len(pcs["t_ns"]) == 0:
            self.set_empty(NO_SAMPLES)
            return
        self._maybe_scan_live(view)
        hot = self._hottest(view, batch)
        self.window_names = [str(n) for n in hot["name"]]
        samples = schema.to_frame("pc_samples", pcs)
        if hot.empty:  # samples but no kernel records: the most-sampled kernel
            real = samples[~samples["stall_reason"].str.endswith("_not_issued")]
            hot = real.groupby("kernel")["count"].sum().sort_values(ascending=False)
            hot = pd.DataFrame({"name": hot.index, "ns": 0.0, "pct": float("nan")})
        kernel = self.pinned or str(hot["name"].iloc[0])
        lt = cubin.table_for_kernel(self._line_tables(view), kernel)
        loc = self._locate(kernel, lt, view)
        skipped: tuple[str, float] | None = None
        if not self.pinned and not _readable(lt, loc):
            # follow what can be read: the hottest kernel that has source, saying so
            name = self._readable_among(view)
            if name is not None:
                skipped = (kernel, _pct_of(hot, kernel))
                kernel = name
                lt = cubin.table_for_kernel(self._line_tables(view), kernel)
                loc = self._locate(kernel, lt, view)
        self.kernel = kernel
        self.skipped = skipped
        pct = _pct_of(hot, kernel)
        # kernel records carry demangled names, PC samples the symbol CUPTI gave them
        ks = samples[samples["kernel"].isin(self._names_of(view, kernel))]
        if len(ks) and (ks["kernel"] != kernel).any():
            ks = ks.assign(kernel=kernel)  # one name for the analyses that select by it
        self._pc_view = False
        if loc is None and (lt is None or not lt.instrs):
            if ks.empty:
                self.set_empty(
                    f"Source: {short_name(kernel, 40)} ({_pct(pct)} of GPU time) — no source "
                    "here: not a Triton kernel found on this machine and no line table in the "
                    f"data · {why_no_samples(view.health_data())}"
                )
                return
            # Samples but nothing to map them to: where in the kernel they fall, by PC.
            self.set_empty(None)
            self._pc_view = True
            height = max(4, (self.content_region.height or 16))
            self.body.update(self._draw_pcs(kernel, pct, ks, height))
            return
        self.set_empty(None)
        height = max(4, (self.content_region.height or 16))
        width = max(20, (self.content_region.width or 80))
        if self.sass_mode and lt is not None and lt.instrs:
            out = self._draw_sass(view, kernel, pct, lt, ks, height, width)
        else:
            out = self._draw_source(view, kernel, pct, lt, loc, ks, height, width)
        self.body.update(out)

    def _header(self, kernel: str, pct: float, where: str, flag: str) -> Text:
        t = Text(no_wrap=True, overflow="ellipsis")
        if self.skipped is not None:
            name, p = self.skipped
            t.append(f"{short_name(name, 28)} {_pct(p)} (no source) · showing ")
        t.append(short_name(kernel, 36), self.get_component_rich_style("source-pane--header"))
        t.append(f" · {_pct(pct)} GPU · {where} · ")
        if self.pinned:
            t.append("pinned (f: follow)")
        else:
            t.append("hottest with source (f: pin)" if self.skipped else "hottest (f: pin)")
        if flag:
            t.append(" · " + flag, self.get_component_rich_style("source-pane--flag"))
        return t

    def _theme(self) -> str | None:
        kd = getattr(self.app, "kd_theme", "dark")
        if kd == "mono":
            return None
        return "ansi_light" if kd == "light" else "ansi_dark"

    def _draw_source(
        self,
        view: View,
        kernel: str,
        pct: float,
        lt: cubin.LineTable | None,
        loc: Located | None,
        ks: pd.DataFrame,
        height: int,
        width: int,
    ) -> Text:
        note_style = self.get_component_rich_style("source-pane--note")
        heat = cubin.hot_lines(ks, lt) if lt is not None and not ks.empty else pd.DataFrame()
        file = loc.file if loc is not None else ""
        if not heat.empty:
            heat = heat[heat["file"] == file] if file else heat
        shares = dict(zip(heat.get("line", []), heat.get("share", []), strict=False))
        counts = dict(zip(heat.get("line", []), heat.get("samples", []), strict=False))
        self._hot_rows = [int(x) for x in heat.get("line", []) if int(x) > 0]
        sf, flag = self._source_for(view, file, lt)
        n_lines = len(sf.plain) if sf is not None else 0
        self._n_rows = n_lines
        default = self._hot_rows[0] if self._hot_rows else (loc.def_line if loc else 1)
        sel = self._selected.setdefault((kernel, False), default)
        sel = min(max(1, sel), max(1, n_lines))
        self._selected[(kernel, False)] = sel
        where = f"{Path(file).name}:{sel}" if file else "no file"
        out = Text(no_wrap=True, overflow="ellipsis")
        out.append_text(self._header(kernel, pct, where, flag))
        # the bottom block: stall bars for the selected line, or why there are none
        bottom: list[Text] = []
        if heat.empty:
            why = (
                why_no_samples(view.health_data()) if ks.empty else (lt.no_lines_hint if lt else "")
            )
            if ks.empty and loc is not None:
                why += f" · definition line {loc.def_line} marked ({loc.how})"
            bottom.append(Text(why, style=note_style, no_wrap=True, overflow="ellipsis"))
        else:
            bottom.extend(self._stall_block(ks, lt, file, sel, counts, shares, height))
        code_h = max(1, height - 1 - len(bottom))
        if sf is not None:
            lines = styled_lines(sf, file, self._theme())
            # Hot line centred; without heat the definition near the top (the body below it).
            first = sel - code_h // 2 if not heat.empty else sel - min(2, code_h // 4)
            top = min(max(1, first), max(1, n_lines - code_h + 1))
            vmax = max(shares.values()) if shares else 0.0
            for ln in range(top, min(n_lines, top + code_h - 1) + 1):
                out.append("\n")
                out.append_text(
                    self._code_row(
                        ln, lines[ln - 1], shares.get(ln, 0.0), vmax, ln == sel, loc, heat.empty
                    )
                )
        else:
            out.append("\n")
            out.append("(source not available on this machine)", note_style)
        for b in bottom:
            out.append("\n")
            out.append_text(b)
        return out

    @staticmethod
    def _source_for(
        view: View, file: str, lt: cubin.LineTable | None
    ) -> tuple[_SourceFile | None, str]:
        """The file's text and a header flag: the file on disk when it is the one the line
        table was made from, else the copy carried in the data, else what is on disk with a
        warning that lines may not match."""
        if not file:
            return None, ""
        disk = read_source(file)
        st = cubin.source_status(lt).get(file, "ok") if lt is not None else "ok"
        if disk is not None and st == "ok":
            return disk, ""
        sha = lt.file_sha256.get(file, "") if lt is not None else ""
        carried = carried_source(view.store, file, sha)
        if carried is not None:
            return carried, "" if disk is None else "as captured (the file here has changed)"
        if disk is not None:
            return disk, f"source {st}: lines may not match"
        return None, "source file not readable here"

    def _code_row(
        self,
        ln: int,
        code: Text,
        share: float,
        vmax: float,
        selected: bool,
        loc: Located | None,
        no_heat: bool,
    ) -> Text:
        heat_style = self.get_component_rich_style("source-pane--heat")
        row = Text(no_wrap=True, overflow="ellipsis")
        append_heat(row, share, vmax, heat_style)
        mark = "▶" if selected else ("·" if no_heat and loc and ln == loc.def_line else " ")
        row.append(f"{ln:5d} {mark} ")
        row.append_text(code)
        if selected:
            row.stylize(self.get_component_rich_style("source-pane--selected"))
        return row

    def _stall_block(
        self,
        ks: pd.DataFrame,
        lt: cubin.LineTable | None,
        file: str,
        line: int,
        counts: dict,
        shares: dict,
        height: int,
    ) -> list[Text]:
        note_style = self.get_component_rich_style("source-pane--note")
        bar_style = self.get_component_rich_style("source-pane--bar")
        n = int(counts.get(line, 0))
        head = Text(no_wrap=True, overflow="ellipsis")
        if n == 0:
            head.append(f"line {line}: no samples (n/N: hot lines)", note_style)
            return [head]
        share = float(shares.get(line, 0.0))
        head.append(f"line {line}: {n} samples, {_share(share)} of the kernel's", note_style)
        rows = [head]
        st = cubin.line_stalls(ks, lt, file, line) if lt is not None else pd.DataFrame()
        room = max(0, min(STALL_ROWS, (height - 6) // 3))
        if room == 0 and not st.empty:  # a short pane (80x24): the top reasons on the line itself
            top = ", ".join(
                f"{str(r.reason)[:18]} {100 * float(r.share):.0f}%"
                for r in st.head(2).itertuples(index=False)
            )
            head.append(f" · {top}", bar_style)
        for r in st.head(room).itertuples(index=False):
            t = Text(no_wrap=True, overflow="ellipsis")
            filled = round(10 * float(r.share))
            t.append(f"  {str(r.reason)[:18]:<18} ")
            t.append("█" * filled + "░" * (10 - filled), bar_style)
            t.append(f" {100 * float(r.share):3.0f}%  ")
            t.append(str(r.meaning), note_style)
            rows.append(t)
        return rows

    def _draw_sass(
        self,
        view: View,
        kernel: str,
        pct: float,
        lt: cubin.LineTable,
        ks: pd.DataFrame,
        height: int,
        width: int,
    ) -> Text:
        heat_style = self.get_component_rich_style("source-pane--heat")
        note_style = self.get_component_rich_style("source-pane--note")
        sel_style = self.get_component_rich_style("source-pane--selected")
        h = cubin.sass_heat(ks, lt)
        h = h[h["kernel"] == kernel].reset_index(drop=True)
        sel = self._select_row(kernel, h, hot_only=True)
        cur = h.iloc[sel - 1] if len(h) else None
        where = f"SASS +0x{int(cur['pc_offset']):x}" if cur is not None else "SASS"
        out = Text(no_wrap=True, overflow="ellipsis")
        out.append_text(self._header(kernel, pct, where, lt.no_lines_hint and "no line info"))
        foot = Text(no_wrap=True, overflow="ellipsis")
        if ks.empty:
            foot.append(why_no_samples(view.health_data()), note_style)
        elif cur is not None and cur["samples"] > 0:
            foot.append(
                f"+0x{int(cur['pc_offset']):x}: {int(cur['samples'])} samples, "
                f"{_share(float(cur['share']))} · {cur['top_stalls']}",
                note_style,
            )
        else:
            foot.append("no samples on this instruction (n/N: hot instructions)", note_style)
        code_h = max(1, height - 2)
        top = scroll_top(sel, len(h), code_h)
        vmax = float(h["share"].max()) if len(h) else 0.0
        for i in range(top, min(len(h), top + code_h - 1) + 1):
            r = h.iloc[i - 1]
            row = Text(no_wrap=True, overflow="ellipsis")
            append_heat(row, float(r["share"]), vmax, heat_style, " ")
            row.append(f"{int(r['pc_offset']):05x} {'▶' if i == sel else ' '} ")
            src = f"{Path(str(r['file'])).name}:{int(r['line'])}" if r["file"] else ""
            row.append(f"{str(r['sass']):<44} ")
            row.append(src, note_style)
            if i == sel:
                row.stylize(sel_style)
            out.append("\n")
            out.append_text(row)
        out.append("\n")
        out.append_text(foot)
        return out

    def _select_row(self, kernel: str, h: pd.DataFrame, hot_only: bool) -> int:
        """The selected row (1-based) of the SASS or PC view of `kernel`, hottest first by
        default; also sets the rows n/N walk (`hot_only`: rows with samples)."""
        self._n_rows = len(h)
        order = h.sort_values("samples", ascending=False, kind="stable")
        hot = order.index[order["samples"] > 0] if hot_only else order.index
        self._hot_rows = [int(i) + 1 for i in hot]
        sel = self._selected.setdefault((kernel, True), self._hot_rows[0] if self._hot_rows else 1)
        sel = min(max(1, sel), max(1, len(h)))
        self._selected[(kernel, True)] = sel
        return sel

    def _draw_pcs(self, kernel: str, pct: float, ks: pd.DataFrame, height: int) -> Text:
        """A kernel with samples but no cubin: its sampled PCs in order, with heat and stalls
        (the SASS view without the instruction text), and why there is no text."""
        heat_style = self.get_component_rich_style("source-pane--heat")
        note_style = self.get_component_rich_style("source-pane--note")
        sel_style = self.get_component_rich_style("source-pane--selected")
        h = cubin.pc_heat(ks, kernel)
        sel = self._select_row(kernel, h, hot_only=False)
        cur = h.iloc[sel - 1]
        out = Text(no_wrap=True, overflow="ellipsis")
        out.append_text(self._header(kernel, pct, f"PC +0x{int(cur['pc_offset']):x}", ""))
        out.append("\n")
        out.append(cubin.NO_LINE_TABLE, note_style)
        code_h = max(1, height - 3)
        top = scroll_top(sel, len(h), code_h)
        vmax = float(h["share"].max())
        for i in range(top, min(len(h), top + code_h - 1) + 1):
            r = h.iloc[i - 1]
            row = Text(no_wrap=True, overflow="ellipsis")
            append_heat(row, float(r["share"]), vmax, heat_style, " ")
            row.append(f"+0x{int(r['pc_offset']):05x} {'▶' if i == sel else ' '} ")
            row.append(str(r["top_stalls"]), note_style)
            if i == sel:
                row.stylize(sel_style)
            out.append("\n")
            out.append_text(row)
        out.append("\n")
        out.append(
            f"+0x{int(cur['pc_offset']):x}: {int(cur['samples'])} samples, "
            f"{_share(float(cur['share']))} of the kernel's · n/N: hottest PCs",
            note_style,
        )
        return out

    # -- keys -------------------------------------------------------------------------------
    def _redraw(self) -> None:
        if self._last_view is not None:
            self.show(self._last_view)

    def _say(self, text: str) -> None:
        """A key that cannot act says why, in one short notification."""
        self.notify(text, timeout=4)

    def _sass_shown(self) -> bool:
        return self.sass_mode and self._sass_available()

    def _sass_available(self) -> bool:
        view = self._last_view
        if view is None or self.kernel is None:
            return False
        lt = cubin.table_for_kernel(self._line_tables(view), self.kernel)
        return lt is not None and bool(lt.instrs)

    def action_move(self, delta: int) -> None:
        if self.kernel is None:
            self._say("source pane: no kernel shown yet")
            return
        key = (self.kernel, self._sass_shown() or self._pc_view)
        cur = self._selected.get(key, 1)
        self._selected[key] = min(max(1, cur + delta), max(1, self._n_rows))
        self._redraw()

    def action_page(self, direction: int) -> None:
        self.action_move(direction * max(1, (self.content_region.height or 8) - 4))

    def action_next_hot(self, delta: int) -> None:
        if self.kernel is None:
            self._say("source pane: no kernel shown yet")
            return
        if not self._hot_rows:
            view = self._last_view
            why = why_no_samples(view.health_data()) if view is not None else "no data yet"
            self._say(f"no hot lines for {short_name(self.kernel, 30)}: {why}")
            return
        key = (self.kernel, self._sass_shown() or self._pc_view)
        cur = self._selected.get(key, self._hot_rows[0])
        i = self._hot_rows.index(cur) + delta if cur in self._hot_rows else 0
        self._selected[key] = self._hot_rows[i % len(self._hot_rows)]
        self._redraw()

    def action_toggle_sass(self) -> None:
        if not self.sass_mode and not self._sass_available():
            name = short_name(self.kernel, 30) if self.kernel else "this kernel"
            self._say(f"no SASS for {name}: the data holds no line table (cubin) for it")
            return
        self.sass_mode = not self.sass_mode
        self._redraw()

    def toggle_pin(self, kernel: str | None) -> str:
        """Pin `kernel` (unpin when it is already pinned or None); returns what happened."""
        if kernel is None or kernel == self.pinned:
            self.pinned = None
            msg = "source pane: following the hottest kernel"
        else:
            self.pinned = kernel
            msg = f"source pane: pinned {short_name(kernel, 40)}"
        self._redraw()
        return msg

    def kernel_for_table_row(self, cell: str) -> str | None:
        """The full kernel name behind a kernel-table label (the table's labels are
        `kdash.names.short_names(.., 40)` over the window's names)."""
        for name, label in short_names(self.window_names, 40).items():
            if label == cell:
                return name
        return None


def _readable(lt: cubin.LineTable | None, loc: Located | None) -> bool:
    """Whether a kernel has source to show: a line table with lines, or a file it was found in."""
    return loc is not None or (lt is not None and lt.has_lines)


def _pct_of(hot: pd.DataFrame, kernel: str) -> float:
    row = hot.loc[hot["name"] == kernel, "pct"]
    return float(row.iloc[0]) if len(row) else float("nan")


def _pct(p: float) -> str:
    return "n/a" if p != p else f"{p:.1f}%"


def _share(f: float) -> str:
    """A share of samples as a percentage; "<0.1%" rather than a misleading "0.0%"."""
    return "<0.1%" if 0 < f < 0.0005 else f"{100 * f:.1f}%"


def append_heat(row: Text, share: float, vmax: float, style: Style, gap: str = "") -> None:
    """The gutter of a line, an instruction or a PC: its share and a shade scaled to the
    hottest shown, in the heat style (blank, unstyled, when it has no samples)."""
    if share <= 0:
        row.append(" " * (7 + len(gap)))
        return
    shade = SHADES[min(4, max(1, round(4 * share / vmax)))] if vmax else " "
    row.append(f"{_share(share):>6}{shade}{gap}", style)


def scroll_top(sel: int, rows: int, height: int) -> int:
    """The first row (1-based) of a `height`-row view of `rows` that keeps `sel` centred."""
    return min(max(1, sel - height // 2), max(1, rows - height + 1))
