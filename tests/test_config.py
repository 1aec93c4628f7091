"""The config file keeps what its user wrote when kdash saves the theme (`t`)."""

from __future__ import annotations

import tomllib

from kdash.config import load_config, save_config

USER_FILE = """# my kdash settings: keep the mono theme on the shared box
theme = "mono"   # NO_COLOR terminals here

[thresholds]
# our scheduler threads wait a little by design
runq_ms_per_s = 20
min_duration_s = 2.0  # one slow poll is not a finding

[other]
left = "alone"
"""


def test_saving_the_theme_keeps_comments_order_and_unknown_keys(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text(USER_FILE)
    cfg = load_config(path)
    assert cfg.theme == "mono" and cfg.thresholds.runq_ms_per_s == 20.0
    cfg.theme = "light"
    save_config(cfg)
    text = path.read_text()
    assert "# my kdash settings: keep the mono theme on the shared box" in text
    assert "# our scheduler threads wait a little by design" in text
    assert "# one slow poll is not a finding" in text
    assert "runq_ms_per_s = 20\n" in text  # unchanged values stay as written
    assert 'left = "alone"' in text
    data = tomllib.loads(text)
    assert data["theme"] == "light" and data["other"] == {"left": "alone"}
    again = load_config(path)
    assert again.theme == "light" and again.thresholds.min_duration_s == 2.0
    assert again.warning == "" or "other" not in again.warning


def test_changed_thresholds_are_written_and_missing_ones_added(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text('theme = "dark"\n')
    cfg = load_config(path)
    cfg.thresholds.hot_thread_cpu_pct = 70.0
    save_config(cfg)
    data = tomllib.loads(path.read_text())
    assert data["thresholds"]["hot_thread_cpu_pct"] == 70.0
    assert data["thresholds"]["runq_ms_per_s"] == 5.0


def test_a_missing_or_broken_file_is_written_fresh(tmp_path):
    fresh = tmp_path / "a" / "config.toml"
    save_config(load_config(fresh))
    assert tomllib.loads(fresh.read_text())["theme"] == "dark"
    broken = tmp_path / "config.toml"
    broken.write_text("theme = = \n")
    cfg = load_config(broken)
    assert cfg.warning
    save_config(cfg)
    assert tomllib.loads(broken.read_text())["thresholds"]["sm_clock_ratio"] == 0.8
