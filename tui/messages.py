"""The recorder's events as Textual messages: the recorder calls back on its poll thread, and
the app posts one of these (`post_message` is thread-safe) to handle it on the UI thread."""

from __future__ import annotations

from textual.message import Message

from kdash.session import CaptureState


class RecorderMessage(Message):
    """Base of the recorder's events; posted from the poll thread, handled on the UI thread."""


class CaptureStarted(RecorderMessage):
    def __init__(self, state: CaptureState) -> None:
        super().__init__()
        self.state = state


class CaptureSaved(RecorderMessage):
    def __init__(self, state: CaptureState) -> None:
        super().__init__()
        self.state = state


class CaptureFailed(RecorderMessage):
    def __init__(self, state: CaptureState) -> None:
        super().__init__()
        self.state = state


class TargetExited(RecorderMessage):
    def __init__(self, pid: object) -> None:
        super().__init__()
        self.pid = pid


EVENT_MESSAGES: dict[str, type[RecorderMessage]] = {
    "capture-started": CaptureStarted,
    "capture-saved": CaptureSaved,
    "capture-failed": CaptureFailed,
    "target-exited": TargetExited,
}
