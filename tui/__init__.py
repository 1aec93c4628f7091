"""The Textual app: screens, panes, widgets. Reads the store; never polls a source itself."""
