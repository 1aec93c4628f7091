"""The target's pid reaches the panes through the View (never through the recorder): the source
pane indexes the live target's site-packages for the pid the view names, and no pane module
reaches for the app's recorder or session."""

from __future__ import annotations

import os
import re
from pathlib import Path

from test_tui import wait_for

from kdash import triton_index as ti
from kdash.session import Recorder, RecorderOptions
from kdash.store import Store
from kdash.target import Target

PANES = Path(__file__).resolve().parents[1] / "tui" / "panes"


async def test_the_source_pane_indexes_the_pid_the_view_names(make_app, tmp_path, monkeypatch):
    """A live app over this process: the view carries its pid and the source pane's index is
    built for it. The site-packages roots are none here (scanning the venv, torch included,
    takes minutes on a 2-core machine); the index worker itself runs for real."""
    from kdash.tui.panes.source import SourcePane

    asked: list[int] = []

    def roots(pid: int) -> list[str]:
        asked.append(pid)
        return []

    monkeypatch.setattr(ti, "site_packages_of_pid", roots)
    target = Target.from_pid(os.getpid())
    store = Store(retention_s=30)
    rec = Recorder([], store, target, RecorderOptions(capture_dir=tmp_path))
    app = make_app(store=store, meta={"target": target.describe()}, mode="live", recorder=rec)
    async with app.run_test(size=(120, 40)) as pilot:
        view = app.build_view()
        assert view.target_pid == os.getpid()
        pane = app.query_one(SourcePane)
        pane._maybe_scan_live(view)
        assert await wait_for(pilot, lambda: pane._live_index is not None)
        assert pane._live_index.root == f"pid {os.getpid()}" and asked == [os.getpid()]
        await pilot.press("q")


def test_a_replay_view_names_no_pid(replay_app):
    assert replay_app.build_view().target_pid is None


def test_no_pane_reaches_the_recorder_or_the_session():
    pattern = re.compile(r"app\b[^\n]*\b(recorder|session)\b|\"(recorder|session)\"")
    found = [
        f"{p.name}:{n}: {line.strip()}"
        for p in sorted(PANES.glob("*.py"))
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert found == []
