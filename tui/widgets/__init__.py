"""Small building blocks of the dashboard: time-binned sparklines, the status bar, the help."""
