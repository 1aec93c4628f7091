"""Analyses: pure functions from tables to tables, shared by the panes and `kdash report`."""
