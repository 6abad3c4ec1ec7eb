"""A progress line on stderr for inputs that take more than a moment to read (terminals only)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """``advance()`` per item; the line appears only after ``delay`` seconds and only on a terminal."""

    def __init__(self, total: int, label: str, stream: TextIO | None = None, delay: float = 1.0) -> None:
        self.total, self.label, self.done = total, label, 0
        self.stream = stream or sys.stderr
        self.started = time.monotonic()
        self.delay = delay
        self.shown = False

    def advance(self, items: int = 1) -> None:
        self.done += items
        if not self.stream.isatty() or time.monotonic() - self.started < self.delay:
            return
        width = 30
        filled = width * self.done // max(1, self.total)
        self.stream.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total}")
        self.stream.flush()
        self.shown = True

    def close(self) -> None:
        if self.shown:
            self.stream.write("\n")
            self.stream.flush()
