"""Data sources. One module per source; none imports Textual (they also run headless)."""
