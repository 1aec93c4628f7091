"""The in-process agent (runs inside the target) and its client source and wire format."""
