"""The CPU pane's thread table between redraws: the same threads in the same order change only
their cells (no refill, which made Textual lay the screen out again every second); a new
thread, a changed order or a value wider than its column refills. Real capture (local-cpu)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from conftest import store_from_capture

from kdash.capture import load_capture

DATA = Path(__file__).resolve().parent / "data"


def _rows(cpu: list[float], tids: list[int], name: str = "python3") -> pd.DataFrame:
    n = len(tids)
    return pd.DataFrame(
        {
            "pid": [100] * n,
            "tid": tids,
            "name": [name] * n,
            "cpu_pct": cpu,
            "cpu": [1] * n,
            "allowed_cpus": ["0-1"] * n,
            "runq_ms_per_s": [0.0] * n,
            "sw_s": [10.0] * n,
            "mig_s": [0.0] * n,
        }
    )


async def test_same_threads_update_in_place_and_others_refill(make_app) -> None:
    cap = load_capture(DATA / "local-cpu.kdash")
    app = make_app(store=store_from_capture(cap), meta=dict(cap.meta), mode="replay")
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        pane = app.query_one("#cpu")
        table = pane.table
        pane._fill_table(_rows([50.0, 10.0], [100, 101]))
        table.move_cursor(row=1)
        calls: list[bool] = []
        real = pane._update_in_place

        def spy(cells):
            ok = real(cells)
            calls.append(ok)
            return ok

        pane._update_in_place = spy
        pane._fill_table(_rows([60.0, 12.0], [100, 101]))  # same threads: cells only
        assert calls[-1] is True
        assert [table.get_row_at(i)[3] for i in range(2)] == ["60", "12"]
        assert table.cursor_row == 1 and table.row_count == 2
        pane._fill_table(_rows([60.0, 12.0, 5.0], [100, 101, 102]))  # a new thread: refill
        assert calls[-1] is False and table.row_count == 3
        pane._fill_table(_rows([5.0, 60.0, 12.0], [102, 100, 101]))  # re-sorted: refill
        assert calls[-1] is False
        assert [table.get_row_at(i)[1] for i in range(3)] == ["102", "100", "101"]
        pane._fill_table(_rows([5.0, 60.0, 12.0], [102, 100, 101], "a-much-longer-nm"))
        assert calls[-1] is False  # wider than the column was: refill, which re-measures
        assert table.get_row_at(0)[2] == "a-much-longer-nm"
