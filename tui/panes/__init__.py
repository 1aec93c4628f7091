"""The dashboard's panes: one module each, all read-only views over the store."""
